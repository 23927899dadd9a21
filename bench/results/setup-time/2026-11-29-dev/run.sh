#!/bin/bash
# The README's first command from a fresh clone, caches cold: a HOME of its own (pip's cache, kforge's state and the
# evaluator's caches), a CARGO_HOME of its own (the crates downloaded from the registry), the toolchain shared.
export HOME=/tmp/cold/home RUSTUP_HOME=/root/.rustup CARGO_HOME=/tmp/cold/home/.cargo PATH=/root/.cargo/bin:/usr/local/bin:/usr/bin:/bin
cd /tmp/cold/main
stamp() { while IFS= read -r line; do printf '%7.1f %s\n' "$(awk -v s="$START" 'BEGIN{ "date +%s.%N" | getline n; print n - s }')" "$line"; done; }
export START=$(date +%s.%N)
{ scripts/setup.sh 2>&1; echo "setup rc=$?"; } | stamp
{ target/debug/kforge run 2>&1; echo "run rc=$?"; } | stamp
