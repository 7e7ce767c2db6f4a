"""A live `specdec serve` app on a loopback port, over the tiny byte-level chat model (tests only)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from specdec import SpecDecoder
from specdec.config import RuntimeConfig
from specdec.controller.draft_length import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.corpus import vocab_fingerprint
from specdec.drafters.model import ModelDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.serve.app import create_app
from specdec.serve.cache import CACHE_FILE, CacheConfig, ServedCache
from specdec.serve.engine import EngineConfig
from specdec.serve.service import ServeConfig, Service

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


REPLICA_CONFIG = ServeConfig(model_name="tiny", default_max_tokens=24, engine=EngineConfig(max_batch=4))


def replica_app(cache_dir: str, rank: int):
    """A Ray replica's app (tests/test_serve_ray.py; ``specdec.serve.replicas`` calls it with the replica's
    rank): the tiny target with a suffix drafter whose served text is saved every half second to the
    rank's file in ``cache_dir``, the folder the replicas share."""
    drafter = SuffixDrafter()
    tokenizer = tiny_tokenizer()
    path = Path(cache_dir) / f"replica-{rank}" / CACHE_FILE
    cache = ServedCache([drafter], vocab_fingerprint(tokenizer), CacheConfig(path, save_every=0.5))
    cache.load()
    return create_app(Service(tiny_decoder(drafter, cost_aware=False), tokenizer, REPLICA_CONFIG, cache))


class LiveServer:
    """uvicorn in a thread on a free port; ``stop()`` runs the app's shutdown (engine, cache)."""

    def __init__(self, decoder: SpecDecoder | None, config: ServeConfig = ServeConfig(model_name="tiny"), cache=None,
                 app=None):
        """``app``: an app made elsewhere (``specdec.cli.serve.build_app``) in place of one over ``decoder``."""
        self.tokenizer = tiny_tokenizer()
        self.service = app.state.service if app is not None else Service(decoder, self.tokenizer, config, cache)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = app if app is not None else create_app(self.service)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
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
