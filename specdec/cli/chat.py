"""`specdec chat`: a terminal chat with speculative decoding, streaming text as tokens are accepted.

Each reply streams as the decoder commits tokens; with colour on, text that came from accepted
drafts is tinted, the target's own tokens are plain. After each reply a stats line gives tokens/s and
the mean accepted tokens per target forward. Commands: /clear, /drafter NAME, /help, /quit (or EOF).

Ctrl-C during a reply stops that reply only. What was already shown stays in the conversation as
the assistant's (partial) answer, so the model's next turn sees exactly what the user saw; a reply
stopped before any text removes the question instead. Ctrl-C at the prompt does not end the session
(it says how to: /quit or Ctrl-D).

Reads plain lines when stdin is not a terminal, so ``printf 'hi\\n/quit\\n' | specdec chat`` works.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from specdec.decoder import SpecDecoder, StepEvent
from specdec.arguments import (add_constraint_arguments, add_sampling_arguments, add_weights_argument, constraint_arguments,
                               positive_int, sampling_arguments, weights_for)
from specdec.processing import Constraint
from specdec.prompting import context_window, eos_ids, fit_conversation, has_chat_template
from specdec.registry import DRAFTERS, make_drafter

DRAFT_STYLE = "cyan"  # text from accepted drafts
HELP = ("/clear  start a new conversation    /drafter NAME  switch drafter ({names})\n"
        "/help   this text                   /quit  leave (also Ctrl-D)    Ctrl-C  stop a reply")


# Control characters a model may emit (ESC would let it drive the terminal: clear it, move the cursor,
# retitle the window); dropped from what is *shown*, kept in the conversation. Newline and tab stay.
_HIDDEN = {c: None for c in [*range(0x00, 0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


def printable(text: str) -> str:
    return text.translate(_HIDDEN)


class IncrementalDetokenizer:
    """Token ids in, printable text out, never splitting a multi-byte character.

    A byte-level BPE token can hold part of a UTF-8 character ("é" = two tokens), which decodes to
    U+FFFD until the rest arrives, so text is released only when it no longer ends in U+FFFD. Each
    piece is decoded with the previous piece as context (prefix_offset..read_offset) and the
    context's text cut off: SentencePiece-style tokenizers render a leading space only in context.
    Example: ids [A, B1, B2] where B1 B2 encode "é": push(A) -> "a", push(B1) -> "", push(B2) -> "é".
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context piece
        self.read_offset = 0  # ids before this have been released as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (maybe "")."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character at the very end)."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):]

    def text(self) -> str:
        return self._decode(self.ids)


@dataclass(frozen=True)
class ReplyStats:
    tokens: int  # new tokens, EOS included
    seconds: float
    steps: int  # target forwards
    drafted: int  # tokens that came from accepted drafts
    interrupted: bool

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mean_accepted_tokens(self) -> float:
        return self.tokens / max(self.steps, 1)


class ChatSession:
    """The conversation, the decoder, and how replies are shown."""

    def __init__(self, model, tokenizer, drafter: str, max_new_tokens: int, console, color: bool = True,
                 sampling: dict | None = None) -> None:
        if not has_chat_template(tokenizer):
            raise ValueError("this model's tokenizer has no chat template; chat needs one")
        self.model, self.tokenizer, self.console = model, tokenizer, console
        self.max_new_tokens = max_new_tokens
        self.color = color
        self.sampling = dict(sampling or {})  # generate() arguments (specdec.arguments.sampling_arguments)
        if self.sampling.get("seed") is not None:  # one stream for the whole chat, not the same per reply
            self.sampling["generator"] = torch.Generator().manual_seed(self.sampling.pop("seed"))
        self.eos = eos_ids(model, tokenizer, required=True)
        self.messages: list[dict] = []
        self.context_window = context_window(model)
        self.set_drafter(drafter)

    def set_drafter(self, name: str) -> None:
        self.decoder = SpecDecoder(self.model, make_drafter(name, self.model))  # ValueError if unknown
        if isinstance(self.sampling.get("constraint"), Constraint):  # compiled once: a bad one fails here
            self.sampling["constraint"] = self.decoder.processing(self.sampling["constraint"], self.tokenizer,
                                                                  self.eos).grammar
        self.decoder.warm_up()  # the first reply then pays no one-time packing or corpus index
        self.drafter_name = name

    def clear(self) -> None:
        self.messages = []

    def _prompt_ids(self):
        """[1, P] the conversation so far; drops the oldest exchanges while a full reply would not
        fit the context window. None if even the last message alone does not fit."""
        ids, kept = fit_conversation(self.tokenizer, self.messages, self.max_new_tokens, self.context_window)
        for _ in range((len(self.messages) - len(kept)) // 2):  # each: the oldest user message and its answer
            self.console.print("[dim](oldest exchange dropped: context window full)[/dim]")
        self.messages = kept
        return ids

    def reply(self, text: str) -> ReplyStats | None:
        """Answer ``text`` in the conversation, streaming to the console; None if it cannot fit."""
        self.messages.append({"role": "user", "content": text})
        ids = self._prompt_ids()
        if ids is None:
            self.messages.pop()
            self.console.print(f"[red]that message is too long for the model's context window "
                               f"({self.context_window} tokens)[/red]")
            return None
        detok = IncrementalDetokenizer(self.tokenizer)
        counts = {"steps": 0, "drafted": 0}

        def on_step(ev: StepEvent) -> None:
            counts["steps"] += 1
            counts["drafted"] += ev.from_draft
            for i, tok in enumerate(ev.tokens):
                self._show(detok.push(tok), drafted=i < ev.from_draft)

        interrupted = False
        t = time.perf_counter()
        try:
            self.decoder.generate(ids, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                  callback=on_step, **self.sampling)
        except KeyboardInterrupt:  # stop this reply only; the decoder keeps no state between calls
            interrupted = True
        seconds = time.perf_counter() - t
        self._show(detok.flush(), drafted=False)
        self.console.print()
        answer = detok.text().strip()
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
        elif interrupted:  # nothing was said: forget the question too
            self.messages.pop()
        stats = ReplyStats(len(detok.ids), seconds, counts["steps"], counts["drafted"], interrupted)
        self.console.print(self.stats_line(stats), style="dim", highlight=False, markup=False)
        return stats

    def _show(self, piece: str, drafted: bool) -> None:
        piece = printable(piece)
        if piece:
            from rich.text import Text

            style = DRAFT_STYLE if drafted and self.color else ""
            self.console.print(Text(piece, style=style), end="", soft_wrap=True)

    def stats_line(self, s: ReplyStats) -> str:
        head = "[interrupted] " if s.interrupted else ""
        return (f"{head}{s.tokens} tokens in {s.seconds:.2f} s · {s.tokens_per_second:.1f} tokens/s · "
                f"mean accepted tokens {s.mean_accepted_tokens:.2f} ({s.steps} target forwards, "
                f"{s.drafted} drafted tokens kept) · drafter {self.drafter_name}")

    def command(self, line: str) -> bool:
        """Run a /command; returns False when the session should end."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/clear":
            self.clear()
            self.console.print("[dim](conversation cleared)[/dim]")
        elif name == "/drafter" and arg:
            try:
                self.set_drafter(arg)
                self.console.print(f"[dim](drafter: {arg})[/dim]")
            except ValueError as e:
                self.console.print(f"[red]{e}[/red]", highlight=False)
        elif name == "/drafter":
            self.console.print(f"drafter: {self.drafter_name}; known: {', '.join(sorted(DRAFTERS))}",
                               highlight=False)
        else:
            self.console.print(HELP.format(names=", ".join(sorted(DRAFTERS))), highlight=False, markup=False)
        return True

    def loop(self, read_line) -> int:
        """Prompt, read, answer until /quit or EOF. ``read_line(prompt)`` is ``console.input``."""
        while True:
            try:
                line = read_line("[bold green]you>[/bold green] ")
            except EOFError:
                self.console.print()
                return 0
            except KeyboardInterrupt:
                self.console.print("\n[dim](Ctrl-C stops a reply; leave with /quit or Ctrl-D)[/dim]")
                continue
            if not line.strip():
                continue
            if line.lstrip().startswith("/"):
                if not self.command(line):
                    return 0
                continue
            self.console.print("[bold blue]model>[/bold blue] ", end="")
            self.reply(line.strip())


def add_arguments(p) -> None:
    p.add_argument("--model", default="default", help="'default', a .gguf file or a HF model directory")
    add_weights_argument(p)
    p.add_argument("--drafter", default="prompt-lookup", choices=sorted(DRAFTERS))
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per reply")
    p.add_argument("--no-color", action="store_true", help="no colours (drafted tokens not marked)")
    add_sampling_arguments(p)
    add_constraint_arguments(p)  # every reply: JSON / a regex / a grammar, penalties


def run(args) -> int:
    from rich.console import Console

    from specdec.models import load_model

    sampling = sampling_arguments(args)
    console = Console(no_color=args.no_color, highlight=False)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-tensor loading bar: noise here
    with console.status(f"loading {args.model} ..."):
        loaded = load_model(args.model, weights=weights_for(args.model, args.weights), numerics=args.numerics)
    if loaded.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; chat needs one with a chat template")
    color = not args.no_color and console.color_system is not None
    options = constraint_arguments(args, loaded.tokenizer)
    session = ChatSession(loaded.model, loaded.tokenizer, args.drafter, args.max_new_tokens, console, color,
                          sampling | options)
    console.print(f"[bold]specdec chat[/bold] · {loaded.name} · drafter {args.drafter} · up to "
                  f"{args.max_new_tokens} tokens per reply · /help for commands")
    if color:
        console.print(f"[{DRAFT_STYLE}]tinted text[/{DRAFT_STYLE}]: tokens drafted and accepted; "
                      "plain: the model's own tokens")
    return session.loop(console.input)
