-- Until when (milliseconds since the Unix epoch) the owner holds the job: it renews the lease while it runs the
-- job; another instance may take the job over (ResumeJob) only once the lease has run out.
ALTER TABLE jobs ADD COLUMN lease_until_ms BIGINT NOT NULL DEFAULT 0;
