"""specdec.kernels: the skinny-GEMM route for few-row linear layers on CPU."""

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_greedy, perturbed, tiny_llama
from specdec import kernels
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(1, rows, 40, generator=g)  # [B, Q, K], as a decoder layer passes it
    y = kernels.linear(x, w, b, max_rows=8)
    assert y.shape == (1, rows, 96) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_takes_the_skinny_path_only_where_it_applies(monkeypatch):
    calls = []
    real = kernels._skinny
    monkeypatch.setattr(kernels, "_skinny", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    w = torch.randn(16, 8)
    kernels.linear(torch.randn(3, 8), w)
    assert calls == [3]  # one chunk (padded to 4 inside)
    kernels.linear(torch.randn(6, 8), w, max_rows=8)
    assert calls == [3, 4, 2]  # then chunks of 4 and 2
    calls.clear()
    kernels.linear(torch.randn(5, 8), w)  # more rows than max_rows
    kernels.linear(torch.randn(2, 8, dtype=torch.float64), w.double())  # not fp32
    kernels.linear(torch.randn(2, 8, requires_grad=True), w)  # training needs F.linear's autograd
    kernels.linear(torch.randn(2, 8), w, max_rows=0)  # off
    assert calls == []


def test_skinny_linears_patches_and_restores():
    model = tiny_llama(3, dtype=torch.float32)
    lin = model.model.layers[0].mlp.down_proj
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        ref = model(ids).logits
        with kernels.skinny_linears(model):
            assert "forward" in vars(lin)
            with kernels.skinny_linears(model):  # nested: the inner one patches nothing
                pass
            assert "forward" in vars(lin)  # ... and so restores nothing
            got = model(ids).logits
        assert "forward" not in vars(lin)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("drafter", ["perturbed", "prompt-lookup", "none"])
def test_fp32_lossless_through_skinny_kernels(seed, drafter, monkeypatch):
    """fp32 targets take the skinny path (the float64 tiny models of the other tests do not)."""
    calls = []
    real = kernels._skinny
    monkeypatch.setattr(kernels, "_skinny", lambda x, w: calls.append(1) or real(x, w))
    target = tiny_llama(seed, dtype=torch.float32)
    d = {"perturbed": lambda: ModelDrafter(perturbed(target, 0.3, seed)),
         "prompt-lookup": lambda: PromptLookupDrafter(), "none": lambda: None}[drafter]()
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
    want = hf_greedy(target, ids, 40)
    got = SpecDecoder(target, d).generate(ids, max_new_tokens=40).sequences
    assert torch.equal(got, want)
    assert calls, "the skinny path never ran"


def test_skinny_rows_zero_keeps_torch_path(target, monkeypatch):
    monkeypatch.setattr(kernels, "_skinny", lambda x, w: pytest.fail("skinny path used with skinny_rows=0"))
    model = tiny_llama(4, dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    out = SpecDecoder(model, PromptLookupDrafter(), SpecDecoderConfig(skinny_rows=0)).generate(ids, max_new_tokens=10)
    assert torch.equal(out.sequences, hf_greedy(model, ids, 10))
