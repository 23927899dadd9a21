"""What a precompiled start of nvcc's host compile saves, and whether the object is the same.

    python bench/compile/measure_host_pch.py OUT_DIR CANDIDATE_DIR... [--repeat N] [--parallel N] [--sources N]

Precompiles the starts the way the evaluator's start-up stage does (kforge_nvcc.precompile_host_prefixes, for
load_inline's nvcc flags with no extra flags and with -O3), then reads every candidate's CUDA sources as
measure_operators.py does and compiles each through kforge's nvcc twice, in the same directory to the same object
name: as before (only the operator headers the source names) and with the precompiled starts ($KFORGE_HOST_PCH).
The objects are compared by what they hold: the bytes of their code, data and device-code sections, their
disassembly with relocations, and their symbols, once nvcc's temporary file names (`tmpxft_<pid>_<n>`) and the name
of the start's anonymous namespace (`cuda::std::<anon>::ignore`, which the precompiled start renames) are masked.
kforge's nvcc traces each host compile ($KFORGE_NVCC_TRACE): whether it used a start, and its seconds.

Then the first source that uses a start is timed: N builds of each way, alternating, one at a time.

Prints one JSON line per comparison and per timed build, and a summary.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from measure_operators import (  # noqa: E402
    WRAPPER,
    distinct_sources,
    fresh_object,
    harness_build,
    kforge_nvcc,
    nvcc_flags,
)

SECTIONS = (".text", ".data", ".rodata", ".nv_fatbin", ".nvFatBinSegment", ".init_array", ".bss")
MASKS = [
    (re.compile(rb"tmpxft_[0-9a-f]+_[0-9a-f]+"), b"tmpxft"),
    (re.compile(rb"__4\d+_GLOBAL__N__\w+?6ignoreE"), b"__4<anon>6ignoreE"),
]


def contents(path):
    """What an object holds, by part, with the names that vary masked."""
    parts = {}
    with tempfile.NamedTemporaryFile() as section:
        for name in SECTIONS:
            subprocess.run(["objcopy", "-O", "binary", "--only-section", name, path, section.name], check=True)
            with open(section.name, "rb") as f:
                parts[name] = f.read()
    # objdump's first lines name the file.
    parts["disassembly"] = subprocess.run(
        ["objdump", "-dr", "--no-show-raw-insn", path], capture_output=True, check=True
    ).stdout.split(b"\n", 3)[-1]
    parts["symbols"] = subprocess.run(["nm", path], capture_output=True, check=True).stdout
    for pattern, mask in MASKS:
        parts = {name: pattern.sub(mask, data) for name, data in parts.items()}
    return parts


def compile_once(directory, flags, pch, trace):
    cflags, post = flags
    obj = fresh_object(directory)
    env = dict(os.environ, KFORGE_NVCC_TRACE=trace)
    env.pop("KFORGE_ALL_OPERATORS", None)
    env.pop("KFORGE_HOST_PCH", None)
    if pch:
        env["KFORGE_HOST_PCH"] = pch
    if os.path.exists(trace):
        os.remove(trace)
    command = f"{sys.executable} {WRAPPER} -MD -MF {obj}.d {cflags} -c cuda.cu -o {obj} {post}"
    started = time.monotonic()
    done = subprocess.run(command, shell=True, cwd=directory, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    events = []
    if os.path.exists(trace):
        with open(trace) as f:
            events = [json.loads(line) for line in f]
    host = next((e for e in events if e["event"] == "host_compile"), {})
    return {
        "rc": done.returncode,
        "wall_s": round(wall, 2),
        "precompiled": host.get("precompiled"),
        "steps_s": {e["event"]: e["seconds"] for e in events if "seconds" in e},
        "host_compile_s": host.get("seconds"),
        "host_status": host.get("status"),
        "unfit_operators": next((e["operators"] for e in events if e["event"] == "host_pch_unfit"), None),
        "compiled_again": any(e["event"] == "host_compile_again" for e in events),
        "object": contents(obj) if done.returncode == 0 else None,
        "output": (done.stdout + done.stderr)[-2000:],
    }


def compare(index, source, root, flags, pch):
    directory = os.path.join(root, f"s{index}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "cuda.cu"), "w") as f:
        f.write(source)
    trace = os.path.join(directory, "trace.jsonl")
    before = compile_once(directory, flags, None, trace)
    after = compile_once(directory, flags, pch, trace)
    differing = None
    if before["object"] is not None and after["object"] is not None:
        differing = [name for name in before["object"] if before["object"][name] != after["object"][name]]
    return {
        "source": index,
        "named_rc": before["rc"],
        "pch_rc": after["rc"],
        "precompiled": after["precompiled"],
        "unfit_operators": after["unfit_operators"],
        "compiled_again": after["compiled_again"],
        "host_compile_s": [before["host_compile_s"], after["host_compile_s"]],
        "wall_s": [before["wall_s"], after["wall_s"]],
        "same_object": differing == [],
        "differing_parts": differing,
        "output": None if before["rc"] == 0 and after["rc"] == 0 else [before["output"], after["output"]],
    }


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("candidates", nargs="+", help="directories of candidates (*.py)")
    parser.add_argument("--repeat", type=int, default=3, help="timed builds of each way")
    parser.add_argument("--parallel", type=int, default=4, help="sources compared at once")
    parser.add_argument("--sources", type=int, default=None, help="compare only the first N sources")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="kforge-host-pch-")
    flags = nvcc_flags()
    print(json.dumps({"nvcc_flags": flags}), flush=True)

    pch = os.path.join(root, "pch")
    os.makedirs(pch)
    # The evaluator's variants (bindings_pch.rs, VARIANTS), with the flags its start-up stage gives them.
    variants = harness_build.nvcc_flags_of({"default": [], "O3": ["-O3"]})
    started = time.monotonic()
    built = kforge_nvcc.precompile_host_prefixes(
        kforge_nvcc.real_nvcc(), variants, pch, kforge_nvcc.COMMON_HEADERS, kforge_nvcc.COMMON_OPERATORS
    )
    with open(os.path.join(pch, "manifest.json")) as f:
        manifest = json.load(f)
    sizes = {p: os.path.getsize(os.path.join(pch, p)) for p in os.listdir(pch) if p.startswith("host-")}
    print(
        json.dumps(
            {
                "precompiled": built,
                "seconds": round(time.monotonic() - started, 1),
                "operators": len(manifest["operators"]),
                "bytes": sizes,
            }
        ),
        flush=True,
    )

    sources = distinct_sources(args.candidates)
    print(json.dumps({"distinct_cuda_sources": len(sources)}), flush=True)
    sources = sources[: args.sources]
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for result in pool.map(lambda item: compare(item[0], item[1], root, flags, pch), enumerate(sources)):
            results.append(result)
            print(json.dumps(result), flush=True)

    timed = {"named": [], "host_pch": []}
    first = next((r for r in results if r["precompiled"] and r["same_object"]), None)
    if first is not None:
        print(json.dumps({"timed_source": first["source"]}), flush=True)
        directory = os.path.join(root, f"s{first['source']}")
        trace = os.path.join(directory, "trace.jsonl")
        for _ in range(args.repeat):
            for way, given in (("named", None), ("host_pch", pch)):
                build = compile_once(directory, flags, given, trace)
                timed[way].append(build["wall_s"])
                print(
                    json.dumps(
                        {"timed": way, "rc": build["rc"], "wall_s": build["wall_s"], "steps_s": build["steps_s"]}
                    ),
                    flush=True,
                )
    built_both = [r for r in results if r["named_rc"] == 0 and r["pch_rc"] == 0]
    summary = {
        "sources": len(results),
        "built": len(built_both),
        "used_a_start": sum(bool(r["precompiled"]) for r in built_both),
        "same_object": sum(r["same_object"] for r in built_both),
        "same_status": sum((r["named_rc"] == 0) == (r["pch_rc"] == 0) for r in results),
        "compiled_again": sum(r["compiled_again"] for r in results),
        "unfit": [r["unfit_operators"] for r in results if r["unfit_operators"]],
        "timed_s": timed,
    }
    print(json.dumps({"summary": summary}), flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
