"""`specdec chat`: streaming detokenisation, the session (commands, conversation, Ctrl-C), and the
command itself through a pipe and through a pseudo-terminal."""

import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig

from specdec.cli.chat import ChatSession, IncrementalDetokenizer, printable
from tiny_chat import save_tiny_chat, tiny_chat_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           OMP_NUM_THREADS="1", COLUMNS="200", SPECDEC_KERNEL_CALIBRATE="0")  # the chat, not the self-check
TEXT = "héllo wörld — 日本語 ✓ ok"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny forwards on one thread


@pytest.fixture(scope="module")
def tiny():
    return tiny_chat_model(), tiny_tokenizer()


def _stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(t) for t in ids]
    return pieces, pieces + [d.flush()], d


def test_streaming_never_splits_a_multibyte_character():
    tok = tiny_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TEXT.encode())  # byte-level: "é" is two tokens, "日" three
    pieces, all_pieces, d = _stream(tok, ids)
    assert "".join(all_pieces) == TEXT == d.text()
    assert not any("\ufffd" in p for p in all_pieces)
    assert pieces[:3] == ["h", "", "é"]  # the first byte of "é" is held back until the second
    assert pieces[-1] == "k"


def test_unfinished_character_is_released_by_flush():
    tok = tiny_tokenizer()
    ids = tok("aé", add_special_tokens=False)["input_ids"][:-1]  # cut inside "é"
    pieces, all_pieces, _ = _stream(tok, ids)
    assert pieces == ["a", ""] and all_pieces[-1] == "\ufffd"


def test_control_characters_are_not_sent_to_the_terminal():
    assert printable("a\x1b[2Jb\rc\x07\x9bd\n\te") == "a[2Jbcd\n\te"


def test_special_tokens_are_not_shown():
    tok = tiny_tokenizer()
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert "".join(_stream(tok, ids)[1]) == "hi"


@pytest.mark.real_model
def test_streaming_with_the_default_tokenizer(real):
    tok = real.tokenizer
    text = "Grüße aus Köln 🌍! Let's write `code`: x = [1, 2]  # done\n  indented"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    _, all_pieces, _ = _stream(tok, ids)
    assert "".join(all_pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in all_pieces)


def _session(tiny, drafter="prompt-lookup", max_new=12, color=False):
    model, tok = tiny
    buf = io.StringIO()
    console = Console(file=buf, width=300, force_terminal=color, color_system="standard" if color else None)
    return ChatSession(model, tok, drafter, max_new, console, color=color), buf


def test_conversation_keeps_both_sides_and_clear_resets_it(tiny):
    s, buf = _session(tiny)
    first = s.reply("Hello there")
    assert first.tokens == 12 and not first.interrupted and first.steps <= 12
    assert [m["role"] for m in s.messages] == ["user", "assistant"]
    assert printable(s.messages[1]["content"]) in buf.getvalue()  # what was streamed is what is remembered
    assert re.search(r"12 tokens in [\d.]+ s · [\d.]+ tokens/s · mean accepted tokens [\d.]+ \(\d+ target forwards",
                     buf.getvalue())
    s.reply("And then?")
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert s.command("/clear") and s.messages == []


def test_drafter_switch_and_bad_names(tiny):
    s, buf = _session(tiny)
    assert s.command("/drafter none") and s.drafter_name == "none" and s.decoder.drafter is None
    assert s.command("/drafter no-such-drafter") and s.drafter_name == "none"
    assert "unknown drafter 'no-such-drafter'" in buf.getvalue()
    assert s.command("/whatever") and "/clear" in buf.getvalue()  # unknown command: help
    assert not s.command("/quit")
    assert s.reply("hi").mean_accepted_tokens == 1  # no drafter: one token per forward


def test_accepted_draft_tokens_are_coloured(tiny):
    s, buf = _session(tiny, max_new=60, color=True)
    # draft on every step: the cost gate would switch drafting off on timing, which tests avoid
    s.decoder.config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))
    stats = s.reply("Tell me a long story.")  # the tiny model loops: prompt lookup drafts well
    assert stats.drafted > 0
    assert "\x1b[36m" in buf.getvalue()  # cyan
    plain, pbuf = _session(tiny, max_new=60, color=False)
    plain.reply("Tell me a long story.")
    assert "\x1b[" not in pbuf.getvalue()


class _InterruptAfter:
    """Wraps a decoder: Ctrl-C (KeyboardInterrupt) arrives after ``n`` steps of a reply."""

    def __init__(self, decoder, n):
        self.decoder, self.n = decoder, n

    def generate(self, ids, callback, **kw):
        seen = [0]

        def cb(ev):
            if seen[0] == self.n:
                raise KeyboardInterrupt
            seen[0] += 1
            callback(ev)

        return self.decoder.generate(ids, callback=cb, **kw)


def test_ctrl_c_stops_the_reply_keeps_the_partial_answer_and_the_session(tiny):
    s, buf = _session(tiny, max_new=40)
    s.decoder = _InterruptAfter(s.decoder, 3)
    stats = s.reply("Hello")
    assert stats.interrupted and 0 < stats.tokens < 40 and stats.steps == 3
    assert "[interrupted]" in buf.getvalue()
    assert [m["role"] for m in s.messages] == ["user", "assistant"]  # partial answer kept
    s.decoder = s.decoder.decoder
    assert not s.reply("go on").interrupted
    assert len(s.messages) == 4


def test_ctrl_c_before_any_text_drops_the_question(tiny):
    s, _ = _session(tiny)
    s.decoder = _InterruptAfter(s.decoder, 0)
    assert s.reply("Hello").tokens == 0
    assert s.messages == []


def test_loop_reads_until_quit_or_eof(tiny):
    s, buf = _session(tiny, max_new=4)
    lines = iter(["", "hi", "/drafter none", KeyboardInterrupt, "again", "/quit", "never read"])

    def read_line(prompt):
        x = next(lines)
        if x is KeyboardInterrupt:
            raise KeyboardInterrupt
        return x

    assert s.loop(read_line) == 0
    assert next(lines) == "never read"
    assert buf.getvalue().count("target forwards") == 2
    assert "leave with /quit or Ctrl-D" in buf.getvalue()
    s2, _ = _session(tiny, max_new=4)
    assert s2.loop(lambda prompt: (_ for _ in ()).throw(EOFError)) == 0


def test_chat_command_reads_a_pipe(tmp_path):
    """stdin not a terminal: plain lines in, answers and stats out, EOF ends the session."""
    save_tiny_chat(tmp_path / "tiny")
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "chat", "--model", str(tmp_path / "tiny"),
                           "--max-new-tokens", "6", "--drafter", "none"],
                          input="hello\n/drafter prompt-lookup\nmore please\n", env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("6 tokens in") == 2
    assert "drafter none" in proc.stdout and "drafter prompt-lookup" in proc.stdout
    assert "\x1b[" not in proc.stdout  # no terminal, no escape codes


# ------------------------------------------------------------------ through a pseudo-terminal

class Pty:
    """The child runs with a pty as its controlling terminal: typed Ctrl-C becomes SIGINT."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            try:
                # a terminal's Ctrl-C must reach it: a process started from a background job (as a CI
                # runner may start the tests) inherits SIGINT ignored, and exec keeps that (POSIX)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execvpe(argv[0], argv, ENV)
            finally:
                os._exit(127)
        self.out = b""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.time() + timeout
        rx = re.compile(pattern.encode())
        while True:
            m = rx.search(self.out)
            if m:
                return m
            left = deadline - time.time()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not seen in {timeout} s; output:\n"
                                     f"{self.out[-3000:].decode(errors='replace')}")
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"child ended before {pattern!r}; output:\n"
                                         f"{self.out[-3000:].decode(errors='replace')}")
                self.out += chunk

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.out += os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise AssertionError("child did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _chat_argv(*args):
    return [sys.executable, "-m", "specdec.cli", "chat", *args]


def test_ctrl_c_in_a_terminal_stops_only_the_reply(tmp_path):
    save_tiny_chat(tmp_path / "tiny")
    # no drafter: prompt lookup copies the tiny model's repetitive reply at ~470 tokens/s, all 3000
    # tokens in ~6 s; plain decoding keeps the reply going long enough for the Ctrl-C to land in it
    p = Pty(_chat_argv("--model", str(tmp_path / "tiny"), "--max-new-tokens", "3000", "--drafter", "none"))
    try:
        p.expect(r"you>", 120)
        p.send("Tell me a long story.\n")
        p.expect(r"model>[\s\S]{200}", 60)  # the reply is streaming
        p.send("\x03")  # Ctrl-C
        p.expect(r"\[interrupted\] \d+ tokens in", 60)
        p.expect(r"you>", 30)
        p.send("/quit\n")
        assert p.wait(30) == 0
    finally:
        p.kill()


@pytest.mark.real_model
def test_chat_on_the_default_model_in_a_terminal(real):
    p = Pty(_chat_argv("--max-new-tokens", "8", "--no-color"))
    try:
        p.expect(r"you>", 180)
        p.send("What is the capital of France?\n")
        m = p.expect(r"model>([\s\S]*?)\r?\n.*?(\d+) tokens in [\d.]+ s · ([\d.]+) tokens/s · "
                     r"mean accepted tokens ([\d.]+)", 180)
        answer = m.group(1).decode().strip()
        assert answer and int(m.group(2)) <= 8
        assert float(m.group(3)) > 0 and float(m.group(4)) >= 1
        p.expect(r"you>", 30)
        p.send("/quit\n")
        assert p.wait(30) == 0
        assert b"\x1b[36m" not in p.out  # --no-color
    finally:
        p.kill()
