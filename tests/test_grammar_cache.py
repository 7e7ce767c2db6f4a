"""The compiled-grammar cache (``specdec.processing.grammar.GrammarCache``): one compile per distinct
constraint and vocabulary, the least recently used dropped past the bound, refusals never kept, and a
shared grammar starting each sequence fresh. The server's use of it: tests/test_serve_constraints.py."""

from __future__ import annotations

import json
import threading

import pytest

from specdec.bench.device.tiny import tiny_tokenizer
from specdec.processing.grammar import Constraint, ConstraintError, GrammarCache, Vocabulary
from specdec.serve.service import ServeConfig

EOS = 256  # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}, "required": ["a", "b"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return Vocabulary.of(tok, len(tok), [EOS])


@pytest.fixture
def compiles(monkeypatch) -> list[Constraint]:
    """The constraints ``Constraint.compile`` was called on, in order."""
    calls: list[Constraint] = []
    compile_ = Constraint.compile

    def counting(self, vocabulary):
        calls.append(self)
        return compile_(self, vocabulary)

    monkeypatch.setattr(Constraint, "compile", counting)
    return calls


def forced_text(tok, grammar) -> str:
    """What the grammar forces from its start (the whole answer, for SCHEMA's constants)."""
    return tok.decode(grammar.start().forced(50))


def test_the_same_schema_twice_compiles_once(vocab, compiles):
    cache = GrammarCache(4)
    first = cache.compile(Constraint.json_schema(SCHEMA), vocab)
    again = cache.compile(Constraint.json_schema(json.loads(json.dumps(SCHEMA))), vocab)  # an equal, new dict
    assert again is first and len(compiles) == 1
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)


def test_schemas_differing_only_in_whitespace_share_an_entry(vocab, compiles):
    cache = GrammarCache(4)
    spaced = json.dumps(SCHEMA, indent=4)  # a request's schema as JSON text, pretty-printed
    grammar = cache.compile(Constraint.json_schema(spaced), vocab)
    assert cache.compile(Constraint.json_schema(SCHEMA), vocab) is grammar
    assert cache.compile(Constraint.json_schema(json.dumps(SCHEMA, separators=(",", ":"))), vocab) is grammar
    assert len(compiles) == 1


def test_property_order_is_part_of_the_key_because_it_is_the_answers_order(tok, vocab, compiles):
    """Sorting the keys would share one grammar between these two schemas: their answers differ."""
    swapped = dict(SCHEMA, properties={"b": {"const": 2}, "a": {"const": 1}})
    cache = GrammarCache(4)
    ab, ba = cache.compile(Constraint.json_schema(SCHEMA), vocab), cache.compile(Constraint.json_schema(swapped), vocab)
    assert ab is not ba and len(compiles) == 2
    assert (forced_text(tok, ab), forced_text(tok, ba)) == ('{"a":1,"b":2}', '{"b":2,"a":1}')


def test_different_constraints_and_vocabularies_do_not_share(tok, vocab, compiles):
    other_vocab = Vocabulary.of(tok, len(tok), [EOS])  # an equal tokenizer, another object: its own entry
    constraints = [Constraint.json_schema(SCHEMA), Constraint.json_schema(dict(SCHEMA, required=["a"])),
                   Constraint.json_schema(SCHEMA, compact=False), Constraint.json_object(),
                   Constraint.regex("a+"), Constraint.regex("a*"), Constraint.lark('start: "a"+'),
                   Constraint.gbnf('root ::= "a"+')]
    cache = GrammarCache(64)
    grammars = [cache.compile(c, vocab) for c in constraints] + [cache.compile(constraints[0], other_vocab)]
    assert len({id(g) for g in grammars}) == len(grammars) == len(compiles) == len(cache) == 9
    assert cache.hits == 0
    assert grammars[-1].vocabulary is other_vocab


def test_the_bound_evicts_the_least_recently_used(vocab, compiles):
    a, b, c = (Constraint.regex(p) for p in ("a+", "b+", "c+"))
    cache = GrammarCache(2)
    cache.compile(a, vocab)
    cache.compile(b, vocab)
    cache.compile(a, vocab)  # a is now the most recently used: b goes next
    cache.compile(c, vocab)
    assert (len(cache), cache.evictions) == (2, 1)
    cache.compile(a, vocab)
    cache.compile(c, vocab)
    assert [x.source for x in compiles] == ["a+", "b+", "c+"]  # a and c were kept
    cache.compile(b, vocab)  # b was dropped: compiled again (and a, least recent now, dropped)
    assert [x.source for x in compiles] == ["a+", "b+", "c+", "b+"]
    assert (cache.hits, cache.misses, cache.evictions) == (3, 4, 2)


def test_a_bound_of_zero_keeps_nothing(vocab, compiles):
    cache = GrammarCache(0)
    one, two = (cache.compile(Constraint.regex("a+"), vocab) for _ in range(2))
    assert one is not two and len(compiles) == 2 and len(cache) == 0 and cache.misses == 2


def test_a_refused_schema_is_refused_every_time(vocab, compiles):
    cache = GrammarCache(4)
    bad = Constraint.json_schema({"type": "nope"})
    for _ in range(2):
        with pytest.raises(ConstraintError, match="json_schema constraint does not compile"):
            cache.compile(bad, vocab)
    assert len(compiles) == 2 and len(cache) == 0 and (cache.hits, cache.misses) == (0, 2)
    cache.compile(Constraint.json_schema(SCHEMA), vocab)  # and the cache goes on working
    assert len(cache) == 1


def test_a_shared_grammar_starts_each_sequence_fresh(tok, vocab):
    """Two sequences on one cached grammar: one moving leaves the other, and the next one started, at the
    start, as a grammar compiled for them alone."""
    cache = GrammarCache(4)
    constraint = Constraint.regex("(ab|ac)d")
    grammar = cache.compile(constraint, vocab)
    one, two = grammar.start(), grammar.start()
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    one.consume([a, b])
    alone = constraint.compile(vocab).start().allowed()
    assert cache.compile(constraint, vocab) is grammar
    assert bool((two.allowed() == alone).all()) and bool((grammar.start().allowed() == alone).all())
    assert not bool((one.allowed() == alone).all())


def test_concurrent_lookups_count_every_call_and_keep_the_bound(vocab):
    patterns = [f"x{i}+" for i in range(6)]
    cache = GrammarCache(4)
    got: list[tuple[str, str]] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(30):
            c = Constraint.regex(patterns[(seed * 7 + i) % len(patterns)])
            g = cache.compile(c, vocab)
            with lock:
                got.append((c.source, g.constraint.source))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 240 and all(asked == served for asked, served in got)
    assert cache.hits + cache.misses == 240 and len(cache) <= 4
    # each grammar kept was compiled once and is held or was dropped (a compile that lost a race kept nothing)
    assert len(cache) + cache.evictions <= cache.misses


def test_the_bound_must_not_be_negative():
    with pytest.raises(ValueError, match="grammar_cache_size >= 0"):
        ServeConfig(grammar_cache_size=-1)
    with pytest.raises(ValueError, match="max_entries >= 0"):
        GrammarCache(-1)


def test_a_bitmask_unpacks_bit_j_of_word_w_as_token_32w_plus_j():
    import torch

    from specdec.processing.grammar import unpack_bitmask

    assert unpack_bitmask(torch.tensor([[0b101]], dtype=torch.int32), 3).tolist() == [[True, False, True]]
    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    want = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(3, -1)[:, :150].bool()
    assert torch.equal(unpack_bitmask(words, 150), want)  # sign bits (word < 0) included


@pytest.mark.parametrize("vocab", [150, 160, 31])
def test_packed_masks_mask_count_and_answer_as_their_bools(vocab):
    """Masks (the grammar's bitmask kept packed) against its unpacked bools on seeded random words, sign bits
    and bits past V included: llguidance's in-place -inf equals masked_fill over the bools, the counts are
    the bools' sums, allows(r, t) is bool r, t, rows() selects rows."""
    import torch

    from specdec.processing.grammar import Masks

    g = torch.Generator().manual_seed(vocab)
    for _ in range(50):
        R = int(torch.randint(1, 9, (1,), generator=g))
        words = torch.randint(-2**31, 2**31 - 1, (R, -(-vocab // 32)), dtype=torch.int32, generator=g)
        words[words[:, 0] % 3 == 0] = 0  # rows that allow nothing
        masks = Masks(words, vocab)
        bools = masks.allowed
        assert bools.shape == (R, vocab)
        scores = torch.randn(R, vocab, generator=g)
        assert torch.equal(masks.apply_(scores.clone()), scores.masked_fill(~bools, float("-inf")))
        assert masks.counts().tolist() == bools.sum(dim=-1).tolist()
        r, t = int(torch.randint(0, R, (1,), generator=g)), int(torch.randint(0, vocab, (1,), generator=g))
        assert masks.allows(r, t) == bool(bools[r, t])
        assert torch.equal(masks.rows([R - 1, 0]).allowed, bools[[R - 1, 0]])
