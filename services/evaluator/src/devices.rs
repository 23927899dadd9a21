//! Device lanes, the gate that lets evaluations share a device without touching each other's timings, and device
//! health.
//!
//! A lane is a slot on one device: the CPU has one, each GPU `gpu_slots`. Lanes are taken from a pool (any free
//! slot of a healthy GPU), so several GPUs serve one queue. Waiting evaluations are served by priority (higher
//! first) and, within a priority, in turns across jobs (`job_id`): a job that queued a hundred evaluations does not
//! make a job that queued one wait for all of them.
//!
//! Memory-aware admission: each GPU may have a memory budget (its total memory times `gpu_memory_fraction`), and
//! an evaluation whose footprint is known (from its task's reference: [`footprint`]) reserves that many bytes of it
//! while it holds a slot. A waiter is handed a slot only on a device where its footprint fits beside what is
//! reserved there, or where nothing is reserved (a task larger than the budget runs without other known-footprint
//! evaluations rather than never). An evaluation whose footprint is unknown is admitted by slots alone. The queue
//! stays in order: the first waiter is served when it fits, and while it does not, nobody behind it is served
//! (head-of-line waiting), so small evaluations cannot keep a large one waiting forever.
//!
//! The evaluations holding slots on one device share it through its [`Gate`]: their processes use the device side
//! by side, except that timed work (timing loops, the census's recorded calls) runs alone: it starts only once
//! every other process on the device has reached a synchronised pause point and been stopped (`SIGSTOP`), and no
//! process joins or resumes until it is over. With one slot, an evaluation has its device to itself, as before.
//!
//! After a CUDA-level fault on a GPU (an illegal address, a launch failure, a kernel killed at its time limit, a
//! crash) the device is probed before anything else runs on it: `kforge-device-probe`, a short-lived process that
//! creates a context, runs a tiny kernel and checks its result, under a timeout. A device that fails is
//! quarantined: its lane leaves the pool, evaluations waiting for a GPU get a retryable `VERDICT_INFRA_ERROR`
//! once no healthy GPU is left, readiness goes NOT_SERVING, and the probe runs again every `retry_secs` until it
//! passes, which puts the lane back.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kforge_sandbox::Exit;
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch};

use crate::metrics::EvaluatorMetrics;

/// The probe's name, looked up next to the running executable and then on PATH.
pub const PROBE_PROGRAM: &str = "kforge-device-probe";

/// How GPUs are health-probed (`[evaluator.device_probe]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceProbeConfig {
    /// The probe program. Default: `kforge-device-probe` next to this executable, else on PATH.
    pub command: Option<PathBuf>,
    /// A probe that has not finished after this many seconds failed (a wedged device hangs driver calls).
    pub timeout_secs: u64,
    /// While a device is quarantined, it is probed again this often, in seconds.
    pub retry_secs: u64,
}

impl Default for DeviceProbeConfig {
    fn default() -> Self {
        Self { command: None, timeout_secs: 30, retry_secs: 15 }
    }
}

/// Why a stage's end looks like a device fault rather than a fault of the candidate's host code; `None` when it
/// does not (an exception, a wrong shape, an out-of-memory error leave the device usable).
pub fn fault(exit: Exit, error_text: &str) -> Option<String> {
    const SIGNATURES: &[&str] = &[
        "illegal memory access",
        "illegal address",
        "illegal instruction",
        "misaligned address",
        "unspecified launch failure",
        "launch timed out",
        "device-side assert",
        "hardware stack error",
        "invalid program counter",
        "uncorrectable ecc",
        "ecc error",
        "fallen off the bus",
        "cuda error: unknown error",
        "cuda_error_",
        "cudaerror",
    ];
    match exit {
        Exit::Cancelled => None,
        Exit::TimedOut => Some("a stage ran past its time limit and was killed".into()),
        Exit::Signal(signal) => Some(format!("a stage was killed by signal {signal}")),
        Exit::Code(_) => {
            let text = error_text.to_lowercase();
            SIGNATURES.iter().find(|s| text.contains(*s)).map(|s| format!("a stage failed with a CUDA fault ({s})"))
        }
    }
}

/// The device lanes of one evaluator, and the health of its GPUs.
#[derive(Debug)]
pub struct Lanes {
    cpu: Mutex<Pool>,
    gpus: Mutex<Pool>,
    /// Slots per GPU.
    slots: usize,
    cpu_gate: Arc<Gate>,
    gpu_gates: Vec<Arc<Gate>>,
    /// Per GPU: why it is quarantined.
    quarantined: Mutex<Vec<Option<String>>>,
    /// Whether any GPU is healthy (always true without GPUs): the service's readiness.
    ready: watch::Sender<bool>,
    probe: Result<PathBuf, String>,
    config: DeviceProbeConfig,
    metrics: EvaluatorMetrics,
}

/// How many bytes of device memory an evaluation needs, from the peak its task's reference allocated on the device
/// (`torch.cuda.max_memory_allocated` after the reference trials): the candidate's process holds the same inputs
/// and outputs and a workspace of its own, and the checker holds the reference's outputs beside the candidate's,
/// hence twice the peak; plus 1 GiB that the allocator does not see or that the harness adds: the CUDA context
/// (300-500 MB), the first gigabyte of free memory the candidate stage fills with NaN before it starts, and the
/// extra timing input sets of small tasks.
pub fn footprint(reference_peak_bytes: u64) -> u64 {
    const FACTOR: u64 = 2;
    const OVERHEAD: u64 = 1 << 30;
    reference_peak_bytes.saturating_mul(FACTOR).saturating_add(OVERHEAD)
}

/// Where a waiter stands: priority (higher first), its job's turn, arrival.
type Turn = (Reverse<i32>, u64, u64);

/// A slot handed out: its device, the bytes reserved there for the evaluation, and the device's quarantine count
/// at the time (a slot taken before a quarantine does not go back to the pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grant {
    index: usize,
    bytes: u64,
    generation: u64,
}

/// An evaluation waiting for a slot.
#[derive(Debug)]
struct Waiter {
    sender: oneshot::Sender<Grant>,
    /// Its footprint in bytes, where known.
    footprint: Option<u64>,
}

/// Slots of one kind of device and the evaluations waiting for them.
#[derive(Debug, Default)]
struct Pool {
    /// Free slots of devices in service, by device index (a device appears once per free slot).
    free: Vec<usize>,
    /// Devices in service (not quarantined).
    in_service: usize,
    /// Per device: its memory budget in bytes; `None`: admitted by slots alone (the CPU, a GPU whose memory is
    /// unknown, or admission by memory turned off).
    budgets: Vec<Option<u64>>,
    /// Per device: the bytes reserved by the evaluations holding its slots.
    reserved: Vec<u64>,
    /// Per device: the reserved bytes as a metric (none for the CPU).
    gauges: Vec<Gauge>,
    /// Per device: how many times it was quarantined, and whether it is now.
    generation: Vec<u64>,
    quarantined: Vec<bool>,
    waiters: BTreeMap<Turn, Waiter>,
    /// Per job: the turn its next waiter gets.
    next_turn: HashMap<String, u64>,
    /// The turn of the waiter served last; a job that starts waiting starts here.
    serving: u64,
    arrivals: u64,
}

impl Pool {
    /// Devices with these budgets, `slots` slots each.
    fn new(budgets: Vec<Option<u64>>, slots: usize, gauges: Vec<Gauge>) -> Self {
        let devices = budgets.len();
        let free = (0..slots).flat_map(|_| (0..devices).rev()).collect();
        Self {
            free,
            in_service: devices,
            budgets,
            reserved: vec![0; devices],
            gauges,
            generation: vec![0; devices],
            quarantined: vec![false; devices],
            ..Self::default()
        }
    }

    /// Whether an evaluation of `footprint` may join device `index` now: it fits beside what is reserved there,
    /// or nothing is. Without a budget or a footprint, always.
    fn fits(&self, index: usize, footprint: Option<u64>) -> bool {
        match (self.budgets[index], footprint) {
            (Some(budget), Some(bytes)) => {
                let reserved = self.reserved[index];
                reserved == 0 || reserved.saturating_add(bytes) <= budget
            }
            _ => true,
        }
    }

    /// Takes a free slot where `footprint` fits (the last freed first), reserving it there.
    fn take(&mut self, footprint: Option<u64>) -> Option<Grant> {
        let at = self.free.iter().rposition(|&index| self.fits(index, footprint))?;
        let index = self.free.remove(at);
        let bytes = if self.budgets[index].is_some() { footprint.unwrap_or(0) } else { 0 };
        self.reserve(index, self.reserved[index].saturating_add(bytes));
        Some(Grant { index, bytes, generation: self.generation[index] })
    }

    fn reserve(&mut self, index: usize, bytes: u64) {
        self.reserved[index] = bytes;
        if let Some(gauge) = self.gauges.get(index) {
            gauge.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// Puts a slot and its bytes back, unless its device was quarantined since it was taken.
    fn give_back(&mut self, grant: Grant) {
        let Grant { index, bytes, generation } = grant;
        if self.quarantined[index] || self.generation[index] != generation {
            return;
        }
        self.reserve(index, self.reserved[index].saturating_sub(bytes));
        self.free.push(index);
    }

    /// Gives a slot back and serves the waiters that now fit.
    fn release(&mut self, grant: Grant) {
        self.give_back(grant);
        self.serve();
    }

    /// Hands free slots to waiters in order while the first one fits; one that does not keeps the others waiting
    /// behind it (head-of-line), so that it is served once enough is released. Waiters that went away are skipped.
    fn serve(&mut self) {
        while let Some((&place, first)) = self.waiters.first_key_value() {
            if first.sender.is_closed() {
                self.waiters.remove(&place);
                continue;
            }
            let Some(grant) = self.take(first.footprint) else { return };
            let waiter = self.waiters.remove(&place).expect("the first waiter");
            let (_, turn, _) = place;
            self.serving = self.serving.max(turn);
            if let Err(grant) = waiter.sender.send(grant) {
                self.give_back(grant);
            }
        }
    }

    /// Queues a waiter of `job` at `priority` in its turn; returns its place and where its slot will come.
    fn enqueue(&mut self, priority: i32, job: &str, footprint: Option<u64>) -> (Turn, oneshot::Receiver<Grant>) {
        let turn = self.serving.max(self.next_turn.get(job).copied().unwrap_or(0));
        self.next_turn.insert(job.to_owned(), turn + 1);
        let arrival = self.arrivals;
        self.arrivals += 1;
        let (sender, receiver) = oneshot::channel();
        let place = (Reverse(priority), turn, arrival);
        self.waiters.insert(place, Waiter { sender, footprint });
        (place, receiver)
    }

    /// Takes device `index` out of service: its free slots leave the pool, and its slots in use and their bytes
    /// do not come back.
    fn quarantine(&mut self, index: usize) {
        self.free.retain(|&free| free != index);
        self.quarantined[index] = true;
        self.generation[index] += 1;
        self.reserve(index, 0);
        self.in_service -= 1;
        if self.in_service == 0 {
            // Nothing will serve them: every waiter gets its error now.
            self.waiters.clear();
        }
    }

    /// Puts device `index` back in service with `slots` free slots, and serves the waiters that fit.
    fn restore(&mut self, index: usize, slots: usize) {
        self.quarantined[index] = false;
        self.in_service += 1;
        self.reserve(index, 0);
        self.free.extend(std::iter::repeat_n(index, slots));
        self.serve();
    }
}

/// A slot on one device; released on drop, unless the device was quarantined meanwhile.
#[derive(Debug)]
pub struct Lane {
    lanes: Arc<Lanes>,
    /// A GPU lane (else the CPU's).
    is_gpu: bool,
    /// The device's index in its pool: the GPU index for a GPU lane.
    index: usize,
    /// Whether this evaluation's stages keep the device to themselves (see [`Gate`]).
    solo: AtomicBool,
    /// How long this evaluation's stages ran alone on the device and waited at its gate.
    gate_times: Arc<Mutex<MemberTimes>>,
    /// The slot held (given back on drop); none for work outside the slots.
    grant: Option<Grant>,
}

impl Lane {
    /// The GPU index, or `None` for the CPU lane.
    pub fn gpu(&self) -> Option<usize> {
        self.is_gpu.then_some(self.index)
    }

    /// The harness's name of this lane's device kind: `cuda` or `cpu`.
    pub fn device(&self) -> &'static str {
        if self.is_gpu { "cuda" } else { "cpu" }
    }

    /// The bytes of device memory reserved for this evaluation (0: its footprint is unknown, or not counted).
    pub fn reserved_bytes(&self) -> u64 {
        self.grant.map_or(0, |grant| grant.bytes)
    }

    /// The gate of this lane's device.
    pub fn gate(&self) -> &Arc<Gate> {
        if self.is_gpu { &self.lanes.gpu_gates[self.index] } else { &self.lanes.cpu_gate }
    }

    /// Whether other evaluations may hold slots on this lane's device at the same time.
    pub fn shared(&self) -> bool {
        self.is_gpu && self.lanes.slots > 1
    }

    /// From now on, this evaluation's stages run with the device to themselves.
    pub fn go_solo(&self) {
        self.solo.store(true, Ordering::SeqCst);
    }

    /// Whether this evaluation's stages keep the device to themselves.
    pub fn solo(&self) -> bool {
        self.solo.load(Ordering::SeqCst)
    }

    /// Adds a stage's time alone and waiting at the gate to this evaluation's.
    pub fn add_gate_times(&self, times: MemberTimes) {
        let mut total = self.gate_times.lock().expect("never poisoned");
        total.alone += times.alone;
        total.waited += times.waited;
    }

    /// This evaluation's time alone and waiting at the gate, readable after the lane is released.
    pub fn gate_times(&self) -> Arc<Mutex<MemberTimes>> {
        self.gate_times.clone()
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // The slots of a quarantined device stay out of the pool; a probe that passes puts them all back (see
        // `Lanes::recover`).
        if let Some(grant) = self.grant.take() {
            self.lanes.pool(self.is_gpu).release(grant);
        }
    }
}

/// A place in a pool's queue; if dropped (the evaluation was cancelled), the place is given up, and a slot handed
/// to it but not yet taken goes back.
struct Waiting<'a> {
    lanes: &'a Lanes,
    gpu: bool,
    place: Turn,
    receiver: Option<oneshot::Receiver<Grant>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut receiver) = self.receiver.take() {
            // Closed first: a slot is then either in the channel already or never sent (see `Pool::serve`).
            receiver.close();
            let mut pool = self.lanes.pool(self.gpu);
            pool.waiters.remove(&self.place);
            if let Ok(grant) = receiver.try_recv() {
                pool.give_back(grant);
            }
            // A first waiter that leaves may let those behind it through.
            pool.serve();
        }
    }
}

impl Lanes {
    /// `gpus` GPUs of `slots` slots each (at least one), and the CPU's one; admitted by slots alone.
    pub fn new(gpus: usize, slots: usize, config: DeviceProbeConfig, metrics: EvaluatorMetrics) -> Arc<Self> {
        Self::with_budgets(vec![None; gpus], slots, config, metrics)
    }

    /// GPUs with these memory budgets in bytes (`None`: admitted by slots alone), `slots` slots each (at least
    /// one), and the CPU's one.
    pub fn with_budgets(
        budgets: Vec<Option<u64>>,
        slots: usize,
        config: DeviceProbeConfig,
        metrics: EvaluatorMetrics,
    ) -> Arc<Self> {
        let gpus = budgets.len();
        let slots = slots.max(1);
        let probe = match &config.command {
            Some(command) => Ok(command.clone()),
            None => find_probe(),
        };
        if gpus > 0
            && let Err(reason) = &probe
        {
            tracing::warn!(%reason, "GPU faults will not be followed by a device health probe");
        }
        let gauges = (0..gpus).map(|gpu| metrics.gpu_reserved_bytes(gpu)).collect();
        Arc::new(Self {
            cpu: Mutex::new(Pool::new(vec![None], 1, Vec::new())),
            gpus: Mutex::new(Pool::new(budgets, slots, gauges)),
            slots,
            cpu_gate: Arc::default(),
            gpu_gates: (0..gpus).map(|_| Arc::default()).collect(),
            quarantined: Mutex::new(vec![None; gpus]),
            ready: watch::Sender::new(true),
            probe,
            config,
            metrics,
        })
    }

    fn pool(&self, gpu: bool) -> std::sync::MutexGuard<'_, Pool> {
        let pool = if gpu { &self.gpus } else { &self.cpu };
        pool.lock().expect("lane lock is never poisoned")
    }

    /// Readiness: false while every GPU is quarantined.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The probe program, or why there is none.
    pub fn probe_program(&self) -> Result<&Path, &str> {
        self.probe.as_deref().map_err(String::as_str)
    }

    /// Where each GPU's time went, by what its gate was doing.
    pub fn gpu_accounts(&self) -> Vec<GateAccount> {
        self.gpu_gates.iter().map(|gate| gate.account()).collect()
    }

    /// Per GPU: the bytes reserved now by the evaluations holding its slots (also the metric
    /// `kforge_evaluator_gpu_reserved_bytes{gpu}`).
    pub fn gpu_reserved_bytes(&self) -> Vec<u64> {
        self.pool(true).reserved.clone()
    }

    /// Why GPU `gpu` is quarantined, if it is.
    pub fn quarantine_reason(&self, gpu: usize) -> Option<String> {
        self.quarantined.lock().expect("lane lock is never poisoned").get(gpu).cloned().flatten()
    }

    /// The first healthy GPU, outside its slots: for work the evaluator does for itself beside the evaluations
    /// (a baseline computed ahead). Its stages share the device through the gate like any slot's; nothing is
    /// reserved, and nothing is released when it is dropped. None without a healthy GPU.
    pub fn outside_slots(self: &Arc<Self>) -> Option<Lane> {
        let index = self.quarantined.lock().expect("lane lock is never poisoned").iter().position(Option::is_none)?;
        Some(self.lane(true, index, None))
    }

    /// A lane on device `index` (a GPU's, or the CPU's), holding a slot or not.
    fn lane(self: &Arc<Self>, is_gpu: bool, index: usize, grant: Option<Grant>) -> Lane {
        Lane { lanes: self.clone(), is_gpu, index, solo: AtomicBool::new(false), gate_times: Arc::default(), grant }
    }

    /// The CPU's slot, or a free slot of a healthy GPU where `footprint` (bytes of device memory, where known)
    /// fits, waiting for one in turn (`priority`, then turns across `job`s); an error when every GPU is
    /// quarantined (also for those already waiting when the last one goes). The CPU ignores footprints.
    pub async fn acquire(
        self: &Arc<Self>,
        gpu: bool,
        priority: i32,
        job: &str,
        footprint: Option<u64>,
    ) -> Result<Lane, String> {
        let (place, receiver) = {
            let mut pool = self.pool(gpu);
            if pool.in_service == 0 {
                drop(pool);
                return Err(self.unavailable());
            }
            if pool.waiters.is_empty()
                && let Some(grant) = pool.take(footprint)
            {
                drop(pool);
                return Ok(self.lane(gpu, grant.index, Some(grant)));
            }
            let queued = pool.enqueue(priority, job, footprint);
            // It may go first (a higher priority), and fit where the first waiter did not.
            pool.serve();
            queued
        };
        let mut waiting = Waiting { lanes: self, gpu, place, receiver: Some(receiver) };
        let delivered = waiting.receiver.as_mut().expect("set above").await;
        waiting.receiver = None;
        match delivered {
            Ok(grant) => Ok(self.lane(gpu, grant.index, Some(grant))),
            // The pool dropped its waiters: no lane is left in service.
            Err(_) => Err(self.unavailable()),
        }
    }

    fn unavailable(&self) -> String {
        let quarantined = self.quarantined.lock().expect("lane lock is never poisoned");
        let reasons: Vec<String> = quarantined
            .iter()
            .enumerate()
            .filter_map(|(gpu, reason)| reason.as_ref().map(|r| format!("cuda:{gpu} ({r})")))
            .collect();
        format!("every GPU of this evaluator is quarantined: {}; retry on another evaluator", reasons.join(", "))
    }

    /// After `fault` on the GPU `lane` holds: probes it, and quarantines it when the probe fails. Returns whether
    /// the device is healthy. Called with the lane held; evaluations sharing the device go on meanwhile (a fault
    /// in one process's context leaves the others' intact), and none joins once it is quarantined.
    pub async fn after_fault(self: &Arc<Self>, lane: &Lane, fault: &str) -> bool {
        let Some(gpu) = lane.gpu() else { return true };
        let Ok(program) = &self.probe else { return true };
        tracing::info!(gpu, fault, "probing the device after a fault");
        match self.probe(program, gpu).await {
            Ok(()) => true,
            Err(reason) => {
                tracing::error!(gpu, %reason, fault, "device failed its health probe; quarantined");
                // Another evaluation on the device may have quarantined it already; one recovery loop is enough.
                if self.set_quarantine(gpu, Some(format!("failed its health probe after {fault}: {reason}"))) {
                    let lanes = self.clone();
                    tokio::spawn(async move { lanes.recover(gpu).await });
                }
                false
            }
        }
    }

    /// Probes a quarantined GPU every `retry_secs` until it passes, then returns its lane to the pool.
    async fn recover(self: Arc<Self>, gpu: usize) {
        let Ok(program) = &self.probe else { return };
        loop {
            tokio::time::sleep(Duration::from_secs(self.config.retry_secs)).await;
            if let Err(reason) = self.probe(program, gpu).await {
                tracing::warn!(gpu, %reason, "quarantined device still fails its health probe");
                continue;
            }
            tracing::info!(gpu, "device passed its health probe; back in service");
            self.set_quarantine(gpu, None);
            return;
        }
    }

    /// Takes GPU `gpu` out of service (`Some(reason)`: its free slots leave the pool, and slots in use and the
    /// bytes they reserved do not come back) or puts it back with all its slots and nothing reserved (`None`).
    /// Returns whether that changed anything.
    fn set_quarantine(&self, gpu: usize, reason: Option<String>) -> bool {
        let back = reason.is_none();
        let count = {
            let mut quarantined = self.quarantined.lock().expect("lane lock is never poisoned");
            if quarantined[gpu].is_some() != back {
                return false;
            }
            quarantined[gpu] = reason;
            quarantined.iter().filter(|reason| reason.is_some()).count()
        };
        let mut pool = self.pool(true);
        if back {
            pool.restore(gpu, self.slots);
        } else {
            pool.quarantine(gpu);
        }
        let in_service = pool.in_service;
        drop(pool);
        self.metrics.devices_quarantined(count);
        self.ready.send_replace(in_service > 0);
        true
    }

    /// Runs the probe on `gpu` in its own process, killed at the timeout.
    async fn probe(&self, program: &Path, gpu: usize) -> Result<(), String> {
        let mut command = tokio::process::Command::new(program);
        command
            .args(["--ordinal", "0"])
            .env_clear()
            .env("CUDA_VISIBLE_DEVICES", gpu.to_string())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let timeout = Duration::from_secs(self.config.timeout_secs);
        let result = match tokio::time::timeout(timeout, command.output()).await {
            Err(_) => Err(format!("the probe did not finish within {} s", self.config.timeout_secs)),
            Ok(Err(error)) => Err(format!("could not run {}: {error}", program.display())),
            Ok(Ok(output)) if output.status.success() => Ok(()),
            Ok(Ok(output)) => {
                let report: Option<serde_json::Value> = serde_json::from_slice(&output.stdout).ok();
                let error = report.as_ref().and_then(|r| r.get("error")).and_then(|e| e.as_str()).map(str::to_owned);
                Err(error.unwrap_or_else(|| {
                    format!("{} ({})", output.status, String::from_utf8_lossy(&output.stderr).trim())
                }))
            }
        };
        self.metrics.device_probe(result.is_ok());
        result
    }
}

/// Who is using one device, and how. Members (stage processes) share the device, except that one at a time may
/// run alone: it is let through once every other member stands at a pause point (or is idle), and until it shares
/// again no member joins or resumes. A member waiting at a pause point is stopped by its driver (`SIGSTOP`) after
/// synchronising its device work, so a member running alone has the device to itself. A solo member (an
/// evaluation retried without neighbours) joins only an empty device and keeps it empty.
///
/// A trusted stage (one that runs no candidate code: the reference, the checker, the baseline) may join idle: it
/// does host work without holding anyone up, and asks to share before it touches the device.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    /// Bumped on every change of `state`; waiters re-check their condition.
    changed: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct GateState {
    next_id: u64,
    members: BTreeMap<u64, Standing>,
    /// Members waiting to run alone, first asked first.
    queue: VecDeque<u64>,
    alone: Option<u64>,
    solo: Option<u64>,
    /// Where the device's time went until `since`.
    account: GateAccount,
    since: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Standing {
    /// Running, and may be using the device.
    Sharing,
    /// At a pause point with its device work synchronised (stopped by its driver).
    Paused,
    /// Running with the device to itself.
    Alone,
    /// A trusted stage doing host work only.
    Idle,
}

/// Where one device's time went, by what its gate was doing.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct GateAccount {
    /// A member ran alone.
    pub alone: Duration,
    /// A member waited to run alone while others finished their shared work: the device drained.
    pub draining: Duration,
    /// Members shared the device.
    pub shared: Duration,
    /// No member.
    pub empty: Duration,
}

impl GateState {
    /// Whether a member may start (or resume) using the device side by side with others.
    fn open(&self) -> bool {
        self.alone.is_none() && self.queue.is_empty() && self.solo.is_none()
    }

    /// Books the time since the last change to what the gate was doing during it.
    fn book(&mut self) {
        let now = Instant::now();
        let elapsed = self.since.map_or(Duration::ZERO, |since| now - since);
        self.since = Some(now);
        let bucket = if self.alone.is_some() {
            &mut self.account.alone
        } else if !self.queue.is_empty() {
            &mut self.account.draining
        } else if self.members.is_empty() {
            &mut self.account.empty
        } else {
            &mut self.account.shared
        };
        *bucket += elapsed;
    }
}

/// A member of a [`Gate`]; leaves it when dropped.
#[derive(Debug)]
pub struct Member {
    gate: Arc<Gate>,
    id: u64,
    /// May go idle (a trusted stage).
    trusted: bool,
    clock: MemberClock,
}

/// How long one member ran alone and waited at its gate.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct MemberTimes {
    pub alone: Duration,
    pub waited: Duration,
}

/// A member's [`MemberTimes`] as they accrue; a handle that outlives the member.
#[derive(Debug, Clone, Default)]
pub struct MemberClock(Arc<Mutex<Clock>>);

#[derive(Debug, Default)]
struct Clock {
    times: MemberTimes,
    alone_since: Option<Instant>,
}

impl MemberClock {
    /// The times so far (a member running alone now counts up to its last change).
    pub fn times(&self) -> MemberTimes {
        self.lock().times
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Clock> {
        self.0.lock().expect("never poisoned")
    }

    fn end_alone(&self) {
        let mut clock = self.lock();
        if let Some(since) = clock.alone_since.take() {
            clock.times.alone += since.elapsed();
        }
    }
}

impl Gate {
    /// Joins the device, waiting while a member runs alone or waits to (timed work is never disturbed by a
    /// newcomer). A `solo` member waits for an empty device and keeps everyone else out.
    pub async fn join(self: &Arc<Self>, solo: bool) -> Member {
        let id = self
            .wait_until(|state| {
                if !state.open() || (solo && !state.members.is_empty()) {
                    return None;
                }
                let id = state.next_id;
                state.next_id += 1;
                state.members.insert(id, Standing::Sharing);
                if solo {
                    state.solo = Some(id);
                }
                Some(id)
            })
            .await;
        Member { gate: self.clone(), id, trusted: false, clock: MemberClock::default() }
    }

    /// Joins idle, at once: a trusted stage that asks to share before it uses the device (and may go idle again).
    pub fn join_idle(self: &Arc<Self>) -> Member {
        let mut id = 0;
        self.update(|state| {
            id = state.next_id;
            state.next_id += 1;
            state.members.insert(id, Standing::Idle);
        });
        Member { gate: self.clone(), id, trusted: true, clock: MemberClock::default() }
    }

    /// How many members the device has now.
    pub fn members(&self) -> usize {
        self.state.lock().expect("gate lock is never poisoned").members.len()
    }

    /// Where the device's time went since the gate was made.
    pub fn account(&self) -> GateAccount {
        let mut state = self.state.lock().expect("gate lock is never poisoned");
        state.book();
        state.account
    }

    /// Applies `step` under the lock until it returns `Some`, waiting for a change between tries.
    async fn wait_until<T>(&self, mut step: impl FnMut(&mut GateState) -> Option<T>) -> T {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let mut state = self.state.lock().expect("gate lock is never poisoned");
                state.book();
                if let Some(value) = step(&mut state) {
                    drop(state);
                    self.changed.send_modify(|version| *version += 1);
                    return value;
                }
            }
            // The sender lives in `self`, so this never fails.
            let _ = changed.changed().await;
        }
    }

    fn update(&self, change: impl FnOnce(&mut GateState)) {
        {
            let mut state = self.state.lock().expect("gate lock is never poisoned");
            state.book();
            change(&mut state);
        }
        self.changed.send_modify(|version| *version += 1);
    }
}

impl Member {
    /// Waits at a pause point until this member may run alone: its turn among those asking, with every other
    /// member paused or idle. Runs alone already: nothing to wait for.
    pub async fn alone(&self) {
        let id = self.id;
        let asked = Instant::now();
        self.gate.update(|state| {
            if state.alone != Some(id) && !state.queue.contains(&id) {
                state.members.insert(id, Standing::Paused);
                state.queue.push_back(id);
            }
        });
        self.gate
            .wait_until(|state| {
                if state.alone == Some(id) {
                    return Some(());
                }
                let others_held = state
                    .members
                    .iter()
                    .all(|(&m, &standing)| m == id || matches!(standing, Standing::Paused | Standing::Idle));
                if state.alone.is_some() || state.queue.front() != Some(&id) || !others_held {
                    return None;
                }
                state.queue.pop_front();
                state.alone = Some(id);
                state.members.insert(id, Standing::Alone);
                Some(())
            })
            .await;
        let mut clock = self.clock.lock();
        clock.times.waited += asked.elapsed();
        clock.alone_since.get_or_insert_with(Instant::now);
    }

    /// Ends running alone (or any wait, or being idle), pausing until members may share the device again.
    pub async fn share(&self) {
        let id = self.id;
        let asked = Instant::now();
        self.stand(Standing::Paused);
        self.gate
            .wait_until(|state| {
                // A solo member has the device to itself anyway.
                (state.solo == Some(id) || state.open()).then(|| {
                    state.members.insert(id, Standing::Sharing);
                })
            })
            .await;
        self.clock.lock().times.waited += asked.elapsed();
    }

    /// Whether a pause point should pause: someone runs alone or waits to.
    pub fn must_pause(&self) -> bool {
        let state = self.gate.state.lock().expect("gate lock is never poisoned");
        state.alone.is_some() || !state.queue.is_empty()
    }

    /// Goes idle (a trusted member only; `false` otherwise): host work only until it shares again.
    pub fn idle(&self) -> bool {
        if !self.trusted {
            return false;
        }
        self.stand(Standing::Idle);
        true
    }

    /// Leaves running alone or waiting to, standing as `standing`.
    fn stand(&self, standing: Standing) {
        let id = self.id;
        self.clock.end_alone();
        self.gate.update(|state| {
            if state.alone == Some(id) {
                state.alone = None;
            }
            state.queue.retain(|&m| m != id);
            state.members.insert(id, standing);
        });
    }

    /// This member's clock, readable after the member is gone.
    pub fn clock(&self) -> MemberClock {
        self.clock.clone()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        let id = self.id;
        self.clock.end_alone();
        self.gate.update(|state| {
            state.members.remove(&id);
            state.queue.retain(|&m| m != id);
            if state.alone == Some(id) {
                state.alone = None;
            }
            if state.solo == Some(id) {
                state.solo = None;
            }
        });
    }
}

/// `kforge-device-probe` next to the running executable, else on PATH.
fn find_probe() -> Result<PathBuf, String> {
    let beside = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join(PROBE_PROGRAM)));
    beside
        .filter(|p| p.is_file())
        .or_else(|| crate::python::resolve_on_path(Path::new(PROBE_PROGRAM)))
        .ok_or_else(|| format!("{PROBE_PROGRAM} is neither next to this executable nor on PATH"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> EvaluatorMetrics {
        EvaluatorMetrics::register(&mut prometheus_client::registry::Registry::default())
    }

    /// A probe script that fails while `broken` exists and counts its runs in `runs`.
    fn fake_probe(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("probe.sh");
        let text = format!(
            "#!/bin/sh\necho run >> {runs}\nif [ -e {broken} ]; then echo '{{\"ok\":false,\"error\":\"context: unknown error\"}}'; exit 1; fi\necho '{{\"ok\":true}}'\n",
            runs = dir.join("runs").display(),
            broken = dir.join("broken").display(),
        );
        std::fs::write(&script, text).expect("probe script");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        script
    }

    fn test_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kforge-devices-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("test dir");
        dir
    }

    fn lanes(dir: &Path, gpus: usize, retry_secs: u64) -> Arc<Lanes> {
        slotted_lanes(dir, gpus, 1, retry_secs)
    }

    fn slotted_lanes(dir: &Path, gpus: usize, slots: usize, retry_secs: u64) -> Arc<Lanes> {
        let config = DeviceProbeConfig { command: Some(fake_probe(dir)), timeout_secs: 5, retry_secs };
        Lanes::new(gpus, slots, config, metrics())
    }

    /// Whether `future` is still waiting after other tasks had a chance to run.
    async fn waits<T>(future: &mut tokio::task::JoinHandle<T>) -> bool {
        tokio::time::sleep(Duration::from_millis(30)).await;
        !future.is_finished()
    }

    /// Waits for readiness to come back: the next periodic probe passed.
    async fn recovered(lanes: &Lanes) {
        let mut readiness = lanes.readiness();
        tokio::time::timeout(Duration::from_secs(10), readiness.wait_for(|ready| *ready))
            .await
            .expect("recovered within the retry interval")
            .expect("sender alive");
    }

    async fn done<T>(future: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(5), future).await.expect("in time").expect("task")
    }

    #[tokio::test]
    async fn timed_work_runs_alone_and_in_turn() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = Arc::new(gate.join(false).await);
        assert_eq!(gate.members(), 2, "members share the device");

        // A asks to run alone: it waits while B may be using the device.
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await, "B is still sharing");
        // A newcomer waits too: it must not start work under A's timing.
        let mut c_joins = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(false).await }
        });
        assert!(waits(&mut c_joins).await);
        // B reaches its own pause point: A goes first, B after it.
        let mut b_alone = tokio::spawn({
            let b = b.clone();
            async move { b.alone().await }
        });
        done(a_alone).await;
        assert!(waits(&mut b_alone).await, "one alone at a time");
        let mut a_shares = tokio::spawn({
            let a = a.clone();
            async move { a.share().await }
        });
        done(b_alone).await;
        assert!(waits(&mut a_shares).await, "nobody resumes while B runs alone");
        assert!(waits(&mut c_joins).await);
        b.share().await;
        done(a_shares).await;
        let c = done(c_joins).await;
        assert_eq!(gate.members(), 3);
        drop(c);
    }

    #[tokio::test]
    async fn a_member_that_leaves_lets_the_others_through() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = gate.join(false).await;
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await);
        drop(b); // its process ended, however it ended
        done(a_alone).await;
        // A member that ends while running alone reopens the device.
        drop(a);
        let newcomer = tokio::time::timeout(Duration::from_secs(5), gate.join(false)).await;
        assert!(newcomer.is_ok(), "the device is open again");
    }

    #[tokio::test]
    async fn idle_members_hold_nobody_up_and_pause_points_pause_only_for_timed_work() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let checker = gate.join_idle();
        assert!(!a.must_pause(), "nobody runs alone or waits to");
        // An idle member does not hold up timed work, and joins at once even while it runs.
        tokio::time::timeout(Duration::from_secs(5), a.alone()).await.expect("the idle checker holds nobody up");
        let late = gate.join_idle();
        assert_eq!(gate.members(), 3);
        // Sharing from idle waits while timed work runs.
        let mut checker_shares = tokio::spawn(async move {
            checker.share().await;
            checker
        });
        assert!(waits(&mut checker_shares).await, "timed work runs");
        let b = Arc::new(gate.join_idle());
        assert!(b.idle(), "a trusted member goes idle");
        a.share().await;
        let checker = done(checker_shares).await;

        // A sharing member at a pause point pauses only while someone asks to run alone.
        let mut a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        assert!(waits(&mut a_alone).await, "the checker shares the device");
        assert!(checker.must_pause(), "someone waits to run alone");
        let mut checker_pauses = tokio::spawn(async move {
            checker.share().await;
            checker
        });
        done(a_alone).await;
        assert!(waits(&mut checker_pauses).await, "paused while A runs alone");
        a.share().await;
        let checker = done(checker_pauses).await;
        assert!(!checker.must_pause());
        drop((late, b, checker));

        // An untrusted member cannot go idle: only stages that run no candidate code may.
        assert!(!a.idle());
    }

    #[tokio::test]
    async fn the_gate_accounts_for_time_alone_draining_and_shared() {
        let gate = Arc::new(Gate::default());
        let a = Arc::new(gate.join(false).await);
        let b = gate.join(false).await;
        let step = Duration::from_millis(60);
        tokio::time::sleep(step).await; // shared
        let a_alone = tokio::spawn({
            let a = a.clone();
            async move { a.alone().await }
        });
        tokio::time::sleep(step).await; // draining: B has not paused
        let b = Arc::new(b);
        let b_alone = tokio::spawn({
            let b = b.clone();
            async move { b.alone().await } // B pauses, queued behind A
        });
        done(a_alone).await;
        tokio::time::sleep(step).await; // A alone
        let a_shares = tokio::spawn({
            let a = a.clone();
            async move { a.share().await }
        });
        done(b_alone).await; // B's turn
        b.share().await;
        done(a_shares).await;
        let times = a.clock().times();
        drop((a, b));
        let account = gate.account();
        for (what, spent) in [("shared", account.shared), ("draining", account.draining), ("alone", account.alone)] {
            assert!(spent >= step, "{what}: {spent:?} < {step:?} ({account:?})");
        }
        assert!(account.alone < 4 * step && account.draining < 4 * step, "{account:?}");
        assert!(times.alone >= step && times.alone < account.alone + Duration::from_millis(1), "{times:?}");
        assert!(times.waited >= step, "A waited for B to pause: {times:?}");
    }

    #[tokio::test]
    async fn a_solo_member_has_the_device_to_itself() {
        let gate = Arc::new(Gate::default());
        let a = gate.join(false).await;
        let mut solo = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(true).await }
        });
        assert!(waits(&mut solo).await, "a solo member waits for an empty device");
        drop(a);
        let solo = done(solo).await;
        // Its own requests are granted at once; nobody else joins while it is there.
        solo.alone().await;
        solo.share().await;
        let mut other = tokio::spawn({
            let gate = gate.clone();
            async move { gate.join(false).await }
        });
        assert!(waits(&mut other).await);
        drop(solo);
        done(other).await;
    }

    #[tokio::test]
    async fn gpu_slots_are_shared_and_a_quarantine_takes_them_all() {
        let dir = test_dir("slots");
        let lanes = slotted_lanes(&dir, 1, 2, 1);
        let first = lanes.acquire(true, 0, "", None).await.expect("a slot");
        let second = lanes.acquire(true, 0, "", None).await.expect("a second slot on the same GPU");
        assert_eq!((first.gpu(), second.gpu()), (Some(0), Some(0)));
        assert!(first.shared() && !lanes.acquire(false, 0, "", None).await.expect("the CPU").shared());
        std::fs::write(dir.join("broken"), "").expect("marker");
        let mut third = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "", None).await.map(|lane| lane.gpu()) }
        });
        assert!(waits(&mut third).await, "both slots are taken");
        assert!(!lanes.after_fault(&first, "an illegal address").await);
        assert!(!lanes.after_fault(&second, "an illegal address").await, "the second fault finds it quarantined");
        assert!(done(third).await.is_err(), "no healthy GPU is left for the waiter");
        drop((first, second));
        assert!(lanes.acquire(true, 0, "", None).await.is_err(), "slots in use when it went do not come back");

        std::fs::remove_file(dir.join("broken")).expect("marker");
        recovered(&lanes).await;
        let back = [
            lanes.acquire(true, 0, "", None).await.expect("slot"),
            lanes.acquire(true, 0, "", None).await.expect("slot"),
        ];
        let mut more = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "", None).await.map(|lane| lane.gpu()) }
        });
        assert!(waits(&mut more).await, "exactly its two slots came back");
        drop(back);
        assert_eq!(done(more).await, Ok(Some(0)));
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs")).map(|t| t.lines().count()).unwrap_or(0)
    }

    #[test]
    fn device_faults_are_told_from_candidate_errors() {
        assert!(fault(Exit::TimedOut, "").is_some());
        assert!(fault(Exit::Signal(11), "").is_some());
        assert!(fault(Exit::Code(1), "RuntimeError: CUDA error: an illegal memory access was encountered").is_some());
        assert!(fault(Exit::Code(1), "triton: CUDA_ERROR_LAUNCH_FAILED").is_some());
        assert!(fault(Exit::Code(1), "torch.OutOfMemoryError: CUDA out of memory.").is_none());
        assert!(fault(Exit::Code(1), "ValueError: shapes do not match").is_none());
        assert!(fault(Exit::Cancelled, "illegal memory access").is_none());
    }

    #[tokio::test]
    async fn a_healthy_device_stays_in_service() {
        let dir = test_dir("healthy");
        let lanes = lanes(&dir, 1, 60);
        let lane = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        assert!(lanes.after_fault(&lane, "an illegal address").await);
        drop(lane);
        assert_eq!(runs(&dir), 1);
        assert!(*lanes.readiness().borrow());
        assert_eq!(lanes.acquire(true, 0, "", None).await.expect("the lane again").gpu(), Some(0));
    }

    #[tokio::test]
    async fn a_failing_device_is_quarantined_waiters_are_released_and_it_recovers() {
        let dir = test_dir("quarantine");
        std::fs::write(dir.join("broken"), "").expect("marker");
        let lanes = lanes(&dir, 1, 1);
        let lane = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        // Queued behind the faulting evaluation.
        let waiter = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "", None).await.map(|lane| lane.gpu()) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "the lane is held");
        assert!(!lanes.after_fault(&lane, "an illegal address").await);
        drop(lane);
        let error = waiter.await.expect("task").expect_err("no healthy GPU left");
        assert!(error.contains("quarantined") && error.contains("context: unknown error"), "{error}");
        assert!(!*lanes.readiness().borrow(), "readiness follows the quarantine");
        assert!(lanes.acquire(true, 0, "", None).await.is_err(), "new work is refused while quarantined");
        assert!(lanes.acquire(false, 0, "", None).await.is_ok(), "the CPU lane is unaffected");

        // The device heals: the next periodic probe passes and the lane returns.
        std::fs::remove_file(dir.join("broken")).expect("marker");
        recovered(&lanes).await;
        assert_eq!(lanes.quarantine_reason(0), None);
        let lane = lanes.acquire(true, 0, "", None).await.expect("the lane is back");
        assert_eq!(lane.gpu(), Some(0));
        assert!(runs(&dir) >= 2, "probed at the fault and again to recover");
    }

    #[tokio::test]
    async fn one_quarantined_gpu_leaves_the_others_serving() {
        let dir = test_dir("two");
        std::fs::write(dir.join("broken"), "").expect("marker");
        let lanes = lanes(&dir, 2, 3600);
        let first = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        let bad = first.gpu().expect("a GPU");
        assert!(!lanes.after_fault(&first, "a launch failure").await);
        drop(first);
        assert!(*lanes.readiness().borrow(), "one healthy GPU keeps the service ready");
        for _ in 0..3 {
            let lane = lanes.acquire(true, 0, "", None).await.expect("the healthy GPU");
            assert_ne!(lane.gpu(), Some(bad), "the quarantined GPU is out of the pool");
        }
    }

    #[tokio::test]
    async fn a_probe_that_hangs_fails() {
        use std::os::unix::fs::PermissionsExt;
        let dir = test_dir("hang");
        let script = dir.join("hang.sh");
        std::fs::write(&script, "#!/bin/sh\nsleep 30\n").expect("script");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let config = DeviceProbeConfig { command: Some(script), timeout_secs: 1, retry_secs: 3600 };
        let lanes = Lanes::new(1, 1, config, metrics());
        let lane = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        assert!(!lanes.after_fault(&lane, "a kernel that never ended").await);
        let reason = lanes.quarantine_reason(0).expect("quarantined");
        assert!(reason.contains("did not finish within 1 s"), "{reason}");
    }

    /// Queues labelled waiters one after another (each registered before the next arrives), then frees the lane
    /// and returns the order in which they got it.
    async fn service_order(lanes: &Arc<Lanes>, waiters: &[(&'static str, i32, &'static str)]) -> Vec<&'static str> {
        let held = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for &(label, priority, job) in waiters {
            let (lanes, order) = (lanes.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let lane = lanes.acquire(true, priority, job, None).await.expect("a lane in turn");
                order.lock().expect("order").push(label);
                drop(lane);
            }));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(held);
        for task in tasks {
            task.await.expect("waiter");
        }
        Arc::try_unwrap(order).expect("all done").into_inner().expect("order")
    }

    #[tokio::test]
    async fn waiters_are_served_by_priority_then_in_turns_across_jobs() {
        let lanes = lanes(&test_dir("fair"), 1, 3600);
        let order = service_order(
            &lanes,
            &[("a1", 0, "a"), ("a2", 0, "a"), ("a3", 0, "a"), ("b1", 0, "b"), ("b2", 0, "b"), ("urgent", 5, "c")],
        )
        .await;
        // Job b queued after all of a's evaluations, yet alternates with them; the higher priority goes first.
        assert_eq!(order, ["urgent", "a1", "b1", "a2", "b2", "a3"]);
    }

    #[tokio::test]
    async fn a_cancelled_waiter_does_not_lose_the_lane() {
        let lanes = lanes(&test_dir("cancel"), 1, 3600);
        let held = lanes.acquire(true, 0, "", None).await.expect("a GPU lane");
        let cancelled = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "gone", None).await.map(|lane| lane.gpu()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancelled.abort();
        let _ = cancelled.await;
        drop(held);
        let lane = tokio::time::timeout(Duration::from_secs(5), lanes.acquire(true, 0, "next", None)).await;
        assert_eq!(lane.expect("the lane came back").expect("a lane").gpu(), Some(0));
    }

    // Memory-aware admission. The pool is driven step by step: a waiter's channel says whether it was served, and
    // `acquire`'s future is polled by hand, so nothing depends on timing.

    const GIB: u64 = 1 << 30;

    /// A pool of `devices` GPUs with a budget of `budget_gib` GiB each and `slots` slots each.
    fn memory_pool(devices: usize, budget_gib: u64, slots: usize) -> Pool {
        Pool::new(vec![Some(budget_gib * GIB); devices], slots, Vec::new())
    }

    fn served(receiver: &mut oneshot::Receiver<Grant>) -> Option<Grant> {
        receiver.try_recv().ok()
    }

    /// Lanes of GPUs with these budgets in GiB, 4 slots each; no device is ever probed.
    fn memory_lanes(budgets_gib: &[u64]) -> Arc<Lanes> {
        let config = DeviceProbeConfig { command: Some("/nonexistent/probe".into()), ..DeviceProbeConfig::default() };
        Lanes::with_budgets(budgets_gib.iter().map(|gib| Some(gib * GIB)).collect(), 4, config, metrics())
    }

    fn poll_now<F: std::future::Future>(future: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
        future.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    }

    /// `acquire` when it completes at once (a lane or an error); panics if it would wait.
    fn acquire_now(lanes: &Arc<Lanes>, gpu: bool, footprint: Option<u64>) -> Result<Lane, String> {
        match poll_now(std::pin::pin!(lanes.acquire(gpu, 0, "", footprint))) {
            std::task::Poll::Ready(lane) => lane,
            std::task::Poll::Pending => panic!("acquire waits"),
        }
    }

    #[test]
    fn footprints_are_twice_the_reference_peak_and_a_gigabyte() {
        assert_eq!(footprint(0), GIB);
        assert_eq!(footprint(3 * GIB), 7 * GIB);
        assert_eq!(footprint(u64::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn a_footprint_is_admitted_only_where_it_fits_and_unknown_ones_by_slots() {
        let mut pool = memory_pool(1, 10, 4);
        let first = pool.take(Some(6 * GIB)).expect("fits an empty device");
        assert_eq!((first.index, first.bytes), (0, 6 * GIB));
        assert_eq!(pool.take(Some(5 * GIB)), None, "6 + 5 GiB is over the 10 GiB budget, with slots free");
        let second = pool.take(Some(4 * GIB)).expect("6 + 4 GiB fits");
        assert_eq!(pool.reserved, [10 * GIB]);
        let unknown = pool.take(None).expect("an unknown footprint needs only a slot");
        assert_eq!(unknown.bytes, 0);
        assert_eq!(pool.reserved, [10 * GIB]);
        assert!(pool.take(None).is_some(), "the last slot");
        assert_eq!(pool.take(None), None, "no slot left");
        pool.release(first);
        assert_eq!(pool.reserved, [4 * GIB]);
        assert!(pool.take(Some(6 * GIB)).is_some(), "fits again once released");
        pool.release(second);
        pool.release(unknown);
        assert_eq!(pool.reserved, [6 * GIB]);
    }

    #[test]
    fn a_footprint_goes_to_a_gpu_where_it_fits() {
        let mut pool = memory_pool(2, 10, 4);
        let a = pool.take(Some(6 * GIB)).expect("a GPU");
        let b = pool.take(Some(6 * GIB)).expect("the other GPU");
        assert_ne!(a.index, b.index, "6 + 6 GiB does not fit on one");
        assert_eq!(pool.take(Some(6 * GIB)), None);
        let small = pool.take(Some(4 * GIB)).expect("4 GiB fits beside either");
        assert_eq!(pool.reserved.iter().sum::<u64>(), 16 * GIB);
        assert!([a.index, b.index].contains(&small.index));
    }

    #[test]
    fn the_first_waiter_waits_for_memory_holds_those_behind_it_and_is_served_on_release() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(6 * GIB)).expect("fits");
        let (_, mut large) = pool.enqueue(0, "a", Some(6 * GIB));
        pool.serve();
        assert_eq!(served(&mut large), None, "6 + 6 GiB does not fit");
        let (_, mut small) = pool.enqueue(0, "b", Some(GIB));
        pool.serve();
        assert_eq!(served(&mut small), None, "it would fit, but waits behind the first waiter (head-of-line)");
        pool.release(held);
        let large = served(&mut large).expect("served once the memory was released");
        let small = served(&mut small).expect("and the one behind it, which fits beside it");
        assert_eq!((large.bytes, small.bytes), (6 * GIB, GIB));
        assert_eq!(pool.reserved, [7 * GIB]);
        assert!(pool.waiters.is_empty());
    }

    #[test]
    fn a_footprint_over_the_budget_runs_without_other_reservations_rather_than_never() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(3 * GIB)).expect("fits");
        let (_, mut huge) = pool.enqueue(0, "", Some(20 * GIB));
        pool.serve();
        assert_eq!(served(&mut huge), None, "it waits for the device's reservations to end");
        pool.release(held);
        let huge = served(&mut huge).expect("nothing reserved: admitted although over the budget");
        assert_eq!(pool.reserved, [20 * GIB]);
        assert_eq!(pool.take(Some(GIB)), None, "nothing with a known footprint joins it");
        assert!(pool.take(None).is_some(), "an unknown footprint is admitted by slots (the OOM retry covers it)");
        pool.release(huge);
        assert_eq!(pool.reserved, [0]);
    }

    #[test]
    fn memory_waits_keep_priority_then_turns_across_jobs() {
        let mut pool = memory_pool(1, 10, 4);
        let held = pool.take(Some(6 * GIB)).expect("fits");
        // Each needs 6 GiB: one at a time.
        let (_, mut a1) = pool.enqueue(0, "a", Some(6 * GIB));
        let (_, mut a2) = pool.enqueue(0, "a", Some(6 * GIB));
        let (_, mut b1) = pool.enqueue(0, "b", Some(6 * GIB));
        let (_, mut urgent) = pool.enqueue(5, "c", Some(6 * GIB));
        pool.serve();
        let mut order = Vec::new();
        let mut grant = held;
        for _ in 0..4 {
            pool.release(grant);
            let next = [("a1", &mut a1), ("a2", &mut a2), ("b1", &mut b1), ("urgent", &mut urgent)]
                .into_iter()
                .filter_map(|(label, receiver)| served(receiver).map(|grant| (label, grant)))
                .collect::<Vec<_>>();
            assert_eq!(next.len(), 1, "one at a time: {next:?}");
            order.push(next[0].0);
            grant = next[0].1;
        }
        assert_eq!(order, ["urgent", "a1", "b1", "a2"]);
    }

    #[test]
    fn a_cancelled_waiter_lets_those_behind_it_through_and_returns_a_slot_handed_to_it() {
        let lanes = memory_lanes(&[10]);
        let held = acquire_now(&lanes, true, Some(6 * GIB)).expect("fits");
        let mut large = Box::pin(lanes.acquire(true, 0, "a", Some(6 * GIB)));
        assert!(poll_now(large.as_mut()).is_pending(), "6 + 6 GiB does not fit");
        let mut small = Box::pin(lanes.acquire(true, 0, "b", Some(GIB)));
        assert!(poll_now(small.as_mut()).is_pending(), "behind the first waiter");
        drop(large); // cancelled while first in line
        let std::task::Poll::Ready(Ok(small)) = poll_now(small.as_mut()) else { panic!("served once it left") };
        assert_eq!(small.reserved_bytes(), GIB);
        assert_eq!(lanes.gpu_reserved_bytes(), [7 * GIB]);

        // A slot handed to a waiter that is cancelled before it takes it goes back, with its bytes.
        let mut late = Box::pin(lanes.acquire(true, 0, "c", Some(6 * GIB)));
        assert!(poll_now(late.as_mut()).is_pending());
        drop(held);
        assert_eq!(lanes.gpu_reserved_bytes(), [7 * GIB], "handed to the waiter");
        drop(late);
        assert_eq!(lanes.gpu_reserved_bytes(), [GIB], "given back");
        drop(small);
        assert_eq!(lanes.gpu_reserved_bytes(), [0]);
        let lanes_held: Vec<Lane> = (0..4).map(|_| acquire_now(&lanes, true, Some(GIB)).expect("every slot")).collect();
        assert_eq!(lanes.gpu_reserved_bytes(), [4 * GIB]);
        drop(lanes_held);
        assert_eq!(lanes.gpu_reserved_bytes(), [0]);
    }

    #[test]
    fn a_quarantine_drops_the_reservations_of_its_gpu_and_a_recovery_starts_from_nothing() {
        let lanes = memory_lanes(&[10]);
        let held = acquire_now(&lanes, true, Some(6 * GIB)).expect("fits");
        let mut waiting = Box::pin(lanes.acquire(true, 0, "", Some(6 * GIB)));
        assert!(poll_now(waiting.as_mut()).is_pending());
        assert!(lanes.set_quarantine(0, Some("failed its probe".into())));
        assert_eq!(lanes.gpu_reserved_bytes(), [0]);
        assert!(matches!(poll_now(waiting.as_mut()), std::task::Poll::Ready(Err(_))), "no GPU left for the waiter");
        drop(held);
        assert_eq!(lanes.gpu_reserved_bytes(), [0], "a slot taken before the quarantine gives nothing back");
        assert!(lanes.set_quarantine(0, None));
        let again = acquire_now(&lanes, true, Some(6 * GIB)).expect("back in service, nothing reserved");
        assert_eq!(lanes.gpu_reserved_bytes(), [6 * GIB]);
        drop(again);
        assert_eq!(lanes.gpu_reserved_bytes(), [0]);
    }

    #[test]
    fn the_cpu_lane_ignores_footprints_and_gpus_without_a_budget_count_slots_only() {
        let lanes = memory_lanes(&[10]);
        let cpu = acquire_now(&lanes, false, Some(u64::MAX)).expect("the CPU lane");
        assert_eq!((cpu.gpu(), cpu.reserved_bytes()), (None, 0));
        assert_eq!(lanes.gpu_reserved_bytes(), [0]);

        let unbudgeted = Lanes::new(1, 2, DeviceProbeConfig::default(), metrics());
        let a = acquire_now(&unbudgeted, true, Some(100 * GIB)).expect("a slot");
        let b = acquire_now(&unbudgeted, true, Some(100 * GIB)).expect("the other slot");
        assert_eq!((a.reserved_bytes(), b.reserved_bytes()), (0, 0));
    }

    #[test]
    fn reserved_bytes_are_a_metric_per_gpu() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = EvaluatorMetrics::register(&mut registry);
        let config = DeviceProbeConfig { command: Some("/nonexistent/probe".into()), ..DeviceProbeConfig::default() };
        let lanes = Lanes::with_budgets(vec![Some(10 * GIB), Some(10 * GIB)], 2, config, metrics);
        let _lane = acquire_now(&lanes, true, Some(3 * GIB)).expect("fits");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        let line = |gpu: usize, bytes: u64| format!("kforge_evaluator_gpu_reserved_bytes{{gpu=\"{gpu}\"}} {bytes}");
        assert!(text.contains(&line(0, 3 * GIB)) && text.contains(&line(1, 0)), "{text}");
    }
}
