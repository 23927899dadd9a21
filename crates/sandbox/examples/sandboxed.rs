//! Runs one command in this host's sandbox and prints how it ended: for diagnosing what a command needs on a new host
//! (which paths a GPU driver reads, whether Landlock lets it start).
//!
//! `cargo run -p kforge-sandbox --example sandboxed -- [--read PATH]... [--write PATH]... [--env K=V]...
//! [--without network_namespace|landlock|process_limit|command_users]... -- PROGRAM [ARGS]...`

use std::ffi::OsString;
use std::path::PathBuf;

use kforge_sandbox::{Command, Limits, Sandbox, SandboxOptions};
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args_os().skip(1);
    let (mut readable, mut writable, mut env) = (Vec::new(), Vec::new(), Vec::new());
    let mut options = SandboxOptions::default();
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--read") => readable.push(PathBuf::from(args.next().expect("--read PATH"))),
            Some("--write") => writable.push(PathBuf::from(args.next().expect("--write PATH"))),
            Some("--env") => {
                let pair = args.next().expect("--env K=V").into_string().expect("utf-8 --env");
                let (key, value) = pair.split_once('=').expect("--env K=V");
                env.push((OsString::from(key), OsString::from(value)));
            }
            Some("--without") => match args.next().and_then(|a| a.into_string().ok()).as_deref() {
                Some("network_namespace") => options.network_namespace = false,
                Some("landlock") => options.landlock = false,
                Some("process_limit") => options.process_limit = false,
                Some("command_users") => options.command_users = false,
                other => panic!("--without: unknown protection {other:?}"),
            },
            Some("--") => break,
            _ => panic!("unexpected argument {arg:?}"),
        }
    }
    let program = PathBuf::from(args.next().expect("a program after --"));
    let scratch = std::env::temp_dir().join(format!("kforge-sandboxed-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch directory");
    env.push(("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into()));
    env.push(("HOME".into(), scratch.clone().into()));
    let sandbox = Sandbox::detect_with(options).await;
    for protection in sandbox.protections() {
        println!("{:<18} {:<5} {}", protection.name, protection.active, protection.detail);
    }
    let command = Command {
        program,
        args: args.collect(),
        env,
        scratch: scratch.clone(),
        readable,
        writable,
        limits: Limits::default(),
    };
    let finished = sandbox.run(command, CancellationToken::new()).await.expect("the sandbox starts the job");
    println!("exit: {:?} after {:?}", finished.exit, finished.wall);
    println!("--- stdout\n{}", String::from_utf8_lossy(&finished.stdout));
    println!("--- stderr\n{}", String::from_utf8_lossy(&finished.stderr));
    let _ = std::fs::remove_dir_all(scratch);
}
