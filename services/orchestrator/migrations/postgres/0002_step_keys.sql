-- The idempotency key of each step-API turn: the first key to claim a turn owns it; a retry with that key replays
-- or finishes the step, another key is refused.
CREATE TABLE step_keys (
    job_id TEXT NOT NULL,
    turn BIGINT NOT NULL,
    idempotency_key TEXT NOT NULL,
    PRIMARY KEY (job_id, turn)
);
