#!/usr/bin/env bash
# The issue-19 benchmark: the default search on Gemma-3-270M (GGUF), timed, with the load average
# before and after (the build box is shared: say what else ran). Usage (repo root, venv built):
#   bash bench/gemma3_search.sh [OUT_DIR]   (default bench/results/gemma3; KVPLAN_COMMIT=... stamps a run
#   made from a copy without .git)
# Writes OUT_DIR/plan.yaml (+ .trials.csv / .search.json), search.log, time.txt, run.txt. The recorded run
# (bench/gemma3.md) used the default --processes (2 on the 2-core box, one torch thread each).
set -euo pipefail
OUT=${1:-bench/results/gemma3}
mkdir -p "$OUT"
GGUF=$(.venv/bin/python -c "from kvplan.models.loading import gemma3_model_path; import os; print(os.path.join(*gemma3_model_path()))")
COMMIT=${KVPLAN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
CMD=(.venv/bin/kvplan search --model "$GGUF" --budget 2.5bpv --out "$OUT/plan.yaml")
{
  echo "commit: $COMMIT"
  echo "command: OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset} ${CMD[*]}"
  echo "start: $(date -u +%FT%TZ)  load average: $(cut -d' ' -f1-3 /proc/loadavg)  cores: $(nproc --all)"
} > "$OUT/run.txt"
/usr/bin/time -v -o "$OUT/time.txt" "${CMD[@]}" > "$OUT/search.log" 2>&1 && rc=0 || rc=$?
{
  echo "end: $(date -u +%FT%TZ)  load average: $(cut -d' ' -f1-3 /proc/loadavg)  rc: $rc"
  grep -E "Elapsed \(wall|Maximum resident" "$OUT/time.txt"
} >> "$OUT/run.txt"
