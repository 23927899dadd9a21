"""How stable each per-process statistic of a call's times is across clean processes, from host_sync_probe.py's
raw samples: for calls with two cost levels (a host wait mid-call) the median jumps between levels with the share of
calls in each, a low quantile much less.

    python3 bench/timing/level_statistics.py bench/results/timing-host-sync/*/**/results.jsonl

Per (results folder, model, timer): each statistic's value per process, and its spread across processes ((max -
min) / median, in %).
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common


def interquartile_mean(samples):
    ordered = sorted(samples)
    middle = ordered[len(ordered) // 4 : len(ordered) - len(ordered) // 4]
    return sum(middle) / len(middle)


STATISTICS = {
    "median": statistics.median,
    "iqm": interquartile_mean,
    "mean": statistics.fmean,
    "p20": lambda s: common.percentile(s, 20),
    "min": min,
}


def main(paths):
    processes = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            record = json.loads(line)
            if record.get("samples"):
                key = (str(Path(path).parent), record["model"], record["config"])
                processes.setdefault(key, []).append(record["samples"])
    print("| results | model | timer | n | " + " | ".join(f"{name} (spread %)" for name in STATISTICS) + " |")
    print("|---" * (4 + len(STATISTICS)) + "|")
    for (folder, model, config), runs in sorted(processes.items()):
        cells = []
        for fn in STATISTICS.values():
            values = [fn(samples) for samples in runs]
            spread = (max(values) - min(values)) / statistics.median(values) * 100
            cells.append(f"{'/'.join(f'{v:.3f}' for v in values)} ({spread:.1f})")
        print(f"| {Path(folder).name} | {model} | {config} | {len(runs)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
