//! The endpoints a Service's EndpointSlices and pod annotations make, from objects in the API's own JSON
//! (tests/data: an evaluator Service with a ready, a terminating and an unconditioned endpoint, an address in two
//! slices, an FQDN slice), fed through the watch events the Kubernetes watcher yields.

use std::net::SocketAddr;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kforge_discovery::{Endpoint, Pool};
use kube::api::PartialObjectMeta;
use kube::runtime::watcher::Event;
use serde_json::Value;

fn items<K: serde::de::DeserializeOwned>(file: &str) -> Vec<K> {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    let list: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("fixture")).expect("json");
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|item| serde_json::from_value(item.clone()).expect("object"))
        .collect()
}

fn slices() -> Vec<EndpointSlice> {
    items("evaluator-slices.json")
}

fn pods() -> Vec<PartialObjectMeta<Pod>> {
    items("evaluator-pods.json")
}

fn endpoint(address: &str, capacity: u32, pod: &str) -> Endpoint {
    Endpoint { address: address.parse::<SocketAddr>().expect("address"), capacity, pod: Some(pod.to_owned()) }
}

/// A pool that has listed everything in the fixtures.
fn listed() -> Pool {
    let mut pool = Pool::new("grpc", 2);
    pool.apply_slice(Event::Init);
    slices().into_iter().for_each(|s| pool.apply_slice(Event::InitApply(s)));
    pool.apply_slice(Event::InitDone);
    pool.apply_pod(Event::Init);
    pods().into_iter().for_each(|p| pool.apply_pod(Event::InitApply(p)));
    pool.apply_pod(Event::InitDone);
    pool
}

#[test]
fn ready_endpoints_carry_their_pods_capacity() {
    assert_eq!(
        listed().endpoints(),
        vec![
            // Annotated 8.
            endpoint("10.244.1.17:50051", 8, "kforge-evaluator-6d9f7c8b5-abcde"),
            // In two slices, listed once; annotated 0, which is no capacity: the default (2).
            endpoint("10.244.2.9:50051", 2, "kforge-evaluator-6d9f7c8b5-fghij"),
            // No conditions: ready, as the API defines; the annotation's spaces are ignored.
            endpoint("10.244.4.21:50051", 16, "kforge-evaluator-6d9f7c8b5-pqrst"),
            // 10.244.3.4 is terminating (ready false): no new calls. The FQDN slice is not an address.
        ]
    );
}

#[test]
fn endpoints_without_their_pods_metadata_get_the_default_capacity() {
    let mut pool = Pool::new("grpc", 3);
    slices().into_iter().for_each(|s| pool.apply_slice(Event::Apply(s)));
    let capacities: Vec<u32> = pool.endpoints().iter().map(|e| e.capacity).collect();
    assert_eq!(capacities, vec![3, 3, 3]);
}

#[test]
fn a_port_name_the_slices_lack_gives_no_endpoints() {
    let mut pool = Pool::new("metrics", 2);
    slices().into_iter().for_each(|s| pool.apply_slice(Event::Apply(s)));
    assert_eq!(pool.endpoints(), vec![]);
}

#[test]
fn changes_apply_as_they_are_watched() {
    let mut pool = listed();
    let [first, second, _fqdn] = <[EndpointSlice; 3]>::try_from(slices()).expect("three slices");

    // The second slice goes: its pod's endpoint goes with it; 10.244.2.9 stays, from the first slice.
    pool.apply_slice(Event::Delete(second.clone()));
    let addresses: Vec<String> = pool.endpoints().iter().map(|e| e.address.to_string()).collect();
    assert_eq!(addresses, ["10.244.1.17:50051", "10.244.2.9:50051"]);

    // The terminating pod's replacement becomes ready in the first slice.
    let mut updated = first.clone();
    updated.endpoints[2].conditions.as_mut().expect("conditions").ready = Some(true);
    pool.apply_slice(Event::Apply(updated));
    assert!(pool.endpoints().contains(&endpoint("10.244.3.4:50051", 4, "kforge-evaluator-6d9f7c8b5-klmno")));

    // A capacity change reaches the endpoint.
    let mut pod = pods().remove(0);
    pod.metadata.annotations.as_mut().expect("annotations").insert("kforge.dev/capacity".into(), "12".into());
    pool.apply_pod(Event::Apply(pod));
    assert_eq!(pool.endpoints()[0], endpoint("10.244.1.17:50051", 12, "kforge-evaluator-6d9f7c8b5-abcde"));
}

#[test]
fn a_relist_replaces_the_objects_only_when_it_is_done() {
    let mut pool = listed();
    let before = pool.endpoints();
    let [_first, second, _fqdn] = <[EndpointSlice; 3]>::try_from(slices()).expect("three slices");

    // After a watch error the watcher lists again: until the list is complete, the last endpoints stay in use.
    pool.apply_slice(Event::Init);
    pool.apply_slice(Event::InitApply(second));
    assert_eq!(pool.endpoints(), before, "a partial relist changes nothing");

    // The relist found only the second slice: the first slice's endpoints are gone.
    pool.apply_slice(Event::InitDone);
    let addresses: Vec<String> = pool.endpoints().iter().map(|e| e.address.to_string()).collect();
    assert_eq!(addresses, ["10.244.2.9:50051", "10.244.4.21:50051"]);
}
