#!/bin/bash
# GPU run G (binaries at HEAD): scalar outputs on the GPU, then fidelity with the pipeline full after the spin change.
cd "$(dirname "$0")/../../../.."
T0=$(date +%s)
mkdir -p $OUT/g target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; } > $OUT/g/machine.txt 2>&1
export PATH=$PWD/target/release:$PATH
echo "== scalar outputs"; mkdir -p /tmp/sc
for t in examples/tasks/mse_loss/task.py .kb/kernelbench/level1/95_CrossEntropyLoss.py .kb/kernelbench/level1/99_TripletMarginLoss.py; do
  n=$(basename $t .py); [ $n = task ] && n=mse_loss
  sed 's/class Model(/class ModelNew(/; s/super(Model,/super(ModelNew,/' $t > /tmp/sc/$n.py
  timeout 100 kforge eval --task $t --candidate /tmp/sc/$n.py --backend cuda --json > $OUT/g/scalar-$n.json 2>&1
  echo "$n rc=$? $(python3 -c "import json,sys;r=json.load(open('$OUT/g/scalar-$n.json'));print(r.get('verdict'),r.get('speedup'),[f.get('code') for f in r.get('findings',[])],r.get('error','')[:300])" 2>&1)"
done
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
mkdir -p /tmp/kbg && cp /tmp/kbc/*.py /tmp/kbg/
python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '88_MinGPT', '12_Matmul_with_diag', '76_Gemm_Add', '14_Gemm_Divide', '9_Matmul_Subtract'))]
json.dump(keep, open('/tmp/kbg/manifest.json', 'w'))
PY
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbg --tasks-dir $PWD/.kb/kernelbench --corpus"
trap 'mkdir -p $OUT/fid; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
echo "== dobench"; $F --phases dobench --deadline-s 200 2>&1 | grep -v "^\s*$" | tail -12
echo "== full"; timeout $(( 580 - ($(date +%s) - T0) )) $F --phases full --deadline-s $(( 540 - ($(date +%s) - T0) )) 2>&1 | tail -4
$F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
