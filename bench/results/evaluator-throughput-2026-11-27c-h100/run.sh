#!/bin/bash
# Evaluator throughput, pipeline against the serial worker, on the binary in .kb/bin (commit in .kb/bin/COMMIT).
# Two commands on one warm machine (one command may run 10 minutes): PART=1 the pipeline, PART=2 the serial worker
# on the pipeline's evaluations.
cd "$(dirname "$0")/../../.."
mkdir -p target/release $OUT/tp && cp .kb/bin/evaluator-throughput target/release/
if [ "${PART:?}" = 1 ]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "binary: $(cat .kb/bin/COMMIT)"; } > $OUT/tp/machine.txt 2>&1
  rm -rf /tmp/kft /tmp/tp; mkdir -p /tmp/tp
  python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
  timeout 330 target/release/evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed \
    --python $(which python3) --work /tmp/kft --out /tmp/tp/pipeline --repeat 2 --serial 0 --gpu-slots 8 > /tmp/tp/pipeline.log 2>&1
  echo "pipeline rc=$?"; tail -15 /tmp/tp/pipeline.log
  cp -r /tmp/tp/pipeline /tmp/tp/pipeline.log $OUT/tp/
else
  timeout 391 target/release/evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed \
    --python $(which python3) --work /tmp/kft2 --out /tmp/tp/serial --pipeline-from /tmp/tp/pipeline/evaluations.jsonl \
    --serial 3 --gpu-slots 8 > /tmp/tp/serial.log 2>&1
  echo "serial rc=$?"; tail -25 /tmp/tp/serial.log
  cp -r /tmp/tp/serial /tmp/tp/serial.log $OUT/tp/
fi
