#!/bin/bash
# GPU run A, after the execution crate (binaries from .kb/bin, built at the commit in .kb/bin/COMMIT): the throughput
# benchmark's pipeline half, then the CUDA corpus. The pipeline's evaluations stay in /tmp/thr for run B (same VM).
cd "$(dirname "$0")/../../../.."
mkdir -p $OUT/a target/release; trap 'tar czf $OUT/a.tgz -C $OUT a 2>/dev/null' EXIT && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; ncu --version | tail -1; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/a/machine.txt 2>&1
export PATH=$PWD/target/release:$PATH
python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
echo "== throughput (pipeline)"; T0=$(date +%s)
timeout 340 evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) \
  --work /tmp/kft --out /tmp/thr --repeat 2 --serial 0 --gpu-slots 8 --alone 8 > $OUT/a/pipeline.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -22 $OUT/a/pipeline.log; cp /tmp/thr/evaluations.jsonl $OUT/a/ 2>/dev/null
echo "== corpus (cuda)"; T0=$(date +%s)
KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 \
  KFORGE_CORPUS_PYTHON=$(which python3) KFORGE_CORPUS_WORK=/tmp/kfc KFORGE_CORPUS_REPORT=$OUT/a/corpus-cuda.jsonl \
  timeout 200 target/release/corpus --nocapture > $OUT/a/corpus-cuda.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; grep -E "^test |test result" $OUT/a/corpus-cuda.log | tail -25
