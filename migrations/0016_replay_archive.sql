-- A replay may read the archive (segments in S3) instead of the outbox's
-- kept rows: its cursor there is the segment's key and the lines of it
-- copied, moved in the same transaction as the copies.
ALTER TABLE outbox_replays ADD COLUMN IF NOT EXISTS cursor_key text;
ALTER TABLE outbox_replays ADD COLUMN IF NOT EXISTS cursor_line integer;
