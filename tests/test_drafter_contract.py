"""The drafter contract, run over every implementation: what propose() may return, and that a
generation with it equals HF greedy decoding."""

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_llama
from specdec import SpecDecoder
from specdec.drafters import LookupHybridDrafter, ModelDrafter, PromptLookupDrafter
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.suffix import SuffixDrafter
from specdec.registry import DRAFTERS, make_drafter
from specdec.tree import DraftTree

TARGET = tiny_llama(7, layers=3)

IMPLEMENTATIONS = {
    "model": lambda: ModelDrafter(perturbed(TARGET, 0.2)),
    "prompt-lookup": lambda: PromptLookupDrafter(),
    "early-exit": lambda: ModelDrafter(early_exit_model(TARGET, 1)),
    "lookup+model": lambda: LookupHybridDrafter(ModelDrafter(perturbed(TARGET, 0.2))),
    "suffix": lambda: SuffixDrafter(),
    "suffix+corpus": lambda: SuffixDrafter.from_corpus(
        [hf_greedy(TARGET, _prompt().input_ids[:, 5:], 30)[0].tolist(), list(range(40))]),
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def drafter(request):
    return IMPLEMENTATIONS[request.param]()


def _prompt():
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids], dim=1)
    return Prompt(ids, torch.tensor([20]))


@pytest.mark.parametrize("budget", [0, 1, 3, 6])
def test_propose_respects_the_budget(drafter, budget):
    drafter.begin(_prompt())
    tree = drafter.propose(budget)
    assert isinstance(tree, DraftTree) and tree.batch_size == 1
    assert int(tree.num_nodes[0]) <= budget and tree.width <= max(budget, tree.width)
    assert ((tree.parents >= -1) & (tree.parents < torch.arange(tree.width))).all()  # parents first
    assert ((tree.tokens >= 0) & (tree.tokens < 128)).all()


def test_accept_then_propose_again(drafter):
    drafter.begin(_prompt())
    tree = drafter.propose(3)
    n = int(tree.num_nodes[0])
    a = min(1, n)
    tokens = torch.cat([tree.tokens[:, :a], torch.tensor([[5]])], dim=1)
    drafter.accept(Commit(tokens, torch.tensor([a + 1]), torch.tensor([a])))
    assert drafter.propose(2).width <= 2


def test_generation_is_lossless(drafter):
    ids = _prompt().input_ids
    out = SpecDecoder(TARGET, drafter).generate(ids, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(out.sequences, hf_greedy(TARGET, ids, 40))


def test_registry_names_build(target):
    for name in DRAFTERS:
        if "eagle" in name:
            continue  # needs trained weights; covered by its own tests
        make_drafter(name, target)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        make_drafter("nope", target)
