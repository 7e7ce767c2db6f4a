"""Names for drafters, mapped to factories: what ``--drafter NAME`` accepts in every command.

    register_drafter("bigram", lambda target: BigramDrafter())    # a plugin's drafter gets a name
    make_drafter("bigram", target)                                 # what the commands call

A factory takes the target model and returns a Drafter, several sources (``drafters.chooser.Sources``)
or None (plain decoding). An installed package can also name its drafters in the entry-point group
``specdec.drafters`` (``bigram = "mypkg.drafters:make_bigram"``): they are registered when this module
is first imported, before any command builds its arguments.
"""

from __future__ import annotations

import re
import warnings
from functools import partial
from importlib.metadata import entry_points
from typing import Callable

import torch

from specdec.drafters.base import Drafter
from specdec.drafters.chooser import Chooser, Sources
from specdec.config import current as current_runtime
from specdec.drafters.eagle import make_eagle
from specdec.drafters.eagle3 import make_eagle3
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.grammar import GrammarDrafter
from specdec.drafters.hybrid import LookupHybridDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.quant_self import quant_self_drafter
from specdec.drafters.self_spec import SnapKVDrafter, StreamingDrafter
from specdec.drafters.suffix import SuffixDrafter, stored_answers_fit
from specdec.drafters.vocab import packaged_vocabulary
from specdec.introspect import float_dtype, text_config

DrafterFactory = Callable[[object], "Drafter | Chooser | None"]
ENTRY_POINTS = "specdec.drafters"  # the entry-point group plugins name their drafters in
NAME = re.compile(r"[a-z0-9][a-z0-9+._-]*")  # lower case, as the CLI spells them: "eagle+lookup"

# Self-speculation joins ``auto`` from the prompt length at which its draft token reads at most this
# share of a target step's bytes (StreamingDrafter.pays_from): the weights are read once per step
# whatever the batch, the K/V per sequence, so a batch reaches it at shorter prompts (MagicDec's
# regime). Why 0.5: docs/decisions/008-auto-sources.md
SELF_SPEC_MAX_READ_RATIO = 0.5
EAGLE_MAX_PROMPT = 4 * 512 - 1  # twice the conversations its head learned from (008-auto-sources.md)
# the target dtypes ``auto`` drafts with quant-self for: where a target step runs HF's ops (bf16, fp16) its
# fp32 Q4_0 copy is cheap enough to pay beside the copying sources; beside an fp32 target's lean forward it
# is not (docs/decisions/015-quant-kernels.md, Decision: quantized self-drafter)
QUANT_SELF_IN_AUTO = (torch.bfloat16, torch.float16)


def make_auto(target, eagle3: bool = False, quant_self: bool | None = None) -> Sources:
    """Prompt lookup, suffix, EAGLE (if a head fits the target; prompts up to EAGLE_MAX_PROMPT
    tokens), the quantized self-drafter (``quant_self``; None: for a bf16 / fp16 target, not an fp32
    or quantized one, QUANT_SELF_IN_AUTO) and StreamingLLM self-speculation (prompts long enough that
    its drafts read at most SELF_SPEC_MAX_READ_RATIO of what a target step reads, at the batch's size);
    the controller picks per step (drafters.chooser). Where the stored answers fit the target's
    vocabulary, suffix indexes them too (as ``suffix-corpus``) and EAGLE stays out: the packaged head
    learned from those same answers and added only its draft time beside them
    (docs/decisions/008-auto-sources.md). An EAGLE-3 head, where the runtime names one
    ($SPECDEC_EAGLE3_HEAD) or ``eagle3`` asks for it (else the packaged one), is a source in EAGLE's
    place (the decoder keeps one kind of target features)."""
    corpus = stored_answers_fit(text_config(target).vocab_size)
    suffix = SuffixDrafter.from_stored_answers() if corpus else SuffixDrafter()
    sources: dict[str, Drafter] = {"grammar": GrammarDrafter(), "lookup": PromptLookupDrafter(), "suffix": suffix}
    if eagle3 or current_runtime().eagle3_head is not None:
        sources["eagle3"] = make_eagle3(target)  # named explicitly: a head that does not fit is an error
    elif not corpus:
        try:
            sources["eagle"] = make_eagle(target)
        except ValueError:
            pass  # no head for this target: the model-free sources only
    if quant_self is None:
        quant_self = float_dtype(target) in QUANT_SELF_IN_AUTO
    if quant_self:
        sources["quant-self"] = quant_self_drafter(target)
    streaming = sources["streaming"] = StreamingDrafter(target, budget=512, vocab=packaged_vocabulary(target))
    streaming_from = partial(streaming.pays_from, SELF_SPEC_MAX_READ_RATIO)  # prompt tokens, given the batch size
    heads = [n for n in ("eagle", "eagle3") if n in sources]
    learned = [n for n in (*heads, "quant-self") if n in sources]  # keyed by prompt lookup's match
    return Sources(sources, min_prompt={"streaming": streaming_from}, max_prompt=dict.fromkeys(heads, EAGLE_MAX_PROMPT),
                   by_match=tuple(learned), subsumes={"grammar": ("lookup",)})


DRAFTERS: dict[str, DrafterFactory] = {
    "none": lambda target: None,  # autoregressive on the BMC store: what BMC alone gives
    "prompt-lookup": lambda target: PromptLookupDrafter(),
    # the tokens a constraint forces (JSON keys, punctuation): free drafts where the grammar decides the text
    "grammar": lambda target: GrammarDrafter(),
    # the first third of the target's layers draft for the whole model
    "early-exit": lambda target: ModelDrafter(
        early_exit_model(target, max(1, target.config.num_hidden_layers // 3))),
    # a trained head: $SPECDEC_EAGLE_HEAD, else the packaged one; a clear error says how to train it
    "eagle": lambda target: make_eagle(target),
    # an EAGLE-3 head ($SPECDEC_EAGLE3_HEAD: vLLM / SGLang / speculators layout, or trained here)
    "eagle3": lambda target: make_eagle3(target),
    # auto with the EAGLE-3 head (SPECDEC_EAGLE3_HEAD, else the packaged one) among its sources
    "auto+eagle3": lambda target: make_auto(target, eagle3=True),
    # auto with the quantized self-drafter among its sources whatever the target's dtype
    "auto+quant-self": lambda target: make_auto(target, quant_self=True),
    # prompt lookup after a 2-gram match or longer, the EAGLE head elsewhere
    "eagle+lookup": lambda target: LookupHybridDrafter(make_eagle(target)),
    # the target drafts for itself over 512 KV rows (MagicDec): 4 sinks + the recent window; its output
    # layer over the packaged draft vocabulary and the prompt's ids where that fits the target (drafters.vocab)
    "streaming": lambda target: StreamingDrafter(target, budget=512, vocab=packaged_vocabulary(target)),
    # ... or over the prompt rows its last 32 prompt queries attend to most, plus the window
    "snapkv": lambda target: SnapKVDrafter(target, budget=512, vocab=packaged_vocabulary(target)),
    # the target's own decoder layers quantized to Q4_0 blocks (its output layer to Q8_0, over the draft
    # vocabulary as streaming's), drafting over the target's own K/V rows
    "quant-self": quant_self_drafter,
    # a tree of what followed the longest matching suffix of the prompt and answer so far
    "suffix": lambda target: SuffixDrafter(),
    # the same, also searching the project's stored answers (data/eagle_answers.jsonl), indexed on
    # first use (~2 s, ~150 MB for its 313k tokens)
    "suffix-corpus": lambda target: SuffixDrafter.from_stored_answers(),
    # all of the above that fit (lookup, suffix, EAGLE, streaming at long prompts): the controller
    # uses the one whose drafting steps have been fastest, switching as that changes
    "auto": make_auto,
}


def register_drafter(name: str, factory: DrafterFactory, *, replace: bool = False) -> None:
    """Give ``factory`` (target -> Drafter | Sources | None) the name ``name`` in every command.
    Names are lower case (letters, digits, ``+ . _ -``); a name already taken is refused unless
    ``replace``."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"drafter name {name!r}: use lower-case letters, digits and + . _ - "
                         "(starting with a letter or digit)")
    if not callable(factory):
        raise TypeError(f"drafter {name!r}: the factory must be callable (target -> drafter), got {factory!r}")
    if name in DRAFTERS and not replace:
        raise ValueError(f"drafter {name!r} is already registered; pass replace=True to replace it")
    DRAFTERS[name] = factory


def drafter_names() -> list[str]:
    """Every registered name, sorted: what ``--drafter`` accepts."""
    return sorted(DRAFTERS)


def make_drafter(name: str, target) -> Drafter | Chooser | None:
    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(drafter_names())}") from None
    return factory(target)


def _load_plugins() -> None:
    """Register the drafters installed packages name in the ``specdec.drafters`` entry-point group;
    a plugin that fails to load is skipped with a warning (the built-in names still work)."""
    for ep in entry_points(group=ENTRY_POINTS):
        try:
            register_drafter(ep.name, ep.load())
        except Exception as e:  # a broken plugin must not break every command
            warnings.warn(f"drafter plugin {ep.name!r} ({ep.value}) not registered: {e}", stacklevel=2)


_load_plugins()
