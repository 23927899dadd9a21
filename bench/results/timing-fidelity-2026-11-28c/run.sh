#!/bin/bash
# The cover's cap with the flush (binaries in .kb/bin, commit in .kb/bin/COMMIT): timing fidelity in one command on
# the ops where the cap binds (level1/12, level2/68 and the corpus's two relu candidates): do_bench in two clean
# processes per candidate, warm, idle repeat 0, the pipeline full, idle repeat 1.
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/fid target/release && cp .kb/bin/* target/release/ && gunzip -f target/release/kforge.gz && chmod +x target/release/*
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"; nproc; uname -r; lscpu | grep -E "Model name"; echo "binaries: $(cat .kb/bin/COMMIT)"; } > $OUT/machine.txt 2>&1
export PATH=$PWD/target/release:$PATH
python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
mkdir -p /tmp/kbs && cp /tmp/kbc/*.py /tmp/kbs/
python3 - <<'PY'
import json
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in ('68_Matmul_Min', '12_Matmul_with_diag'))]
json.dump(keep, open('/tmp/kbs/manifest.json', 'w'))
PY
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates /tmp/kbs --tasks-dir $PWD/.kb/kernelbench --corpus"
trap 'cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt $OUT/fid/ 2>/dev/null' EXIT
left() { echo $(( $1 - ($(date +%s) - T0) )); }
echo "== dobench"; $F --phases dobench --dobench-repeats 2 --deadline-s $(left 120) 2>&1 | grep -v "^\s*$" | tail -9
echo "== warm"; $F --phases warm --deadline-s $(left 190) 2>&1 | tail -2
echo "== idle0"; $F --phases idle --only-repeat 0 --deadline-s $(left 270) 2>&1 | tail -2
echo "== full"; $F --phases full --deadline-s $(left 330) 2>&1 | tail -2
echo "== idle1"; $F --phases idle --only-repeat 1 --deadline-s $(left 410) 2>&1 | tail -2
$F --summary-only > /dev/null 2>&1
echo "total $(( $(date +%s) - T0 )) s"
