//! What the evaluator's integration tests share.

use std::path::PathBuf;

/// The Python environment that `scripts/setup.sh --test` makes (`.venv` with torch), or `None` once the test's
/// output says `SKIP:` and what is missing. Under `KFORGE_CI=1` set-up has run, so a missing environment fails the
/// test instead.
pub fn python() -> Option<PathBuf> {
    kforge_test_support::python::or_skip(&[])
}
