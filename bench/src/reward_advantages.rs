//! ComputeAdvantages over one million turn-samples: the pure function in-process, and the same batch through the
//! Reward RPC on loopback (encode, transfer, decode, compute, and back), in one run on one machine.
//!
//! Run: `cargo run --release -p kforge-bench --bin reward-advantages` (pin to one core with `taskset -c 0`).

use std::time::{Duration, Instant};

use kforge::mesh::{Mesh, MeshConfig, Service};
use kforge_proto::v1 as pb;
use kforge_reward_core::{Estimator, compute_advantages};

const GROUPS: usize = 8192;
const TRAJECTORIES: usize = 16;
const TURNS: usize = 9;
const RUNS: usize = 7;

/// Deterministic returns in [0, 4), ragged: trajectory t of a group stops after `TURNS - t % 3` turns.
fn batch() -> Vec<Vec<Vec<f64>>> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 4.0
    };
    (0..GROUPS).map(|_| (0..TRAJECTORIES).map(|t| (0..TURNS - t % 3).map(|_| next()).collect()).collect()).collect()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn time<T>(mut f: impl FnMut() -> T) -> (Duration, Duration) {
    let samples: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .collect();
    let min = *samples.iter().min().expect("RUNS > 0");
    (median(samples), min)
}

/// ComputeAdvantages over one million turn-samples, in-process and through the Reward RPC on loopback. It takes no
/// flags: the batch and the number of runs are fixed.
#[derive(clap::Parser)]
#[command(name = "reward-advantages")]
struct Args {}

fn main() {
    let Args {} = clap::Parser::parse();
    let groups = batch();
    let samples: usize = groups.iter().flatten().map(Vec::len).sum();
    println!(
        "batch: {GROUPS} groups x {TRAJECTORIES} trajectories, ragged up to {TURNS} turns = {samples} turn-samples"
    );
    println!("runs per figure: {RUNS}; figures are median (min)");

    let estimators = [
        ("grpo", Estimator::GRPO, pb::AdvantageEstimator::Grpo),
        ("turn_mean", Estimator::TurnMean, pb::AdvantageEstimator::TurnMean),
        ("trloo", Estimator::Trloo, pb::AdvantageEstimator::Trloo),
        ("rloo", Estimator::Rloo, pb::AdvantageEstimator::Rloo),
    ];
    for (name, estimator, _) in estimators {
        let (median, min) = time(|| compute_advantages(estimator, &groups).expect("valid batch"));
        println!("in-process {name:<10} {:>8.1} ms ({:.1} ms)", ms(median), ms(min));
    }

    let request = |estimator: pb::AdvantageEstimator| pb::ComputeAdvantagesRequest {
        estimator: estimator.into(),
        groups: groups
            .iter()
            .enumerate()
            .map(|(g, group)| pb::AdvantageGroup {
                group_id: format!("g{g}"),
                trajectories: group
                    .iter()
                    .enumerate()
                    .map(|(t, values)| pb::TrajectoryValues { trajectory_id: format!("t{t}"), values: values.clone() })
                    .collect(),
            })
            .collect(),
        normalize_std: None,
        epsilon: None,
    };
    let encoded = prost::Message::encoded_len(&request(pb::AdvantageEstimator::Grpo));
    println!("request size: {:.1} MB", encoded as f64 / 1e6);

    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let mut config = MeshConfig::default();
        config.reward.server.max_message_bytes = 64 * 1024 * 1024;
        let mesh = Mesh::start(&[Service::Reward], &config, true).await.expect("reward starts");
        let address = mesh.address(Service::Reward).expect("reward runs").to_owned();
        let channel = kforge_server::client::connect(&address, &Default::default()).await.expect("connects");
        let mut client = pb::reward_client::RewardClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024)
            .max_encoding_message_size(64 * 1024 * 1024);
        for (name, _, wire) in estimators {
            let mut samples = Vec::with_capacity(RUNS);
            for _ in 0..RUNS {
                let message = request(wire);
                let start = Instant::now();
                let response = client.compute_advantages(message).await.expect("rpc succeeds");
                samples.push(start.elapsed());
                std::hint::black_box(response);
            }
            let min = *samples.iter().min().expect("RUNS > 0");
            println!("rpc        {name:<10} {:>8.1} ms ({:.1} ms)", ms(median(samples)), ms(min));
        }
        mesh.shutdown().await.expect("drains");
    });
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
