"""KV stores for speculative decoding."""

from specdec.kv.bmc import BlockInputs, BMCCache, BMCConfig
from specdec.kv.prefix import PrefixCache

__all__ = ["BlockInputs", "BMCCache", "BMCConfig", "PrefixCache"]
