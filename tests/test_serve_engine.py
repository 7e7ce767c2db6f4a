"""The server's decode loop: requests joining a running batch answer exactly as alone."""

import threading

import pytest
import torch

from specdec import SpecDecoder as _SpecDecoder
from specdec.config import RuntimeConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.sampling import SamplingParams
from specdec.serve.acceptance import GumbelStream
from specdec.serve.engine import Busy, Engine, EngineConfig, Request

from conftest import hf_greedy


def SpecDecoder(target, drafter):
    """No kernel self-check (seconds on a busy machine; the tiny float64 model never uses the kernels)."""
    return _SpecDecoder(target, drafter, SpecDecoderConfig(runtime=RuntimeConfig(calibrate=False)))


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
        self.first, self.hold = threading.Event(), hold
        self.handle = engine.submit(Request(prompt, max_new, sampling, seed, self._emit))

    def _emit(self, u) -> None:
        self.tokens += u.tokens
        if not self.first.is_set():
            self.first.set()
            if self.hold is not None:
                self.hold.wait(30)
        if u.finish is not None:
            self.finish = u.finish
            self.done.set()


@pytest.mark.parametrize("make", [PromptLookupDrafter, SuffixDrafter], ids=["lookup", "suffix"])
def test_requests_joining_mid_batch_answer_as_generate_alone(target, make):
    prompts, max_new = _prompts(5), [20, 6, 24, 14, 10]
    engine = Engine(SpecDecoder(target, make()), eos=set(), config=EngineConfig(max_batch=4))
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
        alone = SpecDecoder(target, make()).generate(torch.tensor(p), max_new_tokens=m)
        assert c.tokens == alone.generated(0).tolist()
        if make is SuffixDrafter:  # and the target's own greedy output (once: generate is pinned to it elsewhere)
            assert c.tokens == hf_greedy(target, torch.tensor([p]), m)[0, len(p):].tolist()
        assert c.finish == "length"
    assert engine.counters.tokens == sum(max_new)
    assert engine.counters.joins >= 1  # some arrived while rows were live


def test_seeded_sampling_repeats_whatever_the_batch_mates(target):
    sampling = SamplingParams(temperature=0.9, top_k=20)
    prompt = _prompts(1)[0]
    answers = []
    for mates in (0, 3):
        engine = Engine(SpecDecoder(target, PromptLookupDrafter()), eos=set())
        engine.start()
        try:
            others = [_Client(engine, p, 20, sampling if i % 2 else None) for i, p in enumerate(_prompts(mates, 1))]
            c = _Client(engine, prompt, 20, sampling, seed=1234)
            for x in others + [c]:
                assert x.done.wait(60)
        finally:
            engine.stop()
        answers.append(c.tokens)
    assert answers[0] == answers[1]
    other_seed = Engine(SpecDecoder(target, None), eos=set())
    other_seed.start()
    try:
        d = _Client(other_seed, prompt, 20, sampling, seed=99)
        assert d.done.wait(60)
    finally:
        other_seed.stop()
    assert d.tokens != answers[0]  # the seed matters


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
