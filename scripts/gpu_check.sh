#!/usr/bin/env bash
# The device check on a machine with a GPU, in one call: the card, `dynamix bench device` (its table and JSON)
# and the GPU tests. Writes into $OUT (default ./gpu-check). Runs from a checkout whose dependencies are
# installed (or on PYTHONPATH): bash scripts/gpu_check.sh. It runs the bench as a module: a GPU image may lack
# the dynamix command's other dependencies (gymnasium, stable-baselines3).
set -u
out="${OUT:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
"$python" - <<'PY' | tee -a "$out/card.txt"
import importlib.util, lightning, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__,
      "pynvml", importlib.util.find_spec("pynvml") is not None, "cpus", __import__("os").cpu_count())
PY
timeout "${BENCH_SECONDS:-420}" "$python" -m lightning_dynamix.bench.device --budget 150 \
    --output "$out/device.json" >"$out/device.log" 2>&1
echo "bench device exit $?" | tee -a "$out/device.log"
tail -n 16 "$out/device.log"
timeout "${TEST_SECONDS:-150}" "$python" -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu} >"$out/tests.log" 2>&1
echo "tests exit $?" | tee -a "$out/tests.log"
tail -n 15 "$out/tests.log"
