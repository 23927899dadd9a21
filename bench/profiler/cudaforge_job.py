"""A cudaforge job on a GPU machine, end to end through `kforge run`: one KernelBench task, a replayed Coder and
Judge whose story is the profiler's candidates (a compile error, then a correct kernel starved by occupancy, then
the vectorised row scale), so that the Judge's optimisation mode runs on a real Nsight Compute profile. Then
`kforge export` of the job's samples, summarised: per turn the verdict, speedup, the review's mode, the profiled
kernel's diagnosis and metrics shown, the advice and the seconds spent.

    python3 bench/profiler/cudaforge_job.py --out OUT --tasks-dir .kb/kernelbench [--kforge target/release/kforge]

Writes OUT/cudaforge-run.log, OUT/cudaforge-samples.jsonl and OUT/cudaforge-summary.json. Stdlib only.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "level1/12_Matmul_with_diagonal_matrices_"
STORY = ["compile_error", "diag_scale_occupancy", "diag_scale"]
REVIEWS = [
    {
        "critical_issue": "The kernel divides by `columns`, which is never declared; the column count is `cols`.",
        "why_it_matters": "nvcc stops at the undeclared identifier, so the extension never builds.",
        "minimal_fix_hint": "Write `d[i / cols]`.",
    },
    {
        "bottleneck": "Occupancy: each block reserves far more shared memory than it uses, so few warps are resident "
        "and the memory system idles (see the occupancy limit and the achieved occupancy).",
        "optimisation_method": "Drop the unused shared-memory reservation and use 256 threads per block with float4 "
        "loads and stores.",
        "modification_plan": "Remove the shared array, launch (n/4 + 255)/256 blocks of 256 threads, read B and write "
        "C as float4, keep one scale load per element group.",
    },
]


def record(turn, text):
    return {"task_id": TASK, "trajectory": 0, "turn": turn, "completions": [{"text": text, "finish_reason": "stop"}]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tasks-dir", required=True)
    parser.add_argument("--kforge", default="target/release/kforge")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--scratch", default="/tmp/kforge-cudaforge-job")
    args = parser.parse_args()
    out, scratch = Path(args.out), Path(args.scratch)
    out.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)

    coder = [
        record(turn, f"Turn {turn}.\n\n```python\n{(HERE / 'candidates' / f'{name}.py').read_text()}```\n")
        for turn, name in enumerate(STORY)
    ]
    judge = [record(turn, "Review:\n" + json.dumps(review)) for turn, review in enumerate(REVIEWS)]
    (scratch / "coder.jsonl").write_text("".join(json.dumps(r) + "\n" for r in coder))
    (scratch / "judge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in judge))
    source = (Path(args.tasks_dir) / f"{TASK}.py").read_text()
    (scratch / "tasks.jsonl").write_text(json.dumps({"task_id": TASK, "source": source}) + "\n")
    config = scratch / "kforge.toml"
    config.write_text(
        f"[evaluator]\npython = {json.dumps(args.python)}\nwork_dir = {json.dumps(str(scratch / 'work'))}\n"
        "bindings_pch = false\nbaseline_torch_compile = false\n\n"
        f"[orchestrator]\nstore = {json.dumps(str(scratch / 'orchestrator.db'))}\n\n"
        f'[[gateway.pools]]\nmodel = "coder"\n[[gateway.pools.backends]]\nkind = "replay"\n'
        f"file = {json.dumps(str(scratch / 'coder.jsonl'))}\n\n"
        f'[[gateway.pools]]\nmodel = "judge"\n[[gateway.pools.backends]]\nkind = "replay"\n'
        f"file = {json.dumps(str(scratch / 'judge.jsonl'))}\n"
    )

    started = time.monotonic()
    run = subprocess.run(
        [
            args.kforge,
            "run",
            "--config",
            str(config),
            "--recipe",
            "cudaforge",
            "--tasks",
            str(scratch / "tasks.jsonl"),
            "--model",
            "coder",
            "--judge-model",
            "judge",
            "--turns",
            str(len(STORY)),
            "--trajectories",
            "1",
            "--backend",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    seconds = time.monotonic() - started
    (out / "cudaforge-run.log").write_text(
        f"$ kforge run ... ({seconds:.1f} s, exit {run.returncode})\n" + run.stderr + "\n" + run.stdout
    )
    print(run.stdout)
    job_id = run.stdout.split()[1] if run.stdout.startswith("job ") else None
    if not job_id:
        print(run.stderr[-3000:])
        raise SystemExit("the job did not report")
    samples = out / "cudaforge-samples.jsonl"
    subprocess.run([args.kforge, "export", job_id, "--config", str(config), "--out", str(samples)], check=True)
    summary = []
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        judge = sample.get("judge") or {}
        evaluation = sample.get("evaluation") or {}
        summary.append(
            {
                "turn": sample["turn"],
                "verdict": sample["verdict"],
                "speedup_eager": evaluation.get("speedup_eager"),
                "judge_mode": judge.get("mode"),
                "judge_error": judge.get("error"),
                "profile_note": judge.get("profile_note"),
                "diagnosis": (judge.get("diagnosis") or {}).get("summary"),
                "metrics_shown": len(judge.get("metrics") or []),
                "advice": judge.get("advice_json"),
                "judge_seconds": judge.get("wall_time_s"),
                "judge_prompt_tail": ((judge.get("prompt") or [{}])[-1].get("content") or "")[-1500:],
            }
        )
    (out / "cudaforge-summary.json").write_text(json.dumps({"seconds": seconds, "turns": summary}, indent=1))
    print(json.dumps(summary, indent=1)[:6000])


if __name__ == "__main__":
    main()
