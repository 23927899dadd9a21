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


def build(real, args, scratch):
    """Builds the object the plan's way and returns nvcc's exit status, or None when nvcc itself must build it."""
    rest, depfile = split_dependency_output(args)
    output = output_of(args)
    dry = subprocess.run([real, "--dryrun", *rest], env=dict(os.environ, TMPDIR=scratch), capture_output=True,
                         text=True)
    lines = [line[3:] for line in dry.stderr.splitlines() + dry.stdout.splitlines() if line.startswith("#$ ")]
    steps = plan(lines) if dry.returncode == 0 else None
    if steps is None:
        return None
    if depfile:
        steps.host[0] = f"{steps.host[0]} -MD -MF {shlex.quote(depfile)} -MT {shlex.quote(output)}"
    host, device = start(steps.environment, steps.host), start(steps.environment, steps.device)
    host_output, _ = host.communicate()
    if host.returncode != 0:
        os.killpg(device.pid, signal.SIGKILL)
        device.wait()
        sys.stdout.buffer.write(host_output)
        return host.returncode
    device_output, _ = device.communicate()
    if device.returncode == 0:
        ids = set()
        for path in steps.module_ids:
            with open(path, "rb") as f:
                ids.add(f.read())
        if len(ids) != 1:
            # Not seen in testing; a library built with mismatched ids would not find its kernels.
            return None
    sys.stdout.buffer.write(host_output + device_output)
    sys.stdout.flush()
    if device.returncode != 0:
        return device.returncode
    return subprocess.run(["bash", "-c", script(steps.environment, [steps.final])]).returncode


def run(args):
    real = real_nvcc()
    if split_dependency_output(args) is not None and output_of(args) is not None:
        scratch = tempfile.mkdtemp(prefix="kforge-nvcc-")
        try:
            status = build(real, args, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if status is not None:
            return status
    os.execv(real, [real, *args])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
