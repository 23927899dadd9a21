//! A fleet simulated on one machine (`kforge_bench::fleet`): evaluator endpoints of unequal capacity whose
//! evaluations take the recorded KernelBench times times `--time-scale`, 2-4 orchestrator replicas on one
//! PostgreSQL (a throwaway cluster, `kforge_test_support::Postgres`), thousands of trajectories; optionally a share
//! of the endpoints lost and a replica killed mid-run. Prints JSON: turns per second, the orchestrator's overhead
//! per turn, the store's write rate and share, how evenly load landed on the endpoints, what the losses did.
//!
//! ```text
//! orchestrator-fleet [--endpoints 100] [--capacities 64,96,128,192] [--trajectories 10000] [--jobs 8]
//!                    [--per-task 8] [--turns 4] [--replicas 2] [--replica-threads 1] [--time-scale 0.01]
//!                    [--generate-ms 0] [--lease-ms 3000] [--lose-share 0.1] [--lose-at 0.3]
//!                    [--loss drain|kill] [--notice-ms 1000] [--kill-at 0.5]
//! ```

use std::time::Duration;

use kforge_bench::fleet::{self, FleetConfig, Lose, Loss};

#[derive(clap::Parser)]
#[command(name = "orchestrator-fleet")]
struct Args {
    /// Evaluator endpoints.
    #[arg(long, default_value_t = 100)]
    endpoints: usize,
    /// Capacities given to the endpoints in turn.
    #[arg(long, value_delimiter = ',', default_value = "64,96,128,192")]
    capacities: Vec<u32>,
    /// Trajectories in all, every one in flight at once.
    #[arg(long, default_value_t = 10_000)]
    trajectories: u32,
    /// Jobs they are spread over, submitted round-robin to the replicas.
    #[arg(long, default_value_t = 8)]
    jobs: u32,
    /// Trajectories per task.
    #[arg(long, default_value_t = 8)]
    per_task: u32,
    /// Turns per trajectory.
    #[arg(long, default_value_t = 4)]
    turns: u32,
    #[arg(long, default_value = "kevin")]
    recipe: String,
    /// Orchestrator replicas.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Worker threads of each replica's runtime.
    #[arg(long, default_value_t = 1)]
    replica_threads: usize,
    /// An evaluation takes its recorded time (mean 26.5 s) times this.
    #[arg(long, default_value_t = 0.01)]
    time_scale: f64,
    /// A generation's mean time, in milliseconds (0: at once).
    #[arg(long, default_value_t = 0)]
    generate_ms: u64,
    /// The replicas' lease_ms.
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// The share of endpoints lost mid-run (0: none).
    #[arg(long, default_value_t = 0.0)]
    lose_share: f64,
    /// When: the share of the turns' evaluations answered.
    #[arg(long, default_value_t = 0.3)]
    lose_at: f64,
    /// How: drain (removed from discovery, calls in flight finish) or kill (calls in flight and arriving fail).
    #[arg(long, default_value = "drain", value_parser = loss)]
    loss: Loss,
    /// How long a killed endpoint stays listed, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    notice_ms: u64,
    /// Kill replica 0 when this share of the turns' evaluations is answered.
    #[arg(long)]
    kill_at: Option<f64>,
}

fn loss(text: &str) -> Result<Loss, String> {
    match text {
        "drain" => Ok(Loss::Drain),
        "kill" => Ok(Loss::Kill),
        other => Err(format!("drain or kill, not {other}")),
    }
}

#[tokio::main]
async fn main() {
    let args: Args = clap::Parser::parse();
    let Some(postgres) = kforge_test_support::Postgres::start("fleet") else { return };
    let config = FleetConfig {
        endpoints: args.endpoints,
        capacities: args.capacities,
        trajectories: args.trajectories,
        jobs: args.jobs,
        per_task: args.per_task,
        turns: args.turns,
        recipe: args.recipe,
        replicas: args.replicas,
        replica_threads: args.replica_threads,
        time_scale: args.time_scale,
        generate_ms: args.generate_ms,
        lease_ms: args.lease_ms,
        lose: (args.lose_share > 0.0).then_some(Lose {
            share: args.lose_share,
            at: args.lose_at,
            loss: args.loss,
            notice: Duration::from_millis(args.notice_ms),
        }),
        kill_at: args.kill_at,
    };
    let outcome = fleet::run(&config, &postgres.url).await;
    let mut report = outcome.report;
    report["machine"] = serde_json::json!({
        "nproc": std::thread::available_parallelism().map_or(0, |n| n.get()),
    });
    println!("{report:#}");
}
