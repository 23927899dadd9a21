"""Where a load_inline build of a one-kernel module spends its time, and what cuts it without changing device code.

    python bench/compile/measure_compile.py OUT_DIR [--parallel N]

Builds the same one-kernel module (kforge's fused-epilogue candidate) in fresh build directories, one variant at a
time, and reports per variant: wall time, the ninja steps' durations (the g++ step for the bindings, the nvcc step
for the .cu file, the link), nvcc's own phase times (`nvcc --time`, stock nvcc only) and a digest of the device code
(the SASS that `cuobjdump -sass` prints for the built library). Variants:

- stock: what torch's load_inline does by default;
- light: the .cu file includes torch/types.h where it asked for torch/extension.h (all.h and the Python bindings
  are not parsed three times by nvcc);
- light+parallel: light, built through kforge's nvcc (crates/execution/harness/kforge_nvcc.py: nvcc's own steps,
  the host and device front ends side by side). Its object is compared with the light build's: equal but for the
  temporary file names nvcc itself varies per run.

With --parallel N, N distinct modules are then built at once with light+parallel (a compile pool's view).
"""

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernelbench"))
import make_candidates
import torch
import torch.utils.cpp_extension as ext

CUDA = make_candidates.EPILOGUE_CUDA.replace("EXPRESSION", "return fmaxf(v, 0.f) / a;")
CPP = make_candidates.EPILOGUE_CPP


def ninja_steps(build_dir):
    steps = {}
    with open(os.path.join(build_dir, ".ninja_log")) as f:
        for line in f:
            if line.startswith("#"):
                continue
            start, end, _, output, _ = line.rstrip("\n").split("\t")
            steps[output] = (int(end) - int(start)) / 1000.0
    return steps


def nvcc_phases(path):
    phases = {}
    if not os.path.exists(path):
        return phases
    with open(path) as f:
        for row in f.read().splitlines()[1:]:
            cells = [c.strip().strip('"') for c in row.split(",")]
            if len(cells) >= 4:
                with contextlib.suppress(ValueError):
                    phases[cells[0]] = phases.get(cells[0], 0.0) + float(cells[-1]) / 1000.0
    return phases


def sass_digest(library):
    out = subprocess.run(["cuobjdump", "-sass", library], capture_output=True, text=True).stdout
    # Keep the instructions, drop the file name line.
    body = "\n".join(
        line
        for line in out.splitlines()
        if "Fatbin" not in line
        and "code for" not in line
        and "arch =" not in line
        and "host =" not in line
        and "compile_size" not in line
        and "Compiled with" not in line
        and "identifier" not in line
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16], len(out)


WRAPPER = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "execution", "harness", "kforge_nvcc.py")


def object_words(path):
    """The object's printable strings but nvcc's temporary file names (tmpxft_<pid>_...), which vary per run."""
    out = subprocess.run(["strings", "-a", path], capture_output=True, text=True).stdout
    return [re.sub(r"tmpxft_[0-9a-f]+_[0-9a-f]+", "tmpxft", line) for line in out.splitlines()]


def same_object(build_dir):
    """Compiles the build's .cu with nvcc and with kforge's nvcc, with load_inline's flags from its build.ninja, in
    the same directory; whether the objects are equal but for nvcc's temporary file names."""
    with open(os.path.join(build_dir, "build.ninja")) as f:
        config = dict(line.split(" = ", 1) for line in f.read().splitlines() if " = " in line)
    # CUDA_HOME: found on the GPU machines this runs on.
    nvcc = os.path.join(ext.CUDA_HOME, "bin", "nvcc")  # pyright: ignore[reportArgumentType, reportCallIssue]
    objects = {}
    for label, compiler in [("nvcc", [nvcc]), ("kforge_nvcc", [sys.executable, os.path.abspath(WRAPPER)])]:
        obj = os.path.join(build_dir, f"compare-{label}.o")
        command = " ".join(
            [
                *compiler,
                "-MD",
                "-MF",
                obj + ".d",
                config["cuda_cflags"],
                "-c",
                os.path.join(build_dir, "cuda.cu"),
                "-o",
                obj,
                config.get("cuda_post_cflags", ""),
            ]
        )
        subprocess.run(command, shell=True, check=True, cwd=build_dir)
        objects[label] = object_words(obj)
    return objects["nvcc"] == objects["kforge_nvcc"]


def build(variant, root, tag, out):
    """One build of the module in a fresh directory under `root`; nvcc's phase times are copied to `out`."""
    name = f"kforge_compile_{variant.replace('+', '_')}_{tag}"
    build_dir = os.path.join(root, name)
    shutil.rmtree(build_dir, ignore_errors=True)
    os.makedirs(build_dir)
    cuda = CUDA
    if "light" in variant:
        cuda = cuda.replace("#include <torch/extension.h>", "#include <torch/types.h>")
    time_csv = os.path.join(build_dir, "nvcc-time.csv")
    parallel = "parallel" in variant
    extra_cuda = [] if parallel else ["--time", time_csv]
    if parallel:
        os.environ["PYTORCH_NVCC"] = f"{sys.executable} {os.path.abspath(WRAPPER)}"
    started = time.monotonic()
    try:
        ext.load_inline(
            name=name,
            cpp_sources=CPP,
            cuda_sources=cuda,
            functions=["fused_epilogue"],
            build_directory=build_dir,
            extra_cuda_cflags=extra_cuda,
        )
    finally:
        os.environ.pop("PYTORCH_NVCC", None)
    wall = time.monotonic() - started
    library = os.path.join(build_dir, f"{name}.so")
    digest, size = sass_digest(library)
    if os.path.exists(time_csv):
        shutil.copy(time_csv, os.path.join(out, f"nvcc-time-{name}.csv"))
    return {
        "variant": variant,
        "name": name,
        "wall_s": round(wall, 2),
        "ninja_steps_s": ninja_steps(build_dir),
        "nvcc_phases_s": nvcc_phases(time_csv),
        "sass": digest,
        "sass_chars": size,
        "object": os.path.join(build_dir, "cuda.cuda.o"),
    }


def main():
    out = sys.argv[1]
    parallel = int(sys.argv[sys.argv.index("--parallel") + 1]) if "--parallel" in sys.argv else 0
    os.makedirs(out, exist_ok=True)
    root = os.path.join(out, "builds") if "--keep-builds" in sys.argv else "/tmp/kforge-compile-builds"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    os.environ.setdefault("MAX_JOBS", "2")
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "cores": os.cpu_count(),
            }
        ),
        flush=True,
    )
    nvcc = shutil.which("nvcc") or os.path.join(ext.CUDA_HOME or "", "bin", "nvcc")
    print(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    results = []
    for variant in ["stock", "light", "light+parallel", "light", "light+parallel"]:
        result = build(variant, root, f"s{len(results)}", out)
        results.append(result)
        print(json.dumps(result), flush=True)
    if parallel:
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            runs = list(pool.map(lambda i: build("light+parallel", root, f"p{i}", out), range(parallel)))
        print(
            json.dumps(
                {
                    "parallel": parallel,
                    "wall_s": round(time.monotonic() - started, 2),
                    "each_wall_s": [r["wall_s"] for r in runs],
                    "sass": sorted({r["sass"] for r in runs}),
                }
            ),
            flush=True,
        )
    sass = {r["variant"]: r["sass"] for r in results}
    light_dir = os.path.dirname(next(r["object"] for r in results if r["variant"] == "light"))
    print(
        json.dumps(
            {
                "same_sass_across_variants": len(set(sass.values())) == 1,
                "sass": sass,
                "nvcc_and_kforge_nvcc_objects_equal_but_temporary_names": same_object(light_dir),
            }
        )
    )


if __name__ == "__main__":
    main()
