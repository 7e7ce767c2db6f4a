"""`specdec serve --replicas`: two engines as Ray Serve replicas on a local Ray cluster (one CPU, one
thread each) behind one endpoint, driven by the official openai client: the answers a single in-process
server gives, a conversation kept on one replica, and one replica killed under load."""

import argparse
import dataclasses
import socket
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from specdec.cli import build_parser
from specdec.cli.serve import build_app, replica_options, serve_config
from specdec.config import RuntimeConfig
from specdec.drafters.corpus import load_corpus_file, vocab_fingerprint
from specdec.serve.cache import CACHE_FILE

from serve_helpers import LiveServer
from tiny_chat import save_tiny_chat, tiny_tokenizer

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
from specdec.serve.replicas import build_application  # noqa: E402  (imports Ray only when called)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: the in-process server's forwards on one thread
OPENINGS = [f"question {i}: abc {i} abc {i}" for i in range(16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    """`specdec serve --replicas 2` over the tiny chat model saved as a HF directory, drafting with a
    suffix drafter whose served text each replica saves every second to its file in the shared folder."""
    root = tmp_path_factory.mktemp("ray")
    save_tiny_chat(root / "tiny")
    args = build_parser({"serve"}).parse_args(
        ["serve", "--model", str(root / "tiny"), "--model-name", "tiny", "--drafter", "suffix", "--max-batch", "4",
         "--default-max-tokens", "24", "--cache-dir", str(root / "shared"), "--save-every", "1", "--replicas", "2"])
    args.runtime = RuntimeConfig(kernel="off", calibrate=False)  # what the CLI reads from the environment
    return args


@pytest.fixture(scope="module")
def cluster(args):
    """A local Ray cluster of 2 CPUs, the command's application on a free port (one CPU, one thread a
    replica); its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)  # workers: this env
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = dataclasses.replace(replica_options(args, serve_config(args)), health_check_period_s=1.0)
        serve.run(build_application(partial(build_app, args), options), name="specdec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def single(args, one_thread, tmp_path_factory):
    """The same command's app without --replicas, in this process (one `specdec serve`, no Ray): what
    the replicas must answer."""
    alone = argparse.Namespace(**{**vars(args), "replicas": None, "cache_dir": str(tmp_path_factory.mktemp("one"))})
    live = LiveServer(None, app=build_app(alone))
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)
    live.stop()


def _chat(c, messages, **kw):
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, temperature=0, **kw)
    return r.parse().choices[0].message.content, r.headers.get("x-specdec-replica")


def test_replicas_answer_as_one_in_process_server_and_keep_a_conversation_on_one_replica(client, single):
    seen = set()
    for opening in OPENINGS[:6]:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": opening}]
        first, replica = _chat(client, messages, max_tokens=16)
        assert first == _chat(single, messages, max_tokens=16)[0]
        seen.add(replica)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
        second, again = _chat(client, messages, max_tokens=16)
        assert second == _chat(single, messages, max_tokens=16)[0]
        assert again == replica  # the later turn meets the first turn's rows
    prompt = "abc abc abc abc"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == single.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                                          temperature=0).choices[0].text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": OPENINGS[0]}], max_tokens=16, temperature=0, stream=True)
        if c.choices)
    assert streamed == _chat(single, [{"role": "user", "content": OPENINGS[0]}], max_tokens=16)[0]
    for opening in OPENINGS[6:]:  # 16 conversations: all on one replica of two is a 1-in-30,000 chance
        seen.add(_chat(client, [{"role": "user", "content": opening}], max_tokens=1)[1])
    assert seen == {"0", "1"}
    with pytest.raises(openai.BadRequestError, match="messages"):  # the replica's own validation, passed through
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)


def _engine_replicas() -> list[tuple[str, str]]:
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if "SpecdecEngine" in a["name"]]


def test_a_killed_replica_fails_its_requests_clearly_and_is_restarted(args, client, single):
    outcomes: list = [None] * 12

    def ask(i: int) -> None:
        messages = [{"role": "user", "content": OPENINGS[i]}]
        try:
            if i % 2:
                outcomes[i] = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=200, temperature=0, stream=True) if c.choices)
            else:
                outcomes[i] = _chat(client, messages, max_tokens=200)[0]
        except openai.APIError as e:
            outcomes[i] = e

    before = _engine_replicas()
    assert len(before) == 2
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(outcomes))]
    for t in threads:
        t.start()
    time.sleep(0.5)  # requests in flight on both replicas
    ray.kill(ray.get_actor(*before[0]), no_restart=True)  # the process ends at once, as kill -9
    for t in threads:
        t.join(120)
    for i, o in enumerate(outcomes):  # each answered in full, or failed saying what happened and what to do
        if isinstance(o, Exception):
            assert "replica" in str(o) and "retry" in str(o), o
        else:
            assert o == _chat(single, [{"role": "user", "content": OPENINGS[i]}], max_tokens=200)[0]
    deadline = time.monotonic() + 60
    while True:  # the endpoint serves again, on two replicas again (Ray started a new one)
        try:
            answered = [_chat(client, [{"role": "user", "content": o}], max_tokens=4) for o in OPENINGS]
            if {r for _, r in answered} == {"0", "1"}:
                break
        except openai.APIError:
            pass
        assert time.monotonic() < deadline, "the endpoint did not serve on two replicas again"
        time.sleep(0.5)
    assert len(_engine_replicas()) == 2 and set(_engine_replicas()) != set(before)
    fingerprint = vocab_fingerprint(tiny_tokenizer())
    shared = Path(args.cache_dir)
    files = sorted(shared.glob(f"replica-*/{CACHE_FILE}"))
    assert files and not list(shared.glob("replica-*/*.corrupt"))
    for f in files:  # every rank's file whole, whatever the kill interrupted
        assert load_corpus_file(f, fingerprint)
