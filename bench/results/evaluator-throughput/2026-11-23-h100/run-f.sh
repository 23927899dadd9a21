#!/bin/bash
# GPU run F: the serial worker on the same VM as run E, scalar outputs, then do_bench for the full-load set.
cd "$(dirname "$0")/../../../.."
mkdir -p $OUT/f target/release && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
[ -d /tmp/mixed ] || python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
echo "== serial"; T0=$(date +%s)
timeout 300 evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) \
  --work /tmp/kft2 --out $OUT/f/serial --pipeline-from .kb/e/evaluations.jsonl --serial 3 --gpu-slots 8 > $OUT/f/serial.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -30 $OUT/f/serial.log
echo "== scalar outputs"; mkdir -p /tmp/sc
for t in examples/tasks/mse_loss/task.py .kb/kernelbench/level1/95_CrossEntropyLoss.py .kb/kernelbench/level1/99_TripletMarginLoss.py; do
  n=$(basename $t .py); [ $n = task ] && n=mse_loss
  sed 's/class Model(/class ModelNew(/; s/super(Model,/super(ModelNew,/' $t > /tmp/sc/$n.py
  timeout 100 kforge eval --task $t --candidate /tmp/sc/$n.py --backend cuda --json > $OUT/f/scalar-$n.json 2>&1
  echo "$n rc=$? $(python3 -c "import json,sys;r=json.load(open('$OUT/f/scalar-$n.json'));print(r.get('verdict'),r.get('speedup'),[f.get('code') for f in r.get('findings',[])],r.get('error','')[:300])" 2>&1)"
done
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbc --tasks-dir $PWD/.kb/kernelbench --corpus --limit 10"
trap 'mkdir -p $OUT/fid; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
echo "== dobench"; $F --phases dobench --deadline-s $(( 570 - ($(date +%s) - T0) )) 2>&1 | grep -v "^\s*$" | tail -4
