"""The drafter contract, run over every registered drafter (and the plugin example) in every mode
it declares: greedy at batch 1 equals HF greedy decoding; at a batch with ragged acceptance each row
equals its prompt alone; under sampling it runs, drafts and gives valid tokens; behind the lookup
hybrid and as a source of a chooser it stays exact. Each greedy case also has drafts of the drafter
under test accepted: a verifier that rejected every draft would give HF's output too. Plus what
propose() may return, and the registry's rules."""

from dataclasses import replace

import pytest
import torch

from conftest import (agreeing_eagle3_head, agreeing_eagle_head, bigram_llama, bigram_plugin, hf_greedy, perturbed,
                      tiny_llama)
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters import (Capabilities, Drafter, LookupHybridDrafter, ModelDrafter, PromptLookupDrafter, Sources,
                              SuffixDrafter)
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.eagle import EagleConfig, EagleDrafter
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.drafters.early_exit import early_exit_model
from specdec.drafters.self_spec import StreamingDrafter
from specdec.registry import DRAFTERS, drafter_names, make_drafter, register_drafter
from specdec.tree import DraftTree

# self-speculation over 512 rows of a 20-token prompt copies it all: exact, and it says so
pytestmark = pytest.mark.filterwarnings("ignore:.*fits the budget")

TARGET = tiny_llama(7, layers=2)
# an EAGLE head agrees with a target that is nearly a bigram model: its next token is the bigram's
# about 3 times in 4, and depends on the whole text (a wrong K/V row can change it)
NEAR_BIGRAM = bigram_llama(7, context=0.5)
NEW = 12  # new tokens per generation: short, the suite is near its time budget
# drafts sized without timing (BASS's schedule, whole trees): the counts asserted below repeat on a loaded machine
FIXED = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))
# a chooser's sources without shadow drafts: a new source is asked in a fixed order, not by measured
# gains, so the source under test drafts on a loaded machine too
UNSHADOWED = replace(FIXED, shadow_drafts=False)


BIGRAM = bigram_plugin()


def _eagle(target) -> EagleDrafter:
    # a head that drafts the bigram's guess over a reduced vocabulary (no multiples of 4): accepted partly
    return EagleDrafter(target, agreeing_eagle_head(target, torch.arange(128)[torch.arange(128) % 4 != 0]),
                        EagleConfig(total_tokens=6, depth=3, top_k=2))


def _eagle3(target) -> Eagle3Drafter:
    # the same guess through an EAGLE-3 head over even ids only
    return Eagle3Drafter(target, agreeing_eagle3_head(target, torch.arange(0, 128, 2)),
                         EagleConfig(total_tokens=6, depth=3, top_k=2))


def _corpus() -> list[list[int]]:
    return [hf_greedy(TARGET, _ids()[:, 5:], 20)[0].tolist(), list(range(40))]


# Registered names whose factory needs what a tiny random target lacks (a trained head, stored answers
# in its vocabulary) run with the same drafter built for it, on the target it is built for (the EAGLE
# heads agree with NEAR_BIGRAM); every other name runs its own factory on TARGET.
STAND_INS = {
    "eagle": (NEAR_BIGRAM, _eagle),
    "eagle+lookup": (NEAR_BIGRAM, lambda t: LookupHybridDrafter(_eagle(t))),
    "eagle3": (NEAR_BIGRAM, _eagle3),
    "suffix-corpus": (TARGET, lambda t: SuffixDrafter.from_corpus(_corpus())),
    "auto": (NEAR_BIGRAM, lambda t: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
                                             "eagle": _eagle(t), "streaming": StreamingDrafter(t, budget=16, sink=2)},
                                            by_match=("eagle",))),
    "auto+eagle3": (NEAR_BIGRAM, lambda t: Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
                                                    "eagle3": _eagle3(t),
                                                    "streaming": StreamingDrafter(t, budget=16, sink=2)},
                                                   by_match=("eagle3",))),
}


@pytest.fixture(scope="module", autouse=True)
def bigram_registered():
    register_drafter("bigram", BIGRAM.make)  # the plugin example, as a plugin registers it
    yield
    del DRAFTERS["bigram"]


def _build(name: str):
    """(target, drafter) of a case: a stand-in on its target, else the registered factory on TARGET (at
    collection, before the fixture above registers it, the plugin example's own)."""
    if name in STAND_INS:
        target, make = STAND_INS[name]
        return target, make(target)
    return TARGET, DRAFTERS.get(name, BIGRAM.make)(TARGET)


def _ids() -> torch.Tensor:
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, ids], dim=1)  # [1, 20]: repeats itself, so copies find matches


def _prompts() -> list[torch.Tensor]:
    ids = _ids()[0]  # rows of different lengths and texts: each accepts its own number of drafts
    return [ids[:13], ids, torch.cat([ids[3:9], ids[3:9], ids[:4]])]


_REF: dict[tuple, list[int]] = {}


def _greedy(target, prompt: torch.Tensor) -> list[int]:
    key = (id(target), tuple(prompt.tolist()))
    if key not in _REF:
        _REF[key] = hf_greedy(target, prompt[None], NEW)[0, len(prompt):].tolist()
    return _REF[key]


def _assert_exact(target, drafter, batch: bool, own=lambda key: True, config=FIXED) -> None:
    """Each row HF's greedy answer, and drafts of the classes ``own`` picks out (the drafter under
    test's, beside prompt lookup's in a hybrid or a chooser) accepted."""
    prompts = _prompts() if batch else [_ids()[0]]
    out = SpecDecoder(target, drafter, config).generate(prompts, max_new_tokens=NEW, eos_token_id=None)
    for b, p in enumerate(prompts):
        assert out.generated(b).tolist() == _greedy(target, p), f"row {b}"
    drafted = sum(sum(s.num_drafted) for s in out.steps if own(s.key))
    accepted = sum(sum(s.num_accepted) for s in out.steps if own(s.key))
    assert accepted > 0, f"{drafted} drafted, none accepted: exact with drafting off too, so no test of it"


# "none": plain decoding, no drafter; "grammar" drafts only the tokens a constraint forces: it is held to
# the same checks under constraints, greedy alone and in batches, in tests/test_constraints.py
NAMES = [n for n in drafter_names() + ["bigram"] if n not in ("none", "grammar")]


def _declared_modes(name: str) -> list[str]:
    """The modes a drafter declares: greedy always; a batch and sampling if its capabilities say so;
    behind the lookup hybrid and as a chooser's source if it is a plain drafter (a chooser, auto, is
    not a source of another)."""
    drafter = _build(name)[1]
    caps = drafter.capabilities
    return ["greedy"] + ["batch"] * caps.batches + ["sampling"] * caps.samples + \
        ["hybrid", "source"] * isinstance(drafter, Drafter)


CASES = [(name, mode) for name in NAMES for mode in _declared_modes(name)]


def test_stand_ins_name_registered_drafters():
    assert set(STAND_INS) <= set(DRAFTERS) and "bigram" in drafter_names()


@pytest.mark.parametrize("name, mode", CASES)
def test_every_registered_drafter_in_every_mode_it_declares(name, mode):
    target, drafter = _build(name)
    caps = drafter.capabilities
    if mode == "greedy":
        _assert_exact(target, drafter, batch=False)
    elif mode == "batch":
        _assert_exact(target, drafter, batch=True)
    elif mode == "hybrid":  # behind prompt lookup after 1-gram matches: both sources draft
        _assert_exact(target, LookupHybridDrafter(drafter), batch=caps.batches,
                      own=lambda key: key is not None and key[0] == "other")
    elif mode == "source":
        _assert_exact(target, Sources({"lookup": PromptLookupDrafter(), name: drafter}), batch=caps.batches,
                      own=lambda key: key is not None and key[0] == name, config=UNSHADOWED)
    else:
        prompts = _prompts() if caps.batches else [_ids()[0]]
        out = SpecDecoder(target, drafter, FIXED).generate(prompts, max_new_tokens=NEW, eos_token_id=None,
                                                           do_sample=True, temperature=0.8, seed=0)
        assert out.num_new == [NEW] * len(prompts)
        assert ((out.sequences >= 0) & (out.sequences < 128)).all()
        assert sum(sum(s.num_drafted) for s in out.steps) > 0


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
