"""The grammar's own drafts: where a constraint allows only one way on (a JSON key, punctuation, a
forced literal), those tokens are proposed, free to make and accepted unless the target writes the same
text in other tokens; between them, the text that followed the same n-gram earlier in the prompt or
answer (prompt lookup's guess), as far as the grammar allows it, then the grammar's forced tokens again.

    SpecDecoder(target, Sources({"grammar": GrammarDrafter(), "lookup": PromptLookupDrafter()}))

It reads each row's grammar state from ``Prompt.processors`` (the decoder advances them); rows without
a grammar draft nothing, and a step where no row has a chain has no draft of this class (``draft_class``
0), so beside other sources (``auto``) it drafts only under a constraint; it drafts on guesses too, not
only where the grammar forces a token (why: docs/decisions/020-constraints.md). Example, schema {"name": string, "age": integer} and
a prompt holding `"name":"Bob"` earlier: forced `{"name":"`, guessed `Bob"` (what followed `"name":"`
before), forced `,"age":`, one chain of all three.
"""

from __future__ import annotations


from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt, TokenHistory
from specdec.drafters.prompt_lookup import NgramIndex
from specdec.tree import DraftTree

LOOKAHEAD = 32  # tokens a guess holds at most
MAX_NGRAM = 3  # the longest suffix a guess matches on (prompt lookup's default)


class GrammarDrafter(Drafter):
    capabilities = Capabilities(free_drafts=True, batches=True, samples=True)

    def __init__(self) -> None:
        self.processors: list = []
        self.texts: list[NgramIndex] = []

    def begin(self, prompt: Prompt) -> None:
        self.processors = list(prompt.processors or [None] * len(prompt.lengths))
        self.texts = [NgramIndex(row, 1, MAX_NGRAM) for row in TokenHistory(prompt).rows]

    def draft_class(self):
        """2: some row's chain opens with a token the grammar forces; 1: only guesses the grammar allows;
        0: no row has a chain (no draft of this class this step). Decided on each chain's first token; the
        chains are walked by ``propose``, only as far as its budget (why: docs/decisions/020-constraints.md)."""
        openings = [self._opening(p, t) for p, t in zip(self.processors, self.texts)]
        if not any(openings):
            return 0
        return 2 if "forced" in openings else 1

    def _opening(self, processor, text: NgramIndex) -> str | None:
        """How a row's chain opens: "forced" (a token the grammar forces), "guess" (a guess it allows), or None
        (no chain): the first token of ``_chains``' walk, whose first step is the grammar's forced tokens."""
        if processor is None:
            return None
        return processor.opening(lambda drafted: self._guess(text, drafted))

    def _chains(self, budget: int) -> list[list[int]]:
        """Each row's chain of at most ``budget`` tokens (the grammar state unmoved)."""
        return [p.draft(budget, lambda out, t=t: self._guess(t, out)) if p is not None else []
                for p, t in zip(self.processors, self.texts)]

    def _guess(self, text: NgramIndex, drafted: list[int]) -> list[int]:
        """What followed the longest earlier occurrence of the text's last n-gram, the drafted tokens
        counted as text (nothing if none occurred)."""
        tail = (text.tokens[-MAX_NGRAM:] + drafted)[-MAX_NGRAM:]
        for n in range(len(tail), 0, -1):
            j = text.table.get(tuple(tail[len(tail) - n:]))
            if j is not None:
                return text.tokens[j: j + LOOKAHEAD]
        return []

    def propose(self, budget: int) -> DraftTree:
        return DraftTree.chains(self._chains(max(0, budget)))

    def accept(self, commit: Commit) -> None:
        """The grammar states are the decoder's, advanced with the commit; the texts grow here."""
        for b, text in enumerate(self.texts):
            text.extend(commit.new_tokens(b))

    def select(self, rows: list[int]) -> None:
        self.processors = [self.processors[b] for b in rows]
        self.texts = [self.texts[b] for b in rows]
