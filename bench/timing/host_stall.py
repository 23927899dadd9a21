"""How long a process on this host can be kept off a CPU: sleeps 10 ms at a time for SECONDS and prints the worst
oversleep and every one over 0.5 s. Run beside a load (a fork bomb's exit, say) to see what the load costs others.

    python3 bench/timing/host_stall.py SECONDS
"""

import sys
import time


def main():
    seconds = float(sys.argv[1])
    start = time.monotonic()
    worst, long = 0.0, []
    while time.monotonic() - start < seconds:
        before = time.monotonic()
        time.sleep(0.01)
        over = time.monotonic() - before - 0.01
        worst = max(worst, over)
        if over > 0.5:
            long.append(round(over, 2))
    print(f"worst oversleep {worst:.2f} s; over 0.5 s: {long}")


if __name__ == "__main__":
    main()
