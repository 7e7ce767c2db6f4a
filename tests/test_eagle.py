"""EAGLE: the head, its dynamic trees, files, and losslessness of whole generations (random and
briefly trained heads) against HF greedy decoding on tiny random targets."""

import json

import pytest
import torch

from conftest import agreeing_eagle_head, bigram_llama, hf_greedy, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.hybrid import HybridConfig, LookupHybridDrafter
from specdec.drafters.eagle import (EagleConfig, EagleDrafter, EagleHead, EagleHeadConfig, export_eagle,
                                    import_eagle, load_head, make_eagle, save_head)
from specdec.kv.bmc import BMCConfig
from specdec.registry import make_drafter
from specdec.tree import node_depths, path_to


def _decoder_config(period: int, nodes: int) -> SpecDecoderConfig:
    # a fixed node budget: the BASS controller's "all accepted" never happens with a bushy tree
    return SpecDecoderConfig(bmc=BMCConfig(period), adaptive_period=False, draft_length=DraftLengthConfig(
        initial=nodes, maximum=nodes, adaptive=False, cost_aware=False))


def _random_head(target, seed=1, **kw) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(target, EagleHeadConfig(**kw))


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


def _prompt_with_features(target, P=12, seed=3):
    ids = torch.randint(0, 128, (1, P), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    return ids, hidden


def _reference_outputs(head, feats, toks):
    """Head outputs of a chain of pairs with no cache, positions 0..S-1: [S, D]."""
    S = toks.shape[0]
    with torch.no_grad():
        return head(feats[None], toks[None], torch.arange(S)[None])[0]


def test_tree_nodes_are_the_heads_top_k_along_their_own_path(target):
    """Every fed node's children must be the top-k of the head evaluated, without any cache, on the
    prompt pairs followed by the node's own path: tree attention in the head's store is exact."""
    head = _random_head(target)
    ids, hidden = _prompt_with_features(target)
    cfg = EagleConfig(total_tokens=200, depth=4, top_k=3, bmc=BMCConfig(5))
    d = EagleDrafter(target, head, cfg)
    d.begin(Prompt(ids, torch.tensor([12]), hidden[:, :-1]))
    tree = d.propose(200)  # everything in the pool: 3 + 3 * 9 = 30 nodes
    assert tree.width == 30 and int(node_depths(tree.parents).max()) == 4
    feats, toks = hidden[0, :11], ids[0, 1:]
    parents, tokens = tree.parents[0], tree.tokens[0]
    children = {}
    for i, p in enumerate(parents.tolist()):
        children.setdefault(p, []).append(int(tokens[i]))
    for node, kids in children.items():
        path = path_to(parents, node) if node >= 0 else []
        f, t = feats, toks
        for j in path:  # the pair of a node: (its parent's head output, its token)
            out = _reference_outputs(head, f, t)
            f, t = torch.cat([f, out[-1:]]), torch.cat([t, tokens[j : j + 1]])
        out = _reference_outputs(head, f, t)
        top = torch.log_softmax(head.logits(out[-1]), -1).topk(3).indices.tolist()
        assert sorted(kids) == sorted(top), f"node {node}"


def test_tree_is_the_best_nodes_closed_under_ancestors(target):
    head = _random_head(target, seed=4)
    ids, hidden = _prompt_with_features(target, seed=5)
    d = EagleDrafter(target, head, EagleConfig(total_tokens=9, depth=5, top_k=2))
    d.begin(Prompt(ids, torch.tensor([12]), hidden[:, :-1]))
    tree = d.propose(9)
    assert tree.num_nodes.tolist() == [9] and tree.width == 9
    par = tree.parents[0].tolist()
    assert all(-1 <= p < i for i, p in enumerate(par))
    for p in set(par):  # siblings are distinct tokens
        sib = [int(tree.tokens[0, i]) for i, q in enumerate(par) if q == p]
        assert len(sib) == len(set(sib))
    assert d.propose(3).width == 3 and d.propose(0).width == 0  # the budget caps the node count
    assert int(node_depths(d.propose(2).parents).max()) <= 2


def test_head_store_keeps_only_committed_pairs(target):
    head = _random_head(target)
    ids, hidden = _prompt_with_features(target)
    d = EagleDrafter(target, head, EagleConfig(total_tokens=8, depth=3, top_k=2, bmc=BMCConfig(3)))
    d.begin(Prompt(ids, torch.tensor([12]), hidden[:, :-1]))
    d.propose(8)
    assert d.cache.lengths == [11]  # prompt pairs only; tree rows were dropped
    commit = Commit(torch.tensor([[7, 9]]), torch.tensor([2]), torch.tensor([1]), torch.randn(1, 2, 64).double())
    d.accept(commit)
    first = d.propose(8)
    assert d.cache.lengths == [13]
    again = d.propose(8)  # proposing twice without news gives the same tree
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.parents, again.parents)


def _drafter_on_a_clock(target, monkeypatch, ticks: list[float]) -> EagleDrafter:
    """A small EAGLE drafter begun on a 12-token prompt, its clock reading ``ticks`` in turn."""
    ids, hidden = _prompt_with_features(target)
    d = EagleDrafter(target, _random_head(target), EagleConfig(total_tokens=4, depth=2, top_k=2))
    d.begin(Prompt(ids, torch.tensor([12]), hidden[:, :-1]))
    clock = iter(ticks)
    monkeypatch.setattr("specdec.drafters.eagle.time.perf_counter", lambda: next(clock))
    return d


def test_catching_up_on_pairs_is_reported_apart_from_drafting(target, monkeypatch):
    """The pairs fed before a tree are the drafter's catch-up, not the tree's price, when there are more
    than one step commits (a whole prompt first): propose reports the seconds it spent feeding them,
    accept clears them; a step's own few pairs are part of the draft's cost."""
    d = _drafter_on_a_clock(target, monkeypatch, [10.0, 10.375, 11.0, 11.5])
    d.propose(4)
    assert d.catch_up_seconds() == 0.375  # 11 prompt pairs
    d.accept(Commit(torch.tensor([[7, 9]]), torch.tensor([2]), torch.tensor([1]), torch.randn(1, 2, 64).double()))
    assert d.catch_up_seconds() == 0.0
    d.propose(4)
    assert d.catch_up_seconds() == 0.0  # the 2 pairs one step committed
    assert d.resume_seconds() == 0.0


def test_a_feed_after_a_pause_is_reported_as_resuming(target, monkeypatch):
    """Pairs committed while the drafter did not draft (a pause) are a catch-up too, and the price of
    drafting again (resume_seconds); the prompt's own pairs are not (paid once per generation)."""
    d = _drafter_on_a_clock(target, monkeypatch, [10.0, 10.375, 11.0, 11.25])
    d.propose(4)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.375, 0.0)  # the prompt
    for _ in range(3):  # three steps drafted by someone else: 6 pairs behind
        d.accept(Commit(torch.tensor([[7, 9]]), torch.tensor([2]), torch.tensor([1]), torch.randn(1, 2, 64).double()))
    d.propose(4)
    assert (d.catch_up_seconds(), d.resume_seconds()) == (0.25, 0.25)


def test_the_controller_prices_drafts_without_the_drafters_catch_up(target, monkeypatch):
    """What the decoder tells the controller a draft cost: the step's draft seconds minus the catch-up
    the drafter reports (a fake clock: every draft takes 1 s, 0.25 s of it catching up)."""
    import types

    import specdec.session as loop_module  # the step loop, whose clock the test fakes
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    class CatchingUp(PromptLookupDrafter):
        def catch_up_seconds(self) -> float:
            return 0.25

        def resume_seconds(self) -> float:
            return 0.125  # of which after a pause: the step's gain pays it

    ticks = iter(range(10**6))
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    dec = SpecDecoder(target, CatchingUp())
    seen = []
    update = dec.controller.update
    monkeypatch.setattr(dec.controller, "update", lambda *a, **k: (seen.append((a[3], k["resume"])), update(*a, **k)))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    out = dec.generate(ids, max_new_tokens=8)
    assert seen and all(t == (0.75, 0.125) for t in seen)  # 1 s of draft time per step, less the 0.25 s
    assert all(s.draft_time == 1.0 for s in out.steps[1:])  # the step's own figures are left whole
    assert torch.equal(out.sequences, hf_greedy(target, ids, 8))


def test_missing_features_are_an_error(target):
    d = EagleDrafter(target, _random_head(target))
    ids = torch.randint(0, 128, (1, 5))
    with pytest.raises(ValueError, match="needs the target's hidden states"):
        d.begin(Prompt(ids, torch.tensor([5])))
    d.begin(Prompt(ids[:, :1], torch.tensor([1])))  # one token: no feature needed, no draft yet
    assert d.propose(5).width == 0
    with pytest.raises(ValueError, match="Commit.hidden"):
        d.accept(Commit(torch.tensor([[3]]), torch.tensor([1]), torch.tensor([0])))


@pytest.mark.parametrize("seed", range(3))
def test_a_partly_accepted_head_is_lossless(seed):
    """Whole generations of trees the target accepts in part (a head that drafts the bigram's guess, on
    a target whose next token is mostly the bigram's and depends on the whole text: conftest's
    agreeing_eagle_head, bigram_llama): HF's greedy output at every period of the stores, for prompts
    of 1, 7 and 30 tokens. (A random head would be exact too, but with nothing accepted: so would a
    verifier that rejected every draft.)"""
    target = bigram_llama(seed, context=0.5)
    head = agreeing_eagle_head(target)
    ids = torch.randint(0, 128, (1, [1, 7, 30][seed]), generator=torch.Generator().manual_seed(seed))
    ref = hf_greedy(target, ids, 40)
    for period in (1, 3, 64):
        drafter = EagleDrafter(target, head, EagleConfig(total_tokens=10, depth=4, top_k=3, bmc=BMCConfig(period)))
        out = SpecDecoder(target, drafter, _decoder_config(period, 10)).generate(ids, max_new_tokens=40,
                                                                                eos_token_id=None)
        assert torch.equal(out.sequences, ref), f"seed {seed} T {period}"
        drafted = sum(sum(s.num_drafted) for s in out.steps)
        accepted = sum(sum(s.num_accepted) for s in out.steps)
        assert 0 < accepted < drafted, f"seed {seed} T {period}: {accepted} of {drafted} drafts accepted"


def test_save_load_and_eagle_export_round_trip(target, tmp_path):
    head = _random_head(target, seed=2)
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    toks, pos = torch.randint(0, 128, (1, 5)), torch.arange(5)[None]
    with torch.no_grad():
        want = head(x, toks, pos)
    with torch.no_grad():
        assert torch.equal(load_head(save_head(head, tmp_path / "ours"), target)(x, toks, pos), want)
    export_eagle(head, tmp_path / "eagle")
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} == names
    cfg = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True and cfg["hidden_size"] == 64
    with torch.no_grad():
        assert torch.equal(import_eagle(tmp_path / "eagle", target)(x, toks, pos), want)


def test_loading_a_head_for_another_target_is_refused(target, tmp_path):
    save_head(_random_head(target), tmp_path / "h")
    other = tiny_llama(0, vocab=96)
    with pytest.raises(ValueError, match="trained for another target: vocab_size 128"):
        load_head(tmp_path / "h", other)
    with pytest.raises(FileNotFoundError, match="no EAGLE head"):
        load_head(tmp_path / "nothing", target)


def test_reduced_draft_vocabulary_maps_back_to_target_ids(target, tmp_path):
    vocab = torch.arange(0, 128, 4)  # 32 draft tokens
    torch.manual_seed(0)
    head = EagleHead(target, draft_vocab=vocab)
    ids, hidden = _prompt_with_features(target)
    d = EagleDrafter(target, head, EagleConfig(total_tokens=12, depth=3, top_k=3))
    d.begin(Prompt(ids, torch.tensor([12]), hidden[:, :-1]))
    assert (d.propose(12).tokens % 4 == 0).all()
    again = load_head(save_head(head, tmp_path / "h"), target)
    assert torch.equal(again.draft_vocab, vocab)
    with pytest.warns(UserWarning, match="no reduced draft vocabulary"):
        export_eagle(head, tmp_path / "e")
    full = import_eagle(tmp_path / "e", target)
    assert full.draft_vocab is None
    assert torch.equal(full.fc.weight, head.fc.weight)
    ref = hf_greedy(target, ids, 30)
    out = SpecDecoder(target, d, _decoder_config(64, 12)).generate(ids, max_new_tokens=30, eos_token_id=None)
    assert torch.equal(out.sequences, ref)


def test_registry_eagle_needs_a_head(target, tmp_path, monkeypatch):
    from specdec.config import RuntimeConfig, use

    monkeypatch.setattr("specdec.drafters.eagle.PACKAGED_HEAD", tmp_path / "none")
    with pytest.raises(ValueError, match="specdec train-eagle"):
        make_drafter("eagle", target)
    save_head(_random_head(target), tmp_path / "h")
    with use(RuntimeConfig(eagle_head=tmp_path / "h")):  # SPECDEC_EAGLE_HEAD at the CLI
        assert isinstance(make_drafter("eagle", target), EagleDrafter)
    assert isinstance(make_eagle(target, tmp_path / "h"), EagleDrafter)


def test_a_ragged_batch_drafts_what_each_row_drafts_alone(target):
    """Batch rows with different prompt lengths and accepted counts (for batched verification
    later): the batched drafter proposes, per row, the trees of a drafter that sees that row only."""
    head = _random_head(target)
    g = torch.Generator().manual_seed(0)
    ids, lengths = torch.randint(0, 128, (2, 9), generator=g), [9, 6]
    with torch.no_grad():
        hid = torch.zeros(2, 9, 64, dtype=torch.float64)
        for b, n in enumerate(lengths):
            hid[b, :n] = target(ids[b : b + 1, :n], output_hidden_states=True).hidden_states[-1][0]
    cfg = EagleConfig(total_tokens=7, depth=3, top_k=2, bmc=BMCConfig(4))
    both = EagleDrafter(target, head, cfg)
    both.begin(Prompt(ids, torch.tensor(lengths), hid[:, :-1]))
    alone = [EagleDrafter(target, head, cfg) for _ in lengths]
    for b, (d, n) in enumerate(zip(alone, lengths)):
        d.begin(Prompt(ids[b : b + 1, :n], torch.tensor([n]), hid[b : b + 1, : n - 1]))
    for step in range(3):
        tree = both.propose(7)
        for b, d in enumerate(alone):
            one = d.propose(7)
            assert torch.equal(tree.tokens[b], one.tokens[0]) and torch.equal(tree.parents[b], one.parents[0])
        toks, new = torch.randint(0, 128, (2, 3), generator=g), torch.tensor([3, 1])
        feat = torch.randn(2, 3, 64, dtype=torch.float64, generator=g)
        both.accept(Commit(toks, new, new - 1, feat))
        for b, d in enumerate(alone):
            n = int(new[b])
            d.accept(Commit(toks[b : b + 1, :n], new[b : b + 1], new[b : b + 1] - 1, feat[b : b + 1, :n]))


def test_head_saved_in_bf16_loads_back_rounded_into_the_target_dtype(target, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    head = EagleHead(target, draft_vocab=torch.arange(0, 128, 2))
    d = save_head(head, tmp_path / "h", torch.bfloat16)
    stored = load_file(str(d / "eagle_head.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["draft_vocab"].dtype == torch.int64
    again = load_head(d, target)
    assert again.fc.weight.dtype == target.dtype
    assert torch.equal(again.fc.weight, head.fc.weight.to(torch.bfloat16).to(target.dtype))
    assert torch.equal(again.draft_vocab, head.draft_vocab)


@pytest.mark.parametrize("seed", range(3))
def test_eagle_with_prompt_lookup_is_lossless_and_uses_both(seed):
    """A prompt that repeats itself gives lookup matches; the random head drafts elsewhere."""
    target = tiny_llama(seed)
    head = _random_head(target, seed=seed + 20)
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 128, (1, 9), generator=g)
    ids = torch.cat([base, torch.randint(0, 128, (1, 3), generator=g), base[:, :4]], dim=1)
    ref = hf_greedy(target, ids, 40)
    for period in (1, 64):
        eagle = EagleDrafter(target, head, EagleConfig(total_tokens=6, depth=3, top_k=2, bmc=BMCConfig(period)))
        drafter = LookupHybridDrafter(eagle, config=HybridConfig(min_ngram=1))
        config = SpecDecoderConfig(bmc=BMCConfig(period), adaptive_period=False,
                                   draft_length=DraftLengthConfig(cost_aware=False))
        out = SpecDecoder(target, drafter, config).generate(ids, max_new_tokens=40, eos_token_id=None)
        assert torch.equal(out.sequences, ref), f"seed {seed} T {period}"
        assert drafter.drafts["lookup"] > 0 and drafter.drafts["other"] > 0, drafter.drafts


def test_hybrid_takes_lookup_after_a_long_enough_match(target):
    ids, hidden = _prompt_with_features(target, P=12)
    ids = torch.cat([ids, ids[:, 3:5]], dim=1)  # ends with a 2-gram seen at position 3
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    prompt = Prompt(ids, torch.tensor([ids.shape[1]]), hidden[:, :-1])
    for min_ngram, want in ((2, "lookup"), (3, "other")):
        eagle = EagleDrafter(target, _random_head(target), EagleConfig(total_tokens=4, depth=2, top_k=2))
        d = LookupHybridDrafter(eagle, config=HybridConfig(min_ngram=min_ngram))
        d.begin(prompt)
        assert d.draft_class() == (("lookup", 2) if want == "lookup" else ("other", None))
        assert d.own_tree(d.draft_class()) == (want != "lookup")  # lookup chains: the controller's length
        tree = d.propose(3)
        if want == "lookup":  # the chain that followed the 2-gram's first occurrence
            assert tree.tokens[0, :3].tolist() == ids[0, 5:8].tolist()
        assert d.drafts == {want: 1}
