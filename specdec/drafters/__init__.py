"""Drafters: everything that can guess the target's next tokens, behind one interface (``base``)."""

from specdec.drafters.base import Capabilities, Commit, Corpus, Drafter, Prompt
from specdec.drafters.chooser import Chooser, Sources
from specdec.drafters.hybrid import HybridConfig, LookupHybridDrafter
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
from specdec.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter
from specdec.drafters.suffix import SuffixConfig, SuffixDrafter

__all__ = ["Capabilities", "Chooser", "Commit", "Corpus", "Drafter", "Prompt", "Sources", "HybridConfig",
           "LookupHybridDrafter", "ModelDrafter", "ModelDrafterConfig", "PromptLookupConfig", "PromptLookupDrafter",
           "SuffixConfig", "SuffixDrafter"]
