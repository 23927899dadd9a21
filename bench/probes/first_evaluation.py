"""Where the first timed evaluation of a task spends its time: `kforge up`, then one `Evaluator/Evaluate` per
candidate of bench/profiler/candidates (each on its own task, compile cold), with every `stage_ms` entry:
`queue_disk` is the task's disk-sizing dry run when it is still running after the compile.

From the repository root on a GPU machine, with target/release/kforge built:

    python3 bench/probes/first_evaluation.py --out "$OUT" --tasks-dir .kb/kernelbench

Writes OUT/results.jsonl. Stdlib only.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiler"))
from profile_live import HERE, Run, header, kforge_arguments, log, machine, start_kforge, stop_kforge

EVALUATOR = "http://127.0.0.1:50051"


def main():
    parser = kforge_arguments("/tmp/kforge-first-evaluation")
    parser.add_argument("--only", default="diag_scale,matmul_tiled")
    args = parser.parse_args()
    run = Run(args)
    log(" | ".join(machine(run.out, args.python)))
    up = start_kforge(run, args, Path(args.scratch))
    try:
        for name in args.only.split(","):
            path = HERE / "candidates" / f"{name}.py"
            fields = header(path)
            request = {
                "requestId": name,
                "task": run.task(fields["task"]),
                "candidateSource": path.read_text(),
                "backend": "BACKEND_" + fields.get("backend", "cuda").upper(),
                "measurePerformance": True,
            }
            ok, response, seconds = run.call("Evaluator/Evaluate", request, addr=EVALUATOR)
            stages = response.get("stageMs", {}) if ok else {}
            run.record(
                call="Evaluate",
                candidate=name,
                ok=ok,
                seconds=seconds,
                verdict=response.get("verdict") if ok else response,
                stage_ms=stages,
            )
            log(
                f"{name}: {seconds:.1f} s {response.get('verdict') if ok else response} queue_disk "
                f"{stages.get('queue_disk')} compile {stages.get('compile')} run {stages.get('run')}"
            )
    finally:
        stop_kforge(up)


if __name__ == "__main__":
    main()
