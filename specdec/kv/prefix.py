"""Prefix cache: prompt K/V rows kept across sequences, found by token prefix, reused exactly.

A prompt is prefilled in forwards of ``block`` tokens at multiples of ``block`` (``forward.prefill_aligned``),
so the rows of its first n blocks are a function of those n * block tokens alone: the same bits whether
they were computed now or by an earlier sequence. The cache keeps them as blocks of ``block`` rows (vLLM's
hashed blocks, keyed exactly): a block is found by its parent block and its own tokens, so a lookup
walks the prompt block by block. Why blocks and not a radix tree of any length, and why only prompt
rows: docs/decisions/021-prefix-cache.md.

Worked example, block 4, cached prompt [a b c d e f g h i j] (blocks [abcd] -> [efgh]; "ij" is not a
whole block, not kept)::

    lookup [a b c d e f g h x]   -> 8 rows reused, the forward starts at row 8 (one chunk: "x")
    lookup [a b c d e f g h]     -> 4 rows: the last token is always computed (its logits give the
                                    first new token), so at most the whole blocks before it
    lookup [a b c d x f g h y]   -> 4 rows (block 2 differs)

Two parts: ``BlockIndex`` (pure: which blocks exist, least recently used first, a byte budget; tested
on token lists) and ``PrefixCache`` (the K/V of each block, and the counts /metrics reports).

Dimensions: H K/V heads, D head dim, n rows, C = block rows (a block's layers stacked first: [layers, H, C, D]).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 64  # rows per block (why 64: docs/decisions/021-prefix-cache.md)


@dataclass
class _Node:
    key: tuple  # (parent node id, the block's tokens)
    parent: int  # node id, -1 for a first block
    nbytes: int
    children: int = 0
    payload: object = None


class BlockIndex:
    """A trie of fixed-size token blocks with LRU eviction of leaves under ``max_bytes``.

    A node is one block; its key is (its parent's id, its tokens), so two blocks with the same tokens
    after different prefixes are different nodes, and no hash can collide. Only leaves are evicted (a
    block without its parent could never be reached); touching a chain touches it root first, so a
    parent is never more recent than the child last used with it.

    Example, block 2: insert [1 2 3 4 5] -> nodes (-1,(1,2)) = 0, (0,(3,4)) = 1; match [1 2 3 4 9] -> [0, 1];
    match [1 2 7 7] -> [0].
    """

    def __init__(self, block: int, max_bytes: int) -> None:
        if block < 1 or max_bytes < 0:
            raise ValueError(f"need block >= 1 and max_bytes >= 0, got block {block}, max_bytes {max_bytes}")
        self.block, self.max_bytes = block, max_bytes
        self.nbytes = 0
        self.evictions = 0  # blocks evicted so far
        self._ids: dict[tuple, int] = {}  # key -> node id
        self._nodes: OrderedDict[int, _Node] = OrderedDict()  # least recently used first
        self._next = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def blocks_of(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """The whole blocks of ``tokens`` (a last partial block is left out)."""
        C = self.block
        return [tuple(tokens[i : i + C]) for i in range(0, len(tokens) - C + 1, C)]

    def match(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Node ids of the longest chain of held blocks ``tokens`` starts with (at most ``limit`` blocks),
        marked used."""
        ids, parent = [], -1
        for blk in self.blocks_of(tokens)[:limit]:
            node = self._ids.get((parent, blk))
            if node is None:
                break
            ids.append(node)
            parent = node
        for i in ids:  # root first: the leaf ends most recent
            self._nodes.move_to_end(i)
        return ids

    def payload(self, node: int):
        return self._nodes[node].payload

    def insert(self, tokens: list[int], nbytes: int, make) -> list[int]:
        """Hold every whole block of ``tokens``: the held ones are touched, missing ones made by
        ``make(i)`` (block i's payload, ``nbytes`` each), evicting least recently used leaves to fit.
        Stops at a block that cannot fit (the budget, or every other block in use by this chain).
        Returns the chain's node ids."""
        ids, parent = [], -1
        for i, blk in enumerate(self.blocks_of(tokens)):
            key = (parent, blk)
            node = self._ids.get(key)
            if node is None:
                if not self._make_room(nbytes, keep=set(ids)):
                    break
                node = self._next
                self._next += 1
                self._ids[key] = node
                self._nodes[node] = _Node(key, parent, nbytes, payload=make(i))
                self.nbytes += nbytes
                if parent >= 0:
                    self._nodes[parent].children += 1
            else:
                self._nodes.move_to_end(node)
            ids.append(node)
            parent = node
        return ids

    def _make_room(self, nbytes: int, keep: set[int]) -> bool:
        """Evict least recently used leaves (never ``keep``) until ``nbytes`` more fit; False if they cannot."""
        if nbytes > self.max_bytes:
            return False
        while self.nbytes + nbytes > self.max_bytes:
            victim = next((i for i, n in self._nodes.items() if n.children == 0 and i not in keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, node: int) -> None:
        n = self._nodes.pop(node)
        del self._ids[n.key]
        self.nbytes -= n.nbytes
        self.evictions += 1
        if n.parent >= 0:
            self._nodes[n.parent].children -= 1

    def clear(self) -> None:
        self._nodes.clear()
        self._ids.clear()
        self.nbytes = 0


@dataclass(frozen=True)
class Hit:
    """What a lookup found: the first ``tokens`` rows of the prompt, per layer (keys, values) [H, n, D]."""

    tokens: int
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class PrefixStats:
    """What /metrics and usage report; plain ints written by the one thread that prefills."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # of them, found with at least one block
    tokens_reused: int = 0  # prompt rows taken from the cache instead of computed
    tokens_prefilled: int = 0  # prompt rows computed by prompts that looked the cache up
    inserted_blocks: int = 0


class PrefixCache:
    """Prompt K/V rows of earlier sequences, shared by every later one (a batch's rows included), LRU
    under ``max_bytes`` (0: nothing is kept, the prompts still prefilled in aligned blocks: the exact
    baseline of a cache that keeps them).

        decoder = SpecDecoder(target, drafter, prefix_cache=PrefixCache(max_bytes=512 * 2**20))
        decoder.generate(system + question_1)   # prefills all of it, keeps its whole 64-token blocks
        decoder.generate(system + question_2)   # prefills from the last whole block of `system` on

    Its rows are exact only with the prefill that made them: a decoder with a prefix cache prefills every
    prompt in aligned blocks (``forward.prefill_aligned``), hit or miss. One cache serves one target, in
    one runtime configuration (the kernels' routes, fixed per process, are part of the arithmetic).
    """

    def __init__(self, max_bytes: int, block: int = BLOCK) -> None:
        self.index = BlockIndex(block, max_bytes)
        self.stats = PrefixStats()
        self._owner: int | None = None  # id of the target whose rows these are

    @property
    def block(self) -> int:
        return self.index.block

    @property
    def max_bytes(self) -> int:
        return self.index.max_bytes

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    @property
    def enabled(self) -> bool:
        return self.index.max_bytes > 0

    def bind(self, target) -> None:
        """Serve rows of ``target`` only: a cache given to decoders of two targets would mix their rows."""
        if self._owner is not None and self._owner != id(target):
            raise ValueError("this PrefixCache holds another target's rows: give each target its own")
        self._owner = id(target)

    def reusable(self, length: int) -> int:
        """The most rows a prompt of ``length`` tokens may take: its whole blocks before its last token
        (which the forward must see to give the first new token). Example, block 4: 9 -> 8, 8 -> 4, 3 -> 0."""
        return (length - 1) // self.block * self.block

    def lookup(self, tokens: list[int]) -> Hit:
        """The longest run of cached blocks ``tokens`` starts with, up to ``reusable(len(tokens))`` rows."""
        self.stats.lookups += 1
        ids = self.index.match(tokens, self.reusable(len(tokens)) // self.block)
        if not ids:
            return Hit(0)
        self.stats.hits += 1
        self.stats.tokens_reused += len(ids) * self.block
        blocks = [self.index.payload(i) for i in ids]  # each (keys, values) [layers, H, C, D]
        keys = torch.cat([k for k, _ in blocks], dim=2)  # [layers, H, n, D]
        values = torch.cat([v for _, v in blocks], dim=2)
        return Hit(len(ids) * self.block, [(keys[i], values[i]) for i in range(keys.shape[0])])

    def insert(self, tokens: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the whole blocks of a prompt prefilled by ``prefill_aligned``: per layer (keys, values)
        [H, n >= len(tokens) rounded down to a block, D]; blocks held already are only touched."""
        C = self.block
        whole = len(tokens) // C * C
        if not self.enabled or whole == 0:
            return
        k0, v0 = layers[0]
        nbytes = len(layers) * C * (k0[:, :1].numel() * k0.element_size() + v0[:, :1].numel() * v0.element_size())

        def make(i: int):  # block i's rows, copied out of the store they sit in: [layers, H, C, D] each
            self.stats.inserted_blocks += 1
            return (torch.stack([k[:, i * C : (i + 1) * C] for k, _ in layers]),
                    torch.stack([v[:, i * C : (i + 1) * C] for _, v in layers]))

        with torch.inference_mode():
            self.index.insert(tokens[:whole], nbytes, make)

    def clear(self) -> None:
        self.index.clear()
