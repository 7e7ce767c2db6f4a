"""Whole generations against HF greedy decoding of the same target, token for token."""

import pytest
import torch

from conftest import hf_greedy, perturbed, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.drafters.base import Commit, Drafter, Prompt
from specdec.kv.bmc import BMCConfig
from specdec.tree import DraftTree


class RandomDrafter(Drafter):
    """Drafts uniformly random tokens: (almost) never accepted."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab_size = vocab
        self.g = torch.Generator().manual_seed(seed)

    def begin(self, prompt: Prompt) -> None:
        pass

    def propose(self, budget: int) -> DraftTree:
        return DraftTree.chain(torch.randint(0, self.vocab_size, (1, budget), generator=self.g))

    def accept(self, commit: Commit) -> None:
        pass


def _config(period: int, k: int = 4, adaptive: bool = False) -> SpecDecoderConfig:
    return SpecDecoderConfig(bmc=BMCConfig(period), adaptive_period=False, draft_length=DraftLengthConfig(
        initial=k, maximum=max(k, 10), adaptive=adaptive, cost_aware=False))


DRAFTERS = {
    "none": lambda t: None,
    "self": lambda t: ModelDrafter(t),  # draft == target: every token accepted
    "random": lambda t: RandomDrafter(t.config.vocab_size),  # nothing accepted
    "perturbed": lambda t: ModelDrafter(perturbed(t, 0.3)),  # part of each draft accepted
    "prompt-lookup": lambda t: PromptLookupDrafter(),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("seed", range(4))
def test_equals_hf_greedy(name, seed):
    target = tiny_llama(seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompt_len = [1, 5, 23, 64][seed]
    # a repetitive prompt gives prompt lookup something to find
    ids = torch.randint(0, 128, (1, prompt_len), generator=g)
    ids = torch.cat([ids, ids[:, : prompt_len // 2]], dim=1) if prompt_len > 4 else ids
    ref = hf_greedy(target, ids, 48)
    for period in (1, 3, 64):
        out = SpecDecoder(target, DRAFTERS[name](target), _config(period, adaptive=seed % 2 == 1)).generate(
            ids, max_new_tokens=48, eos_token_id=None)
        assert torch.equal(out.sequences, ref), f"{name} seed {seed} T {period}"
        assert out.new_tokens == 48


def test_acceptance_is_what_each_drafter_should_get(target):
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))

    def run(drafter):
        return SpecDecoder(target, drafter, _config(16, k=4)).generate(ids, max_new_tokens=40, eos_token_id=None)

    full, none = run(ModelDrafter(target)), run(RandomDrafter(128))
    part = run(ModelDrafter(perturbed(target, 0.3)))
    # step 0 is the prefill (1 token); then 4 drafts + 1 bonus per step, the last one clipped to fit
    assert all(s.num_accepted == s.num_drafted for s in full.steps)
    assert [s.num_drafted[0] for s in full.steps] == [0] + [4] * 7 + [3]
    assert full.mean_accepted_tokens == pytest.approx(40 / 9)
    assert none.mean_accepted_tokens < 1.2
    accepted = [a for s in part.steps for a in s.num_accepted]
    assert 0 < sum(accepted) < sum(s.num_drafted[0] for s in part.steps)  # some, not all


def test_eos_stops_like_hf(target):
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    free = hf_greedy(target, ids, 30)
    eos = int(free[0, 9 + 7])  # the 8th generated token becomes the EOS
    ref = hf_greedy(target, ids, 30, eos_token_id=eos)
    for drafter in (None, ModelDrafter(target), PromptLookupDrafter()):
        out = SpecDecoder(target, drafter, _config(8)).generate(ids, max_new_tokens=30, eos_token_id=eos)
        assert torch.equal(out.sequences, ref)
        assert out.sequences[0, -1] == eos


def test_context_window_clips_generation():
    target = tiny_llama(0, max_pos=40)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    out = SpecDecoder(target, ModelDrafter(target), _config(4)).generate(ids, max_new_tokens=50, eos_token_id=None)
    assert out.sequences.shape[1] == 40
    assert torch.equal(out.sequences, hf_greedy(target, ids, 10))


def test_streamer_and_callback_see_every_token(target):
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    events, streamed = [], []

    class Streamer:
        def put(self, t):
            streamed.append(t.reshape(-1).tolist())

        def end(self):
            streamed.append("end")

    out = SpecDecoder(target, ModelDrafter(perturbed(target, 0.2)), _config(8)).generate(
        ids, max_new_tokens=25, eos_token_id=None, streamer=Streamer(), callback=events.append)
    assert streamed[0] == ids[0].tolist() and streamed[-1] == "end"
    assert sum(streamed[1:-1], []) == out.sequences[0, 8:].tolist()
    assert sum((e.tokens for e in events), []) == out.sequences[0, 8:].tolist()
    assert all(0 <= e.from_draft <= len(e.tokens) for e in events)


class OracleDrafter(Drafter):
    """Drafts the next tokens of a known reference output: every draft accepted."""

    def __init__(self, reference: torch.Tensor) -> None:
        self.reference, self.vocab_size = reference.tolist(), None
        self.position = 0

    def begin(self, prompt: Prompt) -> None:
        self.position = int(prompt.lengths[0])

    def propose(self, budget: int) -> DraftTree:
        return DraftTree.chain(torch.tensor([self.reference[self.position : self.position + budget]]))

    def accept(self, commit: Commit) -> None:
        self.position += int(commit.num_new[0])


def test_the_controller_carries_its_measurements_to_the_next_generate(target):
    """A decoder's controller outlives one generate: the first answer times a plain step before it
    drafts; the second drafts from its first step, with what the first measured. Both exact."""
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(7))
    ref = hf_greedy(target, ids, 24)
    decoder = SpecDecoder(target, OracleDrafter(ref[0]))
    first, second = (decoder.generate(ids, max_new_tokens=24, eos_token_id=None) for _ in range(2))
    assert torch.equal(first.sequences, ref) and torch.equal(second.sequences, ref)
    assert first.steps[1].num_drafted == [0] and any(s.num_drafted[0] for s in first.steps[2:])
    assert second.steps[1].num_drafted[0] > 0
    assert decoder.controller.state().positions.observed > 0
    fresh = SpecDecoder(target, OracleDrafter(ref[0])).generate(ids, max_new_tokens=24, eos_token_id=None)
    assert fresh.steps[1].num_drafted == [0]  # a new decoder learns from scratch
