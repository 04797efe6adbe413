#!/usr/bin/env bash
# The default run's levers side by side, one fit each on the same machine: the committed
# default, then one changed flag per row (a larger batch at the same optimizer steps,
# torch.compile's max-autotune, a wider model). Prints a markdown table of samples/s, MFU,
# idle, the verdict's bound, val/acc and the seconds from the command to the summary, for
# docs/BENCHMARKS.md. Run it on a GPU machine after scripts/gpu_suite.sh:
#   bash scripts/gpu_levers.sh [OUT_DIR]
# EXTRA="flags" is added to every row (EXTRA="--config configs/cpu.yaml
# --trainer.max_epochs=1 --data.synthetic_steps_per_epoch=4" checks the script on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/gpu_levers}"
py=.venv/bin/python
[ -x "$py" ] || py=python3
rows=(
  "default|"
  "batch 2048|--data.batch_size=2048"
  "compile max-autotune|--model.compile=max-autotune"
  "width 96|--model.width=96"
  "width 128|--model.width=128"
)
mkdir -p "$out" && rm -f "$out/rows.txt"
for row in "${rows[@]}"; do
  name="${row%%|*}" flags="${row#*|}"
  dir="$out/${name// /_}"
  start=$(date +%s%N)
  # shellcheck disable=SC2086  # flags are words
  "$py" -m template.train fit --config configs/default.yaml ${EXTRA:-} $flags \
      --trainer.logger.init_args.save_dir="$dir" --trainer.logger.init_args.name=run \
      > "$dir.txt" 2>&1
  echo "$name|$flags|$?|$(( ($(date +%s%N) - start) / 1000000 ))" >> "$out/rows.txt"
done
"$py" - "$out" <<'EOF'
import csv, json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"| flags | samples/s | MFU | idle | bound by | val/acc | to summary |\n|---|---|---|---|---|---|---|")
for line in (out / "rows.txt").read_text().splitlines():
    name, flags, rc, seconds = line.split("|")
    runs = sorted((out / name.replace(" ", "_") / "run").glob("version_*"))
    if rc != "0" or not runs:
        print(f"| {flags or 'default'} | failed (exit {rc}): {out}/{name.replace(' ', '_')}.txt | | | | | |")
        continue
    run = runs[-1]
    tp = json.loads((run / "throughput.json").read_text())
    idle = json.loads((run / "idle.json").read_text())["mean"].get("idle_pct")
    verdict = json.loads((run / "run.json").read_text()).get("verdict") or {}
    accs = [r["val/acc"] for r in csv.DictReader((run / "metrics.csv").open()) if r.get("val/acc")]
    rate = tp.get("samples_per_s")
    mfu = f"{100 * tp['mfu']:.1f}%" if tp.get("mfu") is not None else "n/a"
    print(f"| {flags or 'default'} | {f'{rate:,.0f}' if rate is not None else 'n/a'} | {mfu} | "
          f"{f'{idle:.1f}%' if idle is not None else 'n/a'} | {verdict.get('cause', 'n/a')} | "
          f"{f'{float(accs[-1]):.4f}' if accs else 'n/a'} | {int(seconds) / 1000:.1f} s |")
EOF
