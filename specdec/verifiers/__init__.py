"""Verifiers: decide which drafted tokens the target keeps."""

from specdec.verifiers.tree import Verification, accepted_mask, verify_greedy

__all__ = ["Verification", "accepted_mask", "verify_greedy"]
