"""KV stores for speculative decoding."""

from specdec.kv.blocks import BlockInputs
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.kv.prefix import PrefixCache

__all__ = ["BlockInputs", "BMCCache", "BMCConfig", "PrefixCache"]
