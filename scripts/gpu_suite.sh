#!/usr/bin/env bash
# Everything that needs a GPU, within a total time (SUITE_S, default 480 s), in the order of
# value: the default fit as `make train` runs it, the GPU tests, the default callbacks' host
# cost on CUDA, end to end against plain Lightning, checkpoint saves, then the rest of the
# benchmark suite and the step costs. Each part has its own limit (cut to what the total
# leaves) and prints its table as soon as it ends, so a cut loses only the tail; a part the
# total leaves no time for says "not run". Result files go to the directory given
# (default: runs/gpu_suite).
#
#   bash scripts/gpu_suite.sh [OUT_DIR]          SUITE_S=600 for more time
#
# Uses SUITE_PYTHON if given, else .venv/bin/python when it exists, else python3: a
# machine with torch, lightning, torchmetrics and torchvision installed runs it (nothing is
# downloaded). Every GPU test and benchmark part is a required check: one that skips or
# says "not run" fails the suite, and the last line says "required GPU checks: N run, M
# skipped". On a machine without a network, WHEELHOUSE=dir installs the missing pieces
# first from a folder made elsewhere (README, "Development": make wheelhouse, then one call).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_suite}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
py=${SUITE_PYTHON:-$py}
export PYTHONUNBUFFERED=1
budget=${SUITE_S:-480}
kill_after=${KILL_AFTER_S:-20}  # a part's SIGKILL after its SIGTERM, inside the total
shortest=${SHORTEST_PART_S:-15}  # a part given less is not started
start=$SECONDS
rc=0
rm -f "$out/not_run.txt"
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

# part LIMIT NAME SHOW COMMAND...: run COMMAND (output in OUT/NAME.txt) for at most LIMIT
# seconds or what the total leaves, then SHOW (a command printing its table).
part() {
    local limit=$1 name=$2 show=$3; shift 3
    local left=$((budget - (SECONDS - start) - kill_after))
    ((left < limit)) && limit=$left
    if ((limit < shortest)); then
        echo "== $name: not run (the suite's ${budget} s were spent)" | tee -a "$out/not_run.txt"
        rc=1
        return
    fi
    echo "== $name (at most ${limit} s): $*"
    local t0=$SECONDS
    # SIGTERM first (a fit saves and stops at its next check), SIGKILL kill_after s later
    timeout -k "$kill_after" "$limit" "$@" > "$out/$name.txt" 2>&1
    local code=$?
    ((code == 124 || code == 137)) && echo "   $name: not run in full (cut at ${limit} s)" \
        | tee -a "$out/not_run.txt"
    ((code != 0)) && rc=1
    eval "$show"
    echo "   ($((SECONDS - t0)) s, exit $code)"
}

fit_table() {
    grep -E "throughput: |verdict: |idle between steps|^ *(data wait|sync stall|launch)|fit done in" \
        "$out/default_fit.txt" | sed 's/^[0-9:]* INFO //'
}
part 150 default_fit fit_table "$py" -m template.train fit --config configs/default.yaml \
    --trainer.logger.init_args.save_dir="$out/default_fit"

part 240 gpu_tests 'tail -n 1 "$out/gpu_tests.txt"' "$py" -m pytest -m gpu -p no:xdist \
    -p no:cacheprovider -q -o addopts="-ra --strict-markers" --junitxml="$out/gpu_tests.xml"

part 90 host_cost 'tail -n 8 "$out/host_cost.txt"' "$py" -m bench.host --device cuda \
    --out "$out"

bench_table() { sed -n '/^claim /,$p' "$out/$1.txt" | grep . || tail -n 5 "$out/$1.txt"; }
part 120 end_to_end 'bench_table end_to_end' "$py" -m bench --only end_to_end --out "$out"

part 90 checkpoints 'tail -n 6 "$out/checkpoints.txt"' "$py" -m bench.checkpoints \
    --device cuda --out "$out"

part 150 bench_rest 'bench_table bench_rest' "$py" -m bench \
    --only prefetch,idle_accuracy,overhead,detector_cost,startup --out "$out"

part 120 step_costs 'tail -n 12 "$out/step_costs.txt"' bash scripts/gpu_step_costs.sh \
    "$out/step_costs"

# Last: how many required checks ran; a skip, a cut or a part not run fails the suite.
cat "$out"/end_to_end.txt "$out"/bench_rest.txt "$out"/not_run.txt > "$out/bench.txt" 2>/dev/null
"$py" scripts/required_checks.py "$out/gpu_tests.xml" "$out/bench.txt" || rc=1
echo "suite: $((SECONDS - start)) s of ${budget} s"
exit $rc
