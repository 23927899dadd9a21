//! A throwaway PostgreSQL cluster: initdb and pg_ctl on a temporary directory, as the `postgres` user when this
//! process is root. It listens on a Unix socket in that directory and on no TCP port, so no port is chosen for
//! it and none can be taken from under it; its URL names the socket's directory (`?host=/dir`, which sqlx and
//! libpq read as a socket).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running cluster, stopped and removed on drop.
#[derive(Debug)]
pub struct Postgres {
    dir: PathBuf,
    bin: PathBuf,
    /// `postgres://kforge@localhost/postgres?host=DIR`: the superuser `kforge` (trust authentication).
    pub url: String,
}

impl Postgres {
    /// Starts a cluster named after `test`, or says `SKIP:` and returns `None` where the PostgreSQL binaries are
    /// missing (a failure under `KFORGE_CI=1`).
    pub fn start(test: &str) -> Option<Self> {
        let Some(bin) = bindir() else {
            crate::python::skip(
                "PostgreSQL binaries (initdb, pg_ctl) not found: scripts/setup.sh --test installs them",
            );
            return None;
        };
        // Short: a socket's path has room for about a hundred bytes.
        let dir = std::env::temp_dir().join(format!("kforge-pg-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("cluster dir");
        let root = is_root();
        if root {
            let status = Command::new("chown").arg("postgres:postgres").arg(&dir).status().expect("chown runs");
            assert!(status.success(), "chown postgres {}: is there a postgres user?", dir.display());
        }
        let data = dir.join("data");
        run_as_postgres(
            root,
            &bin.join("initdb"),
            &["-D", path(&data), "-A", "trust", "-U", "kforge", "--no-sync", "-E", "UTF8"],
            &dir,
        );
        let options = format!("-k {} -c listen_addresses='' -c fsync=off", dir.display());
        let log = dir.join("log");
        run_as_postgres(
            root,
            &bin.join("pg_ctl"),
            &["-D", path(&data), "-o", &options, "-l", path(&log), "-w", "-t", "120", "start"],
            &dir,
        );
        Some(Self { url: format!("postgres://kforge@localhost/postgres?host={}", dir.display()), dir, bin })
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let mut command = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bin.join("pg_ctl"));
            c
        } else {
            Command::new(self.bin.join("pg_ctl"))
        };
        let _ = command.args(["-D", path(&data), "-m", "immediate", "-w", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run_as_postgres(root: bool, program: &Path, args: &[&str], dir: &Path) {
    let mut command = if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let output = command.args(args).current_dir(dir).output().expect("postgres tool runs");
    assert!(
        output.status.success(),
        "{} {args:?} failed: {}{}",
        program.display(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The directory holding initdb and pg_ctl: PATH first, then Debian's /usr/lib/postgresql/<version>/bin.
fn bindir() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|entry| entry.path().join("bin"));
    on_path.chain(debian).find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()).map(|dir| {
        // A symlink (/usr/local/bin/initdb) leads to the real directory, where the server binary is too.
        std::fs::canonicalize(dir.join("initdb")).ok().and_then(|p| p.parent().map(Path::to_path_buf)).unwrap_or(dir)
    })
}
