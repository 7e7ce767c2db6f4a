"""Early-exit self-drafting: the target's first layers (plus its final norm and lm_head) draft.

No extra weights: the draft model shares every tensor with the target. Layers are pruned from a
shallow copy of the model, so the target itself is untouched.
"""

from __future__ import annotations

import copy

import torch


def early_exit_model(target, num_layers: int):
    """A view of ``target`` that runs only its first ``num_layers`` decoder layers."""
    inner = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    total = len(inner.layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"early exit needs 1 <= num_layers < {total} (the target's layers), got {num_layers}")
    draft = copy.copy(target)  # shallow: shares every parameter
    draft._modules = dict(target._modules)
    draft_inner = copy.copy(inner)
    draft_inner._modules = dict(inner._modules)
    draft_inner.layers = torch.nn.ModuleList(list(inner.layers)[:num_layers])
    draft.config = copy.deepcopy(target.config)
    draft.config.num_hidden_layers = num_layers
    draft_inner.config = draft.config
    if hasattr(draft.config, "layer_types") and draft.config.layer_types is not None:
        draft.config.layer_types = draft.config.layer_types[:num_layers]
    draft._modules["model"] = draft_inner
    return draft
