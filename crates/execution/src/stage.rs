//! A harness stage's process: started in the sandbox before its request (its interpreter and torch load off the
//! device's time), asked once (`protocol`), its conversation with its device's gate served and its calls into
//! candidate code watched (a hung call stops it), and its outcome read back.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_sandbox::{Command, Control, Finished, Limits, Processes, Sandbox, SandboxError};
use tokio_util::sync::CancellationToken;

use crate::config::CallLimitsConfig;
use crate::devices::{Gate, Member, MemberTimes, PairSide};
use crate::protocol::{self, Decoded, GateRole, Mode, PROTOCOL_VERSION, Report, StageSpec};
use crate::python::PythonEnv;

/// The process of one harness stage: where it runs and what it may touch, fixed when it starts.
#[derive(Debug)]
pub struct Stage {
    pub scratch: PathBuf,
    pub readable: Vec<PathBuf>,
    pub writable: Vec<PathBuf>,
    pub env: Vec<(OsString, OsString)>,
    pub wall: Duration,
    /// Yields the CPU to stages on a device (compiles): see [`Limits::nice`].
    pub background: bool,
    /// A program, with its arguments, that runs the harness's interpreter (`ncu --target-processes all`, for a
    /// profiler): empty for the evaluator's own stages. Its files must be within `readable`.
    pub launcher: Vec<OsString>,
}

/// What a started stage is asked to do: its mode's spec, and environment variables known only now (the device of
/// the lane it was given).
#[derive(Debug)]
pub struct Request<S> {
    pub spec: S,
    pub env: Vec<(String, String)>,
    /// How long each call into candidate code may run (stages that run candidate code); see [`converse`].
    pub limits: Option<CallLimits>,
    /// The stage's side of a paired timing (`devices::pairing`): its rounds alternate with the other side's.
    pub pair: Option<PairSide>,
}

/// How long a call into candidate code may run before its stage is stopped as hung. A call is what follows the
/// harness's `call` message up to its next message: loading the module, building the model, one forward call of
/// a trial, a census mode's calls, one timed call. Its limit counts from the message, while the stage runs.
#[derive(Debug, Clone)]
pub struct CallLimits {
    /// A call that waits (on its device, or asleep): a kernel that never ends uses no CPU time while the harness
    /// waits for it (the harness waits for its GPU asleep).
    pub call: Duration,
    /// A call working on the CPU, at least `working_share` of a CPU over its last [`WORKING_WINDOW`] (JIT
    /// compiles, autotuning, host code; running or runnable, so a call starved by a loaded machine counts:
    /// `Processes::cpu_demand`), runs on, checked every second, up to this long.
    pub working: Duration,
    /// The share of a CPU that tells a working call from a waiting one; `None`: calls are not told apart, and
    /// their CPU use is not read.
    pub working_share: Option<f64>,
    /// How `call` was chosen, for the error a hung stage gets.
    pub basis: String,
}

impl CallLimits {
    /// A call's limits: `reference_factor` times the reference's eager median, at least `floor_secs`; without a
    /// measured reference, `unmeasured_secs`.
    pub fn for_reference(config: &CallLimitsConfig, reference_ms: Option<f64>) -> Self {
        let (call, basis) = match reference_ms {
            Some(ms) => {
                let secs = (config.reference_factor * ms / 1e3).max(config.floor_secs);
                let basis = format!(
                    "limit: {} x the reference's {ms:.3} ms per call, at least {} s",
                    config.reference_factor, config.floor_secs
                );
                (secs, basis)
            }
            None => (config.unmeasured_secs, "limit for a task whose reference is not measured yet".to_owned()),
        };
        Self {
            call: Duration::from_secs_f64(call.max(0.001)),
            working: Duration::from_secs_f64(config.working_secs.max(call).max(0.001)),
            working_share: Some(config.working_share),
            basis,
        }
    }

    /// The same limit for every call, working or not: stages whose calls are timed by their own wall clock.
    pub fn fixed(limit: Duration, basis: impl Into<String>) -> Self {
        Self { call: limit, working: limit, working_share: None, basis: basis.into() }
    }
}

impl<S: StageSpec> Request<S> {
    /// A request with no environment of its own and no call limits.
    pub fn plain(spec: S) -> Self {
        Self { spec, env: vec![], limits: None, pair: None }
    }

    pub fn mode(&self) -> Mode {
        self.spec.mode()
    }
}

/// Why a stage gave no outcome.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// The harness answered in another protocol version: a harness file of another kforge version (evaluators
    /// sharing a work directory must be of one version).
    #[error(
        "the {mode} stage's harness speaks protocol version {}, this evaluator {PROTOCOL_VERSION}: the harness \
         file belongs to another kforge version (evaluators sharing a work directory must be of one version)",
        harness.map_or("none".to_owned(), |v| v.to_string())
    )]
    Protocol { mode: &'static str, harness: Option<u64> },
}

/// A stage that ran: how it ended and the result it wrote, if any.
#[derive(Debug)]
pub struct StageOutcome<R> {
    pub finished: Finished,
    pub result: Option<Report<R>>,
    /// How long it ran alone on its device and waited at the device's gate.
    pub gate: MemberTimes,
    /// Why it was stopped as hung: a call into candidate code ran past its [`CallLimits`].
    pub hung: Option<String>,
    /// How long it spent in calls into candidate code (announced by the harness; see [`converse`]), a call still
    /// open at its end included: what a stage killed at its wall-clock limit is charged to the candidate.
    pub in_calls: Duration,
    /// Whether it closed its control socket and was still running [`CLOSED_GRACE`] later (killed then).
    pub lingered: bool,
    /// Its place at the device's gate, kept after the process ended until the caller lets it go
    /// ([`StageOutcome::leave_gate`]): a device left in doubt (a kill, a fault) is checked first.
    membership: Option<Arc<Member>>,
}

/// How a stage takes part in its device's [`Gate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joining {
    /// Shares the device from its first step (waiting while timed work runs); `solo` keeps the device to itself.
    Share { solo: bool },
    /// Joins idle and asks to share before it uses the device: trusted stages only (no candidate code runs in
    /// them, so they do no device work while they say they are idle).
    Idle,
}

impl Joining {
    /// The harness's `spec.gate`.
    fn role(self) -> GateRole {
        match self {
            Joining::Share { .. } => GateRole::Share,
            Joining::Idle => GateRole::Idle,
        }
    }
}

impl<R> StageOutcome<R> {
    /// Leaves the device's gate: other members may run alone without this stage from now on.
    pub fn leave_gate(&mut self) {
        self.membership = None;
    }

    /// The result's `ok` flag; false when there is no result.
    pub fn ok(&self) -> bool {
        self.finished.success() && self.result.as_ref().is_some_and(|r| r.ok)
    }

    /// The error text the harness reported, or the end of stderr, or what is known of how the stage ended.
    pub fn error_text(&self) -> String {
        if let Some(error) = self.result.as_ref().and_then(|r| r.error.as_deref()) {
            return error.to_owned();
        }
        let stderr = self.finished.stderr_tail(4000);
        if !stderr.trim().is_empty() {
            return stderr;
        }
        if self.lingered {
            return format!(
                "closed its control socket and was still running {} s later, so it was killed",
                CLOSED_GRACE.as_secs()
            );
        }
        match &self.result {
            None => format!("ended ({:?}) without a readable result", self.finished.exit),
            Some(_) => format!("ended ({:?}) and reported failure without an error", self.finished.exit),
        }
    }

    /// The CPU time the stage reported for itself and the children it waited for, in milliseconds.
    pub fn cpu_ms(&self) -> Option<f64> {
        self.result.as_ref()?.cpu_ms
    }

    /// The harness's exception type name, when it reported one.
    pub fn error_type(&self) -> Option<&str> {
        self.result.as_ref()?.error_type.as_deref()
    }

    /// How long the stage ran, less its waits at the device's gate (its wall clock is held there).
    pub fn running(&self) -> Duration {
        self.finished.wall.saturating_sub(self.gate.waited)
    }

    /// Whether a stage killed at its wall-clock limit spent most of its running time in the candidate's calls,
    /// rather than in the harness's own work (making inputs, copying and checking outputs): only then is the
    /// timeout the candidate's.
    pub fn candidate_used_its_time(&self) -> bool {
        self.in_calls.as_secs_f64() >= 0.5 * self.running().as_secs_f64()
    }

    /// A stage that ended with `exit` and `result`, and nothing else of note: for the judging rules' tests.
    #[cfg(test)]
    pub(crate) fn ended(exit: kforge_sandbox::Exit, result: Option<Report<R>>) -> Self {
        let finished = Finished { exit, stdout: vec![], stderr: vec![], output_truncated: false, wall: Duration::ZERO };
        let (gate, hung, in_calls) = (MemberTimes::default(), None, Duration::ZERO);
        Self { finished, result, gate, hung, in_calls, lingered: false, membership: None }
    }
}

/// A harness process started before its request: its interpreter starts and imports torch meanwhile, off the
/// device's time. Dropped without a request, the process is killed.
#[derive(Debug)]
pub struct Started {
    request: Option<tokio::sync::oneshot::Sender<(Vec<u8>, Option<Conversation>)>>,
    finished: tokio::task::JoinHandle<Result<Finished, SandboxError>>,
    result_path: PathBuf,
    /// What the conversation saw: calls into candidate code, and why it stopped the stage as hung, if it did.
    watch: Arc<Mutex<Watch>>,
}

/// What a stage's conversation records for its outcome.
#[derive(Debug, Default)]
struct Watch {
    hung: Option<String>,
    /// It closed its socket and ran on past [`CLOSED_GRACE`].
    lingered: bool,
    /// Time in calls into candidate code that ended, and when the open one began.
    in_calls: Duration,
    open_call: Option<tokio::time::Instant>,
    /// Whether candidate code may have run: a call was announced.
    called: bool,
}

impl Watch {
    fn call_starts(&mut self) {
        self.call_ends();
        self.called = true;
        self.open_call = Some(tokio::time::Instant::now());
    }

    fn call_ends(&mut self) {
        if let Some(since) = self.open_call.take() {
            self.in_calls += since.elapsed();
        }
    }
}

/// What a stage's conversation serves: its place at the gate, and the limits of its calls.
#[derive(Debug)]
struct Conversation {
    member: Arc<Member>,
    limits: Option<CallLimits>,
    pair: Option<PairSide>,
}

/// The largest file a stage may write (RLIMIT_FSIZE): one trial's outputs, saved for the checker, are as large as
/// a device's memory can hold; the sandbox's default (2 GiB) would fail torch.save on KernelBench's larger outputs
/// (its zip writer then reports "unexpected pos"). What all of an evaluation's files take is bounded by the disk
/// budget (`disk.rs`).
fn largest_file(python: &PythonEnv) -> u64 {
    let device = python.gpus.iter().map(|gpu| gpu.total_memory).max().unwrap_or(0);
    device.max(Limits::default().file_bytes)
}

/// Starts the harness for `stage`; its wall-clock limit counts from [`Started::run`]. `harness` is the harness
/// package's folder (`harness/kforge_harness`, run as the interpreter's program); its parent, the harness directory
/// (kforge's nvcc is there too), is readable to the stage.
pub fn start(
    sandbox: &Sandbox,
    python: &PythonEnv,
    harness: &Path,
    stage: Stage,
    cancel: CancellationToken,
) -> Started {
    let mut readable = stage.readable;
    readable.extend(python.readable.iter().cloned());
    readable.extend(harness.parent().map(Path::to_owned));
    let result_path = stage.scratch.join("result.json");
    let (program, args) = match stage.launcher.split_first() {
        Some((launcher, launcher_args)) => {
            let mut args = launcher_args.to_vec();
            args.extend([python.python.clone().into(), harness.into()]);
            (PathBuf::from(launcher), args)
        }
        None => (python.python.clone(), vec![harness.into()]),
    };
    let command = Command {
        program,
        args,
        env: stage.env,
        scratch: stage.scratch,
        readable,
        writable: stage.writable,
        limits: Limits {
            wall: stage.wall,
            nice: if stage.background { 10 } else { 0 },
            cpus: python.stage_cpus().to_vec(),
            file_bytes: largest_file(python),
            ..Limits::default()
        },
    };
    let (request, delivered) = tokio::sync::oneshot::channel::<(Vec<u8>, Option<Conversation>)>();
    let sandbox = sandbox.clone();
    // The conversation comes with the request, and goes to `converse` once the request is delivered.
    let conversation = Arc::new(Mutex::new(None));
    let input = {
        let conversation = conversation.clone();
        async move {
            let (bytes, joined) = delivered.await.ok()?;
            *conversation.lock().expect("never poisoned") = joined;
            Some(bytes)
        }
    };
    let watch = Arc::new(Mutex::new(Watch::default()));
    // A launcher follows the interpreter as its child: a stop and continue would read to it as the child's end
    // (Nsight Compute: "the application returned an error code (18)", measured on the H100 machine).
    let waiting = if stage.launcher.is_empty() { Waiting::Stopped } else { Waiting::ClockHeld };
    let converse = {
        let watch = watch.clone();
        move |control, socket| async move {
            let joined = conversation.lock().expect("never poisoned").take();
            if let Some(Conversation { member, limits, pair }) = joined {
                let party = Party { member: &member, pair: pair.as_ref() };
                match converse(party, &control, waiting, socket, limits.as_ref(), &watch).await {
                    // The harness's socket closes as its interpreter shuts down; a stage that closed it and runs
                    // on would use the device outside the gate.
                    Ended::Closed => {
                        tokio::time::sleep(CLOSED_GRACE).await;
                        watch.lock().expect("never poisoned").lingered = true;
                    }
                    Ended::Broken => {}
                    Ended::Hung(reason) => {
                        tracing::info!(%reason, "stopping a stage whose call never returned");
                        watch.lock().expect("never poisoned").hung = Some(reason);
                    }
                }
                // Unless it ended meanwhile (this future is dropped then).
                control.kill();
            }
        }
    };
    let finished = tokio::spawn(async move { sandbox.run_with_control(command, input, converse, cancel).await });
    Started { request: Some(request), finished, result_path, watch }
}

/// The longest message the harness sends on its control socket.
const MESSAGE_BYTES: u64 = 64;

/// How long a stage may run on after closing its control socket (its interpreter shutting down).
const CLOSED_GRACE: Duration = Duration::from_secs(5);

/// How a stage's conversation ended.
#[derive(Debug)]
enum Ended {
    /// The stage closed its socket.
    Closed,
    /// The stage sent what the harness never sends.
    Broken,
    /// A call ran past its limit: why.
    Hung(String),
}

/// Serves a stage's gate requests, one line each, answered with `go` once granted:
///
/// - `alone`: run alone on the device; `share`: share it again (or start to, from idle);
/// - `pause`: a pause point between steps of shared work; it pauses only while someone runs alone or waits to;
/// - `idle`: host work only until it shares again (trusted stages; see [`Joining::Idle`]): it holds nobody up and
///   runs on while others run alone (the checker reading outputs' files into the page cache);
/// - `round` (a paired stage only): one round of paired timing, run alone once it is this side's turn
///   (`devices::pairing`); the `share` that ends it passes the turn to the other side;
///
/// and two notices, not answered: `call`, a call into candidate code starts (see [`CallLimits`]), and `timed`,
/// a timed call starts (its process waits for the GPU spinning: no longer limit for CPU use). A call still
/// running at its limit ends the conversation with the reason; the caller kills the stage.
///
/// While it waits, the stage's wall clock is held and, unless `waiting` says otherwise, the stage is stopped: it is
/// at a pause point, its device work synchronised, and it is not working. A message it does not know, or may not send, kills the stage: only
/// candidate code forging the harness's messages sends one, and a stage left outside the gate could use the device
/// while others run alone.
async fn converse(
    party: Party<'_>,
    control: &Control,
    waiting: Waiting,
    socket: tokio::net::UnixStream,
    limits: Option<&CallLimits>,
    watch: &Mutex<Watch>,
) -> Ended {
    use tokio::io::AsyncWriteExt;
    let (read, mut write) = socket.into_split();
    let mut heard = Heard { read: tokio::io::BufReader::new(read), line: Vec::new() };
    let processes = control.processes();
    let mut conversing = Conversing { party, control, waiting, limits, watch, processes, call: None, in_round: false };
    loop {
        let message = match conversing.hear(&mut heard).await {
            Ok(message) => message,
            Err(ended) => return ended,
        };
        conversing.call_ends();
        let reply = match conversing.answer(&message).await {
            Ok(reply) => reply,
            Err(ended) => return ended,
        };
        if reply == Reply::Go && write.write_all(b"go\n").await.is_err() {
            return Ended::Closed;
        }
    }
}

/// What the harness has sent on its control socket: the reader, and a message read in part.
#[derive(Debug)]
struct Heard {
    read: tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>,
    /// A message cut short by a check keeps its bytes here; the limit counts over the whole message.
    line: Vec<u8>,
}

/// What a conversation answers a message with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reply {
    /// A gate request, granted: `go`.
    Go,
    /// A notice: no answer.
    Noted,
}

/// A stage's conversation between messages ([`converse`]): who it speaks for, how it waits, and the open call.
struct Conversing<'a> {
    party: Party<'a>,
    control: &'a Control,
    waiting: Waiting,
    limits: Option<&'a CallLimits>,
    watch: &'a Mutex<Watch>,
    processes: Processes,
    /// The call into candidate code that is open, watched under `limits`.
    call: Option<Call>,
    /// A paired round runs: the `share` that ends it passes the turn.
    in_round: bool,
}

impl Conversing<'_> {
    /// The harness's next whole message, the open call checked at its deadlines meanwhile; or how the conversation
    /// ends: the socket closed, a message the harness never sends, or a hung call.
    async fn hear(&mut self, heard: &mut Heard) -> Result<Vec<u8>, Ended> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt};
        loop {
            let check_at = self.call.as_ref().map(|call| call.check_at);
            let mut message = (&mut heard.read).take(MESSAGE_BYTES.saturating_sub(heard.line.len() as u64));
            tokio::select! {
                // A message that is there is read before any check: the call it ends is over.
                biased;
                read = message.read_until(b'\n', &mut heard.line) => return match read {
                    Ok(n) if n > 0 && heard.line.ends_with(b"\n") => Ok(std::mem::take(&mut heard.line)),
                    Ok(0) if heard.line.is_empty() => Err(Ended::Closed),
                    _ => Err(Ended::Broken),
                },
                () = sleep_until(check_at) => self.check_call(heard).await?,
            }
        }
    }

    /// The open call at its check: `Ok` while it is within its limits (checked again later), else
    /// [`Ended::Hung`] with why, and its threads' states.
    async fn check_call(&mut self, heard: &Heard) -> Result<(), Ended> {
        let call = self.call.as_mut().expect("a deadline comes with a call");
        let limits = self.limits.expect("a call is watched only with limits");
        let reading = cpu_demand(self.processes, limits, call.spinning).await;
        match call.check(limits, || reading) {
            Ok(()) => Ok(()),
            // The harness has spoken since: the call returned while this check waited for a CPU (on a host starved
            // by thousands of exiting processes, seconds), and its message is read next.
            Err(_) if message_waiting(&heard.read, &heard.line) => {
                call.check_at = tokio::time::Instant::now() + Duration::from_secs(1);
                Ok(())
            }
            Err(reason) => {
                let processes = self.processes;
                let threads = tokio::task::spawn_blocking(move || processes.thread_states()).await;
                Err(Ended::Hung(match threads {
                    Ok(threads) if !threads.is_empty() => format!("{reason}; its threads then: {threads}"),
                    _ => reason,
                }))
            }
        }
    }

    /// A message from the harness ends the open call, if there is one.
    fn call_ends(&mut self) {
        self.call = None;
        self.watch.lock().expect("never poisoned").call_ends();
    }

    /// Answers `message`: a notice opens a call, a gate request is granted once the gate allows, and anything else
    /// breaks the conversation.
    async fn answer(&mut self, message: &[u8]) -> Result<Reply, Ended> {
        let Party { member, .. } = self.party;
        match message {
            b"call\n" | b"timed\n" => {
                self.call_starts(message == b"timed\n").await;
                return Ok(Reply::Noted);
            }
            b"alone\n" => self.waiting.wait(self.control, member.alone()).await,
            b"round\n" => self.round().await?,
            b"share\n" => self.share().await,
            b"pause\n" => {
                if member.must_pause() {
                    self.waiting.wait(self.control, member.share()).await;
                }
            }
            b"idle\n" if member.idle() => {}
            _ => return Err(Ended::Broken),
        }
        Ok(Reply::Go)
    }

    /// A call into candidate code starts (`spinning`: a timed one), watched under the stage's limits if it has any.
    async fn call_starts(&mut self, spinning: bool) {
        self.watch.lock().expect("never poisoned").call_starts();
        self.call = match self.limits {
            Some(limits) => {
                let reading = cpu_demand(self.processes, limits, spinning).await;
                Some(Call::new(limits, spinning, || reading))
            }
            None => None,
        };
    }

    /// A paired round: stopped, then held at its pause point while the other side's round runs; then alone for its
    /// own. Only a paired stage sends it.
    async fn round(&mut self) -> Result<(), Ended> {
        let Party { member, pair } = self.party;
        let Some(pair) = pair else { return Err(Ended::Broken) };
        self.in_round = true;
        let turn = async {
            member.hold();
            pair.turn().await;
            member.alone().await;
        };
        self.waiting.wait(self.control, turn).await;
        Ok(())
    }

    /// Shares the device again. A round's end passes the turn once this stage is stopped and held: the other side's
    /// round, next, starts with this one paused.
    async fn share(&mut self) {
        let Party { member, pair } = self.party;
        let ends_round = std::mem::take(&mut self.in_round);
        let share = async {
            if let Some(pair) = pair.filter(|_| ends_round) {
                member.hold();
                pair.end_turn();
            }
            member.share().await;
        };
        self.waiting.wait(self.control, share).await;
    }
}

/// Who a stage's conversation speaks for: its place at the gate, and its side of a paired timing.
#[derive(Debug, Clone, Copy)]
struct Party<'a> {
    member: &'a Member,
    pair: Option<&'a PairSide>,
}

/// A reading of a stage's CPU demand ([`Processes::cpu_demand`]) for a call whose CPU use is read ([`reads_cpu`]),
/// taken on the blocking pool: it reads `/proc`, which can take seconds on a starved host, and the runtime's workers
/// serve every other stage meanwhile. `None` for a call whose CPU use is not read.
async fn cpu_demand(processes: Processes, limits: &CallLimits, spinning: bool) -> Option<Duration> {
    if !reads_cpu(limits, spinning) {
        return None;
    }
    tokio::task::spawn_blocking(move || processes.cpu_demand()).await.ok().flatten()
}

/// Whether a whole message from the harness waits to be read (in the reader's buffer or on the socket), or the
/// socket is closed: what the harness said after its call returned. Part of a message does not count: candidate code
/// can write to the socket too, and a byte without its end of line must not keep a hung call alive.
fn message_waiting(read: &tokio::io::BufReader<tokio::net::unix::OwnedReadHalf>, line: &[u8]) -> bool {
    if line.contains(&b'\n') || read.buffer().contains(&b'\n') {
        return true;
    }
    let mut peeked = [0u8; MESSAGE_BYTES as usize];
    let socket: &tokio::net::UnixStream = read.get_ref().as_ref();
    match rustix::net::recv(socket, &mut peeked[..], rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT) {
        // Nothing to read on a socket that waits no more: it is closed.
        Ok((read, _)) => read == 0 || peeked[..read].contains(&b'\n'),
        Err(_) => false,
    }
}

/// Resolves at `at`, or never.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// How far back a call's CPU share is read: long enough that a process asleep on its device, which a clock tick of
/// background work now and then (10 ms) shows at 1% in one second and 0.3% over three, stays under
/// [`CallLimits::working_share`], and that an autotuner's bursts of host work between configurations fall inside
/// it.
const WORKING_WINDOW: Duration = Duration::from_secs(3);

/// Whether a call's CPU use is read (a /proc scan): not for a timed call, whose CPU use says nothing (it spins), nor
/// under limits that do not tell working calls apart.
fn reads_cpu(limits: &CallLimits, spinning: bool) -> bool {
    !spinning && limits.working_share.is_some()
}

/// A call into candidate code, as its conversation watches it.
#[derive(Debug)]
struct Call {
    since: tokio::time::Instant,
    /// Its CPU demand as read at the call's start and every second over the last [`WORKING_WINDOW`] before its
    /// limit and after, oldest first: the oldest is the start of the window its share is read over.
    readings: std::collections::VecDeque<(tokio::time::Instant, Duration)>,
    check_at: tokio::time::Instant,
    /// A timed call: it waits for its GPU spinning, so CPU use does not tell it from a hang.
    spinning: bool,
}

impl Call {
    /// A call starting now; `read` gives its stage's CPU demand (`Processes::cpu_demand`), read only where used.
    fn new(limits: &CallLimits, spinning: bool, read: impl FnOnce() -> Option<Duration>) -> Self {
        let now = tokio::time::Instant::now();
        let mut call = Self { since: now, readings: Default::default(), check_at: now + limits.call, spinning };
        // Read every second from a window before the limit on, so that the first decision has its window's
        // readings; a call whose CPU use is not read is checked at its limit only.
        if call.reads_cpu(limits) {
            call.readings.extend(read().map(|cpu| (now, cpu)));
            call.check_at =
                now + limits.call.saturating_sub(WORKING_WINDOW).max(limits.call.min(Duration::from_secs(1)));
        }
        call
    }

    /// Whether its CPU use is read ([`reads_cpu`]).
    fn reads_cpu(&self, limits: &CallLimits) -> bool {
        reads_cpu(limits, self.spinning)
    }

    /// The share of a CPU the call used over the window, with a reading taken now (`None` where its CPU use is not
    /// read or not known). The rises between readings are added up: a reading can fall (a thread that ended takes its
    /// run-queue wait with it), and a fall must not hide the work around it. Over [`WORKING_WINDOW`] at least, so
    /// that a call younger than that is not judged by its first moments.
    fn share(
        &mut self,
        limits: &CallLimits,
        now: tokio::time::Instant,
        read: impl FnOnce() -> Option<Duration>,
    ) -> Option<f64> {
        if !self.reads_cpu(limits) {
            return None;
        }
        self.readings.push_back((now, read()?));
        while self.readings.get(1).is_some_and(|&(at, _)| at + WORKING_WINDOW <= now) {
            self.readings.pop_front();
        }
        let &(from, _) = self.readings.front()?;
        let used: Duration =
            self.readings.iter().zip(self.readings.iter().skip(1)).map(|(a, b)| b.1.saturating_sub(a.1)).sum();
        let wall = (now - from).max(WORKING_WINDOW).as_secs_f64();
        Some(used.as_secs_f64() / wall)
    }

    /// At `check_at`: `Ok` (checked again later) while the call is within its limit, or works on the CPU and is
    /// within the working limit, else why it is hung.
    fn check(&mut self, limits: &CallLimits, read: impl FnOnce() -> Option<Duration>) -> Result<(), String> {
        let now = tokio::time::Instant::now();
        let ran = now - self.since;
        let share = self.share(limits, now, read);
        if ran < limits.call {
            self.check_at = (now + Duration::from_secs(1)).min(self.since + limits.call);
            return Ok(());
        }
        // The share used and the share that counts as work, where the call's CPU use is read.
        let measured = share.zip(limits.working_share);
        let working = measured.is_some_and(|(share, line)| share >= line);
        if working && ran < limits.working {
            self.check_at = (now + Duration::from_secs(1)).min(self.since + limits.working);
            return Ok(());
        }
        let ran = ran.as_secs_f64();
        Err(match measured {
            _ if self.spinning => format!(
                "a timed call of the candidate did not return within {ran:.1} s: a kernel that never ends ({})",
                limits.basis
            ),
            _ if working => format!(
                "a call into the candidate's code was still running, using the CPU, after {ran:.1} s (the limit for \
                 calls that work on the CPU)"
            ),
            Some((share, line)) => format!(
                "a call into the candidate's code did not return within {ran:.1} s and was waiting, not computing on \
                 the CPU ({:.1}% of a CPU where {:.1}% counts as work): a kernel that never ends ({})",
                100.0 * share,
                100.0 * line,
                limits.basis
            ),
            None => format!("a call into the candidate's code did not return within {ran:.1} s ({})", limits.basis),
        })
    }
}

/// How a stage waits for its turn at the gate.
#[derive(Debug, Clone, Copy)]
enum Waiting {
    /// Stopped (`SIGSTOP`), its wall clock held: nothing of it runs, a candidate's other threads included.
    Stopped,
    /// Its wall clock held only: a stage under a launcher. Its harness waits for the answer, but a thread of the
    /// candidate's could go on; a profiled stage holds its device alone, so no timed work shares it meanwhile.
    ClockHeld,
}

impl Waiting {
    async fn wait(self, control: &Control, turn: impl std::future::Future<Output = ()>) {
        match self {
            Self::Stopped => control.stop(),
            Self::ClockHeld => control.hold_clock(),
        }
        turn.await;
        match self {
            Self::Stopped => control.resume(),
            Self::ClockHeld => control.release_clock(),
        }
    }
}

impl Started {
    /// Sends `request` and waits for the stage to end. With a `gate`, the stage joins its device as `Joining`
    /// says and may ask to run alone (`spec.gate`); it keeps its place there until the outcome leaves it.
    ///
    /// A result in another protocol version is [`StageError::Protocol`] where the harness wrote it: in trusted
    /// modes, and in the candidate's before its first call into candidate code. After that call it may be candidate
    /// code's forgery, and reads as no result (the candidate's failure, not the evaluator's). The compile stage has
    /// no calls announced (no control channel): a forged version there reads as the harness's.
    pub async fn run<S: StageSpec>(
        mut self,
        request: Request<S>,
        gate: Option<(&Arc<Gate>, Joining)>,
    ) -> Result<StageOutcome<S::Result>, StageError> {
        let mode = request.mode();
        let role = gate.map_or(GateRole::None, |(_, joining)| joining.role());
        let message = protocol::encode(&request.spec, &self.result_path, role, &request.env);
        let member = match gate {
            Some((gate, Joining::Share { solo })) => Some(Arc::new(gate.join(solo).await)),
            Some((gate, Joining::Idle)) => Some(Arc::new(gate.join_idle())),
            None => None,
        };
        let clock = member.as_deref().map(Member::clock).unwrap_or_default();
        let Request { limits, pair, .. } = request;
        let conversation = member.clone().map(|member| Conversation { member, limits, pair });
        if let Some(sender) = self.request.take() {
            let _ = sender.send((message, conversation));
        }
        // If this future is dropped (the evaluation was cancelled), `self` goes with it and the child is killed.
        let finished = match (&mut self.finished).await {
            Ok(result) => result?,
            Err(join) => return Err(StageError::Sandbox(SandboxError::Wait(std::io::Error::other(join.to_string())))),
        };
        let (hung, in_calls, called, lingered) = {
            let mut watch = self.watch.lock().expect("never poisoned");
            watch.call_ends();
            (watch.hung.take(), watch.in_calls, watch.called, watch.lingered)
        };
        let result_path = &self.result_path;
        let result = match std::fs::read(result_path) {
            Ok(bytes) => match protocol::decode(&bytes) {
                Decoded::Report(report) => Some(report),
                Decoded::Version { harness } if mode.trusted() || !called => {
                    return Err(StageError::Protocol { mode: mode.name(), harness });
                }
                Decoded::Version { harness } => {
                    tracing::warn!(?harness, path = %result_path.display(), "a stage result of another protocol version, written after candidate code ran");
                    None
                }
                Decoded::Unreadable(error) => {
                    tracing::warn!(%error, bytes = bytes.len(), path = %result_path.display(), "unreadable stage result");
                    None
                }
            },
            Err(_) => None,
        };
        Ok(StageOutcome { finished, result, gate: clock.times(), hung, in_calls, lingered, membership: member })
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        // Kills a process never asked, or abandoned mid-way; a no-op once it finished.
        self.finished.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::future::ready;

    use kforge_test_support::eventually;

    use super::*;
    use crate::devices::Side;

    #[test]
    fn a_stage_may_write_a_file_as_large_as_its_largest_device_s_memory() {
        let mut env = PythonEnv::bare("/venv/bin/python".into(), None);
        assert_eq!(largest_file(&env), 2 << 30, "no GPU: the sandbox's default");
        let gpu = |total_memory| crate::python::Gpu { name: "H100".into(), capability: "9.0".into(), total_memory };
        env.gpus = vec![gpu(80 << 30), gpu(40 << 30)];
        assert_eq!(largest_file(&env), 80 << 30);
    }

    type ShellStage = tokio::task::JoinHandle<Result<StageOutcome<protocol::CompileResult>, StageError>>;

    /// Runs `script` (sh) as a stage on `gate`, joining it as `joining`, with call limits of 1 s waiting and 2 s
    /// working (at least 1% of a CPU).
    fn shell_stage(script: &str, gate: &Arc<Gate>, joining: Joining) -> ShellStage {
        watched_shell_stage(script, gate, joining).0
    }

    /// [`shell_stage`], with what its conversation records as it goes, and its directory.
    fn watched_shell_stage(
        script: &str,
        gate: &Arc<Gate>,
        joining: Joining,
    ) -> (ShellStage, Arc<Mutex<Watch>>, PathBuf) {
        paired_shell_stage(script, gate, joining, None)
    }

    /// [`watched_shell_stage`], as one side of a paired timing when `pair` is given.
    fn paired_shell_stage(
        script: &str,
        gate: &Arc<Gate>,
        joining: Joining,
        pair: Option<PairSide>,
    ) -> (ShellStage, Arc<Mutex<Watch>>, PathBuf) {
        let dir = std::env::temp_dir().join(format!("kforge-python-{}-{}", std::process::id(), script.len()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch");
        let path = dir.join("stage.sh");
        std::fs::write(&path, script).expect("script");
        let env = PythonEnv::bare("/bin/sh".into(), None);
        let stage = Stage {
            scratch: dir.clone(),
            readable: vec![],
            writable: vec![],
            env: vec![],
            wall: Duration::from_secs(600),
            background: false,
            launcher: vec![],
        };
        let started = start(&Sandbox::basic(), &env, &path, stage, CancellationToken::new());
        let limits = CallLimits {
            call: Duration::from_secs(1),
            working: Duration::from_secs(2),
            working_share: Some(0.01),
            basis: "test".into(),
        };
        let spec = protocol::CompileSpec { candidate_path: dir.join("candidate.py"), kernels: false };
        let request = Request { spec, env: vec![], limits: Some(limits), pair };
        let gate = gate.clone();
        let watch = started.watch.clone();
        (tokio::spawn(async move { started.run(request, Some((&gate, joining))).await }), watch, dir)
    }

    const SHARE: Joining = Joining::Share { solo: false };

    /// Waits until `gate` has `members`.
    async fn members(gate: &Gate, members: usize) {
        eventually("members joined", || ready(gate.members() == members)).await;
    }

    #[tokio::test]
    async fn a_call_that_never_returns_is_stopped_and_its_neighbour_then_runs_alone() {
        // Asleep in its call (as a process waiting on a kernel that never ends); spinning on the CPU; and mostly
        // asleep but waking to work, as an autotuner timing its configurations does (well under half a CPU, well
        // over the 1% that counts as work): the last two run on to the working limit.
        let cases = [
            ("printf 'call\\n' >&3; exec sleep 3600", "did not return within"),
            // Part of a message, without its end of line (candidate code can write to the socket): still hung.
            ("printf 'call\\n' >&3; printf 'pau' >&3; exec sleep 3600", "did not return within"),
            ("printf 'call\\n' >&3; while :; do :; done", "using the CPU, after"),
            (
                "printf 'call\\n' >&3; while :; do i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; sleep 0.1; done",
                "using the CPU, after",
            ),
            // A timed call spins while it waits for its GPU: its CPU use earns it no longer limit.
            ("printf 'timed\\n' >&3; while :; do :; done", "timed call of the candidate did not return within 1.0"),
        ];
        for (script, says) in cases {
            let gate = Arc::new(Gate::default());
            let hung = shell_stage(script, &gate, SHARE);
            members(&gate, 1).await;
            // A neighbour that wants to run alone: the hung stage never reaches a pause point.
            let neighbour = Arc::new(gate.join(false).await);
            let alone = tokio::spawn({
                let neighbour = neighbour.clone();
                async move { neighbour.alone().await }
            });
            let outcome = hung.await.expect("task").expect("the stage ran");
            let reason = outcome.hung.clone().expect("stopped as hung");
            assert!(reason.contains(says), "{reason}");
            // What its threads were doing is named: one asleep (S) where the call sleeps, one running where it spins.
            let threads = match script {
                _ if script.contains("exec sleep") => "its threads then: 1 S",
                _ if script.contains("sleep 0.1") => "its threads then: ",
                _ => "its threads then: 1 R",
            };
            assert!(reason.contains(threads), "{reason}");
            assert_eq!(outcome.finished.exit, kforge_sandbox::Exit::Signal(9), "killed: {:?}", outcome.finished);
            // Until the caller has checked the device and lets the stage go, nobody runs alone.
            assert!(!alone.is_finished(), "the killed stage still holds its place");
            drop(outcome);
            tokio::time::timeout(Duration::from_secs(30), alone).await.expect("runs alone").expect("task");
        }
    }

    #[tokio::test]
    async fn paired_stages_take_their_rounds_by_turns_candidate_first() {
        let gate = Arc::new(Gate::default());
        let pairing = crate::devices::Pairing::new();
        let log = std::env::temp_dir().join(format!("kforge-pairing-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        // Each side times three rounds, writing its name and the round into the shared log while it runs alone.
        let script = |side: &str| {
            format!(
                "cat >/dev/null; for i in 0 1 2; do printf 'round\\n' >&3; head -c 3 <&3 >/dev/null; \
                 echo \"{side} $i\" >> {log}; printf 'share\\n' >&3; head -c 3 <&3 >/dev/null; done; \
                 printf '{{\"protocol\": {PROTOCOL_VERSION}, \"ok\": true}}' > result.json",
                log = log.display()
            )
        };
        // The baseline starts first, and still waits for the candidate's first round.
        let (baseline, _, _) =
            paired_shell_stage(&script("baseline"), &gate, SHARE, Some(pairing.side(Side::Baseline)));
        members(&gate, 1).await;
        let (candidate, _, _) =
            paired_shell_stage(&script("candidate"), &gate, SHARE, Some(pairing.side(Side::Candidate)));
        for stage in [candidate, baseline] {
            let outcome = stage.await.expect("task").expect("the stage ran");
            assert!(outcome.ok(), "{}", outcome.error_text());
        }
        let order = std::fs::read_to_string(&log).expect("the rounds' log");
        let expected = "candidate 0\nbaseline 0\ncandidate 1\nbaseline 1\ncandidate 2\nbaseline 2\n";
        assert_eq!(order, expected);
        let _ = std::fs::remove_file(&log);
    }

    #[tokio::test]
    async fn a_round_asked_for_outside_a_pair_ends_the_stage() {
        let gate = Arc::new(Gate::default());
        let script = "cat >/dev/null; printf 'round\\n' >&3; head -c 3 <&3 >/dev/null; : > answered; sleep 3600";
        let (stage, _, dir) = watched_shell_stage(script, &gate, SHARE);
        let outcome = stage.await.expect("task").expect("the stage ran");
        assert_eq!(outcome.finished.exit, kforge_sandbox::Exit::Signal(9), "killed: {:?}", outcome.finished);
        assert!(!dir.join("answered").exists(), "a stage without a pair is never let through a round");
    }

    #[tokio::test]
    async fn a_call_that_returned_while_the_evaluator_was_starved_is_not_taken_for_hung() {
        // The call returns once the test says so, and the harness asks to pause. The evaluator (this runtime, one
        // thread) is starved meanwhile, as a host busy with thousands of exiting processes starved it for seconds:
        // it runs again only once the message is there and the call's limit (1 s) has passed, so the check and the
        // message are both due. The message is read; the call is not hung. Three times, as a random pick of the two
        // took the check in half of the runs.
        for run in 0..3 {
            let script = format!(
                "cat >/dev/null; printf 'call\\n' >&3; while [ ! -e returned ]; do sleep 0.01; done; \
                 printf 'pause\\n' >&3; : > sent; head -c 3 <&3 >/dev/null; \
                 printf '{{\"protocol\": {PROTOCOL_VERSION}, \"ok\": true}}' > result.json # {run}"
            );
            let gate = Arc::new(Gate::default());
            let (stage, watch, dir) = watched_shell_stage(&script, &gate, SHARE);
            eventually("the evaluator saw the call begin", || ready(watch.lock().expect("watch").open_call.is_some()))
                .await;
            let returned = std::time::Instant::now();
            std::fs::write(dir.join("returned"), "").expect("returned");
            // Starved: this thread does nothing else until the message is sent and the limit has passed.
            while !dir.join("sent").exists() || returned.elapsed() < Duration::from_millis(1500) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let outcome = stage.await.expect("task").expect("the stage ran");
            assert_eq!(outcome.hung, None, "run {run}");
            assert!(outcome.ok(), "run {run}: {}", outcome.error_text());
        }
    }

    #[tokio::test]
    async fn a_whole_message_waiting_or_a_closed_socket_ends_a_call_and_part_of_one_does_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
        let (harness, evaluator) = tokio::net::UnixStream::pair().expect("socket pair");
        let (read, _write) = evaluator.into_split();
        let mut read = BufReader::new(read);
        let (_, mut harness) = harness.into_split();
        assert!(!message_waiting(&read, b""), "nothing sent");
        harness.write_all(b"pau").await.expect("write");
        assert!(!message_waiting(&read, b""), "part of a message on the socket");
        assert!(!message_waiting(&read, b"pau"), "part of a message read");
        harness.write_all(b"se\n").await.expect("write");
        assert!(message_waiting(&read, b""), "a whole message on the socket");
        // Read into the reader's buffer: still waiting there.
        let mut first = [0u8; 1];
        read.read_exact(&mut first).await.expect("read");
        assert!(message_waiting(&read, b"p"), "the rest in the reader's buffer");
        let mut rest = Vec::new();
        read.read_buf(&mut rest).await.expect("read");
        assert!(!message_waiting(&read, b""), "all read");
        drop(harness);
        assert!(message_waiting(&read, b""), "the harness closed its socket");
    }

    #[tokio::test]
    async fn a_trusted_stage_doing_host_work_runs_on_beside_timed_work_and_waits_for_it_to_share_again() {
        // A trusted stage shares the device, goes idle for host work that lasts until `go-on` exists (as long as
        // the test wants), then shares again and ends.
        let script = format!(
            "cat >/dev/null; echo $$ > pid; printf 'share\\n' >&3; head -c 3 <&3 >/dev/null; \
             printf 'idle\\n' >&3; head -c 3 <&3 >/dev/null; : > in-host-work; \
             while [ ! -e go-on ]; do sleep 0.01; done; : > host-work-done; \
             printf 'share\\n' >&3; head -c 3 <&3 >/dev/null; \
             printf '{{\"protocol\": {PROTOCOL_VERSION}, \"ok\": true}}' > result.json"
        );
        let gate = Arc::new(Gate::default());
        let stage = shell_stage(&script, &gate, Joining::Idle);
        let dir = std::env::temp_dir().join(format!("kforge-python-{}-{}", std::process::id(), script.len()));
        eventually("the stage got to its host work", || ready(dir.join("in-host-work").exists())).await;
        let neighbour = gate.join(false).await;
        tokio::time::timeout(Duration::from_secs(30), neighbour.alone())
            .await
            .expect("the neighbour runs alone without waiting for the idle stage");
        // Not stopped: its host work goes on and ends while the neighbour runs alone.
        std::fs::write(dir.join("go-on"), "").expect("go-on");
        eventually("the stage's host work ends beside timed work", || ready(dir.join("host-work-done").exists())).await;
        let pid = std::fs::read_to_string(dir.join("pid")).expect("pid");
        let group = pid.trim().parse().expect("a pid");
        eventually("the stage is stopped as it asks to share while its neighbour runs alone", || {
            ready(kforge_sandbox::group_stopped(group))
        })
        .await;
        neighbour.share().await;
        let outcome = stage.await.expect("task").expect("the stage ran");
        assert!(outcome.ok(), "{}", outcome.error_text());
    }

    #[tokio::test]
    async fn a_candidate_stage_may_not_go_idle_nor_send_what_the_harness_never_sends() {
        for message in ["idle", "host"] {
            // Answered, it would end at once (status 0); refused, it is killed while it waits for the answer.
            let script = format!("cat >/dev/null; printf '{message}\\n' >&3; head -c 3 <&3 >/dev/null; exit 0");
            let gate = Arc::new(Gate::default());
            let outcome = shell_stage(&script, &gate, SHARE).await.expect("task").expect("the stage ran");
            assert_eq!(outcome.finished.exit, kforge_sandbox::Exit::Signal(9), "{message}: {:?}", outcome.finished);
            assert!(!outcome.ok(), "{message}");
        }
    }

    #[tokio::test]
    async fn a_stage_that_runs_on_after_closing_its_socket_is_killed_and_told_so() {
        // Its result written and its control socket closed, it does not end (as an interpreter slow to shut down,
        // or candidate code that goes on using the device outside the gate).
        let script = format!(
            "cat >/dev/null; printf '{{\"protocol\": {PROTOCOL_VERSION}, \"ok\": true}}' > result.json; \
             exec 3>&-; exec sleep 3600"
        );
        let gate = Arc::new(Gate::default());
        let outcome = shell_stage(&script, &gate, SHARE).await.expect("task").expect("the stage ran");
        assert!(outcome.lingered, "{:?}", outcome.finished);
        assert_eq!(outcome.finished.exit, kforge_sandbox::Exit::Signal(9), "killed: {:?}", outcome.finished);
        assert!(!outcome.ok(), "a stage killed is not ok, whatever it wrote");
        assert!(outcome.error_text().contains("closed its control socket"), "{}", outcome.error_text());
    }

    #[tokio::test]
    async fn a_launcher_runs_the_harness_under_it() {
        let dir = std::env::temp_dir().join(format!("kforge-launcher-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch");
        let path = dir.join("stage.sh");
        // The stage reports, as its compile's seconds, a variable only the launcher sets.
        let script = format!(
            "cat >/dev/null; printf '{{\"protocol\": {PROTOCOL_VERSION}, \"ok\": true, \"seconds\": %s}}' \
             \"$LAUNCHED\" > result.json"
        );
        std::fs::write(&path, script).expect("script");
        let env = PythonEnv::bare("/bin/sh".into(), None);
        let stage = |launcher: Vec<OsString>| Stage {
            scratch: dir.clone(),
            readable: vec![],
            writable: vec![],
            env: vec![("LAUNCHED".into(), "1".into())],
            wall: Duration::from_secs(600),
            background: false,
            launcher,
        };
        let request =
            || Request::plain(protocol::CompileSpec { candidate_path: dir.join("candidate.py"), kernels: false });
        let launcher = vec!["/usr/bin/env".into(), "LAUNCHED=2".into()];
        let started = start(&Sandbox::basic(), &env, &path, stage(launcher), CancellationToken::new());
        let outcome = started.run(request(), None).await.expect("the stage ran");
        assert!(outcome.ok(), "{}", outcome.error_text());
        assert_eq!(outcome.result.and_then(|r| r.body.seconds), Some(2.0), "run under the launcher");
        let started = start(&Sandbox::basic(), &env, &path, stage(vec![]), CancellationToken::new());
        let outcome = started.run(request(), None).await.expect("the stage ran");
        assert_eq!(outcome.result.and_then(|r| r.body.seconds), Some(1.0), "no launcher");
    }

    /// Drives a call's checks on a paused clock: at each check, the CPU time `cpu` says it has used by then.
    async fn checks(limits: &CallLimits, cpu: impl Fn(Duration) -> Duration) -> (Duration, String) {
        let mut call = Call::new(limits, false, || Some(cpu(Duration::ZERO)));
        loop {
            tokio::time::sleep_until(call.check_at).await;
            let used = cpu(call.since.elapsed());
            if let Err(reason) = call.check(limits, || Some(used)) {
                return (call.since.elapsed(), reason);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_is_stopped_at_its_limit_unless_it_works_on_the_cpu_over_the_window() {
        let limits = CallLimits::for_reference(&CallLimitsConfig::default(), Some(0.005));
        let (call, working) = (limits.call, limits.working);
        // Asleep on its device, a clock tick now and then: stopped at the call limit, the share it used named.
        let (at, reason) = checks(&limits, |t| Duration::from_millis(10 * (t.as_secs() / 2))).await;
        assert_eq!(at, call, "{reason}");
        assert!(reason.contains("was waiting") && reason.contains("(0.3% of a CPU where 1.0%"), "{reason}");
        // An autotuner timing a 40 ms kernel's configurations: 1.3% of a CPU, in bursts of 40 ms every 3 s (as
        // measured). It runs on to the working limit.
        let bursts = |t: Duration| Duration::from_millis(40 * (t.as_secs() / 3 + 1));
        let (at, reason) = checks(&limits, bursts).await;
        assert_eq!(at, working, "{reason}");
        assert!(reason.contains("using the CPU"), "{reason}");
        // Busy compiling for 5 s, then asleep on a kernel that never ends: stopped once the window holds no work.
        let (at, reason) = checks(&limits, |t| t.min(Duration::from_secs(5))).await;
        assert_eq!(at, Duration::from_secs(5) + WORKING_WINDOW, "{reason}");
        assert!(reason.contains("was waiting"), "{reason}");
        // Just under the share over the window: waiting.
        let under = |t: Duration| t.mul_f64(0.9 * limits.working_share.expect("told apart"));
        assert_eq!(checks(&limits, under).await.0, call);
        // Working at 2% a second, but its reading falls by 50 ms every 3 s (a thread that ended takes its run-queue
        // wait with it): the fall does not hide the work around it (the readings' difference would be 0.3%).
        let falling = |t: Duration| {
            let secs = t.as_secs();
            Duration::from_millis(200 + 20 * secs - 50 * (secs / 3))
        };
        let (at, reason) = checks(&limits, falling).await;
        assert!(reason.contains("using the CPU"), "{at:?}: {reason}");
        // A call limit under the window: its share is counted over the window, so a start's few ticks (20 ms in its
        // first second) do not count as work.
        let short = CallLimits { call: Duration::from_secs(1), ..limits.clone() };
        let (at, reason) = checks(&short, |t| Duration::from_millis(20).min(t.mul_f64(0.02))).await;
        assert_eq!(at, Duration::from_secs(1), "{reason}");
        assert!(reason.contains("(0.7% of a CPU"), "{reason}");
        // Limits that do not tell working calls apart (a profiled call's) read no CPU and name none.
        let (at, reason) = checks(&CallLimits::fixed(Duration::from_secs(5), "fixed"), |t| t).await;
        assert_eq!(at, Duration::from_secs(5));
        assert!(reason.contains("did not return within 5.0 s (fixed)"), "{reason}");
        // A timed call spins while it waits: its CPU use earns it nothing.
        let mut timed = Call::new(&limits, true, || panic!("a timed call's CPU is not read"));
        tokio::time::sleep_until(timed.check_at).await;
        let reason = timed.check(&limits, || panic!("a timed call's CPU is not read")).expect_err("stopped");
        assert!(reason.contains("timed call"), "{reason}");
    }

    #[test]
    fn call_limits_scale_with_the_reference_within_the_floor_and_working_limit() {
        let config = CallLimitsConfig::default();
        let unmeasured = CallLimits::for_reference(&config, None);
        assert_eq!(unmeasured.call, Duration::from_secs_f64(config.unmeasured_secs));
        let quick = CallLimits::for_reference(&config, Some(0.001));
        assert_eq!(quick.call, Duration::from_secs_f64(config.floor_secs), "at least the floor");
        let slow_ms = 1e3 * 10.0 * config.working_secs.max(config.floor_secs) / config.reference_factor;
        let slow = CallLimits::for_reference(&config, Some(slow_ms));
        assert!(slow.call > Duration::from_secs_f64(config.working_secs), "{slow:?}");
        assert_eq!(slow.working, slow.call, "the working limit is never below the call limit");
        assert!(slow.basis.contains("x the reference's"), "{}", slow.basis);
    }
}
