"""What a step teaches one draft class (its ``tables.ClassState``): the draft seconds and catch-up a
drafting step cost, its acceptance and BASS's length after it, and what an unverified (shadow) draft
would have yielded. The controller's observations (``DraftLengthController.update``,
``observe_shadow``) call these on the class of the step.
"""

from __future__ import annotations

from specdec.controller import cost, policies
from specdec.controller.config import DraftLengthConfig
from specdec.controller.tables import ClassState, running_mean, running_time
from specdec.tree import subtree_depth


def learn_costs(st: ClassState, c: DraftLengthConfig, num_drafted: list[int], draft_time: float | None,
                catch_up: float, resume: float) -> None:
    """A drafting step's draft seconds for the class's size (the most nodes of a row), the source's
    catch-up (all of it, and after pauses), and at a batch the share of rows that drafted."""
    if draft_time is not None:
        n = max(num_drafted)
        st.draft_by_size[n] = running_time(st.draft_by_size.get(n), draft_time, c.decay)
    st.skipped = 0
    if catch_up > 0:
        st.catch_up = running_mean(st.catch_up or None, catch_up, c.decay)  # 0.0: none measured yet
    if resume > 0:
        st.resume = running_mean(st.resume or None, resume, c.decay)
    if len(num_drafted) > 1:
        st.row_share = running_mean(st.row_share, sum(d > 0 for d in num_drafted) / len(num_drafted), c.decay)


def learn_schedule(st: ClassState, c: DraftLengthConfig, num_drafted: list[int], num_accepted: list[int],
                   probe: bool) -> None:
    """alpha (accepted over judged tokens: a rejection ends the judging), whether the draft was taken
    whole, the probe length after a probe, and BASS's length (``policies.next_length``).
    Example: drafted [3, 3], accepted [3, 1] -> 4 hits in 3 + 2 judged; taken whole by one row only."""
    hits = sum(num_accepted)
    trials = sum(a + (1 if a < d else 0) for d, a in zip(num_drafted, num_accepted) if d)
    st.alpha = running_mean(st.alpha, hits / max(1, trials), c.decay)
    whole = all(a == d for d, a in zip(num_drafted, num_accepted))
    st.whole = max(num_drafted) if whole else 0
    if probe:
        st.probe_length = policies.next_probe_length(st.probe_length, whole, num_accepted, c.maximum, c.step_up)
    if c.adaptive:
        st.length, st.shrinks = policies.next_length(st.length, st.shrinks, num_drafted, num_accepted,
                                                     c.minimum, c.maximum, c.step_up, c.shrink == "bass")


def shadow_tokens(st: ClassState, parents: list[list[int]], accepted: list[list[int]], judged: list[int]) -> float:
    """Tokens a shadow draft would have yielded over its rows: 1 + accepted per row, plus, where the
    path ran as far as the committed text (it was cut there, not rejected), the expected rest of the
    draft below it at the class's measured chain rates (``cost.chain_values``).
    Example: rates [1, .5, .5], a 3-chain judged 1 deep with 1 accepted -> 2 + .5 + .25 = 2.75."""
    tokens = 0.0
    for par, acc, judge in zip(parents, accepted, judged):
        tokens += 1 + len(acc)
        deeper = subtree_depth(par, acc[-1] if acc else -1) if par and len(acc) == judge else 0
        if deeper:
            tokens += cost.chain_values(st.positions.chain(judge + deeper)[judge:])[deeper]
    return tokens
