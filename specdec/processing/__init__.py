"""What a sequence's logits go through before a token is chosen: penalties, biases, a grammar
(``rows``, ``grammar``), and the logprobs reported of them."""

from specdec.processing.grammar import Constraint, ConstraintError, Grammar, Masks, Vocabulary
from specdec.processing.rows import Processing, RowProcessor, TokenLogprob

__all__ = ["Constraint", "ConstraintError", "Grammar", "Masks", "Processing", "RowProcessor", "TokenLogprob", "Vocabulary"]
