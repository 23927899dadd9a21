#!/bin/bash
# The second activity probe (3 s windows; hangs after torch.compile and beside a polling thread; a 40 ms autotuned
# kernel), then the CUDA corpus and the pool-stream race entry twice more, on the binaries in .kb/bin.
cd "$(dirname "$0")/../../.."
mkdir -p $OUT/activity2 $OUT/race2 target/release && cp .kb/bin/corpus target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/activity2/machine.txt 2>&1
timeout 330 python3 bench/timing/call_activity.py --out $OUT/activity2 2>&1 | tail -14
export KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
  KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3)
timeout 150 target/release/corpus --nocapture > $OUT/race2/corpus-cuda.log 2>&1; echo "corpus rc=$?"
grep -E "test result|FAILED|expected finding" $OUT/race2/corpus-cuda.log | tail -6
for i in 1 2; do
  timeout 60 target/release/corpus --nocapture pool_stream_race > $OUT/race2/race-$i.log 2>&1
  echo "race $i rc=$?: $(grep -E '^VERDICT' $OUT/race2/race-$i.log | head -1)"
done
