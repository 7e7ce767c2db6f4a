"""What a GGUF file's architecture means for loading it: the families specdec reads, checked.

llama.cpp's converter (``convert_hf_to_gguf.py``) writes each family its own way, and transformers'
GGUF reader gets some of them wrong or not at all; this table holds what each family needs, so no file
is decoded by a rule meant for another family:

- ``permuted_qk``: only the ``llama`` family's converter (Llama 2/3.x, SmolLM, Mistral, written as
  ``llama``) permutes q/k rows for llama.cpp's rotary layout; Qwen2/3, Gemma 2/3 and Phi-3 files keep
  HF's row order, so un-permuting them (what the packed loader once did to every file) scrambles the
  heads.
- ``layer_tensors``: llama.cpp's tensor name in block N -> the HF module under ``model.layers.N`` (Phi-3
  keeps q/k/v and gate/up fused in both layouts).
- config fixes, read from the file's own metadata (``fix_config``): ``head_dim`` from
  ``attention.key_length`` (Qwen3 files whose head_dim x heads != hidden fail transformers' reader);
  Gemma 2/3's query scale and soft-capping as llama.cpp uses them.
- ``rope_freqs.weight``: the per-frequency divisors of Llama 3.x rope scaling, which the converter writes
  instead of the scaling's parameters and transformers' reader drops (``rope_divisors``): applied to
  the rotary module's frequencies as llama.cpp applies them.

A file of any other architecture is refused at load with its name (``architecture_of``), never decoded
by a rule that was not checked on it. Each family has a fixture made by llama.cpp's converter
(``tests/fixtures/gguf/``, ``scripts/make_gguf_fixtures.py``), checked against the HF model it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_LLAMA_LAYER = {  # llama.cpp name in block N -> HF module under model.layers.N
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PHI3_LAYER = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class Architecture:
    name: str  # llama.cpp's ``general.architecture``
    families: str  # what people know it as, for messages and docs
    permuted_qk: bool = False  # the converter permuted q/k rows for llama.cpp's rotary layout
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LAYER))
    gemma_scale_27b_layers: int | None = None  # Gemma: query scale and soft-capping from the file, by
    # llama.cpp's rule, whose 27B model (this many layers) scales by hidden / heads instead of head_dim


ARCHITECTURES = {a.name: a for a in (
    Architecture("llama", "Llama 2 / 3.x, SmolLM, Mistral", permuted_qk=True),
    Architecture("qwen2", "Qwen2 / Qwen2.5"),
    Architecture("qwen3", "Qwen3"),
    Architecture("gemma2", "Gemma 2", gemma_scale_27b_layers=46),
    Architecture("gemma3", "Gemma 3 (text)", gemma_scale_27b_layers=62),
    Architecture("phi3", "Phi-3", layer_tensors=dict(_PHI3_LAYER)),
)}


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def architecture_of(reader, path) -> Architecture:
    """The file's architecture, or a ValueError naming it and the ones specdec reads."""
    name = _field(reader, "general.architecture")
    if name not in ARCHITECTURES:
        known = "; ".join(f"{a.name} ({a.families})" for a in ARCHITECTURES.values())
        raise ValueError(f"{path}: GGUF architecture {name!r} is not supported by specdec (supported: {known}); "
                         f"convert the model to a HF folder with safetensors to run it through transformers")
    return ARCHITECTURES[name]


def fix_config(config, reader, arch: Architecture) -> None:
    """Set, in place, what transformers' GGUF reader leaves wrong in ``config`` for this file."""
    key_length = _field(reader, f"{arch.name}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    if arch.gemma_scale_27b_layers is not None:
        # llama.cpp scales Gemma 2 / 3 queries by 1/sqrt(head_dim), except its 27B models, by
        # 1/sqrt(hidden / heads) (llama-model.cpp); transformers' reader leaves its default, 256
        if config.num_hidden_layers == arch.gemma_scale_27b_layers:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim
        for key, attr in (("attn_logit_softcapping", "attn_logit_softcapping"),
                          ("final_logit_softcapping", "final_logit_softcapping")):
            value = _field(reader, f"{arch.name}.{key}")
            if value is not None:
                setattr(config, attr, float(value))


def rope_divisors(reader) -> torch.Tensor | None:
    """The file's ``rope_freqs.weight`` (Llama 3.x rope scaling: one divisor per frequency, [Dh / 2]
    float32), or None."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    return None


def apply_rope_divisors(model: torch.nn.Module, divisors: torch.Tensor) -> None:
    """Divide every rotary module's frequencies by ``divisors`` in place, as llama.cpp does with
    ``rope_freqs`` (a frequency theta_i becomes theta_i / divisor_i)."""
    found = False
    for mod in model.modules():
        inv = getattr(mod, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and hasattr(mod, "original_inv_freq"):
            if inv.shape != divisors.shape:
                raise ValueError(f"rope_freqs has {divisors.numel()} divisors, the rotary module {inv.numel()} frequencies")
            scaled = (inv.float() / divisors.to(inv.device)).to(inv.dtype)
            mod.inv_freq = scaled
            mod.original_inv_freq = scaled.clone()
            found = True
    if not found:
        raise ValueError("the file has rope_freqs but the model has no rotary module to apply them to")
