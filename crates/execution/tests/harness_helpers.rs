//! The harness's helpers run directly with the Python environment of `scripts/setup.sh --test`: the build recipe
//! it installs, its count of calls into extensions, its input and comparison helpers, and its timed loop.

use std::path::PathBuf;

use kforge_test_support::python;

/// The harness replaces load_inline with kforge's build recipe unless the evaluator asks for stock builds
/// (`build_recipe = "stock"`, which sets `KFORGE_BUILD_RECIPE=stock`).
#[test]
fn the_harness_leaves_load_inline_alone_for_stock_builds() {
    let Some(python) = python::or_skip(&[]) else { return };
    let harness = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("harness");
    let script = format!(
        "import os, sys\n\
         sys.path.insert(0, {harness:?})\n\
         import torch.utils.cpp_extension as ext\n\
         from kforge_harness import build\n\
         stock = ext.load_inline\n\
         build.install_build_recipe(building=True)\n\
         print('stock' if ext.load_inline is stock else 'recipe')\n",
        harness = harness.display().to_string(),
    );
    let recipe = |stock: bool| {
        let mut command = std::process::Command::new(&python);
        command.args(["-c", &script]).env("TORCH_EXTENSIONS_DIR", std::env::temp_dir());
        if stock {
            command.env("KFORGE_BUILD_RECIPE", "stock");
        }
        let output = command.output().expect("python runs");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    };
    assert_eq!(recipe(false), "recipe");
    assert_eq!(recipe(true), "stock");
}

/// The harness counts calls into the functions of the modules load_inline returns (the census's decoy check), and
/// gives no count for a module it cannot count completely (one exporting a class) or a library that is no module.
#[test]
fn the_harness_counts_calls_into_the_candidate_s_extensions() {
    let Some(python) = python::or_skip(&[]) else { return };
    let harness = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("harness");
    let script = format!(
        "import sys, types\n\
         sys.path.insert(0, {harness:?})\n\
         import torch.utils.cpp_extension as ext\n\
         from kforge_harness import census\n\
         def module(**attributes):\n\
         \x20   m = types.ModuleType('kforge_fake_extension')\n\
         \x20   m.__dict__.update(attributes)\n\
         \x20   return m\n\
         plain = module(double=lambda x: 2 * x, square=lambda x: x * x)\n\
         ext.load_inline = lambda *a, **k: plain\n\
         calls = census.ExtensionCalls()\n\
         calls.install()\n\
         loaded = ext.load_inline('fake', '')\n\
         assert ext.load_inline('fake', '') is loaded\n\
         before = (calls.functions, calls.calls, calls.complete)\n\
         results = (loaded.double(3), loaded.square(3), loaded.square(4))\n\
         print(before, calls.calls, results)\n\
         ext.load_inline = lambda *a, **k: module(run=len, Options=type('Options', (), {{}}))\n\
         calls.install()\n\
         ext.load_inline('classes', '')\n\
         print(calls.complete)\n\
         other = census.ExtensionCalls()\n\
         ext.load = lambda *a, **k: '/path/of/a/library.so'\n\
         other.install()\n\
         ext.load('operators', [])\n\
         print(other.complete)\n",
        harness = harness.display().to_string(),
    );
    let output = std::process::Command::new(&python).args(["-c", &script]).output().expect("python runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines, vec!["(2, 0, True) 3 (6, 9, 16)", "False", "False"], "{stdout}");
}

/// The harness's input and comparison helpers (`fixtures/harness_inputs_and_checks.py`): the sparse perturbation of
/// the sensitivity trial, the device-side input digest, the chunked comparison and its room relative to the output's
/// mean value, the differential sensitivity check and the sensitivity trial's tolerance, the trials kept under the
/// output budget, and the order in which trials, the replay and later re-checks are judged, on values chosen so that
/// each can fail.
#[test]
fn the_harness_perturbs_digests_and_compares_as_documented() {
    let Some(stdout) = fixture_script("harness_inputs_and_checks.py") else { return };
    assert_eq!(stdout.lines().count(), 8, "{stdout}");
}

/// The sample of timed calls the candidate's harness keeps for the checker (`fixtures/harness_timed_sample.py`):
/// every measured call kept with the same chance, as copies taken when the call returned, within the byte bound;
/// and a candidate wrong on every third timed call (right on the last) found through a sampled call.
#[test]
fn the_harness_samples_timed_calls_for_the_checker() {
    let Some(stdout) = fixture_script("harness_timed_sample.py") else { return };
    assert_eq!(stdout.lines().count(), 4, "{stdout}");
}

/// The timed loop's GPU path on a simulated device (`fixtures/harness_timed_loop.py`): the cover hides the host's
/// launch and the events read the device time; a spin that runs shorter than asked for shows in the loop's figures
/// (`cover_device_ms` against `cover_ms`), and the launch beyond it in the events; a launch beyond the cover's cap
/// (the device time plus the flush's plus 50 us) is timed, and the calls whose cover ran out are counted.
#[test]
fn the_harness_times_behind_a_cover_and_reports_the_cover_the_device_ran() {
    let Some(stdout) = fixture_script("harness_timed_loop.py") else { return };
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
}

/// The harness names a candidate's own kernels from what was built and run: the entry functions of a build's device
/// code by function name, and the Triton kernels the candidate's file makes, at import or later.
#[test]
fn the_harness_names_own_kernels_from_device_code_and_made_triton_kernels() {
    let Some(stdout) = fixture_script("harness_kernel_names.py") else { return };
    assert!(!stdout.contains("SKIP"), "Triton's wheel ships ptxas and cuobjdump: {stdout}");
    assert_eq!(stdout.lines().count(), 5, "{stdout}");
}

/// The outputs files that carry trials' outputs between processes (`fixtures/harness_outputs_files.py`): every
/// dtype and shape back bit for bit, and a malformed file, a link or a FIFO (the candidate's process writes its own
/// folder) refused without blocking; the checker's read-ahead skips files already in memory; on a GPU, device
/// tensors through the staging buffers.
#[test]
fn the_harness_writes_outputs_files_and_refuses_malformed_ones() {
    let Some(stdout) = fixture_script("harness_outputs_files.py") else { return };
    // The GPU's line is a visible SKIP without CUDA.
    assert_eq!(stdout.lines().count(), 5, "{stdout}");
}

/// Runs `tests/fixtures/NAME` with the harness directory on PYTHONPATH (the package imports as `kforge_harness`),
/// asserting it succeeded; its standard output, or `None` (a visible skip) without the test environment's Python.
fn fixture_script(name: &str) -> Option<String> {
    let python = python::or_skip(&[])?;
    let harness = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("harness");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let output =
        std::process::Command::new(python).arg(&script).env("PYTHONPATH", &harness).output().expect("python runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    Some(stdout)
}
