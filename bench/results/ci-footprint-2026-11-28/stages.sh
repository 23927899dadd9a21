#!/bin/bash
# Records the time each ==> line (and the nextest summary) first appears in the test log.
seen=0
while true; do
  n=$(grep -c -E '^==>|^    disk:|Summary \[' /tmp/ci/test.log 2>/dev/null || echo 0)
  if [ "$n" -gt "$seen" ]; then
    grep -E '^==>|^    disk:|Summary \[' /tmp/ci/test.log | sed -n "$((seen+1)),${n}p" | while read -r l; do echo "$(date +%s) $l"; done
    seen=$n
  fi
  grep -q '^rc=' /tmp/ci/test.log 2>/dev/null && { grep '^rc=' /tmp/ci/test.log | sed "s/^/$(date +%s) /"; break; }
  sleep 5
done
