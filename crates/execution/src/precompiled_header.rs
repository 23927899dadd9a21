//! torch's extension header, precompiled for load_inline's bindings.
//!
//! Every load_inline extension compiles a `main.cpp` that starts with `#include <torch/extension.h>` and declares
//! the candidate's functions to Python. Reading that header is most of the file's cost (on the 2-core machine, 38 s
//! of a 38 s compile without optimisation; 13 s with the header precompiled: docs/evaluator/COMPILE.md). At start, the
//! engine precompiles it in a trusted stage (harness mode `bindings_pch`: no candidate code) with the flags
//! torch gives the bindings, for each set of extra flags in [`VARIANTS`], into a cache entry (`work_dir/pch/`,
//! bounded by `cache_limits.bindings_pch_bytes`), beside a stub `torch/extension.h` that includes torch's own.
//! Compiles then get that directory on the compiler's include path (`CPATH`), read-only: gcc takes a precompiled
//! header only where the compile's flags match the ones it was built with, and reads the header itself otherwise,
//! so a candidate with other flags builds as before. Device code is not touched (nvcc's `.cu` build includes
//! `torch/types.h`, and gcc uses no precompiled header when it only preprocesses).
//!
//! On a GPU machine with kforge's nvcc, the same stage precompiles the prefix of nvcc's host compile (the headers it starts with) for a source
//! that includes `torch/types.h` (harness/kforge_nvcc.py, `HostPch`), per variant as extra nvcc flags, into the
//! entry's `nvcc-host/`; compiles name it in `KFORGE_HOST_PCH`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kforge_sandbox::{Sandbox, tail};
use tokio_util::sync::CancellationToken;

use crate::cache::{self, Cache, Entry, EntryLock};
use crate::protocol::BindingsPchSpec;
use crate::python::PythonEnv;
use crate::stage::{self, Request, Stage};

/// The extra flags (load_inline's `extra_cflags`) precompiled for: none, torch's default and the kernels in the
/// benchmark's set, and `-O3`, the most common choice of generated candidates. About 0.8 GB each.
pub const VARIANTS: [(&str, &[&str]); 2] = [("default", &[]), ("O3", &["-O3"])];

/// Why there is no precompiled bindings header; compiles then read the header as load_inline does.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    #[error("bindings header cache: {0}")]
    Cache(#[from] std::io::Error),
    /// The build failed: the harness's report (remembered in the cache), or why the stage gave none.
    #[error("{0}")]
    Failed(String),
    #[error("evicted as soon as it was built")]
    Evicted,
}

/// Builds the precompiled header into `cache` (or finds it built, by an earlier start or another evaluator sharing
/// the work directory) and returns its directory, pinned while the returned lock is held. `Err` says why there is
/// none.
pub async fn build(
    sandbox: &Sandbox,
    python: &PythonEnv,
    harness: &Path,
    cache: &Cache,
    scratch: &Path,
    wall: Duration,
) -> Result<(PathBuf, EntryLock), Unavailable> {
    let variants: Vec<String> = VARIANTS.iter().map(|(name, flags)| format!("{name}={};", flags.join(" "))).collect();
    // The entry holds the precompiled prefixes of nvcc's host compile too (kforge_nvcc.HostPch, `nvcc-host/`).
    let key = cache::key(&[python.versions_key().as_bytes(), variants.concat().as_bytes(), b"nvcc-host"]);
    let ready = |entry: Option<Entry>| match entry {
        Some(Entry::Ready(_)) => Some(Ok(())),
        Some(Entry::Failed(reason)) => Some(Err(reason)),
        None => None,
    };
    if ready(cache.get(&key)).is_none() {
        let lock = cache.lock(&key).await?;
        if ready(cache.get(&key)).is_none() {
            let dir = cache.dir(&key);
            std::fs::create_dir_all(&dir)?;
            let started = Instant::now();
            match run(sandbox, python, harness, &dir, scratch, wall).await {
                Ok(built) => {
                    tracing::info!(dir = %dir.display(), ?built, seconds = started.elapsed().as_secs_f64(), "bindings header precompiled");
                    cache.complete(&key, &Entry::Ready(built.join(" ")), &lock)?;
                }
                // The harness reported it (no compiler, a header that does not build): the same next time.
                Err(Failure::Reported(reason)) => cache.complete(&key, &Entry::Failed(reason), &lock)?,
                Err(Failure::Other(reason)) => {
                    cache.discard(&key, &lock);
                    return Err(Unavailable::Failed(reason));
                }
            }
        }
    }
    let pin = cache.pin(&key).await?;
    match ready(cache.get(&key)) {
        Some(Ok(())) => Ok((cache.dir(&key), pin)),
        Some(Err(reason)) => Err(Unavailable::Failed(reason)),
        None => Err(Unavailable::Evicted),
    }
}

/// Why no header was precompiled: reported by the harness (remembered), or anything else (tried again next start).
enum Failure {
    Reported(String),
    Other(String),
}

/// Runs the harness's `bindings_pch` mode, writing into `out`; returns the variants built.
async fn run(
    sandbox: &Sandbox,
    python: &PythonEnv,
    harness: &Path,
    out: &Path,
    scratch: &Path,
    wall: Duration,
) -> Result<Vec<String>, Failure> {
    let cuda = !python.gpus.is_empty();
    let stage = Stage {
        scratch: scratch.to_owned(),
        readable: vec![],
        writable: vec![out.to_owned()],
        // The flags of a GPU machine's builds: torch adds CUDA's include directory to them.
        env: python.env_on(scratch, cuda.then_some(0)),
        wall,
        background: true,
        launcher: vec![],
    };
    let variants = VARIANTS
        .iter()
        .map(|(name, flags)| (name.to_string(), flags.iter().map(|flag| flag.to_string()).collect()))
        .collect();
    let request = Request::plain(BindingsPchSpec { out_dir: out.to_owned(), variants, cuda });
    let started = stage::start(sandbox, python, harness, stage, CancellationToken::new());
    let outcome = started.run(request, None).await.map_err(|e| Failure::Other(e.to_string()))?;
    let Some(report) = &outcome.result else {
        return Err(Failure::Other(format!(
            "the bindings_pch stage ended without a result: {}",
            tail(&outcome.error_text(), 4000)
        )));
    };
    let result = &report.body;
    if !outcome.ok() {
        let detail = result.failed.as_ref().map_or_else(|| outcome.error_text(), json);
        return Err(Failure::Reported(format!("the bindings header did not precompile: {}", tail(&detail, 4000))));
    }
    if let Some(failed) = result.failed.as_ref().filter(|f| !f.is_empty()) {
        tracing::warn!(failed = %tail(&json(failed), 4000), "some bindings headers were not precompiled");
    }
    // The precompiled prefixes of nvcc's host compile (GPU machines with kforge's nvcc): without one, builds parse it as before.
    if !result.host.is_empty() {
        let failed: std::collections::BTreeMap<_, _> = result.host.iter().filter(|(_, why)| why.is_some()).collect();
        if failed.is_empty() {
            tracing::info!(variants = result.host.len(), "nvcc's host compile precompiled");
        } else {
            tracing::warn!(failed = %tail(&json(&failed), 4000), "some prefixes of nvcc's host compile were not precompiled");
        }
    }
    Ok(result.built.clone())
}

/// A map as JSON text, for the log.
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}
