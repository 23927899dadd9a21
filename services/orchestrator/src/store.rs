//! Where jobs and their turns are kept: one interface, [`Store`], over SQLite (the default: a file, nothing to
//! install; `sqlite::memory:` for tests) or PostgreSQL (by URL, for clusters), through sqlx with migrations
//! embedded per backend (`migrations/sqlite`, `migrations/postgres`).
//!
//! Messages are stored proto-encoded (a `kforge.v1.Job`, a `kforge.v1.TurnRecord`), so fields other parts of
//! kforge add to them flow through untouched; beside them are the columns the orchestrator queries. Every write is
//! idempotent: a job by its idempotency key, a turn by (job, task, trajectory, turn) and its [`Stage`] — a later
//! stage replaces an earlier one, never the reverse — so a resumed job can write a turn again without duplicating
//! or regressing it. Each write is one statement or one transaction, committed before the call returns.

use std::str::FromStr;
use std::sync::Arc;

use kforge_proto::v1 as pb;
use prost::Message as _;
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// Why the store could not answer.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's URL is not one this build understands.
    #[error("store url `{url}`: {message}")]
    BadUrl { url: String, message: String },
    /// The database could not be reached, or refused the statement.
    #[error("store unavailable: {0}")]
    Database(#[from] sqlx::Error),
    /// The schema could not be brought up to date.
    #[error("store migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// A stored message no longer decodes (a corrupted row, or one written by an incompatible version).
    #[error("stored {what} does not decode: {source}")]
    Corrupt { what: &'static str, source: prost::DecodeError },
}

/// How far a turn got. Stored as its number; a write never lowers a turn's stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// The model's response is stored (the record holds the prompt, completion, usage and kernel).
    Generated = 1,
    /// The evaluation is stored too.
    Evaluated = 2,
    /// Scored, diagnosed and complete: the turn counts as recorded.
    Recorded = 3,
}

impl Stage {
    fn from_i64(value: i64) -> Self {
        match value {
            1 => Self::Generated,
            2 => Self::Evaluated,
            _ => Self::Recorded,
        }
    }
}

/// A turn's place in its job's order: (task position, trajectory, turn). Export cursors are built from it.
pub type TurnPosition = (i64, u32, u32);

/// A job as listed: its listing sequence (ListJobs pages by it) and the job.
#[derive(Debug, Clone)]
pub struct ListedJob {
    pub seq: i64,
    pub job: pb::Job,
}

#[derive(Debug, Clone)]
enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Runs `$body` with `$p` bound to the pool of whichever backend the store uses. The SQL is shared: both accept
/// `$n` placeholders, `ON CONFLICT ... DO UPDATE` and row-value comparisons.
macro_rules! on_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            Pool::Sqlite($p) => $body,
            Pool::Postgres($p) => $body,
        }
    };
}

/// What a committed write to a SQLite file survives (PostgreSQL's durability is the server's to configure).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// A killed orchestrator (kill -9, a crash, an out-of-memory kill): the commit is in the write-ahead log in the
    /// kernel's page cache when it returns (`synchronous = NORMAL` in WAL mode; the log is synced at checkpoints).
    /// The last commits may roll back after a power loss or a kernel crash, never corrupting the file.
    #[default]
    Process,
    /// Power loss too: every commit waits for its fsync (`synchronous = FULL`; slower: on the GPU machine's disk,
    /// p99 per turn 40 ms against 36 ms pinned to two cores, bench/results/orchestrator-overhead/2026-11-25-dev).
    PowerLoss,
}

impl Durability {
    fn synchronous(self) -> SqliteSynchronous {
        match self {
            Durability::Process => SqliteSynchronous::Normal,
            Durability::PowerLoss => SqliteSynchronous::Full,
        }
    }
}

/// Jobs and their turn records, in SQLite or PostgreSQL.
#[derive(Debug, Clone)]
pub struct Store {
    pool: Pool,
    /// A SQLite file's checkpoints, run on a connection of their own while the store lives.
    _checkpoints: Option<Arc<Checkpoints>>,
}

/// How often a SQLite file's write-ahead log is copied back into the database, off the writers' connection. SQLite's
/// automatic checkpoint runs inside the commit that crosses 1000 pages of log, and every turn queued behind that
/// commit: the orchestrator's p99 overhead per turn was 6.7 ms with it and 3.5-4.0 ms without
/// (bench/results/orchestrator-overhead/2026-11-25-dev).
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The write-ahead log's size past which a checkpoint waits for the writer and truncates the log. A PASSIVE
/// checkpoint copies the log back but never shrinks the file, and the log starts over only when a checkpoint has
/// caught up with it: turns committed back to back (peers that answer at once, every turn failing) never let it,
/// and the log grew to 164 MB for 15,821 failed turns whose database was 30 MB
/// (bench/results/orchestrator-store-growth/2026-11-28-dev). Crossing it costs the writers one wait for a checkpoint.
const WAL_LIMIT_BYTES: u64 = 64 << 20;

/// The checkpointing task; aborted with the last clone of its store.
#[derive(Debug)]
struct Checkpoints(tokio::task::JoinHandle<()>);

impl Drop for Checkpoints {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Checkpoints {
    /// Checkpoints (PASSIVE: it never waits for the writer, nor makes it wait) every [`CHECKPOINT_EVERY`]; once the
    /// log at `wal` is over [`WAL_LIMIT_BYTES`], a TRUNCATE checkpoint instead (it waits for the writer).
    fn start(pool: SqlitePool, wal: std::path::PathBuf) -> Self {
        Self(tokio::spawn(async move {
            let mut every = tokio::time::interval(CHECKPOINT_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                // One stat of a local file: not worth a blocking thread.
                let over = std::fs::metadata(&wal).is_ok_and(|m| m.len() > WAL_LIMIT_BYTES);
                let mode = if over { "TRUNCATE" } else { "PASSIVE" };
                if let Err(error) = sqlx::query(&format!("PRAGMA wal_checkpoint({mode})")).execute(&pool).await {
                    tracing::warn!(%error, mode, "store checkpoint failed; the next one tries again");
                }
            }
        }))
    }
}

impl Store {
    /// Opens the store at `url` and brings its schema up to date: `postgres://...` or `postgresql://...`;
    /// `sqlite://PATH` or a plain path (the file is created when missing); `sqlite::memory:` (one connection, gone
    /// with the store).
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::open_with(url, Durability::default()).await
    }

    /// [`Store::open`], with what a SQLite file's commit survives.
    pub async fn open_with(url: &str, durability: Durability) -> Result<Self, StoreError> {
        let bad = |message: String| StoreError::BadUrl { url: url.to_owned(), message };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = PgPoolOptions::new().max_connections(8).connect(url).await?;
            POSTGRES_MIGRATIONS.run(&pool).await?;
            return Ok(Self { pool: Pool::Postgres(pool), _checkpoints: None });
        }
        if url.is_empty() {
            return Err(bad("empty".into()));
        }
        let memory = url == "sqlite::memory:" || url == ":memory:";
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url).map_err(|e| bad(e.to_string()))?
        } else if url.contains("://") {
            return Err(bad("expected postgres://, sqlite:// or a file path".into()));
        } else {
            SqliteConnectOptions::new().filename(url)
        };
        let options = options
            .create_if_missing(true)
            // WAL lets readers (GetJob, exports) run beside the writer.
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(durability.synchronous())
            .busy_timeout(std::time::Duration::from_secs(30));
        if let Some(parent) = options.get_filename().parent().filter(|p| !memory && !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| bad(format!("cannot create {}: {e}", parent.display())))?;
        }
        let pool_options = if memory {
            // Every connection to `:memory:` is a database of its own: keep exactly one, forever.
            SqlitePoolOptions::new().max_connections(1).min_connections(1).idle_timeout(None).max_lifetime(None)
        } else {
            // One connection: this process's writers queue here, in order, instead of meeting SQLite's lock on
            // several connections, whose busy handler sleeps in steps of up to 100 ms (turns waited 30-40 ms at
            // p99 with four connections; bench/results/orchestrator-overhead/2026-11-23-dev). Other processes on
            // the same file still wait through `busy_timeout`.
            SqlitePoolOptions::new().max_connections(1)
        };
        let lock_path = (!memory).then(|| {
            let mut name = options.get_filename().as_os_str().to_owned();
            name.push(".migrate-lock");
            std::path::PathBuf::from(name)
        });
        // sqlx takes no lock around SQLite migrations, and two processes creating the file at once can find it
        // busy while it turns to WAL: an exclusive lock on a file beside the database serializes opening and
        // migrating (PostgreSQL's migrations take an advisory lock of their own).
        let _lock = match lock_path {
            Some(path) => Some(
                tokio::task::spawn_blocking(move || -> std::io::Result<std::fs::File> {
                    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
                    file.lock()?;
                    Ok(file)
                })
                .await
                .map_err(|e| bad(format!("migration lock: {e}")))?
                .map_err(|e| bad(format!("migration lock: {e}")))?,
            ),
            None => None,
        };
        // The writers' connection never checkpoints; a second one does, in the background.
        let writer = options.clone().pragma("wal_autocheckpoint", if memory { "1000" } else { "0" });
        let pool = pool_options.connect_with(writer).await?;
        SQLITE_MIGRATIONS.run(&pool).await?;
        let checkpoints = match memory {
            true => None,
            false => {
                let mut wal = options.get_filename().as_os_str().to_owned();
                wal.push("-wal");
                let checkpointer = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
                Some(Arc::new(Checkpoints::start(checkpointer, wal.into())))
            }
        };
        Ok(Self { pool: Pool::Sqlite(pool), _checkpoints: checkpoints })
    }

    /// Copies a SQLite file's write-ahead log back into the database and truncates the log (waiting for the
    /// writers; tooling, for a file's size to be read whole): false when a reader kept it from finishing (try again).
    /// Nothing to do on PostgreSQL.
    pub async fn checkpoint(&self) -> Result<bool, StoreError> {
        match &self.pool {
            Pool::Sqlite(pool) => {
                let (busy, _, _): (i64, i64, i64) =
                    sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)").fetch_one(pool).await?;
                Ok(busy == 0)
            }
            Pool::Postgres(_) => Ok(true),
        }
    }

    /// Which backend this store uses: `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        match self.pool {
            Pool::Sqlite(_) => "sqlite",
            Pool::Postgres(_) => "postgres",
        }
    }

    /// Creates `job` with its resolved `tasks`, owned by `owner` until `lease_until_ms`, in one transaction (with
    /// its caller, creation time and turns, for the quotas). When `idempotency_key` is not empty and a job already
    /// holds it, nothing is written and that job is returned.
    pub async fn create_job(
        &self,
        job: &pb::Job,
        idempotency_key: &str,
        owner: &str,
        lease_until_ms: i64,
        tasks: &[pb::Task],
    ) -> Result<Option<pb::Job>, StoreError> {
        let key = (!idempotency_key.is_empty()).then_some(idempotency_key);
        let created: bool = on_pool!(&self.pool, p => {
            let mut tx = p.begin().await?;
            let inserted = sqlx::query(
                "INSERT INTO jobs (job_id, idempotency_key, owner, lease_until_ms, state, job, caller, created_ms, \
                 turns_total) VALUES ($1, $2, $3, $6, $4, $5, $7, $8, $9) ON CONFLICT (idempotency_key) DO NOTHING",
            )
            .bind(&job.job_id)
            .bind(key)
            .bind(owner)
            .bind(i64::from(job.state))
            .bind(job.encode_to_vec())
            .bind(lease_until_ms)
            .bind(&job.caller)
            .bind(job.created_at.as_ref().map_or(0, timestamp_ms))
            .bind(i64::try_from(job.turns_total).unwrap_or(i64::MAX))
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if inserted == 1 {
                for (position, task) in tasks.iter().enumerate() {
                    sqlx::query("INSERT INTO job_tasks (job_id, position, task_id, source) VALUES ($1, $2, $3, $4)")
                        .bind(&job.job_id)
                        .bind(position as i64)
                        .bind(&task.task_id)
                        .bind(&task.source)
                        .execute(&mut *tx)
                        .await?;
                }
            }
            tx.commit().await?;
            inserted == 1
        });
        if created {
            return Ok(None);
        }
        self.job_by_key(idempotency_key).await
    }

    /// Replaces the job's stored snapshot (state, progress, metrics).
    pub async fn put_job(&self, job: &pb::Job) -> Result<(), StoreError> {
        on_pool!(&self.pool, p => {
            sqlx::query("UPDATE jobs SET state = $2, job = $3 WHERE job_id = $1")
                .bind(&job.job_id)
                .bind(i64::from(job.state))
                .bind(job.encode_to_vec())
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(())
    }

    /// The job with this id.
    pub async fn job(&self, job_id: &str) -> Result<Option<pb::Job>, StoreError> {
        let row: Option<(Vec<u8>,)> = on_pool!(&self.pool, p => {
            sqlx::query_as("SELECT job FROM jobs WHERE job_id = $1").bind(job_id).fetch_optional(p).await?
        });
        row.map(|(bytes,)| decode_job(&bytes)).transpose()
    }

    /// The job submitted with this idempotency key (never matches an empty key).
    pub async fn job_by_key(&self, idempotency_key: &str) -> Result<Option<pb::Job>, StoreError> {
        if idempotency_key.is_empty() {
            return Ok(None);
        }
        let row: Option<(Vec<u8>,)> = on_pool!(&self.pool, p => {
            sqlx::query_as("SELECT job FROM jobs WHERE idempotency_key = $1")
                .bind(idempotency_key)
                .fetch_optional(p)
                .await?
        });
        row.map(|(bytes,)| decode_job(&bytes)).transpose()
    }

    /// Up to `limit` jobs, newest first, submitted before the job listed with `before` (all when `None`);
    /// only those in `state` when it is set.
    pub async fn list_jobs(
        &self,
        before: Option<i64>,
        state: Option<i32>,
        limit: u32,
    ) -> Result<Vec<ListedJob>, StoreError> {
        let rows: Vec<(i64, Vec<u8>)> = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT seq, job FROM jobs WHERE seq < $1 AND ($2 < 0 OR state = $2) ORDER BY seq DESC LIMIT $3",
            )
            .bind(before.unwrap_or(i64::MAX))
            .bind(state.map_or(-1, i64::from))
            .bind(i64::from(limit))
            .fetch_all(p)
            .await?
        });
        rows.into_iter().map(|(seq, bytes)| Ok(ListedJob { seq, job: decode_job(&bytes)? })).collect()
    }

    /// The job's tasks as resolved at submission, in order.
    pub async fn tasks(&self, job_id: &str) -> Result<Vec<pb::Task>, StoreError> {
        let rows: Vec<(String, String)> = on_pool!(&self.pool, p => {
            sqlx::query_as("SELECT task_id, source FROM job_tasks WHERE job_id = $1 ORDER BY position")
                .bind(job_id)
                .fetch_all(p)
                .await?
        });
        Ok(rows.into_iter().map(|(task_id, source)| pb::Task { task_id, source }).collect())
    }

    /// Makes `owner` the job's owner until `until_ms`, when it owns the job already or the owner's lease ran out
    /// by `now_ms`. Otherwise returns the owner and its lease's end, and changes nothing.
    pub async fn claim(
        &self,
        job_id: &str,
        owner: &str,
        now_ms: i64,
        until_ms: i64,
    ) -> Result<Result<(), (String, i64)>, StoreError> {
        let claimed = on_pool!(&self.pool, p => {
            sqlx::query(
                "UPDATE jobs SET owner = $2, lease_until_ms = $3 \
                 WHERE job_id = $1 AND (owner = $2 OR lease_until_ms <= $4)",
            )
            .bind(job_id)
            .bind(owner)
            .bind(until_ms)
            .bind(now_ms)
            .execute(p)
            .await?
            .rows_affected()
        });
        if claimed == 1 {
            return Ok(Ok(()));
        }
        let holder: Option<(String, i64)> = on_pool!(&self.pool, p => {
            sqlx::query_as("SELECT owner, lease_until_ms FROM jobs WHERE job_id = $1")
                .bind(job_id)
                .fetch_optional(p)
                .await?
        });
        Ok(Err(holder.unwrap_or_default()))
    }

    /// Extends `owner`'s lease on the job to `until_ms`; false when the job has another owner now.
    pub async fn renew(&self, job_id: &str, owner: &str, until_ms: i64) -> Result<bool, StoreError> {
        let renewed = on_pool!(&self.pool, p => {
            sqlx::query("UPDATE jobs SET lease_until_ms = $3 WHERE job_id = $1 AND owner = $2")
                .bind(job_id)
                .bind(owner)
                .bind(until_ms)
                .execute(p)
                .await?
                .rows_affected()
        });
        Ok(renewed == 1)
    }

    /// Ids of the jobs `owner` has queued or running, oldest first: what it resumes when it starts.
    pub async fn unfinished_jobs(&self, owner: &str) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = on_pool!(&self.pool, p => {
            sqlx::query_as("SELECT job_id FROM jobs WHERE owner = $1 AND state IN ($2, $3) ORDER BY seq")
                .bind(owner)
                .bind(pb::JobState::Queued as i64)
                .bind(pb::JobState::Running as i64)
                .fetch_all(p)
                .await?
        });
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// Ids of the queued or running jobs whose owner is not `owner` and whose lease ran out by `now_ms`, oldest
    /// first, leaving out step-API episodes (owned by `<instance>/step`: their trainer advances them): the jobs a
    /// replica whose peer died may take over ([`Store::claim`] decides which replica does).
    pub async fn orphaned_jobs(&self, owner: &str, now_ms: i64) -> Result<Vec<String>, StoreError> {
        let rows: Vec<(String,)> = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT job_id FROM jobs WHERE owner <> $1 AND state IN ($2, $3) AND lease_until_ms <= $4 \
                 AND owner NOT LIKE '%/step' ORDER BY seq",
            )
            .bind(owner)
            .bind(pb::JobState::Queued as i64)
            .bind(pb::JobState::Running as i64)
            .bind(now_ms)
            .fetch_all(p)
            .await?
        });
        Ok(rows.into_iter().map(|(id,)| id).collect())
    }

    /// How many jobs (step-API episodes left out) `caller` has queued or running.
    pub async fn caller_jobs_in_flight(&self, caller: &str) -> Result<u64, StoreError> {
        let (count,): (i64,) = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT COUNT(*) FROM jobs WHERE caller = $1 AND state IN ($2, $3) AND owner NOT LIKE '%/step'",
            )
            .bind(caller)
            .bind(pb::JobState::Queued as i64)
            .bind(pb::JobState::Running as i64)
            .fetch_one(p)
            .await?
        });
        Ok(u64::try_from(count).unwrap_or(0))
    }

    /// The creation time (milliseconds since the Unix epoch) and turns of every job and episode `caller` created
    /// after `since_ms`, oldest first.
    pub async fn caller_turns_since(&self, caller: &str, since_ms: i64) -> Result<Vec<(i64, u64)>, StoreError> {
        let rows: Vec<(i64, i64)> = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT created_ms, turns_total FROM jobs WHERE caller = $1 AND created_ms > $2 ORDER BY created_ms",
            )
            .bind(caller)
            .bind(since_ms)
            .fetch_all(p)
            .await?
        });
        Ok(rows.into_iter().map(|(at, turns)| (at, u64::try_from(turns).unwrap_or(0))).collect())
    }

    /// Writes `turn` at `stage`, committed when this returns. The same (task, trajectory, turn) written again at
    /// the same or a later stage replaces the stored row; at an earlier stage the write is a no-op.
    pub async fn put_turn(
        &self,
        job_id: &str,
        task_position: i64,
        stage: Stage,
        turn: &pb::TurnRecord,
    ) -> Result<(), StoreError> {
        on_pool!(&self.pool, p => {
            sqlx::query(
                "INSERT INTO turns (job_id, task_id, trajectory, turn, task_position, stage, verdict, score, record) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (job_id, task_id, trajectory, turn) DO UPDATE SET \
                 stage = excluded.stage, verdict = excluded.verdict, score = excluded.score, record = excluded.record \
                 WHERE turns.stage <= excluded.stage",
            )
            .bind(job_id)
            .bind(&turn.task_id)
            .bind(i64::from(turn.trajectory))
            .bind(i64::from(turn.turn))
            .bind(task_position)
            .bind(stage as i64)
            .bind(i64::from(turn.verdict))
            .bind(turn.score)
            .bind(turn.encode_to_vec())
            .execute(p)
            .await?
            .rows_affected()
        });
        Ok(())
    }

    /// Claims `turn` of a step-API episode for `idempotency_key`: true when the key owns the turn (it claimed it
    /// now or before), false when another key did.
    pub async fn claim_step(&self, job_id: &str, turn: u32, idempotency_key: &str) -> Result<bool, StoreError> {
        let owner: (String,) = on_pool!(&self.pool, p => {
            sqlx::query("INSERT INTO step_keys (job_id, turn, idempotency_key) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                .bind(job_id)
                .bind(i64::from(turn))
                .bind(idempotency_key)
                .execute(p)
                .await?;
            sqlx::query_as("SELECT idempotency_key FROM step_keys WHERE job_id = $1 AND turn = $2")
                .bind(job_id)
                .bind(i64::from(turn))
                .fetch_one(p)
                .await?
        });
        Ok(owner.0 == idempotency_key)
    }

    /// Every stored turn of one trajectory, whatever its stage, in turn order: what a resumed episode picks up.
    pub async fn trajectory(
        &self,
        job_id: &str,
        task_id: &str,
        trajectory: u32,
    ) -> Result<Vec<(Stage, pb::TurnRecord)>, StoreError> {
        let rows: Vec<(i64, Vec<u8>)> = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT stage, record FROM turns WHERE job_id = $1 AND task_id = $2 AND trajectory = $3 ORDER BY turn",
            )
            .bind(job_id)
            .bind(task_id)
            .bind(i64::from(trajectory))
            .fetch_all(p)
            .await?
        });
        rows.into_iter().map(|(stage, bytes)| Ok((Stage::from_i64(stage), decode_turn(&bytes)?))).collect()
    }

    /// Every recorded turn of the job, ordered by task (the job's task order), trajectory and turn.
    pub async fn turns(&self, job_id: &str) -> Result<Vec<pb::TurnRecord>, StoreError> {
        Ok(self.turns_after(job_id, None, u32::MAX).await?.into_iter().map(|(_, turn)| turn).collect())
    }

    /// Up to `limit` recorded turns of the job after `after` (from the start when `None`), in the order of
    /// [`Store::turns`], each with its position: a cursor for the next call.
    pub async fn turns_after(
        &self,
        job_id: &str,
        after: Option<TurnPosition>,
        limit: u32,
    ) -> Result<Vec<(TurnPosition, pb::TurnRecord)>, StoreError> {
        let (task, trajectory, turn) = after.unwrap_or((-1, 0, 0));
        let rows: Vec<(i64, i64, i64, Vec<u8>)> = on_pool!(&self.pool, p => {
            sqlx::query_as(
                "SELECT task_position, trajectory, turn, record FROM turns \
                 WHERE job_id = $1 AND stage = $2 AND (task_position, trajectory, turn) > ($3, $4, $5) \
                 ORDER BY task_position, trajectory, turn LIMIT $6",
            )
            .bind(job_id)
            .bind(Stage::Recorded as i64)
            .bind(task)
            .bind(i64::from(trajectory))
            .bind(i64::from(turn))
            .bind(i64::from(limit))
            .fetch_all(p)
            .await?
        });
        rows.into_iter()
            .map(|(task, trajectory, turn, bytes)| {
                let position = (task, u32::try_from(trajectory).unwrap_or(0), u32::try_from(turn).unwrap_or(0));
                Ok((position, decode_turn(&bytes)?))
            })
            .collect()
    }
}

/// A timestamp in milliseconds since the Unix epoch.
pub(crate) fn timestamp_ms(at: &prost_types::Timestamp) -> i64 {
    at.seconds.saturating_mul(1000).saturating_add(i64::from(at.nanos) / 1_000_000)
}

fn decode_job(bytes: &[u8]) -> Result<pb::Job, StoreError> {
    pb::Job::decode(bytes).map_err(|source| StoreError::Corrupt { what: "job", source })
}

fn decode_turn(bytes: &[u8]) -> Result<pb::TurnRecord, StoreError> {
    pb::TurnRecord::decode(bytes).map_err(|source| StoreError::Corrupt { what: "turn", source })
}

/// The default store: `orchestrator.db` under `$XDG_STATE_HOME/kforge` (else `~/.local/state/kforge`, else the
/// current directory).
pub fn default_url() -> String {
    let dir = std::env::var_os("XDG_STATE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| std::path::Path::new(&h).join(".local/state"))
        })
        .map(|d| d.join("kforge"))
        .unwrap_or_default();
    dir.join("orchestrator.db").display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(task: &str, trajectory: u32, turn: u32, kernel: &str) -> pb::TurnRecord {
        pb::TurnRecord { task_id: task.into(), trajectory, turn, kernel: kernel.into(), ..Default::default() }
    }

    async fn memory() -> Store {
        Store::open("sqlite::memory:").await.expect("an in-memory store opens")
    }

    fn job(id: &str) -> pb::Job {
        pb::Job { job_id: id.into(), state: pb::JobState::Queued.into(), ..Default::default() }
    }

    #[tokio::test]
    async fn turns_are_idempotent_never_regress_and_are_ordered_by_the_job_s_tasks() {
        let store = memory().await;
        let position = |task: &str| if task == "b" { 0 } else { 1 };
        for record in [turn("a", 0, 0, "z"), turn("b", 1, 0, "x"), turn("b", 0, 1, "y"), turn("b", 0, 0, "w")] {
            store.put_turn("job", position(&record.task_id), Stage::Recorded, &record).await.expect("written");
        }
        store.put_turn("job", 0, Stage::Recorded, &turn("b", 1, 0, "x again")).await.expect("rewritten");
        store.put_turn("job", 0, Stage::Generated, &turn("b", 1, 0, "stale")).await.expect("a no-op");
        store.put_turn("job", 0, Stage::Generated, &turn("b", 0, 2, "pending")).await.expect("written");
        let keys: Vec<(String, u32, u32, String)> = store
            .turns("job")
            .await
            .expect("read")
            .into_iter()
            .map(|t| (t.task_id, t.trajectory, t.turn, t.kernel))
            .collect();
        assert_eq!(
            keys,
            [
                ("b".into(), 0, 0, "w".into()),
                ("b".into(), 0, 1, "y".into()),
                ("b".into(), 1, 0, "x again".into()),
                ("a".into(), 0, 0, "z".into()),
            ],
            "recorded turns only, in task order; the generated-only turn is not listed"
        );
        let trajectory: Vec<(Stage, String)> =
            store.trajectory("job", "b", 0).await.expect("read").into_iter().map(|(s, t)| (s, t.kernel)).collect();
        assert_eq!(
            trajectory,
            [(Stage::Recorded, "w".into()), (Stage::Recorded, "y".into()), (Stage::Generated, "pending".into())]
        );
        let page = store.turns_after("job", Some((0, 0, 1)), 2).await.expect("read");
        let kernels: Vec<&str> = page.iter().map(|(_, t)| t.kernel.as_str()).collect();
        assert_eq!(kernels, ["x again", "z"]);
        assert_eq!(page[1].0, (1, 0, 0));
        assert!(store.turns("other").await.expect("read").is_empty());
        assert!(store.claim_step("job", 0, "k1").await.expect("claimed"));
        assert!(store.claim_step("job", 0, "k1").await.expect("claimed again by its key"));
        assert!(!store.claim_step("job", 0, "k2").await.expect("read"), "another key is refused");
        assert!(store.claim_step("job", 1, "k2").await.expect("claimed"));
    }

    #[tokio::test]
    async fn jobs_by_id_idempotency_key_owner_and_listing() {
        let store = memory().await;
        let tasks = [pb::Task { task_id: "t".into(), source: "src".into() }];
        assert_eq!(store.create_job(&job("j1"), "key", "me", 0, &tasks).await.expect("written"), None);
        let existing = store.create_job(&job("j2"), "key", "me", 0, &[]).await.expect("read");
        assert_eq!(existing.map(|j| j.job_id), Some("j1".into()), "the key returns the first job");
        assert_eq!(store.job("j2").await.expect("read"), None, "nothing written for a known key");
        assert_eq!(store.create_job(&job("j3"), "", "other", 100, &[]).await.expect("written"), None);
        assert_eq!(store.create_job(&job("j4"), "", "me", 0, &[]).await.expect("written"), None);
        assert_eq!(store.job_by_key("").await.expect("read"), None);
        assert_eq!(store.tasks("j1").await.expect("read"), tasks);

        let mut done = job("j4");
        done.state = pb::JobState::Succeeded.into();
        store.put_job(&done).await.expect("updated");
        assert_eq!(store.job("j4").await.expect("read").map(|j| j.state), Some(done.state));
        assert_eq!(store.unfinished_jobs("me").await.expect("read"), ["j1"]);
        assert_eq!(store.claim("j3", "me", 50, 150).await.expect("read"), Err(("other".into(), 100)), "leased");
        assert_eq!(store.claim("j3", "other", 50, 200).await.expect("renewed by its owner"), Ok(()));
        assert!(!store.renew("j3", "me", 300).await.expect("read"), "not the owner");
        assert!(store.renew("j3", "other", 300).await.expect("renewed"));
        assert_eq!(store.claim("j3", "me", 300, 400).await.expect("claimed once the lease ran out"), Ok(()));
        assert_eq!(store.unfinished_jobs("me").await.expect("read"), ["j1", "j3"]);

        let first = store.list_jobs(None, None, 2).await.expect("listed");
        let ids: Vec<&str> = first.iter().map(|l| l.job.job_id.as_str()).collect();
        assert_eq!(ids, ["j4", "j3"], "newest first");
        let rest = store.list_jobs(Some(first[1].seq), None, 2).await.expect("listed");
        assert_eq!(rest.iter().map(|l| l.job.job_id.as_str()).collect::<Vec<_>>(), ["j1"]);
        let succeeded = store.list_jobs(None, Some(done.state), 10).await.expect("listed");
        assert_eq!(succeeded.iter().map(|l| l.job.job_id.as_str()).collect::<Vec<_>>(), ["j4"]);
    }

    #[tokio::test]
    async fn a_caller_s_jobs_in_flight_and_recent_turns_are_counted() {
        let store = memory().await;
        let at = |ms: i64| prost_types::Timestamp { seconds: ms / 1000, nanos: ((ms % 1000) * 1_000_000) as i32 };
        let job = |id: &str, caller: &str, created_ms: i64, turns_total: u64, state: pb::JobState| pb::Job {
            job_id: id.into(),
            caller: caller.into(),
            created_at: Some(at(created_ms)),
            turns_total,
            state: state.into(),
            ..Default::default()
        };
        let running = pb::JobState::Running;
        for (job, owner) in [
            (job("a1", "alice", 1_000, 10, pb::JobState::Queued), "me"),
            (job("a2", "alice", 2_500, 20, running), "me"),
            (job("a3", "alice", 3_000, 30, pb::JobState::Succeeded), "me"),
            (job("a4", "alice", 4_000, 5, running), "me/step"),
            (job("b1", "bob", 2_000, 40, running), "me"),
            (job("s1", "", 2_000, 50, running), "me"),
        ] {
            store.create_job(&job, "", owner, 0, &[]).await.expect("written");
        }
        assert_eq!(store.caller_jobs_in_flight("alice").await.expect("read"), 2, "finished jobs and episodes not");
        assert_eq!(store.caller_jobs_in_flight("bob").await.expect("read"), 1);
        assert_eq!(store.caller_jobs_in_flight("carol").await.expect("read"), 0);
        let recent = store.caller_turns_since("alice", 2_000).await.expect("read");
        assert_eq!(recent, [(2_500, 20), (3_000, 30), (4_000, 5)], "after the time, oldest first, episodes too");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stores_opened_at_once_on_a_new_file_all_open() {
        let dir = std::env::temp_dir().join(format!("kforge-store-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = dir.join("kforge.db").display().to_string();
        let opened: Vec<_> = (0..4)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { Store::open(&url).await })
            })
            .collect();
        for open in opened {
            open.await.expect("joined").expect("every store opens");
        }
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[tokio::test]
    async fn a_file_store_keeps_its_jobs_across_reopening() {
        let dir = std::env::temp_dir().join(format!("kforge-store-unit-{}", std::process::id()));
        let path = dir.join("nested/kforge.db");
        let url = path.display().to_string();
        {
            let store = Store::open(&url).await.expect("created with its directory");
            store.create_job(&job("j1"), "", "me", 0, &[]).await.expect("written");
            store.put_turn("j1", 0, Stage::Evaluated, &turn("t", 0, 0, "k")).await.expect("written");
            // The store's own checkpoints may hold the log a moment (longer on a loaded machine): a TRUNCATE that
            // finds it busy is tried again, for up to 30 s.
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
            let mut done = store.checkpoint().await.expect("checkpointed");
            while !done && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                done = store.checkpoint().await.expect("checkpointed");
            }
            assert!(done, "no reader outside the store holds the file");
            let wal = std::fs::metadata(dir.join("nested/kforge.db-wal")).expect("the log exists");
            assert_eq!(wal.len(), 0, "a TRUNCATE checkpoint empties the log");
        }
        let store = Store::open(&format!("sqlite://{url}")).await.expect("reopened");
        assert_eq!(store.backend(), "sqlite");
        assert!(store.job("j1").await.expect("read").is_some());
        assert_eq!(store.trajectory("j1", "t", 0).await.expect("read")[0].0, Stage::Evaluated);
        assert!(matches!(Store::open("mysql://x").await, Err(StoreError::BadUrl { .. })));
        std::fs::remove_dir_all(dir).expect("cleanup");
    }
}
