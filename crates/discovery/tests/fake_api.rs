//! KubeDiscovery end to end through kube's real client and watcher, against a fake API server: plain HTTP on
//! loopback serving the list and watch requests of EndpointSlices and pod metadata with the objects of tests/data,
//! then watch events the test sends.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, State};
use axum::routing::get;
use kforge_discovery::{Discovery, KubeDiscovery, KubeTarget};
use serde_json::{Value, json};
use tokio::sync::{broadcast, watch};

fn fixture(file: &str) -> Value {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json")
}

/// What the fake server serves for one resource: its list, then the events sent on `events` to every watch.
#[derive(Clone)]
struct Resource {
    list: Value,
    events: broadcast::Sender<Value>,
    /// Watches connected so far, so the test sends events only once one listens.
    watches: Arc<watch::Sender<usize>>,
}

async fn serve(State(resource): State<Resource>, RawQuery(query): RawQuery) -> Body {
    let watching = query.unwrap_or_default().split('&').any(|pair| pair == "watch=true");
    if !watching {
        let mut list = resource.list.clone();
        list["metadata"] = json!({"resourceVersion": "100"});
        return Body::from(list.to_string());
    }
    let events = resource.events.subscribe();
    resource.watches.send_modify(|n| *n += 1);
    // One JSON object per line, as the API server streams a watch; open until the test ends.
    let stream = futures_util::stream::unfold(events, |mut events| async move {
        let event = events.recv().await.ok()?;
        Some((Ok::<_, std::io::Error>(format!("{event}\n")), events))
    });
    Body::from_stream(stream)
}

fn resource(list: Value) -> Resource {
    Resource { list, events: broadcast::channel(16).0, watches: Arc::new(watch::Sender::new(0)) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_follow_the_api_servers_lists_and_watch_events() {
    let mut slices_list = fixture("evaluator-slices.json");
    slices_list["kind"] = json!("EndpointSliceList");
    slices_list["apiVersion"] = json!("discovery.k8s.io/v1");
    let mut pods_list = fixture("evaluator-pods.json");
    pods_list["apiVersion"] = json!("meta.k8s.io/v1");
    let (slices, pods) = (resource(slices_list.clone()), resource(pods_list));
    let app = Router::new()
        .route("/apis/discovery.k8s.io/v1/namespaces/kforge/endpointslices", get(serve).with_state(slices.clone()))
        .route("/api/v1/namespaces/kforge/pods", get(serve).with_state(pods.clone()));
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });

    let config = kube::Config::new(url.parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    let discovery = KubeDiscovery::start(
        client,
        KubeTarget {
            namespace: "kforge".into(),
            service: "kforge-evaluator-pods".into(),
            port_name: "grpc".into(),
            pod_selector: "app.kubernetes.io/component=evaluator".into(),
            default_capacity: 2,
        },
    );
    let mut endpoints = discovery.subscribe();

    // The lists: three ready endpoints, capacities from the pods' annotations (the pod list may land second).
    let listed = endpoints.wait_for(|e| e.len() == 3 && e[0].capacity == 8).await.expect("discovery runs").clone();
    let summary: Vec<(String, u32)> = listed.iter().map(|e| (e.address.to_string(), e.capacity)).collect();
    assert_eq!(
        summary,
        [("10.244.1.17:50051".into(), 8), ("10.244.2.9:50051".into(), 2), ("10.244.4.21:50051".into(), 16)]
    );

    // A watch event: the second slice is deleted, so its pod's endpoint goes.
    slices.watches.subscribe().wait_for(|n| *n > 0).await.expect("slice watch");
    let second = slices_list["items"][1].clone();
    slices.events.send(json!({"type": "DELETED", "object": second})).expect("a watch listens");
    let after = endpoints.wait_for(|e| e.len() == 2).await.expect("discovery runs").clone();
    let addresses: Vec<String> = after.iter().map(|e| e.address.to_string()).collect();
    assert_eq!(addresses, ["10.244.1.17:50051", "10.244.2.9:50051"]);

    // A pod's new annotation changes its endpoint's capacity.
    pods.watches.subscribe().wait_for(|n| *n > 0).await.expect("pod watch");
    let mut pod = fixture("evaluator-pods.json")["items"][0].clone();
    pod["metadata"]["annotations"]["kforge.dev/capacity"] = json!("12");
    pod["metadata"]["resourceVersion"] = json!("101");
    pods.events.send(json!({"type": "MODIFIED", "object": pod})).expect("a watch listens");
    let updated = endpoints.wait_for(|e| e.first().is_some_and(|e| e.capacity == 12)).await.expect("runs").clone();
    assert_eq!(updated[0].pod.as_deref(), Some("kforge-evaluator-6d9f7c8b5-abcde"));
}
