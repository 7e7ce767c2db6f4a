"""Tiny random models of the architectures people run, converted to GGUF by llama.cpp's own converter.

The packed loader is checked against files written the way users' files are written, not by the
project's own writer (``specdec.quant.write``): ``convert_hf_to_gguf.py`` of a pinned llama.cpp (the copy
vendored in the sdist of llama-cpp-python, whose sha256 is pinned below) converts each tiny model to
Q8_0. The output lands in ``tests/fixtures/gguf/`` with ``SOURCE.json`` saying what made it, and
beside each file ``NAME.ref.safetensors``: the independent reference, i.e. the original transformers
model with its matrices rounded through Q8_0 by gguf-py's quantizer (what the file holds), its logits
on a fixed prompt and its greedy continuation (HF ``generate``).

    .venv/bin/pip install sentencepiece protobuf   # the converter's tokenizer path
    .venv/bin/python scripts/make_gguf_fixtures.py [--sdist llama_cpp_python-0.3.36.tar.gz]

Without ``--sdist`` the sdist is fetched with ``pip download`` (76 MB, once). Each model: 2 layers,
hidden 64, GQA (4 query heads, 2 K/V heads), a 384-token sentencepiece vocabulary trained on the
project's own docs, every weight (norms and biases too) random and seeded, so a wrong row order, a
dropped bias or a norm read with the wrong offset all show in the logits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "gguf"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VOCAB = 384

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# fixture name -> (transformers class, config overrides)
MODELS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim * heads != hidden: read from the file
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 4096, "query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 4096, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3ForCausalLM", {"sliding_window": None, "tie_word_embeddings": False}),
}


def converter(sdist: Path | None, work: Path) -> Path:
    """The vendored llama.cpp folder of the pinned sdist, unpacked into ``work``."""
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python==0.3.36", "-d", str(work)], check=True)
        sdist = work / SDIST
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256}")
    prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix) and
                   (m.name == prefix + "convert_hf_to_gguf.py" or m.name.startswith(prefix + "conversion/")
                    or m.name.startswith(prefix + "gguf-py/"))]
        tf.extractall(work, members=members, filter="data")
    return work / prefix


def tokenizer_files(dest: Path) -> None:
    """A small sentencepiece vocabulary (the converter's first tokenizer path for every family here)."""
    import sentencepiece as spm

    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    corpus = dest / "corpus.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(dest / "tokenizer"), vocab_size=VOCAB,
                                   model_type="bpe", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                   character_coverage=1.0, byte_fallback=False, num_threads=1,
                                   minloglevel=2)
    corpus.unlink()
    (dest / "tokenizer.vocab").unlink()


def random_model(cls_name: str, overrides: dict, seed: int):
    import transformers

    cfg_cls = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(cls_name, cls_name.replace("ForCausalLM", "Config")))
    config = cfg_cls(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms and biases: far from their defaults, so a misread one shows
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if "bias" in name or "gemma" in cls_name.lower() else 1.0))
            else:
                p.normal_(0.0, 0.15)
    return model


SEED_PROMPT = [1, 17, 42, 99, 5, 230, 17, 42, 99, 5, 311, 64, 17, 42]
LEAD = 26  # the prompt is SEED_PROMPT and the model's own first LEAD greedy tokens: where a random model
# falls into a loop, the prompt holds it, so copying drafters find matches in every file
NEW_TOKENS = 40


def q8_0_rounded(model) -> None:
    """Every matrix of ``model`` replaced, in place, by its Q8_0 round trip through gguf-py's reference
    quantizer (the one the converter calls): the weights the converted file holds, in HF's own layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                w = p.detach().float().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)))


def reference(model, dest: Path) -> None:
    """The HF model's own answer on the file's weights: a prompt's logits and its greedy continuation."""
    from safetensors.torch import save_file

    def greedy(ids: torch.Tensor, n: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        ids = greedy(torch.tensor([SEED_PROMPT], dtype=torch.long), LEAD)
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
        out = greedy(ids, NEW_TOKENS)
    save_file({"prompt": ids[0], "logits": logits.contiguous(), "greedy": out[0, ids.shape[1]:].contiguous()},
              str(dest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help=f"a local {SDIST} (else pip downloads it)")
    ap.add_argument("--only", help="comma-separated fixture names")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(MODELS)
    made = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama_cpp = converter(args.sdist, work)
        for seed, name in enumerate(names):
            cls_name, overrides = MODELS[name]
            src = work / name
            src.mkdir()
            model = random_model(cls_name, overrides, seed)
            model.save_pretrained(src, safe_serialization=True)
            tokenizer_files(src)
            out = OUT / f"{name}.gguf"
            cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(src), "--outtype", "q8_0",
                   "--outfile", str(out)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{name}: the converter failed:\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            q8_0_rounded(model)
            reference(model, OUT / f"{name}.ref.safetensors")
            made[name] = {"class": cls_name, "config": {**COMMON, **overrides}, "seed": seed,
                          "sha256": hashlib.sha256(out.read_bytes()).hexdigest(), "bytes": out.stat().st_size}
            print(f"{name}: {out.stat().st_size} bytes")
    source = OUT / "SOURCE.json"
    previous = json.loads(source.read_text())["files"] if source.exists() else {}
    import transformers

    source.write_text(json.dumps({
        "converter": f"convert_hf_to_gguf.py of llama.cpp vendored in {SDIST} (sha256 {SDIST_SHA256})",
        "outtype": "q8_0", "made_by": "scripts/make_gguf_fixtures.py", "transformers": transformers.__version__,
        "torch": torch.__version__, "files": {**previous, **made}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
