"""The controller: what it measures, pure cost functions, the policies that size drafts, the chooser."""

from specdec.controller.draft_length import DraftLengthConfig, DraftLengthController

__all__ = ["DraftLengthConfig", "DraftLengthController"]
