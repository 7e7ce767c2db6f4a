"""Start-up: the lean GGUF index reads what the gguf package reads, the self-checks' verdicts kept on disk
are used only when whole, for this machine and build, and after a spot check, and a command imports
only its own module."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import model_cache, models
from specdec.config import RuntimeConfig
from specdec.formats import FORMATS
from specdec.quant.gguf_index import open_index
from specdec.runtime import calibrate, kernels, qlinear, state, verdicts
from specdec.runtime import linear as lin

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "gguf").glob("*.gguf"))
SMALL = dict(features=(64, 32), rounds=1, vocab=256, stream_mb=1)  # a self-check in milliseconds


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_the_gguf_index_reads_the_tensors_and_scalars_the_gguf_reader_reads(path):
    from gguf import GGUFReader

    reader, index = GGUFReader(str(path)), open_index(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(reader.tensors, index.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in index.fields:  # scalars and strings
            assert index.fields[key].contents() == pytest.approx(field.contents()), key
        else:  # arrays are stepped over
            assert field.types[0].name == "ARRAY", key


def test_the_gguf_index_names_a_truncated_or_foreign_file(tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(FIXTURES[0].read_bytes()[:-100])
    with pytest.raises(ValueError, match="could not read GGUF file .*cut.gguf: tensor .* runs past the end"):
        open_index(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="could not read GGUF file .*other.gguf: GGUF magic invalid"):
        open_index(other)


@pytest.fixture
def kept(tmp_path, monkeypatch) -> Path:
    """The folder of kept verdicts, the test's own (the build stays the shared one: another cache_dir would
    load a second build of the same ops); skipped without a kernel build."""
    if kernels.extension(RuntimeConfig()) is None:
        pytest.skip("no kernel build on this machine")
    monkeypatch.setattr(verdicts, "folder", lambda config: tmp_path / "selfcheck")
    return tmp_path / "selfcheck"


def test_a_verdict_is_read_back_only_whole_and_for_the_same_key(kept, monkeypatch):
    config = RuntimeConfig()
    verdicts.store(config, "routes", {"n": 1}, {"x": [1, 2]})
    [path] = kept.glob("routes-*.json")
    assert verdicts.load(config, "routes", {"n": 1}) == {"x": [1, 2]}
    assert verdicts.load(config, "routes", {"n": 2}) is None  # other parameters
    assert verdicts.load(RuntimeConfig(hugepages=False), "routes", {"n": 1}) is None
    assert verdicts.load(RuntimeConfig(calibration_cache=False), "routes", {"n": 1}) is None
    threads = torch.get_num_threads()
    with monkeypatch.context() as m:
        m.setattr(verdicts.torch, "get_num_threads", lambda: threads + 1)  # another thread count
        assert verdicts.load(config, "routes", {"n": 1}) is None
    record = json.loads(path.read_text())
    record["verdict"]["x"][0] = 7  # edited without its checksum
    path.write_text(json.dumps(record))
    assert verdicts.load(config, "routes", {"n": 1}) is None
    path.write_text(path.read_text()[:40])  # torn
    assert verdicts.load(config, "routes", {"n": 1}) is None
    verdicts.store(config, "routes", {"n": 1}, {"x": [3]})  # the next check's verdict replaces it
    assert verdicts.load(config, "routes", {"n": 1}) == {"x": [3]}
    assert [p.name for p in kept.iterdir()] == [path.name]  # no temp file left
    path.unlink()
    verdicts.store(RuntimeConfig(calibration_cache=False), "routes", {"n": 1}, {"x": [3]})
    assert not any(kept.iterdir())


def test_the_next_process_takes_the_kept_routes_after_their_spot_check(kept, monkeypatch):
    config = RuntimeConfig()
    monkeypatch.setattr(state, "CALIBRATED", {})
    timed = calibrate.calibrate(config, **SMALL)
    monkeypatch.setattr(state, "CALIBRATED", {})  # a new process

    def no_timing(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(calibrate, "_calibrate", no_timing)
    spot = []
    monkeypatch.setattr(calibrate, "spot_check", lambda routes, rt: spot.append(routes) or True)
    assert calibrate.calibrate(config, **SMALL) == timed and spot == [timed]


def test_a_kept_route_that_computes_wrong_is_timed_again(kept, monkeypatch):
    config = RuntimeConfig()
    monkeypatch.setattr(state, "CALIBRATED", {})
    wrong = state.Routes(("mm",) * kernels.MAX_ROWS, False, state.frozen_points(
        {(r, k): False for r in kernels.ATTENTION_POINTS[0] for k in kernels.ATTENTION_POINTS[1]}))
    params = {"features": list(SMALL["features"]), "rounds": 1, "vocab": 256, "stream_mb": 1}
    verdicts.store(config, "routes", params, calibrate._as_record(wrong))
    rt = state.resolve(config)
    assert calibrate.spot_check(wrong, rt)  # right as it is
    monkeypatch.setattr(lin, "_skinny", lambda x, w: torch.mm(w, x.t()).t() + 1e-2)  # "mm" now computes wrong
    assert not calibrate.spot_check(wrong, rt)
    timed = []
    monkeypatch.setattr(calibrate, "_calibrate", lambda *a: timed.append(a) or wrong)
    calibrate.calibrate(config, **SMALL)
    assert len(timed) == 1


def test_kept_routes_that_name_a_route_this_build_lacks_are_not_read(kept):
    rt = state.resolve(RuntimeConfig())
    record = calibrate._as_record(state.Routes(("linear",) * kernels.MAX_ROWS, True, state.frozen_points(
        {(r, k): True for r in kernels.ATTENTION_POINTS[0] for k in kernels.ATTENTION_POINTS[1]})))
    assert calibrate._from_record(record, rt) is not None
    assert calibrate._from_record({**record, "linear": ["nope"] * kernels.MAX_ROWS}, rt) is None
    assert calibrate._from_record({**record, "linear": ["mm"]}, rt) is None  # a size missing
    assert calibrate._from_record({**record, "attention": record["attention"][1:]}, rt) is None
    no_kernel = state.Active(rt.config, None, rt.routes)
    assert calibrate._from_record({**record, "linear": ["packed"] * kernels.MAX_ROWS}, no_kernel) is None


def test_the_kept_block_kernel_routes_are_spot_checked_and_checked_again_when_wrong(kept, monkeypatch):
    config = RuntimeConfig()
    fmt = FORMATS["Q4_1"]
    rt = state.resolve(config)
    first = qlinear._checked(rt, fmt)  # timed and kept
    checks = []
    monkeypatch.setattr(qlinear, "self_check", lambda rt, fmt: checks.append(fmt) or first)
    assert qlinear._checked(rt, fmt) == first and checks == []  # kept: the correctness half only

    class Wrong:  # the kernel off by one wherever it runs
        def quant_linear(self, x, blocks, t):
            return rt.ops.quant_linear(x, blocks, t) + 1.0

        def quant_dequantize(self, blocks, types, out):
            rt.ops.quant_dequantize(blocks, types, out)

    if any(first.kernel):
        qlinear._checked(state.Active(config, Wrong(), rt.routes), fmt)
        assert checks == [fmt]


def test_a_command_imports_its_own_module_only(monkeypatch):
    import specdec.cli as cli

    imported = []
    real = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: imported.append(name) or real(name))
    args = cli.build_parser({"generate"}).parse_args(["generate", "hi", "--max-new-tokens", "3"])
    assert imported == ["specdec.cli.generate"] and args.max_new_tokens == 3
    assert cli._command_named(["chat", "--drafter", "auto"]) == "chat" and cli._command_named(["-h"]) is None


def test_the_spot_check_runs_the_routes_on_fp32_whatever_the_default_dtype(kept):
    rt = state.resolve(RuntimeConfig())
    routes = state.Routes(("mm", "packed") * (kernels.MAX_ROWS // 2), True, state.frozen_points(
        {(r, k): True for r in kernels.ATTENTION_POINTS[0] for k in kernels.ATTENTION_POINTS[1]}))
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert calibrate.spot_check(routes, rt)
    finally:
        torch.set_default_dtype(saved)


def test_cached_weights_are_hashed_once_per_change(tmp_path, monkeypatch):
    """A cache folder's weights hashed right are not hashed again while their stat stays the same; a
    change (even of one byte, size kept) is hashed and refused, and a file changed within SETTLED_S of now
    is hashed at every load."""
    import os
    import time

    w = tmp_path / "model.safetensors"
    w.write_bytes(b"x" * 4096)
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": model_cache.CACHE_FORMAT, "size": 4096, "sha256": model_cache.sha256(w)}))
    hashed = []
    real = model_cache.sha256
    monkeypatch.setattr(model_cache, "sha256", lambda f: hashed.append(f) or real(f))
    assert model_cache.is_valid(tmp_path) and model_cache.is_valid(tmp_path)
    assert len(hashed) == 2 and not (tmp_path / model_cache.VERIFIED).exists()  # just written: hashed each time
    old = time.time() - 10
    os.utime(w, (old, old))  # settled (ctime moves too, to now: recorded only once it is old enough)
    monkeypatch.setattr(model_cache, "SETTLED_S", -1.0)
    assert model_cache.is_valid(tmp_path) and len(hashed) == 3 and (tmp_path / model_cache.VERIFIED).exists()
    assert model_cache.is_valid(tmp_path) and len(hashed) == 3  # the stat as recorded: not hashed again
    w.write_bytes(b"x" * 4095 + b"y")  # same size, one byte changed
    assert not model_cache.is_valid(tmp_path) and len(hashed) == 4
    (tmp_path / model_cache.VERIFIED).write_text("{torn")
    w.write_bytes(b"x" * 4096)
    assert model_cache.is_valid(tmp_path) and len(hashed) == 5


def test_the_process_entry_skips_the_teardown_after_a_quick_command_only(monkeypatch):
    import specdec.cli as cli

    ran, ended = [], []
    monkeypatch.setattr(cli, "main", lambda argv: ran.append(argv) or 3)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: ended.append("atexit"))
    monkeypatch.setattr(cli.os, "_exit", lambda code: ended.append(code))
    monkeypatch.setattr(cli.sys, "argv", ["specdec", "generate", "hi"])
    cli.entry()
    assert ran == [["generate", "hi"]] and ended == ["atexit", 3]  # exit handlers, then the process ends
    monkeypatch.setattr(cli.sys, "argv", ["specdec", "bench-kv"])
    with pytest.raises(SystemExit) as e:  # any other command: the interpreter's own exit
        cli.entry()
    assert e.value.code == 3 and ended == ["atexit", 3]


def test_mapped_safetensors_are_the_files_tensors_and_writes_stay_in_the_process(tmp_path):
    from safetensors.torch import load_file, save_file

    f = tmp_path / "w.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(3, 5, generator=g), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, generator=g).to(torch.bfloat16)}, str(f))
    mapped, ref = models._mapped_safetensors(f), load_file(str(f))
    assert mapped.keys() == ref.keys() and all(torch.equal(mapped[k], ref[k]) for k in ref)
    mapped["a"].mul_(0)  # copy-on-write: this process's page only
    assert torch.equal(load_file(str(f))["a"], ref["a"])
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(models.ModelLoadError, match="corrupt weights file .*cut.safetensors"):
        models._mapped_safetensors(cut)


def test_a_tied_output_layer_kept_once_is_tied_again(tmp_path):
    from accelerate import init_empty_weights
    from safetensors.torch import save_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = LlamaForCausalLM(config).eval()
    save_model(source, str(tmp_path / "model.safetensors"))  # the tied pair under one name
    with init_empty_weights(include_buffers=False):
        model = LlamaForCausalLM(config).eval()
    models._assign_parameters(model, models._mapped_safetensors(tmp_path / "model.safetensors"), tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.requires_grad
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(model(ids).logits, source(ids).logits)
