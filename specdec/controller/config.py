"""The draft-length controller's knobs (``DraftLengthConfig``), one frozen dataclass, a comment on each
default. Why these defaults: docs/decisions/006-draft-length.md."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DraftLengthConfig:
    """The controller's knobs, by the part that reads them: the length schedule (initial, minimum,
    maximum, step_up, adaptive, shrink), the cost gate (cost_aware, explore_every, probe_share, decay,
    gate_decay, min_samples), trees (tree_decay, retree_every, tree_nodes), the source chooser
    (revisit_every, min_samples). Why these defaults: docs/decisions/006-draft-length.md."""

    initial: int = 3  # first draft length (a 4-row verify)
    minimum: int = 1  # never ask for fewer (0 would turn drafting off for good)
    maximum: int = 10  # the longest chain the cost model may pick
    step_up: int = 2  # BASS: +2 after a step where some sequence accepted everything
    adaptive: bool = True  # False: always ask for `initial`
    cost_aware: bool = True  # draft only when the expected gain beats the measured verify cost
    explore_every: int = 8  # while gated off, probe every n steps (backs off to 8n)
    probe_share: float = 0.02  # ...and never more often than keeps probes' extra cost under this share
    decay: float = 0.8  # weight of the past in the running means (alpha, verify and draft times)
    gate_decay: float = 0.95  # the measured gain's running mean: a long memory (~20 steps)
    shrink: str = "one"  # after a step with no whole draft accepted: "one" token, or "bass" (bass_shrink)
    tree_decay: float = 0.98  # trees: weight of the past per observed tree in the depth x rank acceptance
    retree_every: int = 16  # trees: re-run Sequoia's program after this many observed trees
    revisit_every: int = 64  # several sources: a candidate passed over this many steps gets a turn
    min_samples: int = 3  # drafting steps measured before a class's gain is judged (and chosen first until then)
    tree_nodes: int = 0  # > 0 with cost_aware off: a fixed tree budget (a sweep's fixed setting)
    # at a batch where drafting does not pay (``priced_out``), one step in this many drafts as usual
    # (re-measuring it); the others draft nothing
    retime_every: int = 128
    batch_samples: int = 8  # drafting steps measured at a batch size before their pooled gain is judged

    @classmethod
    def bass(cls, **overrides) -> "DraftLengthConfig":
        """BASS's schedule as published: l0 = 7, +2 up to 32, ceil(l/10) shrinks, no cost gate."""
        return replace(cls(initial=7, maximum=32, step_up=2, shrink="bass", cost_aware=False), **overrides)
