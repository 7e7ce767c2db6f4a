"""Peak RSS of a batch of long prompts: batched HF generate vs specdec, each in a fresh process.

    python scripts/batch_memory.py --batch 16 --tokens 2048 --new 32

Each method runs in its own child process (so one peak does not hide another): the default model
loads, B prompts of N tokens are cut from the long-context books (`../shared/longctx/books.jsonl`,
B different windows), and the method generates `--new` tokens greedily. The child reports its peak
RSS (ru_maxrss) and, for specdec, the store's capacity: the BMC store holds at most length + T rows
per sequence.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
from pathlib import Path

BOOKS = Path(__file__).resolve().parents[1].parent / "shared" / "longctx" / "books.jsonl"


def _prompts(tokenizer, batch: int, tokens: int):
    import torch

    texts = [json.loads(line)["text"] for line in open(BOOKS, encoding="utf-8")]
    ids = tokenizer("\n\n".join(texts), return_tensors="pt")["input_ids"][0]
    return [ids[i * tokens : (i + 1) * tokens].to(torch.long) for i in range(batch)]


def _child(method: str, batch: int, tokens: int, new: int, queue) -> None:
    import torch

    from specdec.runtime import kernels
    from specdec.decoder import SpecDecoder
    from specdec.kv.bmc import BMCCache
    from specdec.models import load_model

    loaded = load_model("default")
    model, tok = loaded.model, loaded.tokenizer
    prompts = _prompts(tok, batch, tokens)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = {}
    if method == "hf-generate":
        ids = torch.stack(prompts)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    else:
        kernels.prepare()
        seen = {}
        real = BMCCache.commit

        def spy(self, keep):  # the store's rows and lengths as it goes
            real(self, keep)
            seen["capacity"] = max(seen.get("capacity", 0), self.capacity)
            seen["max_length"] = max(seen.get("max_length", 0), self.max_length)

        BMCCache.commit = spy
        decoder = SpecDecoder(model, None)
        decoder.generate(prompts, max_new_tokens=new, eos_token_id=None)
        info = {**seen, "period": decoder.config.bmc.period}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"method": method, "peak_mb": peak / 1024, "after_load_mb": base / 1024, **info})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    for method in ("specdec:none", "hf-generate"):
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(method, args.batch, args.tokens, args.new, q))
        p.start()
        res = q.get()
        p.join()
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
