#!/bin/bash
# Samples the test run's disk every 30 s: MB of target/, .venv/, pip's cache and target/tmp.
while true; do
  t=$(du -sm /tmp/ci/main/target 2>/dev/null | cut -f1); v=$(du -sm /tmp/ci/main/.venv 2>/dev/null | cut -f1)
  p=$(du -sm /tmp/ci/pipcache 2>/dev/null | cut -f1); tt=$(du -sm /tmp/ci/main/target/tmp 2>/dev/null | cut -f1)
  echo "$(date +%s) target=$t venv=$v pipcache=$p targettmp=$tt"
  sleep 30
done
