"""The server's decode loop: requests joining a running batch answer exactly as alone, with drafts
accepted; the per-request sampling rule samples the target's distribution, and a seed's answer depends
neither on the drafts nor on the batch."""

import threading

import pytest
import torch

import specdec.serve.acceptance as acceptance
from specdec import SpecDecoder as _SpecDecoder
from specdec.bench.distribution import pair_mismatch
from specdec.config import RuntimeConfig
from specdec.controller.draft_length import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.sampling import SamplingParams, target_probs
from specdec.serve.acceptance import GumbelStream, RowAcceptance, RowRule
from specdec.serve.engine import Busy, Engine, EngineConfig, Request
from specdec.tree import DraftTree

from conftest import hf_greedy, tiny_llama


def SpecDecoder(target, drafter, cost_aware: bool = True):
    """No kernel self-check (seconds on a busy machine; the tiny float64 model never uses the kernels).
    ``cost_aware`` False: drafts at every step whatever the timings (tests that count accepted drafts)."""
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=cost_aware),
                               runtime=RuntimeConfig(calibrate=False))
    return _SpecDecoder(target, drafter, config)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


def _self_drafter() -> ModelDrafter:
    """The ``target`` fixture's own weights drafting: its greedy drafts are the target's greedy tokens."""
    return ModelDrafter(tiny_llama(0))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeats in them, so lookup and suffix drafts are accepted in part."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(1, 128, (4 + i,), generator=g).tolist()
        out.append(motif * 3 + torch.randint(1, 128, (3 + 2 * i,), generator=g).tolist())
    return out


class _Client:
    """A request's updates, collected; ``hold``: the engine thread waits in the first update until it is set."""

    def __init__(self, engine: Engine, prompt, max_new, sampling=None, seed=None, hold=None) -> None:
        self.tokens, self.finish, self.done = [], None, threading.Event()
        self.drafted = self.accepted = 0  # draft tokens verified for this request, and kept
        self.first, self.hold = threading.Event(), hold
        self.handle = engine.submit(Request(prompt, max_new, sampling, seed, self._emit))

    def _emit(self, u) -> None:
        self.tokens += u.tokens
        self.drafted += u.drafted
        self.accepted += u.from_draft
        if not self.first.is_set():
            self.first.set()
            if self.hold is not None:
                self.hold.wait(30)
        if u.finish is not None:
            self.finish = u.finish
            self.done.set()


@pytest.mark.parametrize("make", [PromptLookupDrafter, SuffixDrafter], ids=["lookup", "suffix"])
def test_requests_joining_mid_batch_answer_as_generate_alone(target, make):
    """And drafts were accepted on the way (the prompts repeat; drafting is not priced, so it happens
    whatever the timings): a verifier that rejected every draft would answer the same and fail here."""
    prompts, max_new = _prompts(5), [20, 6, 24, 14, 10]
    engine = Engine(SpecDecoder(target, make(), cost_aware=False), eos=set(), config=EngineConfig(max_batch=4))
    engine.start()
    try:
        hold = threading.Event()
        first = [_Client(engine, prompts[0], max_new[0], hold=hold), _Client(engine, prompts[1], max_new[1])]
        assert first[0].first.wait(30)  # its first token: the batch is live and waits for the next ones
        later = [_Client(engine, p, m) for p, m in zip(prompts[2:], max_new[2:])]
        hold.set()
        for c in first + later:
            assert c.done.wait(60)
    finally:
        engine.stop()
    for p, m, c in zip(prompts, max_new, first + later):
        alone = SpecDecoder(target, make(), cost_aware=False).generate(torch.tensor(p), max_new_tokens=m)
        assert c.tokens == alone.generated(0).tolist()
        assert 0 <= c.accepted <= c.drafted
        if make is SuffixDrafter:  # and the target's own greedy output (once: generate is pinned to it elsewhere)
            assert c.tokens == hf_greedy(target, torch.tensor([p]), m)[0, len(p):].tolist()
        assert c.finish == "length"
    assert engine.counters.tokens == sum(max_new)
    assert engine.counters.joins >= 1  # some arrived while rows were live
    clients = first + later
    assert sum(c.accepted for c in clients) > 0, [(c.drafted, c.accepted) for c in clients]
    # /metrics counts what the verifier kept; a request, what its answer kept (not cut by max_tokens)
    assert sum(engine.counters.drafted.values()) == sum(c.drafted for c in clients)
    assert sum(engine.counters.accepted.values()) >= sum(c.accepted for c in clients)


def _answer(engine: Engine, prompt, max_new, sampling, seed, mates=()) -> _Client:
    """The seeded request's answer; ``mates`` (prompt, max_new, sampling, seed) start first and the
    request joins their running batch."""
    engine.start()
    try:
        hold = threading.Event()
        others = [_Client(engine, *m, hold=hold if i == 0 else None) for i, m in enumerate(mates)]
        if others:
            assert others[0].first.wait(30)  # the batch is live (the engine thread waits in its emit)
        c = _Client(engine, prompt, max_new, sampling, seed)
        hold.set()
        for x in others + [c]:
            assert x.done.wait(60)
    finally:
        engine.stop()
    return c


def test_a_seed_answers_the_same_with_and_without_drafts_whatever_the_batch(target):
    """README's promise: a seed gives the same answer whatever else is running, with or without drafts.
    The seeded request alone on a decoder that never drafts == the same request joining a running batch
    of greedy and sampled mates on one whose drafts it accepts; another seed answers otherwise."""
    sampling = SamplingParams(temperature=0.7, top_k=20)
    prompt, max_new = _prompts(1)[0], 24
    plain = _answer(Engine(SpecDecoder(target, None), eos=set()), prompt, max_new, sampling, 1234)
    mates = [(p, m, s, seed) for p, m, s, seed in zip(_prompts(3, 1), [30, 8, 16], [None, sampling, sampling],
                                                     [None, 7, None])]
    engine = Engine(SpecDecoder(target, _self_drafter(), cost_aware=False), eos=set(), config=EngineConfig(max_batch=4))
    drafted = _answer(engine, prompt, max_new, sampling, 1234, mates)
    assert engine.counters.joins >= 1  # it joined a live batch
    assert plain.drafted == 0 and drafted.accepted > 0, (drafted.drafted, drafted.accepted)
    assert drafted.tokens == plain.tokens and len(plain.tokens) == max_new
    other = _answer(Engine(SpecDecoder(target, None), eos=set()), prompt, max_new, sampling, 99)
    assert other.tokens != plain.tokens  # the seed matters


# -- the per-request sampling rule's distribution: RowAcceptance on hand-built logits, no model

V_DIST = 5
L0 = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5], dtype=torch.float64)  # [V] the first token's logits
L1 = torch.stack([L0.roll(t) for t in range(V_DIST)])  # [V, V] the second's after each first token
DIST_SAMPLING = SamplingParams(temperature=0.6, top_k=4)  # top-k: token 4 never comes first
# step 1's draft, a tree: tokens 0 and 1 for the first position, token 2 after 0 for the second
DIST_TREE = ([0, 1, 2], [-1, -1, 0])  # (tokens [N], parents [N])
_advance = GumbelStream.advance
WRONG_RULES = {  # deliberately wrong pieces of specdec.serve.acceptance: (owner, name, replacement)
    # every node of a block judged with the pending row's noise (depth offsets dropped)
    "shared-noise": (acceptance, "node_depths", lambda parents: torch.zeros_like(parents)),
    # the stream moves on by the accepted drafts only, not the bonus token: the next step reuses its noise
    "stale-noise": (GumbelStream, "advance", lambda self, n: _advance(self, n - 1)),
    # the unprocessed distribution (temperature and top-k ignored)
    "raw-logits": (acceptance, "target_probs", lambda logits, params: torch.softmax(logits.to(torch.float64), -1)),
}


def _first_two_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two tokens [n, 2] of n seeded requests (seeds 0..n-1) under ``RowAcceptance``, the
    engine's rule, over two steps as a session runs them: step 1 verifies DIST_TREE (block rows: the
    pending token, then each node, with the logits of the position each predicts); rows that kept no
    draft take step 2 (pending: their first token, a one-token draft [3]). Also the drafts each row
    kept in step 1 [n]."""
    judge = RowAcceptance([RowRule.make(DIST_SAMPLING, seed) for seed in range(n)])
    tokens, parents = (torch.tensor([x] * n) for x in DIST_TREE)
    block = torch.stack([L0, L1[0], L1[1], L0]).expand(n, 4, V_DIST)  # [B, 1 + N, V]; node 2's row: unused
    ver = judge(block, DraftTree(tokens, parents, torch.full((n,), 3)))
    k, path = ver.num_accepted, torch.nn.functional.pad(ver.accepted, (0, 2), value=-1)  # [B], [B, >= 2]
    drafted = tokens.gather(1, path[:, :2].clamp(min=0))  # [B, 2] the accepted nodes' tokens
    first = torch.where(k > 0, drafted[:, 0], ver.next_token)
    second = torch.where(k > 1, drafted[:, 1], ver.next_token)
    again = (k == 0).nonzero()[:, 0]  # [R] rows whose first token was the bonus: a second step
    judge.select(again.tolist())
    R = len(again)
    ver2 = judge(torch.stack([L1[first[again]], L0.expand(R, V_DIST)], dim=1),  # [R, 2, V]
                 DraftTree.chain(torch.full((R, 1), 3)))
    second[again] = torch.where(ver2.num_accepted > 0, 3, ver2.next_token)
    return torch.stack([first, second], dim=1), k


def _exact_joint() -> torch.Tensor:
    """[V, V] p(x) p(y | x), the target's processed distributions."""
    p0 = target_probs(L0[None, None], DIST_SAMPLING)[0, 0]  # [V]
    p1 = target_probs(L1[None], DIST_SAMPLING)[0]  # [V, V]
    return p0[:, None] * p1


def test_seeded_sampling_draws_the_first_two_tokens_from_the_target_distribution():
    """Over 4000 seeds, with drafts accepted whole, in part or not at all: the pairs match p(x) p(y | x)
    (chi-square and total variation, specdec.bench.distribution), and a filtered token never comes."""
    pairs, kept = _first_two_tokens(4000)
    assert all((kept == k).any() for k in (0, 1, 2))  # none, one and both of the drafts kept: every path
    mismatch = pair_mismatch(pairs, _exact_joint())
    assert mismatch is None, mismatch
    assert (pairs[:, 0] != 4).all()


@pytest.mark.parametrize("wrong", sorted(WRONG_RULES))
def test_the_distribution_test_fails_a_wrong_sampling_rule(monkeypatch, wrong):
    """The same check rejects each deliberately wrong rule (fewer seeds: each is off by far)."""
    monkeypatch.setattr(*WRONG_RULES[wrong])
    mismatch = pair_mismatch(_first_two_tokens(2000)[0], _exact_joint())
    assert mismatch is not None and "chi-square" in mismatch


def test_gumbel_rule_samples_the_target_distribution():
    """log p + per-position Gumbel noise, argmax: over many positions the frequencies approach the
    processed p (a rule without the noise, or over the unprocessed logits, fails)."""
    from specdec.sampling import target_probs
    from specdec.serve.acceptance import gumbel_scores

    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, 0.5]]])  # [B=1, Q=1, V=5]
    p = target_probs(logits, SamplingParams(temperature=0.7, top_k=4))[0, 0]  # [V]
    n = 20000
    noise = GumbelStream(0).take(n, 5)  # [n, V]: one row per position
    picks = gumbel_scores(p.expand(n, 5), noise).argmax(-1)
    freq = torch.bincount(picks, minlength=5).double() / n
    assert freq[3] == 0  # top-k removed it
    assert torch.allclose(freq, p, atol=0.01)
    raw = torch.softmax(logits[0, 0].double(), -1)  # the unprocessed distribution is another one
    assert not torch.allclose(freq, raw, atol=0.01)


def test_a_full_queue_refuses_with_retry_after(target):
    engine = Engine(SpecDecoder(target, None), eos=set(), config=EngineConfig(max_batch=1, max_queue=1))
    engine.submit(Request([1, 2, 3], 4, None, None, lambda u: None))  # not started: it waits
    with pytest.raises(Busy) as e:
        engine.submit(Request([1, 2, 3], 4, None, None, lambda u: None))
    assert e.value.retry_after >= 1 and "waiting" in str(e.value)


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(target):
    engine = Engine(SpecDecoder(target, None), eos=set(), config=EngineConfig(max_batch=4))
    engine.start()
    try:
        long_ = _Client(engine, _prompts(1)[0], 400)
        other = _Client(engine, _prompts(2)[1], 60)
        assert long_.first.wait(30)
        engine.cancel(long_.handle)
        assert long_.done.wait(30) and long_.finish == "cancelled"
        assert other.done.wait(60) and other.finish == "length"
        assert len(long_.tokens) < 400 and engine.session.rows == []
    finally:
        engine.stop()


def test_a_request_stops_at_its_eos_as_generate_does(target):
    prompt = _prompts(1)[0]
    free = SpecDecoder(target, None).generate(torch.tensor(prompt), max_new_tokens=12).generated(0).tolist()
    eos = free[5]
    expected = free[: free.index(eos) + 1]
    engine = Engine(SpecDecoder(target, PromptLookupDrafter()), eos={eos})
    engine.start()
    try:
        c = _Client(engine, prompt, 12)
        assert c.done.wait(30)
    finally:
        engine.stop()
    assert c.tokens == expected and c.finish == "stop"


class _HiddenReader(PromptLookupDrafter):
    """Declares that it reads hidden states (as EAGLE does): it cannot restart from text alone."""

    from specdec.drafters.base import Capabilities

    capabilities = Capabilities(reads_hidden_states=True, free_drafts=True, batches=True, samples=True)


def test_a_drafter_reading_hidden_states_takes_requests_in_waves(target):
    prompts, max_new = _prompts(3), [12, 6, 8]
    engine = Engine(SpecDecoder(target, _HiddenReader()), eos=set(), config=EngineConfig(max_batch=4))
    engine.start()
    try:
        hold = threading.Event()
        first = _Client(engine, prompts[0], max_new[0], hold=hold)
        assert first.first.wait(30)
        later = [_Client(engine, p, m) for p, m in zip(prompts[1:], max_new[1:])]
        hold.set()
        for c in [first] + later:
            assert c.done.wait(60)
    finally:
        engine.stop()
    assert engine.counters.joins == 0  # the later ones waited for the batch to empty
    for p, m, c in zip(prompts, max_new, [first] + later):
        assert c.tokens == SpecDecoder(target, None).generate(torch.tensor(p), max_new_tokens=m).generated(0).tolist()


def test_rows_joining_a_priced_out_batch_restart_the_drafters_only_when_a_step_drafts(target, monkeypatch):
    """A join marks the drafters behind instead of restarting them: a batch whose drafting is priced out
    pays no restart per join (nor an accept per step); the first step that drafts restarts them on every
    live row, and every answer is still the target's greedy output."""
    from specdec.serve.acceptance import RowAcceptance, RowRule
    from specdec.session import DecodeSession

    decoder = SpecDecoder(target, PromptLookupDrafter())
    prompts, max_new = _prompts(3), [16, 16, 12]
    priced_out = [True]
    monkeypatch.setattr(decoder.controller, "priced_out", lambda: priced_out[0])
    begins, begin = [], decoder.chooser.begin
    monkeypatch.setattr(decoder.chooser, "begin", lambda p: begins.append(p.input_ids.shape[0]) or begin(p))
    tokens: dict[int, list[int]] = {}

    def collect(events):
        for e in events:
            tokens.setdefault(e.sequence, []).extend(e.tokens)

    def judge(n):
        return RowAcceptance([RowRule.make(None, None) for _ in range(n)])

    with decoder.running():
        session = DecodeSession(decoder, eos=set())
        collect(session.add([torch.tensor(p) for p in prompts[:2]], max_new[:2], judge(2))[1])
        collect(session.step())
        collect(session.add([torch.tensor(prompts[2])], max_new[2:], judge(1))[1])  # joins, priced out
        for _ in range(2):
            collect(session.step())
        assert begins == [2]  # the prompts' begin only
        priced_out[0] = False
        collect(session.step())
        assert begins == [2, 3]  # restarted once, on the three live rows, before drafting
        while session.rows:
            collect(session.step())
        assert begins == [2, 3]
    assert any(s.num_drafted and max(s.num_drafted) > 0 for s in session.steps)
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert tokens[i] == hf_greedy(target, torch.tensor([p]), m)[0, len(p):].tolist()
