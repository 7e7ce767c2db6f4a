"""The drafter contract, run over every registered drafter (and the plugin example) in every mode
it declares: greedy at batch 1 equals HF greedy decoding; at a batch with ragged acceptance each row
equals its prompt alone; under sampling it runs and gives valid tokens; behind the lookup hybrid and
as a source of a chooser it stays exact. Plus what propose() may return, and the registry's rules."""

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters import (Capabilities, Drafter, LookupHybridDrafter, ModelDrafter, PromptLookupDrafter, Sources,
                              SuffixDrafter)
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.eagle3_head import Eagle3Head
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.self_spec import StreamingDrafter
from specdec.registry import DRAFTERS, drafter_names, make_drafter, register_drafter
from specdec.tree import DraftTree

# self-speculation over 512 rows of a 20-token prompt copies it all: exact, and it says so
pytestmark = pytest.mark.filterwarnings("ignore:.*fits the budget")

TARGET = tiny_llama(7, layers=2)
NEW = 12  # new tokens per generation: short, the suite is near its time budget


def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "bigram_drafter.py"
    spec = importlib.util.spec_from_file_location("bigram_drafter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BIGRAM = _example()


def _eagle(target) -> EagleDrafter:
    torch.manual_seed(1)  # a randomly initialised head: exact whatever it guesses
    return EagleDrafter(target, EagleHead(target), EagleConfig(total_tokens=6, depth=3, top_k=2))


def _eagle3(target) -> Eagle3Drafter:
    torch.manual_seed(1)  # a random head over a reduced vocabulary (even ids)
    return Eagle3Drafter(target, Eagle3Head(target, draft_vocab=torch.arange(0, 128, 2)),
                         EagleConfig(total_tokens=6, depth=3, top_k=2))


def _corpus() -> list[list[int]]:
    return [hf_greedy(TARGET, _ids()[:, 5:], 20)[0].tolist(), list(range(40))]


# Registered names whose factory needs what a tiny random target lacks (a trained head, stored answers
# in its vocabulary) run with the same drafter built for it; every other name runs its own factory.
STAND_INS = {
    "eagle": _eagle,
    "eagle+lookup": lambda t: LookupHybridDrafter(_eagle(t)),
    "eagle3": _eagle3,
    "suffix-corpus": lambda t: SuffixDrafter.from_corpus(_corpus()),
    "auto": lambda t: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(), "eagle": _eagle(t),
                               "streaming": StreamingDrafter(t, budget=16, sink=2)}, by_match=("eagle",)),
    "auto+eagle3": lambda t: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(), "eagle3": _eagle3(t),
                                      "streaming": StreamingDrafter(t, budget=16, sink=2)}, by_match=("eagle3",)),
}


@pytest.fixture(scope="module", autouse=True)
def bigram_registered():
    register_drafter("bigram", BIGRAM.make)  # the plugin example, as a plugin registers it
    yield
    del DRAFTERS["bigram"]


def _build(name: str):
    return STAND_INS[name](TARGET) if name in STAND_INS else make_drafter(name, TARGET)


def _ids() -> torch.Tensor:
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, ids], dim=1)  # [1, 20]: repeats itself, so copies find matches


def _prompts() -> list[torch.Tensor]:
    ids = _ids()[0]  # rows of different lengths and texts: each accepts its own number of drafts
    return [ids[:13], ids, torch.cat([ids[3:9], ids[3:9], ids[:4]])]


_REF: dict[tuple, list[int]] = {}


def _greedy(prompt: torch.Tensor) -> list[int]:
    key = tuple(prompt.tolist())
    if key not in _REF:
        _REF[key] = hf_greedy(TARGET, prompt[None], NEW)[0, len(prompt):].tolist()
    return _REF[key]


def _assert_exact(drafter, batch: bool) -> None:
    prompts = _prompts() if batch else [_ids()[0]]
    out = SpecDecoder(TARGET, drafter).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == _greedy(p), f"row {b}"


NAMES = [n for n in drafter_names() + ["bigram"] if n != "none"]  # "none": plain decoding, no drafter
MODES = ["greedy", "batch", "sampling", "hybrid", "source"]


def test_stand_ins_name_registered_drafters():
    assert set(STAND_INS) <= set(DRAFTERS) and "bigram" in drafter_names()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_every_registered_drafter_in_every_mode_it_declares(name, mode):
    drafter = _build(name)
    caps = drafter.capabilities
    plain = isinstance(drafter, Drafter)  # a chooser (auto) is not a source of another
    if mode in ("batch", "sampling") and not (caps.batches if mode == "batch" else caps.samples):
        pytest.skip(f"{name} does not declare {mode}")
    if mode in ("hybrid", "source") and not plain:
        pytest.skip(f"{name} is a chooser")
    if mode == "greedy":
        _assert_exact(drafter, batch=False)
    elif mode == "batch":
        _assert_exact(drafter, batch=True)
    elif mode == "hybrid":  # behind prompt lookup after 1-gram matches: both sources draft
        _assert_exact(LookupHybridDrafter(drafter), batch=caps.batches)
    elif mode == "source":
        _assert_exact(Sources({"lookup": PromptLookupDrafter(), name: drafter}), batch=caps.batches)
    else:
        prompts = _prompts() if caps.batches else [_ids()[0]]
        out = SpecDecoder(TARGET, drafter).generate(prompts, max_new_tokens=NEW, eos_token_id=None,
                                                    do_sample=True, temperature=0.8, seed=0)
        assert out.num_new == [NEW] * len(prompts)
        assert ((out.sequences >= 0) & (out.sequences < 128)).all()


def test_a_seeded_sampled_run_repeats_with_the_plugin_drafter():
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))  # drafts sized alike
    runs = [SpecDecoder(TARGET, BIGRAM.make(TARGET), config).generate(
        _prompts(), max_new_tokens=NEW, eos_token_id=None, do_sample=True, seed=3).sequences for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_a_drafter_that_does_not_declare_sampling_is_refused_under_it():
    class Greedy(BIGRAM.BigramDrafter):
        capabilities = Capabilities(batches=True)

    SpecDecoder(TARGET, Greedy()).generate(_ids(), max_new_tokens=2)
    with pytest.raises(ValueError, match="Greedy does not declare that it drafts under sampling"):
        SpecDecoder(TARGET, Greedy()).generate(_ids(), max_new_tokens=2, do_sample=True)


# ------------------------------------------------------------- what propose() may return (unit)

IMPLEMENTATIONS = {
    "model": lambda: ModelDrafter(perturbed(TARGET, 0.2)),
    "prompt-lookup": lambda: PromptLookupDrafter(),
    "early-exit": lambda: ModelDrafter(early_exit_model(TARGET, 1)),
    "lookup+model": lambda: LookupHybridDrafter(ModelDrafter(perturbed(TARGET, 0.2))),
    "suffix": lambda: SuffixDrafter(),
    "suffix+corpus": lambda: SuffixDrafter.from_corpus(_corpus()),
    "bigram": lambda: BIGRAM.BigramDrafter(),
}


@pytest.fixture(params=list(IMPLEMENTATIONS))
def drafter(request):
    return IMPLEMENTATIONS[request.param]()


@pytest.mark.parametrize("budget", [0, 1, 3, 6])
def test_propose_respects_the_budget(drafter, budget):
    drafter.begin(Prompt(_ids(), torch.tensor([20])))
    tree = drafter.propose(budget)
    assert isinstance(tree, DraftTree) and tree.batch_size == 1
    assert int(tree.num_nodes[0]) <= budget and tree.width <= max(budget, tree.width)
    assert ((tree.parents >= -1) & (tree.parents < torch.arange(tree.width))).all()  # parents first
    assert ((tree.tokens >= 0) & (tree.tokens < 128)).all()


def test_accept_then_propose_again(drafter):
    drafter.begin(Prompt(_ids(), torch.tensor([20])))
    tree = drafter.propose(3)
    n = int(tree.num_nodes[0])
    a = min(1, n)
    tokens = torch.cat([tree.tokens[:, :a], torch.tensor([[5]])], dim=1)
    drafter.accept(Commit(tokens, torch.tensor([a + 1]), torch.tensor([a])))
    assert drafter.propose(2).width <= 2


# ---------------------------------------------------------------------------------- the registry

def test_registry_names_build(target):
    for name in drafter_names():
        if "eagle" in name:
            continue  # needs trained weights for this target; run above with a random head
        make_drafter(name, target)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        make_drafter("nope", target)


def test_register_drafter_validates_names_and_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        register_drafter("bigram", BIGRAM.make)
    register_drafter("bigram", BIGRAM.make, replace=True)
    for bad in ("", "Big", "two words", "-x", "a/b"):
        with pytest.raises(ValueError, match="drafter name"):
            register_drafter(bad, BIGRAM.make)
    with pytest.raises(TypeError, match="callable"):
        register_drafter("not-callable", 3)
    assert "not-callable" not in DRAFTERS


def test_every_command_accepts_a_registered_name():
    from specdec.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "hi", "--drafter", "bigram"], ["chat", "--drafter", "bigram"],
                 ["specbench", "--drafter", "bigram"]):
        assert "bigram" in str(vars(parser.parse_args(argv))), argv


def test_a_draft_models_catch_up_is_reported_apart_from_drafting(monkeypatch):
    """A draft model feeds its store what it has not seen before drafting: the prompt at the first draft
    (catch-up, not resuming), a step's last draft and token after a step (neither), the text of steps
    drafted by someone else (catch-up and resume): the decoder prices drafts without it (decision 010)."""
    ticks = iter([10.0, 10.5, 20.0, 30.0, 30.25])  # a propose reads the clock before its first feed, after it if behind
    monkeypatch.setattr("specdec.drafters.model.time.perf_counter", lambda: next(ticks))
    d = ModelDrafter(perturbed(TARGET, 0.1))
    ids = _ids()
    d.begin(Prompt(ids, torch.tensor([ids.shape[1]])))
    d.propose(3)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.5, 0.0)  # the prompt
    step = Commit(torch.tensor([[5, 6, 7]]), torch.tensor([3]), torch.tensor([2]))
    d.accept(step)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.0, 0.0)
    d.propose(3)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.0, 0.0)  # one token behind: a draft's own feed
    for _ in range(2):  # two steps another source drafted: 6 tokens behind
        d.accept(Commit(torch.tensor([[5, 6, 7]]), torch.tensor([3]), torch.tensor([2])))
    d.propose(3)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.25, 0.25)
