#!/bin/bash
# GPU run H (binaries from .kb/bin, built at the commit named in machine.txt): the orchestrator's overhead per turn on
# this machine's CPUs (two cores, and all), then timing fidelity idle with two repeats (run to run) for the six
# KernelBench candidates of run G and the corpus's cuda/ entries.
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
mkdir -p $OUT/h target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "git: $(git rev-parse --short HEAD 2>/dev/null)"; } > $OUT/h/machine.txt 2>&1
export PATH=$PWD/target/release:$PATH
echo "== orchestrator overhead"
for run in "0,1 process" "0,1 power_loss" "all process"; do
  set -- $run
  pin=""; [ "$1" != all ] && pin="taskset -c $1"
  echo "-- cpus $1, durability $2" >> $OUT/h/overhead.txt
  $pin target/release/orchestrator-overhead --trajectories 1000 --turns 3 --durability $2 >> $OUT/h/overhead.txt 2>/dev/null
done
grep -E "^--|p50|p99|turns_per_s" $OUT/h/overhead.txt
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
mkdir -p /tmp/kbh && cp /tmp/kbc/*.py /tmp/kbh/
python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '88_MinGPT', '12_Matmul_with_diag', '76_Gemm_Add', '14_Gemm_Divide', '9_Matmul_Subtract'))]
json.dump(keep, open('/tmp/kbh/manifest.json', 'w'))
PY
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbh --tasks-dir $PWD/.kb/kernelbench --corpus"
trap 'mkdir -p $OUT/fid; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
left() { echo $(( $1 - ($(date +%s) - T0) )); }
echo "== dobench"; $F --phases dobench --deadline-s $(left 230) 2>&1 | grep -v "^\s*$" | tail -12
echo "== warm"; $F --phases warm --deadline-s $(left 360) 2>&1 | tail -3
echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 470) 2>&1 | tail -6
echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 570) 2>&1 | tail -6
$F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
