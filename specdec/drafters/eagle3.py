"""EAGLE-3 drafting: EAGLE-2's dynamic trees (``drafters.eagle.EagleDrafter``, the same machinery) from an
``Eagle3Head``, which reads three target layers' hidden states and drafts over a reduced vocabulary.

What differs from EAGLE-1/2, and where it lives:
- features: the decoder hands over the inputs of the head's ``aux_layers`` concatenated [3D]
  (``Capabilities.hidden_layers``); the head fuses them with ``fc`` when a pair is fed, and a tree
  node feeds its parent's output back unfused (``Eagle3Head.fuse``);
- vocabulary: children are the head's top-k (or sampled) draft ids, mapped to target ids by ``d2t``;
  under sampling q is spread onto the target's vocabulary at those ids and is 0 elsewhere, so the
  verifier's rejection sampling stays exact (``EagleDrafter._grow_tree``).

The head and its files: ``drafters.eagle3_head``, ``drafters.eagle3_io``. Training: ``specdec
train-eagle --arch eagle3`` (specdec.training.eagle3). Why: docs/decisions/017-eagle3.md
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from specdec.config import current as current_runtime
from specdec.drafters.eagle import EagleConfig, EagleDrafter, lean_head
from specdec.drafters.eagle3_head import Eagle3Head
from specdec.drafters.eagle3_io import load_eagle3
from specdec.introspect import text_config, vocab_size_of


def check_head_fits(head: Eagle3Head, target) -> None:
    """Refuse, by name, a head built for a target of another hidden size, layer count or vocabulary."""
    tcfg, hcfg = text_config(target), head.target_config
    have = {"hidden size": tcfg.hidden_size, "layer count": tcfg.num_hidden_layers,
            "vocabulary": vocab_size_of(target)}
    want = {"hidden size": head.hidden_size, "layer count": hcfg.num_hidden_layers, "vocabulary": head.vocab_size}
    bad = [f"{k} {want[k]} (head) != {have[k]} (target)" for k in have if want[k] != have[k]]
    if bad:
        raise ValueError("EAGLE-3 head was made for another target: " + "; ".join(bad))


class Eagle3Drafter(EagleDrafter):
    """EAGLE-2 dynamic trees from an ``Eagle3Head`` (greedy and sampled, batched), up to
    ``min(total_tokens, budget)`` nodes; see ``EagleDrafter`` for the tree."""

    def __init__(self, target, head: Eagle3Head, config: EagleConfig = EagleConfig()) -> None:
        if not isinstance(head, Eagle3Head):
            raise TypeError(f"Eagle3Drafter drafts from an Eagle3Head, got {type(head).__name__}")
        check_head_fits(head, target)
        super().__init__(target, head, config)
        # the decoder keeps the inputs of the head's layers instead of the last hidden state
        self.capabilities = replace(EagleDrafter.capabilities, hidden_layers=head.aux_layers)


PACKAGED_HEAD3 = Path(__file__).resolve().parent.parent / "data" / "eagle3_head"


def make_eagle3(target, head_path: str | os.PathLike | None = None,
                config: EagleConfig = EagleConfig()) -> Eagle3Drafter:
    """An Eagle3Drafter from ``head_path``, else the runtime configuration's ``eagle3_head``
    ($SPECDEC_EAGLE3_HEAD at the CLI): a directory in vLLM's, SGLang's or the speculators layout; else
    the head packaged for the default model (a head for another target is refused by name)."""
    path = head_path or current_runtime().eagle3_head or PACKAGED_HEAD3
    if path is None or not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"no EAGLE-3 head{'' if path is None else ' at ' + str(path)}: train one with `specdec train-eagle "
            "--arch eagle3 --model MODEL --out DIR` (or use a vLLM / SGLang / speculators EAGLE-3 head for "
            "this target), then pass it with SPECDEC_EAGLE3_HEAD=DIR/head")
    try:
        return Eagle3Drafter(target, lean_head(load_eagle3(path, target), config), config)
    except ValueError as e:
        if head_path or current_runtime().eagle3_head:
            raise
        raise ValueError(f"{e}. The packaged EAGLE-3 head is for the default model (SmolLM2-135M-Instruct): for "
                         "this target train one with `specdec train-eagle --arch eagle3 --model MODEL --out DIR` "
                         "and pass it with SPECDEC_EAGLE3_HEAD=DIR/eagle3/head") from None
