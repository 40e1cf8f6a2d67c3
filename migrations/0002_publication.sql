-- The publication the relay's slot reads. Inserts only: the relay's own
-- status updates must not come back through the stream.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay') THEN
        CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert');
    END IF;
END
$$;
