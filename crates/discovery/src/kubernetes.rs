//! Discovery through the Kubernetes API: the EndpointSlices of one Service (ready addresses and the port) joined
//! with its pods' metadata (the capacity annotation), both watched. [`Pool`] is the pure state both watches feed;
//! [`KubeDiscovery`] runs the watches.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::watcher::{self, Event};
use kube::runtime::{WatchStreamExt, watcher as watch_objects};
use kube::{Client, ResourceExt};
use tokio::sync::watch;

use crate::{CAPACITY_ANNOTATION, Discovery, Endpoint, Endpoints};

/// Which Service to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeTarget {
    pub namespace: String,
    /// The Service's name (its EndpointSlices carry it as `kubernetes.io/service-name`).
    pub service: String,
    /// The Service port's name, e.g. `grpc`.
    pub port_name: String,
    /// A label selector matching the Service's pods, e.g. `app.kubernetes.io/component=evaluator`; their
    /// annotations give each endpoint's capacity.
    pub pod_selector: String,
    /// Capacity of a pod without a valid annotation.
    pub default_capacity: u32,
}

/// One watch's objects, rebuilt in full when the watch (re)lists.
#[derive(Debug)]
struct Objects<K> {
    current: BTreeMap<String, K>,
    /// Objects of a list in progress (between `Init` and `InitDone`); the current ones stay in use until it ends.
    relisting: Option<BTreeMap<String, K>>,
}

impl<K: ResourceExt> Objects<K> {
    fn apply(&mut self, event: Event<K>) {
        match event {
            Event::Apply(object) => {
                self.current.insert(object.name_any(), object);
            }
            Event::Delete(object) => {
                self.current.remove(&object.name_any());
            }
            Event::Init => self.relisting = Some(BTreeMap::new()),
            Event::InitApply(object) => {
                self.relisting.get_or_insert_with(BTreeMap::new).insert(object.name_any(), object);
            }
            Event::InitDone => {
                if let Some(listed) = self.relisting.take() {
                    self.current = listed;
                }
            }
        }
    }
}

impl<K> Default for Objects<K> {
    fn default() -> Self {
        Self { current: BTreeMap::new(), relisting: None }
    }
}

/// The EndpointSlices and pod capacities seen so far, and the endpoints they make.
#[derive(Debug)]
pub struct Pool {
    port_name: String,
    default_capacity: u32,
    slices: Objects<EndpointSlice>,
    pods: Objects<PartialObjectMeta<Pod>>,
}

impl Pool {
    pub fn new(port_name: impl Into<String>, default_capacity: u32) -> Self {
        Self { port_name: port_name.into(), default_capacity, slices: Objects::default(), pods: Objects::default() }
    }

    pub fn apply_slice(&mut self, event: Event<EndpointSlice>) {
        self.slices.apply(event);
    }

    pub fn apply_pod(&mut self, event: Event<PartialObjectMeta<Pod>>) {
        self.pods.apply(event);
    }

    /// Ready endpoints, sorted by address, each address once. An endpoint is ready when its `ready` condition is
    /// true or unset (the API's rule); a terminating pod's is false, so a draining pod gets no new calls.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        let capacities: HashMap<&str, u32> = self
            .pods
            .current
            .iter()
            .map(|(name, pod)| (name.as_str(), capacity(pod.annotations().get(CAPACITY_ANNOTATION))))
            .filter_map(|(name, capacity)| Some((name, capacity?)))
            .collect();
        let mut endpoints = Vec::new();
        for slice in self.slices.current.values() {
            if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
                continue;
            }
            let port = slice.ports.iter().flatten().find(|p| p.name.as_deref() == Some(self.port_name.as_str()));
            let Some(port) = port.and_then(|p| p.port).and_then(|p| u16::try_from(p).ok()) else { continue };
            for endpoint in &slice.endpoints {
                if endpoint.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                    continue;
                }
                let pod = endpoint
                    .target_ref
                    .as_ref()
                    .filter(|r| r.kind.as_deref() == Some("Pod"))
                    .and_then(|r| r.name.clone());
                let capacity = pod.as_deref().and_then(|p| capacities.get(p).copied()).unwrap_or(self.default_capacity);
                for address in &endpoint.addresses {
                    let Ok(ip) = address.parse::<IpAddr>() else { continue };
                    endpoints.push(Endpoint { address: SocketAddr::new(ip, port), capacity, pod: pod.clone() });
                }
            }
        }
        endpoints.sort();
        endpoints.dedup_by(|a, b| a.address == b.address);
        endpoints
    }
}

/// A capacity annotation's value: a positive integer, else none (the default applies).
fn capacity(annotation: Option<&String>) -> Option<u32> {
    let value = annotation?;
    match value.trim().parse::<u32>() {
        Ok(capacity) if capacity > 0 => Some(capacity),
        _ => {
            tracing::warn!(annotation = CAPACITY_ANNOTATION, %value, "not a positive integer; default capacity used");
            None
        }
    }
}

/// A Service's ready endpoints, watched through the Kubernetes API. The watches run until this is dropped; they
/// re-list after errors with backoff, keeping the last endpoints meanwhile.
#[derive(Debug)]
pub struct KubeDiscovery {
    endpoints: watch::Sender<Endpoints>,
    task: tokio::task::JoinHandle<()>,
}

impl KubeDiscovery {
    /// Starts watching with the client the environment gives (a pod's service account, else `KUBECONFIG`); an empty
    /// `target.namespace` is the client's default namespace (a pod's own).
    pub async fn start_in_environment(mut target: KubeTarget) -> Result<Self, kube::Error> {
        let client = Client::try_default().await?;
        if target.namespace.is_empty() {
            target.namespace = client.default_namespace().to_owned();
        }
        Ok(Self::start(client, target))
    }

    /// Starts watching. The list is empty until the first EndpointSlices arrive.
    pub fn start(client: Client, target: KubeTarget) -> Self {
        let endpoints = watch::Sender::new(Endpoints::from(Vec::new()));
        let slices = watch_objects(
            Api::<EndpointSlice>::namespaced(client.clone(), &target.namespace),
            watcher::Config::default().labels(&format!("kubernetes.io/service-name={}", target.service)),
        )
        .default_backoff()
        .map(Update::Slice);
        // Metadata only: the annotations are all that is needed of a pod.
        let pods = watch_objects(
            Api::<PartialObjectMeta<Pod>>::namespaced(client, &target.namespace),
            watcher::Config::default().labels(&target.pod_selector),
        )
        .default_backoff()
        .map(Update::Pod);
        let sender = endpoints.clone();
        let task = tokio::spawn(async move {
            let mut pool = Pool::new(target.port_name, target.default_capacity);
            let mut updates = std::pin::pin!(futures_util::stream::select(slices, pods));
            while let Some(update) = updates.next().await {
                match update {
                    Update::Slice(Ok(event)) => pool.apply_slice(event),
                    Update::Pod(Ok(event)) => pool.apply_pod(event),
                    Update::Slice(Err(error)) | Update::Pod(Err(error)) => {
                        tracing::warn!(service = %target.service, %error, "endpoint watch failed; retrying");
                        continue;
                    }
                }
                let now = pool.endpoints();
                sender.send_if_modified(|current| {
                    let changed = current[..] != now[..];
                    if changed {
                        *current = Endpoints::from(now);
                    }
                    changed
                });
            }
        });
        Self { endpoints, task }
    }
}

enum Update {
    Slice(Result<Event<EndpointSlice>, watcher::Error>),
    Pod(Result<Event<PartialObjectMeta<Pod>>, watcher::Error>),
}

impl Drop for KubeDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Discovery for KubeDiscovery {
    fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.endpoints.subscribe()
    }
}
