//! Calls to a GPU pool (evaluator or profiler pods) spread over its ready endpoints by their advertised capacity.
//!
//! A Kubernetes ClusterIP Service spreads connections, not calls: over one HTTP/2 connection every call lands on the
//! pod that connection reached. So the orchestrator picks the endpoint per call: among the endpoints with a free
//! place (calls in flight below the capacity the pod advertises), the one of highest weighted rendezvous score for
//! the call's key (score = capacity / -ln(hash(key, endpoint)), so keys spread in proportion to capacity, and a
//! retried call, same key, returns to the same pod while it has room: the evaluator's idempotency cache is per
//! pod). With every place taken, a call waits for one. The endpoints come from a [`Discovery`] (the Kubernetes API,
//! or a static list) and change while calls run; a call keeps its endpoint's channel until it ends.
//!
//! An endpoint whose call was cut or refused ([`Place::lost`]: the pod died, its connection broke) is passed over for
//! [`DOWN_FOR`] while another endpoint is up, so the retry of that call (same key) goes elsewhere at once instead of
//! back to the pod its key prefers: a static list keeps a dead pod, and discovery takes seconds to drop one.
//!
//! A pool with one configured URL and no discovery is the same with one endpoint whose capacity is the
//! orchestrator's own `max_in_flight` for that peer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kforge_discovery::{Discovery, Endpoints};
use kforge_server::client::{self, Channel, ClientConfig};
use tokio::sync::{Notify, watch};

use crate::error::OrchestratorError;

/// How long a call waits for a pool with no ready endpoint before it fails (UNAVAILABLE).
const NO_ENDPOINT_PATIENCE: Duration = Duration::from_secs(30);

/// How long an endpoint that lost a call is passed over while another is up; then a call tries it again (a pod that
/// restarted on the same address is back; one still dead costs that call one quick refusal).
const DOWN_FOR: Duration = Duration::from_secs(10);

/// One endpoint as the balancer uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub url: String,
    pub capacity: u32,
}

/// Where a pool's endpoints come from.
#[derive(Debug)]
enum Source {
    /// One configured URL (a Service's DNS name, or the in-process service).
    Fixed(Target),
    /// Endpoints found by discovery, reached over TLS when `tls`.
    Discovered { endpoints: watch::Receiver<Endpoints>, tls: bool, _discovery: Arc<dyn Discovery> },
}

/// A peer's pool of endpoints with the calls in flight to each.
#[derive(Debug)]
pub struct Balancer {
    /// The peer's name, for errors.
    peer: &'static str,
    source: Source,
    client: ClientConfig,
    slots: Mutex<HashMap<String, Slot>>,
    freed: Notify,
    /// The endpoint list as targets, rebuilt only when discovery changes it: formatting a thousand URLs, and
    /// matching every slot against every target, at each call cost more than the rest of a turn
    /// (bench/results/orchestrator-fleet/2026-11-29-dev).
    cached: Mutex<Cached>,
}

#[derive(Debug, Default)]
struct Cached {
    /// The list the targets were built from.
    from: Option<Endpoints>,
    targets: Arc<[Target]>,
}

#[derive(Debug)]
struct Slot {
    channel: Channel,
    in_flight: u32,
    /// Passed over until then while another endpoint is up ([`Place::lost`]).
    down_until: Option<tokio::time::Instant>,
}

impl Slot {
    fn new(channel: Channel) -> Self {
        Self { channel, in_flight: 0, down_until: None }
    }

    fn up(&self, now: tokio::time::Instant) -> bool {
        self.down_until.is_none_or(|until| until <= now)
    }
}

/// A place taken at one endpoint: its channel, for one call. Dropping it frees the place.
#[derive(Debug)]
pub struct Place {
    balancer: Arc<Balancer>,
    url: String,
    channel: Channel,
}

impl Place {
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// The endpoint's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Frees the place of a call its endpoint lost (cut or refused in transport), passing the endpoint over for
    /// [`DOWN_FOR`] while another is up. Whether another endpoint of the pool is up now: a retry can go there at once.
    pub fn lost(self) -> bool {
        let now = tokio::time::Instant::now();
        let targets = self.balancer.targets();
        let mut slots = self.balancer.slots();
        if let Some(slot) = slots.get_mut(&self.url) {
            slot.down_until = Some(now + DOWN_FOR);
        }
        let elsewhere = targets.iter().any(|t| t.url != self.url && slots.get(&t.url).is_none_or(|slot| slot.up(now)));
        // Before the place is freed (its drop takes the lock and wakes waiting calls, which must see the mark).
        drop(slots);
        elsewhere
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut slots = self.balancer.slots();
        if let Some(slot) = slots.get_mut(&self.url) {
            slot.in_flight = slot.in_flight.saturating_sub(1);
        }
        drop(slots);
        self.balancer.freed.notify_waiters();
    }
}

impl Balancer {
    /// A pool of one URL taking `capacity` calls at once.
    pub fn fixed(peer: &'static str, url: &str, capacity: u32, client: ClientConfig) -> Arc<Self> {
        let target = Target { url: url.to_owned(), capacity: capacity.max(1) };
        Arc::new(Self::new(peer, Source::Fixed(target), client))
    }

    /// A pool of the endpoints `discovery` finds; `https` when the client has a CA (the pods' certificates must
    /// then name `client.tls_domain`, as the endpoints are addresses).
    pub fn discovered(peer: &'static str, discovery: Arc<dyn Discovery>, client: ClientConfig) -> Arc<Self> {
        let tls = client.tls_ca_file.is_some();
        let source = Source::Discovered { endpoints: discovery.subscribe(), tls, _discovery: discovery };
        Arc::new(Self::new(peer, source, client))
    }

    fn new(peer: &'static str, source: Source, client: ClientConfig) -> Self {
        Self { peer, source, client, slots: Mutex::default(), freed: Notify::new(), cached: Mutex::default() }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        // Counter updates only: a panic elsewhere cannot leave the map half-changed.
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The endpoints now.
    pub fn targets(&self) -> Vec<Target> {
        match &self.source {
            Source::Fixed(target) => vec![target.clone()],
            Source::Discovered { endpoints, tls, .. } => {
                endpoints.borrow().iter().map(|e| Target { url: e.url(*tls), capacity: e.capacity.max(1) }).collect()
            }
        }
    }

    /// The endpoints now, and whether they changed since the last call here.
    fn current(&self) -> (Arc<[Target]>, bool) {
        // A rebuild only: a panic elsewhere cannot leave it half-changed.
        let mut cached = self.cached.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = match &self.source {
            Source::Fixed(target) => {
                let first = cached.targets.is_empty();
                if first {
                    cached.targets = Arc::from([target.clone()]);
                }
                first
            }
            Source::Discovered { endpoints, tls, .. } => {
                let now = endpoints.borrow().clone();
                let changed = !cached.from.as_ref().is_some_and(|from| Arc::ptr_eq(from, &now));
                if changed {
                    cached.targets =
                        now.iter().map(|e| Target { url: e.url(*tls), capacity: e.capacity.max(1) }).collect();
                    cached.from = Some(now);
                }
                changed
            }
        };
        (cached.targets.clone(), changed)
    }

    /// Checks the pool can take calls, for a job's submission: a fixed URL is connected to now (UNAVAILABLE naming
    /// the peer and its URL when unreachable); a discovered pool needs a ready endpoint.
    pub async fn check(&self) -> Result<(), OrchestratorError> {
        match &self.source {
            Source::Fixed(target) => {
                if self.slots().contains_key(&target.url) {
                    return Ok(());
                }
                let channel = client::connect(&target.url, &self.client).await.map_err(|error| {
                    OrchestratorError::PeerUnavailable {
                        peer: self.peer,
                        url: target.url.clone(),
                        message: error.to_string(),
                    }
                })?;
                self.slots().entry(target.url.clone()).or_insert(Slot::new(channel));
                Ok(())
            }
            Source::Discovered { .. } if self.targets().is_empty() => Err(OrchestratorError::PeerUnavailable {
                peer: self.peer,
                url: "(discovery)".into(),
                message: "no ready endpoint has been found".into(),
            }),
            Source::Discovered { .. } => Ok(()),
        }
    }

    /// Takes a place for a call keyed `key` (see the module's documentation), waiting while every place is taken;
    /// UNAVAILABLE when no endpoint has been ready for [`NO_ENDPOINT_PATIENCE`].
    pub async fn acquire(self: &Arc<Self>, key: &str) -> Result<Place, tonic::Status> {
        let mut changes = match &self.source {
            Source::Discovered { endpoints, .. } => Some(endpoints.clone()),
            Source::Fixed(_) => None,
        };
        let mut none_since: Option<tokio::time::Instant> = None;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            let (targets, changed) = self.current();
            if targets.is_empty() {
                let since = *none_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= NO_ENDPOINT_PATIENCE {
                    return Err(tonic::Status::unavailable(format!(
                        "{}: no ready endpoint for {} s",
                        self.peer,
                        NO_ENDPOINT_PATIENCE.as_secs()
                    )));
                }
            } else {
                none_since = None;
                if let Some(place) = self.take(key, &targets, changed)? {
                    return Ok(place);
                }
            }
            let patience = tokio::time::sleep(NO_ENDPOINT_PATIENCE);
            match changes.as_mut() {
                Some(changes) => tokio::select! {
                    () = &mut freed => {}
                    _ = changes.changed() => {}
                    () = patience => {}
                },
                None => tokio::select! {
                    () = &mut freed => {}
                    () = patience => {}
                },
            }
        }
    }

    /// A place at the best endpoint with room, if any, among the endpoints up (all of them when none is: a call is
    /// tried rather than kept waiting); when the endpoints `changed`, slots of those that are gone and idle are
    /// dropped. Each target's score is computed once, and its room looked up only when it scores best so far.
    fn take(self: &Arc<Self>, key: &str, targets: &[Target], changed: bool) -> Result<Option<Place>, tonic::Status> {
        let now = tokio::time::Instant::now();
        let mut slots = self.slots();
        if changed {
            let listed: std::collections::HashSet<&str> = targets.iter().map(|t| t.url.as_str()).collect();
            slots.retain(|url, slot| slot.in_flight > 0 || listed.contains(url.as_str()));
        }
        let in_flight = |url: &str| slots.get(url).map_or(0, |slot| slot.in_flight);
        let up = |url: &str| slots.get(url).is_none_or(|slot| slot.up(now));
        let any_up = targets.iter().any(|t| up(&t.url));
        let hashed = key_hash(key);
        let mut best: Option<(f64, &Target)> = None;
        for target in targets {
            let score = score(hashed, target);
            if best.is_none_or(|(high, _)| score > high)
                && (up(&target.url) || !any_up)
                && in_flight(&target.url) < target.capacity
            {
                best = Some((score, target));
            }
        }
        let Some((_, target)) = best else { return Ok(None) };
        let slot = match slots.entry(target.url.clone()) {
            std::collections::hash_map::Entry::Occupied(slot) => slot.into_mut(),
            std::collections::hash_map::Entry::Vacant(vacant) => {
                let channel = client::connect_lazy(&target.url, &self.client)
                    .map_err(|error| tonic::Status::unavailable(format!("{}: {error}", self.peer)))?;
                vacant.insert(Slot::new(channel))
            }
        };
        slot.in_flight += 1;
        Ok(Some(Place { balancer: self.clone(), url: target.url.clone(), channel: slot.channel.clone() }))
    }
}

const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The FNV-1a state after a call's key and a separator: each target's score goes on from it.
fn key_hash(key: &str) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    key.bytes().chain([0]).fold(FNV_OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

/// Weighted rendezvous score of `target` for a key hashed by [`key_hash`]: capacity / -ln(u), u in (0, 1) a hash
/// of both.
fn score(key_hash: u64, target: &Target) -> f64 {
    let mut z = target.url.bytes().fold(key_hash, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME));
    // SplitMix64's finaliser: FNV alone is weak in its high bits.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let u = ((z >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(target.capacity) / -u.ln()
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use kforge_discovery::{Endpoint, StaticDiscovery};

    use super::*;

    fn address(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn pool(capacities: &[(u16, u32)]) -> Arc<Balancer> {
        let endpoints =
            capacities.iter().map(|&(port, capacity)| Endpoint { address: address(port), capacity, pod: None });
        Balancer::discovered("evaluator", Arc::new(StaticDiscovery::new(endpoints)), ClientConfig::default())
    }

    #[tokio::test]
    async fn each_endpoint_takes_its_capacity_and_a_freed_place_goes_to_a_waiting_call() {
        let pool = pool(&[(1, 1), (2, 2)]);
        let mut places = Vec::new();
        for key in ["a", "b", "c"] {
            places.push(pool.acquire(key).await.expect("a place"));
        }
        let mut urls: Vec<&str> = places.iter().map(Place::url).collect();
        urls.sort_unstable();
        assert_eq!(urls, ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:2"]);
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire("d").await.map(|place| place.url().to_owned()) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "every place is taken");
        let freed = places.iter().position(|l| l.url() == "http://127.0.0.1:1").expect("one there");
        drop(places.remove(freed));
        assert_eq!(waiting.await.expect("task").expect("a place"), "http://127.0.0.1:1");
    }

    #[tokio::test]
    async fn keys_spread_in_proportion_to_capacity_and_a_key_returns_to_its_endpoint() {
        let pool = pool(&[(1, 1000), (2, 3000)]);
        let mut on_second = 0;
        for i in 0..4000 {
            let key = format!("job/task/{i}/0");
            let first = pool.acquire(&key).await.expect("a place").url().to_owned();
            let again = pool.acquire(&key).await.expect("a place").url().to_owned();
            assert_eq!(first, again, "a retry goes back while there is room");
            on_second += usize::from(first.ends_with(":2"));
        }
        // Expected 3000 of 4000; a binomial's standard deviation here is 27.
        assert!((2850..3150).contains(&on_second), "{on_second}");
    }

    #[tokio::test]
    async fn a_pool_follows_its_endpoints_as_they_change() {
        let (sender, receiver) = watch::channel::<Endpoints>(Arc::from(vec![]));
        #[derive(Debug)]
        struct Fake(watch::Receiver<Endpoints>);
        impl Discovery for Fake {
            fn subscribe(&self) -> watch::Receiver<Endpoints> {
                self.0.clone()
            }
        }
        let pool = Balancer::discovered("evaluator", Arc::new(Fake(receiver)), ClientConfig::default());
        assert!(pool.check().await.is_err(), "no ready endpoint yet");
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire("k").await.map(|place| place.url().to_owned()) }
        });
        tokio::task::yield_now().await;
        let endpoint = |port| Endpoint { address: address(port), capacity: 1, pod: None };
        sender.send_replace(Arc::from(vec![endpoint(7)]));
        assert_eq!(waiting.await.expect("task").expect("a place"), "http://127.0.0.1:7");
        sender.send_replace(Arc::from(vec![endpoint(8)]));
        assert_eq!(pool.acquire("k").await.expect("a place").url(), "http://127.0.0.1:8", "the gone one is not used");
        pool.check().await.expect("ready");
    }

    /// A key whose preferred endpoint in `pool` is `url`.
    async fn key_preferring(pool: &Arc<Balancer>, url: &str) -> String {
        for i in 0.. {
            let key = format!("job/task/{i}/0");
            if pool.acquire(&key).await.expect("a place").url() == url {
                return key;
            }
        }
        unreachable!("some key prefers each endpoint")
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_endpoint_is_passed_over_while_another_is_up_then_tried_again() {
        let pool = pool(&[(1, 2), (2, 2)]);
        let key = key_preferring(&pool, "http://127.0.0.1:1").await;
        let place = pool.acquire(&key).await.expect("a place");
        assert!(place.lost(), "the other endpoint is up");
        assert_eq!(pool.acquire(&key).await.expect("a place").url(), "http://127.0.0.1:2", "the retry goes elsewhere");
        tokio::time::advance(DOWN_FOR).await;
        assert_eq!(pool.acquire(&key).await.expect("a place").url(), "http://127.0.0.1:1", "tried again later");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_waits_for_a_place_at_an_endpoint_up_rather_than_take_a_lost_one() {
        let pool = pool(&[(1, 1), (2, 1)]);
        let on_second = pool.acquire(&key_preferring(&pool, "http://127.0.0.1:2").await).await.expect("a place");
        let key = key_preferring(&pool, "http://127.0.0.1:1").await;
        assert!(pool.acquire(&key).await.expect("a place").lost(), "the second is up");
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire(&key).await.map(|place| place.url().to_owned()) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the lost endpoint's free place is not taken");
        drop(on_second);
        assert_eq!(waiting.await.expect("task").expect("a place"), "http://127.0.0.1:2");
    }

    #[tokio::test(start_paused = true)]
    async fn with_every_endpoint_lost_a_call_is_still_placed() {
        let pool = pool(&[(1, 1), (2, 1)]);
        for port in [1, 2] {
            let place = pool.acquire(&key_preferring(&pool, &format!("http://127.0.0.1:{port}")).await).await;
            let elsewhere = place.expect("a place").lost();
            assert_eq!(elsewhere, port == 1, "after the second is lost, none is up");
        }
        pool.acquire("k").await.expect("tried rather than kept waiting");
        let fixed = Balancer::fixed("evaluator", "http://127.0.0.1:3", 1, ClientConfig::default());
        assert!(!fixed.acquire("k").await.expect("a place").lost(), "a pool of one has nowhere else");
        assert_eq!(fixed.acquire("k").await.expect("a place").url(), "http://127.0.0.1:3");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pool_with_no_endpoint_fails_a_call_after_its_patience() {
        let pool = pool(&[]);
        let status = pool.acquire("k").await.expect_err("nothing to call");
        assert_eq!(status.code(), tonic::Code::Unavailable);
        assert!(status.message().contains("no ready endpoint"), "{status:?}");
    }
}
