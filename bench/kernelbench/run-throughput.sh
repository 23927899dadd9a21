#!/bin/bash
# Evaluator throughput on a GPU machine, in two commands on one warm machine (one command may run 10 minutes): the
# pipeline half, then the serial worker on the pipeline's evaluations. From the repository root, on the
# evaluator-throughput binary carried in .kb/bin (commit in .kb/bin/COMMIT), with KernelBench's tasks in
# .kb/kernelbench and the 28 mixed candidates of `make_candidates.py --mixed`.
#
#   bash bench/kernelbench/run-throughput.sh pipeline   # 28 evaluations on 8 slots, then 2 again (cache hits)
#   bash bench/kernelbench/run-throughput.sh serial     # the serial worker, 3 candidates, same machine afterwards
#
# The pipeline's report and evaluations go to /tmp/tp/pipeline (the serial half reads them there), the serial
# half's to /tmp/tp/serial; both, with their logs, are copied to $OUT/tp.
#
# Variables:
#   OUT      where the results go (required)
#   TIMEOUT  the half's time limit in seconds (default 330 for the pipeline, 391 for the serial worker)
#   FACTS    the machine-facts file under $OUT (default tp/machine.txt), written by the pipeline half; empty: none
cd "$(dirname "$0")/../.."
: "${OUT:?OUT is where the results go}"
mode=${1:?pipeline or serial}
FACTS=${FACTS-tp/machine.txt}
mkdir -p target/release "$OUT/tp" && cp .kb/bin/evaluator-throughput target/release/
TP="target/release/evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed"
TP="$TP --python $(which python3)"
case $mode in
  pipeline)
    [ -z "$FACTS" ] || { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"
      nproc; uname -r; echo "binary: $(cat .kb/bin/COMMIT)"; } > "$OUT/$FACTS" 2>&1
    rm -rf /tmp/kft /tmp/tp; mkdir -p /tmp/tp
    python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
    timeout "${TIMEOUT:-330}" $TP --work /tmp/kft --out /tmp/tp/pipeline --repeat 2 --serial 0 --gpu-slots 8 \
      > /tmp/tp/pipeline.log 2>&1
    echo "pipeline rc=$?"; tail -15 /tmp/tp/pipeline.log
    cp -r /tmp/tp/pipeline /tmp/tp/pipeline.log "$OUT/tp/" ;;
  serial)
    timeout "${TIMEOUT:-391}" $TP --work /tmp/kft2 --out /tmp/tp/serial \
      --pipeline-from /tmp/tp/pipeline/evaluations.jsonl --serial 3 --gpu-slots 8 > /tmp/tp/serial.log 2>&1
    echo "serial rc=$?"; tail -25 /tmp/tp/serial.log
    cp -r /tmp/tp/serial /tmp/tp/serial.log "$OUT/tp/" ;;
  *) echo "pipeline or serial, not $mode" >&2; exit 2 ;;
esac
