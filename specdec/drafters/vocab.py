"""A draft's output layer over part of the vocabulary: the ids the target emits most, and the prompt's.

A self-speculative draft (StreamingLLM, SnapKV, quant-self) runs the target's own output layer at every
draft token (for the default model 49,152 rows, a fifth of its weights). It computes only the rows of the
ids a target emits most (FR-Spec's frequency-ranked draft vocabulary) and of every id in the prompt (the
names and numbers an answer copies). The draft then never proposes an id outside the set: its logits
there are -inf, so its distribution q is zero there, and the verifier's rule is the one it always runs:
the output stays the target's (greedy, token for token; sampled, in distribution). Measured, and why the prompt's ids:
docs/decisions/015-quant-kernels.md, Decision: draft vocabulary.

    vocab = DraftVocabulary(frequent_ids, vocab_size)       # e.g. packaged_vocabulary(target)
    StreamingDrafter(target, budget=512, vocab=vocab)
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
from safetensors import safe_open

from specdec.drafters.eagle3 import PACKAGED_HEAD3
from specdec.introspect import text_config
from specdec.quant.modules import QuantLinear


class DraftVocabulary:
    """The target ids a draft's output layer always computes (``frequent``); each prompt adds its own."""

    def __init__(self, frequent: torch.Tensor, vocab_size: int) -> None:
        frequent = torch.as_tensor(frequent)
        if frequent.dim() != 1 or frequent.is_floating_point() or frequent.numel() == 0:
            raise ValueError(f"a draft vocabulary is a non-empty 1-D tensor of token ids, got {frequent.dtype} "
                             f"{tuple(frequent.shape)}")
        frequent = frequent.to(torch.long)
        if int(frequent.min()) < 0 or int(frequent.max()) >= vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}) (the target's vocabulary), got "
                             f"{int(frequent.min())}..{int(frequent.max())}")
        self.frequent = torch.unique(frequent)  # sorted, distinct
        self.vocab_size = vocab_size

    def ids_for(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """The ids a draft for ``prompt_ids`` (any shape; every row of a batch) computes: sorted, distinct."""
        prompt = prompt_ids.reshape(-1).to(torch.long).cpu()
        prompt = prompt[(prompt >= 0) & (prompt < self.vocab_size)]
        return torch.unique(torch.cat([self.frequent, prompt]))


def packaged_vocabulary(target) -> DraftVocabulary | None:
    """The packaged EAGLE-3 head's draft vocabulary where that head fits ``target`` (its hidden size, layer
    count and vocabulary: the default model's), else None (the draft computes the whole output layer). Its
    ids are the most frequent of the default model's self-distilled answers (``train-eagle --arch eagle3``)."""
    config_file = PACKAGED_HEAD3 / "config.json"
    weights = PACKAGED_HEAD3 / "model.safetensors"
    if not (config_file.is_file() and weights.is_file()):
        return None
    head = json.loads(config_file.read_text())
    cfg = text_config(target)
    fits = (head.get("vocab_size") == cfg.vocab_size and head.get("target_hidden_size") == cfg.hidden_size
            and head.get("target_num_hidden_layers") == cfg.num_hidden_layers)
    if not fits:
        return None
    with safe_open(str(weights), framework="pt") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t")
    return DraftVocabulary(torch.arange(d2t.numel(), dtype=torch.long) + d2t, cfg.vocab_size)


class VocabHead(nn.Module):
    """An output layer (nn.Linear or QuantLinear) computed for ``ids`` only: logits [..., V], -inf at every
    other id. Its rows are copied from the layer (a QuantLinear's blocks, an nn.Linear's weight)."""

    def __init__(self, head: nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        if type(head) not in (nn.Linear, QuantLinear):
            raise TypeError(f"a draft vocabulary needs an nn.Linear or QuantLinear output layer, got {type(head).__name__}")
        ids = ids.to(torch.long)
        self.vocab_size = head.out_features
        self.register_buffer("ids", ids.to(head.blocks.device if isinstance(head, QuantLinear) else head.weight.device),
                             persistent=False)
        bias = None if head.bias is None else head.bias.detach()[self.ids]
        if isinstance(head, QuantLinear):
            self.rows = QuantLinear(head.blocks.index_select(0, self.ids), head.fmt, head.in_features, bias)
        else:
            self.rows = nn.Linear(head.in_features, ids.numel(), bias=bias is not None,
                                  device=head.weight.device, dtype=head.weight.dtype)
            with torch.no_grad():
                self.rows.weight.copy_(head.weight.detach()[self.ids])
                if bias is not None:
                    self.rows.bias.copy_(bias)
            self.rows.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., V]
        return self._spread(self.rows(x))

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full logits [..., V] (HF's forward computed them all) -> the same restriction: -inf off ``ids``."""
        return self._spread(logits.index_select(-1, self.ids))

    def _spread(self, y: torch.Tensor) -> torch.Tensor:
        out = torch.full((*y.shape[:-1], self.vocab_size), float("-inf"), dtype=y.dtype, device=y.device)
        return out.index_copy_(-1, self.ids, y)
