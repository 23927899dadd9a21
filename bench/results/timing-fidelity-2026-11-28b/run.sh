#!/bin/bash
# The GPU pass at the binaries in .kb/bin (commit in .kb/bin/COMMIT), on one warm machine (/tmp kept between
# commands): PART=1 timing fidelity whole in one command (do_bench in two clean processes per candidate, warm, idle
# repeat 0, the pipeline full, idle repeat 1) on the six KernelBench candidates of the earlier passes and the
# corpus's cuda/ entries; PART=2 the CUDA corpus, 3 cached relu evaluations beside the hang (two repeats) and 3
# KernelBench evaluations beside it (one repeat).
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/fid target/release && cp .kb/bin/* target/release/ && gunzip -f target/release/kforge.gz && chmod +x target/release/*
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; lscpu | grep -E "Model name|MHz"; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/machine.txt 2>&1
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
  echo "== dobench"; $F --phases dobench --dobench-repeats 2 --deadline-s $(left 200) 2>&1 | grep -v "^\s*$" | tail -12
  echo "== warm"; $F --phases warm --deadline-s $(left 280) 2>&1 | tail -3
  echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 430) 2>&1 | tail -3
  echo "== full"; $F --phases full --deadline-s $(left 470) 2>&1 | tail -3
  echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 575) 2>&1 | tail -3
  $F --summary-only > /dev/null 2>&1
elif [ "$PART" = 2 ]; then
  trap - EXIT
  echo "== corpus"; KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
    KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 150 target/release/corpus --nocapture \
    > $OUT/corpus-cuda.log 2>&1; echo "corpus rc=$?"; grep -E "test result|FAILED" $OUT/corpus-cuda.log | tail -4
  echo "== hang3"; python3 bench/timing/hang.py --out /tmp/hang3 --n 3 --repeats 2 --run-timeout 0 --deadline-s $(left 330) 2>&1 | tail -5
  mkdir -p $OUT/hang3 && cp /tmp/hang3/summary.md /tmp/hang3/results.jsonl /tmp/hang3/machine.txt $OUT/hang3/
  echo "== hangkb3"; timeout $(left 585) python3 bench/timing/hang.py --out /tmp/hangkb3 --candidates /tmp/kbh --tasks-dir $PWD/.kb/kernelbench --n 3 --repeats 1 --run-timeout 0 --deadline-s $(left 450) 2>&1 | tail -5
  mkdir -p $OUT/hangkb3 && cp /tmp/hangkb3/summary.md /tmp/hangkb3/results.jsonl /tmp/hangkb3/machine.txt $OUT/hangkb3/
fi
echo "total $(( $(date +%s) - T0 )) s"
