#!/bin/bash
# Timing fidelity on the current binaries (.kb/bin, commit in .kb/bin/COMMIT), resumable on one warm machine
# (/tmp/fid kept between commands): the six KernelBench candidates of runs G/H and the corpus's cuda/ entries.
# PART=1: the CUDA corpus, then launch_after_census.py. PART=2: do_bench in three clean processes per candidate, warm,
# idle repeat 0. PART=3: idle repeat 1, the pipeline full. PART=4: liveness beside a hang, 3 then 4 legitimate
# evaluations (the default 4 slots: with 4, one waits for the hang's slot). PART=5: the same with KernelBench candidates.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/fid target/release && cp .kb/bin/* target/release/ && { [ ! -e .kb/bin/kforge.gz ] || gunzip -f target/release/kforge.gz; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/fid/device.txt 2>&1
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
  echo "== corpus"; KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
    KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 240 target/release/corpus --nocapture \
    > $OUT/fid/corpus-cuda.log 2>&1; echo "corpus rc=$?"; tail -25 $OUT/fid/corpus-cuda.log
  echo "== launch after census"; timeout $(left 560) python3 bench/timing/launch_after_census.py --out-dir $OUT/lac --repeats 2 2>&1 | tail -30
elif [ "$PART" = 2 ]; then
  echo "== dobench"; $F --phases dobench --dobench-repeats 3 --deadline-s $(left 320) 2>&1 | grep -v "^\s*$" | tail -12
  echo "== warm"; $F --phases warm --deadline-s $(left 440) 2>&1 | tail -3
  echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 560) 2>&1 | tail -6
elif [ "$PART" = 4 ]; then
  for n in 3 4; do
    echo "== hang n=$n"; python3 bench/timing/hang.py --out /tmp/hang$n --n $n --repeats 2 --run-timeout 0 --deadline-s $(left $((n == 3 ? 270 : 560))) 2>&1 | tail -14
    mkdir -p $OUT/hang$n && cp /tmp/hang$n/*.md /tmp/hang$n/*.jsonl /tmp/hang$n/*.txt /tmp/hang$n/*.log /tmp/hang$n/*.toml $OUT/hang$n/
  done
elif [ "$PART" = 5 ]; then
  for n in 3 4; do
    echo "== hang kernelbench n=$n"; python3 bench/timing/hang.py --out /tmp/hangkb$n --candidates /tmp/kbh --tasks-dir $PWD/.kb/kernelbench --n $n --repeats 2 --run-timeout 0 --deadline-s $(left $((n == 3 ? 280 : 570))) 2>&1 | tail -14
    mkdir -p $OUT/hangkb$n && cp /tmp/hangkb$n/summary.md /tmp/hangkb$n/results.jsonl /tmp/hangkb$n/machine.txt $OUT/hangkb$n/
  done
elif [ "$PART" = 3 ]; then
  echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 220) 2>&1 | tail -6
  echo "== full"; $F --phases full --deadline-s $(left 480) 2>&1 | tail -6
fi
[ "$PART" = 1 ] || [ "$PART" -ge 4 ] || $F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
