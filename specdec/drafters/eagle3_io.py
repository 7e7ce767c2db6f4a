"""EAGLE-3 heads on disk: the layouts serving engines load, safetensors only (never pickles).

    save_eagle3(head, dir, layout)   ->  dir/config.json + dir/model.safetensors
    load_eagle3(dir, target)         ->  an Eagle3Head for ``target`` (layout read from config.json)

Layouts (config.json; the weights' names)::

    "vllm"         architectures ["Eagle3LlamaForCausalLM"] (vLLM's llama_eagle3): a Llama config of the
                   head's one layer (num_hidden_layers 1, vocab_size = the target's) plus draft_vocab_size,
                   target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids;
                   fc.weight [D, 3D], midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
                   .weight, midlayer.self_attn.{q,k,v}_proj.weight [., 2D], .o_proj, midlayer.mlp.*,
                   norm.weight, lm_head.weight [M, D], d2t [M] int64, t2d [V] bool (embed_tokens
                   optional: the target's is used, a stored one must equal it)
    "sglang"       the same tensors, architectures ["LlamaForCausalLMEagle3"], "bias" for fc's bias
    "speculators"  architectures ["Eagle3Speculator"], speculators_model_type "eagle3", the layer's
                   config nested under transformer_layer_config, speculators_config naming the
                   verifier; the layer's tensors under layers.0.* instead of midlayer.*

The aux layer ids mean different things in the engines: vLLM captures the input of layer j (our
``aux_layers``), SGLang adds 1 (the output of layer j). Both pick (2, N/2, N-3) inputs when the key is
absent, so the key is written only for other layers, in the layout's own convention.
Our own extra keys (ignored by the engines): target_num_hidden_layers, target_model_type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdec.drafters.eagle3_head import Eagle3Head, Eagle3HeadConfig, default_aux_layers
from specdec.introspect import text_config, vocab_size_of

WEIGHTS, CONFIG = "model.safetensors", "config.json"
ARCHITECTURES = {"vllm": "Eagle3LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle3",
                 "speculators": "Eagle3Speculator"}
LAYOUTS = tuple(ARCHITECTURES)
_LAYER_PREFIX = {"vllm": "midlayer.", "sglang": "midlayer.", "speculators": "layers.0."}
_AUX_SHIFT = {"vllm": 0, "sglang": -1, "speculators": 0}  # written id = our id + shift


def _layer_config(head: Eagle3Head) -> dict:
    """The Llama config of the head's one layer, as the engines build it."""
    cfg = head.layer_config.to_dict()
    for key in ("layer_types", "architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    cfg.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
               vocab_size=head.vocab_size, torch_dtype=str(head.fc.weight.dtype).removeprefix("torch."))
    return cfg


def _eagle3_keys(head: Eagle3Head, layout: str) -> dict:
    N = head.target_config.num_hidden_layers
    keys = {"draft_vocab_size": int(head.d2t.numel()), "target_hidden_size": head.target_config.hidden_size,
            "norm_before_residual": head.config.norm_before_residual,
            "target_num_hidden_layers": N, "target_model_type": head.target_config.model_type}
    if head.aux_layers != default_aux_layers(N) or default_aux_layers(N) != (2, N // 2, N - 3):
        shifted = [j + _AUX_SHIFT[layout] for j in head.aux_layers]
        if min(shifted) < 0:
            raise ValueError(f"the {layout} layout cannot name the embeddings (aux layer 0) as a fused layer")
        keys["eagle_aux_hidden_state_layer_ids"] = shifted
    return keys


def save_eagle3(head: Eagle3Head, path: str | os.PathLike, layout: str = "vllm",
                dtype: torch.dtype | None = None, proposals: int = 3) -> Path:
    """Write ``head`` in ``layout`` (one of LAYOUTS) into directory ``path``; ``dtype`` (e.g. bf16) stores
    the floating weights in that type; ``proposals``: speculators' speculative_tokens."""
    from safetensors.torch import save_file

    if layout not in ARCHITECTURES:
        raise ValueError(f"EAGLE-3 layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    if head.config.fc_bias and layout == "vllm":
        raise ValueError("vLLM's EAGLE-3 fc has no bias: write this head in the sglang layout")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    prefix = _LAYER_PREFIX[layout]
    tensors = {}
    for k, v in head.state_dict().items():
        v = v.detach().to(dtype if dtype is not None and v.is_floating_point() else v.dtype)
        tensors[prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k] = v.contiguous().cpu()
    layer = _layer_config(head)
    if layout == "speculators":
        cfg = {"architectures": [ARCHITECTURES[layout]], "speculators_model_type": "eagle3",
               "transformer_layer_config": layer, **_eagle3_keys(head, layout),
               "speculators_config": {
                   "algorithm": "eagle3", "default_proposal_method": "greedy",
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": proposals}],
                   "verifier": {"name_or_path": getattr(head.target_config, "_name_or_path", None) or None,
                                "architectures": list(getattr(head.target_config, "architectures", None) or [])}}}
    else:
        cfg = {**layer, "architectures": [ARCHITECTURES[layout]], **_eagle3_keys(head, layout)}
        if layout == "sglang":
            cfg["bias"] = head.config.fc_bias
    tmp = d / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, d / WEIGHTS)  # atomic: a checkpoint is either old or new, never half written
    tmp = d / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=1, default=str))
    os.replace(tmp, d / CONFIG)
    return d


def read_layout(cfg: dict) -> str:
    """The layout a config.json is in: speculators by its nested layer config, else by architecture."""
    if "transformer_layer_config" in cfg or cfg.get("speculators_model_type") == "eagle3":
        return "speculators"
    arch = (cfg.get("architectures") or [None])[0]
    by_arch = {a: layout for layout, a in ARCHITECTURES.items()}
    if arch not in by_arch:
        raise ValueError(f"config.json names architecture {arch!r}, not an EAGLE-3 head "
                         f"({', '.join(ARCHITECTURES.values())})")
    return by_arch[arch]


def _check_fits(d: Path, cfg: dict, layer: dict, target) -> None:
    """Refuse, by name, a head whose target differs from ``target``."""
    tcfg = text_config(target)
    have = {"hidden size": tcfg.hidden_size, "vocabulary": vocab_size_of(target),
            "layer count": tcfg.num_hidden_layers}
    want = {"hidden size": cfg.get("target_hidden_size") or layer.get("hidden_size"),
            "vocabulary": layer.get("vocab_size"), "layer count": cfg.get("target_num_hidden_layers")}
    bad = [f"target {k} {want[k]} (head) != {have[k]} (target)" for k in have
           if want[k] is not None and want[k] != have[k]]
    if layer.get("hidden_size") not in (None, tcfg.hidden_size):
        bad.append(f"head hidden size {layer['hidden_size']} != the target's {tcfg.hidden_size} "
                   "(its embedding could not be shared)")
    if bad:
        raise ValueError(f"EAGLE-3 head in {d} was made for another target: " + "; ".join(bad))


def load_eagle3(path: str | os.PathLike, target, layout: str | None = None) -> Eagle3Head:
    """An ``Eagle3Head`` for ``target`` from a directory in any of LAYOUTS (``layout`` None: read it
    from config.json). A head made for another target (hidden size, layer count, vocabulary) is
    refused by name."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / CONFIG).is_file() or not (d / WEIGHTS).is_file():
        raise FileNotFoundError(f"no EAGLE-3 head in {d} (expected {CONFIG} and {WEIGHTS}; pickled "
                                "pytorch_model.bin is not read)")
    cfg = json.loads((d / CONFIG).read_text())
    layout = layout or read_layout(cfg)
    layer = cfg.get("transformer_layer_config", cfg) if layout == "speculators" else cfg
    _check_fits(d, cfg, layer, target)
    N = text_config(target).num_hidden_layers
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(int(j) - _AUX_SHIFT[layout] for j in ids) if ids else (2, N // 2, N - 3)
    if not all(0 <= j < N for j in aux):
        raise ValueError(f"EAGLE-3 head in {d} fuses target layers {aux} ({layout} ids {ids}); the target "
                         f"has {N} layers (a head for another target's layer count)")
    tensors = load_file(str(d / WEIGHTS))
    prefix = _LAYER_PREFIX[layout]
    state = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in tensors.items()}
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and not torch.equal(embed, target.get_input_embeddings().weight.detach().cpu().to(embed.dtype)):
        raise ValueError(f"EAGLE-3 head in {d} carries its own embed_tokens, unlike the target's: "
                         "specdec shares the target's frozen embedding")
    missing = [k for k in ("fc.weight", "lm_head.weight", "norm.weight") if k not in state]
    if missing:
        raise ValueError(f"EAGLE-3 head in {d} lacks {', '.join(missing)}")
    M = state["lm_head.weight"].shape[0]
    d2t = state.get("d2t", torch.zeros(M, dtype=torch.long)).long()
    if d2t.numel() != M:
        raise ValueError(f"EAGLE-3 head in {d}: d2t has {d2t.numel()} entries, lm_head {M} rows")
    config = Eagle3HeadConfig(aux_layers=aux, norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                              fc_bias="fc.bias" in state)
    head = Eagle3Head(target, config, torch.arange(M, dtype=torch.long) + d2t, layer)
    if "t2d" in state and not torch.equal(state["t2d"].bool(), head.t2d.cpu()):
        raise ValueError(f"EAGLE-3 head in {d}: t2d does not mark the target ids d2t maps to")
    state["d2t"], state["t2d"] = head.d2t, head.t2d
    unknown = sorted(set(state) - set(head.state_dict()))
    if unknown:
        raise ValueError(f"EAGLE-3 head in {d} has tensors this head does not: {', '.join(unknown[:5])}")
    head.load_state_dict(state, strict=True)
    return head.eval()
