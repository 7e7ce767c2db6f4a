"""Turning text into a target's prompt, and what ends a reply: the helpers every command shares.

    ids = chat_ids(tokenizer, [{"role": "user", "content": "hi"}])   # [1, P], ready for the reply
    row = encode_prompt(tokenizer, "hi")                               # [P], template if it has one
    eos = eos_ids(model, tokenizer)                                    # [2] for SmolLM2's <|im_end|>
    n = reply_room(context_window(model), P, max_new_tokens)          # new tokens that still fit

The chat (``specdec chat``), the commands that generate (``generate``, ``specbench``, the bench
harnesses) and the EAGLE training data all go through these, so every one of them prompts a target
the same way and stops on the same tokens. The decoder resolves its own default EOS set when it is
given none (``SpecDecoder.generate``); these helpers are for the callers that pass one explicitly.
"""

from __future__ import annotations

import torch

from specdec.introspect import text_config

Messages = list[dict]  # [{"role": "user" | "assistant", "content": str}, ...]


def user_turn(text: str) -> Messages:
    """A one-message conversation: the user says ``text``."""
    return [{"role": "user", "content": text}]


def chat_ids(tokenizer, messages: Messages) -> torch.Tensor:
    """[1, P] the chat template applied to ``messages``, ready for the assistant's reply."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, text: str, chat: bool = True) -> torch.Tensor:
    """[P] one user message through the chat template when ``chat`` and the tokenizer has one, else
    the raw text's ids (no template: a base model continues the text)."""
    if chat and has_chat_template(tokenizer):
        return chat_ids(tokenizer, user_turn(text))[0]
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def eos_ids(model, tokenizer=None, required: bool = False) -> list[int]:
    """The ids that end a reply: the generation config's EOS (SmolLM2 chat: <|im_end|> = 2), else the
    tokenizer's; [] when neither names one (``required``: a ValueError instead). Every method of a
    benchmark gets the same list."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        if required:
            raise ValueError("neither the model's generation config nor its tokenizer names an EOS token")
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def pad_id(tokenizer, eos: list[int]) -> int:
    """The id that pads a batch for HF generate: the tokenizer's pad token, else the first EOS, else 0."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return eos[0] if eos else 0


def context_window(model) -> int | None:
    """Positions the model can attend to (``max_position_embeddings``), None when it names none."""
    return getattr(text_config(model), "max_position_embeddings", None)


def reply_room(window: int | None, prompt_tokens: int, max_new_tokens: int) -> int:
    """New tokens a reply may take after ``prompt_tokens``: ``max_new_tokens`` clipped to what the
    context window leaves (< 1 means the prompt leaves no room). Example: 2048, 2000, 128 -> 48."""
    return max_new_tokens if window is None else min(max_new_tokens, window - prompt_tokens)


def fit_conversation(tokenizer, messages: Messages, max_new_tokens: int,
                     window: int | None) -> tuple[torch.Tensor | None, Messages]:
    """[1, P] the conversation's prompt and the messages it holds: the oldest exchanges (a user
    message and its answer) dropped while a full reply would not fit the window. The prompt is None
    when even the last message alone does not fit."""
    while True:
        ids = chat_ids(tokenizer, messages)
        if reply_room(window, ids.shape[1], max_new_tokens) == max_new_tokens:
            return ids, messages
        if len(messages) <= 1:
            return (ids if ids.shape[1] < window else None), messages
        messages = messages[2:]
