"""One forward of a HF causal LM over a block of rows laid into a BMC store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kv.bmc import BMCCache


@dataclass(frozen=True)
class BlockOutput:
    logits: torch.Tensor  # [B, Q, V]
    hidden: torch.Tensor | None  # [B, Q, D] last hidden state (after the final norm), if asked


@torch.inference_mode()
def forward_block(model, cache: BMCCache, input_ids: torch.Tensor, block_mask: torch.Tensor | None,
                  depth: torch.Tensor | None, want_hidden: bool = False) -> BlockOutput:
    """input_ids [B, Q]; block_mask [B, Q, Q] bool; depth [B, Q] position offsets within the block.

    block_mask = depth = None means a causal block (chain, prefill, plain decode): the fast path.
    """
    if block_mask is None:
        inputs = cache.prepare_chain(input_ids.shape[1])
    else:
        inputs = cache.prepare(block_mask, depth)
    out = model(
        input_ids=input_ids.to(model.device),
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,  # 4D additive bias: HF uses it as given
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=want_hidden,
    )
    hidden = out.hidden_states[-1] if want_hidden else None  # HF applies the final norm already
    return BlockOutput(out.logits, hidden)
