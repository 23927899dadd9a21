//! A command's output on stdout, where a reader that went away (`kforge call ... | head`) ends the command quietly
//! with status 0: what was not printed was not wanted. Rust ignores SIGPIPE, so a write to a closed pipe fails
//! with `BrokenPipe` instead of killing the process (`println!` would panic on it). Restoring SIGPIPE's default
//! (death by the signal, status 141) is not an option here: the services this process runs write to their own
//! pipes (the evaluator's harness processes), where a reader that died must be an error, not the end of kforge.

use std::io::{self, Write as _};

/// The reader of stdout went away: the command ends quietly ([`is_closed`]).
#[derive(Debug, thiserror::Error)]
#[error("stdout is closed")]
pub struct StdoutClosed;

/// Writes `text` to stdout and flushes it; a closed stdout is [`StdoutClosed`].
pub fn print(text: &str) -> anyhow::Result<()> {
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(written)
}

/// [`print`] with a newline.
pub fn println(text: &str) -> anyhow::Result<()> {
    print(&format!("{text}\n"))
}

/// An error writing to stdout: [`StdoutClosed`] for a reader that went away, else the error.
pub fn written(error: io::Error) -> anyhow::Error {
    if error.kind() == io::ErrorKind::BrokenPipe {
        anyhow::Error::new(StdoutClosed)
    } else {
        anyhow::Error::new(error).context("writing to stdout")
    }
}

/// Whether `error` is (or was caused by) a closed stdout.
pub fn is_closed(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.is::<StdoutClosed>())
}
