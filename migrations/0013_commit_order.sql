-- A FIFO destination's rows in the table are sent in commit order. Ids
-- follow it only while the identity is never reset (`RESTART IDENTITY`
-- gives a later transaction's rows ids below an earlier one's) and a row
-- written back keeps its id, so every row the stream hands to the table
-- keeps its transaction's commit position and its place among that
-- transaction's rows, and a FIFO claim takes those first, in that order,
-- then rows the stream never saw (polling) in id order. Nullable columns
-- without a default: no table rewrite, a brief lock.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS commit_lsn pg_lsn;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS commit_seq integer;
-- Producers' inserts leave them NULL, so they never touch this index.
CREATE INDEX IF NOT EXISTS outbox_new_by_commit
    ON outbox (destination, commit_lsn, commit_seq, id) WHERE status = 'NEW' AND commit_lsn IS NOT NULL;
