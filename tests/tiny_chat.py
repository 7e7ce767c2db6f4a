"""A tiny chat model built in-process: a byte-level tokenizer with a ChatML template over a random
float64 Llama (from conftest.tiny_llama). Greedy output is gibberish, but deterministic and exact.

Byte-level: every UTF-8 byte is one token, so a character like "é" spans two tokens - what
streaming decoders must handle.
"""

from __future__ import annotations

from conftest import tiny_llama

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 259  # 256 bytes + <|im_end|> (EOS) + <pad> + <|im_start|>


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte stand-in characters
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHATML
    assert len(fast) == VOCAB
    return fast


def tiny_chat_model(seed: int = 0, layers: int = 2):
    return tiny_llama(seed, vocab=VOCAB, layers=layers, max_pos=4096)


def save_tiny_chat(directory, seed: int = 0) -> None:
    """A HF model directory (safetensors + tokenizer) that ``specdec.models.load_model`` reads."""
    tiny_chat_model(seed).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
