-- Ids can be reused: `TRUNCATE ... RESTART IDENTITY`, `ALTER COLUMN id
-- RESTART`, a restore with OVERRIDING SYSTEM VALUE, a table re-created, or
-- simply a row deleted (by its own transaction, or a later one) and its id
-- given to another. A run of published ids is therefore no proof on its own
-- that a replayed row was published. Each run now also records the commit
-- positions of the stream rows it covers (commit_lo..commit_hi; NULL when a
-- row came from the table path, whose commit is unknown): a run proves a row
-- published only if it covers its id, its commit lies within that range,
-- and it was written after that commit. Runs of the same ids may coexist,
-- so `lo` alone no longer keys a run; (lo, lsn) does, and a GiST index on
-- the id range finds every run that overlaps a chunk's ids.
ALTER TABLE outbox_published_runs DROP CONSTRAINT IF EXISTS outbox_published_runs_pkey;
ALTER TABLE outbox_published_runs ADD PRIMARY KEY (lo, lsn);
ALTER TABLE outbox_published_runs ADD COLUMN IF NOT EXISTS commit_lo pg_lsn,
                                  ADD COLUMN IF NOT EXISTS commit_hi pg_lsn;
CREATE INDEX IF NOT EXISTS outbox_published_runs_ids
    ON outbox_published_runs USING gist (int8range(lo, hi, '[]'));
