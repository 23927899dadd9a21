"""kforge's evaluation harness: the only code that runs next to candidate kernels.

The evaluator (Rust, `crates/execution`) starts it in a fresh sandboxed process per stage, as
`python HARNESS_DIR/kforge_harness` (`__main__.py`); it runs one mode and writes its result (`modes.main`).
Statistics, the profiling ratio and the census checks are computed by the evaluator from raw data; the harness only
measures. It works with PyTorch 2.11 and later, on CPU and CUDA.

Modes:

- compile:   import the candidate module (building its load_inline extensions into TORCH_EXTENSIONS_DIR), and
             list the kernels compiled into them.
- reference: run the task's reference Model on the trial inputs; save its outputs; then, when given a candidate's
             saved outputs, compare them. Clean process, no candidate code.
- candidate: run ModelNew on the same inputs; save its outputs; optionally time it (raw samples only), take a
             kernel census, run calls for a profiler, and run the last trials again after timing. Integrity checks
             report findings.
- check:     compare a candidate's saved outputs with cached reference outputs. Clean process, no candidate code.
- baseline:  time the reference eagerly and under torch.compile. Clean process.
- bindings_pch: precompile torch/extension.h for load_inline's bindings, with the flags torch gives them. No
             candidate code.

Modules, by concern:

- `protocol`:  the messages (spec and result dataclasses, the version), checked and parsed once, results written
- `process`:   what is process-wide: trusted references taken at import, torch's originals, the GPU wait mode
- `gate`:      the device gate's client (`Gate`) and the timing CPU
- `inputs`:    modules, models, trial and timed-call inputs
- `outputs`:   outputs files written and read between processes, their read-ahead and digests
- `timing`:    the timed loop, its timer and the sample of timed calls kept for the checker
- `integrity`: the run-time integrity checks
- `compare`:   the comparison of outputs, in the order of judgement
- `census`:    the kernel census, the calls into extensions, the candidate's own kernels
- `build`:     the build recipe of load_inline extensions, load_inline's flags
- `modes`:     one function per mode, and `main`, the start-up order of a stage

Nothing here is imported at the package's import: each module is imported where it is used, and `__main__` imports
them all (through `modes`) before any candidate code runs. torch is imported inside functions, after start-up.
"""
