-- Jobs, their resolved tasks, and every turn (kforge.v1 messages stored proto-encoded, so that fields added to
-- them later flow through; the columns beside them are what the orchestrator queries). Keep in step with
-- ../postgres/0001_jobs_and_turns.sql.

CREATE TABLE jobs (
    -- Listing order (ListJobs pages by it).
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    -- NULL when the submission named no key.
    idempotency_key TEXT UNIQUE,
    -- The orchestrator instance that runs the job and resumes it after a restart.
    owner TEXT NOT NULL,
    -- kforge.v1.JobState.
    state INTEGER NOT NULL,
    -- kforge.v1.Job.
    job BLOB NOT NULL
);
CREATE INDEX jobs_by_owner_and_state ON jobs (owner, state);

-- The job's tasks as resolved at submission: a resumed job runs exactly these.
CREATE TABLE job_tasks (
    job_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    task_id TEXT NOT NULL,
    source TEXT NOT NULL,
    PRIMARY KEY (job_id, position)
);

-- One row per (job, task, trajectory, turn), written at each stage: generated (the response), evaluated (and the
-- evaluation), recorded (scored and complete). A later stage replaces an earlier one, never the reverse.
CREATE TABLE turns (
    job_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    trajectory INTEGER NOT NULL,
    turn INTEGER NOT NULL,
    task_position INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    -- kforge.v1.Verdict.
    verdict INTEGER NOT NULL,
    score REAL,
    -- kforge.v1.TurnRecord.
    record BLOB NOT NULL,
    PRIMARY KEY (job_id, task_id, trajectory, turn)
);
CREATE INDEX turns_in_order ON turns (job_id, task_position, trajectory, turn);
