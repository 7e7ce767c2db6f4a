"""SpecDecoder: draft -> verify -> accept -> commit, until done.

    out = SpecDecoder(target, PromptLookupDrafter()).generate(input_ids, max_new_tokens=128)
    out.sequences      # [B, P + new], exactly what target.generate(..., do_sample=False) returns
    out = decoder.generate(input_ids, do_sample=True, temperature=0.7, top_p=0.9, seed=0)
                       # distributed exactly as target.generate(..., do_sample=True, same arguments)
    out.steps          # per step: drafted / accepted counts, draft and verify seconds

Invariant between steps: the target's BMC store holds every committed token but the last one, the
*pending* token, which opens the next verify block (row 0), followed by the draft tree's nodes.
The first step's pending block is the whole prompt (the prefill), with nothing drafted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec import kernels
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.drafters.model import vocab_size_of
from specdec.forward import forward_block
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree, ancestor_mask, node_depths
from specdec.verifiers.sampling import verify_sampling
from specdec.verifiers.tree import Verification, verify_greedy


@dataclass(frozen=True)
class SpecDecoderConfig:
    bmc: BMCConfig = BMCConfig(period=64)  # T for the target's store
    draft_length: DraftLengthConfig = DraftLengthConfig()
    # CPU: linear layers over blocks of <= this many rows take specdec.kernels' routes (MKL's
    # skinny GEMM for 1-4 rows, the packed kernel for 5-16); 0 keeps torch's default path everywhere
    skinny_rows: int = kernels.MAX_ROWS


@dataclass(frozen=True)
class StepStats:
    num_drafted: list[int]  # per sequence: real draft nodes verified this step
    num_accepted: list[int]  # per sequence: drafted tokens kept (the step yields this + 1)
    draft_time: float  # seconds in drafter.propose
    verify_time: float  # seconds in the target forward, verification and commit


@dataclass(frozen=True)
class StepEvent:
    """What one step appended to the (single) sequence, for streaming UIs."""

    tokens: list[int]  # the new tokens, after max_new_tokens / EOS truncation
    from_draft: int  # how many of the leading tokens were accepted drafts (the rest: the target's)
    stats: StepStats


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [B, P + new] prompt then generated tokens, like HF generate
    prompt_length: int
    steps: list[StepStats] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return self.sequences.shape[1] - self.prompt_length

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per target forward (accepted drafts + 1), Spec-Bench's tau; 1.0 = no gain."""
        return self.new_tokens / max(1, len(self.steps))

    @property
    def draft_time(self) -> float:
        return sum(s.draft_time for s in self.steps)

    @property
    def verify_time(self) -> float:
        return sum(s.verify_time for s in self.steps)


class SpecDecoder:
    def __init__(self, target, drafter: Drafter | None = None,
                 config: SpecDecoderConfig = SpecDecoderConfig()) -> None:
        self.target = target.eval()
        self.drafter = drafter
        self.config = config
        self.vocab_size = vocab_size_of(target)
        cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.context_window = getattr(cfg, "max_position_embeddings", None)
        if drafter is not None and drafter.vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"drafter vocabulary ({drafter.vocab_size} tokens) does not match the target's "
                f"({self.vocab_size} tokens): a drafter must share the target's tokenizer")

    def _check_input(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        B = input_ids.shape[0]
        if B != 1:
            raise ValueError(f"batch size {B} is not supported yet (batched verification is a later "
                             "issue): pass one sequence at a time")
        if attention_mask is not None:  # drop left/right padding of the single row
            input_ids = input_ids[:, attention_mask[0].bool().to(input_ids.device)]
        P = input_ids.shape[1]
        if P == 0:
            raise ValueError("empty prompt: input_ids has no tokens (SpecDecoder needs at least one)")
        if self.context_window is not None and P >= self.context_window:
            raise ValueError(f"prompt of {P} tokens does not fit the model's context window of "
                             f"{self.context_window} tokens (no room left to generate)")
        return input_ids.to(torch.long)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 128, eos_token_id=None,
                 attention_mask: torch.Tensor | None = None, streamer=None, callback=None,
                 do_sample: bool = False, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 seed: int | None = None) -> GenerateOutput:
        """Greedy generation, token-identical to ``target.generate(..., do_sample=False)``; or, with
        ``do_sample=True``, sampling distributed exactly as ``target.generate(do_sample=True, ...)``
        with the same temperature / top_k / top_p (unset ones as HF fills them: the target's
        generation_config, else temperature 1, top_k 50, top_p 1; see ``specdec.sampling``).
        Randomness: ``generator`` if given, else a new one seeded with ``seed``, else one seeded from
        torch's global RNG (so ``torch.manual_seed`` fixes it, as with HF). A seed repeats a run
        only if the drafts repeat too: the default controller sizes drafts from measured times, so
        for bit-repeatable samples use ``DraftLengthConfig(cost_aware=False)`` (the distribution is
        exact either way). Without do_sample the sampling arguments are ignored, as HF ignores them.

        eos_token_id: int or list (default: the target's generation config); the EOS is kept, as HF
        does. streamer: HF-style object with put(tokens)/end() (e.g. ``TextStreamer``).
        callback: called with a ``StepEvent`` after each step (new tokens, how many were drafted).
        max_new_tokens is clipped to the room left in the context window.
        """
        modules = [self.target] + (self.drafter.torch_modules() if self.drafter is not None else [])
        sampling = SamplingParams.resolve(self.target, temperature, top_k, top_p) if do_sample else None
        if sampling is not None and generator is None:
            seed = int(torch.randint(2**62, ())) if seed is None else seed
            generator = torch.Generator().manual_seed(seed)  # CPU: the verifier samples on the CPU
        with torch.inference_mode(), kernels.skinny_linears(*modules, max_rows=self.config.skinny_rows):
            return self._generate(input_ids, max_new_tokens, eos_token_id, attention_mask, streamer, callback,
                                  sampling, generator)

    def _generate(self, input_ids, max_new_tokens, eos_token_id, attention_mask, streamer, callback,
                  sampling, generator):
        ids = self._check_input(input_ids, attention_mask)
        B, P = ids.shape
        device = self.target.device
        eos = _eos_set(eos_token_id, self.target)
        if self.context_window is not None:
            max_new_tokens = min(max_new_tokens, self.context_window - P)
        want_hidden = self.drafter is not None and self.drafter.needs_hidden_states
        controller = DraftLengthController(self.config.draft_length)
        cache = BMCCache.for_model(self.target, B, self.config.bmc)
        if streamer is not None:
            streamer.put(ids.cpu())
        out = GenerateOutput(ids, P)
        new: list[int] = []
        # Step 0 is the prefill: the whole prompt is the pending block and nothing is drafted, so
        # one forward gives the first token (as in HF). After it, one pending token per step.
        pending = ids.to(device)  # [B, p]
        while len(new) < max_new_tokens:
            # 1. draft: never more than the tokens still wanted after the bonus token
            wanted = max_new_tokens - len(new) - 1
            t0 = time.perf_counter()
            key = self.drafter.draft_class() if self.drafter is not None and new else None
            if self.drafter is None or not new:
                budget = 0
            elif self.drafter.follows_controller:
                budget = min(controller.budget(key), wanted)
            else:  # the drafter sizes its own tree; the controller only says whether drafting pays
                budget = wanted if controller.gate(key) else 0
            tree = (self.drafter.propose(budget) if self.drafter is not None and budget > 0
                    else DraftTree.empty(B))
            t1 = time.perf_counter()
            # 2.-4. one target forward over [pending, nodes], greedy walk, commit the kept rows
            ver, hidden = self._verify(cache, pending, tree, want_hidden, sampling, generator)
            commit = _make_commit(tree, ver, None if hidden is None else hidden[:, P - 1 if not new else 0:])
            t2 = time.perf_counter()
            if not new and self.drafter is not None:
                prefix = None if hidden is None else hidden[:, : P - 1]
                self.drafter.begin(Prompt(ids, torch.full((B,), P), prefix, sampling=sampling,
                                          generator=generator))
            # 5. finish the step: output grows, the drafter learns, the controller adapts
            step_tokens = commit.new_tokens(0)[: max_new_tokens - len(new)]
            stop = next((i for i, t in enumerate(step_tokens) if t in eos), None)
            if stop is not None:
                step_tokens = step_tokens[: stop + 1]
            new.extend(step_tokens)
            stats = StepStats(tree.num_nodes.tolist(), ver.num_accepted.tolist(), t1 - t0, t2 - t1)
            out.steps.append(stats)
            if streamer is not None:
                streamer.put(torch.tensor(step_tokens))
            if callback is not None:
                callback(StepEvent(step_tokens, min(len(step_tokens), stats.num_accepted[0]), stats))
            if stop is not None:
                break
            if self.drafter is not None:
                self.drafter.accept(commit)
            if len(out.steps) > 1:  # the prefill's time says nothing about a decode step's cost
                controller.update(stats.num_drafted, stats.num_accepted, stats.verify_time, stats.draft_time, key)
            pending = ver.next_token[:, None].to(device)
        if streamer is not None:
            streamer.end()
        out.sequences = torch.cat([ids, torch.tensor([new], dtype=torch.long)], dim=1)
        return out

    def _verify(self, cache: BMCCache, pending: torch.Tensor, tree: DraftTree, want_hidden: bool,
                sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> tuple[Verification, torch.Tensor | None]:
        """One target forward over [pending block (p tokens), tree nodes]; keep pending + path
        (greedy walk, or rejection sampling against the processed distribution when sampling).

        Returns the verification and, if asked, the target's last hidden states at the kept rows
        [B, p + A, D] (row p - 1 + j produced new token j).
        """
        B, N = tree.tokens.shape
        p = pending.shape[1]
        block_ids = torch.cat([pending, tree.tokens.to(pending.device)], dim=1)  # [B, p + N]
        if _is_chain(tree):
            mask = depth = None  # causal block: the store's fast path
        else:
            assert p == 1, "a tree hangs off a single pending token"
            mask = ancestor_mask(tree.parents, tree.num_nodes)
            depth = torch.cat([torch.zeros(B, 1, dtype=torch.long), node_depths(tree.parents)], dim=1)
        res = forward_block(self.target, cache, block_ids, mask, depth, want_hidden)
        logits = res.logits[:, p - 1 :].float().cpu()  # [B, 1 + N, V]
        if sampling is None:
            ver = verify_greedy(logits, _to_cpu(tree))
        else:
            ver = verify_sampling(target_probs(logits, sampling), _to_cpu(tree), generator)
        kept = [list(range(p - 1)) + [p - 1 + r for r in rows] for rows in ver.kept_rows()]
        cache.commit(kept)
        hidden = None
        if want_hidden:
            width = max(len(k) for k in kept)
            idx = torch.tensor([k + [k[-1]] * (width - len(k)) for k in kept], device=res.hidden.device)
            hidden = res.hidden.gather(1, idx[:, :, None].expand(-1, -1, res.hidden.shape[-1]))
        return ver, hidden


def _is_chain(tree: DraftTree) -> bool:
    N = tree.width
    return bool((tree.parents == torch.arange(-1, N - 1, device=tree.parents.device)).all())


def _to_cpu(tree: DraftTree) -> DraftTree:
    probs = None if tree.probs is None else tree.probs.cpu()
    return DraftTree(tree.tokens.cpu(), tree.parents.cpu(), tree.num_nodes.cpu(), probs)


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
    if eos_token_id is None:
        gen = getattr(target, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}
