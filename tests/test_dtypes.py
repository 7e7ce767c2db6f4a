"""Generation whatever the dtypes: a float64 default dtype (common in numerics work; the library makes
its own tensors with explicit dtypes), bfloat16 and float64 targets."""

import warnings

import pytest
import torch

from conftest import hf_greedy, tiny_llama
from specdec.config import RuntimeConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import PromptLookupDrafter
from specdec.runtime import calibrate, kernels, state


@pytest.fixture
def float64_default():
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


FAST = SpecDecoderConfig(runtime=RuntimeConfig(calibrate=False))  # no full-size self-check in a unit test


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)


def test_the_self_check_under_a_float64_default_dtype(float64_default, monkeypatch):
    """The self-check makes float32 weights and inputs (the packed kernel takes nothing else) whatever
    the default dtype; the routes it picks then run an fp32 model."""
    monkeypatch.setattr(state, "CALIBRATED", {})
    routes = calibrate.calibrate(RuntimeConfig(calibration_cache=False), features=(64, 32), rounds=1, vocab=256,
                                 stream_mb=1)
    assert len(routes.linear) == kernels.MAX_ROWS and routes.chunked in (True, False)
    target = tiny_llama(1, dtype=torch.float32)
    ids = _prompt(1)
    out = SpecDecoder(target, PromptLookupDrafter(), FAST).generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generation_under_a_float64_default_dtype_is_exact(float64_default, dtype):
    target = tiny_llama(2, dtype=dtype)
    ids = _prompt(2)
    out = SpecDecoder(target, PromptLookupDrafter(), FAST).generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))


def test_a_float64_target_is_exact():
    target = tiny_llama(3, dtype=torch.float64)
    ids = _prompt(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not token-exact" warning for an exact dtype
        out = SpecDecoder(target, PromptLookupDrafter(), FAST).generate(ids, max_new_tokens=20)
    assert torch.equal(out.sequences, hf_greedy(target, ids, 20))


def test_a_bfloat16_target_generates_and_says_it_is_not_token_exact():
    """bfloat16 rounds a verify block's rows differently from one row at a time, so drafts may change a
    near tie: the speculative run is only required to run; plain decoding is HF's greedy output on this
    tiny model (on the real one it drifts from generate's after a near tie: the decoder warns)."""
    target = tiny_llama(4, dtype=torch.bfloat16)
    ids = _prompt(4)
    with pytest.warns(UserWarning, match="computes in torch.bfloat16.*float32 or float64 weights"):
        decoder = SpecDecoder(target, PromptLookupDrafter(), FAST)
    out = decoder.generate(ids, max_new_tokens=20)
    spec_exact = torch.equal(out.sequences, hf_greedy(target, ids, 20))
    print("bf16 speculative == HF greedy:", spec_exact)
    assert out.sequences.shape == (1, ids.shape[1] + 20) and out.sequences.dtype == torch.long
    with pytest.warns(UserWarning, match="computes in torch.bfloat16"):
        plain = SpecDecoder(target, None, FAST).generate(ids, max_new_tokens=20)
    assert torch.equal(plain.sequences, hf_greedy(target, ids, 20))
