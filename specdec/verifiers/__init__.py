"""Verifiers: decide which drafted tokens the target keeps."""

from specdec.verifiers.sampling import acceptance_probability, residual, verify_sampling
from specdec.verifiers.tree import Verification, accepted_mask, verify_greedy

__all__ = ["Verification", "acceptance_probability", "accepted_mask", "residual", "verify_greedy",
           "verify_sampling"]
