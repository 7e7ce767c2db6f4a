"""Steps replayed as captured graphs: a CUDA graph on a GPU, a torch.fx graph as its CPU rehearsal.

A step is a function of a few input tensors (``fn(*inputs) -> tuple of tensors``) that reads and
writes other tensors that stay where they are (a ``kv.static.StaticCache``'s buffers, the weights).
``StepGraphs.run(key, fn, inputs)`` runs it as the mode says:

    eager   fn(*inputs), every time
    cuda    the first call of a key warms fn up on a side stream, captures it into a CUDA graph over
            input tensors of its own, and replays it; later calls copy their inputs in and replay
            (a one-row step of an 8B model is ~20 ms of host work over ~3.5 ms of weight streaming:
            docs/decisions/018-accelerators.md)
    trace   the same protocol with ``make_fx``: the first call traces fn into an fx graph over its own
            input tensors, later calls replay it. Tracing, like capture, records what the host
            decided (a branch, a number turned into a tensor) as a constant, so a step whose output
            depends on a host value that changes between steps gives other results when replayed:
            the CPU's test of what a GPU capture would get wrong. Ops outside ATen (the CPU kernels)
            are not traced: rehearse with them off (float64 targets never take them).

The outputs are copies: a replay overwrites a graph's own outputs, and a caller may keep them.
What a key must name: everything fn's recorded work depends on besides its inputs' values (shapes,
flags, which buffers); ``clear`` drops every graph (the buffers moved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

CAPTURES = ("auto", "eager", "cuda", "trace")


@dataclass
class _Graph:
    inputs: tuple[torch.Tensor, ...]  # the tensors the graph reads its inputs from
    replay: Callable[[], tuple[torch.Tensor, ...]]


class StepGraphs:
    """Captured steps by key, for one set of buffers (see the module doc)."""

    def __init__(self, capture: str, device: torch.device) -> None:
        if capture not in CAPTURES:
            raise ValueError(f"capture must be one of {', '.join(CAPTURES)}, got {capture!r}")
        if capture == "auto":
            capture = "cuda" if device.type == "cuda" else "eager"
        if capture == "cuda" and device.type != "cuda":
            raise ValueError(f"capture='cuda' needs a CUDA device, not {device}")
        self.mode = capture
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None  # CUDA: one memory pool for every graph of these buffers
        self.captures = 0  # graphs made so far (a test counts them)
        self.replays = 0  # calls served by a graph made earlier

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()

    def run(self, key: tuple, fn: Callable[..., tuple[torch.Tensor, ...]],
            inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.mode == "eager":
            return fn(*inputs)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(fn, inputs)
            self.captures += 1
        else:
            self.replays += 1
        for mine, x in zip(graph.inputs, inputs, strict=True):
            assert mine.shape == x.shape and mine.dtype == x.dtype, f"key {key}: input {tuple(x.shape)} {x.dtype} " \
                f"!= captured {tuple(mine.shape)} {mine.dtype}"
            mine.copy_(x, non_blocking=True)
        return tuple(out.clone() for out in graph.replay())

    def _capture(self, fn, inputs) -> _Graph:
        mine = tuple(x.clone() for x in inputs)
        if self.mode == "trace":
            from torch.fx.experimental.proxy_tensor import make_fx

            traced = make_fx(fn)(*mine)  # runs fn once for real: a step writes what its replay writes again
            return _Graph(mine, lambda: tuple(traced(*mine)))
        return self._capture_cuda(fn, mine)

    def _capture_cuda(self, fn, mine) -> _Graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, allocator, library handles
            fn(*mine)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outs = fn(*mine)

        def replay() -> tuple[torch.Tensor, ...]:
            graph.replay()
            return outs

        return _Graph(mine, replay)
