//! Running one command: spawning it with the protections this sandbox enforces, delivering its input, holding its
//! conversation, capping its output, and ending it (on exit, timeout or cancellation) with nothing it started left
//! behind.

use std::future::Future;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

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
        let Launch { ruleset, user, mut process, control, cgroup } =
            self.launch(&command, input.is_some(), converse.is_some())?;
        let mut started = Instant::now();
        let mut child = process.spawn().map_err(spawn_error(&command))?;
        // The child holds its own copies now.
        drop(ruleset);
        let socket = control.map(parent_end).transpose()?;
        let group = GroupKiller(child.id().map(|pid| pid as libc::pid_t));
        let stdout = tokio::spawn(read_capped(child.stdout.take(), command.limits.output_bytes));
        let stderr = tokio::spawn(read_capped(child.stderr.take(), command.limits.output_bytes));

        let exit = 'run: {
            if let Some(input) = input {
                if let Delivery::Ended(exit) = deliver_input(&mut child, input, &cancel).await? {
                    break 'run exit;
                }
                started = Instant::now();
            }
            let conversation = match (converse, socket, group.0) {
                (Some(converse), Some(socket), Some(group)) => {
                    Some(Conversation { converse, socket, group, user: user.as_ref().map(|user| (user.uid, user.gid)) })
                }
                _ => None,
            };
            wait_for_end(&mut child, command.limits.wall, started, conversation, &cancel).await?
        };
        let cgroup = end_what_is_left(group, cgroup, &mut child, user).await;
        let (stdout, stdout_cut) = stdout.await.unwrap_or_default();
        let (stderr, stderr_cut) = stderr.await.unwrap_or_default();
        if let Some(cgroup) = cgroup {
            // Removed once its killed processes have exited; nothing waits for that.
            tokio::task::spawn_blocking(move || drop(cgroup));
        }
        Ok(Finished { exit, stdout, stderr, output_truncated: stdout_cut || stderr_cut, wall: started.elapsed() })
    }

    /// Takes what `command` runs with (its Landlock ruleset, user, control socket and cgroup) and builds its process,
    /// which applies them to itself between fork and exec. All of it is made here, in the parent, where allocation is
    /// allowed; only descriptors and integers cross into the child.
    fn launch(&self, command: &Command, piped_input: bool, controlled: bool) -> Result<Launch, SandboxError> {
        let ruleset = match self.landlock {
            Some(abi) => Some(ruleset::for_command(abi, command)?),
            None => None,
        };
        let user = self.take_user(command)?;
        let mut process = process_for(command, user.as_ref(), piped_input);
        // Both ends are close-on-exec; the child's end becomes its descriptor 3 (without the flag) before exec.
        let control = controlled.then(StdUnixStream::pair).transpose().map_err(spawn_error(command))?;
        let cgroup = match &self.pids {
            Some(pids) => Some(pids.create(command.limits.processes).map_err(spawn_error(command))?),
            None => None,
        };
        ChildSetup {
            cgroup_procs_fd: cgroup.as_ref().map(cgroup::CommandCgroup::procs_fd),
            limits: command.limits.clone(),
            network_namespace: self.network_namespace,
            landlock_fd: ruleset.as_ref().map(AsRawFd::as_raw_fd),
            control_fd: control.as_ref().map(|(_, child)| child.as_raw_fd()),
            user: user.as_ref().map(|user| (user.uid, user.gid)),
        }
        .install(&mut process);
        Ok(Launch { ruleset, user, process, control, cgroup })
    }

    /// A user of its own for `command`, where this sandbox has command users, given the directories the command
    /// writes through their shared group.
    fn take_user(&self, command: &Command) -> Result<Option<users::CommandUser>, SandboxError> {
        let Some(users) = &self.users else { return Ok(None) };
        let user = users.take().ok_or_else(|| SandboxError::NoCommandUser { program: command.program.clone() })?;
        for dir in std::iter::once(&command.scratch).chain(&command.writable).filter(|dir| dir.exists()) {
            users::share_with_group(dir, user.gid).map_err(spawn_error(command))?;
        }
        Ok(Some(user))
    }
}

/// What a command is spawned with, each part released at its own moment afterwards.
struct Launch {
    ruleset: Option<OwnedFd>,
    user: Option<users::CommandUser>,
    process: tokio::process::Command,
    /// Our end and the child's end of the control socket.
    control: Option<(StdUnixStream, StdUnixStream)>,
    cgroup: Option<cgroup::CommandCgroup>,
}

/// The error of `command` failing to start for `source`.
fn spawn_error(command: &Command) -> impl Fn(std::io::Error) -> SandboxError + '_ {
    |source| SandboxError::Spawn { program: command.program.clone(), source }
}

/// `command`'s process before the sandbox's own setup: only the environment it is given (and the command user's
/// name), its scratch directory as working directory and `TMPDIR`, its output piped, a process group of its own.
fn process_for(command: &Command, user: Option<&users::CommandUser>, piped_input: bool) -> tokio::process::Command {
    let mut process = tokio::process::Command::new(&command.program);
    process.env_clear();
    if let Some(user) = user {
        // Tools that look their user up (Python's getpass) find it here: command users are in no passwd file.
        let name = format!("kforge-job-{}", user.uid);
        process.env("USER", &name).env("LOGNAME", &name);
    }
    process
        .args(&command.args)
        .envs(command.env.iter().map(|(k, v)| (k, v)))
        .env("TMPDIR", &command.scratch)
        .current_dir(&command.scratch)
        .stdin(if piped_input { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    process
}

/// Our end of the control socket, once the child is spawned (closing the child's end here, which it holds a copy of).
fn parent_end((ours, theirs): (StdUnixStream, StdUnixStream)) -> Result<tokio::net::UnixStream, SandboxError> {
    drop(theirs);
    ours.set_nonblocking(true).map_err(SandboxError::Wait)?;
    tokio::net::UnixStream::from_std(ours).map_err(SandboxError::Wait)
}

/// Whether a command's input reached it.
enum Delivery {
    /// Its stdin gets the bytes (and closes after them); its wall clock starts now.
    Delivered,
    /// It exited, or was cancelled (also by an input of `None`), first.
    Ended(Exit),
}

/// Waits for `input` and hands it to `child`'s stdin, unless the child exits or `cancel` fires first.
async fn deliver_input(
    child: &mut tokio::process::Child,
    input: impl Future<Output = Option<Vec<u8>>>,
    cancel: &CancellationToken,
) -> Result<Delivery, SandboxError> {
    // Taken first: waiting on the child closes a stdin it still holds.
    let pipe = child.stdin.take();
    let bytes = tokio::select! {
        bytes = input => bytes,
        status = child.wait() => return Ok(Delivery::Ended(Exit::from(status.map_err(SandboxError::Wait)?))),
        () = cancel.cancelled() => None,
    };
    let (Some(bytes), Some(mut pipe)) = (bytes, pipe) else { return Ok(Delivery::Ended(Exit::Cancelled)) };
    // Written aside, so a command that never reads cannot hold this up; closing the pipe is the end.
    tokio::spawn(async move {
        let _ = pipe.write_all(&bytes).await;
    });
    Ok(Delivery::Delivered)
}

/// The caller's side of a command's control channel.
struct Conversation<F> {
    converse: F,
    socket: tokio::net::UnixStream,
    /// The command's process group.
    group: libc::pid_t,
    /// The command's user and group, where it has its own.
    user: Option<(u32, u32)>,
}

/// Waits until `child` exits, runs out of its `wall` time since `started` (less what its conversation held the clock
/// for) or is cancelled; the conversation, if any, runs meanwhile and is dropped then.
async fn wait_for_end<F, Fut>(
    child: &mut tokio::process::Child,
    wall: Duration,
    started: Instant,
    conversation: Option<Conversation<F>>,
    cancel: &CancellationToken,
) -> Result<Exit, SandboxError>
where
    F: FnOnce(Control, tokio::net::UnixStream) -> Fut,
    Fut: Future<Output = ()>,
{
    let (clock, clock_seen) = tokio::sync::watch::channel(Clock::default());
    let conversation = async move {
        if let Some(Conversation { converse, socket, group, user }) = conversation {
            converse(Control::new(group, user, clock), socket).await;
        }
        std::future::pending::<()>().await
    };
    Ok(tokio::select! {
        status = child.wait() => Exit::from(status.map_err(SandboxError::Wait)?),
        () = deadline(wall, started, clock_seen) => Exit::TimedOut,
        () = cancel.cancelled() => Exit::Cancelled,
        () = conversation => unreachable!("a conversation never ends by itself"),
    })
}

/// Ends what is left of a command that exited, timed out or was cancelled, and returns its emptied cgroup (removed
/// later). Kills whatever is left of the group (the command itself on timeout, background children otherwise) and of
/// its cgroup (what left the group), so the pipes close and the readers finish: at the lowest priority first, so that
/// their exits do not starve the host (a fork bomb's thousands). Every process of the command's user (one that left
/// the group too) is gone before this returns.
async fn end_what_is_left(
    group: GroupKiller,
    cgroup: Option<cgroup::CommandCgroup>,
    child: &mut tokio::process::Child,
    user: Option<users::CommandUser>,
) -> Option<cgroup::CommandCgroup> {
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
        let _ = tokio::task::spawn_blocking(move || user.release()).await;
    }
    cgroup
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
