"""What one forward over a block of rows in a KV store needs: where the block is written and what each of
its rows sees (the store's bias mask). ``kv.bmc`` plans them from host lengths; ``kv.static`` computes them on
the device inside a captured step (``block_bias`` takes the rows' starts as a tensor).

Example, one row of 5 committed rows, a causal block of Q = 2 written at rows 5, 6, a view of L = 8 rows::

    block row 0 sees rows 0..5, block row 1 rows 0..6; rows 7.. are padding (hidden)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockInputs:
    """What one forward over a block needs besides the token ids."""

    position_ids: torch.Tensor  # [B, Q] int64
    attention_mask: torch.Tensor  # [B, 1, Q, L] additive bias over the attended view of L rows


class WritePlan:
    """Where the block of the forward in flight goes: set by ``prepare``, read by every layer."""

    __slots__ = ("starts", "q", "end", "row_index")

    def __init__(self, starts: list[int], q: int, device: torch.device, index: bool = True) -> None:
        self.starts = starts  # per batch row, first row of the block
        self.q = q
        self.end = max(starts) + q  # rows of the attended view
        # ragged rows need a scatter; equal starts (always the case at B = 1) take a slice write;
        # index=False: the forward computes it (a static step: kv.static)
        if len(set(starts)) == 1 or not index:
            self.row_index = None
        else:
            s = torch.tensor(starts, device=device)[:, None]
            self.row_index = s + torch.arange(q, device=device)  # [B, Q]


def causal(q: int, device) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool, device=device).tril()


def causal_bias(q: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[Q, Q] additive causal bias: 0 on and below the diagonal, dtype-min above."""
    return torch.full((q, q), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)


def block_bias(starts: torch.Tensor, block_mask: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias [B, 1, Q, L] of a block of Q rows per batch row written at rows ``starts``
    [B] (a tensor: a captured step computes it on the device, ``kv.static``) of a store attended over
    L rows. Column c of batch row b: c < start: committed (visible); start <= c < start + Q: the
    block, as ``block_mask`` [B, Q, Q] says; c >= start + Q: padding, or rows another batch row is
    using (hidden). Example: start 5, Q 2 (causal), L 8 -> row 0 sees 0..5, row 1 sees 0..6."""
    B, Q, _ = block_mask.shape
    rel = torch.arange(L, device=starts.device)[None, :] - starts[:, None]  # [B, L]
    in_block = (rel >= 0) & (rel < Q)
    block_cols = block_mask.gather(2, rel.clamp(0, Q - 1)[:, None, :].expand(B, Q, L))  # [B, Q, L]
    visible = (rel < 0)[:, None, :] | (in_block[:, None, :] & block_cols)
    bias = torch.zeros(B, 1, Q, L, dtype=dtype, device=starts.device)
    return bias.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
