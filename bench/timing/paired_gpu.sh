#!/bin/bash
# Paired timing on a GPU machine, with the binaries of .kb/bin (xz-compressed; commit in .kb/bin/COMMIT): the CUDA
# corpus (GPU evaluations unpaired, the default), then paired timing on the GPU (paired_timing.on = all) beside
# unpaired (off): three tasks, five evaluations each per evaluator, alternating.
#
#   bash bench/timing/paired_gpu.sh      (from the repository root; results in $OUT)
#
# Writes $OUT/machine.txt, corpus-cuda.log, paired.log and unpaired.log (the two evaluators), evaluations.jsonl (one
# line per evaluation), eval-errors.log and summary.txt.
cd "$(dirname "$0")/../.."
mkdir -p /tmp/kb && for f in .kb/bin/*.xz; do xz -dc "$f" > "/tmp/kb/$(basename "$f" .xz)"; done && chmod +x /tmp/kb/*
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton;print(torch.__version__,torch.version.cuda,triton.__version__)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 \
  KFORGE_CORPUS_PYTHON=$(which python3) timeout 240 /tmp/kb/corpus --nocapture > "$OUT/corpus-cuda.log" 2>&1
echo "corpus rc=$?"; grep -E "test result|FAILED" "$OUT/corpus-cuda.log" | tail -4
python=$(which python3)
serve() {
  KFORGE__EVALUATOR__PYTHON=$python KFORGE__EVALUATOR__SERVER__LISTEN=127.0.0.1:$2 KFORGE__EVALUATOR__WORK_DIR=/tmp/work-$1 \
    KFORGE__EVALUATOR__PAIRED_TIMING__ON=$3 KFORGE__EVALUATOR__BINDINGS_PCH=false /tmp/kb/kforge serve evaluator > "$OUT/$1.log" 2>&1 &
}
serve paired 50161 all
serve unpaired 50162 off
for port in 50161 50162; do
  for _ in $(seq 240); do /tmp/kb/kforge call Evaluator/GetCapabilities --addr http://127.0.0.1:$port </dev/null >/dev/null 2>&1 && break; sleep 0.5; done
done
: > "$OUT/evaluations.jsonl"
for pair in "examples/tasks/relu/task.py services/evaluator/tests/corpus/cuda/legit_relu.py" \
            "examples/tasks/matmul/task.py services/evaluator/tests/corpus/legitimate/matmul_operator.py" \
            "services/evaluator/tests/corpus/tasks/mean_squared_error.py services/evaluator/tests/corpus/legitimate/mse_large_two_pass.py"; do
  set -- $pair
  for i in 1 2 3 4 5; do
    for mode in paired unpaired; do
      port=$([[ $mode == paired ]] && echo 50161 || echo 50162)
      /tmp/kb/kforge eval --task "$1" --candidate "$2" --backend cuda --json --addr http://127.0.0.1:$port > /tmp/last.json 2>/tmp/last.err
      python3 -c '
import json, sys
r = json.load(open("/tmp/last.json"))
print(json.dumps({"task": sys.argv[1], "mode": sys.argv[2], "run": int(sys.argv[3]), "verdict": r.get("verdict"),
  "speedup_eager": r.get("speedupEager", 0.0), "basis": r.get("speedupBasis"), "spread": r.get("speedupSpread", 0.0),
  "candidate_ms": (r.get("candidateTiming") or {}).get("medianMs"), "eager_ms": (r.get("eagerTiming") or {}).get("medianMs"),
  "findings": [f.get("code") for f in r.get("findings", [])], "timing_ms": r.get("stageMs", {}).get("timing")}))
' "$(t=$(basename "$1" .py); [[ $t == task ]] && basename "$(dirname "$1")" || echo "$t")" "$mode" "$i" >> "$OUT/evaluations.jsonl" 2>>"$OUT/eval-errors.log" || cat /tmp/last.err >> "$OUT/eval-errors.log"
    done
  done
done
python3 - "$OUT/evaluations.jsonl" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for task in dict.fromkeys(r["task"] for r in rows):
    for mode in ("paired", "unpaired"):
        g = [r for r in rows if r["task"] == task and r["mode"] == mode]
        s = [r["speedup_eager"] for r in g if r["speedup_eager"]]
        if not s:
            print(task, mode, "no speedups", [r["verdict"] for r in g]); continue
        m = statistics.median(s)
        print(f"{task:<20} {mode:<9} n={len(s)} verdicts={sorted(set(r['verdict'] for r in g))} basis={sorted(set(str(r['basis']) for r in g))} "
              f"median={m:.3f} min={min(s):.3f} max={max(s):.3f} worst={max(abs(v/m-1) for v in s)*100:.1f}% "
              f"spread={statistics.mean(r['spread'] for r in g):.3f} cand_ms={statistics.median(r['candidate_ms'] or 0 for r in g):.4f} "
              f"eager_ms={statistics.median(r['eager_ms'] or 0 for r in g):.4f} timing_ms={statistics.median(r['timing_ms'] or 0 for r in g):.0f}")
PY
