//! kforge's nvcc (harness/kforge_nvcc.py) against a stand-in nvcc whose dry run names stand-in tools: the host and
//! device chains run at once, the object comes from nvcc's own final step, the dependency file is written, a
//! failing front end stops the other and prints what nvcc would, and anything unrecognised goes to nvcc as it is.
//! The real nvcc is exercised on a GPU machine (bench/results/compile-*).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WRAPPER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/harness/kforge_nvcc.py");

/// A stand-in nvcc: `--dryrun` prints nvcc's steps for one .cu file (in nvcc's format, with its environment lines),
/// anything else reports that nvcc itself ran.
const NVCC: &str = r#"#!/bin/bash
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
if [ "$1" != "--dryrun" ]; then echo "nvcc itself: $*"; exit 0; fi
d="$TMPDIR"
cat >&2 <<EOF
#\$ _SPACE_= 
#\$ CICC_PATH=$TOOLS
#\$ PATH=$TOOLS:$PATH
#\$ SYSTEM_INCLUDES="-isystem" "/nowhere/cccl"
#\$ LIBRARIES=  "-L/nowhere/lib64"
#\$ gcc -std=c++17 -E -x c++ -D__CUDACC__ "k.cu" -o "$d/k.cpp4.ii"
#\$ cudafe++ --c++17 --gen_c_file_name "$d/k.cudafe1.cpp" --gen_module_id_file --module_id_file_name "$d/k.module_id" "$d/k.cpp4.ii"
#\$ gcc -std=c++17 -D__CUDA_ARCH__=900 -E -x c++ "k.cu" -o "$d/k.cpp1.ii"
#\$ "\$CICC_PATH/cicc" --c++17 -arch compute_90 -tused --module_id_file_name "$d/k.module_id" "$d/k.cpp1.ii" -o "$d/k.ptx"
#\$ ptxas -arch=sm_90 -m64 "$d/k.ptx" -o "$d/k.cubin"
#\$ fatbinary -64 "--image3=kind=elf,sm=90,file=$d/k.cubin" --embedded-fatbin="$d/k.fatbin.c"
#\$ rm $d/k.fatbin
#\$ gcc -std=c++17 -c -x c++ "$d/k.cudafe1.cpp" -o "$out"
EOF
"#;

/// The stand-in tools, one script under several names. Each logs its arguments. cudafe++ waits for cicc to
/// start (it fails if the chains run one after the other); with FAIL_HOST it then reports an error, while cicc
/// sleeps for a minute.
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
    if [[ " $* " == *" -c "* ]]; then echo "module $(cat "${@: -3:1}")" > "$out"; else echo pre > "$out"; fi ;;
  cudafe++)
    for _ in $(seq 200); do [ -e "$LOG/cicc-started" ] && break; sleep 0.05; done
    [ -e "$LOG/cicc-started" ] || { echo "cudafe++ ran alone"; exit 3; }
    if [ -n "$FAIL_HOST" ]; then echo 'k.cu(3): error: identifier "undeclared" is undefined'; exit 2; fi
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
}

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("a script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("an executable script");
}

fn text(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

const COMPILE: [&str; 8] = ["-MD", "-MF", "k.o.d", "-O3", "-c", "k.cu", "-o", "k.o"];

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

#[test]
fn a_failing_host_front_end_prints_what_nvcc_would_and_stops_the_device_chain() {
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
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while running() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!running(), "the device front end was stopped");
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
