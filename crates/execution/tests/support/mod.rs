//! What the execution crate's integration tests share.

use std::path::PathBuf;

/// The Python environment that `scripts/setup.sh --test` makes (`.venv` with torch), or `None` once the test's
/// output says `SKIP:` and what is missing. Under `KFORGE_CI=1` set-up has run, so a missing environment fails the
/// test instead.
pub fn python() -> Option<PathBuf> {
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if python.exists() {
        return Some(python);
    }
    let missing = format!("{} is missing: run scripts/setup.sh --test", python.display());
    assert!(std::env::var_os("KFORGE_CI").is_none_or(|ci| ci != "1"), "{missing}");
    let thread = std::thread::current();
    println!("SKIP: {}: {missing}", thread.name().unwrap_or("this test"));
    None
}
