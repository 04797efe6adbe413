#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the GPU tests, then the GPU benchmarks, with
# their short tables printed last. Result files go to the directory given (default:
# runs/gpu_suite).
#
#   bash scripts/gpu_suite.sh [OUT_DIR]
#
# Uses .venv/bin/python when it exists, else python3 (a machine with torch, lightning,
# torchmetrics, torchvision and jsonargparse already installed).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_suite}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python

"$py" - <<'PY'
import torch, lightning
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
      f"torch {torch.__version__}, lightning {lightning.__version__}")
PY
"$py" -m pytest -m gpu -p no:cacheprovider -q -o addopts="-ra --strict-markers" \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
"$py" -m bench.prefetch --out "$out" > "$out/prefetch.txt" 2>&1
prefetch_rc=$?
"$py" -m bench.syncs --device cuda --out "$out" > "$out/syncs.txt" 2>&1
syncs_rc=$?
"$py" -m bench.idle --device cuda --out "$out" > "$out/idle.txt" 2>&1
idle_rc=$?
echo
echo "== GPU tests: $(tail -n 1 "$out/gpu_tests.txt")"
echo "== prefetch benchmark (python -m bench.prefetch):"
grep -A 10 "^copy of one batch" "$out/prefetch.txt" || tail -n 20 "$out/prefetch.txt"
echo "== sync detector benchmark (python -m bench.syncs --device cuda):"
grep -A 10 "^detector cost" "$out/syncs.txt" || tail -n 20 "$out/syncs.txt"
echo "== idle-time benchmark (python -m bench.idle --device cuda):"
grep -A 12 "^injected idle" "$out/idle.txt" || tail -n 20 "$out/idle.txt"
exit $(( tests_rc != 0 || prefetch_rc != 0 || syncs_rc != 0 || idle_rc != 0 ))
