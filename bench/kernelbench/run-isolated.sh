#!/bin/bash
# Two of the slowest KernelBench tasks (level1/19_ReLU, 6 GiB outputs; level2/87, a convolution), each evaluated alone, cold
# then warm, first with candidates' outputs files in memory (/dev/shm) and then on the disk: what one evaluation of
# such a task costs without neighbours, and what the memory handoff changes (MODES="memory" for one). Results under
# $OUT. TASKS (space-separated task paths), BINARY (under .kb/bin) and LABEL (a prefix of the result files) vary it.
cd "$(dirname "$0")/../.."

mkdir -p target/release && cp .kb/bin/* target/release/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; free -g; df -h / /dev/shm; cat .kb/bin/COMMIT; } > $OUT/machine.txt 2>&1
if [ ! -f /tmp/cand/all.json ]; then  # every candidate once; manifest.json is then the selection
  python3 bench/kernelbench/make_candidates.py --reproduce .kb/kernelbench /tmp/cand 1 2 > /dev/null
  mv /tmp/cand/manifest.json /tmp/cand/all.json
fi
python3 -c "
import json
json.dump([e for e in json.load(open('/tmp/cand/all.json')) if e['task'] in
           '${TASKS:-level1/19_ReLU.py level2/87_Conv2d_Subtract_Subtract_Mish.py}'.split()], open('/tmp/cand/manifest.json', 'w'))"
for mode in ${MODES:-memory disk}; do d=/dev/shm; [ $mode = disk ] && d=""
  timeout 250 target/release/${BINARY:-evaluator-kernelbench} --kernelbench .kb/kernelbench --python $(which python3) --work /tmp/kf-$mode \
    --no-torch-compile --again --candidates /tmp/cand --gpu-slots 1 --in-flight 1 --memory-files-dir "$d" --out $OUT/$LABEL$mode.jsonl > $OUT/$LABEL$mode.log 2>&1
  echo "$mode rc=$?"; rm -rf /tmp/kf-$mode; sync
done
python3 bench/kernelbench/sweep_summary.py $OUT/*.jsonl | grep -v "^| level" | head -40
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/*.jsonl')):
  for l in open(f):
    r=json.loads(l); print(f.split('/')[-1][:-6], r['task'][:30], r['pass'], r['verdict'], round(r['wall_s'],1), {k:round(v/1e3,1) for k,v in sorted(r['stage_ms'].items()) if v>300})"
