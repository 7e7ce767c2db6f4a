"""`specdec <command>`: each command lives in its own module with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this file only maps names to modules."""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import sys

from specdec.config import RuntimeConfig, hub_offline, use

COMMANDS = {  # name -> (module, one-line help)
    "generate": ("specdec.cli.generate", "generate from a prompt on the default (or any) model"),
    "bench": ("specdec.bench.generation", "ours vs HF generate vs HF prompt lookup, same process"),
    "bench-kv": ("specdec.bench.kv", "KV store microbenchmark: iterative vs upfront vs BMC"),
    "bench-period": ("specdec.bench.period", "BMC period sweep: attention-block time over T, lengths, batches"),
    "bench-verify": ("specdec.bench.verify_cost", "target forward time over 1..32 tokens (verify-cost curve)"),
    "bench-longctx": ("specdec.bench.longctx", "long-context self-speculation (MagicDec) vs HF generate"),
    "bench-serve": ("specdec.bench.serve_load", "load on a running specdec serve vs the same load one at a time"),
    "bench-controller": ("specdec.bench.policy", "the draft-length controller vs every fixed length, on replayed steps"),
    "bench-scaling": ("specdec.bench.scaling", "packed GGUF targets of 0.5B-1.5B Llama shapes: step time and RSS vs llama.cpp"),
    "bench-device": ("specdec.bench.device.command", "exactness, verify costs and priced traces on an accelerator"),
    "bench-structured": ("specdec.bench.structured", "JSON-schema answers: plain decoding vs a drafter, every answer checked"),
    "perplexity": ("specdec.bench.perplexity", "perplexity of a target in each numerics (exact, int8) on held-out books"),
    "chat": ("specdec.cli.chat", "terminal chat with speculative decoding"),
    "serve": ("specdec.cli.serve", "an OpenAI-compatible HTTP server with continuous batching"),
    "specbench": ("specdec.cli.specbench", "Spec-Bench evaluation: per-task speedup, resumable"),
    "train-eagle": ("specdec.cli.train_eagle", "train an EAGLE head for a target, offline"),
}


# commands whose process ends without the interpreter's teardown (``entry``): they hold no file open past
# their return, and their start-to-exit time is what people wait for at every call
QUICK_EXIT = ("generate", "chat", "serve")


class _Parser(argparse.ArgumentParser):
    """Bad arguments end the command with one line naming them (no usage block above it)."""

    def error(self, message: str):
        import re

        named = re.fullmatch(r"argument ([^:]+): (must be .*)", message, re.S)  # our types' rule
        if named:  # "argument --lengths: must be ..." -> "--lengths must be ..."
            message = f"{named[1].split('/')[-1]} {named[2]}"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The command line; ``commands``: the names whose modules are imported for their options (None: all).
    The others are listed with their help only: a command's start-up does not import the benchmarks."""
    parser = _Parser(prog="specdec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        p.set_defaults(_module=module)
        if commands is not None and name not in commands:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)  # command not built yet
    return parser


def _command_named(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    hub_offline()  # models load from files on disk
    argv = sys.argv[1:] if argv is None else list(argv)
    named = _command_named(argv)
    args = build_parser({named} if named in COMMANDS else None).parse_args(argv)
    if getattr(args, "_missing", False):
        print(f"specdec: '{args.command}' is not available in this version", file=sys.stderr)
        return 2
    try:
        # the SPECDEC_* variables, read once here; every command runs under them (args.runtime too)
        args.runtime = RuntimeConfig.from_environ()
        with use(args.runtime):
            return importlib.import_module(args._module).run(args) or 0
    except (ValueError, FileNotFoundError) as e:  # bad input: one line naming the problem
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The ``specdec`` process (the console script, ``python -m specdec.cli``): ``main`` on the command line.
    After a QUICK_EXIT command the process ends at once (exit handlers run, logging and the standard
    streams flushed) instead of tearing the interpreter down: freeing the ~350k objects of torch and
    transformers module by module took ~1 s of every call (issue 63); other commands exit as usual."""
    argv = sys.argv[1:]
    code = main(argv)
    if _command_named(argv) not in QUICK_EXIT:
        sys.exit(code)
    atexit._run_exitfuncs()  # what the teardown would run first (weakref finalizers, multiprocessing, ...)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
