#!/usr/bin/env bash
# Creates (or completes) the virtual environment and installs the workspace into it.
# CPU-only machines get the CPU build of torch (the 2.13.0 wheel that lies on disk here);
# machines with an NVIDIA driver get the default CUDA build from the package index and the
# runtime's `gpu` extra.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
[ -d /opt/wheels ] && pip+=(--find-links /opt/wheels)
runtime=packages/ninfer-runtime
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" "torch>=2.6"
  runtime="$runtime[gpu]"  # fla-core's GDN prompt kernels (ops.gdn.prompt_kernels)
else
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" \
  -e "$runtime" -e packages/ninfer-convert \
  -e packages/ninfer-serve -e packages/ninfer-bench \
  -e ".[test]"
touch "$venv/.installed"
