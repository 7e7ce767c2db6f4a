import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from specdec.bench.device.tiny import hf_greedy, perturbed, tiny_llama  # noqa: E402,F401  (the tests import them from here)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def shared_file(rel: str):
    """A file of the steering repo's shared/ data: beside this clone (as CI lays it out), else /work/shared."""
    from pathlib import Path

    beside = Path(__file__).resolve().parents[2] / "shared" / rel
    return beside if beside.exists() else Path("/work/shared") / rel


def ragged_blocks(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, hidden states) of three blocks of a ragged batch of two through ``forward_block``: a
    prefill-sized chain, a tree block (row 0 forks under node 0, row 1 has two roots), a SPLIT chain."""
    from specdec.forward import forward_block
    from specdec.kv.bmc import BMCCache, BMCConfig
    from specdec.tree import ancestor_mask

    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    cache = BMCCache.for_model(model, 2, BMCConfig(8))
    ids = torch.randint(1, V, (2, 9), generator=g)
    out = [forward_block(model, cache, ids, None, None, want_hidden=True)]
    cache.commit([list(range(9)), list(range(5))])  # row 1 keeps 5 of its 9: ragged from here
    mask = ancestor_mask(torch.tensor([[-1, 0, 0], [-1, -1, 1]]))
    depth = torch.tensor([[0, 1, 2, 2], [0, 1, 1, 2]])
    out.append(forward_block(model, cache, torch.randint(1, V, (2, 4), generator=g), mask, depth, want_hidden=True))
    cache.commit([[0, 1, 3], [0, 2]])
    out.append(forward_block(model, cache, torch.randint(1, V, (2, 3), generator=g), None, None, want_hidden=True,
                             split=True))
    return [(o.logits, o.hidden) for o in out]


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
    """The default model (SmolLM2-135M-Instruct), loaded once per session from the local cache."""
    from specdec.models import load_model

    try:
        return load_model("default")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"default model unavailable: {e}")
