"""SpecDecoder: draft -> verify -> accept -> commit, until every sequence is done.

    out = SpecDecoder(target, PromptLookupDrafter()).generate(input_ids, max_new_tokens=128)
    out.sequences      # [B, P + new], exactly what target.generate(..., do_sample=False) returns
    out = decoder.generate(input_ids, do_sample=True, temperature=0.7, top_p=0.9, seed=0)
                       # distributed exactly as target.generate(..., do_sample=True, same arguments)
    out.steps          # per step: drafted / accepted counts per live sequence, draft and verify seconds

A batch is B sequences at once (a padded ``input_ids`` with ``attention_mask``, left or right
padding, or a list of 1-D prompts). Each sequence accepts its own number of drafted tokens per step
(BASS's ragged acceptance) into its own rows of the BMC store, and stops on its own EOS or
``max_new_tokens``; a finished sequence leaves the batch (its rows are dropped from the store and
the drafter: compaction, so no later forward computes it).

The loop itself is ``specdec.session.DecodeSession``: one ``add`` of the prompts, then ``step``
until no row is live (a server adds and removes rows between steps).
"""

from __future__ import annotations

import operator
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from specdec.config import RuntimeConfig
from specdec.config import current as current_runtime
from specdec import fastpath
from specdec.patch import skinny_linears
from specdec.runtime import kernels
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.drafters.base import Corpus, Drafter
from specdec.drafters.chooser import Chooser, as_chooser, draft_step  # noqa: F401 (bench.replay)
from specdec.introspect import float_dtype, sliding_window, text_config, vocab_size_of
from specdec.kv.bmc import BMCConfig
from specdec.kv.prefix import PrefixCache
from specdec.kv.static import SpareStore, StaticShapes
from specdec.processing import Constraint, Grammar, Processing, TokenLogprob, Vocabulary
from specdec.prompting import eos_ids
from specdec.sampling import SamplingParams
# the step core; its names stay importable from here
from specdec.judging import Acceptance
from specdec.session import PREFILL_TOKENS, DecodeSession  # noqa: F401
from specdec.steps import StepEvent, StepOutcome, StepStats, learn_step  # noqa: F401

ATTENTION = ("pad", "split", "auto")
# a target computing in these rounds each layer's output to 8 or 11 bits: another summation order (the
# store's padded width, a verify's rows) moves a near tie, so greedy outputs follow generate's only until
# one (docs/decisions/015-quant-kernels.md, Decision: quantized self-drafter)
INEXACT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SpecDecoderConfig:
    bmc: BMCConfig = BMCConfig(period=64)  # T for the target's store (its first T if adaptive_period)
    # T chosen at every reallocation from the rows held and still wanted, by costs calibrated on the
    # machine (specdec.controller.period: grows with the sequence, padding capped at 1/8 of the rows)
    adaptive_period: bool = True
    draft_length: DraftLengthConfig = DraftLengthConfig()
    # CPU: linear layers over blocks of <= this many rows take specdec.runtime.kernels' routes (MKL's
    # skinny GEMM for 1-4 rows, the packed kernel for 5-16, balanced chunks of those up to 128);
    # 0 keeps torch's default path everywhere
    skinny_rows: int = kernels.CHUNK_ROWS
    # Batches: attention over ragged lengths by padding to the longest (pad), per sequence (split),
    # or chosen per step (auto): split once padding would be more than `split_waste` of the work
    attention: str = "auto"
    # why 0.3: docs/decisions/005-pad-vs-split.md
    split_waste: float = 0.3
    # greedy: a free drafter's classes that draft nothing in a step (several sources: the free sources'
    # classes not chosen; one free drafter: its class when gated off) draft too, for every row,
    # unverified, and are scored against the committed text (drafters.chooser; why:
    # docs/decisions/009-shadow-drafts.md)
    shadow_drafts: bool = True
    # the CPU runtime (kernel variant, self-check, lean forward, ...: specdec.config); None: the one of the
    # enclosing specdec.runtime.use block (the CLI opens one from the SPECDEC_* variables), else the defaults
    runtime: RuntimeConfig | None = None
    # the target's steps over fixed shapes in a store that stays put, replayable as CUDA graphs
    # (kv.static; docs/decisions/025-static-steps.md); None: BMC's growing store (the CPU's fast one)
    static: StaticShapes | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.static is not None and self.attention == "split":
            raise ValueError("attention='split' attends at host offsets, which a static step cannot: "
                             "use 'pad' or 'auto' with static shapes")


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, P + new] the input rows as given, then new tokens padded with pad_token_id
    prompt_length: int  # P: columns of the input (the padded width for a batch)
    steps: list[StepStats] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # [B] tokens generated per sequence
    steps_per_sequence: list[int] = field(default_factory=list)  # [B] target forwards each took
    accepted_per_sequence: list[int] = field(default_factory=list)  # [B] drafted tokens each kept
    # [B][num_new[b]] each new token's logprob under the processed target, with the most likely tokens
    # there (``generate(logprobs=k)``); None when not asked
    logprobs: list[list[TokenLogprob]] | None = None

    @property
    def new_tokens(self) -> int:
        """Tokens generated, summed over the batch."""
        return sum(self.num_new)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target forward per sequence (accepted drafts + 1), Spec-Bench's tau; 1.0 = no gain."""
        return self.new_tokens / max(1, sum(self.steps_per_sequence))

    @property
    def draft_time(self) -> float:
        return sum(s.draft_time for s in self.steps)

    @property
    def verify_time(self) -> float:
        return sum(s.verify_time for s in self.steps)

    def generated(self, b: int) -> torch.Tensor:
        """Sequence b's new tokens [num_new[b]] (no padding)."""
        return self.sequences[b, self.prompt_length : self.prompt_length + self.num_new[b]]


class SpecDecoder:
    def __init__(self, target, drafter: Drafter | Chooser | None = None,
                 config: SpecDecoderConfig = SpecDecoderConfig(), prefix_cache: PrefixCache | None = None) -> None:
        """``prefix_cache``: prompt K/V rows kept between ``generate`` calls (and between the rows of a
        batch), each prompt prefilled after its longest cached prefix, token- and bit-identical to no
        reuse (``specdec.kv.prefix``; not used with a drafter that reads the target's hidden states)."""
        self.target = target.eval()
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.bind(target)
        self.drafter = drafter  # as given: a drafter, several sources (drafters.chooser.Sources), or None
        self.chooser = as_chooser(drafter)  # what the loop drafts through
        self.config = config
        self.vocab_size = vocab_size_of(target)
        cfg = text_config(target)
        self.context_window = getattr(cfg, "max_position_embeddings", None)
        self.sliding_window = sliding_window(cfg)
        # learns across generate calls: this machine's verify times, each draft class's acceptance and gain
        self.controller = DraftLengthController(config.draft_length)
        self._vocabularies: dict[int, Vocabulary] = {}  # id(tokenizer) -> its llguidance form (built once)
        self.spare_store = SpareStore()  # config.static: the last session's store, and its captured steps
        dtype = float_dtype(target)
        if dtype in INEXACT_DTYPES:
            warnings.warn(f"the target computes in {dtype}: its greedy outputs here follow target.generate's only "
                          "until a near tie that another summation order moves (float32 or float64 weights, or a "
                          "GGUF's blocks, are token-exact)", stacklevel=2)
        if drafter is not None and self.chooser.vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"drafter vocabulary ({self.chooser.vocab_size} tokens) does not match the target's "
                f"({self.vocab_size} tokens): a drafter must share the target's tokenizer")

    def warm_up(self) -> None:
        """Do a first generation's one-time work now: the lean forward built and checked against HF's,
        the weights fused and packed for the kernel, the compiled ops' first calls (~1.5 s for the
        default model), and a drafter's corpus indexed (suffix-corpus, auto: ~0.5 s). The first part
        runs a 2-token plain generation on a throwaway decoder of the same target, so this decoder's
        controller measures none of it; a clock started next times generation only."""
        ids = torch.arange(1, 9, dtype=torch.long)[None] % text_config(self.target).vocab_size
        SpecDecoder(self.target, None, self.config).generate(ids, max_new_tokens=2)
        if isinstance(self.drafter, Corpus):
            self.drafter.build_index()

    def generate(self, input_ids, max_new_tokens: int = 128, eos_token_id=None,
                 attention_mask: torch.Tensor | None = None, streamer=None, callback=None,
                 pad_token_id: int | None = None, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
                 seed: int | None = None, constraint: Constraint | Grammar | None = None, tokenizer=None,
                 repetition_penalty: float | None = None, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                 logprobs: int | None = None) -> GenerateOutput:
        """Greedy generation, each sequence token-identical to ``target.generate(..., do_sample=False)``
        of its prompt alone; or, with ``do_sample=True``, sampling distributed exactly as
        ``target.generate(do_sample=True, ...)`` with the same temperature / top_k / top_p (unset ones
        as HF fills them: the target's generation_config, else temperature 1, top_k 50, top_p 1; see
        ``specdec.sampling``). Randomness: ``generator`` if given, else a new one seeded with ``seed``,
        else one seeded from torch's global RNG (so ``torch.manual_seed`` fixes it, as with HF). A seed
        repeats a run only if the drafts repeat too: the default controller sizes drafts from measured
        times, so for bit-repeatable samples use ``DraftLengthConfig(cost_aware=False)`` (the
        distribution is exact either way). Without do_sample the sampling arguments are ignored, as
        HF ignores them.

        input_ids: [P] or [B, P] (with ``attention_mask`` [B, P] for padded rows, left or right), or a
        list of 1-D prompts of different lengths (laid out left-padded, as HF would). eos_token_id: int
        or list (default: the target's generation config); the EOS is kept, as HF does.
        streamer: HF-style object with put(tokens)/end() (e.g. ``TextStreamer``), batch size 1 only.
        callback: called with a ``StepEvent`` per live sequence after each step.
        max_new_tokens is clipped to the room left in the context window by the longest prompt.

        Processing, each sequence on its own text (``specdec.processing.rows``, speculation exact under all
        of them): ``constraint`` (a ``Constraint``: JSON schema or object, regex, Lark, GBNF; compiled with
        ``tokenizer``, or a ``Grammar`` compiled already) keeps every sequence inside its grammar, ending
        on an EOS when it is done; ``repetition_penalty`` (HF's; unset: the target's generation_config's),
        ``frequency_penalty`` / ``presence_penalty`` (OpenAI's, over the output) and ``logit_bias`` (token
        id -> added score). ``logprobs=k``: each new token's logprob under the processed target and the k
        most likely tokens there, in ``GenerateOutput.logprobs``.
        """
        if not hasattr(type(max_new_tokens), "__index__") or operator.index(max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        ids, prompts = self._check_input(input_ids, attention_mask)
        self._check_request(prompts, max_new_tokens, streamer, do_sample)
        pad = _pad_id(pad_token_id, eos_token_id, self.target)
        judge = self._acceptance(do_sample, temperature, top_k, top_p, generator, seed)
        processing = self.processing(constraint, tokenizer, eos_token_id, repetition_penalty, frequency_penalty,
                                     presence_penalty, logit_bias, logprobs)
        if self.context_window is not None:
            max_new_tokens = min(max_new_tokens, self.context_window - max(len(p) for p in prompts))
        session = DecodeSession(self, _eos_set(eos_token_id, self.target))
        if streamer is not None:
            streamer.put(prompts[0][None].cpu())
        lps = [[] for _ in prompts] if processing is not None and processing.logprobs is not None else None
        with self.running():
            seqs, events = session.add(prompts, [max_new_tokens] * len(prompts), judge, [processing] * len(prompts))
            _step_until_done(session, seqs, events, streamer, callback, lps)
        if streamer is not None:
            streamer.end()
        return _output(ids, session, seqs, pad, lps)

    def _check_request(self, prompts: list[torch.Tensor], max_new_tokens: int, streamer, do_sample: bool) -> None:
        """Refuse what ``generate`` cannot do for these prompts: pass the sliding window, stream a batch,
        or ask the drafter for a batch or for sampling it does not declare."""
        longest = max(len(p) for p in prompts) + max_new_tokens
        if self.sliding_window is not None and longest > self.sliding_window:
            raise ValueError(f"the target attends within a sliding window of {self.sliding_window} tokens, which "
                             f"specdec's KV store does not implement: a prompt of {longest - max_new_tokens} tokens "
                             f"+ max_new_tokens {max_new_tokens} would pass it (keep both within the window)")
        if streamer is not None and len(prompts) > 1:
            raise ValueError(f"a streamer takes one sequence (HF streamers are batch-1); got {len(prompts)}: "
                             "use callback=, whose events name their sequence")
        caps = self.chooser.capabilities if self.chooser is not None else None
        if len(prompts) > 1 and caps is not None and not caps.batches:
            raise ValueError(f"drafter {type(self.drafter).__name__} cannot draft for a batch of {len(prompts)} "
                             "sequences (its capabilities do not declare batches); pass one sequence at a time")
        if do_sample and caps is not None and not caps.samples:
            raise ValueError(f"drafter {type(self.drafter).__name__} does not declare that it drafts under "
                             "sampling (Capabilities.samples); use it greedily (do_sample=False)")

    def _acceptance(self, do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None,
                    generator: torch.Generator | None, seed: int | None) -> Acceptance:
        """Greedy acceptance, or sampling's with its generator: the one given, else one seeded with
        ``seed``, else with a seed drawn from torch's global RNG."""
        sampling = SamplingParams.resolve(self.target, temperature, top_k, top_p) if do_sample else None
        if sampling is not None and generator is None:
            seed = int(torch.randint(2**62, ())) if seed is None else seed
            generator = torch.Generator().manual_seed(seed)  # CPU: uniforms drawn here, on any device
        return Acceptance(sampling, generator)

    def vocabulary(self, tokenizer, eos: set[int]) -> Vocabulary:
        """``tokenizer`` as the grammar engine reads it, built once per tokenizer (~0.4 s for 49k tokens)."""
        key = (id(tokenizer), tuple(sorted(eos)))
        if key not in self._vocabularies:
            self._vocabularies[key] = Vocabulary.of(tokenizer, self.vocab_size, eos)
        return self._vocabularies[key]

    def processing(self, constraint: Constraint | Grammar | None = None, tokenizer=None, eos_token_id=None,
                   repetition_penalty: float | None = None, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                   logprobs: int | None = None) -> Processing | None:
        """The ``Processing`` of ``generate``'s arguments (None when they change nothing): a ``Constraint``
        compiled with ``tokenizer`` (a ValueError names what is missing or wrong), ``repetition_penalty``
        unset taken from the target's generation_config as HF takes it."""
        if repetition_penalty is None:
            config = getattr(self.target, "generation_config", None)
            repetition_penalty = getattr(config, "repetition_penalty", None) or 1.0
        grammar = constraint
        if isinstance(constraint, Constraint):
            if tokenizer is None:
                raise ValueError("a constraint needs the target's tokenizer to compile: pass tokenizer=")
            grammar = constraint.compile(self.vocabulary(tokenizer, _eos_set(eos_token_id, self.target)))
        elif constraint is not None and not isinstance(constraint, Grammar):
            raise TypeError(f"constraint must be a specdec Constraint or Grammar, got {type(constraint).__name__}")
        opts = Processing(float(repetition_penalty), float(frequency_penalty), float(presence_penalty),
                          {int(k): float(v) for k, v in (logit_bias or {}).items()}, grammar, logprobs)
        return opts if opts.changes_scores or logprobs is not None else None

    @property
    def reads_hidden(self) -> bool:
        """The drafter reads the target's hidden states: the prefill and verify keep them."""
        return self.chooser is not None and self.chooser.capabilities.reads_hidden_states

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads instead of the last hidden state (EAGLE-3)."""
        return self.chooser.capabilities.hidden_layers if self.chooser is not None else ()

    @contextmanager
    def running(self):
        """What a session's steps run under: inference mode, and on CPU the lean forward of Llama-shaped
        models (``specdec.fastpath``, built and checked here, not in step 1) and the linear
        layers' kernel routes, weights packed."""
        modules = [self.target] + (self.drafter.torch_modules() if self.drafter is not None else [])
        modules = list({id(m): m for m in modules}.values())  # a self-drafter's is the target: walked once
        runtime = self.config.runtime or current_runtime()
        paths = [p for p in (fastpath.get(m, runtime) for m in modules) if p is not None]
        replaced = [m for p in paths for m in p.replaced()]
        # the CPU kernels serve CPU targets only: elsewhere no self-check, no build, no patched linears
        rows = self.config.skinny_rows if self.target.device.type == "cpu" else 0
        drafts = self.chooser is not None and self.chooser.capabilities.approximate_forwards
        with torch.inference_mode(), skinny_linears(*modules, max_rows=rows, skip=replaced, runtime=runtime,
                                                     drafts=drafts):
            kernels.prepack([w for p in paths for w in p.fused_weights()], rows)
            yield

    def _check_input(self, input_ids, attention_mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The input as laid out for the output [B, P], and each sequence's real tokens."""
        if isinstance(input_ids, (list, tuple)):
            if attention_mask is not None:
                raise ValueError("attention_mask goes with a padded input_ids tensor, not a list of prompts")
            prompts = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in input_ids]
            if not prompts:
                raise ValueError("empty batch: the list of prompts has no sequence")
            P = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), P, dtype=torch.long)  # left padding, overwritten below
            for b, p in enumerate(prompts):
                if len(p):
                    ids[b, P - len(p):] = p
        else:
            ids = input_ids[None] if input_ids.dim() == 1 else input_ids
            if ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
            ids = ids.to(torch.long).cpu()
            if attention_mask is None:
                prompts = list(ids)
            else:
                mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
                if tuple(mask.shape) != tuple(ids.shape):
                    raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                                     f"input_ids shape {tuple(input_ids.shape)}")
                mask = mask.bool().cpu()
                prompts = [row[m] for row, m in zip(ids, mask)]
        for b, p in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"sequence {b}"
            if len(p) == 0:
                raise ValueError(f"empty prompt: {name} has no tokens (SpecDecoder needs at least one)")
            if self.context_window is not None and len(p) >= self.context_window:
                raise ValueError(f"{name} of {len(p)} tokens does not fit the model's context window of "
                                 f"{self.context_window} tokens (no room left to generate)")
        if isinstance(input_ids, (list, tuple)):
            pad = _pad_id(None, None, self.target)
            for b, p in enumerate(prompts):
                ids[b, : ids.shape[1] - len(p)] = pad
        return ids, prompts


def _step_until_done(session: DecodeSession, seqs: list[int], events: list[StepEvent], streamer, callback,
                     lps: list[list[TokenLogprob]] | None) -> None:
    """Step ``session`` until no row is live, handing each step's events (the prefill's first) to the
    streamer, the callback and the per-row logprobs ``lps``."""
    row_of = {s: b for b, s in enumerate(seqs)}  # sequence id -> its row of the input
    while True:
        for e in events:
            if streamer is not None:  # batch size 1: the one sequence's tokens of this step
                streamer.put(torch.tensor(e.tokens))
            if callback is not None:
                callback(e)
            if lps is not None:
                lps[row_of[e.sequence]].extend(e.logprobs)
        if not session.rows:
            break
        events = session.step()


def _output(ids: torch.Tensor, session: DecodeSession, seqs: list[int], pad: int,
            lps: list[list[TokenLogprob]] | None) -> GenerateOutput:
    """The finished session's sequences after their inputs ``ids`` [B, P], padded with ``pad``."""
    results = [session.result(s) for s in seqs]
    new = [r.tokens for r in results]
    width = max(len(n) for n in new)
    tail = torch.full((len(seqs), width), pad, dtype=torch.long)  # [B, new]
    for b, n in enumerate(new):
        tail[b, : len(n)] = torch.tensor(n, dtype=torch.long)
    return GenerateOutput(torch.cat([ids, tail], dim=1), ids.shape[1], session.steps, [len(n) for n in new],
                          [r.steps for r in results], [r.accepted for r in results], lps)


def _eos_set(eos_token_id, target) -> set[int]:
    """eos_token_id (an int or a list), else the target's generation config's (``prompting.eos_ids``)."""
    if eos_token_id is None:
        return set(eos_ids(target))
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def _pad_id(pad_token_id, eos_token_id, target) -> int:
    """pad_token_id, else the target's, else its first EOS (as HF generate falls back), else 0."""
    if pad_token_id is not None:
        return int(pad_token_id)
    gen = getattr(target, "generation_config", None)
    if gen is not None and gen.pad_token_id is not None:
        return int(gen.pad_token_id)
    eos = sorted(_eos_set(eos_token_id, target))
    return eos[0] if eos else 0
