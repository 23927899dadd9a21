"""How fast an outputs file can leave and reach the device: the ways the harness could write a large output to its
file and load it back, timed one process alone and several at once (the sweep's load).

Writes (a CUDA tensor of --gib GiB to a file in the folder):
  mapped      the harness until now: the file's room allocated (posix_fallocate), mapped (torch.from_file, shared),
              the tensor copied into the mapping (pageable: the driver stages it, and every 4 KiB page faults).
  mapped_nf   the same without posix_fallocate (its zero-fill pass isolated).
  mapped_pop, mapped_nf_pop   `mapped` and `mapped_nf` with the mapping's pages made first in one call
              (madvise MADV_POPULATE_WRITE) instead of one fault per page.
  staged      copied off the device in 64 MiB chunks into two pinned buffers, each chunk written with os.pwrite while
              the next one copies.
  registered  mapped as `mapped`, the mapping pinned (cudaHostRegister) and copied into by DMA; memory filesystems only.
Loads (the file `staged` wrote, back onto the device; checked equal):
  mapped      the harness until now: mapped privately (torch.from_file) and copied to the device (pageable).
  mapped_pop  the same with the mapping's pages made first (madvise MADV_POPULATE_READ).
  registered  mapped privately, the mapping pinned read-only (cudaHostRegister) and copied by DMA.
  staged      read with os.preadv into two pinned 64 MiB buffers, each copied to the device while the next is read.
  staged16    the same with 16 MiB chunks.

    python3 bench/probes/outputs_io.py --dirs /dev/shm,/tmp --gib 4 --procs 1 --out OUT/io.jsonl
    python3 bench/probes/outputs_io.py --dirs /dev/shm,/tmp --gib 2 --procs 6 --out OUT/io.jsonl

Each process writes one JSON line per (dir, op, repeat): seconds and GB/s; all processes of a run start each step
together (a barrier). Prints a table of the medians per (procs, dir, op).
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

CHUNK = 64 << 20


def pinned_pair(chunk):
    import torch

    return [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23


def madvise(tensor, advice):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(tensor.data_ptr(), tensor.numel(), advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise")


def write_mapped(src, path, fallocate=True, populate=False):
    import torch

    n = src.numel()
    with open(path, "wb") as f:
        if fallocate:
            os.posix_fallocate(f.fileno(), 0, n)
    data = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
    if populate:
        madvise(data, MADV_POPULATE_WRITE)
    data.copy_(src)


def write_staged(src, path, buffers):
    import torch

    n, chunk = src.numel(), buffers[0].numel()
    events: list[Any] = [None, None]  # torch.cuda.Event per buffer, once recorded
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pending = None  # (buffer index, offset, length) copied, not yet written
        for i, at in enumerate(range(0, n, chunk)):
            b = i % 2
            length = min(chunk, n - at)
            buffers[b][:length].copy_(src[at : at + length], non_blocking=True)
            events[b] = torch.cuda.Event()
            events[b].record()
            if pending is not None:
                pb, pat, plen = pending
                events[pb].synchronize()
                os.pwrite(fd, buffers[pb][:plen].numpy(), pat)
            pending = (b, at, length)
        if pending is not None:
            pb, pat, plen = pending
            events[pb].synchronize()
            os.pwrite(fd, buffers[pb][:plen].numpy(), pat)
    finally:
        os.close(fd)


def filesystem(path):
    """The type of the filesystem `path` lies on (/proc/self/mounts, longest mount point that holds it)."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    real = os.path.realpath(os.path.dirname(path))
    holding = [m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
    return max(holding, key=lambda m: len(m[0]))[1]


def write_registered(src, path):
    import torch

    if filesystem(path) not in ("tmpfs", "ramfs"):
        # Linux refuses to pin a disk file's shared mapping for writing, and the failed registration's error would
        # surface at the next CUDA call of this process.
        raise RuntimeError("not a memory filesystem")
    n = src.numel()
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, n)
    data = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()  # cudart() initialises CUDA, which loads it: not None
    err = cudart.cudaHostRegister(data.data_ptr(), n, 0)  # pyright: ignore[reportOptionalMemberAccess]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister: {err}")
    try:
        data.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    finally:
        cudart.cudaHostUnregister(data.data_ptr())  # pyright: ignore[reportOptionalMemberAccess]


def load_mapped(path, device, populate=False):
    import torch

    n = os.path.getsize(path)
    data = torch.from_file(path, shared=False, size=n, dtype=torch.uint8)
    if populate:
        madvise(data, MADV_POPULATE_READ)
    return data.to(device)


def load_registered(path, device):
    import torch

    n = os.path.getsize(path)
    data = torch.from_file(path, shared=False, size=n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()  # cudart() initialises CUDA, which loads it: not None
    err = cudart.cudaHostRegister(data.data_ptr(), n, 8)  # cudaHostRegisterReadOnly  # pyright: ignore[reportOptionalMemberAccess]
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister: {err}")
    try:
        out = data.to(device, non_blocking=True)
        torch.cuda.synchronize()
    finally:
        cudart.cudaHostUnregister(data.data_ptr())  # pyright: ignore[reportOptionalMemberAccess]
    return out


def load_staged(path, device, buffers):
    import torch

    n, chunk = os.path.getsize(path), buffers[0].numel()
    out = torch.empty(n, dtype=torch.uint8, device=device)
    events: list[Any] = [None, None]  # torch.cuda.Event per buffer, once recorded
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, at in enumerate(range(0, n, chunk)):
            b = i % 2
            length = min(chunk, n - at)
            if events[b] is not None:
                events[b].synchronize()  # its last copy to the device is done: the buffer is free
            view = buffers[b][:length]
            done = 0
            while done < length:
                got = os.preadv(fd, [view[done:].numpy()], at + done)
                if got <= 0:
                    raise OSError("short read")
                done += got
            out[at : at + length].copy_(view, non_blocking=True)
            events[b] = torch.cuda.Event()
            events[b].record()
    finally:
        os.close(fd)
    torch.cuda.synchronize()
    return out


def worker(rank, args, barrier, queue):
    import torch

    device = torch.device("cuda")
    n = int(args.gib * (1 << 30))
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    buffers = pinned_pair(CHUNK)
    buffers16 = pinned_pair(16 << 20)
    torch.cuda.synchronize()
    for repeat in range(args.repeats):
        for folder in args.dirs.split(","):
            base = os.path.join(folder, f"kforge-io-{os.getpid()}")
            steps = [
                ("write", "mapped", lambda p: write_mapped(src, p)),
                ("write", "mapped_nf", lambda p: write_mapped(src, p, fallocate=False)),
                ("write", "mapped_pop", lambda p: write_mapped(src, p, populate=True)),
                ("write", "mapped_nf_pop", lambda p: write_mapped(src, p, fallocate=False, populate=True)),
                ("write", "registered", lambda p: write_registered(src, p)),
                ("write", "staged", lambda p: write_staged(src, p, buffers)),
                ("load", "mapped", lambda p: load_mapped(p, device)),
                ("load", "mapped_pop", lambda p: load_mapped(p, device, populate=True)),
                ("load", "registered", lambda p: load_registered(p, device)),
                ("load", "staged", lambda p: load_staged(p, device, buffers)),
                ("load", "staged16", lambda p: load_staged(p, device, buffers16)),
            ]
            for kind, name, fn in steps:
                # `staged` writes the file every load then reads.
                path = base + (".w" + name if kind == "write" and name != "staged" else ".w")
                barrier.wait()
                t0 = time.perf_counter()
                error = None
                try:
                    got = fn(path)
                    torch.cuda.synchronize()
                except Exception as e:  # a variant this machine cannot do is reported, not fatal
                    error, got = f"{type(e).__name__}: {e}"[:200], None
                seconds = time.perf_counter() - t0
                ok = None
                if kind == "load" and got is not None:
                    ok = bool(torch.equal(got, src))
                    del got
                if kind == "write" and name != "staged":
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                queue.put(
                    {
                        "procs": args.procs,
                        "rank": rank,
                        "repeat": repeat,
                        "dir": folder,
                        "kind": kind,
                        "op": name,
                        "s": round(seconds, 4),
                        "GBps": round(n / seconds / 1e9, 2) if not error else None,
                        "equal": ok,
                        "error": error,
                    }
                )
            barrier.wait()
            with contextlib.suppress(OSError):
                os.unlink(base + ".w")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", default="/dev/shm,/tmp")
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing measured")
            return 0
    except ImportError:
        print("no torch: nothing measured")
        return 0
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, barrier, queue)) for r in range(args.procs)]
    for p in procs:
        p.start()
    rows = []
    with open(args.out, "a") as out:
        while any(p.is_alive() for p in procs) or not queue.empty():
            try:
                row = queue.get(timeout=1)
            except Exception:
                continue
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
    for p in procs:
        p.join()
    groups = {}
    for r in rows:
        groups.setdefault((r["dir"], r["kind"], r["op"]), []).append(r)
    print(f"procs={args.procs} gib={args.gib}")
    for (folder, kind, op), rs in groups.items():
        good = [r["s"] for r in rs if not r["error"]]
        errors = {r["error"] for r in rs if r["error"]}
        equal = {r["equal"] for r in rs} - {None}
        med = statistics.median(good) if good else float("nan")
        rate = args.gib * (1 << 30) / med / 1e9 if good else 0
        print(
            f"{folder:10} {kind:5} {op:10} median {med:7.3f} s  {rate:6.2f} GB/s"
            f" per process  equal={sorted(equal)} {sorted(errors) if errors else ''}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
