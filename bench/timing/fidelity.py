"""timing-fidelity: kforge's candidate and eager medians and speedups against triton.testing.do_bench in a clean
process, for a fixed set of candidates: idle (one evaluation at a time), under load (the pipeline full), and
run to run.

On the GPU machine, from the repository root (binaries built: target/release/kforge), with the candidates written
by `python3 bench/kernelbench/make_candidates.py CAND_DIR` (or `--mixed CAND_DIR`) and a KernelBench checkout; each
command fits in 10 minutes and they share OUT (run them in this order, on one machine, with OUT kept between them):

    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases dobench-build
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases dobench
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases warm
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases idle \\
        --only-repeat 0
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases idle \\
        --only-repeat 1
    python3 bench/timing/fidelity.py --out OUT --candidates CAND_DIR --tasks-dir KB_DIR --corpus --phases full
    python3 bench/timing/fidelity.py --out OUT --summary-only

(`--phases warm,idle,full,dobench` runs them all in one command where time allows.) A command stopped by its time
limit loses nothing already recorded: running it again goes on with what is missing (`--no-resume` measures
everything again). `--deadline-s` (default 480) stops starting evaluations that late into the command.

Candidates: make_candidates.py's manifest entries expected VERDICT_CORRECT (entries without `expect` count as
correct) on KernelBench level 1 and 2 tasks (`--limit N` keeps the first N of them), plus with `--corpus` the
corpus's cuda/ entries expected VERDICT_CORRECT (legit_relu.py, triton_legit_relu.py on examples/tasks/relu).

Phases (each appends to OUT/results.jsonl, one line per task/candidate/phase/repeat; OUT/summary.md is rebuilt from
every line present at the end of each command, or alone with `--summary-only`):

- dobench-build: builds the CUDA candidates' extensions for dobench (load_inline as written, TORCH_EXTENSIONS_DIR
  = OUT/torch_extensions), several at once; compiles only, nothing measured. `dobench` builds what is missing itself.
- dobench: for each candidate, a fresh process (`fidelity.py --dobench-one TASK CAND OUTJSON`) imports the task and
  the candidate from their files, seeds torch (0) before get_init_inputs()/Model(...) and again before ModelNew(...)
  (so the parameters match), seeds 1 before get_inputs(), moves everything to cuda, and under torch.no_grad()
  measures `triton.testing.do_bench(lambda: model(*inputs), warmup=25, rep=200, return_mode="median")` for Model
  (eager) and ModelNew, and return_mode="all" for the spread (p20/p80, IQR). No evaluator runs meanwhile (each
  phase stops its evaluator before the next starts; processes found on the GPU are recorded in the line).
- warm: one evaluator, every candidate submitted at once, so compiles (and the bindings' precompiled header) are
  cached in OUT/work; not measured. It waits for the evaluator's children to end, so no later phase pays for them.
- idle: R repeats (`--repeats`, default 2; `--only-repeat K` runs one), each in a fresh evaluator, evaluations
  one at a time with nothing else running. Recorded per evaluation: the candidate's and eager medians and 10th
  percentiles (from the samples), speedup_eager, the samples (and their count), the verdict, and stage_ms
  (summary.md shows the entries whose key contains `timing` or `cpu_wait` or starts with `run.`).
- full: the pipeline full, one evaluator with its default gpu slots (`--gpu-slots` to change): every candidate
  submitted at once together with a cold-compile copy of each (its source plus a line `# load copy <i>`, <i>
  unique to the run, so the compile cache misses); the same fields are recorded for the measured (non-copy) ones.

Fresh eager measurements: the evaluator caches baselines per task and timing budget, so each evaluator gets its own
value of `[evaluator.timing] max_runs` through KFORGE__EVALUATOR__TIMING__MAX_RUNS: warm 999, idle repeat r
1000 + r, full repeat r 1100 + r. max_runs is part of the timing budget that keys the baseline cache (services/
evaluator/src/pipeline.rs, `baseline_key`), and it only caps the adaptive loop (default 1000; the loop stops past
50 samples and 0.2 s at a relative standard error of 0.5%, or after 5 s), so moving it by a few changes nothing
measured (the candidate's loop uses the same budget). The torch.compile baseline
is off (`baseline_torch_compile = false`, `--compile-baseline` turns it on): it is not compared, the evaluator
measures eager before it, and with a fresh baseline per evaluator it would compile every task again.

summary.md: a table per phase (kforge against do_bench: candidate and eager medians and 10th percentiles, speedup,
% errors; idle run-to-run % differences), the candidate's launch against its cover per evaluation, the stage_ms
entries, and the aggregate: for ops whose do_bench eager median is at least 0.1 ms, the largest |error| of kforge's
candidate and eager medians and of the speedups, idle and full, and the largest run-to-run difference (kforge's
10th percentiles beside them, against do_bench's median, not judged), against the targets (`--target-median 3`,
`--target-speedup 3`, `--target-r2r 2`, in %); smaller ops, and calls that make the host wait mid-call (the
evaluator's notice `timing.host_synchronized`), reported apart, the latter's candidate median and speedup held to
the targets against the range of do_bench's medians across its clean processes (`--dobench-repeats 2` or more).
"""

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from fidelity_dobench import dobench_one
from fidelity_phases import PHASES, Run
from fidelity_summary import summary

# The modules, by concern: fidelity_phases.py runs the phases (do_bench children and kforge evaluators),
# fidelity_dobench.py is the do_bench child, fidelity_summary.py writes summary.md; this file is the command line.


def parse():
    default_kb = common.REPO.parent / "shared" / "kernelbench"
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Commands and phases: see the module docstring (python3 -m pydoc or the file).",
    )
    parser.add_argument("--out", help="output directory, shared by every phase's command")
    parser.add_argument("--candidates", help="make_candidates.py's output directory (manifest.json and candidates)")
    parser.add_argument("--tasks-dir", default=str(default_kb), help=f"KernelBench directory (default {default_kb})")
    parser.add_argument("--corpus", action="store_true", help="add the corpus's legitimate cuda/ entries")
    parser.add_argument("--limit", type=int, default=None, help="keep the manifest's first N candidates")
    parser.add_argument(
        "--phases",
        default="warm,idle,full,dobench",
        help=f"comma-separated, run in the order given, from {','.join(PHASES)}",
    )
    parser.add_argument("--repeats", type=int, default=2, help="idle repeats (default 2)")
    parser.add_argument(
        "--dobench-repeats",
        type=int,
        default=1,
        help="do_bench children per candidate in the dobench phases (default 1)",
    )
    parser.add_argument("--only-repeat", type=int, default=None, help="run only this idle repeat (0-based)")
    parser.add_argument("--full-repeats", type=int, default=1, help="full repeats (default 1)")
    parser.add_argument("--gpu-slots", type=int, default=0, help="evaluator gpu_slots (default: its default)")
    parser.add_argument("--compile-baseline", action="store_true", help="keep the torch.compile baseline on")
    parser.add_argument("--python", default=common.default_python(), help="interpreter with torch (default: this one)")
    parser.add_argument("--kforge", default=None, help="kforge binary (default target/release/kforge)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=480.0,
        help="start no evaluation or do_bench child after this many seconds (0: no limit)",
    )
    parser.add_argument(
        "--build-workers",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 2) // 2)),
        help="dobench-build: extensions built at once",
    )
    parser.add_argument("--no-resume", action="store_true", help="measure again what results.jsonl already has")
    parser.add_argument("--summary-only", action="store_true", help="only rebuild summary.md from results.jsonl")
    parser.add_argument("--target-median", type=float, default=3.0)
    parser.add_argument("--target-speedup", type=float, default=3.0)
    parser.add_argument("--target-r2r", type=float, default=2.0)
    parser.add_argument(
        "--dobench-one",
        nargs=3,
        metavar=("TASK", "CAND", "OUTJSON"),
        help="internal: measure one task/candidate with do_bench in this process",
    )
    parser.add_argument("--build-only", action="store_true", help="with --dobench-one: import (build) only")
    args = parser.parse_args()
    if not args.dobench_one and not args.out:
        parser.error("--out is required")
    return args


def select(args):
    entries = []
    if args.candidates:
        entries = common.manifest_entries(args.candidates, args.tasks_dir)
        if args.limit is not None:
            entries = entries[: args.limit]
    if args.corpus:
        entries += common.corpus_entries()
    if not entries:
        raise SystemExit("no candidates: pass --candidates DIR and/or --corpus")
    return entries


def main():
    args = parse()
    if args.dobench_one:
        dobench_one(*args.dobench_one, build_only=args.build_only)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        phases = [p.strip() for p in args.phases.split(",") if p.strip()]
        unknown = [p for p in phases if p not in PHASES]
        if unknown:
            raise SystemExit(f"unknown phases {unknown}; known: {PHASES}")
        entries = select(args)
        (out / "candidates.json").write_text(json.dumps(entries, indent=1))
        run = Run(args)
        needs_evaluator = any(p in ("warm", "idle", "full") for p in phases)
        run.kforge = common.find_kforge(args.kforge) if needs_evaluator else (args.kforge or "(not used)")
        common.record_machine(out, args.python, run.kforge, note=f"fidelity phases {','.join(phases)}")
        common.log(f"{len(entries)} candidates; phases {phases}; out {out}")
        try:
            for phase in phases:
                common.log(f"phase {phase}")
                try:
                    getattr(run, phase.replace("-", "_"))(entries)
                except Exception as error:  # any failure: the next phases and the summary still run
                    common.log(f"phase {phase} failed: {type(error).__name__}: {error}")
                    traceback.print_exc()
                    common.append_jsonl(
                        run.results,
                        {
                            "phase": f"{phase}-error",
                            "repeat": 0,
                            "key": "",
                            "error": f"{type(error).__name__}: {error}"[:4000],
                            "unix": time.time(),
                        },
                    )
        finally:
            common._stop_all()
    summary(out, args)


if __name__ == "__main__":
    main()
