"""Forwards of a HF causal LM for the decoder: a prefill, and a block of rows laid into a BMC store.

Attention over a ragged batch (rows of different committed lengths) takes one of two shapes, after
BASS (Qian et al., 2024):

    PAD    one batched attention over the store's view of max(lengths) + Q rows; each row's unused
           columns are hidden by the additive bias. Padded work grows with the length spread.
    SPLIT  attention per row over its own lengths[b] + Q columns (no padded work), the linear
           layers still batched. Costs B small attention calls per layer instead of one.

Worked example: lengths [200, 4000], Q = 4. PAD attends 2 x 4004 columns (3800 of row 0's hidden);
SPLIT attends 204 + 4004.

Both run through ``specdec.runtime.attention.grouped_attention`` (registered with transformers'
``AttentionInterface``), not HF's SDPA function: for a block of Q > 1 rows with a mask, HF copies every K/V head once per query
head sharing it (``repeat_kv``; 3x for the default model's 9 query / 3 KV heads): at 7k tokens
that copy was ~1 GB per step and made a 2-row verify cost 2.2x a 1-row step. Grouping the queries
instead ([B, 9, Q, D] -> [B, 3, 3Q, D], the mask repeated to match) reads the store's K/V in place,
as HF itself does for Q = 1. Where the kernel self-check found it faster, the grouped rows go to
the attention kernel instead of SDPA (the mask then not repeated: grouped rows share their
position's row of it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache

from specdec.introspect import attention_shape, float_dtype
from specdec.kv.blocks import BlockInputs, block_bias, causal
from specdec.kv.bmc import BMCCache, BMCConfig
from specdec.kv.static import StaticCache
from specdec import fastpath
from specdec.quant.numerics import Numerics, numerics_of
from specdec.runtime.attention import block_scope, grouped_attention, prompt_kernel, prompt_scope, split_attention

PAD, SPLIT = "specdec_pad", "specdec_split"  # the attention implementation names the blocks run under


AttentionInterface.register(PAD, grouped_attention)
AttentionInterface.register(SPLIT, split_attention)


def cache_arg(module) -> str:
    """The name ``module.forward`` takes its KV cache under: ``cache`` from transformers 5.24 on
    (``past_key_values`` there is deprecated, with a FutureWarning per call), ``past_key_values`` before."""
    name = _CACHE_ARG.get(type(module))
    if name is None:
        params = inspect.signature(type(module).forward).parameters
        name = _CACHE_ARG[type(module)] = "cache" if "cache" in params else "past_key_values"
    return name


_CACHE_ARG: dict[type, str] = {}


@dataclass(frozen=True)
class BlockOutput:
    logits: torch.Tensor  # [B, Q, V]
    # [B, Q, D] last hidden state (after the final norm), if asked; [B, Q, D * len(layers)] with layers
    hidden: torch.Tensor | None


def hidden_of(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """HF's ``output_hidden_states`` -> the last one (after the final norm), or with ``layers`` the
    residual stream entering each named layer (``hidden_states[j]``), concatenated: [B, Q, D * len(layers)]."""
    return torch.cat([hidden_states[j] for j in layers], dim=-1) if layers else hidden_states[-1]


@torch.inference_mode()
def forward_block(model, cache: BMCCache, input_ids: torch.Tensor, block_mask: torch.Tensor | None,
                  depth: torch.Tensor | None, want_hidden: bool = False, split: bool = False,
                  layers: tuple[int, ...] = (), head=None, last_only: bool = False,
                  unread: torch.Tensor | None = None, vocab: torch.Tensor | None = None) -> BlockOutput:
    """input_ids [B, Q]; block_mask [B, Q, Q] bool; depth [B, Q] position offsets within the block.

    block_mask = depth = None means a causal block (chain, plain decode): the store's fast path.
    split: SPLIT attention (per row over its own length) instead of PAD.
    layers: with want_hidden, the layers whose inputs to return instead of the last hidden state
    (``hidden_of``; EAGLE-3).
    head: an output layer in the model's place (a draft's ``drafters.vocab.VocabHead``); where HF's forward
    runs, its full logits restricted as that head restricts them.
    last_only: logits of the last row only [B, 1, V] (a prefill chunk: the output layer over every row
    would cost more than the chunk's attention).
    unread: [B, Q] bool, rows whose logits the caller will not read (a grammar allows one token there): the
    lean forward leaves them zeros instead of running the output layer over them; other paths compute them.
    vocab: the groups of 16 token ids whose logits are read (``judging.read_groups``): an int8 output layer
    on the lean forward computes those alone, zeros elsewhere; other paths compute every logit.
    """
    if isinstance(cache, StaticCache):
        return static_block(model, cache, input_ids, block_mask, depth, keep=layers if want_hidden else None,
                            head=head)
    if block_mask is None:
        inputs = cache.prepare_chain(input_ids.shape[1])
    else:
        inputs = cache.prepare(block_mask, depth)
    # every attention layer reads the implementation from the shared config at call time
    config = model.config
    saved = config._attn_implementation
    split = split and cache.batch_size > 1
    ours = split or saved == "sdpa"  # other implementations (flash, flex) are left as the user chose
    keep = layers if want_hidden else ()
    if not ours:  # flash, flex: HF's forward as the user set it up
        return _restricted(_hf_block(model, cache, input_ids, inputs, want_hidden, keep, last_only), head)
    path = fastpath.get(model, check=False)  # under the runtime the decoder's block pinned
    rows = numerics_of(model) == "int8"  # its attention a row at a time (quant.numerics)
    with block_scope([n + input_ids.shape[1] for n in cache.lengths] if split else None, rows):
        if path is not None:  # a Llama-shaped target: the same ops without HF's per-module Python
            # the cache's device is the model's (``model.device`` walks its modules at every call)
            logits, hidden = path(cache, input_ids.to(cache.device), inputs.position_ids, inputs.attention_mask,
                                  split_attention if split else grouped_attention, keep=keep, head=head,
                                  logits_rows=1 if last_only else None, unread=unread, vocab=vocab)
            return BlockOutput(logits, hidden if want_hidden else None)
        config._attn_implementation = SPLIT if split else PAD  # HF's layers look the function up
        try:
            return _restricted(_hf_block(model, cache, input_ids, inputs, want_hidden, keep, last_only), head)
        finally:
            config._attn_implementation = saved


def static_block(model, cache: StaticCache, input_ids: torch.Tensor, block_mask: torch.Tensor | None,
                 depth: torch.Tensor | None, keep: tuple[int, ...] | None, head=None) -> BlockOutput:
    """``forward_block`` on a static store: the block padded to its bucket (pad rows: token 0, depth 0,
    seeing the committed rows and themselves), run by ``static_step`` through the store's graphs (one
    per batch rows, bucket and output), the pad rows' outputs dropped. Always PAD attention (SPLIT
    attends at host offsets). keep: None for no hidden states, else ``forward_block``'s ``layers``.
    Example: Q 3 in buckets (1, 2, 4): ids [p a b] -> [p a b 0], logits [B, 4, V] -> [B, 3, V]."""
    B, Q = input_ids.shape
    Qb = cache.shapes.bucket(Q)
    device = cache.device
    ids = torch.zeros(B, Qb, dtype=torch.long, device=device)
    ids[:, :Q] = input_ids.to(device)
    mask = torch.eye(Qb, dtype=torch.bool, device=device).repeat(B, 1, 1)  # [B, Qb, Qb]
    mask[:, :Q, :Q] = causal(Q, device) if block_mask is None else block_mask.to(device)
    offsets = torch.zeros(B, Qb, dtype=torch.long, device=device)
    offsets[:, :Q] = torch.arange(Q, device=device) if depth is None else depth.to(device)
    cache.plan_block(Qb)
    starts = torch.tensor(cache.lengths, dtype=torch.long, device=device)  # [B]: the step's one host input
    path = fastpath.get(model, check=False)
    rows = numerics_of(model) == "int8"

    def step(ids, starts, mask, offsets):
        return static_step(model, path, cache, ids, starts, mask, offsets, keep, head, rows)

    key = (B, Qb, keep, id(head), path is not None, rows)
    logits, *hidden = cache.graphs.run(key, step, (ids, starts, mask, offsets))
    return BlockOutput(logits[:, :Q], hidden[0][:, :Q] if hidden else None)


def static_step(model, path, cache: StaticCache, ids: torch.Tensor, starts: torch.Tensor, mask: torch.Tensor,
                offsets: torch.Tensor, keep: tuple[int, ...] | None, head, rows: bool) -> tuple[torch.Tensor, ...]:
    """One target forward of a static store, every changing value a tensor (what a graph captures):
    ids [B, Q] tokens, starts [B] each row's first block row, mask [B, Q, Q] the block's visibility,
    offsets [B, Q] its rows' position offsets. Returns (logits [B, Q, V],), with ``keep`` (logits, hidden
    [B, Q, *]): a graph's outputs are a tuple of tensors."""
    B, Q = ids.shape
    cache._plan.row_index = starts[:, None] + torch.arange(Q, device=starts.device)  # [B, Q]: where the block goes
    bias = block_bias(starts, mask, cache.capacity_rows, cache.dtype)  # [B, 1, Q, C]
    position_ids = starts[:, None] + offsets
    layers = keep or ()
    with block_scope(None, rows):
        if path is not None:
            logits, hidden = path(cache, ids, position_ids, bias, grouped_attention, keep=layers, head=head)
            return (logits,) if keep is None else (logits, hidden)
        config = model.config
        saved, config._attn_implementation = config._attn_implementation, PAD
        try:
            out = _hf_block(model, cache, ids, BlockInputs(position_ids, bias), keep is not None, layers)
        finally:
            config._attn_implementation = saved
        out = _restricted(out, head)
        return (out.logits,) if keep is None else (out.logits, out.hidden)


def _restricted(out: BlockOutput, head) -> BlockOutput:
    return out if head is None else BlockOutput(head.restrict(out.logits), out.hidden)


def _hf_block(model, cache: BMCCache, input_ids: torch.Tensor, inputs, want_hidden: bool,
              layers: tuple[int, ...] = (), last_only: bool = False) -> BlockOutput:
    """``forward_block`` through HF's forward."""
    out = model(
        input_ids=input_ids.to(model.device),
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,  # 4D additive bias: HF uses it as given
        use_cache=True,
        **{cache_arg(model): cache},
        output_hidden_states=want_hidden,
        **({"logits_to_keep": 1} if last_only else {}),
    )
    hidden = hidden_of(out.hidden_states, layers) if want_hidden else None  # HF applies the final norm already
    return BlockOutput(out.logits, hidden)


@dataclass(frozen=True)
class Prefill:
    logits: torch.Tensor  # [G, V] the target's logits after each prompt's last token
    hidden: torch.Tensor | None  # [G, P, D] last hidden states at every prompt position, if asked (as BlockOutput's)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values) [G, H, P, D]


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, want_hidden: bool = False, layers: tuple[int, ...] = ()) -> Prefill:
    """G prompts of one length [G, P], exactly as HF ``generate`` prefills an unpadded batch: a
    DynamicCache, no explicit mask (SDPA's causal fast path: a 4D bias at 7k tokens took attention's
    masked path, ~2x HF's time), logits for the last position only (the lm_head over 49k tokens x P
    rows would cost more than the prompt's attention). The caller copies the K/V into its store."""
    path = _prompt_path(model)
    if path is not None:  # the lean forward: the same ops, and the hidden states without keeping every layer's
        cache = DynamicCache(config=model.config)
        logits, hidden = _lean_prompt(model, path, cache, input_ids, 1, layers if want_hidden else ())
        return Prefill(logits[:, -1], hidden if want_hidden else None,
                       [(layer.keys, layer.values) for layer in cache.layers])
    cache = DynamicCache()
    out = model(input_ids=input_ids.to(model.device), use_cache=True, output_hidden_states=want_hidden,
                logits_to_keep=1, **{cache_arg(model): cache})
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    hidden = hidden_of(out.hidden_states, layers) if want_hidden else None
    return Prefill(out.logits[:, -1], hidden, kv)


def _prompt_path(model):
    """The lean forward a prompt is prefilled through (``fastpath``; None: HF's forward): under SDPA only."""
    return fastpath.get(model, check=False) if model.config._attn_implementation == "sdpa" else None


def _lean_prompt(model, path, cache, input_ids: torch.Tensor, logits_rows: int | None, keep: tuple[int, ...],
                 start: int = 0):
    """The lean forward over prompts' rows [G, P] at positions start.. on ``cache`` (holding their first
    ``start`` rows): SDPA's causal path (start 0 only), or in int8 numerics the bf16 prompt attention where the
    build has it (``runtime.attention.prompt_attention``)."""
    G, P = input_ids.shape
    positions = torch.arange(start, start + P, dtype=torch.long, device=model.device).expand(G, P)
    with prompt_scope(numerics_of(model) is Numerics.INT8):
        return path(cache, input_ids.to(model.device), positions, None, grouped_attention,
                    logits_rows=logits_rows, keep=keep)


@torch.inference_mode()
def prompt_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits [G, P, V] for prompts [G, P], computed as ``prefill`` computes a prompt (the
    lean forward where the model has one, else HF's): what a perplexity of the decoder's prefill reads."""
    path = _prompt_path(model)
    if path is None:
        return model(input_ids=input_ids.to(model.device), use_cache=False).logits
    return _lean_prompt(model, path, DynamicCache(config=model.config), input_ids, None, ())[0]


def _cut_free(model) -> bool:
    """Whether ``model``'s prefill gives a row the same bits however its prompt is cut: int8 numerics (its
    linears batch-invariant, norms per row) with the lean forward and the prompt attention kernel."""
    if numerics_of(model) is not Numerics.INT8:
        return False
    _, _, head_dim = attention_shape(model)
    return _prompt_path(model) is not None and prompt_kernel(head_dim, float_dtype(model), model.device)


@torch.inference_mode()
def prefill_after(model, input_ids: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Prefill:
    """One prompt [P] after ``prefix`` (its first n rows' K/V per layer [H, n, D], or None) in one lean forward
    through the prompt attention (keys before the block, then its own): for a model where ``_cut_free``.
    Returns logits [1, V] after the last token and the K/V per layer [1, H, P, D]."""
    cache = DynamicCache(config=model.config)
    n = 0
    for i, (k, v) in enumerate(prefix or ()):
        cache.update(k[None].to(model.device), v[None].to(model.device), i)
        n = k.shape[1]
    logits, _ = _lean_prompt(model, _prompt_path(model), cache, input_ids[None, n:], 1, (), start=n)
    return Prefill(logits[:, -1], None, [(layer.keys, layer.values) for layer in cache.layers])


@torch.inference_mode()
def prefill_aligned(model, input_ids: torch.Tensor, block: int,
                    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Prefill:
    """One prompt [P] in forwards of ``block`` tokens starting at multiples of ``block``, each a causal
    block over the rows before it (``forward_block``), on top of ``prefix``: the K/V of its first n
    tokens, per layer [H, n, D], n a multiple of ``block`` (rows an earlier prefill made this way).

    Why: the rows and logits of a chunk are then a function of its tokens and the rows before it,
    computed by the same forward of the same shape into the same buffers whether the rows before it
    were computed now or taken from a ``kv.prefix.PrefixCache``: a reused prefix gives the bits of no
    reuse (the one-forward prefill does not: a GEMM's blocking and SDPA's causal path depend on the
    row count; docs/decisions/021-prefix-cache.md). Example, block 64, P 150, prefix of 128 rows: one
    forward over tokens 128..149; without the prefix three (0..63, 64..127, 128..149), the last the same.

    A target in int8 numerics whose prefill takes the prompt attention kernel skips the blocks: one forward
    over the rows after the prefix (``prefill_after``) gives those bits, since its every op gives a row the
    same bits however the prompt is cut (docs/decisions/019-int8-numerics.md).

    Returns logits [1, V] after the last token, no hidden states, and the K/V per layer [1, H, P, D]."""
    P = input_ids.shape[0]
    n = 0 if prefix is None else prefix[0][0].shape[1]
    assert n % block == 0 and n < P, f"a prefix of {n} rows for a prompt of {P} in blocks of {block}"
    if _cut_free(model):
        return prefill_after(model, input_ids, prefix)
    store = BMCCache.for_model(model, 1, BMCConfig(block))
    if prefix is None:  # buffers made now, as a prefix's would be: one layout, hit or miss
        num_layers, H, D = attention_shape(model)
        empty = torch.zeros(H, 0, D, dtype=float_dtype(model), device=model.device)
        prefix = [(empty, empty)] * num_layers
    store.load_prefill(0, prefix, capacity=P)  # capacity P rounded up to a block: never grown below
    ids = input_ids.to(model.device)
    for s in range(n, P, block):
        out = forward_block(model, store, ids[None, s : s + block], None, None, last_only=True)
        store.commit([list(range(min(block, P - s)))])
    return Prefill(out.logits[:, -1], None, [(layer.keys[:, :, :P], layer.values[:, :, :P]) for layer in store.layers])
