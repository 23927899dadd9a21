#!/bin/bash
# The profiler benchmarks' GPU pass, from the repository root on the GPU machine: binaries from .kb/bin (commit in
# .kb/bin/COMMIT), KernelBench's tasks in .kb/kernelbench, one part per command (one command may run 10 minutes).
#
#   PART=1 [FIXTURES=0] bash bench/profiler/gpu-pass.sh   # the machine, the Nsight Compute fixtures
#                                                          # (bench/profiler/record-fixtures.sh; FIXTURES=0 skips
#                                                          # them) and the CUDA corpus (CUDA and Triton entries)
#   PART=2 [ONLY=NAMES] bash bench/profiler/gpu-pass.sh   # the live profiler (profile_live.py: every candidate or
#                                                          # ONLY's, the bad requests, a hang under the profiler
#                                                          # stopped by the call's deadline, StreamReport, Nsight
#                                                          # Compute run directly)
#   PART=3 bash bench/profiler/gpu-pass.sh                 # Profile p50 (profile_p50.py) of three candidates
#
# Results go to $OUT: machine.txt, fixtures.log and fixtures.tgz, corpus-cuda.log and corpus-cuda.jsonl, live.log and
# live.tgz, p50.log and p50.tgz.
cd "$(dirname "$0")/../.."
mkdir -p $OUT target/release && cp .kb/bin/* target/release/ && export PATH=$PWD/target/release:$PATH
case ${PART:-1} in
1)
  { nvidia-smi --query-gpu=name,driver_version --format=csv; ncu --version | tail -1; nvcc --version | tail -1
    python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"
    nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/machine.txt 2>&1
  if [ "${FIXTURES:-1}" = 1 ]; then
    echo "== fixtures"; T0=$(date +%s)
    OUT=$OUT timeout 200 bash bench/profiler/record-fixtures.sh > $OUT/fixtures.log 2>&1
    echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -5 $OUT/fixtures.log
    tar czf $OUT/fixtures.tgz -C $OUT fixtures && rm -rf $OUT/fixtures
  fi
  echo "== corpus (cuda)"; T0=$(date +%s)
  KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 \
    KFORGE_CORPUS_PYTHON=$(which python3) KFORGE_CORPUS_WORK=/tmp/kfc KFORGE_CORPUS_REPORT=$OUT/corpus-cuda.jsonl \
    timeout 300 target/release/corpus --nocapture > $OUT/corpus-cuda.log 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s"; grep -E "^test |test result" $OUT/corpus-cuda.log | tail -25 ;;
2)
  echo "== profile live"; T0=$(date +%s)
  timeout 540 python3 bench/profiler/profile_live.py --out $OUT/live --tasks-dir .kb/kernelbench --warm 3 --only "${ONLY:-}" \
    --scratch /tmp/live > $OUT/live.log 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -40 $OUT/live.log; tar czf $OUT/live.tgz -C $OUT live && rm -rf $OUT/live ;;
3)
  echo "== profile p50"; T0=$(date +%s)
  timeout 500 python3 bench/profiler/profile_p50.py --out $OUT/p50 --tasks-dir .kb/kernelbench \
    --only diag_scale,diag_scale_triton,matmul_tiled --launches 3 --measured 3 --reused 3 > $OUT/p50.log 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -20 $OUT/p50.log; tar czf $OUT/p50.tgz -C $OUT p50 && rm -rf $OUT/p50 ;;
esac
