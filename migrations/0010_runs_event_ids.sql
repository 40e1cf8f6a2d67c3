-- Rows the table path publishes (a spooled lane's, a held stream's, polling
-- mode's) have no commit position, so their runs proved nothing to the
-- replay filter and the stream sent them again once it caught up: every row
-- handed to the table while the stream was held went out twice. Such a run
-- now lists the event ids it deleted: a replayed row is proven published
-- when a run written after its commit covers its id and lists its event id.
ALTER TABLE outbox_published_runs ADD COLUMN IF NOT EXISTS event_ids text[];
