"""`--drafter auto`: several sources, the controller picks one per step; exact whatever it picks."""

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_llama
from controller_helpers import ask, choice
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig, DraftLengthController
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.drafters.chooser import Sources
from specdec.drafters.base import Prompt
from specdec.drafters.self_spec import StreamingDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.registry import make_drafter


def _pick(c, keys, say=lambda k: 1):
    return choice(c, keys, say)[0]


def test_choose_on_scripted_gains():
    """Classes measured fewer than min_samples times first (the least measured), then the best
    measured gain, a passed-over class revisited on schedule."""
    c = DraftLengthController(DraftLengthConfig(revisit_every=4, min_samples=2))
    assert choice(c, [], lambda k: 1) == (None, 0)
    keys = [("lookup", 3), ("eagle", None)]
    assert _pick(c, keys) == ("lookup", 3)  # neither measured: the first
    c.update([0], [0], verify_time=1.0)
    for _ in range(2):
        c.update([3], [3], verify_time=1.1, draft_time=0.0, key=("lookup", 3))  # 4 tokens in 1.1 steps
        assert _pick(c, keys) == ("eagle", None)  # eagle measured less: tried next
        c.update([6], [1], verify_time=1.3, draft_time=0.2, key=("eagle", None))  # 2 tokens in 1.5 steps
    picks = [_pick(c, keys) for _ in range(10)]
    assert picks == [("lookup", 3)] * 4 + [("eagle", None)] + [("lookup", 3)] * 4 + [("eagle", None)]
    # the measured gains turn: eagle wins from then on (lookup revisited every 4 steps)
    for _ in range(30):
        c.update([3], [0], verify_time=1.1, draft_time=0.0, key=("lookup", 3))
        c.update([6], [4], verify_time=1.3, draft_time=0.2, key=("eagle", None))
    picks = [_pick(c, keys) for _ in range(5)]
    assert picks.count(("eagle", None)) == 4
    assert _pick(c, [("lookup", 2)]) == ("lookup", 2)  # a class never seen is tried


def test_a_class_that_drafts_nothing_passes_the_step_on():
    """A fresh class whose length rule says 0, or the best-gain class whose rule says 0, hands the
    step to the next class that drafts; after a class whose measured gain loses, nobody is asked."""
    c = DraftLengthController(DraftLengthConfig(min_samples=1))
    c.update([0], [0], verify_time=1.0)
    good, poor, new = ("eagle", 0), ("lookup", 1), ("suffix", 1)
    c.update([6], [3], verify_time=1.2, draft_time=0.1, key=good)  # 4 tokens in 1.3 steps: gain 3.1
    c.update([2], [0], verify_time=1.1, draft_time=0.0, key=poor)  # 1 token in 1.1 steps: gain 0.9
    asked = []

    def say(sizes):
        return lambda k: asked.append(k) or sizes.get(k, 0)

    assert choice(c, [poor, new, good], say({good: 5})) == (good, 5)  # new (fresh) said 0: passed on
    assert asked == [new, good]
    asked.clear()
    assert choice(c, [poor, good], say({})) == (None, 0)  # good says 0, then poor (a loser) too
    assert asked == [good, poor]
    assert choice(c, [poor, good], say({poor: 1})) == (poor, 1)  # ... unless it is due a probe
    asked.clear()
    assert choice(c, [poor, good, new], say({new: 3})) == (new, 3)
    c.update([3], [0], verify_time=1.1, draft_time=0.0, key=new)  # measured now: gain 0.9
    asked.clear()
    assert choice(c, [poor, new, good], say({})) == (None, 0)
    assert asked == [good, poor]  # good said 0, poor lost: new (gain below poor's) not asked
    assert c.state(new).idle == 1 and c.state(good).idle == 0


def test_a_shadow_draft_is_measured_without_drafting():
    """observe_shadow: the draft's acceptance down to the judged depth enters the class's table, its
    would-be gain (1 + accepted) / (t(1 + n) + d(n)) / t(1) the class's gain; a class measured so
    is never 'fresh' (tried first to be measured) and never probed; a new answer forgets that."""
    c = DraftLengthController(DraftLengthConfig(min_samples=2))
    c.update([0], [0], verify_time=1.0)
    copy, model = ("lookup", 2), ("eagle", 0)
    for _ in range(2):
        c.update([3], [3], verify_time=1.2, draft_time=0.3, key=model)  # 4 tokens in 1.5 steps
    c.observe_shadow([[-1, 0, 1]], [[0, 1]], judged=[3], draft_time=0.0, key=copy)  # node 2 missed
    st = c.state(copy)
    assert st.gain == pytest.approx(3 / 1.2) and st.gain_samples == 1  # t(4) = 1.2, d = 0
    trials = [row[0] for row in st.positions.trials[:3]]
    assert trials == [1.0, 1.0, 1.0] and st.positions.hits[1][0] == 1.0 and st.positions.hits[2][0] == 0.0
    assert _pick(c, [copy, model]) == copy  # measured once (< min_samples): tried first
    assert choice(c, [copy, model], lambda k: 1, free=[copy])[0] == model  # by gain: 2.67 > 2.5
    for _ in range(60):  # the copies stop matching: a gain below 1 (1 / 1.2), and no probe ever
        c.observe_shadow([[-1, 0, 1]], [[]], judged=[1], draft_time=0.0, key=copy)
    assert st.gain < 1 and [ask(c, copy) for _ in range(100)] == [0] * 100
    c.new_run(1)  # a new answer: measured afresh (its gain weighs min_samples - 1), drafts again
    assert not st.shadowed and ask(c, copy) > 0


def test_a_shadow_draft_cut_short_by_the_text_is_scored_at_its_expected_rest():
    """A shadow whose path runs as far as the committed tokens go (the chosen draft stopped there) was
    not judged deeper: its gain counts the expected rest of the path at the class's measured rates,
    not 0 (scored as 0, a longer-reaching source looked no better than the one chosen, which kept
    the step). Depth 3 never judged reads as depth 2's rate (sequoia: the flat tail)."""
    c = DraftLengthController(DraftLengthConfig(min_samples=2))
    c.update([0], [0], verify_time=1.0)
    c.update([3], [3], verify_time=1.2)  # t(4) = 1.2
    copy = ("lookup", 2)
    c.observe_shadow([[-1, 0, 1]], [[0, 1]], judged=[3], draft_time=0.0, key=copy)  # rates 1, 1, 0
    c.observe_shadow([[-1, 0, 1]], [[0]], judged=[1], draft_time=0.0, key=copy)  # cut after node 0
    st = c.state(copy)
    rates = st.positions.chain(3)
    rest = rates[1] + rates[1] * rates[2]  # nodes 1 and 2 below the judged depth
    assert 0 < rest < 2
    assert st.gain == pytest.approx((3 / 1.2 + (2 + rest) / 1.2) / 2)
    # a tree cut at the root's child that has no children below it: nothing to add
    c2 = DraftLengthController(DraftLengthConfig(min_samples=2))
    c2.update([0], [0], verify_time=1.0)
    c2.update([2], [2], verify_time=1.2)  # t(3) = 1.2
    c2.observe_shadow([[-1, -1]], [[1]], judged=[1], draft_time=0.0, key=copy)
    assert c2.state(copy).gain == pytest.approx(2 / 1.2)


def test_a_shadowed_class_gets_no_revisit_turn():
    """A class measured by its shadow drafts every step needs no turn after ``revisit_every``
    passed-over steps (a turn would draft it where another class measures better)."""
    c = DraftLengthController(DraftLengthConfig(min_samples=1, revisit_every=4))
    c.update([0], [0], verify_time=1.0)
    copy, model = ("lookup", 1), ("eagle", 0)
    c.update([3], [3], verify_time=1.0, key=model)  # gain 4
    c.observe_shadow([[-1]], [[]], judged=[1], draft_time=0.0, key=copy)  # gain 1
    picks = [choice(c, [copy, model], lambda k: 1, free=[copy])[0] for _ in range(20)]
    assert picks == [model] * 20
    unshadowed = DraftLengthController(DraftLengthConfig(min_samples=1, revisit_every=4))
    unshadowed.update([0], [0], verify_time=1.0)
    unshadowed.update([3], [3], verify_time=1.0, key=model)
    unshadowed.update([1], [0], verify_time=1.0, key=copy)  # gain 0.5, measured where drafted
    assert copy in [choice(unshadowed, [copy, model], lambda k: 1)[0] for _ in range(20)]


def test_a_shadow_draft_at_a_batch_is_scored_per_row_of_the_batch():
    """Batch 2: row 0's 2-node chain gets 1 node accepted and the text it is judged against ends
    there (node 1 unjudged: its expected acceptance, 1.0 from the one hit, counts), row 1 has no draft
    (it pays for row 0's verify rows all the same): (3 + 1) / 2 tokens per row over t(3) = 1.25
    plain steps -> gain 1.6; half the rows drafted; only row 0's judged node enters the table."""
    c = DraftLengthController(DraftLengthConfig(min_samples=2))
    c.set_batch(2)
    c.update([0, 0], [0, 0], verify_time=1.0)
    c.update([2, 2], [0, 0], verify_time=1.25)  # t(3) at batch 2
    c.observe_shadow([[-1, 0], []], [[0], []], judged=[1, 2], draft_time=0.0, key="copy")
    st = c.state("copy")
    assert st.gain == pytest.approx(2 / 1.25) and st.row_share == 0.5 and st.shadowed
    assert [row[0] for row in st.positions.trials[:2]] == [1.0, 0.0]  # depth 2: past what row 0 judged


def _sources(target, seed):
    return {"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
            "model": ModelDrafter(perturbed(target, 0.3, seed=seed)),
            "streaming": StreamingDrafter(target, budget=24, sink=2)}


@pytest.mark.parametrize("seed", range(4))
def test_auto_equals_hf_greedy_and_tries_every_source(seed):
    target = tiny_llama(seed)
    g = torch.Generator().manual_seed(300 + seed)
    base = torch.randint(0, 128, (1, 40), generator=g)
    ids = torch.cat([base, base[:, :30]], dim=1)  # repetitive: lookup and suffix find matches
    ref = hf_greedy(target, ids, 40)
    for shadow_drafts in (True, False):  # without shadows every source drafts to be measured
        config = SpecDecoderConfig(draft_length=DraftLengthConfig(revisit_every=3 + seed), shadow_drafts=shadow_drafts)
        drafter = Sources(_sources(target, seed), min_prompt={"streaming": 48})
        out = SpecDecoder(target, drafter, config).generate(ids, max_new_tokens=40, eos_token_id=None)
        assert torch.equal(out.sequences, ref), f"seed {seed}: {dict(drafter.drafts)}"
    assert set(drafter.drafts) == {"lookup", "suffix", "model", "streaming"}


def test_auto_scores_its_free_sources_unverified_at_batch_1_greedy_only():
    """Prompt lookup's classes, not chosen, are measured anyway (shadow drafts scored against the
    committed text): more gain samples than steps it drafted; not when sampling, nor when turned
    off; exact every way."""
    target = tiny_llama(5)
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 128, (1, 30), generator=g)
    ids = torch.cat([base, base[:, :20]], dim=1)
    ref = hf_greedy(target, ids, 40)

    def run(shadow_drafts, **kw):
        drafter = Sources({"lookup": PromptLookupDrafter(), "model": ModelDrafter(perturbed(target, 0.1, seed=5))})
        decoder = SpecDecoder(target, drafter, SpecDecoderConfig(shadow_drafts=shadow_drafts))
        out = decoder.generate(ids, max_new_tokens=40, eos_token_id=None, **kw)
        samples = sum(st.gain_samples for k, st in decoder.controller.classes.items() if k and k[0] == "lookup")
        return out, samples, drafter.drafts["lookup"]

    out, samples, drafted = run(True)
    assert torch.equal(out.sequences, ref) and samples > drafted
    out, samples, drafted = run(False)
    assert torch.equal(out.sequences, ref) and samples <= drafted
    _, samples, drafted = run(True, do_sample=True, seed=0)
    assert samples <= drafted


def test_a_single_free_drafter_scores_its_gated_off_class_unverified():
    """Prompt lookup alone: a step its class drafts nothing in (gated off: the controller finds that drafting
    does not pay, made so here, since a tiny model's measured times on a shared machine may say either) still
    scores a shadow draft of that class against the committed token, greedy only, exact every way."""
    target = tiny_llama(5)
    base = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([base, base[:, :20]], dim=1)
    ref = hf_greedy(target, ids, 40)

    def run(shadow_drafts, **kw):
        decoder = SpecDecoder(target, PromptLookupDrafter(), SpecDecoderConfig(shadow_drafts=shadow_drafts))
        scored, observe = [], decoder.controller.observe_shadow
        decoder.controller._pays = lambda state: False  # past its first min_samples drafts, gated off but probes

        def spy(parents, accepted, judged, draft_time=None, key=None):
            scored.append((key, max(len(p) for p in parents)))
            observe(parents, accepted, judged, draft_time, key)
        decoder.controller.observe_shadow = spy
        out = decoder.generate(ids, max_new_tokens=40, eos_token_id=None, **kw)
        plain = sum(1 for st in out.steps[1:] if not any(st.num_drafted))
        return out, scored, plain

    out, scored, plain = run(True)
    matched = [n for key, n in scored if key]  # classes with an n-gram match (class 0, none: an empty draft)
    assert torch.equal(out.sequences, ref) and 0 < len(scored) <= plain and matched and all(n >= 1 for n in matched)
    out, scored, _ = run(False)
    assert torch.equal(out.sequences, ref) and scored == []
    _, scored, _ = run(True, do_sample=True, seed=0)
    assert scored == []


def test_auto_in_a_ragged_batch_outside_sources_prompt_ranges():
    target = tiny_llama(7)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (12, 30, 21)]
    prompts = [torch.cat([p, p[: len(p) // 2]]) for p in prompts]
    drafter = Sources(_sources(target, 7), min_prompt={"streaming": 1000}, max_prompt={"model": 40})
    out = SpecDecoder(target, drafter).generate(prompts, max_new_tokens=24, eos_token_id=None)
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == hf_greedy(target, p[None], 24)[0, len(p):].tolist()
    # streaming not started: every prompt too short; model not started: the longest (45) too long
    assert drafter.active == ["lookup", "suffix"]
    assert set(drafter.drafts) <= {"lookup", "suffix"}


def test_a_source_s_minimum_prompt_can_depend_on_the_batch_size():
    """min_prompt as a function of the batch: self-speculation pays at shorter prompts in a batch
    (the weights are read once a step, the K/V per sequence)."""
    target = tiny_llama(7)
    prompt = torch.arange(40) % 128
    drafter = Sources(_sources(target, 7), min_prompt={"streaming": lambda batch: 100 if batch == 1 else 30})
    one = SpecDecoder(target, drafter).generate(prompt[None], max_new_tokens=8, eos_token_id=None)
    assert "streaming" not in drafter.active
    assert one.generated(0).tolist() == hf_greedy(target, prompt[None], 8)[0, 40:].tolist()
    two = SpecDecoder(target, drafter).generate([prompt, prompt], max_new_tokens=8, eos_token_id=None)
    assert "streaming" in drafter.active
    assert two.generated(1).tolist() == one.generated(0).tolist()


def test_a_model_source_is_keyed_by_the_lookup_match_and_stays_exact():
    """by_match: the model drafter's class is the length of prompt lookup's n-gram match (0, 1, 2+),
    so the controller weighs its guesses against copies at the same kind of position."""
    target = tiny_llama(3)
    sources = {"lookup": PromptLookupDrafter(), "model": ModelDrafter(perturbed(target, 0.3, seed=3))}
    drafter = Sources(sources, by_match=("model",))
    drafter.begin(Prompt(torch.tensor([[5, 6, 7, 8, 9, 1, 6, 7]]), torch.tensor([8])))
    assert ("model", ("match", 2)) in drafter.candidates() and ("lookup", 2) in drafter.candidates()
    drafter.begin(Prompt(torch.tensor([[5, 6, 7, 4]]), torch.tensor([4])))
    assert drafter.candidates() == [("model", ("match", 0))]  # lookup has nothing to copy
    with pytest.raises(ValueError, match="'lookup' source"):
        Sources({"model": sources["model"]}, by_match=("model",))
    with pytest.raises(ValueError, match="names no source"):
        Sources(sources, by_match=("eagle",))
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 128, (1, 30), generator=g)
    ids = torch.cat([base, base[:, :20]], dim=1)
    out = SpecDecoder(target, drafter).generate(ids, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 40))


def test_auto_refuses_sources_of_different_vocabularies():
    small = tiny_llama(0, vocab=64)
    with pytest.raises(ValueError, match="vocabulary"):
        Sources({"a": ModelDrafter(small), "b": ModelDrafter(tiny_llama(0))})


def test_auto_is_registered_without_an_eagle_head_for_the_target(target):
    drafter = make_drafter("auto", target)  # the packaged head is for SmolLM2: skipped here
    assert isinstance(drafter, Sources) and "eagle" not in drafter.sources


@pytest.mark.filterwarnings("ignore:the target computes in")  # bf16: not token-exact, says the decoder
def test_auto_drafts_with_quant_self_for_a_bf16_target_only_and_auto_plus_quant_self_always():
    """quant-self is a source of ``auto`` for a bf16 target (its Q4_0 copy pays beside the copying sources
    there), not for an fp32 or fp64 one; ``auto+quant-self`` has it whatever the dtype, and stays exact
    (float64: exact argmax) with drafts of every source verified."""
    has = {dt: "quant-self" in make_drafter("auto", tiny_llama(1, dtype=dt)).sources
           for dt in (torch.bfloat16, torch.float32, torch.float64)}
    assert has == {torch.bfloat16: True, torch.float32: False, torch.float64: False}
    target = tiny_llama(4)
    drafter = make_drafter("auto+quant-self", target)
    assert "quant-self" in drafter.sources
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 128, (1, 30), generator=g)
    out = SpecDecoder(target, drafter).generate(ids, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 40))


def test_auto_forwards_its_corpus_to_the_suffix_source_and_stays_exact():
    target = tiny_llama(3)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    ref = hf_greedy(target, ids, 40)
    drafter = Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter()})
    first = SpecDecoder(target, drafter).generate(ids, max_new_tokens=40, eos_token_id=None)
    drafter.remember(first.sequences[0].tolist(), prompt_len=12)  # as `specdec bench --remember` does
    assert len(drafter.sources["suffix"].remembered) == 1
    drafter.build_index()
    second = SpecDecoder(target, drafter).generate(ids, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(first.sequences, ref) and torch.equal(second.sequences, ref)
    assert len(second.steps) < len(first.steps) / 2  # the remembered answer drafted whole
    words = lambda toks: " ".join(f"w{t}" for t in toks)  # noqa: E731
    question = words(ids[0, 2:8].tolist())
    assert drafter.exclude_questions([question], words) == 1
    assert drafter.sources["suffix"].remembered == []


def test_auto_drafts_from_the_stored_answers_only_for_their_vocabulary(target):
    from specdec.drafters.suffix import STORED_ANSWERS_VOCAB, stored_answers_fit

    assert make_drafter("auto", target).sources["suffix"].corpus is None  # a 128-token vocabulary
    assert not stored_answers_fit(128) and not stored_answers_fit(None)
    smol_vocab = tiny_llama(0, vocab=STORED_ANSWERS_VOCAB, layers=1)
    suffix = make_drafter("auto", smol_vocab).sources["suffix"]
    assert suffix.corpus is not None and len(suffix.corpus.docs) > 1000  # data/eagle_answers.jsonl


class _Scripted(PromptLookupDrafter):
    """Prompt lookup whose draft class this step is set by the test (0: nothing to draft)."""

    def __init__(self, cls) -> None:
        super().__init__()
        self.cls = cls

    def draft_class(self):
        return self.cls


def test_a_subsuming_source_leaves_out_the_sources_it_holds_while_it_drafts():
    """{"grammar": ("lookup",)}: while the grammar has a chain, lookup is neither a candidate nor shadowed;
    without one, lookup competes again; other sources are untouched; unknown names are refused."""
    grammar, lookup, suffix = _Scripted(2), _Scripted(3), _Scripted(1)
    sources = Sources({"grammar": grammar, "lookup": lookup, "suffix": suffix}, subsumes={"grammar": ("lookup",)})
    assert sources.candidates() == [("grammar", 2), ("suffix", 1)]
    grammar.cls = 0  # no constrained row this step
    assert sources.candidates() == [("lookup", 3), ("suffix", 1)]
    plain = Sources({"grammar": _Scripted(2), "lookup": _Scripted(3)})
    assert plain.candidates() == [("grammar", 2), ("lookup", 3)]
    with pytest.raises(ValueError, match=r"subsumes names no source: \['eagle'\]"):
        Sources({"grammar": grammar, "lookup": lookup}, subsumes={"grammar": ("eagle",)})
    assert make_drafter("auto", tiny_llama(0)).subsumes == {"grammar": ("lookup",)}
