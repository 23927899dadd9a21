#!/bin/bash
# The CUDA corpus on the binaries in .kb/bin after the race check's copy moved ahead of the outputs file's
# preparation, then the pool-stream race entry four more times (each run compiles it afresh, as the corpus does).
cd "$(dirname "$0")/../../.."
mkdir -p $OUT/race target/release && cp .kb/bin/corpus target/release/ && echo "binaries: $(cat .kb/bin/COMMIT)" > $OUT/race/device.txt
export KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
  KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3)
timeout 200 target/release/corpus --nocapture > $OUT/race/corpus-cuda.log 2>&1; echo "corpus rc=$?"
grep -E "test result|FAILED|expected finding" $OUT/race/corpus-cuda.log | tail -6
for i in 1 2 3 4; do
  timeout 100 target/release/corpus --nocapture pool_stream_race > $OUT/race/race-$i.log 2>&1
  echo "race $i rc=$?: $(grep -E '^VERDICT' $OUT/race/race-$i.log | head -1)"
done
