//! The job store a command opens: where `kforge run` keeps it (and `kforge run --resume` and `kforge export` find
//! it), the report directory beside it, a stored job's spec, and a store URL as it may be shown.

use std::path::{Path, PathBuf};

use kforge_proto::v1 as pb;

use crate::mesh::MeshConfig;

/// Where `kforge run` keeps its store when the config names none: `orchestrator.db` in `work_dir`, else in the
/// default state directory (so that `kforge run --resume` and `kforge export` find the job later). The in-process
/// orchestrator owns its jobs as `kforge-run` and resumes none at start: only `--resume JOB` takes one over.
pub fn store_for_run(config: &mut MeshConfig, work_dir: Option<&Path>) {
    if let Some(dir) = work_dir {
        config.orchestrator.store = dir.join("orchestrator.db").display().to_string();
    }
    config.orchestrator.instance = RUN_INSTANCE.into();
    config.orchestrator.resume_on_start = false;
}

/// Where `kforge run` writes a job's report: `reports/<job>` beside the SQLite store file (the work directory, or
/// the default state directory), or under `kforge-reports/` in the current directory for a store that is not a file.
pub fn report_dir(config: &MeshConfig, job_id: &str) -> PathBuf {
    let store = match config.orchestrator.store.as_str() {
        "" => kforge_orchestrator::store::default_url(),
        store => store.to_owned(),
    };
    match sqlite_file(&store).and_then(Path::parent) {
        Some(dir) => dir.join("reports").join(job_id),
        None => PathBuf::from("kforge-reports").join(job_id),
    }
}

/// The orchestrator instance name of `kforge run`.
pub const RUN_INSTANCE: &str = "kforge-run";

/// The spec of a stored job, read from the store directly (`kforge run --resume` needs its model before it starts
/// the mesh that will run it).
pub async fn stored_spec(config: &MeshConfig, job_id: &str) -> anyhow::Result<pb::JobSpec> {
    use anyhow::Context as _;
    let url = config.orchestrator.store_url();
    let shown = redact_url(&url);
    let store =
        kforge_orchestrator::store::Store::open(&url).await.with_context(|| format!("opening the store {shown}"))?;
    let job = store.job(job_id).await?.with_context(|| format!("job {job_id} is not in the store {shown}"))?;
    job.spec.with_context(|| format!("job {job_id} has no stored spec"))
}

/// A store URL as it may be shown: the password of `scheme://user:password@host/...` replaced by `***`.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    // The user information ends at the last `@` before the path: a password may hold `@` or `/` only escaped.
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else { return url.to_owned() };
    match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

/// The SQLite file a store URL names (`sqlite://PATH`, `sqlite:PATH` or a bare path); `None` for PostgreSQL and
/// in-memory stores.
pub fn sqlite_file(store: &str) -> Option<&Path> {
    if store.contains(":memory:") || store.starts_with("postgres://") || store.starts_with("postgresql://") {
        return None;
    }
    let path = store.strip_prefix("sqlite://").or_else(|| store.strip_prefix("sqlite:")).unwrap_or(store);
    // Connection options after the path (`sqlite://x.db?mode=ro`) are not part of it.
    let path = path.split('?').next().unwrap_or(path);
    (!path.is_empty()).then(|| Path::new(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_url_is_shown_without_its_password() {
        assert_eq!(
            redact_url("postgres://kforge:s3cr@t@db.internal:5432/kforge?sslmode=require"),
            "postgres://kforge:***@db.internal:5432/kforge?sslmode=require"
        );
        assert_eq!(redact_url("postgres://kforge@db/kforge"), "postgres://kforge@db/kforge", "no password");
        assert_eq!(redact_url("postgres://db/kforge"), "postgres://db/kforge");
        assert_eq!(
            redact_url("/home/u/.local/state/kforge/orchestrator.db"),
            "/home/u/.local/state/kforge/orchestrator.db"
        );
        assert_eq!(redact_url("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db", "an @ in the path is not a user");
    }

    #[test]
    fn the_sqlite_file_of_a_store_url() {
        assert_eq!(sqlite_file("/w/orchestrator.db"), Some(Path::new("/w/orchestrator.db")));
        assert_eq!(sqlite_file("sqlite:///w/o.db?mode=rwc"), Some(Path::new("/w/o.db")));
        assert_eq!(sqlite_file("sqlite:o.db"), Some(Path::new("o.db")));
        assert_eq!(sqlite_file("sqlite::memory:"), None);
        assert_eq!(sqlite_file("postgres://u:p@db/k"), None);
    }
}
