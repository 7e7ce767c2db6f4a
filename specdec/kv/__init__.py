"""KV stores for speculative decoding."""

from specdec.kv.bmc import BlockInputs, BMCCache, BMCConfig

__all__ = ["BlockInputs", "BMCCache", "BMCConfig"]
