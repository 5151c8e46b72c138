#!/usr/bin/env bash
# The GPU check (tests/gpu/check.py), ready for a machine with no network: nccl with one rank per
# GPU, gloo with 4 ranks sharing one GPU, the simulator beside them, %%spmd --compare between
# them, and a recorded TP MLP step drawn to PNG. Writes gpu_results.json to $OUT (when set) or
# test-artifacts/gpu/. Without a GPU it runs the CPU parts and lists what it skipped.
#
# What the machine lacks (IPython, ipyparallel, pyzmq, anywidget, ...) comes from the wheels that
# `make gpu-wheels` downloads into .gpu-wheels/ (carry it: `carry: [".gpu-wheels"]`); they are
# installed into a folder of their own, never over the machine's packages. torch is the machine's.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=${GPU_SITE:-/tmp/shardviz-gpu-site}

"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
if [ -d "$WHEELS" ]; then
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE"
else
    echo "no $WHEELS folder: using the packages this Python has (make gpu-wheels makes it)"
fi
# shardviz from this working tree (also on the engines, which inherit PYTHONPATH).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
exec timeout "${GPU_CHECK_TIMEOUT:-450}" "$PY" tests/gpu/check.py
