#!/bin/bash
# Two builds of the evaluator side by side on one GPU machine, for a change that must not change behaviour: for each
# build, the CUDA integrity corpus (every entry's verdict and findings) and the throughput benchmark's pipeline half
# (the 28 mixed KernelBench candidates of `make_candidates.py --mixed` on 8 slots; verdicts as expected, makespan).
# Runs from the repository root. Each build is a folder under .kb holding `corpus.xz` (the corpus test binary),
# `evaluator-throughput.xz`, `kforge-device-probe.xz` and `COMMIT`, all built on the development machine;
# KernelBench's tasks are in .kb/kernelbench.
#
#   OUT=... bash bench/kernelbench/compare-builds.sh after before
#
# Variables:
#   OUT               where the results go (required): compare.tgz, refreshed after each step, holding machine.txt
#                     and per build corpus-<build>.log, corpus-<build>.verdicts (each entry's verdict and findings),
#                     tp-<build>.log and tp-<build>/ (the pipeline's report and evaluations)
#   CORPUS_TIMEOUT    the corpus's time limit per build in seconds (default 110)
#   PIPELINE_TIMEOUT  the pipeline's time limit per build in seconds (default 190)
cd "$(dirname "$0")/../.."
: "${OUT:?OUT is where the results go}"
R=/tmp/compare-builds && rm -rf $R && mkdir -p $R
keep() { tar czf "$OUT/compare.tgz" -C $R .; }
[ $# -gt 0 ] || { echo "usage: compare-builds.sh BUILD..." >&2; exit 2; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"
  nproc; uname -r; for b in "$@"; do echo "$b: $(cat ".kb/$b/COMMIT")"; done; } > $R/machine.txt 2>&1
python3 bench/kernelbench/make_candidates.py --mixed /tmp/mixed > /dev/null
export KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
  KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3)
for b in "$@"; do
  bin=/tmp/builds/$b
  mkdir -p "$bin" && for f in ".kb/$b"/*.xz; do xz -dc "$f" > "$bin/$(basename "$f" .xz)"; done && chmod +x "$bin"/*
  # The engine finds kforge-device-probe beside the running binary.
  timeout "${CORPUS_TIMEOUT:-110}" "$bin/corpus" --nocapture > "$R/corpus-$b.log" 2>&1
  echo "$b corpus rc=$?: $(grep -E 'test result' "$R/corpus-$b.log")"; grep '^VERDICT_' "$R/corpus-$b.log" | sed 's/, PR [0-9.]*)/)/' | sort > "$R/corpus-$b.verdicts"; keep
  rm -rf /tmp/kft /tmp/tp
  timeout "${PIPELINE_TIMEOUT:-190}" "$bin/evaluator-throughput" --kernelbench "$PWD/.kb/kernelbench" \
    --candidates /tmp/mixed --python "$(which python3)" --work /tmp/kft --out /tmp/tp --repeat 1 --serial 0 \
    --gpu-slots 8 > "$R/tp-$b.log" 2>&1
  echo "$b pipeline rc=$?"; tail -8 "$R/tp-$b.log"
  cp -r /tmp/tp "$R/tp-$b"; keep
done
[ $# -lt 2 ] || { diff "$R/corpus-$1.verdicts" "$R/corpus-$2.verdicts" && echo "corpus: $1 and $2 give the same verdicts and findings"; }
