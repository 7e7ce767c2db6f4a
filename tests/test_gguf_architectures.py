"""GGUF files of the families people run, written by llama.cpp's own converter, decoded right.

Each fixture in ``tests/fixtures/gguf/`` is a tiny random model converted by ``convert_hf_to_gguf.py``
(``scripts/make_gguf_fixtures.py``, its pinned version in ``SOURCE.json``); beside it, the independent
reference: the original transformers model with its matrices rounded as the file holds them, its logits
on a fixed prompt and its greedy continuation. Both loads (fp32 and packed) must give those logits (to
summation order) and that continuation, and every registered drafter on the packed target must give
that continuation with drafts accepted. A file of an architecture specdec does not read is refused by
name.
"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller.config import DraftLengthConfig
from specdec.drafters import LookupHybridDrafter, Sources, PromptLookupDrafter, SuffixDrafter
from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from specdec.drafters.self_spec import StreamingDrafter
from specdec.models import ModelLoadError, load_model
from specdec.quant.gguf_arch import ARCHITECTURES
from specdec.registry import drafter_names, make_drafter

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gguf"
NAMES = sorted(p.name[:-len(".gguf")] for p in FIXTURES.glob("*.gguf"))
WEIGHTS = ("fp32", "packed")
# what the fixtures' files say they are: every family of the table has one
FAMILY = {"llama": "llama", "llama3-rope": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
          "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The fixtures copied aside: a fresh file (its own modification time) is converted afresh, so no load
    here reads a conversion cached by an earlier run of other code."""
    folder = tmp_path_factory.mktemp("gguf")
    for name in NAMES:
        shutil.copy(FIXTURES / f"{name}.gguf", folder / f"{name}.gguf")
    return folder


_MODELS: dict = {}


def _load(files: Path, name: str, weights: str):
    if (name, weights) not in _MODELS:
        _MODELS[name, weights] = load_model(str(files / f"{name}.gguf"), weights=weights).model
    return _MODELS[name, weights]


def _ref(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.ref.safetensors"))


def test_every_family_has_a_fixture():
    assert set(NAMES) == set(FAMILY) and set(FAMILY.values()) == set(ARCHITECTURES)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_the_source_model(files, name, weights):
    ref = _ref(name)
    model = _load(files, name, weights)
    with torch.no_grad():
        logits = model(input_ids=ref["prompt"][None]).logits[0].float()
    scale = ref["logits"].abs().max().item()
    assert (logits - ref["logits"]).abs().max().item() <= 1e-5 * max(1.0, scale)


def _stand_in(name: str, target, answer: list[int]):
    """Registered names whose factory needs a trained head or stored answers in SmolLM2's vocabulary
    run with the same drafter built for the fixture: a random EAGLE head (exact whatever it guesses; its
    acceptance is the contract test's, on a head made to agree), stored answers that hold this answer
    (so one drafter is certain to have drafts accepted)."""
    if name in ("eagle", "eagle+lookup"):
        torch.manual_seed(1)
        eagle = EagleDrafter(target, EagleHead(target), EagleConfig(total_tokens=6, depth=3, top_k=2))
        return eagle if name == "eagle" else LookupHybridDrafter(eagle)
    if name == "suffix-corpus":
        return SuffixDrafter.from_corpus([answer])
    if name in ("auto", "auto+quant-self"):
        return Sources({"lookup": PromptLookupDrafter(), "suffix": SuffixDrafter(),
                        "streaming": StreamingDrafter(target, budget=16, sink=2)})
    return make_drafter(name, target)


# drafting whatever the measured costs: whether a draft pays is timed, and under a loaded machine (the suite's
# other worker) the cost gate may draft nothing, which this test would read as a drafter that finds nothing
DRAFTING = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))

# EAGLE-3 heads read three layers' inputs: the 2-layer fixtures have no low / middle / high to offer
DRAFTERS = [n for n in drafter_names() if n not in ("eagle3", "auto+eagle3")]


@pytest.mark.parametrize("name", NAMES)
def test_every_drafter_on_the_packed_file_is_exact_and_accepts_drafts(files, name):
    ref = _ref(name)
    target = _load(files, name, "packed")
    prompt, want = ref["prompt"][None], ref["greedy"].tolist()
    accepted = {}
    for drafter_name in DRAFTERS:
        drafter = _stand_in(drafter_name, target, ref["prompt"].tolist() + want)
        out = SpecDecoder(target, drafter, config=DRAFTING).generate(prompt, max_new_tokens=len(want),
                                                                      eos_token_id=None)
        assert out.generated(0).tolist() == want, drafter_name
        accepted[drafter_name] = out.accepted_per_sequence[0]
    assert accepted["none"] == 0
    # stored answers that hold this one draft from it: verified and accepted on this file
    assert accepted["suffix-corpus"] > 0, accepted
    # on a random model whether its text repeats is chance: most drafters find something to copy or predict
    drafting = [n for n in DRAFTERS if n not in ("none", "eagle", "grammar")]  # grammar: with a constraint only
    assert sum(accepted[n] > 0 for n in drafting) >= len(drafting) // 2, accepted


def test_an_unsupported_architecture_is_refused_by_name(tmp_path):
    """A file whose architecture is not in the table (its name rewritten in the metadata) fails at load,
    in both modes, with the architecture named; it is never decoded by another family's rule."""
    from gguf import GGUFReader

    src = FIXTURES / "llama.gguf"
    bad = tmp_path / "starcoder.gguf"
    shutil.copy(src, bad)
    field = GGUFReader(str(bad), "r+").fields["general.architecture"]
    raw = field.parts[field.data[0]]
    assert bytes(raw).decode() == "llama"
    raw[:] = list(b"gpt2!")  # same length: the file stays well formed
    for weights in WEIGHTS:
        with pytest.raises(ModelLoadError, match=r"architecture 'gpt2!' is not supported"):
            load_model(str(bad), weights=weights)
