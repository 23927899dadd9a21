//! Device lanes: a lane is a slot on one device, the CPU's one or one of each GPU's `gpu_slots`, taken from a pool
//! (`super::admission`: any free slot of a healthy GPU where the evaluation fits), so several GPUs serve one queue.
//! Each device has a [`Gate`] through which the evaluations holding its slots share it.
//!
//! A GPU that fails its health probe after a fault (`super::health`) is quarantined: its lane leaves the pool,
//! evaluations waiting for a GPU get a retryable `VERDICT_INFRA_ERROR` once no healthy GPU is left, readiness goes
//! NOT_SERVING, and the probe runs again every `retry_secs` until it passes, which puts the lane back.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use super::admission::{Grant, Pool, Turn};
use super::gate::{Gate, GateAccount, MemberTimes};
use super::health::{Probe, ProbeFailed, ProbeMissing};
use crate::config::DeviceProbeConfig;
use crate::metrics::ExecutionMetrics;

/// No GPU lane can be had: every GPU of this evaluator is quarantined (retryable, on another evaluator).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("every GPU of this evaluator is quarantined: {quarantined}; retry on another evaluator")]
pub struct Unavailable {
    /// Each quarantined GPU and why, as `cuda:<index> (<reason>)`.
    pub quarantined: String,
}

/// The device lanes of one engine, and the health of its GPUs.
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
    probe: Probe,
    /// While a GPU is quarantined, it is probed again this often.
    retry: Duration,
    metrics: ExecutionMetrics,
    /// How many lanes outside the slots were handed out: they go to the healthy GPUs in turn.
    outside: std::sync::atomic::AtomicUsize,
}

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
    pub fn new(gpus: usize, slots: usize, config: DeviceProbeConfig, metrics: ExecutionMetrics) -> Arc<Self> {
        Self::with_budgets(vec![None; gpus], slots, config, metrics)
    }

    /// GPUs with these memory budgets in bytes (`None`: admitted by slots alone), `slots` slots each (at least
    /// one), and the CPU's one.
    pub fn with_budgets(
        budgets: Vec<Option<u64>>,
        slots: usize,
        config: DeviceProbeConfig,
        metrics: ExecutionMetrics,
    ) -> Arc<Self> {
        let gpus = budgets.len();
        let slots = slots.max(1);
        let probe = Probe::new(&config);
        if gpus > 0
            && let Err(reason) = probe.program()
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
            retry: Duration::from_secs(config.retry_secs),
            metrics,
            outside: Default::default(),
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
    pub fn probe_program(&self) -> Result<&Path, &ProbeMissing> {
        self.probe.program()
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

    /// A healthy GPU, outside its slots: for work the evaluator does for itself beside the evaluations (a
    /// baseline computed ahead). The healthy GPUs take turns: on the first alone, every baseline's timed work made
    /// GPU 0 run alone 43-44% of the time against 12-24% on the three others (KernelBench sweep on four H200s,
    /// bench/results/evaluator-kernelbench-sweep/2026-11-27b). Its stages share the device through the gate like
    /// any slot's; nothing is reserved, and nothing is released when it is dropped. None without a healthy GPU.
    pub fn outside_slots(self: &Arc<Self>) -> Option<Lane> {
        let healthy: Vec<usize> = (self.quarantined.lock().expect("lane lock is never poisoned").iter().enumerate())
            .filter_map(|(gpu, reason)| reason.is_none().then_some(gpu))
            .collect();
        if healthy.is_empty() {
            return None;
        }
        let turn = self.outside.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(self.lane(true, healthy[turn % healthy.len()], None))
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
    ) -> Result<Lane, Unavailable> {
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

    fn unavailable(&self) -> Unavailable {
        let quarantined = self.quarantined.lock().expect("lane lock is never poisoned");
        let reasons: Vec<String> = quarantined
            .iter()
            .enumerate()
            .filter_map(|(gpu, reason)| reason.as_ref().map(|r| format!("cuda:{gpu} ({r})")))
            .collect();
        Unavailable { quarantined: reasons.join(", ") }
    }

    /// After `fault` on the GPU `lane` holds: probes it, and quarantines it when the probe fails. Returns whether
    /// the device is healthy. Called with the lane held; evaluations sharing the device go on meanwhile (a fault
    /// in one process's context leaves the others' intact), and none joins once it is quarantined.
    pub async fn after_fault(self: &Arc<Self>, lane: &Lane, fault: &str) -> bool {
        let Some(gpu) = lane.gpu() else { return true };
        let Ok(program) = self.probe.program() else { return true };
        tracing::info!(gpu, fault, "probing the device after a fault");
        match self.run_probe(program, gpu).await {
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
        let Ok(program) = self.probe.program() else { return };
        loop {
            tokio::time::sleep(self.retry).await;
            if let Err(reason) = self.run_probe(program, gpu).await {
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
}

impl Lanes {
    /// Runs the health probe on `gpu`, counting its outcome.
    async fn run_probe(&self, program: &Path, gpu: usize) -> Result<(), ProbeFailed> {
        let result = self.probe.run(program, gpu).await;
        self.metrics.device_probe(result.is_ok());
        result
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn metrics() -> ExecutionMetrics {
        ExecutionMetrics::register(&mut prometheus_client::registry::Registry::default())
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

    /// Waits, yielding to the other tasks, until `count` evaluations wait in the GPU pool's queue: a waiter is
    /// known to wait once it stands there.
    async fn queued(lanes: &Lanes, count: usize) {
        for _ in 0..100_000 {
            if lanes.pool(true).waiters.len() == count {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("{count} waiters never queued");
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
        let third = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "", None).await.map(|lane| lane.gpu()) }
        });
        queued(&lanes, 1).await;
        assert!(!third.is_finished(), "both slots are taken");
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
        let more = tokio::spawn({
            let lanes = lanes.clone();
            async move { lanes.acquire(true, 0, "", None).await.map(|lane| lane.gpu()) }
        });
        queued(&lanes, 1).await;
        assert!(!more.is_finished(), "exactly its two slots came back");
        drop(back);
        assert_eq!(done(more).await, Ok(Some(0)));
    }

    fn runs(dir: &Path) -> usize {
        std::fs::read_to_string(dir.join("runs")).map(|t| t.lines().count()).unwrap_or(0)
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
        queued(&lanes, 1).await;
        assert!(!waiter.is_finished(), "the lane is held");
        assert!(!lanes.after_fault(&lane, "an illegal address").await);
        drop(lane);
        let error = waiter.await.expect("task").expect_err("no healthy GPU left").to_string();
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
            let outside = lanes.outside_slots().expect("a healthy GPU");
            assert_ne!(outside.gpu(), Some(bad), "work outside the slots avoids it too");
        }
    }

    #[test]
    fn work_outside_the_slots_goes_to_the_gpus_in_turn() {
        let lanes = memory_lanes(&[80, 80, 80]);
        let gpus: Vec<Option<usize>> = (0..6).map(|_| lanes.outside_slots().expect("healthy GPUs").gpu()).collect();
        assert_eq!(gpus, [0, 1, 2, 0, 1, 2].map(Some));
        assert!(memory_lanes(&[]).outside_slots().is_none(), "no GPU, no lane");
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
        for (queue, &(label, priority, job)) in waiters.iter().enumerate() {
            let (waiter, order) = (lanes.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let lane = waiter.acquire(true, priority, job, None).await.expect("a lane in turn");
                order.lock().expect("order").push(label);
                drop(lane);
            }));
            queued(lanes, queue + 1).await;
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
        queued(&lanes, 1).await;
        cancelled.abort();
        let _ = cancelled.await;
        drop(held);
        let lane = tokio::time::timeout(Duration::from_secs(5), lanes.acquire(true, 0, "next", None)).await;
        assert_eq!(lane.expect("the lane came back").expect("a lane").gpu(), Some(0));
    }

    // Memory-aware admission through the lanes: `acquire`'s future is polled by hand, so nothing depends on timing.

    const GIB: u64 = 1 << 30;

    /// Lanes of GPUs with these budgets in GiB, 4 slots each; no device is ever probed.
    fn memory_lanes(budgets_gib: &[u64]) -> Arc<Lanes> {
        let config = DeviceProbeConfig { command: Some("/nonexistent/probe".into()), ..DeviceProbeConfig::default() };
        Lanes::with_budgets(budgets_gib.iter().map(|gib| Some(gib * GIB)).collect(), 4, config, metrics())
    }

    fn poll_now<F: std::future::Future>(future: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
        future.poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    }

    /// `acquire` when it completes at once (a lane or an error); panics if it would wait.
    fn acquire_now(lanes: &Arc<Lanes>, gpu: bool, footprint: Option<u64>) -> Result<Lane, Unavailable> {
        match poll_now(std::pin::pin!(lanes.acquire(gpu, 0, "", footprint))) {
            std::task::Poll::Ready(lane) => lane,
            std::task::Poll::Pending => panic!("acquire waits"),
        }
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
        let metrics = ExecutionMetrics::register(&mut registry);
        let config = DeviceProbeConfig { command: Some("/nonexistent/probe".into()), ..DeviceProbeConfig::default() };
        let lanes = Lanes::with_budgets(vec![Some(10 * GIB), Some(10 * GIB)], 2, config, metrics);
        let _lane = acquire_now(&lanes, true, Some(3 * GIB)).expect("fits");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        let line = |gpu: usize, bytes: u64| format!("kforge_evaluator_gpu_reserved_bytes{{gpu=\"{gpu}\"}} {bytes}");
        assert!(text.contains(&line(0, 3 * GIB)) && text.contains(&line(1, 0)), "{text}");
    }
}
