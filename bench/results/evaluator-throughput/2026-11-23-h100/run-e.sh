#!/bin/bash
# GPU run E: throughput pipeline (serial 0), the CUDA corpus, scalar outputs on the GPU.
cd "$(dirname "$0")/../../../.."
mkdir -p $OUT/e
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; } > $OUT/e/machine.txt 2>&1
mkdir -p target/release && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
echo "== throughput"; T0=$(date +%s)
timeout 330 evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) \
  --work /tmp/kft --out $OUT/e/pipeline --repeat 2 --serial 0 --gpu-slots 8 --alone 8 > $OUT/e/pipeline.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -25 $OUT/e/pipeline.log
echo "== scalar outputs"; mkdir -p /tmp/sc
for t in examples/tasks/mse_loss/task.py .kb/kernelbench/level1/95_CrossEntropyLoss.py .kb/kernelbench/level1/99_TripletMarginLoss.py; do
  n=$(basename $t .py); [ $n = task ] && n=mse_loss
  { cat $t; printf '\n\nclass ModelNew(Model):\n    pass\n'; } > /tmp/sc/$n.py
  timeout 120 kforge eval --task $t --candidate /tmp/sc/$n.py --backend cuda --json > $OUT/e/scalar-$n.json 2>&1
  echo "$n rc=$? $(python3 -c "import json,sys;r=json.load(open('$OUT/e/scalar-$n.json'));print(r.get('verdict'),r.get('speedup'),[f.get('code') for f in r.get('findings',[])],r.get('error','')[:300])" 2>&1)"
done
echo "== corpus"; T0=$(date +%s)
KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3) timeout 170 target/release/corpus --nocapture > $OUT/e/corpus-cuda.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -6 $OUT/e/corpus-cuda.log
