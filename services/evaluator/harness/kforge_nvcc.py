"""nvcc for kforge's load_inline builds: nvcc's own steps, with the host and device front ends side by side.

    python kforge_nvcc.py NVCC-ARGUMENTS...

For one .cu file nvcc runs, one after the other: the host preprocessor and cudafe++ (the host front end), then per
architecture the device preprocessor, cicc (the device front end) and ptxas, then fatbinary, then the host
compiler over cudafe++'s output. Neither front end needs the other's output but one file: the module id, which
both derive from the source and can each write (`--gen_module_id_file`). So this asks nvcc for its steps
(`--dryrun`, into a private temporary directory), runs the host chain and the device chain at once, checks that
both wrote the same module id, and then runs the host compiler. The commands are nvcc's, unchanged but for the
module id file's name; the object is the one nvcc builds (the same bytes but for the temporary file names nvcc
itself varies per run; bench/results/compile-*). A build that fails prints what nvcc would have printed: the host
chain's output first, and the device chain's only when the host chain succeeded.

When the include path has ATen's headers, ATen/Functions.h is read with only the operator headers the translation
unit names (AtenOverlay, below): the host preprocessor first runs with none of them, the identifiers it leaves are
looked up among the operators' names, and both chains then run with an ATen/Functions.h that includes what was
found, written beside the object. A build that fails so and quotes a left-out operator's name in its messages is
built again with every header; `KFORGE_ALL_OPERATORS=1` always does. The object is the same, byte for byte but for
nvcc's temporary file names (bench/results/compile-*).

`-MD -MF FILE` (load_inline's dependency file) is written by the host preprocessor. Anything this does not
recognise (other dependency options, relocatable device code, several inputs, a dry run that has other steps) is
handed to nvcc as it is. The real nvcc is $KFORGE_REAL_NVCC, else $CUDA_HOME/bin/nvcc.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MODULE_ID = re.compile(r'--module_id_file_name\s+"?([^"\s]+)"?')


def real_nvcc():
    explicit = os.environ.get("KFORGE_REAL_NVCC")
    if explicit:
        return explicit
    return os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def split_dependency_output(args):
    """(the arguments without `-MD -MF FILE`, FILE or None), or None for any other dependency option."""
    rest, depfile, i = [], None, 0
    while i < len(args):
        arg = args[i]
        if arg == "-MD" and i + 2 < len(args) and args[i + 1] == "-MF":
            depfile = args[i + 2]
            i += 3
            continue
        if arg.startswith("-M") or arg.startswith("--generate-dependencies") or arg.startswith("--dependency"):
            return None
        rest.append(arg)
        i += 1
    return rest, depfile


def output_of(args):
    if "-c" not in args or "-o" not in args or args.index("-o") + 1 >= len(args):
        return None
    if sum(1 for a in args if a.endswith(".cu")) != 1:
        return None
    if any(a in ("-rdc=true", "-dc", "--relocatable-device-code=true", "--keep", "--dryrun", "-E") for a in args):
        return None
    return args[args.index("-o") + 1]


# ATen's operator headers. ATen/Functions.h includes one header per operator, `ATen/ops/<op>.h`, declaring the
# functions `at::<op>`, `at::<op>_out` and the like: 1348 of them in torch 2.15, a tenth of what torch/types.h makes a
# compiler read, and an nvcc build reads it three times (cudafe++, cicc, the host compiler).
OPERATOR_INCLUDE = re.compile(r"#include <ATen/ops/(\w+)\.h>")
# Included by Functions.h ahead of the rest, and used by what follows them there.
ALWAYS_INCLUDED = frozenset({"from_blob", "tensor"})
LINE_MARKER = re.compile(rb'^# \d+ "([^"\n]*)"[^\n]*$', re.MULTILINE)
IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
OUTPUT = re.compile(r' -o "?([^"\s]+)"?')
QUOTED = re.compile(r'"([^"\n]*)"')


def named_identifiers(preprocessed):
    """The identifiers a preprocessed translation unit spells outside ATen's operator headers and the Tensor class's
    definition (TensorBody.h, whose methods share the operators' names and call their dispatch entries, never the
    functions of Functions.h). Macros are expanded: what a macro spells where it is used is there."""
    names = set()
    pieces = LINE_MARKER.split(preprocessed)
    skipped = False
    for i, piece in enumerate(pieces):
        if i % 2 == 1:
            skipped = b"/ATen/ops/" in piece or piece.endswith(b"ATen/core/TensorBody.h")
        elif not skipped:
            names.update(IDENTIFIER.findall(piece))
    return {name.decode() for name in names}


def operators_named(operators, names):
    """The operators (of `operators`, header names) whose functions `names` may call. An operator's header declares
    `<op>`, `<op>_out`, `<op>_symint`, ..., `__dispatch_<op>`, and for `__and__` and the like `__<op>__`: a name is
    the operator's when it is the operator's name or starts with it and an underscore, once a leading `__dispatch_`
    or `__` is removed. Keeping more than is needed is harmless; keeping less is a compile error, after which the
    build is made again with every header."""
    kept = set(ALWAYS_INCLUDED)
    for name in names:
        for variant in {name, name.removeprefix("__dispatch_"), name.removeprefix("__")}:
            if variant in operators:
                kept.add(variant)
            cut = variant.find("_", 1)
            while cut != -1:
                if variant[:cut] in operators:
                    kept.add(variant[:cut])
                cut = variant.find("_", cut + 1)
    return kept


class AtenOverlay:
    """ATen/Functions.h with only the operator headers a build names, in a directory put first on the build's
    include path. A build that never spells a function's name cannot call it: name lookup, overload resolution and
    argument-dependent lookup all start from the name, and the operator headers declare inline functions and nothing
    else. So the headers left out change no meaning; they are only not read."""

    def __init__(self, root, directory):
        self.root, self.directory = root, directory
        with open(os.path.join(root, "ATen", "Functions.h")) as f:
            self.lines = f.read().splitlines(keepends=True)
        self.operators = {m.group(1) for line in self.lines if (m := OPERATOR_INCLUDE.fullmatch(line.strip()))}

    @classmethod
    def for_build(cls, args, output):
        """The overlay for a build whose include path has ATen's headers, beside its object (the dependency file
        names it, so it stays with the build); None otherwise, or when $KFORGE_ALL_OPERATORS is set."""
        if os.environ.get("KFORGE_ALL_OPERATORS"):
            return None
        for flag, value in zip(args, args[1:] + [""]):
            directory = value if flag in ("-I", "-isystem") else flag[2:] if flag.startswith("-I") else None
            if directory and os.path.isfile(os.path.join(directory, "ATen", "Functions.h")):
                return cls(directory, os.path.abspath(f"{output}.aten"))
        return None

    def write(self, kept_operators):
        """Writes Functions.h keeping the headers of `kept_operators` and those always included."""
        self.kept = set(kept_operators) | ALWAYS_INCLUDED
        os.makedirs(os.path.join(self.directory, "ATen"), exist_ok=True)
        path = os.path.join(self.directory, "ATen", "Functions.h")
        with open(path, "w") as f:
            for line in self.lines:
                m = OPERATOR_INCLUDE.fullmatch(line.strip())
                if m is None or m.group(1) in self.kept:
                    f.write(line)
        # ninja takes the time a command started as its output's; a header written during the command would be
        # newer than the object, and the next load_inline (the run stage's) would build it again. The overlay is
        # derived from torch's header (and the source, which ninja watches itself), so it takes the header's time.
        source = os.stat(os.path.join(self.root, "ATen", "Functions.h"))
        os.utime(path, ns=(source.st_atime_ns, source.st_mtime_ns))

    def may_explain(self, printed):
        """Whether a failed build's messages quote a name of an operator that was left out. nvcc's front ends
        quote the name they could not find (`identifier "x" is undefined`, `namespace "at" has no member "x"`);
        a failure that quotes none (a typo in the kernel) fails the same way with every header."""
        quoted = {name for text in QUOTED.findall(printed.decode(errors="replace"))
                  for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)}
        return bool(operators_named(self.operators, quoted) - self.kept)

    def remove(self):
        shutil.rmtree(self.directory, ignore_errors=True)


class Plan:
    """nvcc's steps for one compile, sorted into the host chain, the device chain and the final host compile, with
    the module id files the host front end and each device front end write."""

    def __init__(self, environment, host, device, final, module_ids):
        self.environment, self.host, self.device, self.final = environment, host, device, final
        self.module_ids = module_ids


def tool_of(step):
    return os.path.basename(step.split()[0].strip('"'))


def plan(dry_run_lines):
    """The plan for nvcc's `--dryrun` lines (without their `#$ ` prefix), or None when they have another shape."""
    environment, steps = [], []
    for line in dry_run_lines:
        if ASSIGNMENT.match(line):
            environment.append(line)
        elif line.strip():
            steps.append(line)
    host, device, final = [], [], None
    for i, step in enumerate(steps):
        tool = tool_of(step)
        preprocess = " -E " in f" {step} "
        if preprocess and "-D__CUDA_ARCH__=" in step:
            device.append(step)
        elif preprocess:
            host.append(step)
        elif tool == "cudafe++":
            host.append(step)
        elif tool in ("cicc", "ptxas", "fatbinary"):
            device.append(step)
        elif tool == "rm":
            device.append(step.replace("rm ", "rm -f ", 1))
        elif i == len(steps) - 1 and " -c " in f" {step} ":
            final = step
        else:
            return None
    cudafe = [s for s in host if tool_of(s) == "cudafe++"]
    front_ends = [s for s in device if tool_of(s) == "cicc"]
    if final is None or len(cudafe) != 1 or not front_ends or "--gen_module_id_file" not in cudafe[0]:
        return None
    ids = {MODULE_ID.search(s).group(1) if MODULE_ID.search(s) else None for s in cudafe + front_ends}
    if len(ids) != 1 or None in ids:
        return None
    # Each device front end writes its own copy of the module id instead of reading the host front end's.
    module_ids = [ids.pop()]
    for n, step in enumerate(device):
        if tool_of(step) == "cicc":
            module_ids.append(f"{module_ids[0]}.device{n}")
            device[n] = step.replace(module_ids[0], module_ids[-1]).replace(" -tused", " -tused --gen_module_id_file", 1)
            if "--gen_module_id_file" not in device[n]:
                return None
    return Plan(environment, host, device, final, module_ids)


def exports(environment):
    """nvcc's variables as exports. Lists (`SYSTEM_INCLUDES="-isystem" "DIR"`) are nvcc's own bookkeeping, already
    spelled out in the steps, and are left out."""
    for assignment in environment:
        words = shlex.split(assignment)
        if len(words) == 1:
            name, value = words[0].split("=", 1)
            yield f"export {name}={shlex.quote(value)}"


def script(environment, steps):
    lines = ["set -e", *exports(environment), *steps]
    return "\n".join(lines) + "\n"


def start(environment, steps):
    return subprocess.Popen(["bash", "-c", script(environment, steps)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def build(real, args, scratch, aten=None):
    """Builds the object the plan's way: (nvcc's exit status, what it printed), or None when nvcc itself must build
    it. With `aten` (an AtenOverlay), ATen's operator headers the translation unit never names are left out."""
    rest, depfile = split_dependency_output(args)
    output = output_of(args)
    if aten is not None:
        rest = ["-I", aten.directory, *rest]
        aten.write(kept_operators=())
    dry = subprocess.run([real, "--dryrun", *rest], env=dict(os.environ, TMPDIR=scratch), capture_output=True,
                         text=True)
    lines = [line[3:] for line in dry.stderr.splitlines() + dry.stdout.splitlines() if line.startswith("#$ ")]
    steps = plan(lines) if dry.returncode == 0 else None
    if steps is None:
        return None
    if aten is not None:
        # The host preprocessor over the source with no operator header at all: what the source and the other
        # headers name. Run again below, with the operators they name.
        preprocessed = OUTPUT.search(steps.host[0])
        if preprocessed is None:
            return None
        probe = subprocess.run(["bash", "-c", script(steps.environment, [steps.host[0]])], capture_output=True)
        if probe.returncode != 0:
            return probe.returncode, probe.stdout + probe.stderr
        with open(preprocessed.group(1), "rb") as f:
            aten.write(operators_named(aten.operators, named_identifiers(f.read())))
    if depfile:
        steps.host[0] = f"{steps.host[0]} -MD -MF {shlex.quote(depfile)} -MT {shlex.quote(output)}"
    host, device = start(steps.environment, steps.host), start(steps.environment, steps.device)
    host_output, _ = host.communicate()
    if host.returncode != 0:
        os.killpg(device.pid, signal.SIGKILL)
        device.wait()
        return host.returncode, host_output
    device_output, _ = device.communicate()
    if device.returncode == 0:
        ids = set()
        for path in steps.module_ids:
            with open(path, "rb") as f:
                ids.add(f.read())
        if len(ids) != 1:
            # Not seen in testing; a library built with mismatched ids would not find its kernels.
            return None
    if device.returncode != 0:
        return device.returncode, host_output + device_output
    final = subprocess.run(["bash", "-c", script(steps.environment, [steps.final])], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    return final.returncode, host_output + device_output + final.stdout


def attempt(real, args, aten=None):
    scratch = tempfile.mkdtemp(prefix="kforge-nvcc-")
    try:
        return build(real, args, scratch, aten)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args):
    real = real_nvcc()
    if split_dependency_output(args) is not None and output_of(args) is not None:
        aten = AtenOverlay.for_build(args, output_of(args))
        built = attempt(real, args, aten) if aten is not None else None
        if built is None or (built[0] != 0 and aten.may_explain(built[1])):
            # What the left-out headers may have failed is built with all of them, and reports as nvcc would.
            if aten is not None:
                aten.remove()
            built = attempt(real, args)
        if built is not None:
            status, printed = built
            sys.stdout.buffer.write(printed)
            sys.stdout.flush()
            return status
    os.execv(real, [real, *args])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
