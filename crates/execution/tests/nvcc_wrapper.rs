//! kforge's nvcc (harness/kforge_nvcc.py) against a stand-in nvcc whose dry run names stand-in tools: the host and
//! device chains run at once, the object comes from nvcc's own final step, the dependency file is written, a
//! failing front end stops the other and prints what nvcc would, and anything unrecognised goes to nvcc as it is.
//! The real nvcc is exercised on a GPU machine (bench/results/compile/).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use kforge_test_support::{Wait, python};

const WRAPPER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/harness/kforge_nvcc.py");

/// A stand-in nvcc: `--dryrun` prints nvcc's steps for one .cu file (in nvcc's format, with its environment lines),
/// anything else reports that nvcc itself ran.
const NVCC: &str = r#"#!/bin/bash
out=""; prev=""; includes=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  { [ "$prev" = "-I" ] || [ "$prev" = "-isystem" ]; } && includes="$includes $prev $a"
  prev="$a"
done
if [ "$1" != "--dryrun" ]; then echo "nvcc itself: $*"; exit 0; fi
d="$TMPDIR"
cat >&2 <<EOF
#\$ _SPACE_= 
#\$ CICC_PATH=$TOOLS
#\$ PATH=$TOOLS:$PATH
#\$ SYSTEM_INCLUDES="-isystem" "/nowhere/cccl"
#\$ LIBRARIES=  "-L/nowhere/lib64"
#\$ gcc -std=c++17 -E -x c++ -D__CUDACC__$includes "k.cu" -o "$d/k.cpp4.ii"
#\$ cudafe++ --c++17 --gen_c_file_name "$d/k.cudafe1.cpp" --gen_module_id_file --module_id_file_name "$d/k.module_id" "$d/k.cpp4.ii"
#\$ gcc -std=c++17 -D__CUDA_ARCH__=900 -E -x c++$includes "k.cu" -o "$d/k.cpp1.ii"
#\$ "\$CICC_PATH/cicc" --c++17 -arch compute_90 -tused --module_id_file_name "$d/k.module_id" "$d/k.cpp1.ii" -o "$d/k.ptx"
#\$ ptxas -arch=sm_90 -m64 "$d/k.ptx" -o "$d/k.cubin"
#\$ fatbinary -64 "--image3=kind=elf,sm=90,file=$d/k.cubin" --embedded-fatbin="$d/k.fatbin.c"
#\$ rm $d/k.fatbin
#\$ gcc -std=c++17 -c -x c++ "$d/k.cudafe1.cpp" -o "$out"
EOF
"#;

/// The stand-in tools, one script under several names. Each logs its arguments. The preprocessor writes the source
/// under a line marker, then a line from an operator header and one from TensorBody.h (as an ATen build's would),
/// and `overlay` when an include directory ending in `.aten` comes first. cudafe++ waits for cicc to start (it
/// fails if the chains run one after the other); with FAIL_HOST it then reports an error, while cicc sleeps for a
/// minute; with FAIL_OVERLAY it reports a left-out operator, `conv2d`, as undefined when its input says `overlay`.
const TOOL: &str = r#"#!/bin/bash
name=$(basename "$0")
echo "$name $*" >> "$LOG/calls"
arg() { local prev=""; for a in "$@"; do [ "$prev" = "$flag" ] && echo "$a"; prev="$a"; done; }
flag=-o; out=$(arg "$@")
flag=--module_id_file_name; id=$(arg "$@")
case "$name" in
  gcc)
    flag=-MF; deps=$(arg "$@")
    [ -n "$deps" ] && echo "deps of k.cu" > "$deps"
    if [[ " $* " == *" -c "* ]]; then echo "module $(cat "${@: -3:1}")" > "$out"
    else
      { [[ " $* " == *".aten -isystem "* ]] && echo overlay
        echo '# 1 "k.cu"'; cat k.cu 2>/dev/null
        echo '# 1 "/inc/ATen/ops/conj.h" 1'; echo 'inline void softmax(); inline void conj();'
        echo '# 1 "/inc/ATen/core/TensorBody.h" 1'; echo 'void mul();'
        echo '# 9 "k.cu" 2'; echo 'end'; } > "$out"
    fi ;;
  cudafe++)
    for _ in $(seq 200); do [ -e "$LOG/cicc-started" ] && break; sleep 0.05; done
    [ -e "$LOG/cicc-started" ] || { echo "cudafe++ ran alone"; exit 3; }
    if [ -n "$FAIL_HOST" ]; then echo 'k.cu(3): error: identifier "undeclared" is undefined'; exit 2; fi
    if [ -n "$FAIL_OVERLAY" ] && grep -q overlay "${@: -1}"; then
      echo 'k.cu(3): error: namespace "at" has no member "conv2d"'; exit 2
    fi
    flag=--gen_c_file_name; generated=$(arg "$@")
    echo "_k_cu_1234" > "$id"; echo "host code" > "$generated"; echo "cudafe++ says hello" ;;
  cicc)
    echo $$ > "$LOG/cicc-started"
    [ -n "$FAIL_HOST" ] && sleep 60
    [[ " $* " == *" --gen_module_id_file "* ]] || { echo "cicc was not asked for its own module id"; exit 4; }
    echo "${DEVICE_ID:-_k_cu_1234}" > "$id"; echo ptx > "$out"; echo "cicc says hello" ;;
  ptxas) echo cubin > "$out" ;;
  fatbinary) : ;;
esac
"#;

struct Fixture {
    dir: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Fixture {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kforge-nvcc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let tools = dir.join("tools");
        std::fs::create_dir_all(&tools).expect("a fixture directory");
        write_executable(&dir.join("nvcc"), NVCC);
        write_executable(&tools.join("tool"), TOOL);
        for name in ["gcc", "cudafe++", "cicc", "ptxas", "fatbinary"] {
            std::os::unix::fs::symlink(tools.join("tool"), tools.join(name)).expect("a tool link");
        }
        Self { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let scratch = self.path("scratch");
        std::fs::create_dir_all(&scratch).expect("a scratch directory");
        Command::new("python3")
            .arg(WRAPPER)
            .args(args)
            .current_dir(&self.dir)
            .env("KFORGE_REAL_NVCC", self.path("nvcc"))
            .env("TOOLS", self.path("tools"))
            .env("LOG", &self.dir)
            .env("TMPDIR", &scratch)
            .envs(env.iter().copied())
            .output()
            .expect("python3 runs")
    }

    fn calls(&self) -> String {
        std::fs::read_to_string(self.path("calls")).unwrap_or_default()
    }

    /// ATen's headers in `inc/` (a Functions.h over eight operators) and a source naming three of them.
    fn with_aten(&self) {
        write_functions_h(&self.path("inc"), &OPERATORS);
        std::fs::write(self.path("k.cu"), "at::relu(x); at::add_out(y, x, x); at::__dispatch_conj(x);\n")
            .expect("a source");
    }

    /// The operators the overlay beside the object includes, in order; None when there is none.
    fn kept_operators(&self) -> Option<Vec<String>> {
        let overlay = std::fs::read_to_string(self.path("k.o.aten/ATen/Functions.h")).ok()?;
        assert!(overlay.starts_with("#pragma once\n") && overlay.ends_with("inline bool tail();\n"), "{overlay}");
        Some(
            overlay
                .lines()
                .filter_map(|line| line.strip_prefix("#include <ATen/ops/")?.strip_suffix(".h>"))
                .map(str::to_owned)
                .collect(),
        )
    }
}

/// `root/ATen/Functions.h`, including the headers of `operators` and ending with a declaration of its own.
fn write_functions_h(root: &Path, operators: &[&str]) {
    std::fs::create_dir_all(root.join("ATen")).expect("an include directory");
    let includes: String = operators.iter().map(|op| format!("#include <ATen/ops/{op}.h>\n")).collect();
    std::fs::write(root.join("ATen/Functions.h"), format!("#pragma once\n{includes}inline bool tail();\n"))
        .expect("Functions.h");
}

const OPERATORS: [&str; 8] = ["from_blob", "tensor", "add", "conj", "conv2d", "mul", "relu", "softmax"];

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("a script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("an executable script");
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

const COMPILE: [&str; 8] = ["-MD", "-MF", "k.o.d", "-O3", "-c", "k.cu", "-o", "k.o"];
const ATEN_COMPILE: [&str; 10] = ["-MD", "-MF", "k.o.d", "-isystem", "inc", "-O3", "-c", "k.cu", "-o", "k.o"];

#[test]
fn the_front_ends_run_side_by_side_and_nvccs_final_step_builds_the_object() {
    let fixture = Fixture::new("sides");
    let output = fixture.run(&COMPILE, &[]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(std::fs::read_to_string(fixture.path("k.o")).expect("the object"), "module host code\n");
    assert_eq!(
        std::fs::read_to_string(fixture.path("k.o.d")).expect("the dependency file"),
        "deps of k.cu\n",
        "the dependency file"
    );
    // nvcc's order of output: the host chain's, then the device chain's.
    let printed = text(&output);
    let (host, device) = (printed.find("cudafe++ says hello"), printed.find("cicc says hello"));
    assert!(host.is_some() && device.is_some() && host < device, "{printed}");
    let calls = fixture.calls();
    assert!(calls.contains("-MD -MF k.o.d -MT k.o"), "the host preprocessor writes the dependencies: {calls}");
    assert!(!calls.contains("nvcc itself"), "{calls}");
    let leftovers: Vec<_> = std::fs::read_dir(fixture.path("scratch")).expect("the scratch directory").collect();
    assert!(leftovers.is_empty(), "the temporary directory is removed: {leftovers:?}");
}

#[tokio::test]
async fn a_failing_host_front_end_prints_what_nvcc_would_and_stops_the_device_chain() {
    let fixture = Fixture::new("failing");
    let output = fixture.run(&COMPILE, &[("FAIL_HOST", "1")]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert_eq!(text(&output), "k.cu(3): error: identifier \"undeclared\" is undefined\n");
    assert!(!fixture.path("k.o").exists());
    // cudafe++ fails only after cicc started, so there is always a device front end to stop.
    let cicc: u32 =
        std::fs::read_to_string(fixture.path("cicc-started")).expect("cicc started").trim().parse().expect("a pid");
    // Killed, it is gone (or a zombie) within moments; left running, it would sleep for a minute.
    let running = || {
        std::fs::read_to_string(format!("/proc/{cicc}/stat"))
            .is_ok_and(|stat| stat.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
    };
    Wait::new("the device front end to be stopped")
        .within(Duration::from_secs(10))
        .every(Duration::from_millis(50))
        .until(|| std::future::ready(!running()))
        .await;
}

#[test]
fn mismatched_module_ids_are_built_by_nvcc_itself() {
    let fixture = Fixture::new("mismatch");
    let output = fixture.run(&COMPILE, &[("DEVICE_ID", "_another_id")]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(text(&output), "nvcc itself: -MD -MF k.o.d -O3 -c k.cu -o k.o\n", "only nvcc's own output");
    let leftovers: Vec<_> = std::fs::read_dir(fixture.path("scratch")).expect("the scratch directory").collect();
    assert!(leftovers.is_empty(), "the temporary directory is removed before nvcc runs: {leftovers:?}");
}

#[test]
fn what_it_does_not_recognise_goes_to_nvcc_as_it_is() {
    for args in
        [&["--version"][..], &["-M", "k.cu"], &["-dc", "-c", "k.cu", "-o", "k.o"], &["-c", "a.cu", "b.cu", "-o", "k.o"]]
    {
        let fixture = Fixture::new("unrecognised");
        let output = fixture.run(args, &[]);
        assert!(output.status.success(), "{}", text(&output));
        assert_eq!(text(&output), format!("nvcc itself: {}\n", args.join(" ")));
        assert_eq!(fixture.calls(), "", "no step ran for {args:?}");
    }
}

#[test]
fn only_the_operator_headers_the_source_names_are_read() {
    let fixture = Fixture::new("operators");
    fixture.with_aten();
    let output = fixture.run(&ATEN_COMPILE, &[]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(std::fs::read_to_string(fixture.path("k.o")).expect("the object"), "module host code\n");
    // Named in the source: relu, add (add_out), conj (__dispatch_conj). Always: from_blob, tensor. Spelled only
    // inside an operator header (softmax, conj) or TensorBody.h (mul), or nowhere (conv2d): left out.
    assert_eq!(
        fixture.kept_operators().expect("an overlay beside the object"),
        ["from_blob", "tensor", "add", "conj", "relu"]
    );
    let calls = fixture.calls();
    let overlay = format!("-I {} -isystem inc", fixture.path("k.o.aten").display());
    let preprocessed: Vec<_> = calls.lines().filter(|line| line.starts_with("gcc") && line.contains(" -E ")).collect();
    assert_eq!(preprocessed.len(), 3, "the probe, then the host and device preprocessors: {calls}");
    assert!(preprocessed.iter().all(|line| line.contains(&overlay)), "the overlay comes first: {calls}");
    // ninja counts an output as made when its command started: a header the dependency file names must not be
    // newer, or the next load_inline (the run stage's) builds the object again.
    let modified = |path: &str| std::fs::metadata(fixture.path(path)).and_then(|m| m.modified()).expect("a header");
    assert_eq!(modified("k.o.aten/ATen/Functions.h"), modified("inc/ATen/Functions.h"));

    let every = Fixture::new("operators-all");
    every.with_aten();
    let output = every.run(&ATEN_COMPILE, &[("KFORGE_ALL_OPERATORS", "1")]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(every.kept_operators(), None);
    assert!(!every.calls().contains(".aten"), "{}", every.calls());
}

#[test]
fn a_failure_that_quotes_a_left_out_operator_is_built_again_with_every_header() {
    let fixture = Fixture::new("operators-retry");
    fixture.with_aten();
    let output = fixture.run(&ATEN_COMPILE, &[("FAIL_OVERLAY", "1")]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(!text(&output).contains("conv2d"), "only the second build's output: {}", text(&output));
    assert_eq!(std::fs::read_to_string(fixture.path("k.o")).expect("the object"), "module host code\n");
    assert_eq!(fixture.kept_operators(), None, "the overlay is removed");
    let calls = fixture.calls();
    assert_eq!(calls.lines().filter(|line| line.starts_with("cudafe++")).count(), 2, "{calls}");
    assert!(calls.lines().last().is_some_and(|line| line.starts_with("gcc") && line.contains(" -c ")), "{calls}");
}

#[test]
fn a_failure_that_quotes_no_left_out_operator_is_reported_from_the_first_build() {
    let fixture = Fixture::new("operators-typo");
    fixture.with_aten();
    let output = fixture.run(&ATEN_COMPILE, &[("FAIL_HOST", "1")]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output));
    assert_eq!(text(&output), "k.cu(3): error: identifier \"undeclared\" is undefined\n");
    let calls = fixture.calls();
    assert_eq!(calls.lines().filter(|line| line.starts_with("cudafe++")).count(), 1, "built once: {calls}");
}

/// The naming rule against the installed torch: every function an operator header declares is found by the rule
/// to be that operator's, so a source that names it gets its header. And with torch's real headers and g++: a
/// source built with only the operators it names compiles, while an operator it does not name is not declared.
#[test]
fn torch_s_operator_headers_are_kept_for_every_name_they_declare_and_left_out_otherwise() {
    let Some(python) = python::or_skip(&[]) else { return };
    let dir = std::env::temp_dir().join(format!("kforge-nvcc-torch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let check = r##"
import os, re, subprocess, sys
sys.path.insert(0, sys.argv[1])
from kforge_harness import build
import kforge_nvcc as k
import torch.utils.cpp_extension as cpp_extension
work = sys.argv[2]
roots = cpp_extension.include_paths()
root = next(d for d in roots if os.path.isfile(os.path.join(d, "ATen", "Functions.h")))
overlay = k.AtenOverlay(root, os.path.join(work, "overlay"))
assert len(overlay.operators) > 1000, len(overlay.operators)
declared = re.compile(r"^\s*(?:inline|TORCH_API|template)[^(;{]*?\b(\w+)\s*\(", re.MULTILINE)
unclaimed = []
for op in sorted(overlay.operators - k.ALWAYS_INCLUDED):
    with open(os.path.join(root, "ATen", "ops", f"{op}.h")) as f:
        names = set(declared.findall(f.read()))  # none for operators that are only methods
    unclaimed += [(op, name) for name in names if op not in k.operators_named(overlay.operators, {name})]
assert not unclaimed, unclaimed[:20]

source = os.path.join(work, "k.cpp")
with open(source, "w") as f:
    f.write("#include <torch/types.h>\n"
            "#define OUT(op) at::op##_out\n"
            "torch::Tensor f(torch::Tensor x) {\n"
            "  auto y = torch::empty_like(x);\n"
            "  OUT(relu)(y, x);\n"
            "  return at::add(y, x.mul(x)).softmax(-1);\n"
            "}\n")
# load_inline's own flags for a C++ source (the harness's build.bindings_flags reads them from torch).
flags = build.bindings_flags([], False)
compiler = [cpp_extension.get_cxx_compiler(), "-I", overlay.directory, *flags]
overlay.write(())
probe = subprocess.run([*compiler, "-E", source], capture_output=True, check=True).stdout
kept = k.operators_named(overlay.operators, k.named_identifiers(probe))
overlay.write(kept)
for op in ("empty_like", "relu", "add", "mul"):
    assert op in kept, op
# Spelled only as a method (TensorBody.h's own text is not counted, the source's is): kept, to be safe.
assert "softmax" in kept
assert len(kept) < len(overlay.operators) // 2, len(kept)
assert "conv2d" not in kept
subprocess.run([*compiler, "-fsyntax-only", source], check=True)
with open(source, "a") as f:
    f.write("auto unnamed = &at::conv2d_symint;\n")
failed = subprocess.run([*compiler, "-fsyntax-only", source], capture_output=True, text=True)
assert failed.returncode != 0 and "conv2d_symint" in failed.stderr, failed.stderr[-2000:]
print(len(overlay.operators), len(kept))
"##;
    // torch looks for ninja on PATH to write its build files; the environment's is beside its Python.
    let path = format!(
        "{}:{}",
        python.parent().expect("a bin directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new(&python)
        .env("PATH", path)
        .args(["-c", check, concat!(env!("CARGO_MANIFEST_DIR"), "/harness")])
        .arg(&dir)
        .output()
        .expect("python runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(output.status.success(), "{}", text(&output));
}

/// A directory of precompiled starts (kforge_nvcc.HostPch) whose operators are `operators`, and none of whose
/// starts fits the stand-in's output.
fn host_pch(fixture: &Fixture, operators: &[&str]) -> PathBuf {
    let dir = fixture.path("pch");
    write_functions_h(&dir.join("aten"), operators);
    let manifest = serde_json::json!({ "aten": "aten", "operators": operators, "prefixes": [] });
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).expect("a manifest");
    dir
}

/// Builds the ATen source with the starts in `pch`; returns kforge's nvcc's trace.
fn run_with_host_pch(fixture: &Fixture, pch: &Path) -> String {
    let (pch, trace) = (pch.display().to_string(), fixture.path("trace.jsonl").display().to_string());
    let output = fixture.run(&ATEN_COMPILE, &[("KFORGE_HOST_PCH", &pch), ("KFORGE_NVCC_TRACE", &trace)]);
    assert!(output.status.success(), "{}", text(&output));
    std::fs::read_to_string(&trace).expect("a trace")
}

#[test]
fn a_source_that_names_only_the_precompiled_start_s_operators_reads_its_headers() {
    let fixture = Fixture::new("host-pch-fits");
    fixture.with_aten();
    let pch = host_pch(&fixture, &["from_blob", "tensor", "add", "conj", "relu", "softmax"]);
    let traced = run_with_host_pch(&fixture, &pch);
    assert_eq!(std::fs::read_to_string(fixture.path("k.o")).expect("the object"), "module host code\n");
    // The chains started beside the probe, with the start's operators, and were kept: no overlay of its own.
    assert_eq!(fixture.kept_operators(), None);
    let calls = fixture.calls();
    let shared = format!("-I {} -isystem inc", pch.join("aten").display());
    let preprocessed: Vec<_> = calls.lines().filter(|line| line.starts_with("gcc") && line.contains(" -E ")).collect();
    assert_eq!(preprocessed.len(), 3, "the probe and the two chains' preprocessors: {calls}");
    assert_eq!(preprocessed.iter().filter(|line| line.contains(&shared)).count(), 2, "{calls}");
    assert!(traced.contains(r#""event": "host_compile", "precompiled": false"#), "no start fits: {traced}");
    assert!(!traced.contains("host_pch_unfit"), "{traced}");

    // A source that names an operator the start leaves out: the chains begun with the start's are stopped, and the
    // build reads its own overlay.
    let unfit = Fixture::new("host-pch-unfit");
    unfit.with_aten();
    let pch = host_pch(&unfit, &["from_blob", "tensor", "add", "relu", "softmax"]);
    let traced = run_with_host_pch(&unfit, &pch);
    assert_eq!(unfit.kept_operators().expect("its own overlay"), ["from_blob", "tensor", "add", "conj", "relu"]);
    assert!(traced.contains(r#"{"event": "host_pch_unfit", "operators": ["conj"]}"#), "{traced}");
    let calls = unfit.calls();
    let own = format!("-I {} -isystem inc", unfit.path("k.o.aten").display());
    assert_eq!(calls.lines().filter(|l| l.starts_with("gcc") && l.contains(" -E ") && l.contains(&own)).count(), 3);
}

/// The precompiled start with a real host compiler: cudafe++'s output has the shape nvcc's has (the main file's
/// line marker, preprocessed headers that open an anonymous namespace inside a namespace under the module's name,
/// the source's code, the stub's include), written by a stand-in cudafe++. The start is built from one source and
/// used by another whose module name differs in length; the object holds the same code, data and symbols but for
/// that namespace's name, and gcc reads the precompiled header. A start that does not fit leaves the output as it
/// is; a compile that fails over a start is run again over the output as it was.
#[test]
fn the_host_compile_reads_a_precompiled_start_and_builds_the_same_code() {
    let fixture = Fixture::new("host-pch-gcc");
    let check = r##"
import os, re, subprocess, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import kforge_nvcc as k
work = sys.argv[2]
tools = os.path.join(work, "tools")
with open(os.path.join(tools, "cudafe++"), "w") as f:
    f.write('#!/bin/bash\nprev=""; for a in "$@"; do [ "$prev" = --gen_c_file_name ] && out="$a"; prev="$a"; done\n'
            'cp "$SYNTHETIC" "$out"\n')
os.chmod(os.path.join(tools, "cudafe++"), 0o755)
os.environ["PATH"] = tools + ":" + os.environ["PATH"]
headers = subprocess.run(["g++", "-std=c++17", "-E", "-x", "c++", "-"], input="#include <vector>\n#include <string>\n",
                         capture_output=True, text=True, check=True).stdout

def output(main, anon, code):
    """cudafe++'s output for a source at `main` whose module names its anonymous namespace `anon`."""
    return (f'# 1 "{main}"\n' + headers +
            f'# 3 "/inc/lib.h" 3\nnamespace lib {{ namespace {anon} __attribute__((visibility("hidden"))) {{ }}; '
            f'using namespace ::lib::{anon}; namespace {anon} __attribute__((visibility("hidden"))) {{\n'
            'inline constexpr int ignore = 7; inline int twice(int x) { return 2 * x; } } }\n'
            f'{code}\n# 1 "k.stub.c"\n#define _NV_ANON_NAMESPACE {anon}\n#ifdef _NV_ANON_NAMESPACE\n#endif\n'
            '# 1 "k.stub.c"\n#include "k.stub.c"\n# 1 "k.stub.c"\n#undef _NV_ANON_NAMESPACE\n')

with open(os.path.join(work, "k.stub.c"), "w") as f:
    f.write("static const int *registered = &::lib::_NV_ANON_NAMESPACE::ignore;\n")
cudafe = f"cudafe++ --stub_file_name k.stub.c --gen_c_file_name {work}/b.cudafe1.cpp {work}/b.ii"
compile_b = f'g++ -std=c++17 -fPIC -c -x c++ "{work}/b.cudafe1.cpp" -o "{work}/b.o"'
with open(os.path.join(work, "b.synthetic"), "w") as f:
    f.write(output("/build/b/cuda.cu", "_GLOBAL__N__1a2b3c4d_7_cuda_cu_5e6f7a8b", ""))
os.environ["SYNTHETIC"] = os.path.join(work, "b.synthetic")
pch_dir = os.path.join(work, "pch")
os.makedirs(pch_dir)
reason, entry = k._precompile_host_prefix("default", k.Plan([], [cudafe], [], compile_b, []), pch_dir)
assert reason is None, reason
assert entry["occurrences"] == 3 and entry["scopes"] == ["lib"], entry
with open(os.path.join(pch_dir, "manifest.json"), "w") as f:
    k.json.dump({"aten": "aten", "operators": [], "prefixes": [entry]}, f)
os.environ["KFORGE_HOST_PCH"] = pch_dir
pch = k.HostPch.configured()

code = ('# 5 "/build/c/cuda.cu"\nint use(int x) { std::vector<std::string> v(lib::ignore);\n'
        '  return lib::twice(x) + (int)v.size() + lib::_GLOBAL__N__99887766_7_cuda_cu__Z3usei::ignore; }\n')
source = output("/build/c/cuda.cu", "_GLOBAL__N__99887766_7_cuda_cu__Z3usei", code)
path = os.path.join(work, "c.cudafe1.cpp")

def build(text, rewrite, out):
    with open(path, "w") as f:
        f.write(text)
    original = pch.rewrite(path) if rewrite else None
    done = subprocess.run(["g++", "-std=c++17", "-fPIC", "-H", "-c", "-x", "c++", path, "-o", out],
                          capture_output=True, text=True, cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    return original, done.stderr

def contents(obj):
    names = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    code = subprocess.run(["objdump", "-dr", "--no-show-raw-insn", obj], capture_output=True, text=True,
                          check=True).stdout.split("\n", 3)[-1]
    return re.sub(r"\d+_GLOBAL__N__\w+?(?=\d+(ignore|twice))", "<anon>", names + code)

_, plain = build(source, False, os.path.join(work, "plain.o"))
assert "! " not in plain
original, used = build(source, True, os.path.join(work, "pch.o"))
assert original == source.encode(), "the rewrite returns the output as it was"
with open(path) as f:
    rewritten = f.read()
assert rewritten.startswith('# 1 "/build/c/cuda.cu"\n#include "' + os.path.join(pch_dir, "host-default.h") + '"\n')
assert "namespace lib { namespace _GLOBAL__N__99887766_7_cuda_cu__Z3usei = _GLOBAL__N__kforge_cuda_cu; }" in rewritten
assert len(rewritten) < len(source) // 5
assert "! " + os.path.join(pch_dir, "host-default.h.gch") in used, used[:2000]
assert contents(os.path.join(work, "plain.o")) == contents(os.path.join(work, "pch.o"))
assert "_GLOBAL__N__kforge_cuda_cu" in subprocess.run(["nm", os.path.join(work, "pch.o")], capture_output=True,
                                                      text=True).stdout

# Another start: left as it is.
other = source.replace("inline constexpr int ignore = 7;", "inline constexpr int ignore = 8;")
with open(path, "w") as f:
    f.write(other)
assert pch.rewrite(path) is None
with open(path) as f:
    assert f.read() == other

# A rest that reopens the start's namespace by the module's name fails over the start (the alias is no
# namespace), and is compiled again over the output as it was.
reopened = source.replace("# 1 \"k.stub.c\"\n#define",
                          "namespace lib { namespace _GLOBAL__N__99887766_7_cuda_cu__Z3usei { int more; } }\n"
                          "# 1 \"k.stub.c\"\n#define", 1)
with open(path, "w") as f:
    f.write(reopened)
os.environ["KFORGE_NVCC_TRACE"] = os.path.join(work, "trace.jsonl")
done = k.host_compile([], f'g++ -std=c++17 -fPIC -c -x c++ "{path}" -o "{work}/again.o"', pch)
assert done.returncode == 0, done.stdout[-2000:]
with open(path) as f:
    assert f.read() == reopened
with open(os.path.join(work, "trace.jsonl")) as f:
    events = [k.json.loads(line) for line in f]
assert [(e["event"], e.get("precompiled"), e["status"]) for e in events] == [
    ("host_compile", True, 1), ("host_compile_again", None, 0)], events
print("ok")
"##;
    let output = Command::new("python3").args(["-c", check, WRAPPER]).arg(&fixture.dir).output().expect("python3 runs");
    assert!(output.status.success(), "{}", text(&output));
}
