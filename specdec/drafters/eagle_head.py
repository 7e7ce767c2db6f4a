"""The EAGLE head: one layer of the target's architecture over its features, and its files.

References: see ``drafters.eagle``.

The head (``EagleHead``), as in EAGLE-1/2::

    f_t   target last hidden state at position t (after the final norm), [D]
    x_t+1 the token that follows position t
    h_t = layer(fc([embed(x_t+1); f_t]))      predicts f_t+1;  lm_head(h_t) predicts x_t+2

``fc`` is Linear(2D -> D), embedding first then feature (EAGLE's order); ``layer`` is one decoder
layer of the target's own architecture, built from its config class, without its input norm (EAGLE
drops it: fc's output enters attention directly); the output goes to the target's lm_head with no
final norm. The embedding, rotary embedding and lm_head are the target's own, frozen, and are not
part of the head's weights. Optionally the head drafts from a reduced vocabulary: the M most
frequent tokens of its training data (``draft_vocab``: draft index -> target id).

Files:
    save_head(head, dir)  ->  dir/eagle_head.safetensors + dir/eagle_head.json (our format)
    export_eagle(head, dir) -> EAGLE's checkpoint layout:
        config.json         the target's text config with num_hidden_layers = 1, "bias": fc has bias
        model.safetensors   fc.weight [D, 2D], fc.bias [D] (when "bias"),
                            layers.0.self_attn.{q,k,v,o}_proj.weight (+ .bias where the target's
                            attention has biases), layers.0.mlp.{gate,up,down}_proj.weight,
                            layers.0.post_attention_layernorm.weight
                            (no layers.0.input_layernorm: EAGLE-1/2 have none; no embed_tokens:
                            EAGLE loads the base model's; a reduced draft vocabulary is
                            dropped, with a warning). EAGLE's older loaders read
                            pytorch_model.bin; we never write pickles, convert if you need one.
    import_eagle(dir, target) reads that layout back (e.g. a public EAGLE-1/2 head for a target).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from specdec.runtime import kernels
from specdec.forward import cache_arg
from specdec.introspect import text_config, vocab_size_of
from specdec.quant.modules import weight_rows

HEAD_FORMAT = 1  # bump when eagle_head.json / the tensor names change
HEAD_FILE, HEAD_JSON = "eagle_head.safetensors", "eagle_head.json"


@dataclass(frozen=True)
class EagleHeadConfig:
    fc_bias: bool = True  # EAGLE-1 trains fc with a bias (its LLaMA-3 heads: without)
    input_norm: bool = False  # EAGLE-1/2 remove the decoder layer's input norm
    feature_noise: float = 0.2  # training only: uniform noise (+-noise/2) on input features, as EAGLE



def _decoder(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


class _TargetParts:
    """The target's frozen modules the head borrows. Deliberately not an nn.Module: they stay out of
    the head's parameters, state dict, optimizer and ``.to()``."""

    def __init__(self, target) -> None:
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.rotary = _decoder(target).rotary_emb
        # a rotary module with a table per layer type (Gemma 3's rope_type dict) is asked for the type of
        # the head's one layer, the target's first (EagleHead builds it from layer_types[:1])
        types = getattr(text_config(target), "layer_types", None)
        self.rotary_kwargs = {"layer_type": types[0]} if isinstance(getattr(self.rotary, "rope_type", None), dict) \
            and types else {}

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None):
        """What a head's layer takes beside its hidden states [B, S, D]: the frozen embeddings of tokens
        [B, S], the attention bias (None: causal over the S rows) and the rotary table at position_ids."""
        B, S, _ = hidden.shape
        assert tokens.shape == (B, S) and position_ids.shape == (B, S), \
            f"tokens {tuple(tokens.shape)}, positions {tuple(position_ids.shape)} vs hidden {(B, S)}"
        with torch.no_grad():  # the target's embedding is frozen
            emb = self.embed(tokens).to(hidden.dtype)
        if attention_mask is None:
            attention_mask = causal_bias(B, S, hidden.dtype, hidden.device)
        return emb, attention_mask, self.rotary(hidden, position_ids, **self.rotary_kwargs)


class EagleHead(nn.Module):
    def __init__(self, target, config: EagleHeadConfig = EagleHeadConfig(),
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        tcfg = text_config(target)
        D = tcfg.hidden_size
        layer_cfg = copy.deepcopy(tcfg)
        layer_cfg.num_hidden_layers = 1
        if getattr(layer_cfg, "layer_types", None) is not None:
            layer_cfg.layer_types = layer_cfg.layer_types[:1]
        self.fc = nn.Linear(2 * D, D, bias=config.fc_bias)
        # one decoder layer of the target's own class: no copied modeling code, any architecture
        # whose layers take (hidden, attention_mask, position_ids, past_key_values, ...) works
        self.layer = type(_decoder(target).layers[0])(layer_cfg, layer_idx=0)
        if not config.input_norm:
            self.layer.input_layernorm = nn.Identity()
        self.target_config = tcfg  # for save/export: what the head was built for
        V = vocab_size_of(target)
        if draft_vocab is not None:
            draft_vocab = draft_vocab.long().reshape(-1)
            if draft_vocab.numel() == 0 or int(draft_vocab.min()) < 0 or int(draft_vocab.max()) >= V:
                raise ValueError(f"draft_vocab ids must lie in [0, {V})")
            self.register_buffer("draft_vocab", draft_vocab)  # [M] draft index -> target id
        else:
            self.draft_vocab = None
        self.vocab_size = V
        self.to(dtype=target.dtype, device=target.device)
        self._target = _TargetParts(target)
        self._lm_weight: torch.Tensor | None = None  # [M, D] lm_head rows of the draft vocabulary

    @property
    def hidden_size(self) -> int:
        return self.fc.out_features

    @property
    def feature_size(self) -> int:
        """Width of the target features a committed position carries (the last hidden state's)."""
        return self.fc.out_features

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> the head's feature input: the same (EAGLE-3's head fuses three layers)."""
        return features

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """features [B, S, D], tokens [B, S] (token t follows feature t), position_ids [B, S],
        attention_mask [B, 1, S, L] additive bias (None: causal over the S rows, training) ->
        head outputs [B, S, D]."""
        emb, attention_mask, rope = self._target.inputs(features, tokens, position_ids, attention_mask)
        x = self.fc(torch.cat([emb, features], dim=-1))  # [B, S, D]
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, use_cache=cache is not None,
                         position_embeddings=rope, **{cache_arg(self.layer): cache})
        return out[0] if isinstance(out, tuple) else out

    def draft(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
              attention_mask: torch.Tensor, cache, last: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` for drafting (the head's modules; EAGLE-3's head has a lean path here); ``last``
        [B]: only row ``last[b]``'s output ([B, 1, D], as ``Eagle3Head.draft``)."""
        return rows_at(self(features, tokens, position_ids, attention_mask, cache), last)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., M] over the draft vocabulary (M = V without a reduced vocabulary)."""
        if self.draft_vocab is None:
            return self._target.lm_head(hidden)
        if self._lm_weight is None or self._lm_weight.device != hidden.device:
            # a copy of M rows, made once: indexing the full matrix every call would copy each time
            with torch.inference_mode(False):  # a normal tensor: training may use it after drafting
                self._lm_weight = weight_rows(self._target.lm_head, self.draft_vocab).to(hidden.device)
        return kernels.linear(hidden, self._lm_weight.to(hidden.dtype))

    def target_logits(self, hidden: torch.Tensor, full_vocab: bool = False) -> torch.Tensor:
        """The target's own lm_head on features: [..., D] -> [..., M] (or [..., V] if full_vocab)."""
        with torch.no_grad():
            full = self._target.lm_head(hidden)
        return full if full_vocab or self.draft_vocab is None else full[..., self.draft_vocab]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]


def rows_at(h: torch.Tensor, last: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """Row ``last[b]`` along ``dim`` of each sequence b (h's first dim), that dim then of size 1 (h itself
    where ``last`` is None). Example: h [B, S, D], dim 1 -> [B, 1, D]; q [B, H, Q, Dh], dim 2 -> [B, H, 1, Dh]."""
    if last is None:
        return h
    shape = list(h.shape)
    shape[dim] = 1
    return h.gather(dim, last.view(-1, *[1] * (h.dim() - 1)).expand(shape))


def causal_bias(B: int, S: int, dtype: torch.dtype, device, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, S, S] additive causal bias; with ``lengths`` [B], keys past a row's length are hidden
    too (a fully hidden query row still sees key 0, so no row softmaxes over nothing)."""
    visible = torch.ones(S, S, dtype=torch.bool, device=device).tril()[None].expand(B, S, S)
    if lengths is not None:
        visible = visible & (torch.arange(S, device=device)[None, None, :] < lengths.to(device)[:, None, None])
        visible = visible.clone()
        visible[:, :, 0] = True
    bias = torch.zeros(B, 1, S, S, dtype=dtype, device=device)
    return bias.masked_fill_(~visible[:, None], torch.finfo(dtype).min)



# ---------------------------------------------------------------------------------------- files

def save_head(head: EagleHead, path: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``eagle_head.safetensors`` + ``eagle_head.json`` into directory ``path``; ``dtype``
    (e.g. bf16, half the size) stores the weights in that type, loading casts them back."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype)
               .contiguous().cpu() for k, v in head.state_dict().items()}
    tcfg = head.target_config
    meta = {
        "format": HEAD_FORMAT,
        "head": asdict(head.config),
        "target": {"model_type": tcfg.model_type, "hidden_size": tcfg.hidden_size,
                   "vocab_size": head.vocab_size, "layer_class": type(head.layer).__name__},
        "draft_vocab_size": None if head.draft_vocab is None else int(head.draft_vocab.numel()),
    }
    tmp = d / (HEAD_FILE + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, d / HEAD_FILE)  # atomic: a checkpoint is either old or new, never half written
    (d / HEAD_JSON).write_text(json.dumps(meta, indent=1))
    return d


def load_head(path: str | os.PathLike, target) -> EagleHead:
    """Read a head written by ``save_head`` for ``target``; the error names what does not fit."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / HEAD_JSON).is_file() or not (d / HEAD_FILE).is_file():
        raise FileNotFoundError(f"no EAGLE head in {d} (expected {HEAD_JSON} and {HEAD_FILE})")
    meta = json.loads((d / HEAD_JSON).read_text())
    if meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{d / HEAD_JSON}: head format {meta.get('format')}, this specdec reads {HEAD_FORMAT}")
    tcfg = text_config(target)
    want = meta["target"]
    have = {"model_type": tcfg.model_type, "hidden_size": tcfg.hidden_size,
            "vocab_size": vocab_size_of(target),
            "layer_class": type(_decoder(target).layers[0]).__name__}
    bad = [f"{k} {want[k]} (head) != {have[k]} (target)" for k in have if want.get(k) != have[k]]
    if bad:
        raise ValueError(f"EAGLE head in {d} was trained for another target: " + "; ".join(bad))
    tensors = load_file(str(d / HEAD_FILE))
    known = {f.name for f in fields(EagleHeadConfig)}
    head = EagleHead(target, EagleHeadConfig(**{k: v for k, v in meta["head"].items() if k in known}),
                     tensors.get("draft_vocab"))
    head.load_state_dict(tensors, strict=True)
    return head.eval()


def _eagle_names(head: EagleHead) -> dict[str, str]:
    """Our state-dict names -> EAGLE's (``layer.X`` -> ``layers.0.X``, ``fc.*`` unchanged)."""
    return {k: ("layers.0." + k[len("layer."):] if k.startswith("layer.") else k)
            for k in head.state_dict() if k != "draft_vocab"}


def export_eagle(head: EagleHead, path: str | os.PathLike) -> Path:
    """Write the head in EAGLE-1/2's checkpoint layout (see the module docstring)."""
    from safetensors.torch import save_file

    if head.draft_vocab is not None:
        warnings.warn("EAGLE-1/2 checkpoints have no reduced draft vocabulary: the exported head drafts "
                      "over the target's full vocabulary (its feature regression does not depend on it)",
                      stacklevel=2)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    state = head.state_dict()
    save_file({new: state[old].detach().contiguous().cpu() for old, new in _eagle_names(head).items()},
              str(d / "model.safetensors"))
    cfg = head.target_config.to_dict()
    cfg.update(num_hidden_layers=1, bias=head.config.fc_bias)
    cfg.pop("layer_types", None)
    (d / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    return d


def import_eagle(path: str | os.PathLike, target) -> EagleHead:
    """Read an EAGLE-1/2 checkpoint (config.json + model.safetensors) as an ``EagleHead``."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors in {d} (pickled pytorch_model.bin is not read)")
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    tensors = load_file(str(d / "model.safetensors"))
    if tensors["fc.weight"].shape[1] != 2 * text_config(target).hidden_size:
        raise ValueError(f"{d}: fc.weight {tuple(tensors['fc.weight'].shape)} is not an EAGLE-1/2 head "
                         f"for hidden size {text_config(target).hidden_size}")
    head = EagleHead(target, EagleHeadConfig(fc_bias=bool(cfg.get("bias", "fc.bias" in tensors)),
                                             input_norm="layers.0.input_layernorm.weight" in tensors))
    names = {new: old for old, new in _eagle_names(head).items()}
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise ValueError(f"{d}: EAGLE checkpoint lacks {', '.join(missing)}")
    head.load_state_dict({names[k]: v for k, v in tensors.items() if k in names}, strict=True)
    return head.eval()
