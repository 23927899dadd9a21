"""Outputs files: how outputs pass between a stage's processes (the candidate's, the reference's, the checker's),
written and read without pickle (`write_outputs`, `load_outputs`), read ahead as host work (`prefetch`), and their
digests (`tensor_digest`, `outputs_digest`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import process
from .process import libc_memory, originals

if TYPE_CHECKING:
    import torch

    from .gate import Gate

# An output in the saved form: `exact_tensor`, `device`, and `tensor` or `value` (see `write_outputs`).
Saved = dict[str, Any]


def flatten_outputs(output: Any) -> list[Any]:
    """A model's output as a list of values; tuples and lists are flattened one level, in order."""
    if isinstance(output, (list, tuple)):
        return list(output)
    return [output]


# Elements per step of the device-side digest and comparison: bounds their temporary memory (a few hundred MB).
CHUNK_ELEMENTS = 1 << 25


def saved_outputs(output: Any) -> list[Saved]:
    """Outputs in the saved form (see write_outputs), left on their device: for comparing in this process."""
    import torch

    return [
        {"exact_tensor": type(v) is torch.Tensor, "device": str(v.device), "tensor": v.detach()}
        if isinstance(v, torch.Tensor)
        else {"exact_tensor": False, "device": "", "value": repr(v)[:200]}
        for v in flatten_outputs(output)
    ]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's bytes as a flat uint8 tensor (a 0-dim tensor too: a loss is one)."""
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def tensor_bytes(values: Iterable[Any]) -> int:
    """The bytes of the tensors among `values`."""
    import torch

    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def output_bytes(output: Any) -> int:
    """The bytes of a model output's tensors."""
    return tensor_bytes(flatten_outputs(output))


def tensor_digest(values: Iterable[Any], key: int | None = None) -> tuple[int, ...]:
    """A digest of tensors' bytes, computed where they live (no copy to the host): per tensor, the wrapping sums of
    its 32-bit words (bytes where the size is not a multiple of 4) and of those words times a weight per position:
    a multiplicative hash of the position, or with `key` a random draw from a generator seeded with it, so that
    changes that cancel out cannot be chosen without the key. Any change of a word changes it unless a second change
    cancels it exactly; it compares a tensor with itself earlier in the same process (inputs the candidate must not
    write), or an outputs file with the outputs it was written from (`outputs_digest`)."""
    import torch

    parts = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        flat = as_bytes(value.detach())
        words = flat
        if flat.numel() % 4 == 0:
            try:
                words = flat.view(torch.int32)
            except RuntimeError:  # a view whose first byte is not 4-aligned (a half tensor at an odd offset)
                words = flat.clone().view(torch.int32)
        plain = torch.zeros((), dtype=torch.int64, device=flat.device)
        weighted = torch.zeros_like(plain)
        for start in range(0, words.numel(), CHUNK_ELEMENTS):
            chunk = words[start : start + CHUNK_ELEMENTS].to(torch.int64)
            if key is None:
                position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device)
                weight = position * 2654435761 + 97531
            else:
                draws = torch.Generator(device=flat.device).manual_seed((key * 1_000_003 + start) % (1 << 62))
                weight = torch.randint(
                    -(1 << 62), 1 << 62, (chunk.numel(),), generator=draws, dtype=torch.int64, device=flat.device
                )
            plain += chunk.sum()
            weighted += (chunk * weight).sum()
        parts.append(torch.stack([plain, weighted]))
    return tuple(torch.stack(parts).flatten().tolist()) if parts else ()


# Outputs files (`write_outputs`, `load_outputs`): this magic, the JSON header's length (8 bytes, little-endian), the
# header, then each tensor's bytes as they lie in memory, every part starting on a multiple of OUTPUTS_ALIGN.
OUTPUTS_MAGIC = b"KFOUT1\n\0"


OUTPUTS_ALIGN = 64


OUTPUTS_HEADER_LIMIT = 1 << 20


def aligned(n: int) -> int:
    return -(-n // OUTPUTS_ALIGN) * OUTPUTS_ALIGN


def write_outputs(output: Any, path: str, stream: Any = None, private: bool = False) -> list[Saved]:
    """Writes a model's output for another process of the evaluation to read (`load_outputs`): a JSON header (each
    output's dtype, shape and place, or the repr of a value that is not a tensor), then each tensor's bytes as they
    are, at 64-byte aligned offsets. No pickle and no checksum: torch.save computed a CRC32 per record at about
    1 GB/s on one core. On a memory filesystem (/dev/shm), a device tensor is copied off its device in chunks
    through two pinned buffers, each chunk written (pwrite) while the next one copies; on a disk, the file's room is
    allocated and mapped, and each tensor copied into its place (`write_tensor`: what measured fastest on each).
    A full filesystem is an error here. With `stream`, everything that reads the output (resolving conjugate and
    negative views, making it contiguous, the copies) is ordered on that stream, as a consumer on it would read.
    Without `private`, one tensor at a time, so at most one contiguous copy is held on the device. With `private`
    (outputs of at most RACE_CHECK_BYTES), every tensor is first copied on the device, all before any is copied to
    host memory of the harness's own, and the file is written from those host copies, which are what is returned:
    the file is in the candidate's folder, and the candidate's code could rewrite it.

    Returns the outputs in the saved form: `exact_tensor` (the value's type is torch.Tensor itself), `device`, and
    with `private` `tensor` (the copy), or `value` for what is not a tensor."""
    import torch

    o = originals()
    values = flatten_outputs(output)
    # What is written: with `private`, the harness's own copies, taken before any host work. Each output is first
    # copied on the stream (`as_written`'s copy where it made one, else a clone), the copies enqueued one after the
    # other with no host synchronisation between them, then each is copied to the host: work the stream is not
    # ordered after has only until those copies run to end and hide a race (at most RACE_CHECK_BYTES of copies on the
    # device). A copy off the device is already the harness's own; so is a CPU tensor's copy.
    written = values
    if private:
        with o.stream(stream) if stream is not None else contextlib.nullcontext():
            written = [own_copy(value) if isinstance(value, torch.Tensor) else value for value in values]
            written = [o.to(copy, "cpu") if isinstance(copy, torch.Tensor) else copy for copy in written]
    items, offset = [], 0
    for value in values:
        if not isinstance(value, torch.Tensor):
            items.append({"exact_tensor": False, "device": "", "value": repr(value)[:200]})
            continue
        nbytes = value.numel() * value.element_size()
        items.append(
            {
                "exact_tensor": type(value) is torch.Tensor,
                "device": str(value.device),
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        offset += aligned(nbytes)
    header = json.dumps({"items": items}).encode()
    if len(header) > OUTPUTS_HEADER_LIMIT:
        raise ValueError(f"{len(items)} outputs: more than an outputs file's header holds")
    start = aligned(len(OUTPUTS_MAGIC) + 8 + len(header))
    saved = []
    fd = o.os_open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        pwrite_all(fd, OUTPUTS_MAGIC + len(header).to_bytes(8, "little") + header, 0)
        mapping = None
        if offset and not memory_backed(fd):
            o.fallocate(fd, start, offset)  # a full disk is an error here, not a SIGBUS in the copy
            mapping = o.from_file(f"/proc/self/fd/{fd}", shared=True, size=start + offset, dtype=torch.uint8)
        with o.stream(stream) if stream is not None else contextlib.nullcontext():
            for value, item in zip(written, items):
                if "dtype" not in item:
                    saved.append(item)
                    continue
                tensor = as_written(value)  # a private copy is as written already: the same memory
                write_tensor(fd, tensor, start + item["offset"], mapping)
                entry = {"exact_tensor": item["exact_tensor"], "device": item["device"]}
                if private:
                    entry["tensor"] = tensor
                saved.append(entry)
                del tensor
        o.ftruncate(fd, start + offset)  # the padding after the last tensor
    finally:
        o.close(fd)
    return saved


def own_copy(value: torch.Tensor) -> torch.Tensor:
    """`as_written(value)` in memory of its own: the same tensor cloned where `as_written` made no copy."""
    o = originals()
    written = as_written(value)
    return o.clone(written) if o.data_ptr(written) == o.data_ptr(value) else written


def as_written(value: torch.Tensor) -> torch.Tensor:
    """A tensor output as `write_outputs` writes its bytes: conjugate and negative views resolved, contiguous."""
    o = originals()
    return o.contiguous(o.resolve_neg(o.resolve_conj(o.detach(value))))


# On a memory filesystem, a device tensor larger than a sixteenth of this goes to its file through pinned staging
# buffers of this size (two, made once per process); a smaller one is copied to host memory at once. Measured on H100
# and H200 hosts (bench/results/evaluator-outputs-io/2026-11-27): a 4 GiB output written to /dev/shm took 3.4-3.9 s
# mapped (one page fault per 4 KiB, the driver's pageable copy) and 1.4-1.7 s staged; to a disk's page cache,
# 1.1 s mapped and 0.9-2.8 s staged.
STAGING_BYTES = 64 << 20


def staging_buffers() -> list[torch.Tensor]:
    """The process's two staging buffers: pinned host memory where the device allows it, pageable otherwise. Making
    pinned memory synchronises the device, so a candidate's process makes them before the candidate is imported
    (`mode_candidate`), where its outputs will be staged."""
    import torch

    if not process.STAGING:
        try:
            buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        except RuntimeError:
            buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8) for _ in range(2)]
        process.STAGING[:] = buffers
    return process.STAGING


def write_tensor(fd: int, tensor: torch.Tensor, at: int, mapping: torch.Tensor | None = None) -> None:
    """Writes a contiguous tensor's bytes at offset `at` of the file: into the file's `mapping` where there is one (a
    copy on the current stream); else a CPU tensor's (or a small device tensor's host copy) at once, and a device
    tensor's in chunks through the staging buffers (`write_staged`), each written once its copy is done (an event on
    the current stream, not a device-wide synchronisation) while the next one copies."""
    import torch

    o = originals()
    nbytes = o.numel(tensor) * o.element_size(tensor)
    if nbytes == 0:
        return
    flat = o.view(o.reshape(tensor, (-1,)), torch.uint8)
    if mapping is not None:
        o.copy(o.narrow(mapping, 0, at, nbytes), flat)
        return
    if flat.device.type == "cpu" or nbytes <= STAGING_BYTES // 16:
        host = flat if flat.device.type == "cpu" else o.to(flat, "cpu")
        pwrite_all(fd, o.numpy(host), at)
        return
    write_staged(fd, flat, at, nbytes)


def write_staged(fd: int, flat: torch.Tensor, at: int, nbytes: int) -> None:
    """Writes a flat byte tensor of a device through the staging buffers: chunk i is copied on the current stream
    into buffer i % 2 and an event recorded; then chunk i - 1, its event reached, is written while chunk i copies."""
    o = originals()
    buffers, events, pending = staging_buffers(), [None, None], None

    def write(slot, done, length):
        o.event_synchronize(events[slot])
        pwrite_all(fd, o.numpy(o.narrow(buffers[slot], 0, 0, length)), at + done)

    try:
        for index, done in enumerate(range(0, nbytes, STAGING_BYTES)):
            slot, length = index % 2, min(STAGING_BYTES, nbytes - done)
            o.copy(o.narrow(buffers[slot], 0, 0, length), o.narrow(flat, 0, done, length), non_blocking=True)
            events[slot] = o.event()
            o.event_record(events[slot])
            if pending is not None:
                write(*pending)
            pending = (slot, done, length)
        write(*pending)  # pyright: ignore[reportOptionalIterable]  (set by the loop: nbytes > 0)
    finally:
        # A write that failed leaves no copy into a buffer running: the next write reuses them.
        for event in events:
            if event is not None:
                o.event_synchronize(event)


def memory_backed(fd: int) -> bool:
    """Whether the open file (or directory) lies on a memory filesystem (tmpfs or ramfs, by fstatfs's f_type)."""
    import ctypes

    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86-64); f_type, a long, comes first
    if libc_memory().fstatfs(fd, buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF in (TMPFS_MAGIC, RAMFS_MAGIC)


# statfs magic numbers of filesystems that keep their files in memory (as the evaluator's handoff.rs).
TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6


def staged_outputs(folder: str) -> bool:
    """Whether outputs written in `folder` go through the staging buffers (it lies on a memory filesystem)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        return memory_backed(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: Any, at: int) -> None:
    """Writes all of a bytes-like object at offset `at` (one pwrite moves at most about 2 GiB)."""
    o = originals()
    view = o.memoryview(data).cast("B")
    while view:
        written = o.pwrite(fd, view, at)
        if written <= 0:
            raise OSError(f"pwrite wrote {written} bytes")
        view, at = view[written:], at + written


def open_regular(path: str) -> tuple[int, int]:
    """A read-only descriptor of `path` if it is a regular file (not a link, a FIFO or a device: the candidate's
    process writes its own outputs' folder), and its size; OSError otherwise."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(f"{os.path.basename(path)} is not a regular file")
    return fd, info.st_size


def load_outputs(path: str, device: torch.device) -> list[Saved]:
    """Outputs `write_outputs` wrote, onto `device`: the file is mapped, not read into memory first, and for a device
    its pages are made in one call (`populate`: a 4 GiB file onto an H100 in 0.74 s against 0.86 s faulting page by
    page, 0.56 s against 0.93 s with six such loads at once). The file may be the candidate's process's: it must be
    a regular file laid out exactly as `write_outputs` lays it out (tensors one after the other, the file ending
    with the last), with known dtypes and sizes that match the bytes, or nothing is loaded (an exception)."""
    import torch

    fd, size = open_regular(path)
    try:
        head = os.pread(fd, len(OUTPUTS_MAGIC) + 8, 0)
        if len(head) < len(OUTPUTS_MAGIC) + 8 or not head.startswith(OUTPUTS_MAGIC):
            raise ValueError("not an outputs file")
        length = int.from_bytes(head[len(OUTPUTS_MAGIC) :], "little")
        if length > OUTPUTS_HEADER_LIMIT:
            raise ValueError("outputs header too long")
        header = json.loads(os.pread(fd, length, len(head)))
        start = aligned(len(head) + length)
        items, offset = [], 0
        for item in header["items"]:
            if "dtype" not in item:
                items.append((item, None, None, None, 0))
                continue
            dtype = getattr(torch, str(item["dtype"]), None)
            shape = item["shape"]
            if (
                not isinstance(dtype, torch.dtype)
                or not isinstance(shape, list)
                or len(shape) > 64
                or not all(type(n) is int and 0 <= n <= size for n in shape)
            ):
                raise ValueError("outputs header: bad dtype or shape")
            nbytes = math.prod(shape) * dtype.itemsize
            if item["offset"] != offset or item["nbytes"] != nbytes:
                raise ValueError("outputs header: bad extent")
            items.append((item, dtype, shape, start + offset, nbytes))
            offset += aligned(nbytes)
        if size != start + offset:
            raise ValueError("outputs file: its size is not its header's")
        data = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=size, dtype=torch.uint8)
        if device.type != "cpu":
            populate(data)
    finally:
        os.close(fd)
    outputs = []
    for item, dtype, shape, at, nbytes in items:
        if dtype is None:
            outputs.append({"exact_tensor": False, "device": "", "value": str(item.get("value", ""))[:200]})
            continue
        tensor = data[at : at + nbytes].view(dtype).reshape(shape)
        outputs.append(
            {
                "exact_tensor": item.get("exact_tensor") is True,
                "device": str(item.get("device", ""))[:64],
                "tensor": tensor.to(device),
            }
        )
    return outputs


def in_memory(fd: int, size: int) -> bool:
    """Whether every page of the open file is in memory (the page cache, or a memory-backed filesystem such as the
    evaluator's outputs directory in /dev/shm): mincore(2) over a shared read-only mapping. False where it cannot
    tell; true, whatever is resident, for a file this process may not write (mincore pretends so since Linux 5.0)."""
    import ctypes

    if size == 0:
        return True
    libc = libc_memory()
    address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if address is None or address == ctypes.c_void_p(-1).value:
        return False
    try:
        pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(address, size, vector) != 0:
            return False
        return bytes(vector).count(0) == 0
    finally:
        libc.munmap(address, size)


def populate(mapped: torch.Tensor) -> None:
    """Makes every page of a mapped CPU tensor present in one call (madvise MADV_POPULATE_READ, Linux 5.14) rather
    than one fault per 4 KiB page as it is read; where that is refused, the pages fault as before."""
    if mapped.numel():
        libc_memory().madvise(mapped.data_ptr(), mapped.numel(), 22)


def prefetch(paths: Iterable[str], device: torch.device, gate: Gate) -> None:
    """Reads files into the page cache as host work (see Gate.host_work), so that loading them onto the device
    after, while sharing it, copies from memory instead of waiting for the disk. Only regular files, and no more
    than their size; one that cannot be read is left to the load, which reports it. A file already wholly in memory
    is not read (a 6 GiB trial's two files took 2.8 s to read again on an H200 host)."""
    buffer = bytearray(16 << 20)
    with gate.host_work(device):
        for path in paths:
            try:
                fd, size = open_regular(path)
            except OSError:
                continue
            try:
                # mincore reports every page resident for a file its caller may not write: read such a file.
                if os.access(path, os.W_OK) and in_memory(fd, size):
                    continue
                done = 0
                while done < size:
                    read = os.readv(fd, [buffer])
                    if read <= 0:
                        break
                    done += read
            except OSError:
                pass
            finally:
                os.close(fd)


def timed_output_path(candidate_dir: str, call: int) -> str:
    """Where the outputs of timed call `call` are kept for the checker, in the candidate's folder."""
    return os.path.join(candidate_dir, f"timed-{call}.out")


def outputs_digest(tensors: Iterable[Any], entries: Sequence[Saved], key: int) -> list[int]:
    """The digest of an outputs file: its tensors' bytes (`tensor_digest` with `key`) and a keyed hash of what its
    header says of each output (`entries` in the saved form: a tensor's exact type and device, the repr of what is
    not a tensor). The harness takes it of what it wrote, the checker of what it loaded, so a file the candidate's
    code rewrote in between is seen."""
    import hashlib

    header = json.dumps([(e["exact_tensor"], e["device"], e.get("value")) for e in entries]).encode()
    keyed = hashlib.blake2b(header, digest_size=8, key=key.to_bytes(8, "little"))
    return [*tensor_digest(tensors, key), int.from_bytes(keyed.digest(), "little", signed=True)]
