"""Argument types and shared options for every command (``specdec <command>`` and the benches).

A bad number fails while the arguments are parsed, before any model loads, with one line naming the
argument and the value: ``specdec generate: error: argument --max-new-tokens: must be a positive
integer, got '-5'``. argparse adds the argument's name; each type names the rule and the value.

    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--lengths", type=int_list, default=int_list("1024,2048"))   # -> [1024, 2048]
"""

from __future__ import annotations

import argparse
import math

import torch

from specdec.models import Weights
from specdec.sampling import SamplingParams

# a command's --dtype: the target's weights as loaded (a GGUF's dequantized layers, a HF checkpoint's)
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _number(text: str, kind, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (token counts, batch sizes, repeats, threads)."""
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (top-k, where 0 turns it off; seeds; counts that may be zero)."""
    value = _number(text, int, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (temperature, where 0 is greedy; noise)."""
    value = _number(text, float, "a number >= 0")
    if not (value >= 0 and math.isfinite(value)):  # NaN fails the comparison
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (top-p's mass)."""
    value = _number(text, float, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (a held-out share)."""
    value = _number(text, float, "a number in [0, 1)")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers. Example: "1024,2048" -> [1024, 2048]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """Comma-separated names, empty entries dropped. Example: "none,prompt-lookup," -> [none, prompt-lookup]."""
    return [x.strip() for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------- sampling (chat, generate)

def add_weights_argument(p, numerics: str = "auto") -> None:
    """``--weights``: how the target's weights are held (``models.Weights``; its default, "auto", resolved by
    ``Weights.resolve`` as ``load_model`` resolves it)."""
    p.add_argument("--weights", type=weights_choice, default=Weights.AUTO, choices=list(Weights),
                   help="auto (default): a GGUF's (the default model's) quantized blocks kept packed, a HF "
                        "directory's weights as they are; fp32: a GGUF dequantized; packed: a GGUF's blocks (the "
                        "same outputs as fp32 up to summation order, a fraction of the memory and time); "
                        "q8_0/q4_0/q4_1/q4_k: quantize on load (another target)")
    add_numerics_argument(p, default=numerics)


def weights_choice(text: str) -> Weights:
    """``--weights``' type: ``Weights.parse`` (one line naming the choices on a bad value)."""
    try:
        return Weights.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(w.value for w in Weights)}, got {text!r}") from None


def add_numerics_argument(p, default: str = "exact") -> None:
    """``--numerics``: the arithmetic of a quantized target (``specdec.quant.numerics``); the commands that
    answer (generate, chat, serve) default to auto, the benchmarks to exact."""
    choices = ("auto", "exact", "int8") if default == "auto" else ("exact", "int8")
    p.add_argument("--numerics", default=default, choices=choices,
                   help=("auto (default): int8 where every linear layer is Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks (the default "
                         "model), else exact; " if default == "auto" else "exact (default): ") +
                        ("exact: " if default == "auto" else "") +
                        "the blocks' fp32 values, fp32 products, token-identical to HF; int8: activations rounded "
                        "to 8 bits, integer products, faster, batch-invariant (speculation exact against this "
                        "target's own plain decoding, not HF's); Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights")


def weights_for(model: str, weights: Weights | str) -> Weights:
    """``load_model``'s ``weights`` for a command's ``--model`` and ``--weights`` (``Weights.resolve``: "auto"
    is "packed" for a GGUF, "fp32" for anything else)."""
    return Weights.parse(weights).resolve(model)


def add_sampling_arguments(p) -> None:
    """``--temperature/--top-p/--top-k/--seed`` for the commands that generate (chat, generate)."""
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (default): greedy; > 0: sample (lossless: distributed exactly as HF generate "
                        "with do_sample=True and these arguments)")
    p.add_argument("--top-p", type=probability, default=None, help="with --temperature > 0: nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=non_negative_int, default=None,
                   help="with --temperature > 0: keep the k most likely tokens (unset: the model's "
                        "generation config, else HF's default 50; 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="with --temperature > 0: repeatable samples")


def sampling_arguments(args) -> dict:
    """The decoder's generate() arguments from ``add_sampling_arguments``' flags; checks them (one line)."""
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not args.temperature:
        return {}
    SamplingParams(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p)  # validates
    return {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "seed": args.seed}


def add_constraint_arguments(p) -> None:
    """``--json-schema FILE / --json / --regex / --grammar FILE`` and the penalties, for the commands that
    generate (chat, generate): exact under speculation (specdec.processing)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", default=None, help="answers are JSON valid against this schema")
    g.add_argument("--json", action="store_true", help="answers are a JSON object")
    g.add_argument("--regex", default=None, help="answers match this regular expression")
    g.add_argument("--grammar", metavar="FILE", default=None,
                   help="answers follow this grammar: GBNF (llama.cpp's), or Lark in a .lark file")
    p.add_argument("--repetition-penalty", type=float, default=None, help="HF's repetition penalty (> 0; 1 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")


def constraint_arguments(args, tokenizer) -> dict:
    """The decoder's generate() arguments from ``add_constraint_arguments``' flags; a file that cannot be
    read or a constraint that does not compile is a ValueError naming the flag."""
    from specdec.processing import Constraint

    def read(flag: str, path: str) -> str:
        try:
            return open(path, encoding="utf-8").read()
        except OSError as e:
            raise ValueError(f"{flag} {path}: {e.strerror}") from None

    constraint = None
    if args.json_schema is not None:
        constraint = Constraint.json_schema(read("--json-schema", args.json_schema))
    elif args.json:
        constraint = Constraint.json_object()
    elif args.regex is not None:
        constraint = Constraint.regex(args.regex)
    elif args.grammar is not None:
        text = read("--grammar", args.grammar)
        constraint = Constraint.lark(text) if args.grammar.endswith(".lark") else Constraint.gbnf(text)
    out = {"repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
           "presence_penalty": args.presence_penalty}
    if constraint is not None:
        out |= {"constraint": constraint, "tokenizer": tokenizer}
    return out
