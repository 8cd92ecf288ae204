#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs PyTorch (CPU wheel) into a virtual environment under build/ for `attention_cpu --peer torch`.
# Never touches the system Python. Usage: bench/torch_peer/install.sh [VENV_DIR]   (default build/torch-venv)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$root/build/torch-venv}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# The CPU wheel avoids the multi-GB CUDA packages; fall back to PyPI's default wheel (it runs on the CPU).
if ! "$venv/bin/python" -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch; then
  echo "CPU wheel index unavailable; installing torch from PyPI" >&2
  "$venv/bin/python" -m pip install --quiet torch
fi
"$venv/bin/python" -m pip install --quiet numpy  # torch warns at import without it
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "threads", torch.get_num_threads())'
