//! Running one command: spawning it with the protections this sandbox enforces, delivering its input, holding its
//! conversation, capping its output, and ending it (on exit, timeout or cancellation) with nothing it started left
//! behind.

use std::future::Future;
use std::os::fd::AsRawFd;
use std::process::Stdio;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::control::{Clock, Control, deadline};
use crate::sys::{self, ChildSetup};
use crate::{Command, Exit, Finished, Sandbox, SandboxError, cgroup, ruleset, users};

/// The conversation of a command that has none.
type NoConversation = fn(Control, tokio::net::UnixStream) -> std::future::Ready<()>;

impl Sandbox {
    /// Runs `command` to completion, timeout or cancellation. The process group is killed in every case before this
    /// returns, so nothing the command started outlives it; with a process limit, so is every process in the command's
    /// cgroup (one that left the group with `setsid` too).
    pub async fn run(&self, command: Command, cancel: CancellationToken) -> Result<Finished, SandboxError> {
        self.execute(command, None::<std::future::Ready<Option<Vec<u8>>>>, None::<NoConversation>, cancel).await
    }

    /// Runs `command` like [`Sandbox::run`], its stdin a pipe: the command starts at once, and what `input` resolves to
    /// is written to its stdin, which then closes. The wall-clock limit (and [`Finished::wall`]) counts from that
    /// moment, so a command can be started before the resource it needs is free and prepare while it waits. `None`
    /// from `input` cancels the command; a command that exits first is finished as it ended.
    pub async fn run_with_input(
        &self,
        command: Command,
        input: impl Future<Output = Option<Vec<u8>>>,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError> {
        self.execute(command, Some(input), None::<NoConversation>, cancel).await
    }

    /// Runs `command` like [`Sandbox::run_with_input`], with a control channel: the command's file descriptor 3 is a
    /// stream socket whose other end goes to `converse`, with a [`Control`] of the command's process group and wall
    /// clock, once the input is delivered. `converse` runs until the command ends (it is dropped then) and may hold the
    /// command's clock while the command waits for it.
    pub async fn run_with_control<F, Fut>(
        &self,
        command: Command,
        input: impl Future<Output = Option<Vec<u8>>>,
        converse: F,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError>
    where
        F: FnOnce(Control, tokio::net::UnixStream) -> Fut,
        Fut: Future<Output = ()>,
    {
        self.execute(command, Some(input), Some(converse), cancel).await
    }

    async fn execute<F, Fut>(
        &self,
        command: Command,
        input: Option<impl Future<Output = Option<Vec<u8>>>>,
        converse: Option<F>,
        cancel: CancellationToken,
    ) -> Result<Finished, SandboxError>
    where
        F: FnOnce(Control, tokio::net::UnixStream) -> Fut,
        Fut: Future<Output = ()>,
    {
        let spawn_error = |source| SandboxError::Spawn { program: command.program.clone(), source };
        let ruleset = match self.landlock {
            Some(abi) => Some(ruleset::for_command(abi, &command)?),
            None => None,
        };
        let user = match &self.users {
            Some(users) => {
                let user =
                    users.take().ok_or_else(|| SandboxError::NoCommandUser { program: command.program.clone() })?;
                for dir in std::iter::once(&command.scratch).chain(&command.writable).filter(|dir| dir.exists()) {
                    users::share_with_group(dir, user.gid).map_err(spawn_error)?;
                }
                Some(user)
            }
            None => None,
        };
        let mut process = tokio::process::Command::new(&command.program);
        process.env_clear();
        if let Some(user) = &user {
            // Tools that look their user up (Python's getpass) find it here: command users are in no passwd file.
            let name = format!("kforge-job-{}", user.uid);
            process.env("USER", &name).env("LOGNAME", &name);
        }
        process
            .args(&command.args)
            .envs(command.env.iter().map(|(k, v)| (k, v)))
            .env("TMPDIR", &command.scratch)
            .current_dir(&command.scratch)
            .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // Both ends are close-on-exec; the child's end becomes its descriptor 3 (without the flag) before exec.
        let control = match converse {
            Some(_) => Some(std::os::unix::net::UnixStream::pair().map_err(spawn_error)?),
            None => None,
        };
        let cgroup = match &self.pids {
            Some(pids) => Some(pids.create(command.limits.processes).map_err(spawn_error)?),
            None => None,
        };
        let setup = ChildSetup {
            cgroup_procs_fd: cgroup.as_ref().map(cgroup::CommandCgroup::procs_fd),
            limits: command.limits.clone(),
            network_namespace: self.network_namespace,
            landlock_fd: ruleset.as_ref().map(AsRawFd::as_raw_fd),
            control_fd: control.as_ref().map(|(_, child)| child.as_raw_fd()),
            user: user.as_ref().map(|user| (user.uid, user.gid)),
        };
        let command_user = setup.user;
        setup.install(&mut process);

        let mut started = Instant::now();
        let mut child = process.spawn().map_err(spawn_error)?;
        drop(ruleset);
        let ours = match control {
            Some((ours, theirs)) => {
                drop(theirs);
                ours.set_nonblocking(true).map_err(SandboxError::Wait)?;
                Some(tokio::net::UnixStream::from_std(ours).map_err(SandboxError::Wait)?)
            }
            None => None,
        };
        let pid = child.id().map(|pid| pid as libc::pid_t);
        let group = GroupKiller(pid);
        let stdout = tokio::spawn(read_capped(child.stdout.take(), command.limits.output_bytes));
        let stderr = tokio::spawn(read_capped(child.stderr.take(), command.limits.output_bytes));

        let exit = 'run: {
            if let Some(input) = input {
                // Taken first: waiting on the child closes a stdin it still holds.
                let pipe = child.stdin.take();
                let bytes = tokio::select! {
                    bytes = input => bytes,
                    status = child.wait() => break 'run Exit::from(status.map_err(SandboxError::Wait)?),
                    () = cancel.cancelled() => None,
                };
                let (Some(bytes), Some(mut pipe)) = (bytes, pipe) else { break 'run Exit::Cancelled };
                // Written aside, so a command that never reads cannot hold this up; closing the pipe is the end.
                tokio::spawn(async move {
                    let _ = pipe.write_all(&bytes).await;
                });
                started = Instant::now();
            }
            let (clock, clock_seen) = tokio::sync::watch::channel(Clock::default());
            let conversation = async move {
                if let (Some(converse), Some(socket), Some(group)) = (converse, ours, pid) {
                    converse(Control::new(group, command_user, clock), socket).await;
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                status = child.wait() => Exit::from(status.map_err(SandboxError::Wait)?),
                () = deadline(command.limits.wall, started, clock_seen) => Exit::TimedOut,
                () = cancel.cancelled() => Exit::Cancelled,
                () = conversation => unreachable!("a conversation never ends by itself"),
            }
        };
        // Kill whatever is left of the group (the command itself on timeout, background children otherwise) and of
        // its cgroup (what left the group), so the pipes close and the readers finish: at the lowest priority first,
        // so that their exits do not starve the host (a fork bomb's thousands).
        if let Some(leader) = group.0 {
            sys::lowest_priority(leader, user.as_ref().map(|user| user.uid));
        }
        drop(group);
        // The cgroup's reads, kills and waits for emptiness block: off the async threads.
        let cgroup = match cgroup {
            Some(cgroup) => tokio::task::spawn_blocking(move || {
                cgroup.kill_all();
                cgroup
            })
            .await
            .ok(),
            None => None,
        };
        let _ = child.wait().await;
        if let Some(user) = user {
            // Every process of the command's user (one that left the group too) is gone before this returns.
            let _ = tokio::task::spawn_blocking(move || user.release()).await;
        }
        let (stdout, stdout_cut) = stdout.await.unwrap_or_default();
        let (stderr, stderr_cut) = stderr.await.unwrap_or_default();
        if let Some(cgroup) = cgroup {
            // Removed once its killed processes have exited; nothing waits for that.
            tokio::task::spawn_blocking(move || drop(cgroup));
        }
        Ok(Finished { exit, stdout, stderr, output_truncated: stdout_cut || stderr_cut, wall: started.elapsed() })
    }
}

/// SIGKILLs the process group when dropped.
struct GroupKiller(Option<libc::pid_t>);

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(group) = self.0 {
            sys::signal_group(group, libc::SIGKILL);
        }
    }
}

/// Reads up to `cap` bytes, then keeps draining so the writer never blocks; returns the bytes and whether it cut.
async fn read_capped(stream: Option<impl AsyncRead + Unpin>, cap: usize) -> (Vec<u8>, bool) {
    let Some(mut stream) = stream else { return (Vec::new(), false) };
    let mut kept = Vec::new();
    let mut buffer = [0u8; 16 * 1024];
    let mut cut = false;
    loop {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buffer[..n.min(room)]);
                cut |= n > room;
            }
        }
    }
    (kept, cut)
}
