#!/usr/bin/env bash
# One budgeted EAGLE-3 run for the default model on one GPU (docs/decisions/017-eagle3.md, its data
# recipe): the target answers the project's prompts (its own list and the templated ones) greedily in
# batches, the answers' features stay in GPU memory, the head trains for a fixed time, and the head
# (vLLM's layout), the answers and the log land in $OUT.
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf OUT=out DATA_MIN=2.5 TRAIN_MIN=3 bash scripts/train_eagle3_gpu.sh
# Sampled answers beside the shipped greedy ones (the second run; docs/decisions/017-eagle3.md):
#   zcat data/eagle3_answers.jsonl.gz > greedy.jsonl
#   GGUF=... OUT=out ANSWERS=out/sampled.jsonl TEMP=0.7 WITH_ANSWERS="greedy.jsonl data/eagle_answers.jsonl" \
#       DATA_MIN=2 TRAIN_MIN=5 STEPS=4500 bash scripts/train_eagle3_gpu.sh
set -eo pipefail
: "${GGUF:?path of the target GGUF file}" "${OUT:?where the head, answers and log go}"
RUN=${RUN:-/tmp/eagle3-run}
mkdir -p "$RUN" "$OUT"
ANSWERS=${ANSWERS:-$OUT/answers.jsonl}  # new answers are appended here (greedy, or sampled at TEMP)
WITH=()
for f in ${WITH_ANSWERS-data/eagle_answers.jsonl}; do WITH+=(--with-answers "$f"); done
python3 scripts/make_eagle_prompts.py --n 20000 --seed 1 > "$RUN/templated.txt"
grep -v '^#' specdec/data/eagle_prompts.txt | cat - "$RUN/templated.txt" | awk 'NF && !seen[$0]++' > "$RUN/prompts.txt"
echo "prompts: $(wc -l < "$RUN/prompts.txt")"
python3 -m specdec.cli train-eagle --model "$GGUF" --device "${DEVICE:-cuda}" --arch eagle3 --in-memory \
    --out "$RUN" --answers "$ANSWERS" --temperature "${TEMP:-0}" --seed "${SEED:-0}" "${WITH[@]}" --prompts "$RUN/prompts.txt" \
    --num-prompts "${NUM_PROMPTS:-100000}" --data-batch-size "${DATA_BATCH:-512}" \
    --max-new-tokens "${MAX_NEW:-384}" --data-minutes "${DATA_MIN:-2.5}" \
    --steps "${STEPS:-4000}" --batch-size "${BATCH:-32}" --lr "${LR:-5e-4}" --warmup 100 --eval-every "${EVAL_EVERY:-500}" \
    --draft-vocab 8192 --ttt-steps 3 --save-minutes 60 --train-minutes "${TRAIN_MIN:-3}" --tf32 \
    2>&1 | tee "$OUT/log.txt"
python3 - "$RUN/eagle3/head" "$OUT" <<'PY'
# the head in fp16 (the project ships it so; the drafter computes in the target's dtype)
import json, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
tensors = load_file(str(src / "model.safetensors"))
save_file({k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}, str(out / "model.safetensors"))
(out / "config.json").write_text((src / "config.json").read_text())
print({k: tuple(v.shape) for k, v in tensors.items()})
PY
gzip -f "$ANSWERS"
cp "$RUN/eagle3/checkpoint/train_state.json" "$OUT/" 2>/dev/null || true
split -b 15m "$OUT/model.safetensors" "$OUT/model.safetensors.part-" && rm "$OUT/model.safetensors"  # files of <= 16 MiB
ls -la "$OUT"
