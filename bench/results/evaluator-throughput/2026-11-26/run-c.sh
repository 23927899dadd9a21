#!/bin/bash
# GPU run C: the pipeline before and after the renovation on one VM, back to back, cold caches each:
# .kb/old/evaluator-throughput (a356e44, before the execution crate) then .kb/bin/evaluator-throughput (after).
cd "$(dirname "$0")/../../../.."
mkdir -p $OUT/c target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; echo "after: $(cat .kb/bin/COMMIT) before: $(cat .kb/old/COMMIT)"; } > $OUT/c/machine.txt 2>&1
python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
for side in ${ORDER:-before after}; do
  bin=.kb/bin/evaluator-throughput; [ $side = before ] && bin=.kb/old/evaluator-throughput
  echo "== $side"; T0=$(date +%s)
  timeout 280 $bin --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) \
    --work /tmp/kft-$side$R --out /tmp/thr-$side$R --repeat 2 --serial 0 --gpu-slots 8 > $OUT/c/pipeline-$side$R.log 2>&1
  echo "rc=$? $(( $(date +%s) - T0 )) s"; cp /tmp/thr-$side$R/summary.json $OUT/c/summary-$side$R.json 2>/dev/null
  python3 -c "import json;p=json.load(open('/tmp/thr-$side$R/summary.json'))['pipeline'];print({k:p[k] for k in ('evaluations','evaluations_per_hour','makespan_s','verdicts_as_expected','stage_cpu_s_per_evaluation')}, p['compile_cold_s'], p['device_s_per_evaluation'])"
done
