"""Constraints, penalties, biases and logprobs under speculation (specdec.processing): greedy outputs
token-identical between plain decoding and every drafter, alone and in ragged batches; plain decoding
equal to HF's own processors where HF has them; sampling distributed as the processed target; the
grammar's state following the accepted path only; logprobs equal to plain decoding's."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.bench.device.tiny import peaked, perturbed, tiny_llama, tiny_tokenizer
from specdec.bench.distribution import pair_mismatch
from specdec.config import RuntimeConfig
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoder, SpecDecoderConfig
from specdec.drafters.base import Capabilities, Drafter
from specdec.drafters.chooser import Sources
from specdec.drafters.grammar import GrammarDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.drafters.self_spec import StreamingDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.judging import constrain
from specdec.processing import Constraint, ConstraintError, Processing, RowProcessor, Vocabulary
from specdec.sampling import SamplingParams, target_probs
from specdec.tree import DraftTree

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "the", "on"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": Constraint.json_schema(SCHEMA),
    "json_object": Constraint.json_object(),
    "regex": Constraint.regex(r"(the|a) [a-z]{1,6}( (on|in) (the|a) [a-z]{2,5})*\."),
    "lark": Constraint.lark('start: item ("," item)*\nitem: /[a-e]+/ | "the"'),
    "gbnf": Constraint.gbnf('root ::= "yes" | "no" | "maybe " [0-9]+'),
}
EOS = 256
# drafts sized without timings (repeatable); no kernel self-check: the float64 models never use the kernels
CONFIG = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False), runtime=RuntimeConfig(calibrate=False))


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    m = tiny_llama(3, vocab=len(tok))
    m.generation_config.eos_token_id = EOS
    return m


@pytest.fixture(scope="module")
def vocab(tok):
    return Vocabulary.of(tok, len(tok), [EOS])


def prompts(tok) -> list[torch.Tensor]:
    texts = ["the cat is on the mat", "a", "name: Bob, age 12, tags: the, on"]
    return [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


class Oracle(Drafter):
    """Drafts the reference answer's next tokens, with a wrong (often grammar-allowed) token swapped in
    at a random depth: drafts that are accepted part of the way, and grammar states walked deeper than
    what is committed (the rollback)."""

    capabilities = Capabilities(batches=True)

    def __init__(self, answers: list[list[int]], swaps: list[int], seed: int = 0) -> None:
        self.answers, self.swaps, self.rng = answers, swaps, random.Random(seed)

    def begin(self, prompt) -> None:
        self.rows = list(range(len(prompt.lengths)))
        self.done = [0] * len(self.rows)

    def propose(self, budget: int) -> DraftTree:
        chains = []
        for b, r in zip(range(len(self.rows)), self.rows):
            chain = self.answers[r][self.done[b]: self.done[b] + budget]
            if chain and self.rng.random() < 0.7:
                chain = list(chain)
                chain[self.rng.randrange(len(chain))] = self.rng.choice(self.swaps)
            chains.append(chain)
        return DraftTree.chains(chains)

    def accept(self, commit) -> None:
        for b in range(len(self.rows)):
            self.done[b] += int(commit.num_new[b])

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self.done = [self.done[b] for b in rows]


def _eagle(model):
    """An EAGLE drafter with a random head: dynamic trees of 10 nodes, siblings and depth, mostly refused."""
    from specdec.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, EagleHeadConfig

    torch.manual_seed(1)
    return EagleDrafter(model, EagleHead(model, EagleHeadConfig()), EagleConfig(total_tokens=10, depth=4, top_k=3))


def drafters(model):
    return {
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "model": lambda: ModelDrafter(perturbed(model, 0.05)),
        "suffix": lambda: SuffixDrafter(),
        "streaming": lambda: StreamingDrafter(model, budget=16, sink=2),
        "grammar": lambda: GrammarDrafter(),
        "eagle": lambda: _eagle(model),
        "grammar+model": lambda: Sources({"grammar": GrammarDrafter(), "model": ModelDrafter(perturbed(model, 0.05))}),
    }


def run(model, drafter, ps, **kw):
    decoder = SpecDecoder(model, drafter, CONFIG)
    return decoder.generate(ps, max_new_tokens=kw.pop("max_new_tokens", 40), **kw)


def answers(out, n: int) -> list[list[int]]:
    return [out.generated(b).tolist() for b in range(n)]


OPTIONS = {
    "constraint": lambda c: dict(constraint=c),
    "penalties": lambda c: dict(constraint=c, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4,
                                logit_bias={101: 2.5, 116: -1.0, EOS: -3.0}),
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("opts", list(OPTIONS))
def test_greedy_token_identical_for_every_drafter_alone_and_ragged(model, tok, kind, opts):
    ps = prompts(tok)
    kw = OPTIONS[opts](CONSTRAINTS[kind]) | dict(tokenizer=tok, logprobs=2)
    ref = run(model, None, ps, **kw)
    ref_alone = [run(model, None, [p], **kw) for p in ps]
    for b in range(len(ps)):  # a batch row is its prompt alone
        assert ref.generated(b).tolist() == ref_alone[b].generated(0).tolist()
    grammar = CONSTRAINTS[kind].compile(Vocabulary.of(tok, len(tok), [EOS]))
    for b in range(len(ps)):  # every answer the grammar's: each token allowed where it came
        st = grammar.start()
        for t in ref.generated(b).tolist():
            assert bool(st.allowed()[t]), f"row {b}: token {t} outside the grammar"
            st.consume([t])
    every = (kind, opts) in (("json_schema", "penalties"), ("regex", "constraint"))  # the rest: two drafters
    for name, make in drafters(model).items():
        if not every and name not in ("suffix", "grammar+model"):
            continue
        batch = run(model, make(), ps, **kw)
        assert answers(batch, 3) == answers(ref, 3), f"{name}, batch"
        one = run(model, make(), [ps[0]], **kw)
        assert one.generated(0).tolist() == ref.generated(0).tolist(), f"{name}, alone"
        for b in range(3):
            got, want = batch.logprobs[b], ref.logprobs[b]
            assert [x.token for x in got] == ref.generated(b).tolist()
            assert max(abs(x.logprob - y.logprob) for x, y in zip(got, want)) < 1e-6, name
            assert [t for t, _ in got[-1].top] == [t for t, _ in want[-1].top]


def test_rows_a_grammar_forces_skip_the_output_layer_and_change_nothing(model, tok, monkeypatch):
    """Rows where the grammar allows one token leave the output layer out (their logits unread): the same
    tokens and logprobs as with every row's logits computed, plain and drafting, greedy and sampled."""
    import specdec.session as session

    skipped, real = [], session.unread_rows
    monkeypatch.setattr(session, "unread_rows", lambda m, w: skipped.append(r := real(m, w)) or r)
    ps = prompts(tok)
    for drafter in (None, GrammarDrafter):
        for sampled in (False, True):
            kw = dict(constraint=CONSTRAINTS["json_schema"], tokenizer=tok, logprobs=2, frequency_penalty=0.4)
            if sampled:
                kw |= dict(do_sample=True, temperature=0.8, seed=5)
            skipped.clear()
            out = run(model, drafter and Sources({"grammar": drafter(), "lookup": PromptLookupDrafter()}), ps, **kw)
            assert any(r is not None and bool(r.any()) for r in skipped)  # some rows were forced
            monkeypatch.setattr(session, "unread_rows", lambda m, w: None)
            full = run(model, drafter and Sources({"grammar": drafter(), "lookup": PromptLookupDrafter()}), ps, **kw)
            monkeypatch.setattr(session, "unread_rows", lambda m, w: skipped.append(r := real(m, w)) or r)
            assert answers(out, 3) == answers(full, 3), (drafter, sampled)
            for b in range(3):
                assert [(x.token, x.logprob) for x in out.logprobs[b]] == [(x.token, x.logprob) for x in full.logprobs[b]]


def test_partly_accepted_drafts_roll_the_grammar_back(model, tok):
    """The oracle's drafts are right up to a swapped token: the grammar walks past what is committed
    in every such draft, and the output stays the plain one, inside the grammar."""
    ps = prompts(tok)
    for kind in ("json_schema", "regex"):
        kw = dict(constraint=CONSTRAINTS[kind], tokenizer=tok, frequency_penalty=0.3)
        ref = run(model, None, ps, **kw)
        swaps = [t for a in answers(ref, 3) for t in a]  # tokens the grammar allows somewhere
        oracle = Oracle(answers(ref, 3), swaps)
        out = run(model, oracle, ps, **kw)
        assert answers(out, 3) == answers(ref, 3), kind
        partial = [(d, a) for s in out.steps for d, a in zip(s.num_drafted, s.num_accepted) if 0 < a < d]
        assert partial, f"{kind}: no draft was accepted part of the way"


def test_plain_decoding_equals_hf_with_hf_processors(model, tok):
    """repetition_penalty and logit_bias (HF's SequenceBiasLogitsProcessor) as HF applies them; the grammar
    as an HF logits processor driven by llguidance token by token."""
    p = prompts(tok)[0]
    out = run(model, None, [p], repetition_penalty=1.5, logit_bias={101: 4.0, 32: -2.0}, max_new_tokens=30,
              eos_token_id=EOS)
    hf = model.generate(p[None], max_new_tokens=30, do_sample=False, repetition_penalty=1.5,
                        sequence_bias={(101,): 4.0, (32,): -2.0}, eos_token_id=EOS, pad_token_id=0)
    assert out.generated(0).tolist() == hf[0, len(p):].tolist()

    grammar = CONSTRAINTS["regex"].compile(Vocabulary.of(tok, len(tok), [EOS]))

    class Masked(LogitsProcessor):
        def __init__(self):
            self.state, self.seen = grammar.start(), len(p)

        def __call__(self, input_ids, scores):
            self.state.consume(input_ids[0, self.seen:].tolist())
            self.seen = input_ids.shape[1]
            return scores.masked_fill(~self.state.allowed()[None], float("-inf"))

    out = run(model, None, [p], constraint=grammar, max_new_tokens=30, eos_token_id=EOS)
    hf = model.generate(p[None], max_new_tokens=30, do_sample=False, logits_processor=LogitsProcessorList([Masked()]),
                        eos_token_id=EOS, pad_token_id=0)
    assert out.generated(0).tolist() == hf[0, len(p):].tolist()


def _check_paths_walked_alone(grammar, committed: list[int], parents: list[int], tokens: list[int]) -> int:
    """``tree_masks`` from a state at ``committed``: each node's verdict and mask are what a fresh state
    walking that node's path alone gives, and the state is back where it began. Returns the nodes checked."""
    st = grammar.start()
    st.consume(committed)
    before = st.allowed()
    packed, ok = st.tree_masks(parents, tokens)
    masks = packed.allowed
    assert torch.equal(st.allowed(), before)
    assert torch.equal(masks[0], before)
    assert packed.counts().tolist() == masks.sum(dim=-1).tolist()
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        path.reverse()
        alone = grammar.start()
        alone.consume(committed)
        good = True
        for k, t in enumerate(path):
            if alone.done:  # an EOS may close a finished grammar, and nothing may follow it
                good = t == EOS and k == len(path) - 1
                break
            if not bool(alone.allowed()[t]):
                good = False
                break
            alone.consume([t])
        assert ok[i] == good, (parents, tokens, i)
        if ok[i] and not alone.done:
            assert torch.equal(masks[1 + i], alone.allowed())
        if not ok[i]:
            assert not masks[1 + i].any()  # a cut node's row allows nothing
    return len(tokens)


def test_tree_masks_equal_each_path_walked_alone(tok, vocab):
    """Seeded random trees over tokens near what the grammar allows."""
    rng = random.Random(0)
    grammar = CONSTRAINTS["json_schema"].compile(vocab)
    text = tok('{"name":"ab","age":12,"tags":["the","a"]}', add_special_tokens=False)["input_ids"] + [EOS]
    cases = 0
    for _ in range(150):
        cut = rng.randrange(len(text))
        pool = list(set(text[cut: cut + 4] + [rng.randrange(len(tok)) for _ in range(2)] + [EOS]))
        parents, tokens = [], []
        for i in range(rng.randrange(1, 9)):
            parents.append(rng.randrange(-1, i))
            tokens.append(rng.choice(pool))
        cases += _check_paths_walked_alone(grammar, text[:cut], parents, tokens)
    assert cases > 500


@pytest.mark.parametrize("kind,text", [("json_schema", '{"name":"ab","age":12,"tags":["the","a"]}'),
                                       ("regex", "the cat on a mat in the sun."), ("lark", "ab,the,cde"),
                                       ("json_object", '{"a":[1,{"b":"c"}]}')])
def test_chain_masks_equal_each_path_walked_alone(tok, vocab, kind, text):
    """Chains (the common draft) take the engine's one call for a chain's masks; seeded chains that follow
    the text, stray from it part-way, or run past its end give what each path walked alone gives."""
    rng = random.Random(1)
    grammar = CONSTRAINTS[kind].compile(vocab)
    ids = tok(text, add_special_tokens=False)["input_ids"] + [EOS, EOS]
    cases = fast = 0
    for _ in range(120):
        cut = rng.randrange(len(ids) - 1)
        tokens = ids[cut: cut + rng.randrange(0, 10)]
        if tokens and rng.random() < 0.4:  # a guess that strays
            tokens[rng.randrange(len(tokens))] = rng.choice([rng.randrange(len(tok)), EOS, ids[rng.randrange(len(ids))]])
        st = grammar.start()
        st.consume(ids[:cut])
        fast += st._chain_masks(tokens) is not None
        cases += _check_paths_walked_alone(grammar, ids[:cut], list(range(-1, len(tokens) - 1)), tokens)
    assert cases > 200 and fast > 60  # the chain's own path decided most of them


def test_pruned_tree_keeps_the_allowed_nodes_and_their_q(vocab, tok):
    grammar = Constraint.regex("ab|ac").compile(vocab)
    a, b, c, x = tok.convert_tokens_to_ids(["a", "b", "c", "x"])
    opts = Processing(grammar=grammar)
    proc = RowProcessor([1, 2], opts, len(tok))
    V = len(tok)
    q = torch.full((1, 4, V), 1.0 / V, dtype=torch.float64)
    tree = DraftTree(torch.tensor([[a, x, b, c]]), torch.tensor([[-1, -1, 0, 0]]), torch.tensor([4]), q)
    pruned, packed = constrain(tree, [proc])
    masks = [packed[0].allowed]
    assert pruned.tokens.tolist() == [[a, b, c]] and pruned.parents.tolist() == [[-1, 0, 0]]
    assert masks[0].shape == (4, V)
    allowed_root = masks[0][0]
    assert torch.equal(pruned.probs[0, 0] > 0, allowed_root)  # q restricted to what the grammar allows there
    assert torch.equal(pruned.probs[0, 1] > 0, masks[0][1])


def test_bad_constraints_and_options_are_refused_by_name(tok, vocab, model):
    with pytest.raises(ConstraintError, match="regex"):
        Constraint.regex("(ab").compile(vocab)
    with pytest.raises(ConstraintError, match="not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ConstraintError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="frequency_penalty"):
        Processing(frequency_penalty=3.0)
    with pytest.raises(ValueError, match="logit_bias"):
        run(model, None, prompts(tok)[:1], logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="tokenizer"):
        run(model, None, prompts(tok)[:1], constraint=CONSTRAINTS["regex"])


def _processed_joint(model, prompt, opts: Processing, params: SamplingParams) -> torch.Tensor:
    """The exact joint [V, V] of the first two tokens under the processed, sampled target."""
    V = model.config.vocab_size
    with torch.no_grad():
        proc = RowProcessor(prompt.tolist(), opts, V)
        _, m0 = proc.check_tree([], [])
        first = target_probs(proc.scores(model(prompt[None]).logits[0, -1:], [], [], m0)[None], params)[0, 0]
        joint = torch.zeros(V, V, dtype=torch.float64)
        for x in first.nonzero().flatten().tolist():
            row = RowProcessor(prompt.tolist(), opts, V)
            row.advance([x])
            _, m = row.check_tree([], [])
            logits = model(torch.cat([prompt, torch.tensor([x])])[None]).logits[0, -1:]
            joint[x] = first[x] * target_probs(row.scores(logits, [], [], m)[None], params)[0, 0]
    return joint


class FixedQ(Drafter):
    """Draws each draft token from one fixed distribution q [V], whatever the text: much of q's mass on
    tokens the grammar forbids, so a verifier that does not restrict q to the grammar misjudges the rest."""

    capabilities = Capabilities(batches=True, samples=True)

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q

    def begin(self, prompt) -> None:
        self.B, self.generator = len(prompt.lengths), prompt.generator

    def propose(self, budget: int) -> DraftTree:
        from specdec.sampling import draw

        q = self.q.expand(self.B, -1)
        return DraftTree.chain(draw(q, self.generator)[:, None], probs=q[:, None].clone())

    def accept(self, commit) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        self.B = len(rows)


def test_sampling_with_a_constraint_and_penalties_is_the_processed_target(tok):
    """8,000 sampled two-token openings, each second token drafted from a fixed q with 40% of its mass on
    tokens the grammar forbids there, against the exact processed joint (a verifier that forgets to
    restrict q to the grammar accepts the allowed drafts too rarely: p-value ~0 here)."""
    V = len(tok)
    target = peaked(5, vocab=V)
    target.generation_config.eos_token_id = EOS
    grammar = Constraint.regex("[a-e]{1,3}|the").compile(Vocabulary.of(tok, V, [EOS]))
    a = tok.convert_tokens_to_ids("a")
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={a: 1.0})
    opts = Processing(**kw, grammar=grammar)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0)
    prompt = torch.tensor(tok("the cat", add_special_tokens=False)["input_ids"])
    joint = _processed_joint(target, prompt, opts, params)
    q = torch.zeros(V, dtype=torch.float64)
    q[tok.convert_tokens_to_ids(list("abcde"))] = 0.1
    q[tok.convert_tokens_to_ids(["x", "y"])] = 0.2  # never allowed
    q[EOS] = 0.1
    decoder = SpecDecoder(target, FixedQ(q), CONFIG)
    g = torch.Generator().manual_seed(0)
    pairs, accepted = [], 0
    for _ in range(4):
        out = decoder.generate(prompt.expand(2000, -1), max_new_tokens=3, do_sample=True, temperature=0.8, top_k=0,
                               generator=g, constraint=grammar, **kw)
        pairs.append(out.sequences[:, len(prompt): len(prompt) + 2])
        accepted += sum(sum(s.num_accepted) for s in out.steps)
    assert accepted > 1000, "the drafts were hardly accepted: the test would not see the rule"
    miss = pair_mismatch(torch.cat(pairs), joint)
    assert miss is None, miss


def test_the_commands_take_a_constraint_and_name_a_bad_one(tmp_path):
    """`specdec generate --regex` answers inside the pattern; `chat --json-schema` of a missing file, and a
    regex that does not compile, fail before any reply with the flag named."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tiny_chat import save_tiny_chat

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               SPECDEC_KERNEL_CALIBRATE="0")
    save_tiny_chat(tmp_path / "tiny")
    cli = [sys.executable, "-m", "specdec.cli"]
    model = ["--model", str(tmp_path / "tiny"), "--max-new-tokens", "12"]
    ok = subprocess.run(cli + ["generate", "hello", *model, "--regex", "(yes|no), [a-z]{2,4}\\.", "--drafter", "auto"],
                        env=env, capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert re.search(r"^(yes|no), [a-z]{2,4}\.$", ok.stdout, re.M), ok.stdout
    missing = subprocess.run(cli + ["chat", *model, "--json-schema", str(tmp_path / "none.json")], input="hi\n",
                             env=env, capture_output=True, text=True, timeout=180)
    assert missing.returncode != 0 and "--json-schema" in missing.stderr, missing.stderr[-2000:]
    bad = subprocess.run(cli + ["generate", "hello", *model, "--regex", "(ab"], env=env, capture_output=True,
                         text=True, timeout=180)
    assert bad.returncode != 0 and "regex" in bad.stderr and "does not compile" in bad.stderr, bad.stderr[-2000:]


def test_a_grammar_draft_is_forced_tokens_and_the_guesses_it_allows(tok, vocab):
    """``GrammarState.draft``: forced `{"name":`, the guess `"Bo"` taken, forced `,"n":`, the guess `12x`
    cut to `12` (x is no digit); the state where it began. (The string's opening quote is not forced: the
    tokenizer's `",` and `"}` could follow too.)"""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    state = Constraint.json_schema(schema).compile(vocab).start()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    guesses = iter([ids('"Bo"'), ids("12x")])
    before = state.allowed()
    out = state.draft(40, lambda drafted: next(guesses, []))
    assert tok.decode(out) == '{"name":"Bo","n":12', tok.decode(out)
    assert torch.equal(state.allowed(), before)
    assert state.draft(3, lambda drafted: []) == out[:3]  # the budget caps it


def test_the_grammar_drafters_class_is_how_its_chains_open(vocab, tok):
    """2 where some row's chain opens with a token the grammar forces, 1 where every chain opens with a guess
    the grammar allows (what followed the text's last n-gram before), 0 where no row has a chain."""
    from specdec.drafters.base import Prompt

    grammar = Constraint.regex("ab|ac").compile(vocab)
    a, b, x = tok.convert_tokens_to_ids(["a", "b", "x"])
    V = len(tok)

    def row(text: list[int], committed: list[int]) -> tuple[list[int], RowProcessor]:
        proc = RowProcessor(text, Processing(grammar=grammar), V)
        proc.advance(committed)
        return text, proc

    forced = row([x, x], [])  # "a" is the grammar's only way to start
    guess = row([a, b, x, a], [a])  # after "a": b or c; "a" was followed by "b" before
    nothing = row([x, x, a], [a])  # "a" was never followed by anything
    for rows, want in (([forced], 2), ([guess], 1), ([nothing], 0), ([guess, forced], 2), ([nothing, guess], 1)):
        d = GrammarDrafter()
        n = max(len(t) for t, _ in rows)
        d.begin(Prompt(torch.tensor([t + [0] * (n - len(t)) for t, _ in rows]), torch.tensor([len(t) for t, _ in rows]),
                       processors=[p for _, p in rows]))
        assert d.draft_class() == want, (rows, want)
    assert d.propose(3).tokens.tolist() == [[0], [b]] and d.propose(3).num_nodes.tolist() == [0, 1]


def test_opening_and_forced_tokens_follow_the_committed_state(tok, vocab):
    """``GrammarState.opening`` (a step's class, asked before its draft) is how ``draft(1)`` opens, and the
    forced tokens it keeps for the step are those of the state after every commit: random walks through a
    schema's answers, each state checked against a state that consumed the same tokens afresh."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "tags": {"type": "array", "items": {"type": "integer"}}},
              "required": ["name", "tags"], "additionalProperties": False}
    grammar = Constraint.json_schema(schema).compile(vocab)
    rng = random.Random(3)
    for _ in range(6):
        state, committed = grammar.start(), []
        while not state.done and len(committed) < 40:
            allowed = state.allowed().nonzero().flatten().tolist()
            guess = [rng.choice(allowed), rng.randrange(len(tok))]
            fresh = grammar.start()
            fresh.consume(committed)
            forced = fresh.forced(8)
            drafted = fresh.draft(1, lambda out: list(guess))
            assert state.forced(8) == forced
            assert state.opening(lambda out: list(guess)) == ("forced" if forced else "guess" if drafted else None)
            step = forced[: rng.randint(1, 3)] or [rng.choice(allowed)]
            state.consume(step)
            committed += step


def test_read_groups_are_the_groups_of_16_tokens_the_grammars_allow_where_few():
    from specdec.judging import read_groups
    from specdec.processing.grammar import Masks

    one = Masks(torch.tensor([[0b1, 1 << 20, 0, 0, 0, 0, 0, 0]], dtype=torch.int32), 256)  # tokens 0 and 52
    assert one.groups().tolist() == [True, False, False, True] + [False] * 12
    other = Masks(torch.tensor([[0, 0, 0, 0, 0, 0, 0, -(1 << 31)], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.int32), 256)
    assert read_groups([one, other], 256).tolist() == [0, 3, 4, 15]  # tokens 0, 52, 64, 255: any row's
    assert read_groups([one, None], 256) is None  # a row without a grammar reads every logit
    wide = Masks(torch.full((1, 8), 0x00010001, dtype=torch.int32), 256)  # a token in every group
    assert read_groups([wide], 256) is None
    assert read_groups([Masks(one.bits[:, :7], 224)], 224).tolist() == [0, 3]
    assert read_groups([Masks(one.bits, 250)], 250) is None  # not whole groups


def test_an_int8_output_layer_computes_only_the_logits_a_grammar_reads(tok, monkeypatch):
    """Where every row's grammar allows few groups of 16 tokens (a number's digits, an enum's words), an int8
    target's output layer computes those groups alone (``fastpath``): each logit it computes is the whole
    layer's bit for bit, and decoding gives the tokens and logprobs of every logit computed, plain and drafting,
    greedy and sampled, in a ragged batch."""
    import specdec.fastpath as fastpath
    import specdec.session as session
    from specdec.quant import quantize_model
    from specdec.quant.numerics import set_numerics

    V = (len(tok) + 15) // 16 * 16
    target = set_numerics(quantize_model(tiny_llama(3, vocab=V, dtype=torch.float32), "Q4_1"), "int8")
    target.generation_config.eos_token_id = EOS
    real_output, real_groups, taken = fastpath.FastPath._output, session.read_groups, []

    def output(self, rows, vocab=None):
        out = real_output(self, rows, vocab)
        if vocab is not None:
            cols = (vocab[:, None] * 16 + torch.arange(16)).reshape(-1)
            assert torch.equal(out[..., cols], real_output(self, rows)[..., cols])
            taken.append(len(vocab))
        return out

    monkeypatch.setattr(fastpath.FastPath, "_output", output)
    ps = prompts(tok)
    for drafter in (None, GrammarDrafter):
        for sampled in (False, True):
            kw = dict(constraint=CONSTRAINTS["json_schema"], tokenizer=tok, logprobs=2)
            if sampled:
                kw |= dict(do_sample=True, temperature=0.8, seed=5)
            taken.clear()
            out = run(target, drafter and Sources({"grammar": drafter(), "lookup": PromptLookupDrafter()}), ps, **kw)
            assert taken and max(taken) * 4 <= V // 16  # some steps read few groups
            monkeypatch.setattr(session, "read_groups", lambda m, v: None)
            full = run(target, drafter and Sources({"grammar": drafter(), "lookup": PromptLookupDrafter()}), ps, **kw)
            monkeypatch.setattr(session, "read_groups", real_groups)
            assert answers(out, 3) == answers(full, 3), (drafter, sampled)
            for b in range(3):
                assert [(x.token, x.logprob) for x in out.logprobs[b]] == [(x.token, x.logprob) for x in full.logprobs[b]]
