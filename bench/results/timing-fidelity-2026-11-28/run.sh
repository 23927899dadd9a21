#!/bin/bash
# The GPU pass at the final binaries (.kb/bin, commit in .kb/bin/COMMIT), resumable on one warm machine (/tmp kept
# between commands): timing fidelity on the six KernelBench candidates of the earlier passes and the corpus's cuda/
# entries, the CUDA corpus, and the throughput benchmark's pipeline. PART=1 and 2 ran on two machines (the first went
# back between them), PART=5 on a third; liveness beside a hang ran after PART=5 on that machine (README.md).
# PART=1: the CUDA corpus; do_bench in three clean processes per candidate, warm, idle repeat 0.
# PART=2: idle repeat 1, the pipeline full; the throughput pipeline (28 mixed KernelBench candidates, 8 slots).
# PART=5: timing fidelity whole in one command: do_bench in two clean processes per candidate, warm, idle repeat 0,
#         the pipeline full, idle repeat 1.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/fid target/release && cp .kb/bin/* target/release/ && gunzip -f target/release/kforge.gz && chmod +x target/release/*
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/machine.txt 2>&1
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
TP="target/release/evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) --gpu-slots 8"
if [ "${PART:?}" = 1 ]; then
  echo "== corpus"; KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
    KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 150 target/release/corpus --nocapture \
    > $OUT/corpus-cuda.log 2>&1; echo "corpus rc=$?"; tail -6 $OUT/corpus-cuda.log
  echo "== dobench"; $F --phases dobench --dobench-repeats 3 --deadline-s $(left 380) 2>&1 | grep -v "^\s*$" | tail -12
  echo "== warm"; $F --phases warm --deadline-s $(left 480) 2>&1 | tail -3
  echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 570) 2>&1 | tail -6
elif [ "$PART" = 2 ]; then
  echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 200) 2>&1 | tail -6
  echo "== full"; $F --phases full --deadline-s $(left 330) 2>&1 | tail -6
  $F --summary-only > /dev/null 2>&1
  echo "== throughput pipeline"; rm -rf /tmp/kft /tmp/tp; mkdir -p /tmp/tp $OUT/tp
  python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
  timeout $(left 585) $TP --work /tmp/kft --out /tmp/tp/pipeline --repeat 2 --serial 0 > /tmp/tp/pipeline.log 2>&1
  echo "pipeline rc=$?"; tail -15 /tmp/tp/pipeline.log; cp -r /tmp/tp/pipeline /tmp/tp/pipeline.log $OUT/tp/
elif [ "$PART" = 5 ]; then
  echo "== dobench"; $F --phases dobench --dobench-repeats 2 --deadline-s $(left 200) 2>&1 | grep -v "^\s*$" | tail -12
  echo "== warm"; $F --phases warm --deadline-s $(left 280) 2>&1 | tail -3
  echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 430) 2>&1 | tail -3
  echo "== full"; $F --phases full --deadline-s $(left 470) 2>&1 | tail -3
  echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 575) 2>&1 | tail -3
  $F --summary-only > /dev/null 2>&1
fi
echo "total $(( $(date +%s) - T0 )) s"
