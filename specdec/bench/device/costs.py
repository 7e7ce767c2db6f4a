"""What a step costs on an accelerator: verify-cost curves and KV-store step times, random weights.

Acceptance does not depend on the machine, cost does. These measure costs with random-weight Llama
shapes (the weights' values change no timing) in ``dtype`` on ``device``:

    verify_curves   one verify forward of specdec (``forward.forward_block``: a chain block over the
                    BMC store, or a static store's captured step) with ``rows`` new rows per sequence, at ``batch`` sequences of
                    ``context`` committed tokens each, per shape: seconds, median of repeats
    store_steps     a plain decode step (one row per sequence) on the BMC store against the same step
                    on transformers' ``DynamicCache`` (which concatenates: a copy of every layer's
                    K/V per step), at long contexts and large batches

The stores are filled with random K/V (no prefill: a 64 x 32k prefill of an 8B model would take the
whole run), and a grid point whose K/V would not fit the device's memory is recorded as skipped.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdec.forward import cache_arg, forward_block
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.kv.static import StaticCache


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes(self, tokens: int, dtype: torch.dtype) -> int:
        """K and V of ``tokens`` tokens over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * tokens * dtype.itemsize


SHAPES = {
    "135M": Shape(576, 1536, 30, 9, 3, 49152),  # SmolLM2-135M, the default model
    "1B": Shape(2048, 8192, 16, 32, 8, 128256),  # Llama-3.2-1B
    "8B": Shape(4096, 14336, 32, 32, 8, 128256),  # Llama-3.1-8B (MagicDec's and EAGLE's size)
    "tiny": Shape(64, 128, 2, 4, 2, 256),  # a rehearsal of the command on a CPU, in seconds
}
ROWS = (1, 2, 4, 8, 16, 32, 64)  # rows per sequence of a verify block (gamma + 1)
BATCHES = (1, 4, 16, 32, 64)
CONTEXTS = (1024, 4096, 16384, 32768)


def random_llama(shape: Shape, dtype: torch.dtype, device: torch.device | str) -> LlamaForCausalLM:
    """A Llama of ``shape`` with random weights, made on ``device`` in ``dtype`` (no host copy)."""
    cfg = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                      num_key_value_heads=shape.kv_heads, max_position_embeddings=65536, rope_theta=500000.0,
                      tie_word_embeddings=shape.vocab * shape.hidden < 10**8, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls after two warm-ups, synchronised per call."""
    for _ in range(2):
        fn()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_bytes(device: torch.device) -> int:
    """Memory the device can still give (the host's is not checked: CPU grids are kept small)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return 1 << 62


def _random_kv(shape: Shape, batch: int, context: int, dtype, device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random K and V [batch, kv_heads, context, head_dim], one layer at a time (never all layers twice)."""
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(shape.layers):
        k = torch.randn(batch, shape.kv_heads, context, shape.head_dim, generator=g, dtype=dtype, device=device)
        yield k, torch.randn(k.shape, generator=g, dtype=dtype, device=device)


def _release(device: torch.device) -> None:
    """Give the memory of the last grid point back before the next one is sized."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bmc_store(model, shape: Shape, batch: int, context: int, room: int, steps: str = "dynamic") -> BMCCache:
    """A BMC store of ``batch`` rows holding ``context`` random tokens each, with ``room`` rows to spare;
    steps "static": a ``kv.static.StaticCache`` (its steps captured as CUDA graphs on a GPU)."""
    if steps == "static":
        cache = StaticCache.for_model(model, batch, context + room)
    else:
        cache = BMCCache.for_model(model, batch, BMCConfig(period=64))
    kv = list(_random_kv(shape, 1, context, model.dtype, model.device))  # one row's K/V, copied into every row
    for b in range(batch):
        cache.load_prefill(b, [(k[0], v[0]) for k, v in kv], capacity=context + room)
    return cache


def verify_curves(device, shapes: list[str], dtype: torch.dtype = torch.bfloat16, rows=ROWS, batches=BATCHES,
                  contexts=CONTEXTS, repeats: int = 3, headroom: float = 0.85,
                  deadline: float = float("inf"), steps: tuple[str, ...] = ("dynamic",)) -> Iterator[dict]:
    """One record per grid point and steps kind: {"shape", "batch", "context", "steps", "rows", "seconds"}
    or "skipped": why. steps: "dynamic" (BMC's store), "static" (``kv.static``: captured on a GPU).
    Stops (a record with "skipped": "time budget") once ``deadline`` (time.perf_counter()) passes."""
    device = torch.device(device)
    for name in shapes:
        shape = SHAPES[name]
        model = random_llama(shape, dtype, device)
        try:
            for context in contexts:
                for batch in batches:
                    point = {"shape": name, "batch": batch, "context": context}
                    # the store, plus the largest block's logits and activations (a rough bound)
                    need = shape.kv_bytes(batch * (context + max(rows) + 64), dtype) + \
                        batch * max(rows) * (shape.vocab * 4 + shape.intermediate * 8)
                    if need > headroom * free_bytes(device):
                        yield {**point, "skipped": f"needs ~{need / 2**30:.0f} GiB"}
                        continue
                    if time.perf_counter() > deadline:
                        yield {**point, "skipped": "time budget"}
                        continue
                    for kind in steps:
                        try:
                            yield from _verify_point(model, shape, {**point, "steps": kind}, rows, repeats)
                        except torch.OutOfMemoryError:
                            yield {**point, "steps": kind, "skipped": "out of memory"}
                        _release(device)
        finally:
            del model
            _release(device)


def _verify_point(model, shape: Shape, point: dict, rows, repeats: int) -> Iterator[dict]:
    cache = bmc_store(model, shape, point["batch"], point["context"], max(rows), point["steps"])
    g = torch.Generator().manual_seed(0)
    for q in rows:
        ids = torch.randint(0, shape.vocab, (point["batch"], q), generator=g).to(model.device)
        seconds = median_seconds(lambda: forward_block(model, cache, ids, None, None), model.device, repeats)
        yield {**point, "rows": q, "seconds": seconds}


def store_steps(device, shape_name: str = "1B", dtype: torch.dtype = torch.bfloat16, batches=(16, 32, 64),
                contexts=(8192, 16384, 32768), repeats: int = 3, headroom: float = 0.85,
                deadline: float = float("inf")) -> Iterator[dict]:
    """One record per (batch, context): seconds of a decode step on the BMC store and on a
    DynamicCache holding the same tokens, and their ratio; or "skipped": why."""
    device = torch.device(device)
    shape = SHAPES[shape_name]
    model = random_llama(shape, dtype, device)
    arg = cache_arg(model)
    try:
        for context in contexts:
            for batch in batches:
                point = {"shape": shape_name, "batch": batch, "context": context}
                # the DynamicCache's concatenation holds a layer's old and new K/V at once
                need = shape.kv_bytes(batch * (context + 64), dtype) * (1 + 1 / shape.layers) + batch * shape.vocab * 4
                if need > headroom * free_bytes(device) or time.perf_counter() > deadline:
                    why = "time budget" if need <= headroom * free_bytes(device) else f"needs ~{need / 2**30:.0f} GiB"
                    yield {**point, "skipped": why}
                    continue
                try:
                    bmc, hf = _bmc_step(model, shape, point, repeats), _dynamic_step(model, shape, point, repeats, arg)
                except torch.OutOfMemoryError:
                    yield {**point, "skipped": "out of memory"}
                else:
                    yield {**point, "bmc_seconds": bmc, "dynamic_seconds": hf, "dynamic_over_bmc": hf / bmc}
                _release(device)
    finally:
        del model
        _release(device)


def _step_ids(shape: Shape, batch: int, device) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (batch, 1), generator=torch.Generator().manual_seed(0)).to(device)


def _bmc_step(model, shape: Shape, point: dict, repeats: int) -> float:
    cache = bmc_store(model, shape, point["batch"], point["context"], 1)
    ids = _step_ids(shape, point["batch"], model.device)
    return median_seconds(lambda: forward_block(model, cache, ids, None, None), model.device, repeats)


def _dynamic_step(model, shape: Shape, point: dict, repeats: int, arg: str) -> float:
    batch, context = point["batch"], point["context"]
    dyn = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(_random_kv(shape, batch, context, model.dtype, model.device)):
        dyn.update(k, v, layer)
        del k, v  # the cache holds its own copy
    ids = _step_ids(shape, batch, model.device)
    position = torch.full((batch, 1), context, dtype=torch.long, device=model.device)

    def step():
        with torch.inference_mode():
            model(input_ids=ids, position_ids=position, use_cache=True, **{arg: dyn})
        dyn.crop(-1)  # a view: the next step appends to the same context again

    return median_seconds(step, model.device, repeats)
