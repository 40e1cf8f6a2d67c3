-- Settlement deletes published rows (published_rows = "delete", the default):
-- one small WAL record per row instead of a new row version and its index
-- entries. What a restart replays must still be told apart from rows a
-- later transaction deleted, so each settlement statement records the ids it
-- deleted as runs of consecutive ids: one small row per run, usually one per
-- statement. The relay prunes runs once every slot has confirmed past them.
CREATE TABLE IF NOT EXISTS outbox_published_runs (
    lo           bigint PRIMARY KEY,
    hi           bigint NOT NULL CHECK (hi >= lo),
    lsn          pg_lsn NOT NULL DEFAULT pg_current_wal_insert_lsn(),
    published_at timestamptz NOT NULL DEFAULT now()
);

-- Transient rows (inserted and deleted by the same transaction, the table
-- staying empty) are told apart in the stream by their DELETE: the relay's
-- publication carries deletes too. A publication with a row filter (a shard)
-- stays insert-only: PostgreSQL refuses deletes on a table whose publication
-- filters on a column outside its replica identity.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_publication p
                WHERE p.pubname = 'outbox_relay' AND NOT p.pubdelete
                  AND NOT EXISTS (SELECT 1 FROM pg_publication_tables t
                                   WHERE t.pubname = p.pubname AND t.rowfilter IS NOT NULL)) THEN
        ALTER PUBLICATION outbox_relay SET (publish = 'insert, delete');
    END IF;
END
$$;
