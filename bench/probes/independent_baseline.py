"""Independent eager-baseline timing for the timing-fidelity target: triton.testing.do_bench's median, each task in
a fresh process, compared with the evaluator's eager medians.

    python bench/probes/independent_baseline.py KERNELBENCH_DIR RESULTS.jsonl [RESULTS2.jsonl]

Prints one line per task: the evaluator's eager median (and a second run's, when given), do_bench's median, and
their relative differences. do_bench flushes the L2 between runs, as the evaluator does.
"""

import json
import subprocess
import sys

MEASURE = r"""
import importlib.util, json, sys, torch, triton.testing
spec = importlib.util.spec_from_file_location("task", sys.argv[1])
task = importlib.util.module_from_spec(spec)
spec.loader.exec_module(task)
torch.manual_seed(0)
model = task.Model(*task.get_init_inputs()).cuda()
inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in task.get_inputs()]
with torch.no_grad():
    ms = triton.testing.do_bench(lambda: model(*inputs), warmup=100, rep=1000, return_mode="median")
print(json.dumps({"median_ms": ms}))
"""


def eager_medians(path):
    medians = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("eager_median_ms") and row.get("backend") == "BACKEND_CUDA":
                medians[row["task"]] = row["eager_median_ms"]
            elif row.get("eager_median_ms"):
                medians.setdefault(row["task"], row["eager_median_ms"])
    return medians


def main():
    root, first = sys.argv[1], eager_medians(sys.argv[2])
    second = eager_medians(sys.argv[3]) if len(sys.argv) > 3 else {}
    print(f"{'task':<55} {'kforge ms':>10} {'kforge#2':>10} {'run diff':>9} {'do_bench':>10} {'vs do_bench':>11}")
    within_5, agree_3, compared, compared_runs = 0, 0, 0, 0

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for task in sorted(first):
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, f"{root}/{task}"], capture_output=True, text=True, timeout=300
        )
        reference = json.loads(out.stdout.strip().splitlines()[-1])["median_ms"] if out.returncode == 0 else None
        ours, again = first[task], second.get(task)
        run_diff = abs(again - ours) / ours if again else None
        vs = abs(ours - reference) / reference if reference else None
        if vs is not None:
            compared += 1
            within_5 += vs <= 0.05
        if run_diff is not None and ours > 0.1:
            compared_runs += 1
            agree_3 += run_diff <= 0.03
        print(
            f"{task:<55} {ours:>10.4f} {fmt(again, '>10.4f')} {fmt(run_diff and 100 * run_diff, '>8.2f')}% "
            f"{fmt(reference, '>10.4f')} {fmt(vs and 100 * vs, '>10.2f')}%"
        )
    print(
        f"# eager median within 5% of do_bench: {within_5}/{compared}; "
        f"two runs within 3% (ops > 0.1 ms): {agree_3}/{compared_runs}"
    )


if __name__ == "__main__":
    main()
