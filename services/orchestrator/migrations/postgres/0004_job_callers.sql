-- The named caller that submitted the job ('' for the shared token or no auth), when (milliseconds since the Unix
-- epoch) and how many turns it asked for: what the per-caller quotas count.
ALTER TABLE jobs ADD COLUMN caller TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN created_ms BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN turns_total BIGINT NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_caller ON jobs (caller, created_ms);
