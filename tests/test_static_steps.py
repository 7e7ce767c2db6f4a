"""Static-shape target steps (``specdec.kv.static``, ``specdec.runtime.graphs``): what a GPU's CUDA graphs
will replay, ready on the CPU before a GPU is.

Capture's rules are rehearsed by ``capture="trace"``: each step is traced once per shape into an fx
graph and replayed, so any value the host decided at capture (a length, a tree) is baked in, as a CUDA
graph bakes it. The exactness suite of ``specdec bench-device`` runs here on traced steps, every drafter
at batch 1 and in ragged batches, against the target's own greedy decoding; a step that reads a host
value is shown to fail it.
"""

import pytest
import torch

from conftest import hf_greedy, ragged_blocks, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec import forward as fw
from specdec.bench.device import exactness
from specdec.drafters import PromptLookupDrafter
from specdec.judging import Acceptance
from specdec.kv.static import StaticCache, StaticShapes
from specdec.quant import quantize_model
from specdec.quant.numerics import set_numerics
from specdec.runtime.graphs import StepGraphs
from specdec.session import DecodeSession

TRACED = StaticShapes(capture="trace")
# every greedy case of the suite; ragged batches traced for two drafters (a trace per batch size and
# bucket takes a second or two here), the others' static steps run eagerly
CASES = [(c, "eager" if c.startswith("batch/") and c not in ("batch/none", "batch/auto") else "trace")
         for c in exactness.cases("cpu") if not c.startswith("sampling/")]


@pytest.mark.filterwarnings("ignore:.*fits the budget")
@pytest.mark.parametrize("case,capture", CASES)
def test_the_exactness_suite_holds_on_static_steps(case, capture):
    [record] = exactness.run("cpu", [case], static=StaticShapes(capture=capture))
    assert record["passed"], record["detail"]
    assert record["steps"] == "static"


def _prompts():
    ids = torch.randint(1, 128, (10,), generator=torch.Generator().manual_seed(0))
    return [ids[:7], torch.cat([ids, ids]), torch.cat([ids[3:9], ids[3:9]])]


def _spy_stores(monkeypatch) -> list[StaticCache]:
    """The static stores the target's forwards ran on, in order."""
    seen = []
    real = fw.static_block

    def spy(model, cache, *args, **kwargs):
        seen.append(cache)
        return real(model, cache, *args, **kwargs)

    monkeypatch.setattr(fw, "static_block", spy)
    return seen


def test_a_step_that_reads_a_host_value_fails_when_traced(monkeypatch):
    """The rehearsal's premise: a step whose rows' starts come from the host list (baked at capture)
    instead of its input tensor is right when run eagerly and wrong when replayed."""
    target = tiny_llama(7)
    prompt = _prompts()[1]
    want = hf_greedy(target, prompt[None], 10)[0, len(prompt):].tolist()
    real = fw.static_step

    def host_starts(model, path, cache, ids, starts, *args):
        return real(model, path, cache, ids, torch.tensor(cache.lengths, device=starts.device), *args)

    monkeypatch.setattr(fw, "static_step", host_starts)
    for capture, right in (("eager", True), ("trace", False)):
        decoder = SpecDecoder(target, None, SpecDecoderConfig(static=StaticShapes(capture=capture)))
        got = decoder.generate([prompt], max_new_tokens=10, eos_token_id=None).generated(0).tolist()
        assert (got == want) is right, capture


def test_steps_are_captured_once_per_shape_and_the_buffers_stay_put(monkeypatch):
    seen = _spy_stores(monkeypatch)
    target = tiny_llama(7)
    prompts = _prompts()
    out = SpecDecoder(target, PromptLookupDrafter(), SpecDecoderConfig(static=TRACED)).generate(
        prompts, max_new_tokens=12, eos_token_id=None)
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == hf_greedy(target, p[None], 12)[0, len(p):].tolist()
    store = seen[-1]
    assert all(s is store for s in seen), "one store for the whole generation"
    graphs = store.graphs
    # never cleared (a move of the buffers drops every graph): captured once per shape, on the same buffers
    assert graphs.replays > 0 and graphs.captures == len(graphs) <= 3 * len(TRACED.blocks)
    assert store.capacity_rows == TRACED.capacity(max(len(p) for p in prompts) + 12)


def test_the_next_generate_reuses_the_store_and_its_graphs(monkeypatch):
    seen = _spy_stores(monkeypatch)
    target = tiny_llama(7)
    decoder = SpecDecoder(target, None, SpecDecoderConfig(static=TRACED))
    prompt = _prompts()[1]
    runs = [decoder.generate([prompt], max_new_tokens=m, eos_token_id=None).generated(0).tolist() for m in (8, 10)]
    assert runs[1][:8] == runs[0] and runs[1] == hf_greedy(target, prompt[None], 10)[0, len(prompt):].tolist()
    assert seen[0] is seen[-1] and seen[-1].graphs.captures == 1, "one store, one capture, for both calls"


def test_static_blocks_match_the_dynamic_store():
    """A prefill-sized chain, a tree block over ragged rows and a chain (PAD here, where BMC took SPLIT):
    the same logits and hidden states as BMC's store, to float64 rounding, traced steps included."""
    target = tiny_llama(3)
    shapes = StaticShapes(blocks=(1, 2, 4, 8, 16), capture="trace")
    static = ragged_blocks(target, store=lambda model, batch: StaticCache.for_model(model, batch, 40, shapes))
    for (lo, ho), (ls, hs) in zip(ragged_blocks(target), static, strict=True):
        assert ls.shape == lo.shape and hs.shape == ho.shape
        torch.testing.assert_close(ls, lo, rtol=0, atol=1e-10)
        torch.testing.assert_close(hs, ho, rtol=0, atol=1e-10)


def test_rows_joining_and_leaving_a_session_stay_exact(monkeypatch):
    """A server's batch: a row joins a running static store (appended), rows leave (compacted), and
    every sequence equals its own greedy decoding."""
    seen = _spy_stores(monkeypatch)
    target = tiny_llama(5)
    decoder = SpecDecoder(target, PromptLookupDrafter(), SpecDecoderConfig(static=TRACED))
    a, b, c = _prompts()
    new = {}
    with decoder.running():
        session = DecodeSession(decoder, eos=set())
        judge = Acceptance()
        ids, _ = session.add([a], [14], judge)
        session.step()
        session.step()
        more, _ = session.add([b, c], [6, 9], judge)
        while session.rows:
            session.step()
        for s, p, m in zip(ids + more, (a, b, c), (14, 6, 9)):
            new[s] = (session.result(s).tokens, hf_greedy(target, p[None], m)[0, len(p):].tolist())
    assert all(got == want for got, want in new.values()), new
    assert len({id(s) for s in seen}) == 1 and seen[-1].graphs.replays > 0


def test_a_store_grows_past_its_capacity_keeping_its_rows():
    target = tiny_llama(2)
    store = StaticCache.for_model(target, 1, 10, StaticShapes(blocks=(1, 4), capacity_step=16, capture="trace"))
    assert store.capacity_rows == 16  # 10 rows + the largest block (4), rounded up to 16
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    fw.forward_block(target, store, ids[:, :4], None, None)
    store.commit([[0, 1, 2, 3]])
    keys = store.layers[0].keys[:, :, :4].clone()
    where, graphs = store.layers[0].keys.data_ptr(), len(store.graphs)
    assert graphs == 1
    for s in range(4, 20, 4):
        fw.forward_block(target, store, ids[:, s:s + 4], None, None)
        store.commit([[0, 1, 2, 3]])
    # the block at 16 needs rows 16..19: grown once, to (20 + 4) rounded up to 16
    assert store.capacity_rows == 32 and store.layers[0].keys.data_ptr() != where, "new buffers"
    assert torch.equal(store.layers[0].keys[:, :, :4], keys)
    assert store.graphs.captures == 2, "the graph over the old buffers was dropped and made again"


def test_an_int8_target_on_static_steps_is_bit_equal_to_its_plain_decoding():
    """int8 numerics attend a row at a time over the store: the static store's masked padding and pad rows
    change no bit of a real row (run eagerly: the CPU kernels are not traced)."""
    model = tiny_llama(0, layers=2).float()
    quantize_model(model, "Q4_1")
    set_numerics(model, "int8")
    prompts = _prompts()
    plain = SpecDecoder(model, None).generate(prompts, max_new_tokens=10, eos_token_id=None, logprobs=0)
    static = SpecDecoderConfig(static=StaticShapes(capture="eager"))
    for drafter in (None, PromptLookupDrafter()):
        out = SpecDecoder(model, drafter, static).generate(prompts, max_new_tokens=10, eos_token_id=None, logprobs=0)
        assert torch.equal(out.sequences, plain.sequences)
        assert [[t.logprob for t in row] for row in out.logprobs] == [[t.logprob for t in row] for row in plain.logprobs]


def test_static_shapes_say_what_they_refuse():
    assert StaticShapes(blocks=(1, 2, 4, 8)).bucket(3) == 4 and StaticShapes(blocks=(1, 2, 4, 8)).bucket(9) == 9
    assert StaticShapes(capacity_step=256, blocks=(1, 64)).capacity(300) == 512
    with pytest.raises(ValueError, match="blocks must be increasing"):
        StaticShapes(blocks=(4, 2))
    with pytest.raises(ValueError, match="capture must be one of auto, eager, cuda, trace"):
        StaticShapes(capture="graph")
    with pytest.raises(ValueError, match="attention='split'.*static"):
        SpecDecoderConfig(static=StaticShapes(), attention="split")
    with pytest.raises(ValueError, match="capture='cuda' needs a CUDA device"):
        StepGraphs("cuda", torch.device("cpu"))


def test_static_steps_take_prompts_from_the_prefix_cache(monkeypatch):
    """Prompts prefilled through a prefix cache (aligned blocks in a BMC store of their own, then loaded into the
    static store): the same tokens as the target's greedy decoding, a second prompt reusing the first's rows."""
    from specdec.kv.prefix import PrefixCache

    seen = _spy_stores(monkeypatch)
    target = tiny_llama(4)
    cache = PrefixCache(2**20, block=4)
    decoder = SpecDecoder(target, PromptLookupDrafter(), SpecDecoderConfig(static=TRACED), prefix_cache=cache)
    first, second = _prompts()[1], torch.cat([_prompts()[1][:12], _prompts()[0]])
    for prompt in (first, second):
        got = decoder.generate([prompt], max_new_tokens=10, eos_token_id=None).generated(0).tolist()
        assert got == hf_greedy(target, prompt[None], 10)[0, len(prompt):].tolist()
    assert cache.stats.tokens_prefilled < len(first) + len(second), "the second prompt reused the first's blocks"
    assert seen and seen[-1].graphs.replays > 0
