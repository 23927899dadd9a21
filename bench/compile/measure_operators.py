"""What leaving out the ATen operator headers a .cu file never names saves, and whether the object is the same.

    python bench/compile/measure_operators.py OUT_DIR CANDIDATE_DIR... [--repeat N] [--parallel N]

Reads every candidate (`*.py`) under the given directories that builds CUDA sources with load_inline, without
running it: load_inline is replaced by a stand-in that records its CUDA source. Each source is made what the
evaluator compiles (kforge_harness.build.lighten: torch/types.h where torch/extension.h was asked for) and compiled with
load_inline's nvcc flags through kforge's nvcc twice, in the same directory to the same object name: with every
operator header ($KFORGE_ALL_OPERATORS) and with only those the source names. The two objects are compared byte for
byte once nvcc's temporary file names (`tmpxft_<pid>_<n>`, which differ between any two runs of nvcc) are masked.

Then the first source that builds is timed: N builds of each variant, alternating, one at a time.

Prints one JSON line per comparison and per timed build, and a summary.
"""

import argparse
import concurrent.futures
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "..", "..", "crates", "execution", "harness")
sys.path.insert(0, HARNESS)
import kforge_nvcc  # noqa: E402
from kforge_harness import build as harness_build  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

WRAPPER = os.path.join(HARNESS, "kforge_nvcc.py")


class _Recorded(Exception):
    pass


def cuda_sources(path):
    """The CUDA sources the candidate at `path` gives load_inline, in order."""
    found = []

    def record(name, cpp_sources, cuda_sources=None, *args, **kwargs):
        if cuda_sources:
            found.append(cuda_sources if isinstance(cuda_sources, str) else "\n".join(cuda_sources))
        raise _Recorded()

    stock = cpp_extension.load_inline
    cpp_extension.load_inline = record
    try:
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        # _Recorded, or a candidate that fails before it builds anything (none in the record)
        with contextlib.suppress(Exception):
            exec(code, {"__name__": "candidate"})
    finally:
        cpp_extension.load_inline = stock
    return found


def distinct_sources(directories):
    """The distinct CUDA sources of the candidates under `directories`, as the evaluator compiles them (lightened)."""
    sources = []
    for directory in directories:
        for path in sorted(glob.glob(os.path.join(directory, "**", "*.py"), recursive=True)):
            for source in cuda_sources(path):
                light = harness_build.lighten(source) or source
                if light not in sources:
                    sources.append(light)
    return sources


def fresh_object(directory):
    """The object's path in `directory`, with what an earlier build left there removed."""
    obj = os.path.join(directory, "cuda.cuda.o")
    for leftover in (obj, obj + ".d"):
        if os.path.exists(leftover):
            os.remove(leftover)
    shutil.rmtree(obj + ".aten", ignore_errors=True)
    return obj


def nvcc_flags():
    """load_inline's nvcc flags (its ninja file's cuda_cflags and cuda_post_cflags)."""
    values = harness_build.load_inline_flags([], cuda=True)
    return values.get("cuda_cflags", ""), values.get("cuda_post_cflags", "")


def compile_once(directory, flags, every_operator):
    cflags, post = flags
    obj = fresh_object(directory)
    env = dict(os.environ)
    if every_operator:
        env["KFORGE_ALL_OPERATORS"] = "1"
    else:
        env.pop("KFORGE_ALL_OPERATORS", None)
    command = f"{sys.executable} {WRAPPER} -MD -MF {obj}.d {cflags} -c cuda.cu -o {obj} {post}"
    started = time.monotonic()
    done = subprocess.run(command, shell=True, cwd=directory, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    kept = None
    overlay = os.path.join(obj + ".aten", "ATen", "Functions.h")
    if os.path.exists(overlay):
        with open(overlay) as f:
            kept = sum(1 for line in f if kforge_nvcc.OPERATOR_INCLUDE.fullmatch(line.strip()))
    data = None
    if done.returncode == 0:
        with open(obj, "rb") as f:
            data = re.sub(rb"tmpxft_[0-9a-f]+_[0-9a-f]+", b"tmpxft", f.read())
    return {
        "rc": done.returncode,
        "wall_s": round(wall, 2),
        "kept_operators": kept,
        "object": data,
        "output": (done.stdout + done.stderr)[-2000:],
    }


def compare(index, source, root, flags):
    directory = os.path.join(root, f"s{index}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "cuda.cu"), "w") as f:
        f.write(source)
    every = compile_once(directory, flags, every_operator=True)
    named = compile_once(directory, flags, every_operator=False)
    same = every["object"] is not None and every["object"] == named["object"]
    return {
        "source": index,
        "first_line": source.strip().splitlines()[0][:80] if source.strip() else "",
        "all_rc": every["rc"],
        "named_rc": named["rc"],
        "kept_operators": named["kept_operators"],
        "all_wall_s": every["wall_s"],
        "named_wall_s": named["wall_s"],
        "same_object": same,
        "object_bytes": len(every["object"] or b""),
        "output": None if every["rc"] == 0 and named["rc"] == 0 else [every["output"], named["output"]],
    }


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("candidates", nargs="+", help="directories of candidates (*.py)")
    parser.add_argument("--repeat", type=int, default=3, help="timed builds of each variant")
    parser.add_argument("--parallel", type=int, default=4, help="sources compared at once")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="kforge-operators-")
    flags = nvcc_flags()
    print(json.dumps({"nvcc_flags": flags}), flush=True)
    sources = distinct_sources(args.candidates)
    print(json.dumps({"distinct_cuda_sources": len(sources)}), flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for result in pool.map(lambda item: compare(item[0], item[1], root, flags), enumerate(sources)):
            results.append(result)
            print(json.dumps(result), flush=True)
    timed = {"all": [], "named": []}
    first = next((r for r in results if r["all_rc"] == 0 and r["named_rc"] == 0), None)
    if first is not None:
        print(json.dumps({"timed_source": first["source"]}), flush=True)
        directory = os.path.join(root, f"s{first['source']}")
        for _ in range(args.repeat):
            for variant in ("all", "named"):
                build = compile_once(directory, flags, every_operator=variant == "all")
                timed[variant].append(build["wall_s"])
                print(
                    json.dumps(
                        {
                            "timed": variant,
                            "rc": build["rc"],
                            "wall_s": build["wall_s"],
                            "kept_operators": build["kept_operators"],
                        }
                    ),
                    flush=True,
                )
    built = [r for r in results if r["all_rc"] == 0]
    summary = {
        "sources": len(results),
        "built_with_all_operators": len(built),
        "same_object": sum(r["same_object"] for r in built),
        "named_failed_where_all_built": sum(r["named_rc"] != 0 for r in built),
        "kept_operators": sorted(r["kept_operators"] for r in built if r["kept_operators"] is not None),
        "operators": len(
            kforge_nvcc.AtenOverlay(
                next(
                    d for d in cpp_extension.include_paths() if os.path.isfile(os.path.join(d, "ATen", "Functions.h"))
                ),
                root,
            ).operators
        ),
        "timed_s": timed,
    }
    print(json.dumps({"summary": summary}), flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
