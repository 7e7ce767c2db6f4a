"""Names the CLI and configs use for drafters, mapped to constructors (no if/elif ladders).

Each constructor takes the target model and returns a Drafter, or None for plain decoding.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from specdec.drafters.auto import AutoDrafter
from specdec.drafters.base import Drafter
from specdec.drafters.eagle import make_eagle
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.hybrid import LookupHybridDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.drafters.suffix import SuffixDrafter, stored_answers_fit
from specdec.models import text_config

DrafterFactory = Callable[[object], "Drafter | None"]


# Self-speculation joins ``auto`` from the prompt length at which its draft token reads at most this
# share of a target step's bytes (StreamingDrafter.pays_from): the weights are read once per step
# whatever the batch, the K/V per sequence, so a batch reaches it at shorter prompts (MagicDec's
# regime). Measured on the default model (AVX-512 machine), next to the copy sources: at batch 1 it
# made ``auto`` 3-25% slower at 2,048 tokens (ratio 0.89) and 6-7% slower at 7,000 (0.65) (alone it
# was 0.97-1.10x and 1.2-1.4x plain decoding there); at 8 x 7,000 (0.24) it is auto's main gain, 1.4x
# plain decoding alone. 0.5 lies between: ~12,800 tokens at batch 1, ~2,500 at batch 8.
SELF_SPEC_MAX_READ_RATIO = 0.5


def make_auto(target) -> AutoDrafter:
    """Prompt lookup, suffix, EAGLE (if a head fits the target; prompts under 2,048 tokens, twice
    what its head was trained on) and StreamingLLM self-speculation (prompts long enough that its
    drafts read at most half of what a target step reads, at the batch's size); the controller picks
    per step (drafters.auto). Where the stored answers fit the target's vocabulary, suffix indexes
    them too (as ``suffix-corpus``) and EAGLE stays out: the packaged head learned from those same
    answers, and beside a suffix drafter over them it added no accepted tokens, only its draft time
    (26 Spec-Bench questions, one process: tau 2.24 with and without it, 75.7 vs 76.6 tokens/s;
    B = 8: 10.25 vs 10.22 s; a15ae54, the Xeon)."""
    corpus = stored_answers_fit(text_config(target).vocab_size)
    suffix = SuffixDrafter.from_stored_answers() if corpus else SuffixDrafter()
    sources: dict[str, Drafter] = {"lookup": PromptLookupDrafter(), "suffix": suffix}
    if not corpus:
        try:
            sources["eagle"] = make_eagle(target)
        except ValueError:
            pass  # no head for this target: the model-free sources only
    streaming = sources["streaming"] = StreamingDrafter(target, budget=512)
    streaming_from = partial(streaming.pays_from, SELF_SPEC_MAX_READ_RATIO)  # prompt tokens, given the batch size
    return AutoDrafter(sources, min_prompt={"streaming": streaming_from}, max_prompt={"eagle": 4 * 512 - 1},
                       by_match=("eagle",) if "eagle" in sources else ())


DRAFTERS: dict[str, DrafterFactory] = {
    "none": lambda target: None,  # autoregressive on the BMC store: what BMC alone gives
    "prompt-lookup": lambda target: PromptLookupDrafter(),
    # the first third of the target's layers draft for the whole model
    "early-exit": lambda target: ModelDrafter(
        early_exit_model(target, max(1, target.config.num_hidden_layers // 3))),
    # a trained head: $SPECDEC_EAGLE_HEAD, else the packaged one; a clear error says how to train it
    "eagle": lambda target: make_eagle(target),
    # prompt lookup after a 2-gram match or longer, the EAGLE head elsewhere
    "eagle+lookup": lambda target: LookupHybridDrafter(make_eagle(target)),
    # the target drafts for itself over 512 KV rows (MagicDec): 4 sinks + the recent window
    "streaming": lambda target: StreamingDrafter(target, budget=512),
    # ... or over the prompt rows its last 32 prompt queries attend to most, plus the window
    "snapkv": lambda target: SnapKVDrafter(target, budget=512),
    # a tree of what followed the longest matching suffix of the prompt and answer so far
    "suffix": lambda target: SuffixDrafter(),
    # the same, also searching the project's stored answers (data/eagle_answers.jsonl), indexed on
    # first use (~2 s, ~150 MB for its 313k tokens)
    "suffix-corpus": lambda target: SuffixDrafter.from_stored_answers(),
    # all of the above that fit (lookup, suffix, EAGLE, streaming at long prompts): the controller
    # uses the one whose drafting steps have been fastest, switching as that changes
    "auto": make_auto,
}


def make_drafter(name: str, target) -> Drafter | None:
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(sorted(DRAFTERS))}") from None
    return factory(target)


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Add a drafter name (later drafters - EAGLE, self-speculation - register themselves here)."""
    DRAFTERS[name] = factory
