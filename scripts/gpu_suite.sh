#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the default fit as `make train` runs it (its
# throughput, MFU, verdict, idle and val/acc, and the time from the command to the
# summary), the GPU tests, then the benchmark suite (python -m bench: end to end, prefetch
# overlap, idle-time accuracy, overhead, start-up) and the checkpoint writers' hold
# (python -m bench.checkpoints), tables printed last. Result files go to the directory
# given (default: runs/gpu_suite): default_fit.txt, gpu_tests.xml/.txt, bench.json,
# bench.txt, checkpoints.txt.
#
#   bash scripts/gpu_suite.sh [OUT_DIR]
#
# Uses .venv/bin/python when it exists, else python3: a machine with torch, lightning,
# torchmetrics and torchvision installed runs it (nothing is downloaded). Every GPU test
# and benchmark part is a required check: one that skips or says "not run" (without
# jsonargparse, those that run the entry point) fails the suite, and the last line says
# "required GPU checks: N run, M skipped". matplotlib is optional. On a machine without a
# network, WHEELHOUSE=dir installs the missing pieces first from a folder made elsewhere:
#   make wheelhouse WHEELHOUSE=dir SKIP='torch|torchvision|triton|nvidia-.*|cuda-.*' \
#     PLATFORM="manylinux_2_28_x86_64 manylinux_2_17_x86_64" PYTHON_VERSION=3.12
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_suite}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
if [ -n "${WHEELHOUSE:-}" ]; then
    # Against what the machine has (no lock): its own torch and lightning stay.
    "$py" -m pip install --quiet --no-index --find-links "$WHEELHOUSE" -e '.[template]' \
        || echo "warning: installing from $WHEELHOUSE failed; the entry point's tests will skip"
fi

"$py" - <<'PY'
import torch, lightning
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
      f"torch {torch.__version__}, lightning {lightning.__version__}")
PY
# The default fit first: what a user sees from `make train` (its command after the install).
fit_start=$EPOCHREALTIME
"$py" -m template.train fit --config configs/default.yaml \
    --trainer.logger.init_args.save_dir="$out/default_fit" > "$out/default_fit.txt" 2>&1
fit_rc=$?
fit_s=$(awk "BEGIN { print $EPOCHREALTIME - $fit_start }")
printf 'command to summary: %.1f s (exit %d)\n' "$fit_s" "$fit_rc" >> "$out/default_fit.txt"

"$py" -m pytest -m gpu -p no:cacheprovider -q -o addopts="-ra --strict-markers" \
    --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}
"$py" -m bench --out "$out" > "$out/bench.txt" 2>&1
bench_rc=$?
"$py" -m bench.checkpoints --device cuda --out "$out" > "$out/checkpoints.txt" 2>&1 \
    || bench_rc=1
echo
echo "== the default fit (python -m template.train fit --config configs/default.yaml):"
grep -E "throughput: |verdict: |idle between steps|^ *(data wait|sync stall|launch)|fit done in|^command to summary" \
    "$out/default_fit.txt" | sed 's/^[0-9:]* INFO //'
echo "== GPU tests: $(tail -n 1 "$out/gpu_tests.txt")"
echo "== benchmark suite (python -m bench), full log in $out/bench.txt:"
sed -n '/^claim /,$p' "$out/bench.txt" | grep . || tail -n 30 "$out/bench.txt"
echo "== checkpoint saves (python -m bench.checkpoints --device cuda):"
tail -n 6 "$out/checkpoints.txt"
echo "== step costs (bash scripts/gpu_step_costs.sh):"
bash scripts/gpu_step_costs.sh "$out/step_costs" || bench_rc=1
# Last: how many required checks ran; a skip is a failure of the suite, not a pass.
"$py" scripts/required_checks.py "$out/gpu_tests.xml" "$out/bench.txt"
checks_rc=$?
exit $(( fit_rc != 0 || tests_rc != 0 || bench_rc != 0 || checks_rc != 0 ))
