"""Random-weight Llama GGUFs (specdec.quant.write) and `specdec bench-scaling`: the files load packed
in every writable type and decode losslessly, a damaged cached file is written again, and the bench
writes its JSON for a tiny shape."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import SpecDecoder, SpecDecoderConfig
from specdec.config import RuntimeConfig, use
from specdec.drafters import PromptLookupDrafter
from specdec.models import default_gguf_path
from specdec.quant import QuantEmbedding, QuantLinear
from specdec.quant.numerics import numerics_of
from specdec.quant.write import (SHAPES, WRITABLE, LlamaShape, cached_random_gguf, gguf_opens, write_f32_gguf,
                                 write_random_gguf)

UNCALIBRATED = RuntimeConfig(calibrate=False)  # the kernel for every few-row forward: no full-size self-check here
# one file holding every writable type, with a separate output layer: tiny, but every path of a large one
MIXED = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q6_K",
         "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q4_K", "output": "Q4_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    shape = LlamaShape(hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2, tied=False)
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", shape, "Q4_K", seed=1, overrides=MIXED,
                             tokenizer_from=default_gguf_path())


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """A cache folder holding the tiny Q4_0 file, written once for the tests that read it."""
    cache = tmp_path_factory.mktemp("random-gguf")
    cached_random_gguf("tiny", "Q4_0", cache, tokenizer_from=default_gguf_path())
    return cache


def test_random_gguf_of_every_type_loads_packed_and_speculative_greedy_is_its_own_generate(mixed_gguf):
    from specdec.models import load_model

    model = load_model(str(mixed_gguf), weights="packed").model
    quant = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert {m.fmt.name for m in quant.values()} == set(WRITABLE)
    assert quant["lm_head"].fmt.name == "Q4_K" and quant["model.embed_tokens"].fmt.name == "Q8_0"  # not tied
    assert not [n for n, p in model.named_parameters() if p.dim() == 2]  # no fp32 matrix anywhere
    assert model.config.vocab_size == 49152 and model.config.num_key_value_heads == 2
    base = torch.randint(17, 49152, (5,), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([base, base, base[:2]])  # repeats: prompt lookup drafts and is partly accepted
    decoder = SpecDecoder(model, PromptLookupDrafter(), SpecDecoderConfig(runtime=UNCALIBRATED))
    out = decoder.generate(prompt[None], max_new_tokens=10, eos_token_id=[])
    with use(UNCALIBRATED):  # the target's own generate on the same routes
        ref = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert sum(sum(s.num_drafted) for s in out.steps) > 0  # drafts were verified: a speculative run
    assert out.generated(0).tolist() == ref[0, len(prompt):].tolist()


def test_an_f32_copy_holds_the_dequantized_weights_and_every_key(mixed_gguf, tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    src, out = GGUFReader(str(mixed_gguf)), GGUFReader(str(write_f32_gguf(mixed_gguf, tmp_path / "f32.gguf")))
    assert {t.tensor_type for t in out.tensors} == {GGMLQuantizationType.F32}
    for a, b in zip(src.tensors, out.tensors, strict=True):
        assert a.name == b.name and np.array_equal(dequantize(a.data, a.tensor_type), b.data), a.name
    keys = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}  # noqa: E731
    want = keys(src) | {"general.file_type": 0}
    assert keys(out) == want


def test_named_shapes_are_whole_q4_k_rows_and_near_their_names():
    for name, shape in SHAPES.items():
        shape.check()
        assert shape.hidden % 256 == 0 and shape.intermediate % 256 == 0, name
    assert 0.4e9 < SHAPES["0.5b"].params() < 0.6e9 and 1.3e9 < SHAPES["1.5b"].params() < 1.7e9


def test_a_damaged_cached_gguf_is_written_again_not_reused(tiny_cache, tmp_path):
    [whole] = tiny_cache.iterdir()
    path = Path(shutil.copy(whole, tmp_path))  # a damaged copy; the shared file stays whole
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)  # a copy cut short
    assert not gguf_opens(path)
    again = cached_random_gguf("tiny", "Q4_0", tmp_path, tokenizer_from=default_gguf_path())
    assert again == path and again.stat().st_size == size and gguf_opens(again)


def test_a_write_that_fails_midway_leaves_no_file(tmp_path, monkeypatch):
    from specdec.quant import write

    calls = []

    def failing(w, quant):
        calls.append(quant)
        if len(calls) > 3:
            raise MemoryError("killed midway")
        return np.zeros((w.shape[0], w.shape[1] // 32 * 18), dtype=np.uint8)

    monkeypatch.setattr(write, "quantize_rows", failing)
    with pytest.raises(MemoryError):
        write.cached_random_gguf("tiny", "Q4_0", tmp_path, tokenizer_from=default_gguf_path())
    assert os.listdir(tmp_path) == []  # neither the file nor its temp file


def test_writer_names_an_unwritable_type_and_a_shape_of_partial_blocks(tmp_path):
    with pytest.raises(ValueError, match=r"cannot write 'Q5_K' weights: writable types are Q8_0, Q4_0, Q4_1, Q4_K, "
                                         r"Q6_K \(mixes: Q4_K_M\)"):
        write_random_gguf(tmp_path / "x.gguf", SHAPES["tiny"], "q5_k", tokenizer_from=default_gguf_path())
    odd = LlamaShape(hidden=896, layers=1, intermediate=4864, heads=14, kv_heads=2, tied=True)
    with pytest.raises(ValueError, match="Q4_K needs rows of whole 256-weight blocks: hidden 896"):
        write_random_gguf(tmp_path / "x.gguf", odd, "Q4_K", tokenizer_from=default_gguf_path())
    assert not list(tmp_path.iterdir())


def _calibrates(_: str) -> bool:
    from specdec.config import current

    return current().calibrate


def test_a_measurement_in_a_fresh_process_runs_under_this_ones_runtime():
    from specdec.bench.scaling import in_fresh_process

    assert RuntimeConfig().calibrate  # the default: a child that did not get this runtime would calibrate
    with use(UNCALIBRATED):
        assert in_fresh_process(_calibrates, "x") is False


def test_bench_scaling_writes_its_json_for_a_tiny_shape(tiny_cache, tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_KERNEL_CALIBRATE", "off")  # the measurement: no full-size self-check
    out = tmp_path / "scaling.json"
    # in this process: the harness is what is checked here, not a figure (a fresh one re-imports torch)
    argv = ["bench-scaling", "--shapes", "tiny", "--quants", "q4_0", "--tokens", "4", "--prompt-tokens", "8",
            "--cache-dir", str(tiny_cache), "--out", str(out), "--in-process"]
    assert main(argv) == 0
    [entry] = json.loads(out.read_text())["entries"]
    assert entry["shape"] == "tiny" and entry["quant"] == "Q4_0" and entry["specdec"]["new_tokens"] == 4
    rss = entry["specdec"]["rss"]
    assert 0 < rss["before_load"] <= rss["after_load"] and entry["rss_growth_bytes"] > 0
    assert set(rss) == set(entry["specdec"]["rss_anon"]) == {"before_load", "after_load", "after_warm_up",
                                                              "after_decode", "after_trim"}
    assert entry["specdec"]["kv_bytes"] == 2 * 2 * 2 * 64 * 4 * (8 + 4)  # layers x K,V x heads x dim x 4 B x rows
    assert entry["llama.cpp"] == {"skipped": "no --peer-python given"}
    assert main(argv) == 0 and "already in" in capsys.readouterr().out  # resumed: the entry is not run again


def test_bench_scaling_self_draft_writes_the_costs_of_a_tiny_bf16_target(tmp_path, capsys, monkeypatch):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_KERNEL_CALIBRATE", "off")
    out = tmp_path / "scaling.json"
    argv = ["bench-scaling", "--self-draft", "bfloat16", "--shapes", "tiny", "--tokens", "12", "--prompt-tokens", "8",
            "--out", str(out), "--in-process"]
    assert main(argv) == 0
    [e] = json.loads(out.read_text())["self_draft"]
    assert (e["shape"], e["dtype"], e["tokens"]) == ("tiny", "bfloat16", 12)
    assert min(e["target_ms"], e["draft_ms"], e["verify_ms"]) > 0 and 1 <= e["tau"] <= 4  # 3 drafted + 1
    assert e["c"] == pytest.approx(e["draft_ms"] / e["target_ms"])
    assert e["predicted_speedup"] == pytest.approx(3 * e["target_ms"] / (3 * e["draft_ms"] + e["verify_ms"]))
    assert main(argv) == 0 and "already in" in capsys.readouterr().out  # resumed, not measured again


def test_a_q4_k_m_file_mixes_q6_k_as_llama_cpp_does_and_runs_int8_exactly(tmp_path):
    """"Q4_K_M": Q4_K, with Q6_K for attn_v, ffn_down and the (tied: embedding's) output layer; the file says
    MOSTLY_Q4_K_M; loaded with the commands' numerics rule it runs int8, and speculation equals its own plain
    decoding."""
    from gguf import GGUFReader

    from specdec.models import load_model

    path = cached_random_gguf("tiny", "Q4_K_M", tmp_path, tokenizer_from=default_gguf_path())
    reader = GGUFReader(str(path))
    types = {t.name.split(".")[-2]: t.tensor_type.name for t in reader.tensors if t.name.endswith("weight")}
    assert {k: v for k, v in types.items() if v == "Q6_K"}.keys() == {"attn_v", "ffn_down", "token_embd"}
    assert {v for k, v in types.items() if "norm" not in k and v != "Q6_K"} == {"Q4_K"}
    assert int(reader.fields["general.file_type"].contents()) == 15
    model = load_model(str(path), weights="packed", numerics="auto").model
    assert numerics_of(model) == "int8"
    base = torch.randint(17, 49152, (5,), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([base, base, base[:2]])
    config = SpecDecoderConfig(runtime=UNCALIBRATED)
    plain = SpecDecoder(model, None, config).generate(prompt[None], max_new_tokens=10, eos_token_id=[])
    out = SpecDecoder(model, PromptLookupDrafter(), config).generate(prompt[None], max_new_tokens=10, eos_token_id=[])
    assert out.generated(0).tolist() == plain.generated(0).tolist()
