//! Usage and cost: Prometheus metrics per model and backend (tokens, TTFT, latency, attempts and errors by
//! class, affinity hits), and each request's cost from the pool's price table, attributed to its job.
//!
//! The metrics join the host's registry, so they are served at `/metrics` beside the per-method gRPC metrics
//! every kforge service has. A job's dollars are `kforge_gateway_cost_usd_total{job=...}` summed over models;
//! each response also carries its own `usage.cost_usd`, so the orchestrator can attribute cost per kernel.
//!
//! Every series of a configured model and backend exists from the start at 0 ([`Accounting::create_pool`]):
//! Prometheus's `rate` counts increases between scrapes, so a series created by its first event would hide that
//! event from the dashboards. A job's cost series cannot be made ahead of the job: it is made, at 0, when the
//! job's first request to a priced pool arrives.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::backends::UsageOut;
use crate::config::Price;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendLabels {
    model: String,
    backend: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    model: String,
    backend: String,
    /// `prompt`, `completion`, `cached_prompt` or `reasoning`.
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    model: String,
    backend: String,
    /// `ok` or the error class.
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CostLabels {
    model: String,
    job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AffinityLabels {
    model: String,
    /// `hit` (the episode's home served it) or `miss`.
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model: String,
    /// `ok` or the gRPC code name.
    code: String,
}

/// The gateway's metrics (prefix `kforge_gateway_`).
#[derive(Debug, Clone)]
pub struct Accounting {
    tokens: Family<TokenLabels, Counter>,
    ttft: Family<BackendLabels, Histogram>,
    latency: Family<BackendLabels, Histogram>,
    attempts: Family<AttemptLabels, Counter>,
    cost: Family<CostLabels, Counter<f64, AtomicU64>>,
    affinity: Family<AffinityLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
}

/// `attempts_total`'s outcomes: `ok` and every `AttemptError::class`.
const ATTEMPT_OUTCOMES: [&str; 10] = [
    "ok",
    "connect",
    "deadline",
    "rate_limited",
    "upstream_timeout",
    "server_error",
    "client_error",
    "broken_stream",
    "malformed",
    "replay_miss",
];

/// `tokens_total`'s kinds.
const TOKEN_KINDS: [&str; 4] = ["prompt", "completion", "cached_prompt", "reasoning"];

fn seconds_histogram() -> Histogram {
    // 1 ms to ~9 minutes: a cached replay answer to a long reasoning generation.
    Histogram::new(exponential_buckets(0.001, 2.0, 20))
}

impl Accounting {
    pub fn register(registry: &mut Registry) -> Self {
        let this = Self {
            tokens: Family::default(),
            ttft: Family::new_with_constructor(seconds_histogram),
            latency: Family::new_with_constructor(seconds_histogram),
            attempts: Family::default(),
            cost: Family::default(),
            affinity: Family::default(),
            requests: Family::default(),
        };
        let gateway = registry.sub_registry_with_prefix("kforge_gateway");
        gateway.register("tokens", "tokens by model, backend and kind", this.tokens.clone());
        gateway.register("ttft_seconds", "time to each completion's first token", this.ttft.clone());
        gateway.register("latency_seconds", "time to each completion's end", this.latency.clone());
        gateway.register("attempts", "upstream attempts by outcome (ok or error class)", this.attempts.clone());
        gateway.register("cost_usd", "cost in US dollars from the pools' price tables, by job", this.cost.clone());
        gateway.register("affinity", "affinity-routed attempts served by the episode's home", this.affinity.clone());
        gateway.register("requests", "generation requests by final status", this.requests.clone());
        this
    }

    /// Creates, at 0, every series of `model` served by `backends`: tokens by kind, TTFT and latency, attempts by
    /// outcome, requests by each gRPC code, and affinity hits and misses where the pool routes by affinity.
    pub fn create_pool(&self, model: &str, backends: &[String], affinity: bool) {
        for backend in backends {
            for kind in TOKEN_KINDS {
                let _ = self.tokens.get_or_create(&TokenLabels { model: model.into(), backend: backend.clone(), kind });
            }
            let labels = BackendLabels { model: model.into(), backend: backend.clone() };
            let _ = self.ttft.get_or_create(&labels);
            let _ = self.latency.get_or_create(&labels);
            for outcome in ATTEMPT_OUTCOMES {
                let _ = self.attempts.get_or_create(&AttemptLabels {
                    model: model.into(),
                    backend: backend.clone(),
                    outcome,
                });
            }
        }
        for code in (0..=16).map(tonic::Code::from) {
            let _ = self
                .requests
                .get_or_create(&RequestLabels { model: model.into(), code: kforge_server::code_name(code) });
        }
        if affinity {
            for result in ["hit", "miss"] {
                let _ = self.affinity.get_or_create(&AffinityLabels { model: model.into(), result });
            }
        }
    }

    /// Creates `job`'s cost series for `model` at 0 when its first request arrives, so that the cost of the
    /// request counts in `rate` (where a scrape falls between its arrival and its answer).
    pub fn job_request(&self, model: &str, job: &str) {
        let _ = self.cost.get_or_create(&CostLabels { model: model.into(), job: job.into() });
    }

    pub fn attempt(&self, model: &str, backend: &str, outcome: &'static str) {
        self.attempts.get_or_create(&AttemptLabels { model: model.into(), backend: backend.into(), outcome }).inc();
    }

    pub fn affinity(&self, model: &str, hit: bool) {
        let result = if hit { "hit" } else { "miss" };
        self.affinity.get_or_create(&AffinityLabels { model: model.into(), result }).inc();
    }

    pub fn request(&self, model: &str, code: &str) {
        self.requests.get_or_create(&RequestLabels { model: model.into(), code: code.into() }).inc();
    }

    /// Records a served request: its tokens, each completion's TTFT and latency, and its cost.
    pub fn served(&self, model: &str, backend: &str, job: &str, usage: &UsageOut, timings: &[(f64, f64)], cost: f64) {
        let labels = BackendLabels { model: model.into(), backend: backend.into() };
        for (kind, count) in [
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
            ("cached_prompt", usage.cached_prompt_tokens),
            ("reasoning", usage.reasoning_tokens),
        ] {
            if count > 0 {
                self.tokens
                    .get_or_create(&TokenLabels { model: model.into(), backend: backend.into(), kind })
                    .inc_by(count);
            }
        }
        for &(ttft, latency) in timings {
            self.ttft.get_or_create(&labels).observe(ttft);
            self.latency.get_or_create(&labels).observe(latency);
        }
        if cost > 0.0 {
            self.cost.get_or_create(&CostLabels { model: model.into(), job: job.into() }).inc_by(cost);
        }
    }
}

/// Dollars for `usage` at `price`: uncached prompt tokens at the input price, cached ones at the cached price
/// (the input price when none is set), completion tokens at the output price.
pub fn cost_usd(price: &Price, usage: &UsageOut) -> f64 {
    let cached = usage.cached_prompt_tokens.min(usage.prompt_tokens);
    let uncached = usage.prompt_tokens - cached;
    let cached_price = price.cached_input_per_mtok.unwrap_or(price.input_per_mtok);
    (uncached as f64 * price.input_per_mtok
        + cached as f64 * cached_price
        + usage.completion_tokens as f64 * price.output_per_mtok)
        / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_prices_cached_tokens_apart() {
        let price = Price { input_per_mtok: 2.0, cached_input_per_mtok: Some(0.5), output_per_mtok: 8.0 };
        let usage = UsageOut {
            prompt_tokens: 1_000_000,
            cached_prompt_tokens: 400_000,
            completion_tokens: 500_000,
            reasoning_tokens: 0,
        };
        let cost = cost_usd(&price, &usage);
        assert!((cost - (1.2 + 0.2 + 4.0)).abs() < 1e-9, "{cost}");
        assert_eq!(cost_usd(&Price::default(), &usage), 0.0);
    }
}
