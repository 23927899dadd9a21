//! What a command is (a program, its environment, the paths it may touch and its limits) and how it ended.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// System locations every command may read (and execute from): libraries, compilers, device nodes, `/proc`.
pub const SYSTEM_READABLE: &[&str] =
    &["/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/opt", "/proc", "/sys", "/dev", "/run"];

/// Resource limits of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Wall-clock time before the whole process group is killed.
    pub wall: Duration,
    /// CPU seconds (RLIMIT_CPU), summed over the command's threads.
    pub cpu_seconds: u64,
    /// Largest file the command may write (RLIMIT_FSIZE).
    pub file_bytes: u64,
    /// Open file descriptors (RLIMIT_NOFILE).
    pub open_files: u64,
    /// Bytes of stdout and of stderr kept; the rest is read and dropped so the command never blocks on a full pipe.
    pub output_bytes: usize,
    /// Scheduling niceness (0 to 19): a background command yields the CPU to the others.
    pub nice: i32,
    /// Processes and threads of the command at once (its pids cgroup's `pids.max`), where the host allows one.
    pub processes: u64,
    /// The CPUs the command starts on (its affinity); empty: those of the caller.
    pub cpus: Vec<usize>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            wall: Duration::from_secs(120),
            cpu_seconds: 600,
            file_bytes: 2 << 30,
            open_files: 4096,
            output_bytes: 64 * 1024,
            nice: 0,
            // torch.compile's workers (one per core, up to 32) with their threads stay well under this.
            processes: 2048,
            cpus: Vec::new(),
        }
    }
}

/// A program to run in the sandbox.
#[derive(Debug, Clone)]
pub struct Command {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// The whole environment of the command; nothing is inherited.
    pub env: Vec<(OsString, OsString)>,
    /// Working directory and `TMPDIR`; always writable.
    pub scratch: PathBuf,
    /// Further paths the command may read (the interpreter's installation, its input files). With Landlock active,
    /// nothing else is readable but [`SYSTEM_READABLE`], the scratch directory and `writable`; the evaluator's
    /// caches stay out of a candidate's view.
    pub readable: Vec<PathBuf>,
    /// Further directories the command may write (e.g. the compile cache during a compile).
    pub writable: Vec<PathBuf>,
    pub limits: Limits,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal (its own fault: a segfault, an abort, RLIMIT_CPU's SIGXCPU...).
    Signal(i32),
    /// Ran past its wall-clock limit; the sandbox killed the group.
    TimedOut,
    /// The caller cancelled it; the sandbox killed the group.
    Cancelled,
}

impl From<std::process::ExitStatus> for Exit {
    fn from(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Exit::Code(code),
            (None, Some(signal)) => Exit::Signal(signal),
            (None, None) => Exit::Signal(0),
        }
    }
}

/// A finished command.
#[derive(Debug, Clone)]
pub struct Finished {
    pub exit: Exit,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Whether stdout or stderr went over `output_bytes` and was cut.
    pub output_truncated: bool,
    /// From the start, or for a command given its input later, from the input's delivery, to the end.
    pub wall: Duration,
}

impl Finished {
    pub fn success(&self) -> bool {
        self.exit == Exit::Code(0)
    }

    /// The end of stderr as text, for error messages.
    pub fn stderr_tail(&self, bytes: usize) -> String {
        let start = self.stderr.len().saturating_sub(bytes);
        String::from_utf8_lossy(&self.stderr[start..]).into_owned()
    }
}

/// At most `limit` bytes of `text`, cut at a character boundary, keeping the end (where a command's errors are), marked
/// `[...]` where cut: for error messages and logs made from a command's output.
pub fn tail(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_owned();
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    format!("[...]{}", &text[start..])
}

/// `program` itself when it names a path, otherwise the first executable of that name on this process's `PATH`: a
/// command's environment is its own, so the program it runs is found before it starts.
pub fn resolve_on_path(program: &std::path::Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.components().count() > 1 {
        return Some(program.to_owned());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(program)).find(|candidate| {
        std::fs::metadata(candidate).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_keeps_the_end_at_a_character_boundary() {
        assert_eq!(tail("short", 10), "short");
        assert_eq!(tail("0123456789", 4), "[...]6789");
        // "é" is two bytes: a cut inside it moves past it.
        assert_eq!(tail("aé", 1), "[...]");
        assert_eq!(tail("aéb", 2), "[...]b");
    }

    #[test]
    fn a_program_is_found_on_path_unless_it_names_a_path() {
        assert_eq!(resolve_on_path(std::path::Path::new("./x")), Some(PathBuf::from("./x")));
        let sh = resolve_on_path(std::path::Path::new("sh")).expect("sh is on PATH");
        assert!(sh.is_absolute() && sh.ends_with("sh"), "{}", sh.display());
        assert_eq!(resolve_on_path(std::path::Path::new("kforge-no-such-program")), None);
    }
}
