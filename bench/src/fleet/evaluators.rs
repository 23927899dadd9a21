//! The fleet's evaluator endpoints: one in-process gRPC server per endpoint, each with a capacity of its own (what
//! its pod would advertise as `kforge.dev/capacity`, its `queue_capacity`), an evaluation taking a time drawn from
//! the recorded KernelBench sweep (compressed by the time scale), and a [`Discovery`] that lists them as the
//! Kubernetes watch would: an endpoint that is lost leaves the list.
//!
//! A fake takes every call it is sent at once (the balancer keeps each endpoint's calls at or under its capacity);
//! it does not slow down as it fills, as a real pod queueing on its GPUs would.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kforge_discovery::{Discovery, Endpoints};
use kforge_proto::v1 as pb;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Wall seconds of one evaluation at every fifth percentile (p0, p5, ..., p100) of the 550 evaluations recorded in
/// `bench/results/evaluator-kernelbench-sweep/2026-11-27b/` (`*/sweep-*.jsonl`, field `wall_s`: every reproducing
/// KernelBench candidate cold and warm at the shipped 4 evaluations per GPU, on 1x and 4x H200; mean 26.5 s).
pub const RECORDED_WALL_S: [f64; 21] = [
    3.8, 7.7, 9.7, 11.1, 12.9, 14.4, 15.2, 17.0, 17.8, 19.7, 21.9, 23.5, 25.6, 27.7, 31.8, 35.2, 37.7, 41.3, 48.2,
    63.0, 97.1,
];

/// The recorded wall time at quantile `u` in [0, 1], interpolated between the table's points.
pub fn recorded_wall_s(u: f64) -> f64 {
    let x = u.clamp(0.0, 1.0) * 20.0;
    let i = (x.floor() as usize).min(19);
    RECORDED_WALL_S[i] + (RECORDED_WALL_S[i + 1] - RECORDED_WALL_S[i]) * (x - i as f64)
}

/// A number in [0, 1) from `key` (FNV-1a, then SplitMix64's finaliser): the same key, the same draw.
pub fn unit(key: &str) -> f64 {
    let mut z = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// How a lost endpoint goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// As a pod deleted with a grace period: it leaves the endpoint list at once and finishes the calls it holds.
    Drain,
    /// As a pod killed: every call it holds, and every call that reaches it afterwards, fails UNAVAILABLE (a reset
    /// connection); it leaves the endpoint list only after the discovery's notice.
    Kill,
}

/// One endpoint and what it saw.
#[derive(Debug)]
pub struct Endpoint {
    pub address: SocketAddr,
    pub capacity: u32,
    /// Evaluations received.
    pub calls: AtomicU64,
    /// Evaluations answered UNAVAILABLE because the endpoint was killed.
    pub refused: AtomicU64,
    /// Most evaluations in flight at once.
    pub peak: AtomicU64,
    in_flight: AtomicU64,
    killed: CancellationToken,
    lost: std::sync::atomic::AtomicBool,
}

impl Endpoint {
    /// Whether the endpoint was lost during the run.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }
}

/// The endpoint list, as a discovery would keep it.
#[derive(Debug)]
pub struct FleetDiscovery(watch::Sender<Endpoints>);

impl Discovery for FleetDiscovery {
    fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.0.subscribe()
    }
}

/// Every endpoint, their discovery, and what the fleet answered.
#[derive(Debug)]
pub struct Evaluators {
    pub endpoints: Vec<Arc<Endpoint>>,
    pub discovery: Arc<FleetDiscovery>,
    /// Evaluations answered (not refused), by idempotency key.
    pub answered: Arc<Mutex<HashMap<String, u32>>>,
    /// Evaluations answered, in all.
    pub answered_total: Arc<AtomicU64>,
    stop: CancellationToken,
}

#[derive(Debug, Clone)]
struct Fake {
    endpoint: Arc<Endpoint>,
    time_scale: f64,
    answered: Arc<Mutex<HashMap<String, u32>>>,
    answered_total: Arc<AtomicU64>,
}

impl Evaluators {
    /// Starts one server per capacity in `capacities` on an ephemeral port, on the current runtime. An evaluation
    /// takes its recorded time times `time_scale`.
    pub async fn start(capacities: &[u32], time_scale: f64) -> Self {
        let answered: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let answered_total: Arc<AtomicU64> = Arc::default();
        let stop = CancellationToken::new();
        let mut endpoints = Vec::with_capacity(capacities.len());
        for &capacity in capacities {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind an endpoint");
            let address = listener.local_addr().expect("address");
            let endpoint = Arc::new(Endpoint {
                address,
                capacity,
                calls: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                peak: AtomicU64::new(0),
                in_flight: AtomicU64::new(0),
                killed: CancellationToken::new(),
                lost: false.into(),
            });
            let fake = Fake {
                endpoint: endpoint.clone(),
                time_scale,
                answered: answered.clone(),
                answered_total: answered_total.clone(),
            };
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let server = tonic::transport::Server::builder()
                // Every call the orchestrators' balancers send (at most the capacity from each) on one connection.
                .max_concurrent_streams(None)
                .tcp_nodelay(true)
                .add_service(pb::evaluator_server::EvaluatorServer::new(fake))
                .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned());
            tokio::spawn(server);
            endpoints.push(endpoint);
        }
        let listed = endpoints
            .iter()
            .map(|e| kforge_discovery::Endpoint { address: e.address, capacity: e.capacity, pod: None })
            .collect::<Vec<_>>();
        let discovery = Arc::new(FleetDiscovery(watch::Sender::new(listed.into())));
        Self { endpoints, discovery, answered, answered_total, stop }
    }

    /// Loses the endpoints at `lose` (indices) as `loss` says; a killed endpoint leaves the list after `notice`.
    pub fn lose(&self, lose: &[usize], loss: Loss, notice: Duration) {
        for &i in lose {
            self.endpoints[i].lost.store(true, Ordering::Relaxed);
            if loss == Loss::Kill {
                self.endpoints[i].killed.cancel();
            }
        }
        let remaining: Vec<_> = self
            .endpoints
            .iter()
            .filter(|e| !e.lost())
            .map(|e| kforge_discovery::Endpoint { address: e.address, capacity: e.capacity, pod: None })
            .collect();
        let discovery = self.discovery.clone();
        let delay = if loss == Loss::Kill { notice } else { Duration::ZERO };
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            discovery.0.send_replace(remaining.into());
        });
    }

    /// Stops every server.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

/// Keeps an endpoint's count of calls in flight while a call lives.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[tonic::async_trait]
impl pb::evaluator_server::Evaluator for Fake {
    async fn evaluate(&self, request: Request<pb::EvaluateRequest>) -> Result<Response<pb::EvaluateResponse>, Status> {
        let request = request.into_inner();
        let endpoint = &self.endpoint;
        endpoint.calls.fetch_add(1, Ordering::Relaxed);
        let now = endpoint.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        let _in_flight = InFlight(&endpoint.in_flight);
        endpoint.peak.fetch_max(now, Ordering::Relaxed);
        let took = Duration::from_secs_f64(recorded_wall_s(unit(&request.idempotency_key)) * self.time_scale);
        let started = Instant::now();
        tokio::select! {
            () = tokio::time::sleep(took) => {}
            () = endpoint.killed.cancelled() => {
                endpoint.refused.fetch_add(1, Ordering::Relaxed);
                return Err(Status::unavailable("connection reset (the fleet killed this endpoint)"));
            }
        }
        let took = started.elapsed();
        *self.answered.lock().expect("never poisoned").entry(request.idempotency_key).or_default() += 1;
        self.answered_total.fetch_add(1, Ordering::Relaxed);
        let timing = |ms| Some(pb::TimingStats { median_ms: ms, ..Default::default() });
        Ok(Response::new(pb::EvaluateResponse {
            // The time it took, for the overhead: the turn keeps the evaluation.
            stage_ms: [("fake".to_owned(), took.as_secs_f64() * 1e3)].into(),
            verdict: pb::Verdict::Correct.into(),
            speedup_eager: 1.5,
            candidate_timing: timing(2.0),
            eager_timing: timing(3.0),
            ..Default::default()
        }))
    }

    type EvaluateStreamStream = tonic::codegen::BoxStream<pb::EvaluateResponse>;

    async fn evaluate_stream(
        &self,
        _request: Request<tonic::Streaming<pb::EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStreamStream>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_capabilities(
        &self,
        _request: Request<pb::GetCapabilitiesRequest>,
    ) -> Result<Response<pb::GetCapabilitiesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_follow_the_recorded_quantiles() {
        assert_eq!(recorded_wall_s(0.0), 3.8);
        assert_eq!(recorded_wall_s(1.0), 97.1);
        assert!((recorded_wall_s(0.5) - 21.9).abs() < 1e-9);
        let n = 20_000;
        let mean = (0..n).map(|i| recorded_wall_s(unit(&format!("job/t/{i}/0")))).sum::<f64>() / f64::from(n);
        // The table's own mean, by the trapezoid rule, is 26.6 s (the records' 26.5 s).
        assert!((25.6..27.6).contains(&mean), "{mean}");
    }
}
