//! Where the pods of a kforge service are, for clients that balance across them: the ready endpoints, each with
//! the capacity its pod advertises, kept current.
//!
//! - [`KubeDiscovery`]: watches a Service's EndpointSlices and its pods' annotations through the Kubernetes API.
//! - [`StaticDiscovery`]: a fixed list, for one machine (`kforge up`) or a cluster without API access.
//!
//! Both are [`Discovery`]: a watch channel whose value is the endpoint list now and which changes as pods come,
//! go, become ready or stop being ready.

mod kubernetes;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;

/// Why [`KubeDiscovery::start_in_environment`] found no Kubernetes API client.
pub use kube::Error as KubeError;
pub use kubernetes::{KubeDiscovery, KubeTarget, Pool};

/// The pod annotation that advertises how many calls a pod takes at once (an evaluator's queue capacity, say). A
/// pod without it, or with a value that is not a positive integer, gets the target's default capacity.
pub const CAPACITY_ANNOTATION: &str = "kforge.dev/capacity";

/// One ready endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Endpoint {
    /// Where to connect.
    pub address: SocketAddr,
    /// Calls the endpoint takes at once: balancing weight and per-endpoint limit.
    pub capacity: u32,
    /// The pod behind it, where known (for logs and metrics).
    pub pod: Option<String>,
}

impl Endpoint {
    /// The URL a gRPC client connects to: `http://address` or `https://address`.
    pub fn url(&self, tls: bool) -> String {
        format!("{}://{}", if tls { "https" } else { "http" }, self.address)
    }
}

/// The current endpoint list, shared.
pub type Endpoints = Arc<[Endpoint]>;

/// A source of ready endpoints. `subscribe` gives the list now; `changed()` on the receiver waits for the next.
pub trait Discovery: Send + Sync + std::fmt::Debug {
    fn subscribe(&self) -> watch::Receiver<Endpoints>;
}

/// A fixed endpoint list.
#[derive(Debug)]
pub struct StaticDiscovery {
    endpoints: watch::Sender<Endpoints>,
}

impl StaticDiscovery {
    pub fn new(endpoints: impl IntoIterator<Item = Endpoint>) -> Self {
        let mut endpoints: Vec<_> = endpoints.into_iter().collect();
        endpoints.sort();
        endpoints.dedup_by(|a, b| a.address == b.address);
        Self { endpoints: watch::Sender::new(endpoints.into()) }
    }

    /// Addresses that all take `capacity` calls.
    pub fn from_addresses(addresses: impl IntoIterator<Item = SocketAddr>, capacity: u32) -> Self {
        Self::new(addresses.into_iter().map(|address| Endpoint { address, capacity, pod: None }))
    }
}

impl Discovery for StaticDiscovery {
    fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.endpoints.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_static_list_is_sorted_and_has_each_address_once() {
        let a: SocketAddr = "10.0.0.2:50051".parse().expect("addr");
        let b: SocketAddr = "10.0.0.1:50051".parse().expect("addr");
        let discovery = StaticDiscovery::from_addresses([a, b, a], 4);
        let endpoints = discovery.subscribe().borrow().clone();
        assert_eq!(endpoints.iter().map(|e| e.address).collect::<Vec<_>>(), vec![b, a]);
        assert!(endpoints.iter().all(|e| e.capacity == 4 && e.pod.is_none()));
        assert_eq!(endpoints[0].url(false), "http://10.0.0.1:50051");
        assert_eq!(endpoints[0].url(true), "https://10.0.0.1:50051");
    }
}
