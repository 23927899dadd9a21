//! The sandbox's behaviour, through its public interface, on this host. Protections the host lacks (Landlock, a
//! pids cgroup, root for command users) are kernel or host features, not tools set-up installs: a test that needs one
//! says `SKIP:` with what is missing, and checks that the protection is reported inactive where it can.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;

use crate::*;

/// Says, in the test's output, which part of a test did not run on this host and why.
fn skip(what: &str) {
    println!("SKIP: {what}");
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kforge-sandbox-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch");
    dir
}

fn shell(script: &str, name: &str, limits: Limits) -> Command {
    Command {
        program: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
        scratch: scratch(name),
        readable: vec![],
        writable: vec![],
        limits,
    }
}

/// Whether process `pid` is still alive (neither gone nor a zombie) after up to 10 s of polling, with its
/// `/proc/<pid>/stat` line: a SIGKILL is sent at once, but a process on a loaded machine dies when next scheduled.
fn alive(pid: &str) -> (bool, Option<String>) {
    for _ in 0..500 {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        let alive =
            state.as_deref().and_then(|s| s.rsplit(')').next()).is_some_and(|rest| !rest.trim_start().starts_with('Z'));
        if !alive {
            return (false, state);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (true, std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
}

/// The state letter of process `pid` once it is `wanted`, or as it is after up to 2 s.
async fn state_becomes(pid: &str, wanted: impl Fn(Option<char>) -> bool) -> Option<char> {
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
    };
    // Up to 20 s: a stopped or continued process changes state when it next runs, late on a loaded machine (in a
    // whole-suite run on 2 cores a shell stayed in uninterruptible sleep, `D`, for more than 5 s).
    for _ in 0..1000 {
        if wanted(state()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    state()
}

/// Polls (up to 20 s, as `state_becomes`) until the process group `group` is stopped ([`crate::group_stopped`]),
/// or is not, as `wanted`; whether it is.
async fn group_stopped_becomes(group: &str, wanted: bool) -> bool {
    let group = group.parse().expect("a pid");
    for _ in 0..1000 {
        if crate::group_stopped(group) == wanted {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    crate::group_stopped(group)
}

async fn run(sandbox: &Sandbox, command: Command) -> Finished {
    sandbox.run(command, CancellationToken::new()).await.expect("job runs")
}

#[tokio::test]
async fn environment_is_scrubbed_and_scratch_is_the_working_directory() {
    let sandbox = Sandbox::basic();
    let finished = run(&sandbox, shell("env; pwd", "env", Limits::default())).await;
    let out = String::from_utf8_lossy(&finished.stdout);
    assert!(finished.success());
    assert!(!out.contains("CARGO"), "inherited variables leaked: {out}");
    assert!(out.contains(&format!("TMPDIR={}", scratch("env").display())), "{out}");
    assert!(out.trim_end().ends_with(&scratch("env").display().to_string()), "{out}");
}

#[tokio::test]
async fn input_given_later_starts_the_wall_clock_and_none_cancels() {
    let sandbox = Sandbox::basic();
    let limits = Limits { wall: Duration::from_secs(1), ..Limits::default() };
    // The input arrives once a command started after this one has run past the same wall limit: the limit counts from
    // the input's delivery, so this one is not killed.
    let later = async {
        let outlived = sandbox.run(shell("sleep 30", "outlived", limits.clone()), CancellationToken::new()).await;
        assert_eq!(outlived.expect("runs").exit, Exit::TimedOut);
        Some(b"hello\n".to_vec())
    };
    let command = shell("read x; echo got $x", "input", limits.clone());
    let finished = sandbox.run_with_input(command, later, CancellationToken::new()).await.expect("job runs");
    assert_eq!(finished.exit, Exit::Code(0));
    assert_eq!(String::from_utf8_lossy(&finished.stdout).trim(), "got hello");

    let command = shell("read x; echo got $x", "no-input", limits.clone());
    let finished = sandbox.run_with_input(command, async { None }, CancellationToken::new()).await.expect("runs");
    assert_eq!(finished.exit, Exit::Cancelled);
    assert!(finished.stdout.is_empty());

    // A command that ends before its input is finished as it ended.
    let command = shell("exit 7", "early-exit", limits);
    let never = std::future::pending::<Option<Vec<u8>>>();
    let finished = sandbox.run_with_input(command, never, CancellationToken::new()).await.expect("runs");
    assert_eq!(finished.exit, Exit::Code(7));
}

#[tokio::test]
async fn a_controlled_job_talks_on_descriptor_3_and_waits_off_the_clock() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let sandbox = Sandbox::basic();
    // One second of wall clock; the command waits stopped for its reply while a command started after the stop runs past
    // that same limit, then works 0.5 s.
    let limits = Limits { wall: Duration::from_secs(1), ..Limits::default() };
    let command = shell(
        "read request; echo \"ready $request\" >&3; read reply <&3; echo \"$reply\"; sleep 0.5",
        "control",
        limits.clone(),
    );
    let (states, seen) = tokio::sync::oneshot::channel();
    let other = sandbox.clone();
    let converse = |control: Control, socket: tokio::net::UnixStream| async move {
        let (read, mut write) = socket.into_split();
        let mut lines = BufReader::new(read).lines();
        let first = lines.next_line().await.expect("read").expect("a line");
        let group = control.group.to_string();
        control.stop();
        let stopped = state_becomes(&group, |s| s == Some('T')).await;
        let outlived = other.run(shell("sleep 30", "held", limits), CancellationToken::new()).await;
        assert_eq!(outlived.expect("runs").exit, Exit::TimedOut);
        control.resume();
        let resumed = state_becomes(&group, |s| s != Some('T')).await;
        write.write_all(b"go\n").await.expect("reply");
        let _ = states.send((first, stopped, resumed));
        std::future::pending::<()>().await
    };
    let finished = sandbox
        .run_with_control(command, async { Some(b"hello\n".to_vec()) }, converse, CancellationToken::new())
        .await
        .expect("ran");
    let (first, stopped, resumed) = seen.await.expect("the conversation happened");
    assert_eq!(first, "ready hello");
    assert_eq!(stopped, Some('T'), "stop stopped the job");
    assert_ne!(resumed, Some('T'), "resume continued it");
    assert_eq!(finished.exit, Exit::Code(0), "held time did not count: {:?}", finished.wall);
    assert_eq!(String::from_utf8_lossy(&finished.stdout), "go\n");
    // Held for more than the limit, then 0.5 s of work: the time held is in the command's wall time all the same.
    assert!(finished.wall >= Duration::from_millis(1500), "{:?}", finished.wall);
}

#[tokio::test]
async fn wall_clock_kills_the_whole_group() {
    let sandbox = Sandbox::basic();
    let pid_file = scratch("hang").join("child.pid");
    // The wall clock starts once the command has recorded its child (its input comes then), so a slow start on a
    // loaded machine cannot end it before it has a child to leave behind.
    // The child does not hold the command's output pipes, so nothing but the group kill can end it in time.
    let script = format!("sleep 600 >/dev/null 2>&1 & echo $! > {}; read go; sleep 60", pid_file.display());
    let limits = Limits { wall: Duration::from_millis(500), ..Limits::default() };
    let recorded = {
        let pid_file = pid_file.clone();
        async move {
            while std::fs::read_to_string(&pid_file).map_or(true, |pid| !pid.ends_with('\n')) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Some(b"go\n".to_vec())
        }
    };
    let command = shell(&script, "hang", limits);
    let finished = sandbox.run_with_input(command, recorded, CancellationToken::new()).await.expect("job runs");
    assert_eq!(finished.exit, Exit::TimedOut);
    let pid = std::fs::read_to_string(&pid_file).expect("the job recorded its child").trim().to_owned();
    // SIGKILL is delivered before `run` returns; the child is then gone or a zombie awaiting its reaper.
    // Gone (already reaped) or a zombie both mean dead.
    let (alive, state) = alive(&pid);
    assert!(!alive, "a child of the timed-out job survived: {state:?}");
}

#[tokio::test]
async fn output_is_capped_without_blocking_the_job() {
    let sandbox = Sandbox::basic();
    let limits = Limits { output_bytes: 1000, ..Limits::default() };
    let finished = run(&sandbox, shell("head -c 5000000 /dev/zero; echo done >&2", "output", limits)).await;
    assert!(finished.success());
    assert_eq!(finished.stdout.len(), 1000);
    assert!(finished.output_truncated);
    assert_eq!(finished.stderr_tail(100).trim(), "done");
}

#[tokio::test]
async fn signals_and_exit_codes_are_reported() {
    let sandbox = Sandbox::basic();
    assert_eq!(run(&sandbox, shell("exit 7", "code", Limits::default())).await.exit, Exit::Code(7));
    assert_eq!(
        run(&sandbox, shell("kill -SEGV $$", "signal", Limits::default())).await.exit,
        Exit::Signal(libc::SIGSEGV)
    );
}

#[tokio::test]
async fn cancellation_kills_the_job() {
    let sandbox = Sandbox::basic();
    let cancel = CancellationToken::new();
    let command = shell("sleep 30", "cancel", Limits::default());
    let handle = tokio::spawn({
        let cancel = cancel.clone();
        let sandbox = sandbox.clone();
        async move { sandbox.run(command, cancel).await }
    });
    cancel.cancel();
    assert_eq!(handle.await.expect("task").expect("runs").exit, Exit::Cancelled);
}

#[tokio::test]
async fn detected_protections_are_enforced() {
    let sandbox = Sandbox::detect().await;
    let active = |name: &str| sandbox.protections().iter().any(|p| p.name == name && p.active);
    let skipped = |name: &str| skip(&format!("{name} is inactive on this host: its enforcement is not checked"));
    if active("network_namespace") {
        // Only a down loopback exists in the command's namespace.
        let finished = run(&sandbox, shell("cat /proc/net/dev", "net", Limits::default())).await;
        let interfaces = String::from_utf8_lossy(&finished.stdout);
        assert!(!interfaces.lines().skip(2).any(|l| !l.trim_start().starts_with("lo:")), "{interfaces}");
    } else {
        skipped("network_namespace");
    }
    if active("landlock") {
        let outside = std::env::temp_dir().join(format!("kforge-sandbox-outside-{}", std::process::id()));
        let secret = scratch("secret").join("reference.pt");
        std::fs::write(&secret, "expected outputs").expect("secret file");
        let script =
            format!("touch {} 2>/dev/null; cat {} 2>/dev/null; touch inside", outside.display(), secret.display());
        let finished = run(&sandbox, shell(&script, "landlock", Limits::default())).await;
        assert!(finished.success(), "{}", finished.stderr_tail(500));
        assert!(!outside.exists(), "a write outside scratch got through");
        assert!(finished.stdout.is_empty(), "a file outside the readable paths was read");
        assert!(scratch("landlock").join("inside").exists(), "scratch must stay writable");
        // Its own /proc entry stays writable (thread names; the GPU driver needs it), its parent's does not.
        let script = "echo kforge-job > /proc/self/comm && read name < /proc/self/comm && echo $name; echo x 2>/dev/null > /proc/$PPID/comm || echo denied";
        let finished = run(&sandbox, shell(script, "proc", Limits::default())).await;
        assert_eq!(String::from_utf8_lossy(&finished.stdout), "kforge-job\ndenied\n", "{}", finished.stderr_tail(500));
    } else {
        skipped("landlock");
    }
    if active("process_limit") {
        // A fork loop stops at the cap (the shell exits when it cannot fork); without it, it reaches 100.
        let limits = Limits { processes: 20, ..Limits::default() };
        let script = "i=0; while [ $i -lt 100 ]; do sleep 30 & i=$((i+1)); echo $i > forked; done";
        let finished = run(&sandbox, shell(script, "forks", limits)).await;
        let forked: u32 =
            std::fs::read_to_string(scratch("forks").join("forked")).map_or(0, |n| n.trim().parse().unwrap_or(0));
        assert!(forked > 0 && forked < 20, "{forked} children under a cap of 20: {finished:?}");
        // A process that left the command's group and session is still in its cgroup, and killed at the end.
        let script = "setsid sh -c 'echo $$ > escaped.pid; exec sleep 600' </dev/null >/dev/null 2>&1 & \
                      while [ ! -s escaped.pid ]; do sleep 0.01; done";
        let finished = run(&sandbox, shell(script, "escape", Limits::default())).await;
        assert!(finished.success(), "{}", finished.stderr_tail(500));
        let pid = std::fs::read_to_string(scratch("escape").join("escaped.pid")).expect("pid").trim().to_owned();
        let (alive, state) = alive(&pid);
        assert!(!alive, "a process that left the job's group survived it: {state:?}");
    } else {
        skipped("process_limit");
    }
    if active("command_user") || landlock_scopes_signals(&sandbox) {
        // Its parent (this test, standing for the evaluator) is out of its reach.
        assert_eq!(signal_to_parent(&sandbox, "signal-parent").await, "denied\n");
    } else {
        skip("neither command users nor landlock's signal scope (abi 6) is active: signals to the parent not checked");
    }
    // Which protections exist depends on the host; the report must say, one way or the other.
    for name in ["network_namespace", "landlock", "process_group", "rlimits", "process_limit", "command_user"] {
        assert!(sandbox.protections().iter().any(|p| p.name == name), "{name} not reported");
    }
}

/// A sandbox with the command users alone (no cgroup, Landlock or namespace), so what a test sees is their doing.
async fn command_users_only() -> Sandbox {
    let options =
        SandboxOptions { network_namespace: false, landlock: false, process_limit: false, ..SandboxOptions::default() };
    Sandbox::detect_with(options).await
}

/// What a command prints after trying to signal its parent (this test, standing for the evaluator): `reached` or
/// `denied`, with its stderr when it printed neither.
async fn signal_to_parent(sandbox: &Sandbox, name: &str) -> String {
    let script = "kill -0 $PPID 2>/dev/null && echo reached || echo denied";
    let finished = run(sandbox, shell(script, name, Limits::default())).await;
    let out = String::from_utf8_lossy(&finished.stdout).into_owned();
    if out.is_empty() { finished.stderr_tail(500) } else { out }
}

fn landlock_scopes_signals(sandbox: &Sandbox) -> bool {
    sandbox.protections().iter().any(|p| p.name == "landlock" && p.active && p.detail.contains("signals and"))
}

/// A fork loop's count, a `setsid` escapee's pid and what `id` said, from a command as its own user.
const AS_A_USER: &str = "id -u > uid; id -g > gid; touch made; \
    setsid sh -c 'echo $$ > escaped.pid; exec sleep 600' </dev/null >/dev/null 2>&1 & \
    while [ ! -s escaped.pid ]; do sleep 0.01; done; \
    i=0; while [ $i -lt 100 ]; do sleep 30 & i=$((i+1)); echo $i > forked; done";

#[tokio::test]
async fn a_command_user_caps_processes_keeps_signals_in_and_leaves_nothing_behind_without_cgroups() {
    let sandbox = command_users_only().await;
    let report = |name: &str| sandbox.protections().iter().find(|p| p.name == name).cloned().expect(name);
    if sys::effective_uid() != 0 {
        assert!(!report("command_user").active, "{:?}", report("command_user"));
        assert!(!report("process_limit").active, "{:?}", report("process_limit"));
        skip("command users need the tests to run as root: only their report as inactive was checked");
        return;
    }
    assert!(report("command_user").active, "{:?}", report("command_user"));
    assert!(report("process_limit").active && report("process_limit").detail.contains("RLIMIT_NPROC"));

    // Two commands at once run as two users, both in the commands' group, with a cap of 20 each.
    let limits = Limits { processes: 20, ..Limits::default() };
    let (a, b) = tokio::join!(
        run(&sandbox, shell(AS_A_USER, "user-a", limits.clone())),
        run(&sandbox, shell(AS_A_USER, "user-b", limits))
    );
    let read =
        |dir: &str, file: &str| std::fs::read_to_string(scratch(dir).join(file)).unwrap_or_default().trim().to_owned();
    let base = SandboxOptions::default().command_user_base;
    let (uid_a, uid_b): (u32, u32) =
        (read("user-a", "uid").parse().expect("uid"), read("user-b", "uid").parse().expect("uid"));
    assert!(uid_a >= base && uid_b >= base && uid_a != uid_b, "{uid_a} {uid_b}: {a:?} {b:?}");
    assert_eq!(read("user-a", "gid"), base.to_string());
    use std::os::unix::fs::MetadataExt;
    let made = std::fs::metadata(scratch("user-a").join("made")).expect("the job wrote its scratch");
    assert_eq!((made.uid(), made.gid(), made.mode() & 0o020), (uid_a, base, 0o020), "group-writable, the jobs' group");
    for dir in ["user-a", "user-b"] {
        let forked: u32 = read(dir, "forked").parse().unwrap_or(0);
        assert!(forked > 0 && forked < 20, "{forked} children under a cap of 20");
        // The escapee left the group and the session, and no cgroup holds it: the command user's end killed it.
        let pid = read(dir, "escaped.pid");
        let (alive, state) = alive(&pid);
        assert!(!alive, "a process of a finished command's user survived: {state:?}");
    }
    assert_eq!(signal_to_parent(&sandbox, "user-signal").await, "denied\n");
}

#[tokio::test]
async fn stopping_a_job_with_its_own_user_stops_what_left_its_group() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let sandbox = command_users_only().await;
    if !sandbox.command_users_active() {
        // Not root: reported, and the group is all a stop reaches.
        skip("command users are inactive (the tests do not run as root): a stop reaching past the group not checked");
        return;
    }
    // The command starts a child in a session of its own, which says its pid on descriptor 3; the command then waits.
    let script = "setsid sh -c 'echo $$ >&3; exec 3>&-; while :; do sleep 0.05; done' </dev/null >/dev/null 2>&1 & \
                  read reply <&3";
    let command = shell(script, "stop-user", Limits::default());
    let (states, seen) = tokio::sync::oneshot::channel();
    let converse = |control: Control, socket: tokio::net::UnixStream| async move {
        let (read, mut write) = socket.into_split();
        let leader = BufReader::new(read).lines().next_line().await.expect("read").expect("a pid");
        // The child leads a group of its own (setsid), with the `sleep` it runs.
        control.stop();
        let stopped = group_stopped_becomes(&leader, true).await;
        control.resume();
        let resumed = !group_stopped_becomes(&leader, false).await;
        write.write_all(b"done\n").await.expect("reply");
        let _ = states.send((stopped, resumed));
        std::future::pending::<()>().await
    };
    let finished = sandbox
        .run_with_control(command, async { Some(Vec::new()) }, converse, CancellationToken::new())
        .await
        .expect("ran");
    let (stopped, resumed) = seen.await.expect("the conversation happened");
    assert!(stopped, "the stop reached the processes outside the group: {finished:?}");
    assert!(resumed, "the resume reached them too");
}

#[tokio::test]
async fn a_job_s_cpu_demand_and_thread_states_are_read_under_its_own_user() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let sandbox = command_users_only().await;
    if !sandbox.command_users_active() {
        skip(
            "command users are inactive (the tests do not run as root): reading only a command user's processes not checked",
        );
        return;
    }
    // Works on the CPU, says so, and waits for the reply (asleep in `read`).
    let script = "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done; echo worked >&3; read reply <&3";
    let command = shell(script, "demand-user", Limits::default());
    let (readings, seen) = tokio::sync::oneshot::channel();
    let converse = |control: Control, socket: tokio::net::UnixStream| async move {
        let (read, mut write) = socket.into_split();
        let said = BufReader::new(read).lines().next_line().await.expect("read").expect("a line");
        let processes = control.processes();
        let read = tokio::task::spawn_blocking(move || (processes.cpu_demand(), processes.thread_states()));
        let (demand, threads) = read.await.expect("read /proc");
        write.write_all(b"done\n").await.expect("reply");
        let _ = readings.send((said, demand, threads));
        std::future::pending::<()>().await
    };
    let finished = sandbox
        .run_with_control(command, async { Some(Vec::new()) }, converse, CancellationToken::new())
        .await
        .expect("ran");
    let (said, demand, threads) = seen.await.expect("the conversation happened");
    assert_eq!(said, "worked", "{finished:?}");
    let demand = demand.expect("its processes were found under its user");
    assert!(demand >= Duration::from_millis(100), "the loop's CPU time is counted: {demand:?}");
    assert!(threads.starts_with("1 S"), "one thread, asleep in its read: {threads}");
}

#[tokio::test]
async fn landlock_keeps_a_job_s_signals_to_its_own_processes() {
    let options = SandboxOptions {
        network_namespace: false,
        process_limit: false,
        command_users: false,
        ..SandboxOptions::default()
    };
    let sandbox = Sandbox::detect_with(options).await;
    if !landlock_scopes_signals(&sandbox) {
        skip("landlock's signal scope needs landlock abi 6; this host reports it absent");
        return;
    }
    // Its own child it may signal; its parent (the evaluator here) it may not, though both run as one user.
    let script = "sleep 30 & kill $! && echo child-signalled; kill -0 $PPID 2>/dev/null && echo reached || echo denied";
    let finished = run(&sandbox, shell(script, "scoped-signal", Limits::default())).await;
    assert_eq!(String::from_utf8_lossy(&finished.stdout), "child-signalled\ndenied\n", "{}", finished.stderr_tail(500));
}
