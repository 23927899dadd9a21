"""nvcc for kforge's load_inline builds: nvcc's own steps, with the host and device front ends side by side.

    python kforge_nvcc.py NVCC-ARGUMENTS...

For one .cu file nvcc runs, one after the other: the host preprocessor and cudafe++ (the host front end), then per
architecture the device preprocessor, cicc (the device front end) and ptxas, then fatbinary, then the host
compiler over cudafe++'s output. Neither front end needs the other's output but one file: the module id, which
both derive from the source and can each write (`--gen_module_id_file`). So this asks nvcc for its steps
(`--dryrun`, into a private temporary directory), runs the host chain and the device chain at once, checks that
both wrote the same module id, and then runs the host compiler. The commands are nvcc's, unchanged but for the
module id file's name; the object is the one nvcc builds (the same bytes but for the temporary file names nvcc
itself varies per run; bench/results/compile/). A build that fails prints what nvcc would have printed: the host
chain's output first, and the device chain's only when the host chain succeeded.

When the include path has ATen's headers, ATen/Functions.h is read with only the operator headers the translation
unit names (AtenOverlay, below): the host preprocessor first runs with none of them, the identifiers it leaves are
looked up among the operators' names, and both chains then run with an ATen/Functions.h that includes what was
found, written beside the object. A build that fails so and quotes a left-out operator's name in its messages is
built again with every header; `KFORGE_ALL_OPERATORS=1` always does. The object is the same, byte for byte but for
nvcc's temporary file names (bench/results/compile/).

With $KFORGE_HOST_PCH (HostPch, below), the host compile starts from a precompiled start of cudafe++'s output when
that output begins with it, and the operator probe runs beside chains already started with the start's operators.
$KFORGE_NVCC_TRACE names a file to which each step's time is appended.

`-MD -MF FILE` (load_inline's dependency file) is written by the host preprocessor. Anything this does not
recognise (other dependency options, relocatable device code, several inputs, a dry run that has other steps) is
handed to nvcc as it is. The real nvcc is $KFORGE_REAL_NVCC, else $CUDA_HOME/bin/nvcc.
"""

import concurrent.futures
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MODULE_ID = re.compile(r'--module_id_file_name\s+"?([^"\s]+)"?')


def trace(event, **fields):
    """Appends one JSON line to $KFORGE_NVCC_TRACE, when set: what a build did and how long its steps took."""
    path = os.environ.get("KFORGE_NVCC_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, **fields}) + "\n")


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
    def for_build(cls, args, output, directory=None):
        """The overlay for a build whose include path has ATen's headers, in `directory` or beside its object (the
        dependency file names it, so it stays with the build); None otherwise, or when $KFORGE_ALL_OPERATORS is
        set."""
        if os.environ.get("KFORGE_ALL_OPERATORS"):
            return None
        for flag, value in zip(args, args[1:] + [""]):
            root = value if flag in ("-I", "-isystem") else flag[2:] if flag.startswith("-I") else None
            if root and os.path.isfile(os.path.join(root, "ATen", "Functions.h")):
                return cls(root, directory or os.path.abspath(f"{output}.aten"))
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

    def adopt(self, operators):
        """The build reads a shared overlay of `operators` (a precompiled start's) instead of writing its own."""
        self.remove()
        self.directory, self.kept = None, set(operators)

    def remove(self):
        """Removes the overlay this build wrote (none once it reads a precompiled start's)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


class Plan:
    """nvcc's steps for one compile, sorted into the host chain, the device chain and the final host compile, with
    the module id files the host front end and each device front end write."""

    def __init__(self, environment, host, device, final, module_ids):
        self.environment, self.host, self.device, self.final = environment, host, device, final
        self.module_ids = module_ids

    def with_include(self, old, new):
        """The plan with include directory `old` replaced by `new` in every step."""
        swap = lambda step: step.replace(old, new)  # noqa: E731
        return Plan(self.environment, [swap(s) for s in self.host], [swap(s) for s in self.device],
                    swap(self.final), self.module_ids)


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


def run_steps(environment, steps):
    """Runs `steps` to the end: the completed process, with what they printed (stdout and stderr) in `stdout`."""
    return subprocess.run(["bash", "-c", script(environment, steps)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def dry_run(real, args, scratch):
    """nvcc's plan for `args` (`--dryrun`, its temporary files named in `scratch`): (the Plan or None when it has
    another shape, what nvcc printed)."""
    dry = subprocess.run([real, "--dryrun", *args], env=dict(os.environ, TMPDIR=scratch), capture_output=True,
                         text=True)
    lines = [line[3:] for line in dry.stderr.splitlines() + dry.stdout.splitlines() if line.startswith("#$ ")]
    return (plan(lines) if dry.returncode == 0 else None), dry.stdout[-2000:] + dry.stderr[-2000:]


def start(environment, steps):
    return subprocess.Popen(["bash", "-c", script(environment, steps)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


# The host compile over a precompiled start. nvcc's last step compiles cudafe++'s output with the host compiler:
# torch's headers once more, preprocessed and rewritten (10 MB of C++ for torch/types.h), the longest step after
# cudafe++ on the host chain. That output starts with the same bytes for every source that starts by including
# torch/types.h (what kforge's recipe makes of torch/extension.h), but for one name: the anonymous namespace,
# which cudafe++ names after the module (`_GLOBAL__N__<hash>_7_cuda_cu_<suffix>`, of varying length) and which
# torch's headers open inside `cuda::std` (libcu++'s `ignore`). A trusted stage (harness mode bindings_pch) builds
# that start from a source that includes torch/types.h alone, with the name replaced by a placeholder, and
# precompiles it with nvcc's host-compile flags (`precompile_host_prefixes`). A build whose cudafe++ output starts
# with those bytes (its own name replaced the same way) is compiled as `#include "<start>.h"`, an alias of its own
# name to the placeholder in each scope that opens the namespace (the rest, and the stub the device chain wrote,
# name it so), and the rest; gcc loads the precompiled start instead of parsing it. The program is the same: the
# same text but for a consistent renaming of a namespace that only using-directives of the start itself open (the
# builder refuses a start that opens one at global scope); the object differs only in the hidden names of that
# namespace's entities. A gcc that finds the precompiled header invalid reads the header, which holds the same
# bytes; a compile that fails over the start is run again on cudafe++'s output as it was. Both chains then read
# the operator headers of the start (`operators` in its manifest), which must include every one the source names.
HOST_PREFIX_SOURCE = "#include <torch/types.h>\n"
# What sources commonly include beside torch/types.h, and the operators they commonly name (a kernel's helper
# called `gelu_` or `row_max` counts as naming gelu or max): the starts read these operators' headers, so that a
# source naming no other one can use them. About a quarter of the headers, where a source alone reads a fifth.
COMMON_HEADERS = ("ATen/cuda/CUDAContext.h", "c10/cuda/CUDAGuard.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_runtime.h")
COMMON_OPERATORS = """abs acos add addmm amax amin arange argmax argmin asin atan avg_pool2d baddbmm batch_norm bmm cat
ceil celu clamp clamp_max clamp_min clone conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d cos
cosh cumprod cumsum diag div dot dropout einsum elu empty empty_like empty_strided erf exp exp2 expand expm1 fill
flatten floor fmax fmin fmod full full_like gather gelu glu group_norm hardsigmoid hardswish hardtanh index_select
instance_norm layer_norm leaky_relu lerp linear log log10 log1p log2 log_softmax logsigmoid logsumexp matmul max
max_pool1d max_pool2d max_pool3d maximum mean min minimum mish mm mse_loss mul narrow neg nll_loss norm ones ones_like
outer pad permute pow prelu prod rand randn reciprocal relu relu6 remainder reshape round rsqrt scatter selu sigmoid
sign silu sin sinh softmax softplus softsign sort sqrt square squeeze stack std sub sum tan tanh threshold topk
transpose tril triu trunc unsqueeze var view where zeros zeros_like""".split()
ANON_NAMESPACE = re.compile(rb"^#define _NV_ANON_NAMESPACE (\S+)$", re.MULTILINE)
HOST_INPUT = re.compile(r'"?([^"\s]+\.cudafe1\.cpp)"?')
LINE = re.compile(rb'^# (\d+)(?: "([^"\n]*)"((?: \d+)*))?[ \t]*$')


def presumed_end(text):
    """Where a compiler's presumed location stands after `text` (preprocessed C++ with line markers): (line, file,
    flags); file None for the main file, which `text` never names."""
    line, file, flags = 1, None, b""
    for row in text.split(b"\n")[:-1]:
        m = LINE.match(row)
        if m:
            line = int(m.group(1))
            if m.group(2) is not None:
                file, flags = m.group(2), b"".join(b" " + f for f in m.group(3).split(b" ") if f in (b"3", b"4"))
            continue
        line += 1
    return line, file, flags


class HostPch:
    """The precompiled starts of cudafe++'s output a trusted stage built ($KFORGE_HOST_PCH: a directory with
    manifest.json, the starts as headers beside their .gch, and the overlay of operator headers they read)."""

    def __init__(self, directory, manifest):
        self.aten_dir = os.path.join(directory, manifest["aten"])
        self.operators = frozenset(manifest["operators"])
        self.prefixes = [dict(p, header=os.path.join(directory, p["header"])) for p in manifest["prefixes"]]

    @classmethod
    def configured(cls):
        directory = os.environ.get("KFORGE_HOST_PCH")
        if not directory or os.environ.get("KFORGE_ALL_OPERATORS"):
            return None
        try:
            with open(os.path.join(directory, "manifest.json")) as f:
                return cls(directory, json.load(f))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def rewrite(self, path):
        """Rewrites cudafe++'s output at `path` to include the first precompiled start it begins with; returns the
        original bytes, or None when none matches (the file is left as it is)."""
        with open(path, "rb") as f:
            data = f.read()
        first = data.find(b"\n") + 1
        main = LINE.match(data[:first].rstrip(b"\n"))
        anon = ANON_NAMESPACE.search(data)
        if not first or main is None or main.group(2) is None or anon is None:
            return None
        name = anon.group(1)
        for prefix in self.prefixes:
            placeholder = prefix["placeholder"].encode()
            # The start names the namespace `occurrences` times, and the two names differ in length.
            length = prefix["length"] + prefix["occurrences"] * (len(name) - len(placeholder))
            head = data[first:first + length]
            if hashlib.sha256(head.replace(name, placeholder)).hexdigest() != prefix["sha256"]:
                continue
            include = b'#include "%s"\n' % prefix["header"].encode()
            # The rest (and the stub nvcc's device chain wrote) may name the start's namespace by the build's own
            # name: an alias in each scope where the start opens it.
            aliases = b"".join(b"%s namespace %s = %s; %s\n" % (
                b" ".join(b"namespace %s {" % part.encode() for part in scope.split("::")), name, placeholder,
                b"}" * len(scope.split("::"))) for scope in prefix["scopes"])
            line, file, flags = prefix["resume"]
            resume = b'# %d "%s"%s\n' % (line, main.group(2) if file is None else file.encode(), flags.encode())
            with open(path, "wb") as f:
                f.write(data[:first] + include + aliases + resume + data[first + length:])
            return data
        return None


def host_compile(environment, final, pch):
    """nvcc's final host compile, over a precompiled start when `pch` has one that fits."""
    source = HOST_INPUT.search(final)
    original = pch.rewrite(source.group(1)) if pch is not None and source else None
    started = time.monotonic()
    done = run_steps(environment, [final])
    trace("host_compile", precompiled=original is not None, status=done.returncode,
          seconds=round(time.monotonic() - started, 3), printed=done.stdout[-2000:].decode(errors="replace"))
    if original is not None and done.returncode != 0:
        with open(source.group(1), "wb") as f:
            f.write(original)
        done = run_steps(environment, [final])
        trace("host_compile_again", status=done.returncode)
    return done


def precompile_host_prefixes(real, variants, out_dir, common_headers=(), common_operators=()):
    """Builds the precompiled starts of cudafe++'s output for a source that includes torch/types.h alone, one per
    variant ({name: nvcc's flags for a load_inline build, without source and output}), into `out_dir`, with the
    manifest HostPch reads. The operator headers the starts read, and every build that uses one, are those named
    by torch/types.h with `common_headers` (what sources include beside it) and `common_operators` (what they call
    themselves): a source that names another builds as before. Returns {variant: None when built, else why not}."""
    scratch = tempfile.mkdtemp(prefix="kforge-host-pch-")
    try:
        aten_dir = os.path.join(out_dir, "aten")
        sources = {"probe": HOST_PREFIX_SOURCE + "".join(f"#include <{h}>\n" for h in common_headers),
                   "prefix": HOST_PREFIX_SOURCE}
        plans, failed, named, overlay = {}, {}, set(), None
        for name, flags in variants.items():
            for kind, text in sources.items():
                work = os.path.join(scratch, name, kind)
                os.makedirs(work)
                source = os.path.join(work, "cuda.cu")
                with open(source, "w") as f:
                    f.write(text)
                args = [*flags, "-c", source, "-o", os.path.join(work, "cuda.cuda.o")]
                overlay = overlay or AtenOverlay.for_build(args, args[-1], directory=aten_dir)
                if overlay is None:
                    return {n: "no ATen headers on the include path" for n in variants}
                overlay.write(kept_operators=())
                steps, printed = dry_run(real, ["-I", aten_dir, *args], work)
                preprocessed = OUTPUT.search(steps.host[0]) if steps else None
                if preprocessed is None:
                    failed[name] = f"nvcc's steps have another shape: {printed}"
                    break
                if kind == "prefix":
                    plans[name] = steps
                    continue
                probe = run_steps(steps.environment, [steps.host[0]])
                if probe.returncode != 0:
                    failed[name] = probe.stdout.decode(errors="replace")[-4000:]
                    break
                with open(preprocessed.group(1), "rb") as f:
                    named |= operators_named(overlay.operators, named_identifiers(f.read()))
        if overlay is None:
            return failed
        overlay.write(named | (set(common_operators) & overlay.operators))
        prefixes = []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(plans))) as pool:
            reasons = pool.map(lambda item: _precompile_host_prefix(*item, out_dir), plans.items())
            for (name, _), (reason, prefix) in zip(plans.items(), reasons):
                if reason:
                    failed[name] = reason
                else:
                    prefixes.append(prefix)
        with open(os.path.join(out_dir, "manifest.json"), "w") as f:
            json.dump({"aten": "aten", "operators": sorted(overlay.kept), "prefixes": prefixes}, f)
        return {name: failed.get(name) for name in variants}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _precompile_host_prefix(name, steps, out_dir):
    """One variant's start, precompiled: (None, its manifest entry), or (why not, None)."""
    host = run_steps(steps.environment, steps.host)
    source = HOST_INPUT.search(steps.final)
    stub = re.search(r'--stub_file_name\s+"?([^"\s]+)"?', next(s for s in steps.host if tool_of(s) == "cudafe++"))
    if host.returncode != 0 or source is None or stub is None:
        return f"the host front end failed: {host.stdout.decode(errors='replace')[-4000:]}", None
    with open(source.group(1), "rb") as f:
        data = f.read()
    first = data.find(b"\n") + 1
    end = data.rfind(b'\n\n# 1 "%s"\n' % stub.group(1).encode())
    anon = ANON_NAMESPACE.search(data)
    if end < first or anon is None:
        return "cudafe++'s output has another shape", None
    placeholder = b"_GLOBAL__N__kforge_cuda_cu"
    prefix = data[first:end + 1].replace(anon.group(1), placeholder)
    scopes = set(re.findall(rb"using namespace ::([\w:]*)::" + re.escape(placeholder) + rb"\b", prefix))
    if re.search(rb"using namespace ::" + re.escape(placeholder) + rb"\b", prefix) or b"" in scopes:
        return "the headers open an anonymous namespace at global scope", None
    header = os.path.join(out_dir, f"host-{name}.h")
    with open(header, "wb") as f:
        f.write(prefix)
    command = HOST_INPUT.sub(lambda _: shlex.quote(header), steps.final.replace(" -c ", " ", 1), count=1)
    command = command.replace(" -x c++ ", " -x c++-header ", 1)
    command = OUTPUT.sub(lambda _: " -o " + shlex.quote(header + ".gch"), command, count=1)
    built = run_steps(steps.environment, [command])
    if built.returncode != 0:
        return f"{command}\n{built.stdout.decode(errors='replace')[-4000:]}", None
    line, file, flags = presumed_end(prefix)
    return None, {"header": os.path.basename(header), "length": len(prefix),
                  "sha256": hashlib.sha256(prefix).hexdigest(), "placeholder": placeholder.decode(),
                  "occurrences": prefix.count(placeholder), "scopes": sorted(s.decode() for s in scopes),
                  "resume": [line, None if file is None else file.decode(), flags.decode()]}


def build(real, args, scratch, aten=None, pch=None):
    """Builds the object the plan's way: (nvcc's exit status, what it printed), or None when nvcc itself must build
    it. With `aten` (an AtenOverlay), ATen's operator headers the translation unit never names are left out; with
    `pch` (a HostPch, used with `aten` only), the host compile starts from a precompiled start that fits."""
    rest, depfile = split_dependency_output(args)
    output = output_of(args)
    if aten is not None:
        rest = ["-I", aten.directory, *rest]
        aten.write(kept_operators=())
    steps, _ = dry_run(real, rest, scratch)
    if steps is None:
        return None

    def chains(plan):
        if depfile:
            plan.host[0] = f"{plan.host[0]} -MD -MF {shlex.quote(depfile)} -MT {shlex.quote(output)}"
        return start(plan.environment, plan.host), start(plan.environment, plan.device)

    started = time.monotonic()
    running = None
    if aten is None:
        pch = None
    else:
        # The host preprocessor over the source with no operator header at all: what the source and the other
        # headers name. The chains then run with the operators they name.
        preprocessed = OUTPUT.search(steps.host[0])
        if preprocessed is None:
            return None
        names = preprocessed.group(1) + ".names"
        probe = start(steps.environment, [steps.host[0].replace(preprocessed.group(0), f" -o {shlex.quote(names)}")])
        if pch is not None:
            # Started beside the probe with the precompiled start's operators, and kept if the probe finds that
            # the source names no other.
            speculative = steps.with_include(rest[1], pch.aten_dir)
            running = chains(speculative)
        probe_output, _ = probe.communicate()
        trace("probe", seconds=round(time.monotonic() - started, 3))
        if probe.returncode != 0:
            stop(running)
            return probe.returncode, probe_output
        with open(names, "rb") as f:
            named = operators_named(aten.operators, named_identifiers(f.read()))
        if pch is not None and named <= pch.operators:
            aten.adopt(pch.operators)
            steps = speculative
        else:
            if pch is not None:
                trace("host_pch_unfit", operators=sorted(named - pch.operators))
            stop(running)
            running, pch = None, None
            aten.write(named)
    host, device = running or chains(steps)
    host_output, _ = host.communicate()
    trace("host_chain", status=host.returncode, seconds=round(time.monotonic() - started, 3))
    if host.returncode != 0:
        stop((device,))
        return host.returncode, host_output
    device_output, _ = device.communicate()
    # The device chain is waited for after the host chain: when it ended first, this is the host chain's end.
    trace("chains", status=device.returncode, seconds=round(time.monotonic() - started, 3))
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
    final = host_compile(steps.environment, steps.final, pch)
    return final.returncode, host_output + device_output + final.stdout


def stop(processes):
    """Kills started chains (each a session of its own), if any."""
    for process in processes or ():
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def attempt(real, args, aten=None, pch=None):
    scratch = tempfile.mkdtemp(prefix="kforge-nvcc-")
    try:
        return build(real, args, scratch, aten, pch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args):
    started = time.monotonic()
    try:
        return run_nvcc(args)
    finally:
        trace("nvcc", seconds=round(time.monotonic() - started, 3))


def run_nvcc(args):
    real = real_nvcc()
    if split_dependency_output(args) is not None and output_of(args) is not None:
        aten = AtenOverlay.for_build(args, output_of(args))
        built = attempt(real, args, aten, HostPch.configured()) if aten is not None else None
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
