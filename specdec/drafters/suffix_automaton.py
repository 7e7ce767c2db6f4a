"""A suffix automaton with occurrence counts: the suffix drafter's index (``drafters.suffix``).

The index: a suffix automaton (Blumer et al. 1985; the DAWG) per text, built online.
    - every substring of the text is a path from the root; a state is a set of substrings with the
      same end positions, ``length`` its longest one, ``link`` the state of its longest suffix that
      ends elsewhere too. At most 2n states and 3n transitions: memory linear in the text.
    - ``extend(token)`` is amortised O(1) for the automaton, plus one ``count`` increment on each
      state of the new end's suffix-link chain: every state on it but the new one is a suffix of
      the text that occurred before, so the chain is at most (longest repeated suffix + 2) long --
      a handful of states on ordinary text, more while the text repeats itself.
    - ``count[v]`` = how often v's substrings occur (end positions). For a context s (state v) and
      a token c, count[trans[v][c]] = how often s was followed by c: the frequencies of the tree.
    - the longest suffix of the text that occurred before is ``link[last]`` (O(1)); the longest
      suffix found in a *corpus* automaton is tracked by the usual matching walk, one step per
      committed token (amortised O(1)).
Pure Python: a token's ``extend`` and a step's trees cost microseconds; memory is a dict of
transitions per state (~480 bytes a token), so a large corpus is indexed once per session, on first
use or by ``build_index``. Costs: docs/decisions/014-suffix-drafter.md.
"""

from __future__ import annotations

SEPARATOR = -1  # between corpus documents: never drafted, never matched (no query holds it)


class SuffixAutomaton:
    """An online suffix automaton with occurrence counts (see the module docstring).

    Worked example, text [a b a] (a=1, b=2): states 0 (root), 1 "a", 2 "ab"/"b", 3 "aba"/"ba";
    link[3] = 1 ("a" ends at 0 and 2), so the longest earlier suffix is "a" (length 1), and
    count[trans[1][2]] = 1: "a" was followed by "b" once.
    """

    __slots__ = ("trans", "link", "length", "count", "last", "_ranked")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.trans: list[dict[int, int]] = [{}]  # [S] token -> state
        self.link: list[int] = [-1]  # [S] suffix link, -1 for the root
        self.length: list[int] = [0]  # [S] longest substring of the state
        self.count: list[int] = [0]  # [S] end positions of the state's substrings (occurrences)
        self.last = 0  # the state of the whole text
        self._ranked: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}  # ``ranked``'s, until the text grows
        for t in tokens:
            self.extend(t)

    def __len__(self) -> int:
        """Tokens indexed (separators included)."""
        return self.length[self.last]

    @property
    def num_states(self) -> int:
        return len(self.length)

    def _new_state(self, length: int, link: int, trans: dict[int, int], count: int) -> int:
        self.trans.append(trans)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        return len(self.length) - 1

    def extend(self, c: int) -> None:
        if self._ranked:
            self._ranked = {}
        trans, link, length = self.trans, self.link, self.length
        cur = self._new_state(length[self.last] + 1, 0, {}, 0)
        p = self.last
        while p != -1 and c not in trans[p]:
            trans[p][c] = cur
            p = link[p]
        if p != -1:
            q = trans[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # q holds longer strings than p.c: split off the short ones (same end positions)
                clone = self._new_state(length[p] + 1, link[q], dict(trans[q]), self.count[q])
                while p != -1 and trans[p].get(c) == q:
                    trans[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        v = cur  # the new end position is an occurrence of every suffix: the link chain up to the root
        count = self.count
        while v != -1:
            count[v] += 1
            v = link[v]

    def longest_repeat(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the text that also ends earlier (length 0: none)."""
        v = self.link[self.last]
        return (v, self.length[v]) if v > 0 else (0, 0)

    def step(self, state: int, matched: int, c: int) -> tuple[int, int]:
        """Matching walk: the longest suffix of (query + c) found in the text, given the one of query.

        (state, matched) -> (state', matched'); shorten along links until c can follow.
        """
        trans, link = self.trans, self.link
        while state > 0 and c not in trans[state]:
            state = link[state]
            matched = self.length[state]
        nxt = trans[state].get(c)
        if nxt is None:
            return 0, 0
        return nxt, matched + 1

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``tokens`` that occurs in the text."""
        state, matched = 0, 0
        for c in tokens:
            state, matched = self.step(state, matched, c)
        return state, matched

    def children(self, state: int) -> list[tuple[int, int, int]]:
        """(token, count, state) of each continuation of ``state``'s context, separators left out."""
        count = self.count
        return [(c, count[u], u) for c, u in self.trans[state].items() if c != SEPARATOR]

    def ranked(self, state: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(total count, ``children``) with the children by count descending, then token ascending:
        ``suffix.expand_tree``'s order. Kept per state until the text grows: a corpus's, which grows only when
        a document is added, serves every step's tree from it (near its root a state has thousands of
        continuations, of which a tree takes a few)."""
        out = self._ranked.get(state)
        if out is None:
            kids = sorted(self.children(state), key=lambda k: (-k[1], k[0]))
            out = self._ranked[state] = (sum(n for _, n, _ in kids), kids)
        return out
