#!/bin/bash
# GPU run B, on run A's VM: the serial worker against run A's pipeline (the throughput ratio), then Profile p50 of
# two compiled candidates through `kforge up` (the profiler on the execution crate).
cd "$(dirname "$0")/../../../.."
mkdir -p $OUT/b target/release; trap 'tar czf $OUT/b.tgz -C $OUT b --exclude=b.tgz 2>/dev/null; rm -rf $OUT/b/serial $OUT/b/p50' EXIT && cp .kb/bin/* target/release/
export PATH=$PWD/target/release:$PATH
[ -d /tmp/mixed ] || python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
echo "== throughput (serial)"; T0=$(date +%s)
timeout 300 evaluator-throughput --kernelbench $PWD/.kb/kernelbench --candidates /tmp/mixed --python $(which python3) \
  --work /tmp/kft2 --out $OUT/b/serial --pipeline-from /tmp/thr/evaluations.jsonl --serial 3 --gpu-slots 8 > $OUT/b/serial.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -30 $OUT/b/serial.log
echo "== profile p50"; T0=$(date +%s)
timeout 250 python3 bench/profiler/profile_p50.py --out $OUT/b/p50 --tasks-dir .kb/kernelbench --only diag_scale,diag_scale_triton --launches 3 --measured 3 --reused 3 > $OUT/b/p50.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 )) s"; tail -15 $OUT/b/p50.log
