"""Drafters: everything that can guess the target's next tokens, behind one interface."""

from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.drafters.hybrid import HybridConfig, LookupHybridDrafter
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
from specdec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from specdec.drafters.suffix import SuffixConfig, SuffixDrafter

__all__ = ["Commit", "Drafter", "Prompt", "HybridConfig", "LookupHybridDrafter", "ModelDrafter", "ModelDrafterConfig",
           "PromptLookupConfig", "PromptLookupDrafter", "SuffixConfig", "SuffixDrafter"]
