"""`specdec generate`: chat-templated generation of one prompt (or a file of prompts, as one batch),
printing the text and what it cost."""

from __future__ import annotations

import time

from rich.console import Console

from specdec.runtime import kernels
from specdec.decoder import SpecDecoder
from specdec.registry import DRAFTERS, make_drafter
from specdec.arguments import (add_constraint_arguments, add_sampling_arguments, add_weights_argument, constraint_arguments,
                               positive_int, sampling_arguments, weights_for)
from specdec.prompting import encode_prompt, eos_ids


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    add_weights_argument(p)
    p.add_argument("--drafter", default="prompt-lookup", choices=sorted(DRAFTERS))
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--prompts-file", default=None,
                   help="a file of prompts, one per line, generated together as one batch (each sequence "
                        "stops on its own; the answers are printed in order)")
    add_sampling_arguments(p)
    add_constraint_arguments(p)


def run(args) -> int:
    from specdec.models import load_model

    console = Console()
    sampling = sampling_arguments(args)  # bad flags fail before the model loads
    texts = [args.prompt] if args.prompts_file is None else _read_prompts(args.prompts_file)
    with console.status(f"loading {args.model} ..."):
        loaded = load_model(args.model, weights=weights_for(args.model, args.weights), numerics=args.numerics)
    tok = loaded.tokenizer
    prompts = [encode_prompt(tok, t, chat=not args.no_chat_template) for t in texts]
    ids = prompts[0][None] if len(prompts) == 1 else prompts
    decoder = SpecDecoder(loaded.model, make_drafter(args.drafter, loaded.model))
    eos = eos_ids(loaded.model, tok) or None  # the generation config's, else the tokenizer's
    constraints = constraint_arguments(args, tok)
    if "constraint" in constraints:  # compiled now: a schema or grammar that does not compile fails before the warm-up
        constraints["constraint"] = decoder.processing(constraints["constraint"], tok, eos).grammar
    with console.status("preparing specdec's CPU kernels and packed weights ..."):
        kernels.prepare()  # a first-use build (~20 s) and the route self-check are not generation time
        decoder.warm_up()  # the lean forward's check, the weights' packing, a drafter's corpus index
    t = time.perf_counter()
    out = decoder.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, **sampling, **constraints)
    dt = time.perf_counter() - t
    for b in range(len(prompts)):
        if len(prompts) > 1:
            console.rule(f"[bold]{b + 1}[/bold] {texts[b][:80]}")
        console.print(tok.decode(out.generated(b), skip_special_tokens=True))
    batch = f" | batch of {len(prompts)}" if len(prompts) > 1 else ""
    console.print(f"[dim]{loaded.name} | drafter {args.drafter}{batch} | {out.new_tokens} tokens in {dt:.2f} s = "
                  f"{out.new_tokens / dt:.1f} tokens/s | mean accepted tokens {out.mean_accepted_tokens:.2f} "
                  f"per step ({len(out.steps)} target forwards)[/dim]")
    return 0


def _read_prompts(path: str) -> list[str]:
    try:
        lines = [line.strip() for line in open(path, encoding="utf-8")]
    except OSError as e:
        raise FileNotFoundError(f"--prompts-file {path}: {e.strerror}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"--prompts-file {path}: no prompts (one per line)")
    return prompts
