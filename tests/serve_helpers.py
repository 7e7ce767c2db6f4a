"""A live `specdec serve` app on a loopback port, over the tiny byte-level chat model (tests only)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from specdec import SpecDecoder
from specdec.config import RuntimeConfig
from specdec.controller.draft_length import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.model import ModelDrafter
from specdec.serve.app import ServeConfig, Service, create_app

from conftest import tiny_llama
from tiny_chat import VOCAB, tiny_tokenizer

WINDOW = 256  # the tiny model's context window: small, so "over the context" is cheap to ask for


def tiny_model(seed: int = 0):
    return tiny_llama(seed, vocab=VOCAB, layers=2, max_pos=WINDOW)


def tiny_decoder(drafter=None, seed: int = 0, cost_aware: bool = True) -> SpecDecoder:
    """No kernel self-check (seconds on a busy machine; the float64 model never uses the kernels).
    ``cost_aware`` False: the controller drafts at every step whatever the timings (a test that counts
    accepted drafts must not depend on how busy the machine is)."""
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=cost_aware),
                               runtime=RuntimeConfig(calibrate=False))
    return SpecDecoder(tiny_model(seed), drafter, config)


def self_drafter(seed: int = 0) -> ModelDrafter:
    """The tiny target's own weights as a draft model: its greedy drafts are the target's greedy tokens,
    so every one is accepted (as far as the answer's length and EOS let them count)."""
    return ModelDrafter(tiny_model(seed))


class LiveServer:
    """uvicorn in a thread on a free port; ``stop()`` runs the app's shutdown (engine, cache)."""

    def __init__(self, decoder: SpecDecoder, config: ServeConfig = ServeConfig(model_name="tiny"), cache=None):
        self.tokenizer = tiny_tokenizer()
        self.service = Service(decoder, self.tokenizer, config, cache)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.service), host="127.0.0.1", port=self.port,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
