#!/bin/bash
# Liveness beside a hang with the three-level call limit (a call working on the CPU runs on; one asleep is stopped
# at 100 x the reference, at least 3 s), on the binaries in .kb/bin (commit in .kb/bin/COMMIT). One warm machine.
# PART=1: the CUDA corpus, then 3 cached relu evaluations beside the hang. PART=2: 4 cached relu, then 3
# KernelBench candidates beside the hang.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/live target/release && cp .kb/bin/* target/release/ && { [ ! -e .kb/bin/kforge.gz ] || gunzip -f target/release/kforge.gz; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/live/device.txt 2>&1
export PATH=$PWD/target/release:$PATH
left() { echo $(( $1 - ($(date +%s) - T0) )); }
hang() {  # NAME N [ARGS...]
  local name=$1 n=$2; shift 2
  echo "== $name n=$n"; python3 bench/timing/hang.py --out /tmp/$name --n $n --repeats 2 --run-timeout 0 "$@" 2>&1 | tail -14
  mkdir -p $OUT/live/$name && cp /tmp/$name/summary.md /tmp/$name/results.jsonl /tmp/$name/machine.txt $OUT/live/$name/
}
if [ "${PART:?}" = 1 ]; then
  echo "== corpus"; KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
    KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 200 target/release/corpus --nocapture \
    > $OUT/live/corpus-cuda.log 2>&1; echo "corpus rc=$?"; grep -E "test result|FAIL|panicked" $OUT/live/corpus-cuda.log | tail -8
  hang hang3 3 --deadline-s $(left 560)
elif [ "$PART" = 2 ]; then
  python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
  mkdir -p /tmp/kbh && cp /tmp/kbc/*.py /tmp/kbh/
  python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '76_Gemm_Add', '9_Matmul_Subtract'))]
json.dump(keep, open('/tmp/kbh/manifest.json', 'w'))
PY
  hang hang4 4 --deadline-s $(left 290)
  hang hangkb3 3 --candidates /tmp/kbh --tasks-dir $PWD/.kb/kernelbench --deadline-s $(left 570)
fi
echo "total $(( $(date +%s) - T0 )) s"
