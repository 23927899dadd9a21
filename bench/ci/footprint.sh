#!/bin/bash
# Watches a test run (scripts/test.sh in a fresh clone) for the CI-footprint benchmark; each mode prints one line
# per reading, prefixed with the Unix time, until stopped (sample) or until the log's `rc=` line (stages).
#
#   (nohup bench/ci/footprint.sh sample > disk.log &)     # MB of target/, .venv/, pip's cache and target/tmp every 30 s
#   (nohup bench/ci/footprint.sh stages > stages.log &)   # when each ==> line (and nextest's summary) first appears
#
# Variables: CI_DIR (default /tmp/ci) holds the clone (main/), pip's cache (pipcache/, the run's PIP_CACHE_DIR) and
# the test run's log (test.log).
CI_DIR=${CI_DIR:-/tmp/ci}
case ${1:?sample or stages} in
  sample)
    while true; do
      t=$(du -sm $CI_DIR/main/target 2>/dev/null | cut -f1); v=$(du -sm $CI_DIR/main/.venv 2>/dev/null | cut -f1)
      p=$(du -sm $CI_DIR/pipcache 2>/dev/null | cut -f1); tt=$(du -sm $CI_DIR/main/target/tmp 2>/dev/null | cut -f1)
      echo "$(date +%s) target=$t venv=$v pipcache=$p targettmp=$tt"
      sleep 30
    done ;;
  stages)
    seen=0
    while true; do
      n=$(grep -c -E '^==>|^    disk:|Summary \[' $CI_DIR/test.log 2>/dev/null || echo 0)
      if [ "$n" -gt "$seen" ]; then
        grep -E '^==>|^    disk:|Summary \[' $CI_DIR/test.log | sed -n "$((seen+1)),${n}p" \
          | while read -r l; do echo "$(date +%s) $l"; done
        seen=$n
      fi
      grep -q '^rc=' $CI_DIR/test.log 2>/dev/null && { grep '^rc=' $CI_DIR/test.log | sed "s/^/$(date +%s) /"; break; }
      sleep 5
    done ;;
  *) echo "sample or stages, not $1" >&2; exit 2 ;;
esac
