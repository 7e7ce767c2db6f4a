"""The block kernel (specdec/runtime/csrc/quant_linear.cpp, routed by specdec.runtime.qlinear): both
builds equal the reference dequantize-then-F.linear to fp32 summation rounding for every format, block
size and odd shape; the self-check keeps the reference wherever the kernel is wrong; and a quantized
target decoded through the kernel and the lean forward is token for token its own ``generate``."""

import platform

import pytest
import torch
import torch.nn.functional as F

from specdec import SpecDecoder, SpecDecoderConfig
from specdec.config import RuntimeConfig, use
from specdec.controller.draft_length import DraftLengthConfig
from specdec.drafters import ModelDrafter
from specdec.quant import FORMATS, QuantLinear
from specdec.formats import _k_scales, dequantize, q5_k_codes, q6_k_codes, random_blocks
from specdec import fastpath
from specdec.runtime import int8_linear, kernels, qlinear, state
from specdec.runtime.state import CHUNK_ROWS, MAX_ROWS
from conftest import perturbed, sampled_pairs
from test_quant import fp32_twin, prompts, tiny_quant_llama

VARIANTS = ["native", "avx2"] if platform.machine() in ("x86_64", "AMD64") else ["native"]
# a fixed draft of 4 (no cost gate: which steps draft must not depend on how fast this machine is)
FIXED_DRAFTS = DraftLengthConfig(initial=4, maximum=4, adaptive=False, cost_aware=False)


def _ops(variant: str):
    ops = kernels.extension(RuntimeConfig(kernel=variant))
    if ops is None:
        pytest.skip(f"the {variant} kernel is not built here")
    return ops


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_block_kernel_equals_the_reference_for_every_block_size_and_odd_shapes(variant, name):
    ops = _ops(variant)
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(7)
    for N, blocks_per_row in ((1, 1), (37, 3), (130, 2)):  # output features not a multiple of any vector width
        K = blocks_per_row * fmt.block_weights
        w = random_blocks(fmt, N, K, g)
        ref_w = dequantize(w, fmt)
        for rows in [*range(1, MAX_ROWS + 1), 17, 40]:  # 17, 40: balanced passes of the widest shape
            x = torch.randn(rows, K, generator=g)
            err = (ops.quant_linear(x, w, fmt.ggml_type) - F.linear(x, ref_w)).abs()
            # another summation order of the same K products: within K * eps of sum |x w|, far within
            bound = F.linear(x.abs(), ref_w.abs())
            assert (err <= 1e-5 * bound + 1e-30).all(), (variant, name, N, K, rows, (err / bound).max().item())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_a_rows_result_is_the_same_bit_for_bit_in_any_pass(variant, name):
    """Decode (1 row), verify (a few) and batches (many) give each row the same floats: a target's tokens
    must not depend on how many rows a forward carries (several output features per call for few rows,
    balanced passes for many: neither changes a row's summation order)."""
    ops = _ops(variant)
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    w = random_blocks(fmt, 41, 2 * fmt.block_weights, g)  # 41 features: groups of 4 and 2 with a remainder
    x = torch.randn(40, 2 * fmt.block_weights, generator=g)
    alone = torch.cat([ops.quant_linear(x[i:i + 1], w, fmt.ggml_type) for i in range(40)])
    for rows in (2, 3, 5, 16, 17, 40):
        assert torch.equal(ops.quant_linear(x[:rows], w, fmt.ggml_type), alone[:rows]), (variant, name, rows)


@pytest.mark.parametrize("variant", VARIANTS)
def test_several_weights_in_one_call_equal_each_alone_bit_for_bit(variant):
    """quant_linear_parts (a layer's q/k/v or gate/up in one parallel region) puts each weight's output
    beside the others exactly as its own call computes it, whatever the formats and row counts; a weight
    whose blocks are not rows of K is refused by name."""
    ops = _ops(variant)
    g = torch.Generator().manual_seed(11)
    K = 512  # whole blocks of every format
    for names in (("Q4_1", "Q4_1", "Q4_1"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_K", "Q4_0")):
        fmts = [FORMATS[n] for n in names]
        ws = [random_blocks(f, n, K, g) for f, n in zip(fmts, (37, 16, 9))]  # group remainders at part edges
        for rows in (1, 2, 3, 5, 6, 9, 17, 40):
            x = torch.randn(rows, K, generator=g)
            alone = torch.cat([ops.quant_linear(x, w, f.ggml_type) for w, f in zip(ws, fmts)], dim=1)
            together = ops.quant_linear_parts(x, ws, [f.ggml_type for f in fmts])
            assert torch.equal(together, alone), (variant, names, rows)
    with pytest.raises(RuntimeError, match="are not rows of 512 weights"):
        ops.quant_linear_parts(torch.randn(2, K), [ws[0], ws[1][:, :-1]], [fmts[0].ggml_type, fmts[1].ggml_type])


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_K"])
def test_one_call_over_quantized_blocks_is_the_loop_bit_for_bit(quant, monkeypatch):
    """All layers of a quantized target in one compiled call (csrc/layers.cpp over the parts' blocks) give
    the loop's logits and hidden states exactly, on a chain, a ragged tree block and a SPLIT block."""
    _ops("native")
    outs, calls = one_call_and_loop(tiny_quant_llama(quant), monkeypatch)
    assert calls == {"ran": 2, "declined": 1}  # the first block makes the store's buffers
    for (la, ha), (lb, hb) in zip(outs[True], outs[False]):
        assert torch.equal(la, lb) and torch.equal(ha, hb)


def one_call_and_loop(model, monkeypatch, store=None) -> tuple[dict, dict]:
    """``conftest.ragged_blocks`` of ``model`` through the one compiled call (outs[True]) and through the loop
    (outs[False]), on stores made by ``store`` (its default: BMC), and how often the one call ran or declined."""
    from conftest import ragged_blocks
    from test_layer_ops import _count_one_calls

    runtime = RuntimeConfig(calibrate=False)
    with use(runtime):
        path = fastpath.get(model, runtime)
        assert path is not None and path.one_call
        calls = _count_one_calls(monkeypatch)
        outs = {}
        for one_call in (True, False):
            path.one_call = one_call
            outs[one_call] = ragged_blocks(model, store=store)
    return outs, calls


def test_one_call_inside_approximate_is_the_int8_loop_bit_for_bit(monkeypatch):
    """A draft's 1-row and 2-row blocks inside ``int8_linear.approximate()``: the one compiled call takes the int8
    route as the loop's linears do (the same logits and hidden states, bit for bit), which is not the exact
    kernel's result; outside the context the one call is the exact kernel's again."""
    from specdec.forward import forward_block
    from specdec.kv.bmc import BMCCache, BMCConfig
    from test_layer_ops import _count_one_calls

    ops = _ops("native")
    runtime = RuntimeConfig(calibrate=False)
    monkeypatch.setitem(int8_linear.APPROXIMATES, (runtime.variant, "Q4_1"), True)
    model = tiny_quant_llama("Q4_1")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, model.config.vocab_size, (1, 9), generator=g)
    steps = [torch.randint(1, model.config.vocab_size, (1, n), generator=g) for n in (1, 2, 1)]

    def run(one_call: bool, approx: bool):
        path.one_call = one_call
        cache = BMCCache.for_model(model, 1, BMCConfig(8))
        forward_block(model, cache, ids, None, None)
        cache.commit([list(range(9))])
        outs = []
        for step in steps:
            with int8_linear.approximate(approx):
                o = forward_block(model, cache, step, None, None, want_hidden=True)
            outs.append((o.logits, o.hidden))
            cache.commit([list(range(step.shape[1]))])
        return outs

    with use(runtime), torch.inference_mode():
        path = fastpath.get(model, runtime)
        assert path is not None and path.one_call and ops is not None
        calls = _count_one_calls(monkeypatch)
        one, loop, exact = run(True, True), run(False, True), run(True, False)
    assert calls["ran"] >= 2 * len(steps)  # both the approximate and the exact runs took the one call
    for (la, ha), (lb, hb), (le, _) in zip(one, loop, exact):
        assert torch.equal(la, lb) and torch.equal(ha, hb)
        assert not torch.equal(la, le)


def test_block_kernel_names_a_format_it_has_no_decoder_for():
    ops = _ops("native")
    with pytest.raises(RuntimeError, match="GGML type 0 has no kernel"):
        ops.quant_linear(torch.randn(1, 32), torch.zeros(2, 34, dtype=torch.uint8), 0)


def test_self_check_keeps_the_reference_where_the_kernel_is_wrong(monkeypatch):
    """A kernel that returns wrong numbers is never routed to, however fast; a dequantization that is
    wrong turns the GEMM off (the reference runs for many rows instead)."""
    real = _ops("native")

    class Wrong:
        def __init__(self, kernel_off=0.0, weights_off=0.0):
            self.kernel_off, self.weights_off = kernel_off, weights_off

        def quant_linear(self, x, blocks, fmt):
            return real.quant_linear(x, blocks, fmt) + self.kernel_off

        def quant_dequantize(self, blocks, fmts, out):
            real.quant_dequantize(blocks, fmts, out)
            out.view(-1)[-1] += self.weights_off  # one weight of the matrix

    def check(ops):
        return qlinear.self_check(state.Active(RuntimeConfig(), ops, state.uncalibrated(True)), FORMATS["Q4_1"])

    assert check(Wrong(kernel_off=1.0)) == qlinear.QuantRoutes((False,) * MAX_ROWS, MAX_ROWS, True)
    assert not check(Wrong(weights_off=1e-3)).gemm
    right = check(real)
    assert right.kernel[0] and right.gemm  # one row: the kernel reads each block once, the GEMM dequantizes all


@pytest.mark.parametrize("variant", VARIANTS)
def test_dequantization_of_the_build_is_the_reference_bit_for_bit(variant):
    """quant_dequantize (the GEMM route's weights) writes every format's weights exactly as the reference
    dequantizers do, several weights stacked in one matrix; a mismatched output is refused by name."""
    ops = _ops(variant)
    g = torch.Generator().manual_seed(5)
    K = 512
    for names in (("Q8_0", "Q4_0", "Q4_1"), ("Q4_K", "Q5_K", "Q6_K")):
        fmts = [FORMATS[n] for n in names]
        ws = [random_blocks(f, n, K, g) for f, n in zip(fmts, (37, 1, 18))]
        out = torch.empty(56, K)
        ops.quant_dequantize(ws, [f.ggml_type for f in fmts], out)
        ref = torch.cat([dequantize(w, f) for w, f in zip(ws, fmts)])
        assert torch.equal(out.view(torch.int32), ref.view(torch.int32)), (variant, names)
    with pytest.raises(RuntimeError, match="out has 55 rows for 56 output features"):
        ops.quant_dequantize(ws, [f.ggml_type for f in fmts], torch.empty(55, K))


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_many_rows_through_the_gemm_are_the_reference_bit_for_bit(name, monkeypatch):
    """Past the kernel's passes a QuantLinear runs the GEMM on the build's dequantized weights: the
    reference's own computation, so its output equals the reference's exactly, bias and slices of a large
    layer included; stacked weights (q/k/v) equal their parts to fp32 rounding."""
    import specdec.quant.modules as qm

    _ops("native")
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(2)
    K = 2 * fmt.block_weights
    layer = QuantLinear(random_blocks(fmt, 40, K, g), fmt, K, bias=torch.randn(40, generator=g))
    x = torch.randn(CHUNK_ROWS + 3, K, generator=g)
    with use(RuntimeConfig(calibrate=False)):
        assert not qlinear.takes(fmt, x.shape[0])
        assert torch.equal(layer(x), layer.reference(x))
        monkeypatch.setattr(qm.formats, "CHUNK_FLOATS", K * 7)  # 7 output features a slice: 6 slices
        assert torch.equal(layer(x), layer.reference(x))
        parts = [QuantLinear(random_blocks(fmt, n, K, g), fmt, K) for n in (5, 9, 3)]
        together = qlinear.linear_parts(x, [m.blocks for m in parts], [fmt] * 3)
        # one GEMM over the stacked weights: BLAS may block it unlike the parts' (an AMD EPYC did), so
        # within fp32 rounding of sum |x w| (Q6_K's random scales make outputs large: no fixed atol)
        err = (together - torch.cat([m.reference(x) for m in parts], dim=-1)).abs()
        bound = F.linear(x.abs(), torch.cat([m.dequantized() for m in parts]).abs())
        assert (err <= 1e-5 * bound + 1e-30).all(), (err / bound).max().item()


def test_the_gemm_dequantizes_every_slice_into_one_buffer(monkeypatch):
    """A layer's slices reuse one dequantization buffer (a buffer per slice fragmented the C heap: decision
    015, "memory"), and the last, shorter slice still gives the reference's values."""
    import specdec.quant.modules as qm

    ops = _ops("native")
    fmt = FORMATS["Q4_0"]
    g = torch.Generator().manual_seed(4)
    K = 2 * fmt.block_weights
    layer = QuantLinear(random_blocks(fmt, 40, K, g), fmt, K)
    x = torch.randn(CHUNK_ROWS + 1, K, generator=g)
    storages = []

    class Recording:
        def quant_dequantize(self, blocks, fmts, out):
            storages.append(out.untyped_storage().data_ptr())
            return ops.quant_dequantize(blocks, fmts, out)

    monkeypatch.setattr(qm.formats, "CHUNK_FLOATS", K * 7)  # 7 output features a slice: 6 slices, the last 5
    y = qlinear.gemm(x, [layer.blocks], [fmt], Recording())
    assert len(storages) == 6 and len(set(storages)) == 1
    assert torch.equal(y, layer.reference(x))


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_embedding_looks_up_the_reference_values_bit_for_bit(name):
    """The embedding's rows dequantized by the build (one call) are the reference's, kernels on or off."""
    from specdec.quant import QuantEmbedding

    _ops("native")
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(9)
    table = random_blocks(fmt, 50, fmt.block_weights * 2, g)
    emb = QuantEmbedding(table, fmt, fmt.block_weights * 2)
    ids = torch.tensor([[3, 0, 49, 3], [7, 7, 1, 20]])
    ref = dequantize(table, fmt)[ids]
    for kernel in ("native", "off"):
        with use(RuntimeConfig(kernel=kernel, calibrate=False)):
            assert torch.equal(emb(ids).view(torch.int32), ref.view(torch.int32)), kernel


def test_quantized_layer_takes_the_kernel_for_few_rows_and_the_gemm_for_many(monkeypatch):
    fmt = FORMATS["Q4_0"]
    g = torch.Generator().manual_seed(1)
    layer = QuantLinear(random_blocks(fmt, 48, 64, g), fmt, 64, bias=torch.randn(48, generator=g))
    calls = []
    monkeypatch.setattr(qlinear, "CALIBRATED", {})
    real = qlinear.linear_parts

    def counting(*args):
        y = real(*args)
        calls.append("none" if y is None else "kernel" if qlinear.takes(fmt, args[0].shape[0]) else "gemm")
        return y

    monkeypatch.setattr(qlinear, "linear_parts", counting)
    with use(RuntimeConfig(calibrate=False)):
        for rows in (1, 16, qlinear.UNCALIBRATED_CHUNKS, qlinear.UNCALIBRATED_CHUNKS + 1, CHUNK_ROWS + 1):
            x = torch.randn(rows, 64, generator=g)
            torch.testing.assert_close(layer(x), layer.reference(x), rtol=1e-5, atol=1e-5)
    with use(RuntimeConfig(kernel="off")):
        x = torch.randn(3, 64, generator=g)
        assert torch.equal(layer(x), layer.reference(x))
    assert calls == ["kernel", "kernel", "kernel", "gemm", "gemm", "none"]  # no kernels built: the reference


@pytest.mark.parametrize("kernel", ["native", "off"])
@pytest.mark.parametrize("quant", list(FORMATS))
def test_quantized_target_through_the_block_kernel_is_its_own_generate(quant, kernel):
    """The lean forward over quantized layers (kernel on: the block kernel; off: the reference) with a
    drafter that is partly accepted gives the target's own greedy tokens, computed under the same runtime."""
    runtime = RuntimeConfig(kernel=kernel, calibrate=False)  # no timing: the kernel wherever it is built
    target = tiny_quant_llama(quant)
    with use(runtime):
        assert fastpath.get(target, runtime) is not None  # the lean loop takes quantized layers
        decoder = SpecDecoder(target, ModelDrafter(perturbed(fp32_twin(target), 0.05)),
                              SpecDecoderConfig(draft_length=FIXED_DRAFTS, runtime=runtime))
        batch = prompts(target.config.vocab_size)
        out = decoder.generate(batch, max_new_tokens=12)
        for b, p in enumerate(batch):
            ref = target.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert out.generated(b).tolist() == ref[0, len(p):].tolist(), (quant, kernel, b)
    accepted = sum(sum(s.num_accepted) for s in out.steps)
    drafted = sum(sum(s.num_drafted) for s in out.steps)
    assert 0 < accepted < drafted  # drafts partly accepted: both sides of the verify ran


@pytest.mark.parametrize("quant", ["Q4_1", "Q4_K"])
def test_a_prompt_past_the_kernels_rows_prefills_through_the_gemm_and_stays_exact(quant):
    """A prompt longer than CHUNK_ROWS (the prefill on the GEMM route) and drafts partly accepted give the
    target's own greedy tokens (its generate prefills through the reference)."""
    runtime = RuntimeConfig(calibrate=False)
    target = tiny_quant_llama(quant)
    g = torch.Generator().manual_seed(4)
    base = torch.randint(1, target.config.vocab_size, (CHUNK_ROWS // 2 + 5,), generator=g)
    prompt = torch.cat([base, base, base[:20]])  # repetitive: drafts get accepted
    with use(runtime):
        decoder = SpecDecoder(target, ModelDrafter(perturbed(fp32_twin(target), 0.05)),
                              SpecDecoderConfig(draft_length=FIXED_DRAFTS, runtime=runtime))
        out = decoder.generate(prompt, max_new_tokens=16)
        with torch.inference_mode(), kernels.use(RuntimeConfig(kernel="off")):  # the reference's prefill
            ref = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert out.generated(0).tolist() == ref[0, len(prompt):].tolist()
    assert sum(sum(s.num_accepted) for s in out.steps) > 0


def test_quant_self_drafter_quantizes_the_layers_and_the_output_layer_and_leaves_the_target_untouched():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.drafters.quant_self import quantized_copy

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    draft = quantized_copy(target)
    assert draft.model.embed_tokens is target.model.embed_tokens
    assert draft.model.layers[0].input_layernorm is target.model.layers[0].input_layernorm
    head = draft.get_output_embeddings()
    assert isinstance(head, QuantLinear) and head.fmt.name == "Q8_0" and type(target.lm_head) is torch.nn.Linear
    assert quantized_copy(target, head=None).lm_head is target.lm_head
    q = draft.model.layers[1].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.fmt.name == "Q4_0"
    assert type(target.model.layers[1].self_attn.q_proj) is torch.nn.Linear  # the target keeps its layers
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    # the same model up to Q4_0 rounding: close logits, and mostly the same next token
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = target(ids).logits, draft(ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.5


@pytest.mark.filterwarnings("ignore:the target computes in")  # bf16: not token-exact, says the decoder
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_quant_self_drafts_in_float32_for_a_target_of_another_dtype(dtype, monkeypatch):
    """The draft of a bf16 (or float64) target computes in fp32, so its linears take the block kernel
    instead of dequantizing every matrix in Python at every token (what it did: 5x slower than the bf16
    target). The embedding table stays the target's, the target is untouched, and with a float64 target
    (exact argmax) drafts partly accepted give the target's own greedy tokens."""
    from specdec.drafters.quant_self import QuantSelfDrafter, quantized_copy
    from specdec.bench.device.tiny import hf_greedy, tiny_llama

    target = tiny_llama(11, dtype=dtype)
    before = {k: (v.dtype, v.clone()) for k, v in target.state_dict().items()}
    draft = quantized_copy(target)
    assert draft.dtype == torch.float32 and all(p.dtype == torch.float32 for p in draft.parameters())
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert all(v.dtype == before[k][0] and torch.equal(v, before[k][1]) for k, v in target.state_dict().items())
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(3)).repeat(1, 2)
    runtime = RuntimeConfig(calibrate=False)
    with use(runtime):
        if kernels.extension(runtime) is None:
            pytest.skip("no kernel built here")

        def no_reference(self, x):
            raise AssertionError(f"{self.fmt.name} dequantized in Python for {x.dtype} rows")

        with monkeypatch.context() as m:
            m.setattr(QuantLinear, "reference", no_reference)
            drafter = QuantSelfDrafter(target)  # the registered drafter: this copy over the target's rows
            out = SpecDecoder(target, drafter, SpecDecoderConfig(draft_length=FIXED_DRAFTS, runtime=runtime)).generate(
                ids, max_new_tokens=24)
    if dtype == torch.float64:
        assert torch.equal(out.sequences, hf_greedy(target, ids, 24))
    assert 0 < sum(sum(s.num_accepted) for s in out.steps) < 4 * len(out.steps)  # drafts partly accepted


def test_quant_self_never_prefills_or_catches_up_and_is_exact(monkeypatch):
    """The registered quant-self drafts over the target's own K/V rows: its draft model only ever runs
    one token at a time (the pending token, then its drafts), never the prompt or a pause's text, and
    drafts partly accepted give the target's own greedy tokens (float64 target: exact argmax)."""
    from specdec.bench.device.tiny import hf_greedy, tiny_llama
    from specdec.drafters import self_spec
    from specdec.registry import make_drafter

    target = tiny_llama(12)
    drafter = make_drafter("quant-self", target)
    widths, real = [], self_spec.forward_block

    def spy(model, cache, ids, *args, **kwargs):
        if model is drafter.draft:
            widths.append(ids.shape[1])
        return real(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(self_spec, "forward_block", spy)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g) for n in (40, 23)]
    runtime = RuntimeConfig(calibrate=False)
    out = SpecDecoder(target, drafter, SpecDecoderConfig(draft_length=FIXED_DRAFTS, runtime=runtime)).generate(
        prompts, max_new_tokens=24)
    assert widths and set(widths) == {1}
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == hf_greedy(target, p[None], 24)[0, len(p):].tolist()
    assert 0 < sum(sum(s.num_accepted) for s in out.steps) < sum(sum(s.num_drafted) for s in out.steps)


# ------------------------------------------------------------------ the int8 route for drafts (int8_linear.cpp)

APPROX = ["Q4_0", "Q4_1", "Q8_0"]


def _int8_parts(w: torch.Tensor, name: str, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 arithmetic's terms per sub-block of S weights (32; Q6_K's 16), in float64: (codes [N, K / S, S],
    scale D and offset coefficient M [N, K / S]) with w = D q + M (Q4_0: M = -8 d; Q4_K, Q5_K: D = d sc,
    M = -dmin mn per sub-block; Q6_K: codes q - 32, D = d sc, M = 0)."""
    N = w.shape[0]
    if name == "Q6_K":
        b = w.reshape(N * K // 256, 210)
        d = b[:, 208:210].contiguous().view(torch.float16).double()  # [n, 1]
        sc = b[:, 192:208].contiguous().view(torch.int8).double()  # [n, 16]
        q = _q6_codes(b)  # [n, 16, 16]
        return q.reshape(N, K // 16, 16), (d * sc).reshape(N, K // 16), torch.zeros(N, K // 16, dtype=torch.float64)
    if name == "Q5_K":
        b = w.reshape(N, K // 256, 176)
        d, dmin = (b[..., f:f + 2].contiguous().view(torch.float16).double() for f in (0, 2))  # [N, nb, 1]
        sc, mn = (t.double().reshape(N, K // 256, 8) for t in _k_scales(b[..., 4:16].reshape(-1, 12)))
        q = q5_k_codes(b.reshape(-1, 176)).reshape(N, K // 32, 32).double()
        return q, (d * sc).reshape(N, -1), (-(dmin * mn)).reshape(N, -1)
    if name == "Q4_K":
        b = w.reshape(N, K // 256, 144)
        d, dmin = (b[..., f:f + 2].contiguous().view(torch.float16).double() for f in (0, 2))  # [N, nb, 1]
        sc, mn = (t.double().reshape(N, K // 256, 8) for t in _k_scales(b[..., 4:16].reshape(-1, 12)))
        nib = b[..., 16:].reshape(N, K // 256, 4, 32).long()
        q = torch.stack([nib & 15, nib >> 4], 3).reshape(N, K // 32, 32).double()
        return q, (d * sc).reshape(N, -1), (-(dmin * mn)).reshape(N, -1)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[name]
    b = w.reshape(N, K // 32, size)
    d = b[..., 0:2].contiguous().view(torch.float16).double()[..., 0]  # [N, nb]
    if name == "Q8_0":
        return b[..., 2:34].contiguous().view(torch.int8).double(), d, torch.zeros_like(d)
    nib = b[..., size - 16:].long()
    q = torch.cat([nib & 15, nib >> 4], -1).double()  # weights 0-15 low nibbles, 16-31 high
    m = b[..., 2:4].contiguous().view(torch.float16).double()[..., 0] if name == "Q4_1" else -8 * d
    return q, d, m


def _q6_codes(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] -> their codes minus 32 [n, 16, 16], float64."""
    return q6_k_codes(b).double() - 32


def _rounded_as(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rounded`` at the sub-blocks of codes q [N, K / S, S]: (xq [M, K / S, S], dx [M, K / S])."""
    xq, dx = _rounded(x)
    S = q.shape[-1]
    return xq.reshape(x.shape[0], -1, S), dx.repeat_interleave(32 // S, dim=1)


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per 32 values as the kernel does: (xq [M, K / 32, 32], dx [M, K / 32]), float64."""
    xb = x.double().reshape(x.shape[0], x.shape[1] // 32, 32)
    dx = xb.abs().amax(-1) / 127
    return torch.where(dx[..., None] > 0, torch.round(xb / dx[..., None].clamp(min=1e-300)), torch.zeros_like(xb)), dx


def _int8_model(x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    """csrc/int8_linear.cpp's arithmetic in float64 from the blocks' bytes: x rounded per 32 values
    (dx = max|x| / 127), then per 32 weights D dx dot(q, xq) + M sx (``_int8_parts``; sx = dx sum(xq))."""
    q, D, M = _int8_parts(w, name, x.shape[1])
    xq, dx = _rounded_as(x, q)
    dots = torch.einsum("nbk,xbk->xnb", q, xq)
    return torch.einsum("xnb,nb,xb->xn", dots, D, dx) + torch.einsum("nb,xb->xn", M, dx * xq.sum(-1))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", APPROX)
def test_the_int8_draft_kernel_is_its_integer_arithmetic_and_near_the_reference(variant, name):
    """quant_linear_i8 computes exactly its documented int8 arithmetic (to fp32 rounding: fails on a wrong
    nibble order, offset or sign), several parts side by side as each alone, and stays within the
    self-check's APPROX_ERROR of the exact reference."""
    ops = _ops(variant)
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(11)
    for N, nb in ((1, 1), (7, 3), (130, 2)):  # features not a multiple of the kernel's group of 4
        K = nb * 32
        w, w2 = random_blocks(fmt, N, K, g), random_blocks(fmt, 5, K, g)
        for rows in (1, 2, 3):
            x = torch.randn(rows, K, generator=g)
            x[0, :32] = 0.0  # an all-zero block of x
            y = ops.quant_linear_i8(x, [w], [fmt.ggml_type])
            want = _int8_model(x, w, name)
            scale = want.abs() + 1e-3 * want.abs().max()  # fp32 sums of exact integer dots
            assert ((y.double() - want).abs() <= 1e-5 * scale + 1e-30).all(), (variant, name, N, K, rows)
            ref = F.linear(x, dequantize(w, fmt))
            assert (y - ref).norm() <= int8_linear.APPROX_ERROR * ref.norm()
            both = ops.quant_linear_i8(x, [w, w2], [fmt.ggml_type, fmt.ggml_type])
            assert torch.equal(both, torch.cat([y, ops.quant_linear_i8(x, [w2], [fmt.ggml_type])], 1))
    with pytest.raises(RuntimeError, match="is not Q4_0, Q4_1, Q8_0 or"):  # Q2_K (GGML type 10): no kernel reads it
        ops.quant_linear_i8(torch.randn(1, 256), [torch.zeros(2, 84, dtype=torch.uint8)], [10])
    with pytest.raises(RuntimeError, match=r"\(K a multiple of 256\) Q4_K, Q5_K, Q6_K"):  # K formats: whole blocks
        ops.quant_linear_i8(torch.randn(1, 96), [torch.zeros(2, 66, dtype=torch.uint8)], [FORMATS["Q6_K"].ggml_type])


def test_a_layer_takes_the_int8_route_only_inside_approximate_and_for_few_rows(ops, monkeypatch):
    """Outside ``int8_linear.approximate()`` a QuantLinear is the exact kernel's, inside it the int8 kernel's for
    1-2 rows and the exact one's for more; the context ends with its block, an exception included."""
    monkeypatch.setitem(int8_linear.APPROXIMATES, (state.active().config.variant, "Q4_1"), True)
    fmt = FORMATS["Q4_1"]
    g = torch.Generator().manual_seed(2)
    layer = QuantLinear(random_blocks(fmt, 40, 64, g), fmt, 64)
    x = torch.randn(3, 64, generator=g)
    exact = ops.quant_linear(x, layer.blocks, fmt.ggml_type)
    with torch.inference_mode():
        assert torch.equal(layer(x[:1]), exact[:1])
        with int8_linear.approximate():
            assert torch.equal(layer(x[:2]), ops.quant_linear_i8(x[:2], [layer.blocks], [fmt.ggml_type]))
            assert not torch.equal(layer(x[:2]), exact[:2])
            assert torch.equal(layer(x), exact)  # 3 rows: the exact kernel
        with pytest.raises(ZeroDivisionError), int8_linear.approximate():
            1 / 0
        assert torch.equal(layer(x[:1]), exact[:1])


def test_the_int8_check_times_a_layer_as_a_draft_calls_it_and_keeps_the_faster(ops, monkeypatch):
    """The calibrating check times a layer's linears in the calls a draft's forward makes (q, k, v side by
    side; o; gate, up; down) by both kernels over the same blocks, and routes drafts to the int8 kernel
    only where it was the faster of the two."""
    import time

    monkeypatch.setattr(int8_linear, "APPROX_CHECK_MB", 1)
    fmt = FORMATS["Q4_1"]

    class Slowed:  # the real kernels, one of them made slower by a millisecond a call
        def __init__(self, slow: str):
            self.slow, self.calls = slow, []

        def _timed(self, name, x, blocks, fmts):
            self.calls.append((name, tuple(tuple(b.shape) for b in blocks)))
            if name == self.slow:
                time.sleep(1e-3)
            return getattr(ops, name)(x, blocks, fmts)

        def quant_linear_i8(self, x, blocks, fmts):
            return self._timed("quant_linear_i8", x, blocks, fmts)

        def quant_linear_parts(self, x, blocks, fmts):
            return self._timed("quant_linear_parts", x, blocks, fmts)

    d, f = int8_linear.CHECK_FEATURES
    bd, bf = (k // fmt.block_weights * fmt.block_bytes for k in (d, f))  # a row's bytes at K = d, f
    layer = [((d, bd), (d // 3, bd), (d // 3, bd)), ((d, bd),), ((f, bd), (f, bd)), ((d, bf),)]  # blocks' shapes
    for slow, want in (("quant_linear_i8", False), ("quant_linear_parts", True)):
        timed = Slowed(slow)
        rt = state.Active(RuntimeConfig(), timed, state.uncalibrated(True))
        assert int8_linear._approx_check(rt, fmt, rounds=2) is want
        for name in ("quant_linear_i8", "quant_linear_parts"):  # each round ends with a whole layer's calls
            assert [shapes for n, shapes in timed.calls if n == name][-4:] == layer, name


def _int8_route_everywhere(monkeypatch) -> list[str]:
    """Skip without a kernel build; else every format takes the int8 route inside ``approximate()`` (no
    self-check), and the returned list collects the formats asked for."""
    if kernels.extension() is None:
        pytest.skip("no kernel on this machine")
    asked: list[str] = []

    def approximates(fmt, rt=None):
        asked.append(fmt.name)
        return True

    monkeypatch.setattr(int8_linear, "approximates", approximates)
    return asked


def test_streaming_drafts_through_the_int8_route_and_stays_exact(monkeypatch):
    """StreamingLLM on a Q4_1 target: its draft forwards take the int8 route (each 1-row linear inside them),
    its verify the exact kernel: the answer is the target's own generate, token for token, with drafts
    partly accepted."""
    from specdec.drafters.self_spec import StreamingDrafter

    asked = _int8_route_everywhere(monkeypatch)
    target = tiny_quant_llama("Q4_1")
    ids = prompts(96)[2][None]
    want = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    drafter = StreamingDrafter(target, budget=12, sink=2, overshoot=4)
    out = SpecDecoder(target, drafter, SpecDecoderConfig(draft_length=FIXED_DRAFTS)).generate(ids, max_new_tokens=24)
    assert torch.equal(out.sequences, want)
    assert asked and set(asked) == {"Q4_1"}
    assert 0 < sum(sum(s.num_accepted) for s in out.steps) < sum(sum(s.num_drafted) for s in out.steps)
    assert not int8_linear._approximate.get()


def test_the_decoder_checks_the_int8_route_up_front_only_for_drafters_that_declare_it(monkeypatch):
    """Entering a generation's kernels checks the int8 draft route of the target's formats for a drafter
    that declares ``approximate_forwards`` (self-speculation, and a chooser with it among its sources),
    and not for one that does not (a copying drafter): that check is paid only where drafts use it."""
    from specdec.drafters import PromptLookupDrafter
    from specdec.drafters.chooser import Sources
    from specdec.drafters.self_spec import StreamingDrafter

    asked = _int8_route_everywhere(monkeypatch)
    target = tiny_quant_llama("Q4_1")
    streaming = StreamingDrafter(target, budget=12, sink=2, overshoot=4)
    for drafter, want in ((PromptLookupDrafter(), set()), (None, set()), (streaming, {"Q4_1"}),
                          (Sources({"lookup": PromptLookupDrafter(), "streaming": streaming}), {"Q4_1"})):
        asked.clear()
        with SpecDecoder(target, drafter).running():
            assert set(asked) == want, drafter


def test_streaming_samples_through_the_int8_route_as_the_quantized_target_does(monkeypatch):
    """Sampling with StreamingLLM drafts whose q comes through the int8 route (allowed for every row count
    here, so that 2,000-row batches take it): the first two new tokens follow the Q4_1 target's own joint
    distribution (chi-square and total variation, 20,000 samples)."""
    from specdec.bench.distribution import pair_mismatch, two_token_tables
    from specdec.drafters.self_spec import StreamingDrafter
    from specdec.sampling import SamplingParams

    asked = _int8_route_everywhere(monkeypatch)
    monkeypatch.setattr(int8_linear, "APPROX_ROWS", 4096)
    target = tiny_quant_llama("Q4_1", seed=3)
    prompt = torch.tensor([[1, 5, 7, 5, 7, 9]])
    with torch.inference_mode():
        p1, p2 = two_token_tables(target, prompt, SamplingParams.resolve(target, temperature=0.8))
    pairs, drafted, _ = sampled_pairs(target, StreamingDrafter(target, budget=3, sink=1, overshoot=1), prompt)
    assert drafted > 0 and asked
    mismatch = pair_mismatch(pairs, p1[:, None] * p2)
    assert mismatch is None, mismatch
