"""specdec.runtime.kernels: the fast routes for few-row linear layers on CPU (MKL's skinny GEMM for 1-4 rows,
the packed kernel for 5-16, balanced chunks of those for 17-128)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import hf_greedy, perturbed, tiny_llama
from specdec.config import RuntimeConfig, use
from specdec.patch import skinny_linears
from specdec.runtime import build, kernels, memory, state
from specdec.runtime import linear as lin
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 21, 33, 128, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(97, 40, generator=g)  # 97: a last panel of one output feature
    b = torch.randn(97, generator=g) if bias else None
    x = torch.randn(1, rows, 40, generator=g)  # [B, Q, K], as a decoder layer passes it
    y = kernels.linear(x, w, b, max_rows=kernels.CHUNK_ROWS)
    assert y.shape == (1, rows, 97) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


UNCALIBRATED = RuntimeConfig(calibrate=False)  # a generation that leaves the routes uncalibrated


def _routes(monkeypatch, linear=None, chunked=True, attention=None):
    """The routes the default variant takes, as if its self-check had chosen them (default: the
    uncalibrated ones)."""
    routes = state.Routes(tuple(linear) if linear else state.uncalibrated(True).linear, chunked, attention)
    monkeypatch.setitem(state.CALIBRATED, kernels.variant(), routes)


def _count(monkeypatch):
    """Calls per route: 'mm' (W @ x^T) and 'packed' (the kernel), on the uncalibrated routes (1-4 rows
    mm, 5-16 the kernel; chunks wherever the kernel is built) so that which route runs does not depend
    on this machine's timings (generations run under UNCALIBRATED)."""
    monkeypatch.setattr(state, "CALIBRATED", {})
    calls = {"mm": 0, "packed": 0}
    real_mm, real_packed = lin._skinny, lin._packed_linear

    def mm(x, w):
        calls["mm"] += 1
        return real_mm(x, w)

    def packed(x, w, wide=False):
        calls["packed"] += 1
        return real_packed(x, w, wide)

    monkeypatch.setattr(lin, "_skinny", mm)
    monkeypatch.setattr(lin, "_packed_linear", packed)
    return calls


def test_the_kernel_builds_here():
    assert kernels.extension() is not None, "the packed kernel did not build (compiler? ninja?)"


def test_linear_takes_each_route_only_where_it_applies(monkeypatch):
    calls = _count(monkeypatch)  # the uncalibrated routes: 1-4 mm, 5-16 packed
    w = torch.randn(16, 8)
    kernels.linear(torch.randn(3, 8), w)
    kernels.linear(torch.randn(4, 8), w)
    assert calls == {"mm": 2, "packed": 0}
    kernels.linear(torch.randn(5, 8), w)
    kernels.linear(torch.randn(16, 8), w)
    assert calls == {"mm": 2, "packed": 2}
    kernels.linear(torch.randn(17, 8), w)  # more rows than max_rows (MAX_ROWS unless asked)
    kernels.linear(torch.randn(2, 8), w, max_rows=1)  # more rows than max_rows
    kernels.linear(torch.randn(129, 8), w, max_rows=200)  # more rows than CHUNK_ROWS
    kernels.linear(torch.randn(2, 8, dtype=torch.float64), w.double())  # not fp32
    kernels.linear(torch.randn(6, 8, requires_grad=True), w)  # training needs F.linear's autograd
    kernels.linear(torch.randn(2, 8), w, max_rows=0)  # off
    assert calls == {"mm": 2, "packed": 2}
    kernels.linear(torch.randn(20, 8), w, max_rows=32)  # 10 + 10 rows, each chunk by the kernel
    kernels.linear(torch.randn(35, 8), w, max_rows=kernels.CHUNK_ROWS)  # 12 + 12 + 11
    assert calls == {"mm": 2, "packed": 7}
    _routes(monkeypatch, chunked=False)  # calibrated: chunks lost to F.linear here
    kernels.linear(torch.randn(20, 8), w, max_rows=32)
    assert calls == {"mm": 2, "packed": 7}


def test_chunks_are_the_fewest_and_balanced():
    assert kernels.chunks(1) == [(0, 1)] and kernels.chunks(16) == [(0, 16)]
    assert kernels.chunks(17) == [(0, 9), (9, 17)]  # 9 + 8, not 16 + 1
    assert kernels.chunks(40) == [(0, 14), (14, 28), (28, 40)]
    for rows in range(1, kernels.CHUNK_ROWS + 1):
        parts = kernels.chunks(rows)
        sizes = [b - a for a, b in parts]
        assert parts[0][0] == 0 and parts[-1][1] == rows and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
        assert len(parts) == -(-rows // kernels.MAX_ROWS) and max(sizes) <= kernels.MAX_ROWS
        assert len(set(sizes[:-1])) <= 1 and 0 <= sizes[0] - sizes[-1] < len(parts)  # balanced


def test_without_the_kernel_five_rows_and_more_take_f_linear(monkeypatch):
    monkeypatch.setattr(state, "CALIBRATED", {})
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(33, 24, generator=g), torch.randn(7, 24, generator=g)
    with use(RuntimeConfig(kernel="off")):
        assert kernels.extension() is None and kernels.routes()[6] == "linear"
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=0, atol=0)  # F.linear itself


@pytest.mark.parametrize("route", ["packed", "wide"])
def test_each_kernel_shape_agrees_with_f_linear_at_every_block_size(route, monkeypatch):
    """The narrow shape (one panel, up to 16 rows a pass) and the wide one (two panels side by side
    for 3-12 rows, 13-16 rows in two passes; AVX-512 builds, the narrow one elsewhere), taken through
    ``linear`` when the routes say so: output widths that leave a lone panel in a strip, odd
    feature counts, every block size 1-16 and chunks past it."""
    if kernels.extension() is None:
        pytest.skip("no compiler: the kernel is not built here")
    _routes(monkeypatch, (route,) * kernels.MAX_ROWS, chunked=True)
    g = torch.Generator().manual_seed(7)
    for n, k in ((97, 40), (80, 7), (33, 64), (16, 1)):
        w = torch.randn(n, k, generator=g)
        for rows in [*range(1, 17), 29]:
            x = torch.randn(rows, k, generator=g)
            torch.testing.assert_close(kernels.linear(x, w, max_rows=32), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_packed_weight_is_reused_until_the_weight_changes():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(40, 16, generator=g), torch.randn(6, 16, generator=g)
    assert kernels.packed(w) is kernels.packed(w)
    w.mul_(2)  # an in-place update: the old packing is stale
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    key = (id(w), kernels.variant())
    del w
    assert key not in lin._packs  # dropped with its weight


def test_skinny_linears_patches_and_restores(monkeypatch):
    _count(monkeypatch)
    model = tiny_llama(3, dtype=torch.float32)
    down = model.model.layers[0].mlp.down_proj
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        ref = model(ids).logits
        with skinny_linears(model, runtime=UNCALIBRATED):
            assert "forward" in vars(down)
            assert (id(down.weight), kernels.variant()) in lin._packs  # packed on entry, not during a step
            with skinny_linears(model, runtime=UNCALIBRATED):  # nested: the inner one patches nothing
                pass
            assert "forward" in vars(down)  # ... and so restores nothing
            got = model(ids).logits
        assert "forward" not in vars(down)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("drafter", ["perturbed", "prompt-lookup", "none"])
@pytest.mark.parametrize("draft", [3, 12, 20])
def test_fp32_lossless_through_the_kernels(seed, drafter, draft, monkeypatch):
    """fp32 targets take the fast routes (the float64 tiny models of the other tests do not); drafts
    of 12 make verify blocks of 5-13 rows, the packed kernel's; of 20, up to 21 rows in two chunks."""
    calls = _count(monkeypatch)
    target = tiny_llama(seed, dtype=torch.float32)
    d = {"perturbed": lambda: ModelDrafter(perturbed(target, 0.3, seed)),
         "prompt-lookup": lambda: PromptLookupDrafter(), "none": lambda: None}[drafter]()
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(seed)).repeat(1, 2)
    want = hf_greedy(target, ids, 40)
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(initial=draft, maximum=draft, adaptive=False,
                                                              cost_aware=False), runtime=UNCALIBRATED)
    got = SpecDecoder(target, d, config).generate(ids, max_new_tokens=40).sequences
    assert torch.equal(got, want)
    assert calls["mm"], "the mm route never ran"
    if draft > 4 and drafter == "perturbed":
        assert calls["packed"], "the packed kernel never ran"


def test_skinny_rows_zero_keeps_torch_path(target, monkeypatch):
    monkeypatch.setattr(lin, "_skinny", lambda x, w: pytest.fail("mm route used with skinny_rows=0"))
    monkeypatch.setattr(lin, "_packed_linear", lambda x, w, wide=False: pytest.fail("packed kernel used with skinny_rows=0"))
    monkeypatch.setattr(lin, "packed", lambda *a: pytest.fail("weights packed with skinny_rows=0"))
    monkeypatch.setattr(lin, "pack", lambda *a: pytest.fail("weights packed with skinny_rows=0"))
    model = tiny_llama(4, dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    out = SpecDecoder(model, PromptLookupDrafter(), SpecDecoderConfig(skinny_rows=0)).generate(ids, max_new_tokens=10)
    assert torch.equal(out.sequences, hf_greedy(model, ids, 10))


def test_each_block_size_takes_its_fastest_route():
    """The self-check's rule: a route slower than torch's own for a block size is never taken for it."""
    seconds = {"linear": [3.0, 3.0, 3.0], "mm": [2.0, 3.0, 4.0], "packed": [1.0, 9.0, 15.0]}
    assert kernels.fastest_routes(seconds) == ("packed", "linear", "linear")  # ties go to F.linear
    assert kernels.fastest_routes({"linear": [1.0], "mm": [0.5]}) == ("mm",)  # no kernel built


def test_calibration_routes_every_size_and_stays_exact(monkeypatch):
    monkeypatch.setattr(state, "CALIBRATED", {})
    # timed here, not read from a verdict an earlier run kept (tests/test_startup.py covers those)
    chosen = kernels.calibrate(RuntimeConfig(calibration_cache=False), features=(64, 32), rounds=3, vocab=256,
                               stream_mb=1)
    assert len(chosen.linear) == kernels.MAX_ROWS and set(chosen.linear) <= set(kernels.ROUTES)
    assert kernels.routes() == chosen.linear and chosen.chunked in (True, False)
    assert set(chosen.attention) == {(r, k) for r in kernels.ATTENTION_POINTS[0] for k in kernels.ATTENTION_POINTS[1]}
    assert kernels.calibrate(RuntimeConfig()) is chosen  # once per process and variant
    for rows in (1, 5, 8, 16, 40):
        x, w = torch.randn(rows, 32), torch.randn(64, 32)
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_avx2_variant_builds_and_agrees(monkeypatch):
    """The 8-float shape, built for x86-64-v3 on any CPU that has AVX2 (skipped elsewhere)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 variant is for x86-64")
    monkeypatch.setattr(state, "CALIBRATED", {})
    avx2 = RuntimeConfig(kernel="avx2")
    ops = kernels.extension(avx2)
    assert ops is not None and ops.lanes() == 8
    g = torch.Generator().manual_seed(3)
    w = torch.randn(97, 40, generator=g)
    with use(avx2):
        for rows in (5, 8, 13, 16):
            x = torch.randn(rows, 40, generator=g)
            torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    for rows, keys in ((3, 5), (12, 300), (48, 700)):  # its attention: both ways of scoring, key splits
        q, k, v = torch.randn(2, 3, rows, 64, generator=g), torch.randn(2, 3, keys, 64), torch.randn(2, 3, keys, 64)
        torch.testing.assert_close(ops.attention(q, k, v, None, 0.125),
                                   F.scaled_dot_product_attention(q, k, v, scale=0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["native", "avx2"])
def test_the_kernel_runs_on_torchs_thread_pool(name, monkeypatch):
    """Built with OpenMP, so its at::parallel_for spreads panels over torch's threads (without it every
    strip ran on the calling thread: 4.5x slower than F.linear for one row on a Xeon), and it agrees
    with F.linear whatever the thread count."""
    import platform

    if name == "avx2" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 variant is for x86-64")
    config = RuntimeConfig(kernel=name)
    ops = kernels.extension(config)
    if ops is None:
        pytest.skip("no compiler: the kernel is not built here")
    assert ops.parallel()
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(333, 40, generator=g), torch.randn(9, 40, generator=g)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with use(config):
                torch.testing.assert_close(lin._packed_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_a_compiler_without_openmp_still_builds_a_one_thread_kernel(monkeypatch, caplog):
    """If the OpenMP build fails, the kernel is built for one thread (the self-check then weighs it like
    any route) and a warning says so; a variant of its own, so it does not clash with the loaded ops."""
    monkeypatch.setattr(build, "_OPENMP", ["-fno-such-openmp-flag"])  # the compiler rejects it
    monkeypatch.setitem(build.VARIANTS, "one-thread-test",
                        (build.VARIANTS["native"][0], "specdec_kernels_one_thread_test"))
    # only the file of the ops checked here: the fallback is the build's, not a file's (the sources reach
    # threads through at::parallel_for alone), and compiling the other four would add ~80 s of CPU
    monkeypatch.setattr(build, "_SOURCES", [build._CSRC / "packed_linear.cpp"])
    with caplog.at_level("WARNING", logger="specdec.runtime.build"):
        ops = build.build("one-thread-test", RuntimeConfig().cache_dir)
    if ops is None:
        pytest.skip("no compiler: the kernel is not built here")
    assert not ops.parallel() and "did not build with OpenMP" in caplog.text
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(50, 24, generator=g), torch.randn(7, 24, generator=g)
    torch.testing.assert_close(ops.linear(x, ops.pack(w), 50), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_skinny_linears_block_pins_its_configuration(monkeypatch):
    """A block (a generation) resolves its configuration, ops and routes once, when it starts: its linear
    calls take that configuration's kernel whatever is in force outside, and look nothing up again;
    outside a block, a call takes the configuration in force."""
    if kernels.extension() is None:
        pytest.skip("no kernel on this machine")
    x, w = torch.randn(8, 32), torch.randn(64, 32)
    resolves = {"n": 0}
    real = state.resolve

    def counted(*a, **k):
        resolves["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(state, "resolve", counted)
    with use(RuntimeConfig(kernel="off", calibrate=False)):
        with skinny_linears(max_rows=16, runtime=RuntimeConfig(calibrate=False)):
            start = resolves["n"]
            for _ in range(5):
                assert lin._packed_linear(x, w) is not None
            assert resolves["n"] == start
        assert lin._packed_linear(x, w) is None  # outside: the configuration in force (off)


def test_the_environment_is_read_into_one_configuration():
    env = {"SPECDEC_KERNEL": "avx2", "SPECDEC_KERNEL_CALIBRATE": "0", "SPECDEC_ATTENTION": "sdpa",
           "SPECDEC_FUSED": "off", "SPECDEC_ONE_CALL": "off", "SPECDEC_FASTPATH": "off", "SPECDEC_HUGEPAGES": "off",
           "SPECDEC_CACHE": "/tmp/c", "SPECDEC_EAGLE_HEAD": "/tmp/h", "SPECDEC_BENCH_THREADS": "3",
           "SPECDEC_CALIBRATION_CACHE": "off"}
    assert RuntimeConfig.from_environ(env) == RuntimeConfig(
        kernel="avx2", calibrate=False, attention="sdpa", fused=False, one_call=False, fastpath=False,
        hugepages=False, cache_dir=Path("/tmp/c"), eagle_head=Path("/tmp/h"), bench_threads=3,
        calibration_cache=False)
    assert RuntimeConfig.from_environ({}) == RuntimeConfig(cache_dir=Path("~/.cache/specdec").expanduser())
    assert RuntimeConfig.from_environ({"XDG_CACHE_HOME": "/x", "SPECDEC_KERNEL": ""}).cache_dir == Path("/x/specdec")
    assert RuntimeConfig.from_environ({"SPECDEC_KERNEL": "off"}).variant is None


@pytest.mark.parametrize("name,value", [("SPECDEC_KERNEL", "avx512"), ("SPECDEC_FUSED", "no"),
                                        ("SPECDEC_ATTENTION", "flash"), ("SPECDEC_KERNEL_CALIBRATE", "yes"),
                                        ("SPECDEC_BENCH_THREADS", "two"), ("SPECDEC_CALIBRATION_CACHE", "1")])
def test_a_bad_variable_is_named(name, value):
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        RuntimeConfig.from_environ({name: value})


def test_huge_empty_is_aligned_and_marked_for_huge_pages(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda enabled: lambda addr, size, advice: calls.append((addr, size, advice)))
    t = kernels.huge_empty(3 * 2**20 // 4 + 5)  # 3 MB and a bit: rounded to two huge pages
    assert t.dtype == torch.float32 and t.numel() == 3 * 2**20 // 4 + 5
    assert t.data_ptr() % kernels.HUGE_PAGE == 0
    assert calls == [(t.data_ptr(), 2 * kernels.HUGE_PAGE, 14)]
    t.fill_(1.5)  # writable to its last element
    assert t[-1].item() == 1.5


def test_hugepages_off_marks_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda enabled: (lambda *a: calls.append(a)) if enabled else None)
    assert kernels.huge_empty(10, hugepages=False).numel() == 10
    assert memory.Slabs(slab_bytes=2**20, hugepages=False).take(10).numel() == 10
    assert calls == []
    assert RuntimeConfig.from_environ({"SPECDEC_HUGEPAGES": "off"}).hugepages is False


def test_slabs_cut_aligned_disjoint_tensors():
    slabs = kernels.Slabs(slab_bytes=4 * 2**20)
    sizes = [1, 17, 1000, 2**20 // 4, 3 * 2**20 // 4, 7]  # the fifth overflows the first slab
    parts = [slabs.take(n) for n in sizes]
    for p, n in zip(parts, sizes):
        assert p.numel() == n and p.data_ptr() % 64 == 0
        p.fill_(n)
    for p, n in zip(parts, sizes):  # nothing cut twice: every part still holds its own fill
        assert torch.all(p == n)
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert storage(parts[4]) != storage(parts[0]) and storage(parts[5]) == storage(parts[4])
    big = slabs.take(5 * 2**20 // 4)  # larger than a slab: a slab of its own
    assert big.numel() == 5 * 2**20 // 4 and storage(big) not in (storage(parts[0]), storage(parts[4]))


def test_packed_weights_live_in_the_slabs_and_stay_exact(monkeypatch):
    if kernels.extension() is None:
        pytest.skip("no kernel build here")
    monkeypatch.setitem(lin._slabs, True, kernels.Slabs(slab_bytes=2**20))
    w = torch.randn(40, 24)
    p = kernels.packed(w)
    base = lin._slabs[True]._slab
    assert base is not None and p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    x = torch.randn(6, 24)
    torch.testing.assert_close(lin._packed_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_plan_gives_each_chunk_its_route(monkeypatch):
    """``plan`` (for the one compiled call of csrc/layers.cpp) runs a block as ``linear`` would: one chunk
    of its size's route up to MAX_ROWS, balanced chunks past it, F.linear (route 0) over the whole block
    past max_rows or CHUNK_ROWS, where chunks lost the self-check, or where any chunk's route is F.linear's."""
    routes = ["mm"] * 4 + ["packed"] * 4 + ["wide"] * 8
    _routes(monkeypatch, routes, chunked=True)
    assert kernels.plan(1, 16) == [0, 1, 1]
    assert kernels.plan(6, 16) == [0, 6, 2]
    assert kernels.plan(17, 128) == [0, 9, 3, 9, 17, 2]  # 9 + 8 rows: wide, packed
    assert kernels.plan(17, 16) == [0, 17, 0]  # past the caller's max_rows
    assert kernels.plan(129, 1000) == [0, 129, 0]  # past CHUNK_ROWS
    _routes(monkeypatch, routes[:8] + ["linear"] + routes[9:], chunked=True)
    assert kernels.plan(18, 128) == [0, 18, 0]  # 9 + 9, and 9 rows take F.linear
    assert kernels.plan(16, 128) == [0, 16, 3]
    _routes(monkeypatch, routes[:8] + ["linear"] + routes[9:], chunked=False)
    assert kernels.plan(17, 128) == [0, 17, 0]


def test_the_cli_reads_the_environment_once_at_its_edge(monkeypatch, capsys):
    """``specdec`` reads the SPECDEC_* variables into one configuration before a command runs, and the
    command runs under it; a bad value is an error that names it."""
    from specdec import cli, config
    from specdec.cli import generate

    seen = []
    monkeypatch.setattr(generate, "run", lambda args: seen.append((args.runtime, config.current())) or 0)
    monkeypatch.setenv("SPECDEC_FUSED", "off")
    assert cli.main(["generate", "hi"]) == 0
    assert seen[0][0] is seen[0][1] and seen[0][0].fused is False
    monkeypatch.setenv("SPECDEC_KERNEL", "bogus")
    assert cli.main(["generate", "hi"]) == 2
    assert "SPECDEC_KERNEL='bogus'" in capsys.readouterr().err
