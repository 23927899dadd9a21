//! What every kforge server does, checked on a real service over real connections: bearer-token auth, TLS,
//! `/metrics`, message size limits, deadlines, and health going NOT_SERVING when it drains or is not ready.

use std::path::PathBuf;
use std::time::Duration;

use kforge::mesh::{MeshConfig, Service};
use kforge_proto::v1 as pb;
use kforge_proto::v1::reward_client::RewardClient;
use kforge_server::TlsConfig;
use kforge_server::client::ClientConfig;
use kforge_server::config::AuthConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;

fn returns_request(values: Vec<f64>) -> pb::ComputeReturnsRequest {
    pb::ComputeReturnsRequest {
        method: pb::ReturnMethod::Sum.into(),
        gamma: Some(0.5),
        trajectories: vec![pb::TrajectoryValues { trajectory_id: "t".into(), values }],
    }
}

/// A scratch directory unique to this test process and name.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kforge-server-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[tokio::test]
async fn bearer_token_guards_rpcs_but_not_health() {
    let dir = scratch("auth");
    std::fs::write(dir.join("token"), "s3cret\n").expect("token file");
    std::fs::write(dir.join("wrong"), "guess").expect("token file");
    let mut config = MeshConfig::default();
    config.reward.server.auth = AuthConfig { token_file: Some(dir.join("token")), token_env: None };
    // Readiness needs no token: kubelet probes carry none.
    let mesh = kforge_tests::start(&[Service::Reward], &config).await;

    let with_token = |file: Option<PathBuf>| ClientConfig {
        auth: AuthConfig { token_file: file, token_env: None },
        ..Default::default()
    };
    let anonymous = kforge_tests::connect(&mesh, Service::Reward, &with_token(None)).await;
    let status = RewardClient::new(anonymous).compute_returns(returns_request(vec![1.0])).await.expect_err("no token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let wrong = kforge_tests::connect(&mesh, Service::Reward, &with_token(Some(dir.join("wrong")))).await;
    let status = RewardClient::new(wrong).compute_returns(returns_request(vec![1.0])).await.expect_err("wrong token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let right = kforge_tests::connect(&mesh, Service::Reward, &with_token(Some(dir.join("token")))).await;
    let response = RewardClient::new(right).compute_returns(returns_request(vec![1.0, 2.0])).await.expect("authorised");
    assert_eq!(response.into_inner().trajectories[0].values, vec![2.0, 2.0]);
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn tls_serves_clients_that_trust_the_ca() {
    let dir = scratch("tls");
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).expect("self-signed certificate");
    std::fs::write(dir.join("cert.pem"), certified.cert.pem()).expect("cert");
    std::fs::write(dir.join("key.pem"), certified.signing_key.serialize_pem()).expect("key");
    let mut config = MeshConfig::default();
    config.reward.server.tls =
        Some(TlsConfig { cert_file: dir.join("cert.pem"), key_file: dir.join("key.pem"), client_ca_file: None });
    let mesh = kforge::mesh::Mesh::start(&[Service::Reward], &config, true).await.expect("starts");
    let address = mesh.address(Service::Reward).expect("reward runs").to_owned();
    assert!(address.starts_with("https://"), "{address}");

    let trusting = ClientConfig {
        tls_ca_file: Some(dir.join("cert.pem")),
        tls_domain: Some("localhost".into()),
        ..Default::default()
    };
    let channel = kforge_server::client::connect(&address, &trusting).await.expect("tls handshake");
    kforge_test_support::health::until_status(channel.clone(), "kforge.v1.Reward", ServingStatus::Serving).await;
    let response = RewardClient::new(channel).compute_returns(returns_request(vec![4.0])).await.expect("over tls");
    assert_eq!(response.into_inner().trajectories[0].values, vec![4.0]);

    let plaintext = address.replacen("https://", "http://", 1);
    match kforge_server::client::connect(&plaintext, &ClientConfig::default()).await {
        // The HTTP/2 handshake already fails against a TLS listener: that is the refusal.
        Err(_) => {}
        // Or the connection is made lazily and the call is what fails.
        Ok(channel) => {
            RewardClient::new(channel)
                .compute_returns(returns_request(vec![4.0]))
                .await
                .expect_err("plaintext is refused");
        }
    }
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn metrics_count_calls_by_method_and_code() {
    let (mesh, mut reward) = kforge_tests::reward(&MeshConfig::default()).await;
    reward.compute_returns(returns_request(vec![1.0])).await.expect("ok call");
    reward.compute_returns(returns_request(vec![1.0])).await.expect("ok call");
    reward.compute_returns(returns_request(vec![f64::NAN])).await.expect_err("invalid call");

    let address = mesh.address(Service::Reward).expect("reward runs").trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address).await.expect("metrics port");
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: kforge\r\nConnection: close\r\n\r\n").await.expect("request");
    let mut page = String::new();
    stream.read_to_string(&mut page).await.expect("response");
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let line = |code: &str| {
        page.lines()
            .find(|l| {
                l.starts_with("kforge_grpc_requests_total")
                    && l.contains("ComputeReturns")
                    && l.contains(&format!("code=\"{code}\""))
            })
            .unwrap_or_else(|| panic!("no {code} counter in:\n{page}"))
            .to_owned()
    };
    assert!(line("Ok").ends_with(" 2"), "{}", line("Ok"));
    assert!(line("InvalidArgument").ends_with(" 1"), "{}", line("InvalidArgument"));
    assert!(page.contains("service=\"reward\""), "{page}");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn oversized_requests_are_refused_and_the_service_keeps_serving() {
    let mut config = MeshConfig::default();
    config.reward.server.max_message_bytes = 1024;
    let (mesh, mut reward) = kforge_tests::reward(&config).await;
    let status = reward.compute_returns(returns_request(vec![1.0; 1000])).await.expect_err("8 KB > 1 KB");
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");
    reward.compute_returns(returns_request(vec![1.0; 10])).await.expect("small requests still served");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn a_callers_deadline_ends_the_call() {
    let (mesh, mut reward) = kforge_tests::reward(&MeshConfig::default()).await;
    // A million samples take far longer than a microsecond to decode and process.
    let group = pb::AdvantageGroup {
        group_id: "g".into(),
        trajectories: (0..1000)
            .map(|t| pb::TrajectoryValues { trajectory_id: t.to_string(), values: vec![1.0; 1000] })
            .collect(),
    };
    let mut request = tonic::Request::new(pb::ComputeAdvantagesRequest {
        estimator: pb::AdvantageEstimator::Grpo.into(),
        groups: vec![group],
        normalize_std: None,
        epsilon: None,
    });
    request.set_timeout(Duration::from_micros(1));
    let status = reward.compute_advantages(request).await.expect_err("deadline passes");
    assert!(matches!(status.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded), "{status:?}");
    reward.compute_returns(returns_request(vec![1.0])).await.expect("later calls unaffected");
    mesh.shutdown().await.expect("drains");
}

#[tokio::test]
async fn health_goes_not_serving_when_draining() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let mesh = kforge_tests::start(&[Service::Reward], &MeshConfig::default()).await;
    let channel = kforge_tests::connect(&mesh, Service::Reward, &ClientConfig::default()).await;
    let request = HealthCheckRequest { service: "kforge.v1.Reward".into() };
    let mut watch = HealthClient::new(channel).watch(request).await.expect("watch").into_inner();
    let first = watch.message().await.expect("status").expect("a first status");
    assert_eq!(first.status, ServingStatus::Serving as i32);

    let drained = tokio::spawn(mesh.shutdown());
    let next = watch.message().await.expect("status").expect("a status before the stream ends");
    assert_eq!(next.status, ServingStatus::NotServing as i32);
    // The watcher leaves, as a load balancer does once it sees NOT_SERVING; the drain then completes.
    drop(watch);
    drained.await.expect("drain task").expect("drains cleanly");
}

#[tokio::test]
async fn health_follows_readiness_while_serving() {
    use kforge_proto::v1::reward_server::RewardServer;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let config = kforge_server::ServerConfig::listening_on(([127, 0, 0, 1], 0).into());
    let mut host = kforge_server::Host::new("reward", &config).expect("host");
    let (ready, readiness) = tokio::sync::watch::channel(true);
    host.follow_readiness(readiness);
    host.add_service(RewardServer::new(kforge_reward::RewardService));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("listener");
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(host.serve(listener, async {
        let _ = stopped.await;
    }));
    let channel =
        kforge_server::client::connect(&format!("http://{address}"), &ClientConfig::default()).await.expect("connects");
    let request = HealthCheckRequest { service: "kforge.v1.Reward".into() };
    let mut watch = HealthClient::new(channel).watch(request).await.expect("watch").into_inner();
    let mut next = async || {
        let message = tokio::time::timeout(Duration::from_secs(10), watch.message()).await;
        message.expect("a status change within 10 s").expect("status").expect("a status").status
    };
    let mut status = next().await;
    if status != ServingStatus::Serving as i32 {
        status = next().await;
    }
    assert_eq!(status, ServingStatus::Serving as i32);

    // A device quarantined: not ready; and back.
    ready.send_replace(false);
    assert_eq!(next().await, ServingStatus::NotServing as i32);
    ready.send_replace(true);
    assert_eq!(next().await, ServingStatus::Serving as i32);
    drop(watch);
    let _ = stop.send(());
    served.await.expect("serve task").expect("serves and drains");
}
