//! The repository's Python environment (`.venv`, made by `scripts/setup.sh --test`: PyTorch, the harness's
//! packages, pyarrow, PyYAML), and the visible skip of a test that cannot run without something.
//!
//! A test that needs the environment calls [`or_skip`]: without it the test prints `SKIP: <test>: <what is
//! missing>` and returns, except under `KFORGE_CI=1` (set-up has run there), where a missing tool fails the test.
//! A test that must never skip (the CLI's, whose point is the evaluator running candidates) calls [`required`].

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::canonicalize(&root).unwrap_or(root)
}

/// The interpreter's path in the repository's `.venv`, whether or not it exists.
pub fn venv_python() -> PathBuf {
    repo_root().join(".venv/bin/python")
}

/// Whether tests must fail rather than skip when a tool is missing (`scripts/test.sh` sets it after set-up).
pub fn ci() -> bool {
    std::env::var("KFORGE_CI").is_ok_and(|v| v == "1")
}

/// Skips the running test, visibly: prints `SKIP: <test name>: <missing>`. Under `KFORGE_CI=1` it panics with
/// `missing` instead.
pub fn skip(missing: impl Display) {
    assert!(!ci(), "{missing} (KFORGE_CI=1 requires it)");
    let thread = std::thread::current();
    println!("SKIP: {}: {missing}", thread.name().unwrap_or("this test"));
}

/// The `.venv` interpreter if it exists and imports every module of `modules`, or what is missing, with the
/// command that installs it.
pub fn find(modules: &[&str]) -> Result<PathBuf, String> {
    let python = venv_python();
    if !python.exists() {
        return Err(format!("{} is missing: run scripts/setup.sh --test", python.display()));
    }
    for module in modules {
        let imported = Command::new(&python).args(["-c", &format!("import {module}")]).output();
        if !imported.is_ok_and(|output| output.status.success()) {
            return Err(format!("{} cannot import {module}: run scripts/setup.sh --test", python.display()));
        }
    }
    Ok(python)
}

/// The `.venv` interpreter with `modules`, or `None` once the test has said `SKIP:` and what is missing (a
/// failure under `KFORGE_CI=1`).
pub fn or_skip(modules: &[&str]) -> Option<PathBuf> {
    find(modules).map_err(skip).ok()
}

/// The `.venv` interpreter with `modules`; panics naming what is missing (for tests that never skip).
pub fn required(modules: &[&str]) -> PathBuf {
    find(modules).unwrap_or_else(|missing| panic!("{missing}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_root_holds_the_workspace_manifest() {
        assert!(super::repo_root().join("crates/test-support/Cargo.toml").is_file());
    }

    #[test]
    fn a_missing_module_is_named_with_the_set_up_command() {
        // Where the venv itself is missing, that is what is named.
        let missing = super::find(&["kforge_no_such_module"]).expect_err("no such module");
        assert!(missing.ends_with(": run scripts/setup.sh --test"), "{missing}");
        assert!(missing.contains(".venv/bin/python"), "{missing}");
    }
}
