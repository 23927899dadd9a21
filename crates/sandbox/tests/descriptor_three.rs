//! A controlled command under Landlock when the command's ruleset is the parent's descriptor 3: the control channel, which
//! the child moves onto its descriptor 3, must not replace the ruleset before the child restricts itself with it
//! (it did: an evaluator's stage failed to start now and then with "File descriptor in bad state", EBADFD from
//! landlock_restrict_self). A test binary of its own: the test frees descriptor 3 before the sandbox builds the
//! ruleset, so the ruleset takes it.

use std::os::fd::AsRawFd;
use std::time::Duration;

use kforge_sandbox::{Command, Exit, Limits, Sandbox, SandboxOptions};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_util::sync::CancellationToken;

#[test]
fn a_ruleset_on_descriptor_three_outlives_the_control_channel() {
    // Descriptor 3 held while the runtime opens its own, then freed: the lowest free descriptor, which the ruleset
    // (the first descriptor the sandbox opens for a command) takes.
    let placeholder = std::fs::File::open("/dev/null").expect("/dev/null");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let on_three = placeholder.as_raw_fd() == 3;
    drop(placeholder);
    runtime.block_on(async {
        let options = SandboxOptions {
            network_namespace: false,
            process_limit: false,
            command_users: false,
            ..Default::default()
        };
        let sandbox = Sandbox::detect_with(options).await;
        if !sandbox.landlock_active() || !on_three {
            let why = if on_three { "Landlock is not active on this host" } else { "descriptor 3 was taken" };
            println!("SKIP: a_ruleset_on_descriptor_three_outlives_the_control_channel: {why}");
            return;
        }
        let scratch = std::env::temp_dir().join(format!("kforge-sandbox-fd3-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).expect("scratch");
        let command = Command {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo ready >&3; read reply <&3; echo \"$reply\"".into()],
            env: vec![("PATH".into(), "/usr/bin:/bin".into())],
            scratch,
            readable: vec![],
            writable: vec![],
            limits: Limits { wall: Duration::from_secs(30), ..Limits::default() },
        };
        let converse = |_control, socket: tokio::net::UnixStream| async move {
            let (read, mut write) = socket.into_split();
            let line = BufReader::new(read).lines().next_line().await.expect("read").expect("a line");
            assert_eq!(line, "ready");
            write.write_all(b"go\n").await.expect("reply");
            std::future::pending::<()>().await
        };
        let finished = sandbox
            .run_with_control(command, async { Some(Vec::new()) }, converse, CancellationToken::new())
            .await
            .expect("the job starts");
        assert_eq!(finished.exit, Exit::Code(0), "{}", finished.stderr_tail(500));
        assert_eq!(String::from_utf8_lossy(&finished.stdout), "go\n");
    });
}
