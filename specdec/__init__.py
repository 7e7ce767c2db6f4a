"""specdec: lossless speculative decoding for HuggingFace causal language models."""

from specdec.decoder import GenerateOutput, SpecDecoder, SpecDecoderConfig, StepStats
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.kv.prefix import PrefixCache
from specdec.processing import Constraint

__all__ = ["Constraint", "PrefixCache", "GenerateOutput", "SpecDecoder", "SpecDecoderConfig", "StepStats", "ModelDrafter",
           "PromptLookupDrafter"]
__version__ = "0.1.0"
