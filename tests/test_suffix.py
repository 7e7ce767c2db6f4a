"""The suffix drafter: its index against brute force, its trees by hand, whole generations against HF
greedy decoding (trees with several branches, accepted in part)."""

import json
import random

import pytest
import torch

from conftest import hf_greedy, tiny_llama
from specdec import SpecDecoder, SpecDecoderConfig
from specdec.controller import DraftLengthConfig
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.suffix import (SEPARATOR, CorpusDoc, SuffixAutomaton, SuffixConfig, SuffixCorpus,
                                     SuffixDrafter, TreeLimits, expand_tree, match_bucket,
                                     read_text_corpus, read_token_jsonl, tree_limits)
from specdec.kv.bmc import BMCConfig
from specdec.registry import make_drafter


def _occurrences(text, s):
    return sum(1 for i in range(len(text) - len(s) + 1) if text[i: i + len(s)] == s)


def _longest_earlier_suffix(text):
    """Brute force: the longest suffix of text that also ends before its last token."""
    return max((L for L in range(1, len(text)) if _occurrences(text[:-1], text[-L:])), default=0)


def _prompt(*rows):
    P = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [0] * (P - len(r)) for r in rows])
    return Prompt(ids, torch.tensor([len(r) for r in rows]))


# --------------------------------------------------------------------------------------------------
# the index


@pytest.mark.parametrize("seed", range(3))
def test_longest_repeat_and_counts_match_brute_force_after_each_append(seed):
    rng = random.Random(seed)
    for _ in range(40):
        V = rng.choice([2, 3, 6])
        text = [rng.randrange(V) for _ in range(rng.randrange(1, 30))]
        sam = SuffixAutomaton()
        for i, t in enumerate(text):
            sam.extend(t)
            cur = text[: i + 1]
            state, matched = sam.longest_repeat()
            assert matched == _longest_earlier_suffix(cur)
            a = rng.randrange(len(cur))
            s = cur[a: rng.randrange(a, len(cur)) + 1]
            found, n = sam.match(s)
            assert n == len(s) and sam.count[found] == _occurrences(cur, s)
        assert sam.num_states <= max(2 * len(text), 2)  # linear in the text


def test_children_count_what_followed_the_context():
    sam = SuffixAutomaton([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    state, n = sam.match([1, 2])
    assert n == 2
    assert sorted((t, c) for t, c, _ in sam.children(state)) == [(3, 2), (4, 1)]


def test_corpus_match_is_the_longest_suffix_found_in_the_corpus():
    rng = random.Random(3)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    corpus = SuffixCorpus(CorpusDoc(tuple(d), 0) for d in docs)
    query = [rng.randrange(4) for _ in range(40)]
    state, matched = 0, 0
    for i, t in enumerate(query):
        state, matched = corpus.index.step(state, matched, t)
        cur = query[: i + 1]
        brute = max((L for L in range(1, len(cur) + 1) if any(_occurrences(d, cur[-L:]) for d in docs)), default=0)
        assert matched == brute  # separators keep matches inside one document
    assert all(t != SEPARATOR for t, _, _ in corpus.index.children(state))


def test_corpus_grows_without_rebuild():
    corpus = SuffixCorpus([CorpusDoc((1, 2, 3), 0)])
    index = corpus.index
    corpus.add([1, 2, 4])
    assert corpus.index is index and corpus.version == 1
    state, n = index.match([1, 2])
    assert n == 2 and sorted((t, c) for t, c, _ in index.children(state)) == [(3, 1), (4, 1)]


# --------------------------------------------------------------------------------------------------
# the math


def test_tree_grows_with_the_match_length():
    cfg = SuffixConfig()
    assert tree_limits(0, cfg) == TreeLimits(0, 0)
    assert tree_limits(1, cfg) == TreeLimits(2, 2)
    assert tree_limits(4, cfg) == TreeLimits(8, 5)
    assert tree_limits(8, cfg) == TreeLimits(16, 9)
    assert tree_limits(40, cfg) == TreeLimits(16, 16)
    assert tree_limits(1, SuffixConfig(min_match=2)) == TreeLimits(0, 0)
    assert [match_bucket(m) for m in (0, 1, 2, 3, 4, 7, 8, 15, 16, 99)] == [0, 1, 2, 3, 4, 4, 8, 8, 16, 16]


def _ranked(index):
    """A hand-made index's children as ``expand_tree`` takes them: (total count, best first)."""
    def children(key):
        kids = sorted(index[key], key=lambda k: (-k[1], k[0]))
        return sum(n for _, n, _ in kids), kids
    return children


def test_expansion_is_best_first_and_stops_at_min_prob_and_depth():
    # root -> 7 (x3) -> 8 (x2); root -> 9 (x1)
    index = _ranked({"r": [(9, 1, "b"), (7, 3, "a")], "a": [(8, 2, "c")], "b": [], "c": [(5, 1, "d")], "d": []})
    assert expand_tree(index, "r", TreeLimits(3, 2), 0.2) == ([7, 8, 9], [-1, 0, -1], [0.75, 0.75, 0.25])
    assert expand_tree(index, "r", TreeLimits(9, 9), 0.5)[0] == [7, 8, 5]  # 9 (.25) is too unlikely
    assert expand_tree(index, "r", TreeLimits(9, 1), 0.0)[0] == [7, 9]
    assert expand_tree(index, "r", TreeLimits(0, 5), 0.0)[0] == []


def _expand_every_child(sam, root, limits, min_prob):
    """Best-first over every child of every placed node (no order assumed, none left out): the reference."""
    import heapq
    out, heap = ([], [], []), []

    def push(state, parent, p_parent, depth):
        kids = sam.children(state)
        total = sum(n for _, n, _ in kids)
        for tok, n, child in kids:
            p = p_parent * (n / total)
            if p >= min_prob and p > 0:
                heapq.heappush(heap, (-p, -n, tok, parent, depth, child))

    if limits.nodes > 0 and limits.depth > 0:
        push(root, -1, 1.0, 1)
    while heap and len(out[0]) < limits.nodes:
        neg_p, _, tok, parent, depth, child = heapq.heappop(heap)
        for part, x in zip(out, (tok, parent, -neg_p)):
            part.append(x)
        if depth < limits.depth:
            push(child, len(out[0]) - 1, -neg_p, depth + 1)
    return out


def test_ranked_children_and_pruned_pushes_give_the_full_expansion():
    """``expand_tree`` pushes only a node's likeliest children (as many as nodes are left, above min_prob),
    from ``ranked``'s cached order: on random repetitive texts, growing between trees, every tree is the one
    best-first over all children gives."""
    rng = random.Random(5)
    for _ in range(60):
        sam = SuffixAutomaton()
        for _ in range(rng.randint(20, 300)):
            sam.extend(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, SEPARATOR]) if rng.random() < 0.9 else rng.randint(9, 40))
            if rng.random() < 0.1:
                state = rng.randrange(sam.num_states)
                limits, min_prob = TreeLimits(rng.randint(0, 16), rng.randint(0, 9)), rng.choice([0.0, 0.01, 0.1, 0.3])
                assert expand_tree(sam.ranked, state, limits, min_prob) == _expand_every_child(sam, state, limits,
                                                                                                min_prob)


def test_branching_text_gives_the_expected_tree():
    # after "9 1 2": 3 three times (then 4 twice, 7 once), 5 once (then 6); "1 2 3 4" is followed by 9
    text = [9, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 7, 9, 1, 2, 5, 6, 9, 1, 2]
    d = SuffixDrafter()
    d.begin(_prompt(text))
    assert d.draft_class() == ("local", 3)  # the match "9 1 2": 6 nodes, depth 4
    tree = d.propose(16)
    #  pending ── 3 (.75) ── 4 (.5) ── 9 (.5) ── 1 (.5)
    #         └── 5 (.25) ── 6 (.25)          7 (.25, under 3) does not fit the 6 nodes
    assert tree.tokens.tolist() == [[3, 4, 9, 1, 5, 6]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, -1, 4]]
    assert d.propose(2).tokens.tolist() == [[3, 4]]  # the decoder's cap keeps the best nodes


def test_text_without_repeats_drafts_nothing():
    d = SuffixDrafter()
    d.begin(_prompt([1, 2, 3, 4]))
    assert d.draft_class() == ("none", 0)
    assert int(d.propose(8).num_nodes[0]) == 0


def test_corpus_tree_is_used_where_the_text_has_no_match():
    d = SuffixDrafter.from_corpus([[5, 6, 7, 8, 9], [5, 6, 7, 10]])
    d.begin(_prompt([1, 2, 5, 6]))
    assert d.draft_class() == ("corpus", 2)
    tree = d.propose(8)
    assert tree.tokens[0, :2].tolist() == [7, 8] and tree.parents[0, :2].tolist() == [-1, 0]
    d.accept(Commit(torch.tensor([[7, 8]]), torch.tensor([2]), torch.tensor([1])))
    assert d.draft_class() == ("corpus", 4)  # the match follows the committed tokens
    assert d.propose(8).tokens[0].tolist() == [9]


def test_ragged_batch_and_select():
    d = SuffixDrafter()
    d.begin(_prompt([1, 2, 3, 1, 2], [4, 5, 6]))  # row 1 has no repeat
    tree = d.propose(8)
    assert tree.num_nodes.tolist() == [3, 0] and tree.tokens.shape == (2, 3)  # "1 2": 4 nodes, depth 3
    assert tree.tokens[0].tolist() == [3, 1, 2] and tree.parents[1].tolist() == [-1, -1, -1]  # padding
    d.accept(Commit(torch.tensor([[3, 0], [4, 5]]), torch.tensor([1, 2]), torch.tensor([0, 1])))
    d.select([1])  # row 0 finished
    tree = d.propose(8)
    assert tree.batch_size == 1 and tree.tokens[0].tolist() == [6, 4, 5]  # "4 5" was followed by "6 4 5"


# --------------------------------------------------------------------------------------------------
# corpus files


def test_token_jsonl_reader_names_a_malformed_line(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text('{"conv": 0, "prompt_len": 1, "ids": [1, 2, 3]}\n\n{"ids": [4, 5]}\n{"ids": "x"}\n')
    with pytest.raises(ValueError, match=r"answers.jsonl:4: not a token-id line"):
        read_token_jsonl(f)
    f.write_text('{"conv": 0, "prompt_len": 1, "ids": [1, 2, 3]}\n\n{"ids": [4, 5]}\n')
    assert read_token_jsonl(f) == [CorpusDoc((1, 2, 3), 1), CorpusDoc((4, 5), 0)]
    assert SuffixDrafter.from_file(f).corpus.num_tokens == 5


def test_text_corpus_needs_a_tokenizer(tmp_path):
    f = tmp_path / "earlier.txt"
    f.write_text("a b\n\nb c a\n")

    def tok(text, add_special_tokens=False):
        return {"input_ids": [ord(w) for w in text.split()]}

    assert read_text_corpus(f, tok) == [CorpusDoc((97, 98), 0), CorpusDoc((98, 99, 97), 0)]
    with pytest.raises(ValueError, match="plain text: a tokenizer is needed"):
        SuffixDrafter.from_file(f)
    with pytest.raises(FileNotFoundError, match="not found"):
        SuffixDrafter.from_file(tmp_path / "nope.jsonl")


def test_exclude_questions_drops_their_conversations():
    d = SuffixDrafter(corpus=SuffixCorpus([CorpusDoc((1, 2, 3, 9), 3), CorpusDoc((4, 5, 9), 2)]))
    words = {1: "What", 2: "is  2+2?", 3: "\n", 4: "Name", 5: "a colour", 9: "answer"}
    decode = lambda ids: " ".join(words[t] for t in ids)  # noqa: E731
    assert d.exclude_questions(["What is 2+2?", "not in the corpus"], decode) == 1
    assert [doc.ids for doc in d.corpus.docs] == [(4, 5, 9)]


def test_registry_builds_suffix_drafters(target):
    assert isinstance(make_drafter("suffix", target), SuffixDrafter)
    d = make_drafter("suffix-corpus", target)  # the index is built on first use, not here
    assert d.corpus is not None and len(d.corpus.docs) > 1000 and d.corpus._index is None


# --------------------------------------------------------------------------------------------------
# whole generations


class SpyDrafter(SuffixDrafter):
    """Records each proposed tree and the tokens committed after it."""

    def begin(self, prompt):
        super().begin(prompt)
        self.log = []

    def propose(self, budget):
        tree = super().propose(budget)
        self.log.append([tree, None])
        return tree

    def accept(self, commit):
        if self.log and self.log[-1][1] is None:
            self.log[-1][1] = commit.new_tokens(0)[:-1]  # the accepted drafts
        super().accept(commit)


def _config(period):
    # cost_aware off: the gate would otherwise depend on this machine's timings; skinny_rows 0: the
    # kernels' routes are test_lossless's subject, here it is the drafter's trees (and it is faster)
    return SpecDecoderConfig(bmc=BMCConfig(period), adaptive_period=False, draft_length=DraftLengthConfig(cost_aware=False),
                             skinny_rows=0)


def _tree_facts(tree, accepted):
    """(several branches, partly accepted, accepted off the first branch) of a batch-1 tree."""
    n = int(tree.num_nodes[0])
    parents, tokens = tree.parents[0, :n].tolist(), tree.tokens[0, :n].tolist()
    branches = len(parents) != len(set(parents))
    first = []  # the first-ranked chain: node 0, then each node's first child
    node = -1
    while node in parents:
        node = parents.index(node)
        first.append(tokens[node])
    return branches, 0 < len(accepted) < n, bool(accepted) and accepted != first[: len(accepted)]


def test_generations_equal_hf_greedy_with_branching_trees_partly_accepted():
    facts = []
    runs = 0
    for seed in range(8):
        target = tiny_llama(seed, vocab=64 if seed % 2 else 128)
        V = target.config.vocab_size
        g = torch.Generator().manual_seed(500 + seed)
        base = torch.randint(0, V, (1, 6 + seed), generator=g)
        # repetitive: a phrase repeated with variations, so contexts are followed by several tokens
        variant = base.clone()
        variant[0, -1] = (variant[0, -1] + 1) % V
        repetitive = torch.cat([base, variant, base, base[:, : 3 + seed % 3]], dim=1)
        random_ids = torch.randint(0, V, (1, 5 + 2 * seed), generator=g)
        refs = {id(ids): hf_greedy(target, ids, 32) for ids in (repetitive, random_ids)}
        # corpus: the target's own answers with every sixth token changed (partly right), plus noise
        corpus = [[(t + 1) % V if i % 6 == 5 else t for i, t in enumerate(ref[0].tolist())] for ref in refs.values()]
        corpus.append(torch.randint(0, V, (60,), generator=g).tolist())
        cases = ((repetitive, False, 4), (repetitive, True, 64), (random_ids, True, 16))
        for ids, with_corpus, period in cases:
            ref = refs[id(ids)]
            drafter = SpyDrafter.from_corpus(corpus) if with_corpus else SpyDrafter()
            out = SpecDecoder(target, drafter, _config(period)).generate(ids, max_new_tokens=32, eos_token_id=None)
            assert torch.equal(out.sequences, ref), f"seed {seed} corpus {with_corpus} prompt {ids.shape[1]}"
            facts += [_tree_facts(t, a) for t, a in drafter.log if a is not None]
            runs += 1
    assert runs == 24
    assert sum(f[0] for f in facts) >= 10, "too few trees with several branches"
    assert sum(f[1] for f in facts) >= 10, "too few drafts accepted in part"
    assert sum(f[2] for f in facts) >= 1, "no accepted path left the first branch"


def test_remembered_answer_makes_the_second_ask_faster():
    target = tiny_llama(3)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    drafter = SuffixDrafter()
    first = SpecDecoder(target, drafter, _config(16)).generate(ids, max_new_tokens=40, eos_token_id=None)
    drafter.remember(first.sequences[0].tolist(), prompt_len=12)
    second = SpecDecoder(target, drafter, _config(16)).generate(ids, max_new_tokens=40, eos_token_id=None)
    assert torch.equal(second.sequences, first.sequences)
    assert torch.equal(first.sequences, hf_greedy(target, ids, 40))
    assert len(second.steps) <= 6 < len(first.steps)  # ~10 tokens per step from the remembered answer


# --------------------------------------------------------------------------------------------------
# replay on stored answers (no model)


def test_replay_of_a_remembered_answer_accepts_whole_trees():
    from specdec.bench.replay import replay

    prompt, answer = [1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    cold = replay(SuffixDrafter(), prompt, answer)
    assert (cold.tokens, cold.steps, cold.nodes) == (10, 10, 0)  # nothing repeats: one token a step
    warm = SuffixDrafter()
    warm.remember(prompt + answer, len(prompt))
    st = replay(warm, prompt, answer)
    # prefill gives 7; "1 2 3 7" matches (4 tokens: 8 nodes, depth 5): 8-12 accepted + 13; then the
    # rest (14, 15 + 16) in one more step
    assert st.steps == 3 and st.tau == pytest.approx(10 / 3)


def test_a_replay_prices_each_step_by_the_verify_curve():
    from specdec.bench.replay import _ranges, replay, step_cost

    curve = {1: 1.0, 8: 1.28, 16: 1.6}
    assert step_cost(curve, 1) == 1.0 and step_cost(curve, 8) == 1.28
    assert step_cost(curve, 4) == pytest.approx(1.12) and step_cost(curve, 12) == pytest.approx(1.44)
    assert step_cost(curve, 40) == 1.6  # flat past the last size
    prompt, answer = [1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    warm = SuffixDrafter()
    warm.remember(prompt + answer, len(prompt))
    st = replay(warm, prompt, answer, curve=curve)
    # the prefill (1), a step over 1 + 5 nodes (one remembered chain, depth 5), a step over 1 + 2 (the
    # rest: 14, 15 drafted, 16 the bonus)
    assert (st.steps, st.nodes) == (3, 7) and st.cost == pytest.approx(1.0 + step_cost(curve, 6) + step_cost(curve, 3))
    assert replay(SuffixDrafter(), prompt, answer).cost == 0.0  # no curve, no price
    assert _ranges("all", 3) == [0, 1, 2] and _ranges("1-2,5", 9) == [1, 2, 5]


@pytest.mark.parametrize("curve", ["1:1,8", "a:1", "0:1", "1:0", "missing.json"])
def test_a_malformed_verify_curve_is_named(curve, capsys):
    from specdec.bench.replay import main

    with pytest.raises(SystemExit):
        main(["--verify-curve", curve])
    assert "--verify-curve" in capsys.readouterr().err


def test_a_verify_curve_reads_bench_verify_json(tmp_path):
    from specdec.bench.replay import read_curve

    f = tmp_path / "curve.json"
    f.write_text(json.dumps({"in_decoder": True, "seconds": {"1": 0.02, "2": 0.02, "8": 0.03}}))
    assert read_curve(str(f)) == pytest.approx({1: 1.0, 2: 1.0, 8: 1.5})
    for bad in ({"seconds": {"2": 0.02}}, [0.02, 0.03]):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="1-row"):
            read_curve(str(f))


@pytest.mark.parametrize("argv, named", [(["--settings", "controller"], "--verify-curve"),
                                         (["--settings", "m=3"], "--settings"),
                                         (["--drafters", "eagle"], "--drafters")])
def test_replay_arguments_are_checked(argv, named, capsys):
    from specdec.bench.replay import main

    with pytest.raises(SystemExit):
        main(argv)
    assert named in capsys.readouterr().err


def test_a_replayed_controller_stops_drafting_what_does_not_pay():
    """The corpus says 7 is followed by 8, 9; in the answer every other token is a 7 followed by
    something else, and a verify row costs 2 plain steps: a fixed budget verifies the 2-node corpus
    tree after every 7 (5 steps' time), the controller (the decoder's own sizing and learning, shared
    through draft_step / learn_step) closes the class's gate after its first measured drafts."""
    from specdec.bench.runner import fixed_setting
    from specdec.bench.replay import replay
    from specdec.controller import DraftLengthConfig, DraftLengthController

    prompt = [1, 2, 3]
    answer = [7] + [t for x in range(11, 71) for t in (x, 7)]  # 7 11 7 12 7 ...: never 7 8
    curve = {1: 1.0, 2: 3.0, 17: 33.0}

    def run(config):
        d = SuffixDrafter()
        d.remember([5, 6, 7, 8, 9, 10], 0)
        return replay(d, prompt, answer, curve=curve, controller=DraftLengthController(config))

    fixed, ctrl = run(fixed_setting("n=8").draft_length), run(DraftLengthConfig())
    assert fixed.tau == pytest.approx(1.0) and ctrl.tau == pytest.approx(1.0)  # nothing is ever accepted
    assert fixed.nodes > 0 and ctrl.nodes < fixed.nodes
    assert ctrl.cost / ctrl.tokens < 0.5 * fixed.cost / fixed.tokens
    with pytest.raises(ValueError, match="verify curve"):
        replay(SuffixDrafter(), prompt, answer, controller=DraftLengthController())


def test_bench_repeat_pass_two_drafts_from_remembered_answers(target, tmp_path):
    from specdec.bench.generation import Method, run_bench, specdec_method
    from specdec.bench.questions import Question

    class Tok:  # characters as token ids, enough for run_bench
        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])}

        def apply_chat_template(self, messages, **kwargs):
            return self(messages[0]["content"])

    def plain(ids, n):
        return hf_greedy(target, ids, n), None

    questions = [Question(1, "writing", ("Tell me about gardens.",)), Question(2, "math", ("What is two and two?",))]
    methods = [Method("hf", plain), specdec_method(target, "suffix", None)]
    answers = tmp_path / "answers.jsonl"
    collected = []  # what a peer's replies are compared with: the same records as the file's
    records = run_bench(target, Tok(), questions, methods, 24, None, passes=2, remember=True, answers_path=answers,
                        answers=collected)
    assert len(records) == 8 and all(r["identical"] for r in records)
    steps = {(r["pass"], r["question_id"]): r["steps"] for r in records if r["method"] == "specdec:suffix"}
    assert all(steps[(2, q)] < steps[(1, q)] for q in (1, 2))  # the second ask reuses the first answer
    # the first pass's reference outputs, as token ids the replay reads: one per question, HF's own
    from specdec.drafters.suffix import read_token_jsonl

    saved = read_token_jsonl(answers)
    assert len(saved) == 2 and [json.loads(line) for line in answers.read_text().splitlines()] == collected
    for doc, q in zip(saved, questions):
        prompt = Tok()(q.turns[0])["input_ids"]
        assert doc.prompt_len == prompt.shape[1]
        assert list(doc.ids) == hf_greedy(target, prompt, 24)[0].tolist()


def test_suffix_corpus_without_stored_answers_says_so(monkeypatch, tmp_path):
    import specdec.drafters.suffix as suffix

    monkeypatch.setattr(suffix, "default_answers_path", lambda: tmp_path / "eagle_answers.jsonl")
    with pytest.raises(FileNotFoundError, match="eagle_answers.jsonl not found: suffix-corpus needs"):
        SuffixDrafter.from_stored_answers()
