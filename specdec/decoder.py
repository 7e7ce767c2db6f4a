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

Invariant between steps: the target's BMC store holds every committed token of each live sequence
but the last one, the *pending* token, which opens the next verify block (row 0), followed by the
draft tree's nodes. The prefill runs the prompts on the causal fast path, as HF does (prompts of one
length together, in forwards of at most PREFILL_TOKENS tokens), and gives the first token.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field

import torch

from specdec.config import RuntimeConfig
from specdec.config import current as current_runtime
from specdec.runtime import fastpath, kernels
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.drafters.base import Commit, Corpus, Drafter, Prompt
from specdec.drafters.chooser import Chooser, Shadow, as_chooser, draft_step
from specdec.drafters.model import vocab_size_of
from specdec.forward import forward_block, prefill
from specdec.controller import period
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.models import attention_shape, sliding_window, text_config
from specdec.prompting import eos_ids
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree, ancestor_mask, node_depths, path_along
from specdec.verifiers.sampling import verify_sampling
from specdec.verifiers.tree import Verification, verify_greedy

ATTENTION = ("pad", "split", "auto")
PREFILL_TOKENS = 4096  # prompt tokens per prefill forward (prompts of one length go together up to this)


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

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")


@dataclass(frozen=True)
class StepStats:
    num_drafted: list[int]  # per live sequence: real draft nodes verified this step
    num_accepted: list[int]  # per live sequence: drafted tokens kept (the step yields this + 1)
    draft_time: float  # seconds in drafter.propose
    verify_time: float  # seconds in the target forward, verification and commit
    sequences: list[int] = field(default_factory=lambda: [0])  # which sequence each entry is
    split: bool = False  # the step's attention ran per sequence (SPLIT) rather than padded (PAD)


@dataclass(frozen=True)
class StepEvent:
    """What one step appended to one sequence, for streaming UIs."""

    tokens: list[int]  # the new tokens, after max_new_tokens / EOS truncation
    from_draft: int  # how many of the leading tokens were accepted drafts (the rest: the target's)
    stats: StepStats
    sequence: int = 0  # index of the sequence in the batch given to generate


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, P + new] the input rows as given, then new tokens padded with pad_token_id
    prompt_length: int  # P: columns of the input (the padded width for a batch)
    steps: list[StepStats] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # [B] tokens generated per sequence
    steps_per_sequence: list[int] = field(default_factory=list)  # [B] target forwards each took
    accepted_per_sequence: list[int] = field(default_factory=list)  # [B] drafted tokens each kept

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


@dataclass(frozen=True)
class _Acceptance:
    """How the target judges a draft: the greedy walk, or rejection sampling against its processed
    distribution (``sampling`` set), with the run's one generator."""

    sampling: SamplingParams | None = None
    generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor, tree: DraftTree) -> Verification:
        """logits [B, 1 + N, V] at the pending row and every node."""
        # judged where the logits are (a draft is small, logits [B, Q, V] are not); the verdict comes
        # to the host, where the loop reads it
        tree = tree.to(logits.device)
        if self.sampling is None:  # argmax over float32 scores, as HF's greedy search takes it
            ver = verify_greedy(logits.float(), tree)
        else:
            ver = verify_sampling(target_probs(logits, self.sampling), tree, self.generator)
        return ver.cpu()


class _Batch:
    """The live sequences: which input row each is, and what each has generated so far."""

    def __init__(self, B: int, max_new_tokens: int, eos: set[int]) -> None:
        self.rows = list(range(B))  # live row -> sequence index
        self.new: list[list[int]] = [[] for _ in range(B)]  # per sequence
        self.steps = [0] * B
        self.accepted = [0] * B
        self.max_new, self.eos = max_new_tokens, eos

    def wanted(self) -> int:
        """Draft tokens still useful to some live sequence (after its bonus token)."""
        return max(self.max_new - len(self.new[s]) - 1 for s in self.rows)

    def extend(self, commit: Commit, stats: StepStats, callback) -> list[int]:
        """Append each live sequence's new tokens (truncated at max_new_tokens and EOS); returns the
        live rows that go on."""
        keep = []
        for row, s in enumerate(self.rows):
            toks = commit.new_tokens(row)[: self.max_new - len(self.new[s])]
            stop = next((i for i, t in enumerate(toks) if t in self.eos), None)
            if stop is not None:
                toks = toks[: stop + 1]
            self.new[s].extend(toks)
            self.steps[s] += 1
            self.accepted[s] += min(len(toks), int(commit.num_accepted[row]))
            if callback is not None:
                callback(StepEvent(toks, min(len(toks), int(commit.num_accepted[row])), stats, s))
            if stop is None and len(self.new[s]) < self.max_new:
                keep.append(row)
        return keep


def learn_step(controller: DraftLengthController, key, tree: DraftTree, accepted: list[list[int]],
               verify_time: float | None, draft_time: float | None, shadows: list[Shadow] = (),
               texts: list[list[int]] = (), grew: bool = False, resume: float = 0.0,
               catch_up: float = 0.0) -> None:
    """What the controller learns from a verified step (the decoder's step 5, shared with the
    replays): the drafted and accepted counts with the step's seconds, the verified tree's accepted
    path per row (``accepted``: node indices, -1 padded), and each shadow draft scored against
    ``texts``, the tokens each row committed. ``grew``, ``resume``, ``catch_up``: see
    ``DraftLengthController.update``."""
    drafted = tree.num_nodes.tolist()
    controller.update(drafted, [sum(a >= 0 for a in acc) for acc in accepted], verify_time, draft_time, key,
                      grew=grew, resume=resume, catch_up=catch_up)
    if any(drafted):
        controller.observe_tree(tree.real_nodes()[0], accepted, key)
    for sh in shadows:
        paths = [path_along(p, t, x) for p, t, x in zip(sh.parents, sh.tokens, texts)]
        controller.observe_shadow(sh.parents, paths, [len(x) for x in texts], sh.seconds, sh.key)


class SpecDecoder:
    def __init__(self, target, drafter: Drafter | Chooser | None = None,
                 config: SpecDecoderConfig = SpecDecoderConfig()) -> None:
        self.target = target.eval()
        self.drafter = drafter  # as given: a drafter, several sources (drafters.chooser.Sources), or None
        self.chooser = as_chooser(drafter)  # what the loop drafts through
        self.config = config
        self.vocab_size = vocab_size_of(target)
        cfg = text_config(target)
        self.context_window = getattr(cfg, "max_position_embeddings", None)
        self.sliding_window = sliding_window(cfg)
        # learns across generate calls: this machine's verify times, each draft class's acceptance and gain
        self.controller = DraftLengthController(config.draft_length)
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
                 seed: int | None = None) -> GenerateOutput:
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
        """
        if not hasattr(type(max_new_tokens), "__index__") or operator.index(max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        ids, prompts = self._check_input(input_ids, attention_mask)
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
        pad = _pad_id(pad_token_id, eos_token_id, self.target)
        sampling = SamplingParams.resolve(self.target, temperature, top_k, top_p) if do_sample else None
        if sampling is not None and generator is None:
            seed = int(torch.randint(2**62, ())) if seed is None else seed
            generator = torch.Generator().manual_seed(seed)  # CPU: uniforms drawn here, on any device
        modules = [self.target] + (self.drafter.torch_modules() if self.drafter is not None else [])
        # Llama-shaped models run the lean forward (specdec.runtime.fastpath), built and checked here, not in step 1
        runtime = self.config.runtime or current_runtime()
        paths = [p for p in (fastpath.get(m, runtime) for m in modules) if p is not None]
        replaced = [m for p in paths for m in p.replaced()]
        # the CPU kernels serve CPU targets only: elsewhere no self-check, no build, no patched linears
        rows = self.config.skinny_rows if self.target.device.type == "cpu" else 0
        with torch.inference_mode(), kernels.skinny_linears(*modules, max_rows=rows, skip=replaced, runtime=runtime):
            kernels.prepack([w for p in paths for w in p.fused_weights()], rows)
            batch, steps = self._generate(prompts, max_new_tokens, _eos_set(eos_token_id, self.target),
                                          streamer, callback, _Acceptance(sampling, generator))
        new = [batch.new[s] for s in range(len(prompts))]
        width = max(len(n) for n in new)
        tail = torch.full((len(prompts), width), pad, dtype=torch.long)
        for s, n in enumerate(new):
            tail[s, : len(n)] = torch.tensor(n, dtype=torch.long)
        return GenerateOutput(torch.cat([ids, tail], dim=1), ids.shape[1], steps, [len(n) for n in new],
                              batch.steps, batch.accepted)

    def _generate(self, prompts: list[torch.Tensor], max_new_tokens, eos, streamer, callback,
                  judge: _Acceptance):
        B, device = len(prompts), self.target.device
        if self.context_window is not None:
            max_new_tokens = min(max_new_tokens, self.context_window - max(len(p) for p in prompts))
        batch = _Batch(B, max_new_tokens, eos)
        controller = self.controller
        controller.new_run(B)
        cache = BMCCache.for_model(self.target, B, self.config.bmc)
        if self.config.adaptive_period:
            model = _period_model(self.target)
            cache.period_policy = lambda held: model.period(held + batch.wanted(), held)
            cache.set_period(cache.period_policy(max(len(p) for p in prompts)))
        if streamer is not None:
            streamer.put(prompts[0][None].cpu())
        steps: list[StepStats] = []
        # 0. prefill on the causal fast path (prompts of one length together), K/V copied into store rows
        t0 = time.perf_counter()
        ver, commit = self._prefill(cache, prompts, judge)
        stats = StepStats([0] * B, [0] * B, 0.0, time.perf_counter() - t0, list(range(B)))
        live = self._finish_step(batch, cache, commit, stats, steps, streamer, callback)
        pending = ver.next_token[live, None].to(device)  # [B', 1]
        while batch.rows:
            # 1. draft: never more than the tokens some sequence still wants after its bonus token
            t0 = time.perf_counter()
            # shadow drafts are scored against the committed text: greedy only (a sampled token
            # that differs from a draft does not mean the draft would have been rejected)
            shadow = self.config.shadow_drafts and judge.sampling is None
            key, tree, shadows = draft_step(self.chooser, controller, len(batch.rows), batch.wanted(), shadow)
            t1 = time.perf_counter()
            # 2.-4. one target forward over [pending, nodes] per row, greedy walk, commit the kept rows
            allocations = cache.num_allocations
            ver, hidden, split = self._verify(cache, pending, tree, judge)
            commit = _make_commit(tree, ver, hidden)
            t2 = time.perf_counter()
            stats = StepStats(tree.num_nodes.tolist(), ver.num_accepted.tolist(), t1 - t0, t2 - t1,
                              list(batch.rows), split)
            # 5. the controller adapts; outputs grow; the drafter learns; finished rows leave
            # a drafter's catch-up (EAGLE's head fed a whole prompt) is not the price of this draft's size;
            # the part after a pause is a price of drafting again (the step's gain)
            catch_up, resume = (self.chooser.catch_up_seconds(), self.chooser.resume_seconds()) \
                if self.chooser is not None else (0.0, 0.0)
            texts = [commit.new_tokens(b) for b in range(len(batch.rows))] if shadows else []
            learn_step(controller, key, tree, ver.accepted.tolist(), stats.verify_time,
                       max(0.0, stats.draft_time - catch_up), shadows, texts,
                       grew=cache.num_allocations != allocations, resume=resume, catch_up=catch_up)
            live = self._finish_step(batch, cache, commit, stats, steps, streamer, callback)
            controller.set_batch(len(live))
            pending = ver.next_token[live, None].to(device)
        if streamer is not None:
            streamer.end()
        return batch, steps

    # -- stages

    @property
    def _reads_hidden(self) -> bool:
        """The drafter reads the target's hidden states: the prefill and verify keep them."""
        return self.chooser is not None and self.chooser.capabilities.reads_hidden_states

    @property
    def _hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs the drafter reads instead of the last hidden state (EAGLE-3)."""
        return self.chooser.capabilities.hidden_layers if self.chooser is not None else ()

    def _prefill(self, cache: BMCCache, prompts: list[torch.Tensor],
                 judge: _Acceptance) -> tuple[Verification, Commit]:
        """Prompts of one length together (no padding: HF's unpadded prefill), each length alone,
        through ``forward.prefill`` into their rows; the first token of each."""
        want_hidden = self._reads_hidden
        B, P = len(prompts), max(len(p) for p in prompts)
        groups: dict[int, list[int]] = {}
        for b, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(b)
        logits: list[torch.Tensor | None] = [None] * B
        hidden: list[torch.Tensor | None] = [None] * B
        # at most PREFILL_TOKENS per forward: its DynamicCache is a transient second copy of those rows'
        # K/V (why: docs/decisions/011-prefill-chunks.md)
        chunks = [rows[i : i + max(1, PREFILL_TOKENS // n)] for n, rows in groups.items()
                  for i in range(0, len(rows), max(1, PREFILL_TOKENS // n))]
        for rows in chunks:
            pre = prefill(self.target, torch.stack([prompts[b] for b in rows]), want_hidden, self._hidden_layers)
            for g, b in enumerate(rows):
                cache.load_prefill(b, [(k[g], v[g]) for k, v in pre.layers], capacity=P)
                logits[b] = pre.logits[g]
                hidden[b] = pre.hidden[g] if want_hidden else None
        ver = judge(torch.stack(logits)[:, None], DraftTree.empty(B))  # the first token: nothing drafted
        last = torch.stack([h[-1:] for h in hidden]) if want_hidden else None  # [B, 1, D]
        if self.chooser is not None:
            ids = torch.zeros(B, P, dtype=torch.long)  # right-padded, as Prompt says
            prefix = torch.zeros(B, max(P - 1, 0), hidden[0].shape[-1], dtype=hidden[0].dtype) if want_hidden else None
            for b, p in enumerate(prompts):
                ids[b, : len(p)] = p
                if want_hidden:
                    prefix[b, : len(p) - 1] = hidden[b][:-1]
            lengths = torch.tensor([len(p) for p in prompts])
            self.chooser.begin(Prompt(ids, lengths, prefix, cache, judge.sampling, judge.generator))
        return ver, _make_commit(DraftTree.empty(B), ver, last)

    def _verify(self, cache: BMCCache, pending: torch.Tensor, tree: DraftTree, judge: _Acceptance):
        """One target forward over [pending token, tree nodes] per row; keep pending + the accepted path
        (the greedy walk, or rejection sampling against the processed distribution).

        Returns the verification, the target's last hidden states at the kept rows [B, 1 + A, D] if
        the drafter reads them (row j produced new token j), and whether attention ran SPLIT.
        """
        want_hidden = self._reads_hidden
        B, N = tree.tokens.shape
        block_ids = torch.cat([pending, tree.tokens.to(pending.device)], dim=1)  # [B, 1 + N]
        if _is_chain(tree):
            mask = depth = None  # causal block: the store's fast path (ragged chains are causal too)
        else:
            mask = ancestor_mask(tree.parents, tree.num_nodes)
            depth = torch.cat([torch.zeros(B, 1, dtype=torch.long), node_depths(tree.parents)], dim=1)
        split = self._split(cache, 1 + N)
        res = forward_block(self.target, cache, block_ids, mask, depth, want_hidden, split, self._hidden_layers)
        ver = judge(res.logits, tree)
        kept = ver.kept_rows()
        cache.commit(kept)
        hidden = None
        if want_hidden:
            width = max(len(k) for k in kept)
            idx = torch.tensor([k + [k[-1]] * (width - len(k)) for k in kept], device=res.hidden.device)
            hidden = res.hidden.gather(1, idx[:, :, None].expand(-1, -1, res.hidden.shape[-1]))
        return ver, hidden, split

    def _split(self, cache: BMCCache, q: int) -> bool:
        """SPLIT attention this step? auto: when PAD's padded columns would be over split_waste of them.
        Example: lengths [200, 4000], q 4: PAD 8008 columns, 4208 needed -> waste 0.47 -> SPLIT."""
        mode = self.config.attention
        if cache.batch_size == 1 or mode == "pad":
            return False
        if mode == "split":
            return True
        padded = cache.batch_size * (cache.max_length + q)
        return 1 - sum(n + q for n in cache.lengths) / padded > self.config.split_waste

    def _finish_step(self, batch: _Batch, cache: BMCCache, commit: Commit, stats: StepStats,
                     steps: list[StepStats], streamer, callback) -> list[int]:
        """Record the step, stream it, let the drafter learn, drop finished rows; the live rows."""
        steps.append(stats)
        before = len(batch.new[batch.rows[0]])
        keep = batch.extend(commit, stats, callback)
        if streamer is not None:  # batch size 1: the one sequence's tokens of this step
            streamer.put(torch.tensor(batch.new[0][before:]))
        if self.chooser is not None:  # also after the last step: a drafter's state ends in step
            self.chooser.accept(commit)
        if len(keep) < len(batch.rows):  # compaction: one gather per buffer, in the store and the drafter
            if keep:
                cache.select(keep)
                if self.chooser is not None:
                    self.chooser.select(keep)
            batch.rows = [batch.rows[r] for r in keep]
        return keep

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


def _is_chain(tree: DraftTree) -> bool:
    N = tree.width
    return bool((tree.parents == torch.arange(-1, N - 1, device=tree.parents.device)).all())


def _make_commit(tree: DraftTree, ver: Verification, hidden: torch.Tensor | None) -> Commit:
    """Accepted drafted tokens then the target's token, per row: tokens [B, A + 1]."""
    B = tree.batch_size
    A = ver.accepted.shape[1]
    tokens = torch.zeros(B, A + 1, dtype=torch.long)
    if A:
        path_tokens = tree.tokens.cpu().gather(1, ver.accepted.clamp(min=0))
        tokens[:, :A] = torch.where(ver.accepted >= 0, path_tokens, 0)
    tokens[torch.arange(B), ver.num_accepted] = ver.next_token.cpu()
    return Commit(tokens, ver.num_accepted + 1, ver.num_accepted, hidden)


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


def _period_model(target):
    """The BMC period model for the target's attention shape (calibrated once per process)."""
    _, kv_heads, head_dim = attention_shape(target)
    return period.machine_model(kv_heads, head_dim, target.dtype)
