#!/usr/bin/env bash
# What the machinery costs a GPU step, side by side with its count on the CPU (issue 54's
# figures, a few minutes on one GPU): the CUDA calls per step (python -m bench.host
# --cuda-route), the committed default fit (its throughput, idle and verdict), its step
# against the same model in a plain PyTorch loop (python -m bench.plain_step), the default
# callbacks' host cost against bare Lightning (python -m bench.host --device cuda), every
# callback on vs off and the sync detector's amortised cost. Each part has a time limit.
#   bash scripts/gpu_step_costs.sh [OUT_DIR]        (scripts/gpu_suite.sh runs it last)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_step_costs}"
mkdir -p "$out"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONUNBUFFERED=1
rc=0
part() {  # part SECONDS NAME COMMAND...: the command's output in OUT/NAME.txt, its tail shown
    local limit=$1 name=$2; shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1 || { echo "   (exit $?)"; rc=1; }
}
part 40 count "$py" -m bench.host --cuda-route --steps 200
grep -E "^CUDA (calls|reads) per" "$out/count.txt"
part 150 default_fit "$py" -m template.train fit --config configs/default.yaml \
    --trainer.logger.init_args.save_dir="$out/default_fit"
grep -E "throughput: |verdict: |idle between steps|^ *(data wait|sync stall|launch)|syncs|fit done in" \
    "$out/default_fit.txt" | sed 's/^[0-9:]* INFO //' | head -20
part 120 plain_step "$py" -m bench.plain_step --device cuda --repeats 2
tail -n 2 "$out/plain_step.txt"
part 100 host "$py" -m bench.host --device cuda --steps 400 --repeats 3
grep -A3 "^loop, median" "$out/host.txt"
part 160 overhead "$py" - <<'PY'
from bench import idle, syncs
o = idle.overhead("cuda", 150, 2)
print(f"every callback on vs off: {100 * o['cost']:+.1f}% [{100 * min(o['paired_costs']):+.1f}, "
      f"{100 * max(o['paired_costs']):+.1f}]; {100 * o['cost_from_step_medians']:+.1f}% by step medians")
d = syncs.measure_cost("cuda", 150, 2)
print(f"sync detector: watched step {100 * d['watched_step_cost_from_medians']:+.0f}%, "
      f"amortised {100 * d['amortised_cost_from_medians']:.2f}% (budget 1%)")
PY
grep -E "^(every callback on vs off|sync detector):" "$out/overhead.txt"
exit $rc
