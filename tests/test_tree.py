"""Token trees: hand-built verification tables, tree shapes and their networkx export, the BMC commit
of a non-prefix path, and losslessness of whole generations with random trees."""

import random

import pytest
import torch
from transformers import DynamicCache

from conftest import hf_greedy, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters.base import Commit, Drafter, Prompt, TokenHistory
from specdec.forward import cache_arg, forward_block
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.tree import DraftTree, ancestor_mask, node_depths, path_along, path_to, position_ids
from specdec.verifiers.tree import _walk_host, _walk_tensors, accepted_mask, verify_greedy


def _logits(next_tokens, vocab=16):
    """Logits [B, Q, V] whose argmax at row q of batch row b is next_tokens[b][q]."""
    nt = torch.tensor(next_tokens)
    x = torch.zeros(*nt.shape, vocab)
    x.scatter_(2, nt[..., None], 1.0)
    return x


def _tree(tokens, parents, num_nodes=None):
    t = torch.tensor(tokens, dtype=torch.long).reshape(len(tokens), -1)
    p = torch.tensor(parents, dtype=torch.long).reshape(t.shape)
    n = torch.tensor(num_nodes if num_nodes is not None else [t.shape[1]] * t.shape[0])
    return DraftTree(t, p, n)


# The tree of the examples: pending ── 5 ── 7          nodes 0, 1
#                                  └── 6 ── 8 ── 9     nodes 2, 3, 4
#                                       └── 3          node 5
TOKENS = [5, 7, 6, 8, 9, 3]
PARENTS = [-1, 0, -1, 2, 3, 2]


_TABLE = [
    # target_next[q]: the target's token after block row q (0 = pending, 1 + i = node i)
    ("all along the deepest path", [6, 0, 0, 8, 9, 4, 0], [0, 0, 1, 1, 1, 0], [2, 3, 4], 4),
    ("none accepted", [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [], 1),
    ("early mismatch", [5, 2, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0], 2),
    ("second child taken", [6, 7, 0, 3, 9, 0, 0], [0, 0, 1, 0, 0, 1], [2, 5], 0),
    ("first branch to its leaf", [5, 7, 11, 8, 9, 4, 0], [1, 1, 0, 0, 0, 0], [0, 1], 11),
]
_TABLE = [pytest.param(*case) for case in _TABLE]


@pytest.mark.parametrize("case,target_next,ok,accepted,bonus", _TABLE)
def test_verification_table(case, target_next, ok, accepted, bonus):
    tree = _tree([TOKENS], [PARENTS])
    assert accepted_mask(torch.tensor([target_next]), tree).int().tolist() == [ok], case
    ver = verify_greedy(_logits([target_next]), tree)
    assert ver.num_accepted.tolist() == [len(accepted)], case
    assert ver.accepted[0, : len(accepted)].tolist() == accepted, case
    assert ver.next_token.tolist() == [bonus], case
    assert ver.kept_rows() == [[0] + [a + 1 for a in accepted]], case


def test_a_tree_scored_against_the_committed_text_keeps_what_the_verifier_keeps():
    """path_along (how auto scores a shadow draft, never verified) against the tokens a greedy
    verify commits (its accepted path's tokens, then the bonus token) is that verify's accepted path,
    and against a prefix of them, a prefix of it; on the table's cases and 3,000 random trees
    (siblings hold different tokens, as every drafter's do; 4 of them, so the target agrees often)."""
    rng = random.Random(11)
    cases = [(TOKENS, PARENTS, next_) for _, next_, *_ in [c.values for c in _TABLE]]
    for _ in range(3000):
        tokens, parents = [], []
        for _ in range(rng.randint(1, 12)):
            p = rng.randint(-1, len(tokens) - 1)
            free = sorted(set(range(4)) - {t for t, q in zip(tokens, parents) if q == p})
            if free:
                tokens.append(rng.choice(free))
                parents.append(p)
        cases.append((tokens, parents, [rng.randrange(4) for _ in range(len(tokens) + 1)]))
    for tokens, parents, target_next in cases:
        ver = verify_greedy(_logits([target_next], vocab=16), _tree([tokens], [parents]))
        accepted = ver.accepted[0, : int(ver.num_accepted[0])].tolist()
        text = [tokens[a] for a in accepted] + ver.next_token.tolist()
        assert path_along(parents, tokens, text) == accepted, (tokens, parents, target_next)
        for j in range(len(text)):
            assert path_along(parents, tokens, text[:j]) == accepted[:j]


def test_the_host_walk_and_the_tensor_walk_give_the_same_verdict():
    """The verdict's two implementations (a loop over each row's nodes on the host; tensor ops where the
    logits live elsewhere) agree on 3,000 random ragged batches: trees of 0-12 real nodes, siblings that may
    repeat a token (two agreeing nodes at one depth: the first is kept), targets that agree often."""
    rng = random.Random(5)
    for _ in range(3000):
        B, N = rng.randint(1, 4), rng.randint(0, 12)
        tokens = [[rng.randrange(3) for _ in range(N)] for _ in range(B)]
        parents = [[rng.randint(-1, i - 1) for i in range(N)] for _ in range(B)]
        tree = _tree(tokens, parents, [rng.randint(0, N) for _ in range(B)]) if N else DraftTree.empty(B)
        target_next = torch.tensor([[rng.randrange(3) for _ in range(N + 1)] for _ in range(B)])
        host, tensors = _walk_host(target_next, tree), _walk_tensors(target_next, tree)
        for field in ("accepted", "num_accepted", "next_token"):
            a, b = getattr(host, field), getattr(tensors, field)
            assert a.dtype == b.dtype == torch.long and torch.equal(a, b), (field, tokens, parents, target_next)


def test_ragged_rows_accept_their_own_count_and_never_padding():
    # row 0: full tree; row 1: only 2 real nodes, the rest padding that the target would "agree" with
    tree = _tree([TOKENS, TOKENS], [PARENTS, PARENTS], num_nodes=[6, 2])
    target_next = [[6, 0, 0, 8, 9, 4, 0], [5, 7, 6, 8, 9, 4, 0]]
    ver = verify_greedy(_logits(target_next), tree)
    assert ver.num_accepted.tolist() == [3, 2]
    assert ver.accepted.tolist() == [[2, 3, 4], [0, 1, -1]]
    assert ver.next_token.tolist() == [4, 6]
    assert ver.kept_rows() == [[0, 3, 4, 5], [0, 1, 2]]


def test_padding_node_matching_is_not_accepted():
    tree = _tree([TOKENS], [PARENTS], num_nodes=[2])
    ver = verify_greedy(_logits([[6, 0, 0, 8, 9, 4, 0]]), tree)  # node 2 (padding) would match
    assert ver.num_accepted.tolist() == [0] and ver.next_token.tolist() == [6]


def test_empty_tree_is_plain_decoding():
    ver = verify_greedy(_logits([[9], [4]]), DraftTree.empty(2))
    assert ver.num_accepted.tolist() == [0, 0]
    assert ver.next_token.tolist() == [9, 4]
    assert ver.kept_rows() == [[0], [0]]


def test_verifier_rejects_a_block_of_the_wrong_size():
    with pytest.raises(AssertionError, match="logits for 3 rows, tree has 6 nodes"):
        verify_greedy(_logits([[1, 2, 3]]), _tree([TOKENS], [PARENTS]))


# ---------------------------------------------------------------------------------------- shapes

def test_depths_positions_paths_and_mask_of_the_example():
    p = torch.tensor([PARENTS])
    assert node_depths(p).tolist() == [[1, 2, 1, 2, 3, 2]]
    assert position_ids(p, torch.tensor([10])).tolist() == [[10, 11, 12, 11, 12, 13, 12]]
    assert path_to(p[0], 4) == [2, 3, 4] and path_to(p[0], 1) == [0, 1] and path_to(p[0], -1) == []
    m = ancestor_mask(p)[0].int()
    assert m[5].tolist() == [1, 0, 0, 1, 1, 1, 0]  # node 4 sees pending, 2, 3 and itself
    assert m[6].tolist() == [1, 0, 0, 1, 0, 0, 1]  # node 5 sees pending, 2 and itself


def test_a_row_exports_to_networkx_with_its_tokens_depths_ranks_and_probabilities():
    """Row 1 of a batch of two: its real nodes only (padding cut), the pending token as node -1,
    parent -> child edges, and the drafter's probability of each node's token."""
    import networkx as nx

    probs = torch.zeros(2, 6, 16)
    probs[1, torch.arange(6), torch.tensor(TOKENS)] = torch.tensor([0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    tree = DraftTree(torch.tensor([[1] * 6, TOKENS]), torch.tensor([[-1] * 6, PARENTS]), torch.tensor([2, 6]), probs)
    g = tree.to_networkx(1, decode=lambda t: f"<{t}>")
    assert sorted(g.edges) == sorted([(-1, 0), (0, 1), (-1, 2), (2, 3), (3, 4), (2, 5)])
    assert [g.nodes[i]["token"] for i in range(6)] == TOKENS and g.nodes[-1]["depth"] == 0
    assert [g.nodes[i]["depth"] for i in range(6)] == [1, 2, 1, 2, 3, 2]
    assert [g.nodes[i]["rank"] for i in range(6)] == [0, 0, 1, 0, 0, 1]
    assert g.nodes[4]["prob"] == pytest.approx(0.1) and g.nodes[4]["text"] == "<9>"
    assert nx.is_arborescence(g) and nx.dag_longest_path(g) == [-1, 2, 3, 4]  # pending -> 6 -> 8 -> 9
    first = tree.to_networkx(0)  # two real nodes, no text without decode
    assert sorted(first.nodes) == [-1, 0, 1] and "text" not in first.nodes[0] and first.graph["row"] == 0


# ------------------------------------------------------------------------- BMC with tree blocks

@pytest.mark.parametrize("period", [1, 3, 64])
def test_commit_of_a_non_prefix_path_matches_a_fresh_forward(period):
    """Verify a tree block, commit the path 1 -> 3 -> 4 (block rows 0, 2, 4, 5: not a prefix), then
    decode one more token: the logits equal a DynamicCache forward over the committed text.
    Float64 throughout; 1e-9 absolute is ~1e6 x the rounding noise and far below any real bug."""
    target = tiny_llama(3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, 11), generator=g)
    tokens = torch.randint(0, 128, (1, 5), generator=g)
    parents = torch.tensor([[-1, -1, 1, 1, 3]])
    cache = BMCCache.for_model(target, 1, BMCConfig(period))
    P = ids.shape[1]
    forward_block(target, cache, ids[:, :-1], torch.ones(1, P - 1, P - 1).bool().tril(),
                  torch.arange(P - 1)[None])
    cache.commit([list(range(P - 1))])
    block = torch.cat([ids[:, -1:], tokens], dim=1)
    depth = torch.cat([torch.zeros(1, 1, dtype=torch.long), node_depths(parents)], 1)
    out = forward_block(target, cache, block, ancestor_mask(parents), depth)
    cache.commit([[0, 2, 4, 5]])
    committed = torch.cat([ids, tokens[:, [1, 3, 4]]], dim=1)  # [1, P + 3]
    nxt = torch.tensor([[17]])
    step = forward_block(target, cache, nxt, torch.ones(1, 1, 1).bool(), torch.zeros(1, 1, dtype=torch.long))
    with torch.no_grad():
        ref = target(torch.cat([committed, nxt], 1), **{cache_arg(target): DynamicCache()}).logits
    assert cache.lengths == [P + 3]  # P - 1 prefilled + pending + 3 path nodes
    torch.testing.assert_close(out.logits[0, [0, 2, 4, 5]], ref[0, P - 1 : P + 3], atol=1e-9, rtol=0)
    torch.testing.assert_close(step.logits[0, -1], ref[0, -1], atol=1e-9, rtol=0)


# -------------------------------------------------------------- losslessness with random trees

class RandomTreeDrafter(Drafter):
    """Random tree shapes; one random root path follows the target's true greedy continuation for a
    random number of levels (when ``truth`` is given), every other node is a random token, distinct
    among siblings (the verifier's assumption)."""

    def __init__(self, truth: list[int] | None, vocab: int, seed: int) -> None:
        self.truth = truth
        self.vocab_size = vocab
        self.rng = random.Random(seed)
        self.history: TokenHistory | None = None

    def begin(self, prompt: Prompt) -> None:
        self.history = TokenHistory(prompt)

    def propose(self, budget: int) -> DraftTree:
        rng = self.rng
        n = rng.randint(0, budget)
        if n == 0:
            return DraftTree.empty(1)
        shape = rng.choice(["bushy", "deep", "any"])
        parents = []
        for i in range(n):
            lo = {"bushy": -1, "deep": max(-1, i - 2), "any": -1}[shape]
            parents.append(rng.randint(lo, i - 1))
        tokens = [None] * n
        if self.truth is not None:
            c = len(self.history.rows[0])  # committed tokens, the pending one included
            path = path_to(torch.tensor(parents), rng.randrange(n))
            for d, node in enumerate(path[: rng.randint(0, len(path))]):
                if c + d < len(self.truth):
                    tokens[node] = self.truth[c + d]
        for i in range(n):
            if tokens[i] is None:
                taken = {tokens[j] for j in range(n) if parents[j] == parents[i] and j != i}
                tokens[i] = rng.choice([t for t in range(self.vocab_size) if t not in taken])
        return DraftTree(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([n]))

    def accept(self, commit: Commit) -> None:
        self.history.extend(commit)


def _tree_config(period: int, nodes: int) -> SpecDecoderConfig:
    return SpecDecoderConfig(bmc=BMCConfig(period), draft_length=DraftLengthConfig(
        initial=nodes, maximum=nodes, adaptive=False, cost_aware=False))


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_are_lossless(seed):
    target = tiny_llama(seed)
    g = torch.Generator().manual_seed(200 + seed)
    ids = torch.randint(0, 128, (1, [1, 4, 9, 17, 30, 50][seed]), generator=g)
    new = 40
    ref = hf_greedy(target, ids, new)
    truth = ref[0].tolist()
    for period in (1, 3, 64):
        for with_truth in (True, False):
            drafter = RandomTreeDrafter(truth if with_truth else None, 128, seed * 10 + period)
            out = SpecDecoder(target, drafter, _tree_config(period, 12)).generate(
                ids, max_new_tokens=new, eos_token_id=None)
            assert torch.equal(out.sequences, ref), f"seed {seed} T {period} truth {with_truth}"
            if with_truth:
                assert out.mean_accepted_tokens > 1.3, out.mean_accepted_tokens
                assert any(d > 0 and 0 < a < d for s in out.steps for d, a in
                           zip(s.num_drafted, s.num_accepted))  # partial acceptance happened


def test_real_nodes_cut_each_row_at_its_node_count():
    t = DraftTree(torch.tensor([[5, 6], [7, 0]]), torch.tensor([[-1, 0], [-1, -1]]), torch.tensor([2, 1]))
    assert t.real_nodes() == ([[-1, 0], [-1]], [[5, 6], [7]])
    assert DraftTree.empty(2).real_nodes() == ([[], []], [[], []])
