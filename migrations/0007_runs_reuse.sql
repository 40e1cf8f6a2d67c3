-- Ids can be reused: `TRUNCATE ... RESTART IDENTITY`, `ALTER COLUMN id
-- RESTART`, a restore with OVERRIDING SYSTEM VALUE, a table re-created. A run
-- of published ids is therefore no proof on its own that a replayed row was
-- published: the replay filter also requires the run to have been written
-- after the row's commit (settlement always follows the commit it settles,
-- and a row can only reuse an id once the earlier row is gone). Runs of the
-- same ids may then coexist, so `lo` alone no longer keys a run; (lo, lsn)
-- does (two settlements of one id are separated by the commits that freed
-- and reused it), and a GiST index on the id range finds every run that
-- overlaps a chunk's ids.
ALTER TABLE outbox_published_runs DROP CONSTRAINT IF EXISTS outbox_published_runs_pkey;
ALTER TABLE outbox_published_runs ADD PRIMARY KEY (lo, lsn);
CREATE INDEX IF NOT EXISTS outbox_published_runs_ids
    ON outbox_published_runs USING gist (int8range(lo, hi, '[]'));
