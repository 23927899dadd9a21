//! Device lanes and device health.
//!
//! Every device is an exclusive lane: the CPU, and each GPU. A GPU lane is taken from a pool (any free healthy
//! GPU), so several GPUs serve one queue. Waiting evaluations are served by priority (higher first) and, within a
//! priority, in turns across jobs (`job_id`): a job that queued a hundred evaluations does not make a job that
//! queued one wait for all of them.
//!
//! After a CUDA-level fault on a GPU (an illegal address, a launch failure, a kernel killed at its time limit, a
//! crash) the device is probed before anything else runs on it: `kforge-device-probe`, a short-lived process that
//! creates a context, runs a tiny kernel and checks its result, under a timeout. A device that fails is
//! quarantined: its lane leaves the pool, evaluations waiting for a GPU get a retryable `VERDICT_INFRA_ERROR`
//! once no healthy GPU is left, readiness goes NOT_SERVING, and the probe runs again every `retry_secs` until it
//! passes, which puts the lane back.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_sandbox::Exit;
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
    /// Per GPU: why it is quarantined.
    quarantined: Mutex<Vec<Option<String>>>,
    /// Whether any GPU is healthy (always true without GPUs): the service's readiness.
    ready: watch::Sender<bool>,
    probe: Result<PathBuf, String>,
    config: DeviceProbeConfig,
    metrics: EvaluatorMetrics,
}

/// Where a waiter stands: priority (higher first), its job's turn, arrival.
type Turn = (Reverse<i32>, u64, u64);

/// Lanes of one kind and the evaluations waiting for them.
#[derive(Debug, Default)]
struct Pool {
    /// Lanes in service and not in use.
    free: Vec<usize>,
    /// Lanes in service (not quarantined).
    in_service: usize,
    waiters: BTreeMap<Turn, oneshot::Sender<usize>>,
    /// Per job: the turn its next waiter gets.
    next_turn: HashMap<String, u64>,
    /// The turn of the waiter served last; a job that starts waiting starts here.
    serving: u64,
    arrivals: u64,
}

impl Pool {
    fn new(lanes: usize) -> Self {
        Self { free: (0..lanes).rev().collect(), in_service: lanes, ..Self::default() }
    }

    /// Hands `lane` to the first waiter still waiting, or puts it back in the free list.
    fn release(&mut self, lane: usize) {
        let mut lane = lane;
        while let Some(((_, turn, _), waiter)) = self.waiters.pop_first() {
            self.serving = self.serving.max(turn);
            match waiter.send(lane) {
                Ok(()) => return,
                Err(unsent) => lane = unsent,
            }
        }
        self.free.push(lane);
    }
}

/// An exclusive hold on one device; released on drop, unless the device was quarantined meanwhile.
#[derive(Debug)]
pub struct Lane {
    lanes: Arc<Lanes>,
    /// A GPU lane (else the CPU's).
    is_gpu: bool,
    /// The lane's index in its pool: the GPU index for a GPU lane.
    index: usize,
    quarantined: AtomicBool,
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
}

impl Drop for Lane {
    fn drop(&mut self) {
        // A quarantined lane stays out of its pool until a probe passes (see `Lanes::recover`).
        if !self.quarantined.load(Ordering::SeqCst) {
            self.lanes.pool(self.is_gpu).release(self.index);
        }
    }
}

/// A place in a pool's queue; if dropped (the evaluation was cancelled) after a lane was handed to it but before it
/// was taken, the lane goes back.
struct Waiting<'a> {
    lanes: &'a Lanes,
    gpu: bool,
    receiver: Option<oneshot::Receiver<usize>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(mut receiver) = self.receiver.take() {
            receiver.close();
            if let Ok(lane) = receiver.try_recv() {
                self.lanes.pool(self.gpu).release(lane);
            }
        }
    }
}

impl Lanes {
    pub fn new(gpus: usize, config: DeviceProbeConfig, metrics: EvaluatorMetrics) -> Arc<Self> {
        let probe = match &config.command {
            Some(command) => Ok(command.clone()),
            None => find_probe(),
        };
        if gpus > 0
            && let Err(reason) = &probe
        {
            tracing::warn!(%reason, "GPU faults will not be followed by a device health probe");
        }
        Arc::new(Self {
            cpu: Mutex::new(Pool::new(1)),
            gpus: Mutex::new(Pool::new(gpus)),
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

    /// Why GPU `gpu` is quarantined, if it is.
    pub fn quarantine_reason(&self, gpu: usize) -> Option<String> {
        self.quarantined.lock().expect("lane lock is never poisoned").get(gpu).cloned().flatten()
    }

    /// The CPU lane, or a free healthy GPU, waiting for one in turn (`priority`, then turns across `job`s); an
    /// error when every GPU is quarantined (also for those already waiting when the last one goes).
    pub async fn acquire(self: &Arc<Self>, gpu: bool, priority: i32, job: &str) -> Result<Lane, String> {
        let lane = |index| Lane { lanes: self.clone(), is_gpu: gpu, index, quarantined: false.into() };
        let receiver = {
            let mut pool = self.pool(gpu);
            if pool.in_service == 0 {
                drop(pool);
                return Err(self.unavailable());
            }
            if pool.waiters.is_empty()
                && let Some(index) = pool.free.pop()
            {
                return Ok(lane(index));
            }
            let turn = pool.serving.max(pool.next_turn.get(job).copied().unwrap_or(0));
            pool.next_turn.insert(job.to_owned(), turn + 1);
            let arrival = pool.arrivals;
            pool.arrivals += 1;
            let (sender, receiver) = oneshot::channel();
            pool.waiters.insert((Reverse(priority), turn, arrival), sender);
            receiver
        };
        let mut waiting = Waiting { lanes: self, gpu, receiver: Some(receiver) };
        let delivered = waiting.receiver.as_mut().expect("set above").await;
        waiting.receiver = None;
        match delivered {
            Ok(index) => Ok(lane(index)),
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
    /// the device is healthy. Called with the lane held, so nothing else runs on the device meanwhile.
    pub async fn after_fault(self: &Arc<Self>, lane: &Lane, fault: &str) -> bool {
        let Some(gpu) = lane.gpu() else { return true };
        let Ok(program) = &self.probe else { return true };
        tracing::info!(gpu, fault, "probing the device after a fault");
        match self.probe(program, gpu).await {
            Ok(()) => true,
            Err(reason) => {
                tracing::error!(gpu, %reason, fault, "device failed its health probe; quarantined");
                lane.quarantined.store(true, Ordering::SeqCst);
                self.set_quarantine(gpu, Some(format!("failed its health probe after {fault}: {reason}")));
                let lanes = self.clone();
                tokio::spawn(async move { lanes.recover(gpu).await });
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

    /// Takes GPU `gpu` out of service (`Some(reason)`; its lane is held by the caller and not released) or puts
    /// it back (`None`).
    fn set_quarantine(&self, gpu: usize, reason: Option<String>) {
        let back = reason.is_none();
        let count = {
            let mut quarantined = self.quarantined.lock().expect("lane lock is never poisoned");
            quarantined[gpu] = reason;
            quarantined.iter().filter(|q| q.is_some()).count()
        };
        let mut pool = self.pool(true);
        if back {
            pool.in_service += 1;
            pool.release(gpu);
        } else {
            pool.in_service -= 1;
            if pool.in_service == 0 {
                // Nothing will serve them: every waiter gets its error now.
                pool.waiters.clear();
            }
        }
        let in_service = pool.in_service;
        drop(pool);
        self.metrics.devices_quarantined(count);
        self.ready.send_replace(in_service > 0);
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
        let config = DeviceProbeConfig { command: Some(fake_probe(dir)), timeout_secs: 5, retry_secs };
        Lanes::new(gpus, config, metrics())
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
        let lane = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        assert!(lanes.after_fault(&lane, "an illegal address").await);
        drop(lane);
        assert_eq!(runs(&dir), 1);
        assert!(*lanes.readiness().borrow());
        assert_eq!(lanes.acquire(true, 0, "").await.expect("the lane again").gpu(), Some(0));
    }

    #[tokio::test]
    async fn a_failing_device_is_quarantined_waiters_are_released_and_it_recovers() {
        let dir = test_dir("quarantine");
        std::fs::write(dir.join("broken"), "").expect("marker");
        let lanes = lanes(&dir, 1, 1);
        let lane = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        // Queued behind the faulting evaluation.
        let waiter = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "").await.map(|lane| lane.gpu()) }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "the lane is held");
        assert!(!lanes.after_fault(&lane, "an illegal address").await);
        drop(lane);
        let error = waiter.await.expect("task").expect_err("no healthy GPU left");
        assert!(error.contains("quarantined") && error.contains("context: unknown error"), "{error}");
        assert!(!*lanes.readiness().borrow(), "readiness follows the quarantine");
        assert!(lanes.acquire(true, 0, "").await.is_err(), "new work is refused while quarantined");
        assert!(lanes.acquire(false, 0, "").await.is_ok(), "the CPU lane is unaffected");

        // The device heals: the next periodic probe passes and the lane returns.
        std::fs::remove_file(dir.join("broken")).expect("marker");
        let mut readiness = lanes.readiness();
        tokio::time::timeout(Duration::from_secs(10), readiness.wait_for(|ready| *ready))
            .await
            .expect("recovered within the retry interval")
            .expect("sender alive");
        assert_eq!(lanes.quarantine_reason(0), None);
        let lane = lanes.acquire(true, 0, "").await.expect("the lane is back");
        assert_eq!(lane.gpu(), Some(0));
        assert!(runs(&dir) >= 2, "probed at the fault and again to recover");
    }

    #[tokio::test]
    async fn one_quarantined_gpu_leaves_the_others_serving() {
        let dir = test_dir("two");
        std::fs::write(dir.join("broken"), "").expect("marker");
        let lanes = lanes(&dir, 2, 3600);
        let first = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        let bad = first.gpu().expect("a GPU");
        assert!(!lanes.after_fault(&first, "a launch failure").await);
        drop(first);
        assert!(*lanes.readiness().borrow(), "one healthy GPU keeps the service ready");
        for _ in 0..3 {
            let lane = lanes.acquire(true, 0, "").await.expect("the healthy GPU");
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
        let lanes = Lanes::new(1, config, metrics());
        let lane = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        assert!(!lanes.after_fault(&lane, "a kernel that never ended").await);
        let reason = lanes.quarantine_reason(0).expect("quarantined");
        assert!(reason.contains("did not finish within 1 s"), "{reason}");
    }

    /// Queues labelled waiters one after another (each registered before the next arrives), then frees the lane
    /// and returns the order in which they got it.
    async fn service_order(lanes: &Arc<Lanes>, waiters: &[(&'static str, i32, &'static str)]) -> Vec<&'static str> {
        let held = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for &(label, priority, job) in waiters {
            let (lanes, order) = (lanes.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let lane = lanes.acquire(true, priority, job).await.expect("a lane in turn");
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
        let held = lanes.acquire(true, 0, "").await.expect("a GPU lane");
        let cancelled = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "gone").await.map(|lane| lane.gpu()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancelled.abort();
        let _ = cancelled.await;
        drop(held);
        let lane = tokio::time::timeout(Duration::from_secs(5), lanes.acquire(true, 0, "next")).await;
        assert_eq!(lane.expect("the lane came back").expect("a lane").gpu(), Some(0));
    }
}
