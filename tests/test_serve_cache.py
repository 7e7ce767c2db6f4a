"""The suffix cache of served text: round trip, bounded, and never trusted when torn or foreign."""

import logging
from collections import deque

import pytest
import torch

from specdec.drafters.base import Prompt
from specdec.drafters.corpus import (CorpusDoc, CorpusFileError, SuffixCorpus, load_corpus_file, save_corpus_file,
                                     vocab_fingerprint)
from specdec.drafters.suffix import SuffixDrafter
from specdec.serve.cache import CacheConfig, ServedCache, suffix_drafters

from tiny_chat import tiny_tokenizer

DOCS = [CorpusDoc((1, 2, 3, 4, 5), 2), CorpusDoc((7, 8, 9), 0)]


def test_a_corpus_file_round_trips(tmp_path):
    save_corpus_file(tmp_path / "c.json", DOCS, "fp")
    assert load_corpus_file(tmp_path / "c.json", "fp") == DOCS
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_a_torn_or_altered_file_is_refused(tmp_path, damage):
    path = tmp_path / "c.json"
    save_corpus_file(path, DOCS, "fp")
    raw = path.read_bytes()
    raw = {"truncate": raw[:-7], "flip": raw.replace(b"[7,8,9]", b"[7,8,8]"), "header": b"garbage\n" + raw,
           "empty": b""}[damage]
    path.write_bytes(raw)
    with pytest.raises(CorpusFileError):
        load_corpus_file(path, "fp")


def test_a_file_of_another_tokenizer_is_refused(tmp_path):
    save_corpus_file(tmp_path / "c.json", DOCS, "fp-a")
    with pytest.raises(CorpusFileError, match="another tokenizer"):
        load_corpus_file(tmp_path / "c.json", "fp-b")


def test_the_fingerprint_follows_the_vocabulary():
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert vocab_fingerprint(a) == vocab_fingerprint(b)
    b.add_tokens(["<extra>"])
    assert vocab_fingerprint(a) != vocab_fingerprint(b)


def _cache(path, max_tokens=1000):
    drafter = SuffixDrafter()
    return drafter, ServedCache([drafter], "fp", CacheConfig(path, max_tokens=max_tokens))


def test_served_text_survives_a_restart(tmp_path):
    drafter, cache = _cache(tmp_path / "s.json")
    cache.remember([1, 2, 3], [4, 5, 6, 7])
    assert cache.save() and not cache.save()  # nothing new: no second write
    again, loaded = _cache(tmp_path / "s.json")
    assert loaded.load() == 1
    assert again.remembered == [CorpusDoc((1, 2, 3, 4, 5, 6, 7), 3)]


@pytest.mark.parametrize("foreign", [False, True])
def test_an_untrusted_cache_file_is_rebuilt_with_a_warning(tmp_path, caplog, foreign):
    path = tmp_path / "s.json"
    if foreign:
        save_corpus_file(path, DOCS, "another tokenizer")
    else:
        path.write_bytes(b'{"format": "specdec-suffix-cache", "version": 1}\n[[1, 2')
    drafter, cache = _cache(path)
    with caplog.at_level(logging.WARNING, logger="specdec.serve"):
        assert cache.load() == 0
    assert "not trusted" in caplog.text and drafter.remembered == []
    assert (tmp_path / "s.json.corrupt").exists() and not path.exists()
    cache.remember([1], [2, 3])
    cache.save()
    assert len(load_corpus_file(path, "fp")) == 1  # rebuilt from what was served next


def test_the_cache_drops_its_oldest_generation_whole_beyond_its_bound(tmp_path):
    stored = SuffixCorpus([CorpusDoc((1, 2, 3), 0)])
    drafter = SuffixDrafter(corpus=stored)
    cache = ServedCache([drafter], "fp", CacheConfig(tmp_path / "s.json", max_tokens=20))
    index = stored.index
    for i in range(9):
        cache.remember([100 + i], [i] * 4)  # 5 tokens each: generations of 2 (10 tokens at most)
        assert cache.tokens <= 20 and len(drafter.memory) <= 2
        kept = [doc.ids[0] for doc in drafter.remembered]
        assert kept == [doc.ids[0] for doc in cache.docs] and kept[-1] == 100 + i
    assert kept == [106, 107, 108] and cache.generations == deque([2, 1])
    assert stored.index is index and stored.docs == [CorpusDoc((1, 2, 3), 0)]  # the stored corpus: never rebuilt
    assert cache.save() and [d.ids[0] for d in load_corpus_file(tmp_path / "s.json", "fp")] == kept


def test_a_row_drafts_from_the_corpus_with_its_longest_match():
    drafter = SuffixDrafter(corpus=SuffixCorpus([CorpusDoc((1, 2, 3, 4, 50), 0)]))
    drafter.remember([2, 3, 4, 60, 61], 0)  # a shorter match of the row's text, another continuation
    drafter.remember([8, 1, 2, 3, 4, 70, 71], 0)  # the longest: 8 1 2 3 4
    drafter.begin(Prompt(torch.tensor([[8, 1, 2, 3, 4]]), torch.tensor([5]), None, None, None, None))
    assert drafter.propose(16).tokens[0, :2].tolist() == [70, 71]
    drafter.new_generation(keep=0)  # the memory gone: the stored corpus's 1 2 3 4 -> 50
    assert drafter.propose(16).tokens[0, 0].item() == 50


def test_suffix_drafters_are_found_among_sources():
    from specdec.drafters.chooser import Sources
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    s = SuffixDrafter()
    assert suffix_drafters(Sources({"lookup": PromptLookupDrafter(), "suffix": s})) == [s]
    assert suffix_drafters(s) == [s] and suffix_drafters(None) == []
