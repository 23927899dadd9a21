#!/bin/bash
# Timing fidelity on the current binaries (.kb/bin, commit in .kb/bin/COMMIT), resumable on one warm machine
# (/tmp/fid kept between commands): the six KernelBench candidates of runs G/H and the corpus's cuda/ entries.
# PART=1: do_bench in three clean processes per candidate, warm, idle repeat 0. PART=2: idle repeat 1, the pipeline
# full. PART=3: the host-synchronising call split into parts (host_sync_parts.py), then liveness beside a hang.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/fid target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/fid/machine.txt 2>&1
export PATH=$PWD/target/release:$PATH
if [ ! -d /tmp/kbh ]; then
  python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
  mkdir -p /tmp/kbh && cp /tmp/kbc/*.py /tmp/kbh/
  python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '88_MinGPT', '12_Matmul_with_diag', '76_Gemm_Add', '14_Gemm_Divide', '9_Matmul_Subtract'))]
json.dump(keep, open('/tmp/kbh/manifest.json', 'w'))
PY
fi
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbh --tasks-dir $PWD/.kb/kernelbench --corpus"
trap 'cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
left() { echo $(( $1 - ($(date +%s) - T0) )); }
if [ "${PART:?}" = 1 ]; then
  echo "== dobench"; $F --phases dobench --dobench-repeats 3 --deadline-s $(left 320) 2>&1 | grep -v "^\s*$" | tail -12
  echo "== warm"; $F --phases warm --deadline-s $(left 440) 2>&1 | tail -3
  echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 560) 2>&1 | tail -6
elif [ "$PART" = 2 ]; then
  echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 220) 2>&1 | tail -6
  echo "== full"; $F --phases full --deadline-s $(left 480) 2>&1 | tail -6
else
  echo "== parts"; python3 bench/timing/host_sync_parts.py --out-dir $OUT/parts --repeats 3 2>&1 | tail -12
  echo "== hang"; python3 bench/timing/hang.py --out /tmp/hang --n 4 --repeats 1 --run-timeout 0 --deadline-s $(left 540) 2>&1 | tail -12
  mkdir -p $OUT/hang && cp /tmp/hang/*.md /tmp/hang/*.jsonl /tmp/hang/*.txt /tmp/hang/*.log /tmp/hang/*.toml $OUT/hang/
fi
[ "$PART" = 3 ] || $F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
