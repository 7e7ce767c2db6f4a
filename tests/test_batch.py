"""Batches: every sequence of a batch equals HF greedy decoding of its prompt alone, token for token.

The property test draws thousands of random cases (batch size, prompt mix, padding side, drafter,
tree shapes, EOS, max_new_tokens, BMC period T, attention strategy, controller) against references
computed once per prompt: a reference is HF greedy ``generate`` of the prompt alone, and the answer
to any (EOS, max_new_tokens) is a prefix of it, so no case needs a reference run of its own.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from conftest import hf_greedy, perturbed
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters import ModelDrafter, PromptLookupDrafter
from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt, TokenHistory
from specdec.drafters.hybrid import LookupHybridDrafter
from specdec.kv.bmc import BMCConfig
from specdec.tree import DraftTree

CASES = int(os.environ.get("SPECDEC_BATCH_CASES", 2000))  # randomized batches in the property test
MAX_NEW = 14  # reference length per prompt
VOCAB = 64


class OracleTreeDrafter(Drafter):
    """Random trees around the true continuation: the first `d` levels of the main path are right
    (d random, so drafts are accepted whole, in part or not at all), the right token sometimes sits
    behind a wrong sibling, and wrong branches hang off the path. Rows draft different sizes (0 too)."""

    capabilities = Capabilities(batches=True)

    def __init__(self, truth: list[list[int]], seq_ids: list[int], seed: int) -> None:
        self.truth = truth  # per sequence: its reference continuation
        self.seq = list(seq_ids)  # live row -> sequence
        self.rng = random.Random(seed)

    def begin(self, prompt: Prompt) -> None:
        self.history = TokenHistory(prompt)
        self.start = [len(r) for r in self.history.rows]

    def propose(self, budget: int) -> DraftTree:
        rows = []
        for r, s in enumerate(self.seq):
            done = len(self.history.rows[r]) - self.start[r]
            rows.append(self._tree(self.truth[s][done:], self.rng.randint(0, budget)))
        N = max(1, max(len(t) for t, _ in rows))
        tokens = torch.zeros(len(rows), N, dtype=torch.long)
        parents = torch.full((len(rows), N), -1, dtype=torch.long)
        for r, (t, p) in enumerate(rows):
            tokens[r, : len(t)], parents[r, : len(p)] = torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long)
        return DraftTree(tokens, parents, torch.tensor([len(t) for t, _ in rows]))

    def _tree(self, truth: list[int], n: int) -> tuple[list[int], list[int]]:
        rng, tokens, parents = self.rng, [], []
        right = rng.randint(0, min(n, len(truth)))  # levels of the main path that are right
        parent, children = -1, {}
        for depth in range(n):
            if len(tokens) >= n:
                break
            good = truth[depth] if depth < len(truth) else rng.randrange(VOCAB)
            tok = good if depth < right else (good + 1 + rng.randrange(VOCAB - 1)) % VOCAB
            if depth < right and len(tokens) + 1 < n and rng.random() < 0.3:  # a wrong sibling first
                tokens.append((good + 1 + rng.randrange(VOCAB - 1)) % VOCAB)
                parents.append(parent)
            if len(tokens) >= n:
                break
            tokens.append(tok)
            parents.append(parent)
            children.setdefault(parent, set()).update(tokens[-2:] if len(tokens) > 1 and parents[-2] == parent else tokens[-1:])
            parent = len(tokens) - 1
            if len(tokens) < n and rng.random() < 0.3:  # a wrong branch off this node
                used = {tokens[i] for i, p in enumerate(parents) if p == parent}
                t = rng.randrange(VOCAB)
                if t not in used and not (depth + 1 < len(truth) and t == truth[depth + 1]):
                    tokens.append(t)
                    parents.append(parent)
        return tokens, parents

    def accept(self, commit: Commit) -> None:
        self.history.extend(commit)

    def select(self, rows: list[int]) -> None:
        self.history.select(rows)
        self.start = [self.start[r] for r in rows]
        self.seq = [self.seq[r] for r in rows]


def _prompt(rng: random.Random) -> list[int]:
    n = rng.choice([1, 2, rng.randint(3, 20), rng.randint(20, 120), rng.randint(120, 300)])
    base = [rng.randrange(1, VOCAB) for _ in range(max(1, n // 2))]
    return (base * 3)[:n] if rng.random() < 0.5 else [rng.randrange(1, VOCAB) for _ in range(n)]  # repetitive or not


def _small_llama(seed: int):
    """A 1-layer float64 Llama narrower than conftest's (32 wide): thousands of cases stay cheap."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def world():
    """Three small float64 models and 24 prompts each with their HF greedy continuations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only adds synchronisation
    rng = random.Random(0)
    models = []
    for seed in range(3):
        target = _small_llama(seed)
        prompts = [_prompt(rng) for _ in range(24)]
        refs = [hf_greedy(target, torch.tensor([p]), MAX_NEW)[0, len(p):].tolist() for p in prompts]
        models.append((target, perturbed(target, 0.3, seed), prompts, refs))
    yield models
    torch.set_num_threads(threads)


def _expected(ref: list[int], max_new: int, eos: int | None) -> list[int]:
    out = ref[:max_new]
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out


def _drafter(kind: str, target, drafter_model, truth, seed: int):
    seqs = list(range(len(truth)))
    return {"none": lambda: None, "self": lambda: ModelDrafter(target),
            "perturbed": lambda: ModelDrafter(drafter_model), "lookup": lambda: PromptLookupDrafter(),
            "tree": lambda: OracleTreeDrafter(truth, seqs, seed),
            "hybrid": lambda: LookupHybridDrafter(OracleTreeDrafter(truth, seqs, seed))}[kind]()


def _run_case(world, i: int) -> None:
    rng = random.Random(1000 + i)
    target, drafter_model, prompts, refs = world[rng.randrange(len(world))]
    B = rng.randint(1, 8)
    picks = [rng.randrange(len(prompts)) for _ in range(B)]
    max_new = rng.randint(1, MAX_NEW)
    eos = rng.choice(refs[picks[0]]) if rng.random() < 0.4 else None  # stops some rows at a random step
    kind = rng.choice(["none", "self", "perturbed", "lookup", "tree", "tree", "hybrid"])
    drafter = _drafter(kind, target, drafter_model, [refs[p] for p in picks], i)
    k = rng.randint(1, 6)
    config = SpecDecoderConfig(
        bmc=BMCConfig(rng.choice([1, 2, 3, 5, 8, 64])), adaptive_period=rng.random() < 0.2,
        attention=rng.choice(["pad", "split", "auto"]),
        draft_length=DraftLengthConfig(initial=k, maximum=max(k, 8), adaptive=rng.random() < 0.5, cost_aware=False))
    layout = rng.choice(["list", "left", "right"])
    seqs = [torch.tensor(prompts[p]) for p in picks]
    P = max(len(s) for s in seqs)
    if layout == "list":
        out = SpecDecoder(target, drafter, config).generate(seqs, max_new_tokens=max_new, eos_token_id=eos)
    else:
        ids = torch.zeros(B, P, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for b, s in enumerate(seqs):
            span = slice(P - len(s), P) if layout == "left" else slice(0, len(s))
            ids[b, span], mask[b, span] = s, 1
        out = SpecDecoder(target, drafter, config).generate(ids, attention_mask=mask, max_new_tokens=max_new,
                                                           eos_token_id=eos)
        assert torch.equal(out.sequences[:, :P], ids), f"case {i}: the input rows are kept as given"
    T = "auto" if config.adaptive_period else config.bmc.period
    where = f"case {i}: B={B} {kind} T={T} {config.attention} {layout} max_new={max_new} eos={eos}"
    for b, p in enumerate(picks):
        assert out.generated(b).tolist() == _expected(refs[p], max_new, eos), f"{where}, sequence {b}"
    assert out.sequences.shape[1] == P + max(out.num_new)


def test_ragged_batches_equal_hf_greedy_of_each_prompt_alone(world):
    """CASES random batches (default 2,000; SPECDEC_BATCH_CASES to change): zero mismatches."""
    for i in range(CASES):
        _run_case(world, i)


def test_each_sequence_accepts_its_own_count(world):
    """BASS's ragged acceptance: in one step, rows accept different numbers of drafted tokens."""
    target, _, prompts, refs = world[0]
    picks = list(range(6))
    drafter = OracleTreeDrafter([refs[p] for p in picks], picks, seed=7)
    config = SpecDecoderConfig(draft_length=DraftLengthConfig(initial=5, maximum=5, adaptive=False, cost_aware=False))
    out = SpecDecoder(target, drafter, config).generate([torch.tensor(prompts[p]) for p in picks], max_new_tokens=MAX_NEW,
                                                       eos_token_id=None)
    assert any(len(set(s.num_accepted)) > 1 for s in out.steps[1:]), "every step accepted the same count per row"
    for b, p in enumerate(picks):
        assert out.generated(b).tolist() == refs[p]


def test_finished_sequences_leave_the_batch(world):
    """Compaction: once a sequence stops (its EOS), later steps compute only the others."""
    target, _, prompts, refs = world[1]
    eos = refs[0][2]  # sequence 0 stops at its 3rd token (or sooner)
    seqs = [torch.tensor(prompts[p]) for p in range(4)]
    out = SpecDecoder(target, PromptLookupDrafter()).generate(seqs, max_new_tokens=MAX_NEW, eos_token_id=eos)
    first_stop = out.num_new[0]
    assert first_stop <= 3 and out.sequences[0, out.prompt_length + first_stop - 1] == eos
    assert all(0 not in s.sequences for s in out.steps[out.steps_per_sequence[0]:])
    assert len(out.steps[-1].sequences) < 4
    pad = out.sequences[0, out.prompt_length + first_stop:]
    assert (pad == target.generation_config.pad_token_id).all() or pad.numel() == 0


def test_outputs_say_per_sequence_lengths_steps_and_accepted(world):
    target, _, prompts, refs = world[2]
    seqs = [torch.tensor(prompts[p]) for p in range(3)]
    events = []
    out = SpecDecoder(target, ModelDrafter(target)).generate(seqs, max_new_tokens=12, eos_token_id=None,
                                                             callback=events.append)
    assert out.num_new == [12, 12, 12]
    assert len(out.steps_per_sequence) == 3 and all(s >= 1 for s in out.steps_per_sequence)
    assert all(0 <= a <= 11 for a in out.accepted_per_sequence)
    for s in range(3):  # the callback names the sequence each token belongs to
        assert sum((e.tokens for e in events if e.sequence == s), []) == out.generated(s).tolist()


def test_split_and_pad_attention_agree_on_very_different_lengths(world):
    target, _, _, _ = world[0]
    rng = random.Random(5)
    seqs = [torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)]) for n in (3, 290, 40)]
    outs = {}
    for mode in ("pad", "split"):
        outs[mode] = SpecDecoder(target, PromptLookupDrafter(), SpecDecoderConfig(attention=mode)).generate(
            seqs, max_new_tokens=10, eos_token_id=None)
        assert all(s.split == (mode == "split") for s in outs[mode].steps[1:])
    assert torch.equal(outs["pad"].sequences, outs["split"].sequences)
    for b, s in enumerate(seqs):
        assert outs["pad"].generated(b).tolist() == hf_greedy(target, s[None], 10)[0, len(s):].tolist()


def test_auto_attention_splits_only_very_different_lengths(world):
    target = world[0][0]
    rng = random.Random(6)
    similar = [torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)]) for n in (100, 110)]
    apart = [torch.tensor([rng.randrange(1, VOCAB) for _ in range(n)]) for n in (5, 5, 290)]
    dec = SpecDecoder(target, None, SpecDecoderConfig(attention="auto"))
    assert not any(s.split for s in dec.generate(similar, max_new_tokens=4, eos_token_id=None).steps)
    assert all(s.split for s in dec.generate(apart, max_new_tokens=4, eos_token_id=None).steps[1:])
