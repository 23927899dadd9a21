#!/bin/bash
# The timing benchmarks' GPU pass: timing fidelity (fidelity.py), liveness beside a hang (hang.py) and the CUDA
# integrity corpus, as the steps given, in order. Runs from the repository root on the GPU machine, on the binaries
# carried in .kb/bin (commit in .kb/bin/COMMIT; a gzipped kforge.gz is unpacked). One command may run 10 minutes, so
# a pass is several commands on one warm machine: /tmp is kept between them, and fidelity.py resumes from /tmp/fid.
#
#   [VAR=VALUE ...] bash bench/timing/gpu-pass.sh STEP...
#
# Steps. `@N` is a deadline N seconds after this command started: fidelity.py's and hang.py's --deadline-s get what
# is left of it.
#   corpus:T             the CUDA corpus (KFORGE_CORPUS_ONLY=cuda) under `timeout T`, its log in $OUT/$CORPUS_LOG;
#                        skipped when .kb/bin carries no corpus binary
#   dobench@N            fidelity: do_bench in clean processes (fidelity.py's default count per candidate)
#   dobenchR@N           the same with --dobench-repeats R
#   warm@N               fidelity: kforge warm
#   idle0@N, idle1@N     fidelity: kforge idle, repeat 0 or 1
#   full@N               fidelity: kforge with the pipeline full
#   summary              fidelity.py --summary-only (/tmp/fid/summary.md)
#   hangK[xR]@N[/M]      hang.py: K cached relu evaluations beside the hang, R repeats (default 2), in /tmp/hangK and
#                        then $OUT/hangK; /M: under `timeout` until M seconds after the start
#   hangkbK[xR]@N[/M]    the same with K KernelBench candidates of $CANDS, in /tmp/hangkbK and $OUT/hangkbK
#   any other STEP       a shell command, run as it is (eval) in this script's shell: $OUT, $CANDS, $F (the
#                        fidelity.py command) and `left N` (seconds left until N) are defined, and the corpus's
#                        KFORGE_CORPUS_* variables exported
#
# Variables:
#   OUT          where the results go (required)
#   FACTS        the machine-facts file under $OUT (default machine.txt): GPU, driver, memory, PyTorch, Triton,
#                Python, cores, kernel, CPU model and clock, the binaries' commit
#   CORPUS_LOG   the corpus's log under $OUT (default corpus-cuda.log)
#   CANDS        the KernelBench candidates (default /tmp/kbh): made once, by make_candidates.py into /tmp/kbc and
#                the manifest's entries of TASKS copied here
#   TASKS        task names kept in $CANDS (default the fidelity set: 68_Matmul_Min 88_MinGPT 12_Matmul_with_diag
#                76_Gemm_Add 14_Gemm_Divide 9_Matmul_Subtract)
#   HANG_NAME    the hang steps' folder name, in /tmp and $OUT (default hangK or hangkbK)
#   HANG_LOGS=1  keeps the hang's evaluator log and configuration beside its summary, results and machine facts
#
# Fidelity steps write /tmp/fid; its summary, results and machine facts are copied to $OUT/fid when the command
# ends. Each record under bench/results/timing-fidelity/ and bench/results/evaluator-liveness/ gives its commands.
cd "$(dirname "$0")/../.."
T0=$(date +%s)
: "${OUT:?OUT is where the results go}" "${FACTS:=machine.txt}" "${CORPUS_LOG:=corpus-cuda.log}" "${CANDS:=/tmp/kbh}"
: "${TASKS:=68_Matmul_Min 88_MinGPT 12_Matmul_with_diag 76_Gemm_Add 14_Gemm_Divide 9_Matmul_Subtract}"
left() { echo $(( $1 - ($(date +%s) - T0) )); }

mkdir -p "$OUT" "$(dirname "$OUT/$FACTS")" "$(dirname "$OUT/$CORPUS_LOG")" target/release
cp .kb/bin/* target/release/ && { [ ! -e target/release/kforge.gz ] || gunzip -f target/release/kforge.gz; } \
  && chmod +x target/release/*
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,triton,sys;print(torch.__version__,torch.version.cuda,triton.__version__,sys.version)"
  nproc; uname -r; lscpu | grep -E "Model name|MHz"
  echo "binaries: $(cat .kb/bin/COMMIT 2>/dev/null)"; } > "$OUT/$FACTS" 2>&1
export PATH=$PWD/target/release:$PATH
export KFORGE_CORPUS_ROOT=$PWD/services/evaluator KFORGE_CORPUS_BACKEND=cuda KFORGE_CORPUS_ONLY=cuda \
  KFORGE_CORPUS_RUN_TIMEOUT=60 KFORGE_CORPUS_PYTHON=$(which python3)
F="python3 bench/timing/fidelity.py --out /tmp/fid --candidates $CANDS --tasks-dir $PWD/.kb/kernelbench --corpus"

candidates() {  # the KernelBench candidates of TASKS, once per machine
  [ -d "$CANDS" ] && return
  python3 bench/kernelbench/make_candidates.py /tmp/kbc > /dev/null
  mkdir -p "$CANDS" && cp /tmp/kbc/*.py "$CANDS"/
  python3 - "$CANDS" $TASKS <<'PY'
import json, sys
m = json.load(open('/tmp/kbc/manifest.json'))
keep = [e for e in m if any(t in e['task'] for t in sys.argv[2:])]
json.dump(keep, open(sys.argv[1] + '/manifest.json', 'w'))
PY
}

fidelity_ran=
copy_fidelity() {  # at the end, when a fidelity step ran
  [ -z "$fidelity_ran" ] && return
  mkdir -p "$OUT/fid"; cp -r /tmp/fid/*.md /tmp/fid/*.jsonl /tmp/fid/*.txt "$OUT/fid/" 2>/dev/null
}
trap copy_fidelity EXIT

fidelity() {  # PHASE DEADLINE [ARGS...]
  local phase=$1 deadline=$2; shift 2
  candidates; fidelity_ran=1
  echo "== $phase"; $F --phases "$phase" "$@" --deadline-s "$(left "$deadline")" 2>&1 | grep -v "^\s*$" | tail -12
}

hang() {  # KB K REPEATS DEADLINE [TIMEOUT]
  local kb=$1 k=$2 repeats=$3 deadline=$4 until=$5 name args=() wrap=()
  name=${HANG_NAME:-hang$kb$k}
  if [ -n "$kb" ]; then candidates; args=(--candidates "$CANDS" --tasks-dir "$PWD/.kb/kernelbench"); fi
  [ -z "$until" ] || wrap=(timeout "$(left "$until")")
  echo "== $name n=$k"
  "${wrap[@]}" python3 bench/timing/hang.py --out "/tmp/$name" "${args[@]}" --n "$k" --repeats "$repeats" \
    --run-timeout 0 --deadline-s "$(left "$deadline")" 2>&1 | tail -14
  mkdir -p "$OUT/$name" && cp "/tmp/$name"/summary.md "/tmp/$name"/results.jsonl "/tmp/$name"/machine.txt "$OUT/$name"/
  [ "${HANG_LOGS:-}" != 1 ] || cp "/tmp/$name"/*.log "/tmp/$name"/*.toml "$OUT/$name"/
}

for step in "$@"; do
  case $step in
    corpus:*)
      if [ -e .kb/bin/corpus ]; then
        echo "== corpus"; timeout "${step#corpus:}" target/release/corpus --nocapture > "$OUT/$CORPUS_LOG" 2>&1
        echo "corpus rc=$?"; grep -E "test result|FAILED|expected finding|panicked" "$OUT/$CORPUS_LOG" | tail -8
      else
        echo "== corpus: no corpus binary in .kb/bin"
      fi ;;
    dobench@*) fidelity dobench "${step#*@}" ;;
    dobench[0-9]*@*) r=${step%@*}; fidelity dobench "${step#*@}" --dobench-repeats "${r#dobench}" ;;
    warm@*) fidelity warm "${step#*@}" ;;
    idle[01]@*) r=${step%@*}; fidelity idle "${step#*@}" --only-repeat "${r#idle}" ;;
    full@*) fidelity full "${step#*@}" ;;
    summary) candidates; fidelity_ran=1; $F --summary-only > /dev/null 2>&1 ;;
    hang*@*)
      [[ $step =~ ^hang(kb)?([0-9]+)(x([0-9]+))?@([0-9]+)(/([0-9]+))?$ ]] || { echo "bad step: $step" >&2; exit 2; }
      hang "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${BASH_REMATCH[4]:-2}" "${BASH_REMATCH[5]}" \
        "${BASH_REMATCH[7]}" ;;
    *) echo "== $step"; eval "$step" ;;
  esac
done
echo "total $(( $(date +%s) - T0 )) s"
