"""`specdec generate`: one chat-templated generation, printing the text and what it cost."""

from __future__ import annotations

import time

from rich.console import Console

from specdec import kernels
from specdec.decoder import SpecDecoder
from specdec.registry import DRAFTERS, make_drafter
from specdec.sampling import add_sampling_arguments, sampling_arguments


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    p.add_argument("--drafter", default="prompt-lookup", choices=sorted(DRAFTERS))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    add_sampling_arguments(p)


def run(args) -> int:
    from specdec.models import load_model

    console = Console()
    sampling = sampling_arguments(args)  # bad flags fail before the model loads
    with console.status(f"loading {args.model} ..."):
        loaded = load_model(args.model)
    tok = loaded.tokenizer
    if args.no_chat_template or not getattr(tok, "chat_template", None):
        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    decoder = SpecDecoder(loaded.model, make_drafter(args.drafter, loaded.model))
    with console.status("preparing specdec's CPU kernels ..."):
        kernels.prepare()  # a first-use build (~20 s) and the route self-check are not generation time
    t = time.perf_counter()
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, **sampling)
    dt = time.perf_counter() - t
    console.print(tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True))
    console.print(f"[dim]{loaded.name} | drafter {args.drafter} | {out.new_tokens} tokens in {dt:.2f} s = "
                  f"{out.new_tokens / dt:.1f} tokens/s | mean accepted tokens {out.mean_accepted_tokens:.2f} "
                  f"per step ({len(out.steps)} target forwards)[/dim]")
    return 0
