"""llama.cpp (through llama-cpp-python) as a peer of `specdec bench`, in a process of its own:

    python -m specdec.bench.peer_llamacpp REQUEST.json RESULT.json

REQUEST  {"gguf": path, "prompts": [[id, ...], ...], "eos": [id, ...], "max_new_tokens": n,
          "threads": t, "lookup_tokens": k, "modes": ["plain", "lookup"] (optional: these two by default)}
RESULT   {"version": llama_cpp.__version__,
          "modes": {"plain": [{"ids": [id, ...], "seconds": s, "first_seconds": s1}, ...], "lookup": [...]},
          "rss_kib": {"plain": {"before_load": kib, "after_load": kib, "after": kib}, ...}}
         or {"missing": "<the import error>"} when this interpreter cannot import llama_cpp.

REQUEST  {"gguf": path, "texts": [[id, ...], ...], "threads": t, "modes": ["nll"]}  (perplexity)
RESULT   {"version": ..., "nll": [{"sum": -sum log p(next token), "scored": T - 1}, ...]}: each text evaluated
         in one pass with every position's logits kept, as ``specdec perplexity`` scores it.

Each mode loads the file once, generates one untimed warm-up of a few tokens, then every prompt
greedily (top_k=1, temperature 0, no repeat penalty) until an EOS id (kept, as HF keeps it) or
``max_new_tokens``; "lookup" drafts with llama-cpp-python's ``LlamaPromptLookupDecoding``. A
prompt's seconds include its prompt evaluation, as HF generate's do in the bench.

This file imports only the standard library and llama_cpp, so the peer's interpreter needs neither
torch nor specdec: ``specdec.bench.peers`` runs it by path. Both files of the exchange are written
whole or not at all (``write_json``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WARM_UP_TOKENS = 4  # the first generation pays one-off costs (buffers, threads) that are not speed
CONTEXT_MARGIN = 16  # context rows beyond prompt + reply + one draft, for llama.cpp's own bookkeeping


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, atomically: a reader sees the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    os.replace(tmp, path)


def greedy(llm, prompt: list[int], eos: set[int], max_new_tokens: int, clock: list | None = None) -> list[int]:
    """llama.cpp's greedy reply to ``prompt``: up to and including the first EOS id, at most
    ``max_new_tokens``. ``reset()`` first, so nothing of the previous prompt's cache is reused.
    ``clock`` gets the time the first token arrived (prompt evaluated), for a decode-only rate."""
    llm.reset()
    out: list[int] = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if not out and clock is not None:
            clock.append(time.perf_counter())
        out.append(int(t))
        if out[-1] in eos or len(out) >= max_new_tokens:
            break
    return out


def vm_rss_kib(field: str = "VmRSS") -> int:
    """This process's resident set (``field`` of /proc/self/status: VmRSS, or RssAnon, RssFile), KiB; 0
    where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def run_mode(llama_cpp, request: dict, lookup: bool, rss: dict) -> list[dict]:
    """Every prompt of ``request`` on one freshly loaded model: [{"ids", "seconds"}] per prompt; ``rss``
    gets the process's RSS before the load, after it and after the last prompt."""
    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=request["lookup_tokens"])
    prompts, eos, n = request["prompts"], set(request["eos"]), request["max_new_tokens"]
    n_ctx = max(len(p) for p in prompts) + n + request["lookup_tokens"] + CONTEXT_MARGIN
    # with a draft model, a prompt longer than n_batch fails in llama-cpp-python 0.3.36 ("could not broadcast
    # input array ... into shape (0,)"): the lookup mode evaluates each prompt in one batch
    batch = n_ctx if lookup else 512
    rss["before_load"] = vm_rss_kib()
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=n_ctx, n_threads=request["threads"],
                          n_threads_batch=request["threads"], n_batch=batch, verbose=False, draft_model=draft)
    rss["after_load"] = vm_rss_kib()
    greedy(llm, prompts[0], eos, WARM_UP_TOKENS)  # untimed
    runs = []
    for prompt in prompts:
        t, first = time.perf_counter(), []
        ids = greedy(llm, prompt, eos, n, first)
        runs.append({"ids": ids, "seconds": time.perf_counter() - t, "first_seconds": first[0] - t})
    rss["after"] = vm_rss_kib()
    return runs


def run_nll(llama_cpp, request: dict) -> list[dict]:
    """Each text's negative log-likelihood under llama.cpp, every position predicting the next one (numpy
    ships with llama-cpp-python)."""
    import numpy as np

    texts = request["texts"]
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=max(len(t) for t in texts) + CONTEXT_MARGIN,
                          n_threads=request["threads"], n_threads_batch=request["threads"], n_batch=512,
                          logits_all=True, verbose=False)
    out = []
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)  # [T - 1, V]
        top = logits.max(axis=1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        out.append({"sum": float((lse - logits[np.arange(len(ids) - 1), ids[1:]]).sum()), "scored": len(ids) - 1})
    return out


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    try:
        import llama_cpp
    except (ImportError, OSError) as e:  # not installed, or its shared library does not load
        write_json(result_path, {"missing": f"{type(e).__name__}: {e}"})
        return 0
    wanted = request.get("modes", ["plain", "lookup"])
    if wanted == ["nll"]:
        write_json(result_path, {"version": llama_cpp.__version__, "nll": run_nll(llama_cpp, request)})
        return 0
    rss = {name: {} for name in wanted}
    modes = {name: run_mode(llama_cpp, request, name == "lookup", rss[name]) for name in wanted}
    write_json(result_path, {"version": llama_cpp.__version__, "modes": modes, "rss_kib": rss})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
