//! A gateway serving on a loopback port for a test, with a client to it; stopped when dropped.

#![allow(dead_code)] // each test crate uses part of it

use kforge_gateway::GatewayConfig;
use kforge_proto::v1::gateway_client::GatewayClient;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::transport::Channel;

pub struct Gateway {
    pub client: GatewayClient<Channel>,
    pub addr: String,
    _stop: oneshot::Sender<()>,
}

pub async fn start(config: GatewayConfig) -> Gateway {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(async move {
        kforge_gateway::serve(config, listener, async {
            let _ = stopped.await;
        })
        .await
        .expect("the gateway serves");
    });
    let client = GatewayClient::connect(addr.clone()).await.expect("connect");
    Gateway { client, addr, _stop: stop }
}
