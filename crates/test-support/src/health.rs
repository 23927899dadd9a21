//! Readiness: a service is ready when grpc.health.v1's Watch stream says SERVING (following the stream waits
//! exactly as long as the server takes, with no polling); a server that serves no health service (the fake peers, a
//! child process) is ready once it accepts a connection.

use kforge_server::client::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Follows the health Watch stream of `name` (`""`: the whole server) until it reports `status`; returns every
/// status seen on the way. Panics if the stream ends first (the server went away).
pub async fn until_status(channel: Channel, name: &str, status: ServingStatus) -> Vec<ServingStatus> {
    let mut health = HealthClient::new(channel);
    let mut stream = health.watch(HealthCheckRequest { service: name.into() }).await.expect("watch").into_inner();
    let mut seen = Vec::new();
    // `message()` fails or ends when the server goes away; either way no further status will come.
    while let Some(response) = stream.message().await.ok().flatten() {
        let current = ServingStatus::try_from(response.status).expect("a known serving status");
        seen.push(current);
        if current == status {
            return seen;
        }
    }
    panic!("health of {name} ended before {status:?}: {seen:?}");
}

/// [`until_status`] SERVING.
pub async fn until_serving(channel: Channel, name: &str) -> Vec<ServingStatus> {
    until_status(channel, name, ServingStatus::Serving).await
}

/// A channel to `url` once its server accepts connections (a child process that is starting), for at most
/// `patience`; panics with the last connection error after that.
pub async fn connected(url: &str, patience: std::time::Duration) -> tonic::transport::Channel {
    let endpoint = tonic::transport::Endpoint::from_shared(url.to_owned()).expect("a valid url");
    crate::Wait::new(format!("{url} to accept connections")).within(patience).until(|| endpoint.connect()).await
}
