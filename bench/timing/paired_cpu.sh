#!/usr/bin/env bash
# Paired timing on a shared CPU: the same kernels evaluated N times each by two evaluators on this machine, one that
# times the candidate and a fresh baseline in alternating rounds (paired, the CPU default) and one whose speedups are
# against the baseline cached at the task's first evaluation (unpaired), while a second kforge job runs beside them
# the whole time. The evaluations alternate between the two evaluators, so both meet the same load. The machine's
# load (/proc/loadavg and the CPUs' busy share, each second) is recorded beside the results.
#
#   bench/timing/paired_cpu.sh OUT_DIR [N]      (after scripts/setup.sh; N defaults to 10)
#
# TASKS (default "relu layer_norm") names the example tasks; each is evaluated with its first candidate.
#
# Writes OUT_DIR/evaluations.jsonl (one line per evaluation), OUT_DIR/load.tsv, OUT_DIR/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/timing/paired_cpu.sh OUT_DIR [N]}
n=${2:-10}
kforge=$PWD/target/release/kforge
mkdir -p "$out"
out=$(cd "$out" && pwd)
: > "$out/evaluations.jsonl"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# The machine's load each second: 1-minute load average and the share of CPU time busy since the last line.
(
  printf 'unix_time\tloadavg_1m\tbusy_share\n'
  read -r _ u1 n1 s1 i1 w1 q1 sq1 _ < /proc/stat
  while sleep 1; do
    read -r _ u2 n2 s2 i2 w2 q2 sq2 _ < /proc/stat
    busy=$(( (u2 + n2 + s2 + q2 + sq2) - (u1 + n1 + s1 + q1 + sq1) ))
    idle=$(( (i2 + w2) - (i1 + w1) ))
    printf '%s\t%s\t%s\n' "$(date +%s)" "$(cut -d' ' -f1 /proc/loadavg)" \
      "$(awk -v b="$busy" -v i="$idle" 'BEGIN { printf "%.2f", (b + i) ? b / (b + i) : 0 }')"
    u1=$u2 n1=$n2 s1=$s2 i1=$i2 w1=$w2 q1=$q2 sq1=$sq2
  done
) > "$out/load.tsv" &
pids+=($!)

# Two evaluators: paired (the default) and unpaired, each with a work directory of its own.
serve() {
  local name=$1 port=$2 paired=$3
  KFORGE__EVALUATOR__SERVER__LISTEN=127.0.0.1:$port KFORGE__EVALUATOR__WORK_DIR=$out/work-$name \
    KFORGE__EVALUATOR__PAIRED_TIMING__ON=$paired "$kforge" serve evaluator > "$out/$name.log" 2>&1 &
  pids+=($!)
}
serve paired 50161 cpu
serve unpaired 50162 off
for port in 50161 50162; do
  for _ in $(seq 600); do
    "$kforge" call Evaluator/GetCapabilities --addr "http://127.0.0.1:$port" </dev/null >/dev/null 2>&1 && break
    sleep 0.5
  done
done

# The second job: `kforge run` on the examples, again and again, each in a fresh work directory (its compiles and
# evaluations all run again).
(
  round=0
  while :; do
    round=$((round + 1))
    "$kforge" run --work-dir "$out/beside/$round" > "$out/beside-$round.log" 2>&1 || true
    rm -rf "$out/beside/$round"
  done
) &
pids+=($!)
sleep 20 # the second job under way: its first compiles

for task in ${TASKS:-relu layer_norm}; do
  candidate=$(ls examples/tasks/$task/candidates/*.py | head -n1)
  for i in $(seq "$n"); do
    for mode in paired unpaired; do
      port=$([[ $mode == paired ]] && echo 50161 || echo 50162)
      started=$(date +%s.%N)
      "$kforge" eval --task "examples/tasks/$task/task.py" --candidate "$candidate" --backend cpu --json \
        --addr "http://127.0.0.1:$port" > "$out/last.json" 2> "$out/last.err" || true
      ended=$(date +%s.%N)
      python3 - "$out/last.json" "$task" "$mode" "$i" "$started" "$ended" "$(cut -d' ' -f1 /proc/loadavg)" \
        >> "$out/evaluations.jsonl" <<'EOF'
import json, sys
path, task, mode, i, started, ended, load = sys.argv[1:]
try:
    r = json.load(open(path))
except ValueError:
    r = {}
print(json.dumps({
    "task": task, "mode": mode, "run": int(i), "verdict": r.get("verdict"),
    "speedup_eager": r.get("speedupEager", 0.0), "basis": r.get("speedupBasis"),
    "spread": r.get("speedupSpread", 0.0),
    "candidate_ms": (r.get("candidateTiming") or {}).get("medianMs"),
    "eager_ms": (r.get("eagerTiming") or {}).get("medianMs"),
    "findings": [f.get("code") for f in r.get("findings", [])],
    "wall_s": round(float(ended) - float(started), 2), "loadavg_1m": float(load),
}))
EOF
    done
  done
done

python3 - "$out/evaluations.jsonl" > "$out/summary.txt" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'task':<12} {'mode':<9} {'n':>3} {'median':>8} {'min':>8} {'max':>8} {'worst vs median':>16} {'max/min':>8}"
      f" {'mean spread':>12} {'loadavg':>8}")
for task in dict.fromkeys(r["task"] for r in rows):
    for mode in ("paired", "unpaired"):
        group = [r for r in rows if r["task"] == task and r["mode"] == mode and r["speedup_eager"]]
        if not group:
            print(f"{task:<12} {mode:<9} no speedups")
            continue
        s = [r["speedup_eager"] for r in group]
        med = statistics.median(s)
        worst = max(abs(v / med - 1) for v in s)
        spread = statistics.mean(r["spread"] for r in group)
        load = statistics.mean(r["loadavg_1m"] for r in group)
        print(f"{task:<12} {mode:<9} {len(s):>3} {med:>8.3f} {min(s):>8.3f} {max(s):>8.3f} {worst*100:>15.1f}%"
              f" {max(s)/min(s):>8.2f} {spread:>12.3f} {load:>8.2f}")
EOF
cat "$out/summary.txt"
