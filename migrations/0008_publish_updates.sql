-- What is sent is what was committed. A row its own transaction inserted and
-- then changed (its body, its destination) must go out as it stands at
-- commit, in CDC mode as in polling: the relay's publication carries updates
-- too, and the decoder applies an update to the row it holds for that
-- transaction. Updates by later transactions (the relay's own marks among
-- them) reach the decoder and are passed over. A publication with a row
-- filter (a shard) stays insert-only, as in migration 5: PostgreSQL refuses
-- updates on a table whose publication filters on a column outside its
-- replica identity.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_publication p
                WHERE p.pubname = 'outbox_relay' AND NOT p.pubupdate
                  AND NOT EXISTS (SELECT 1 FROM pg_publication_tables t
                                   WHERE t.pubname = p.pubname AND t.rowfilter IS NOT NULL)) THEN
        ALTER PUBLICATION outbox_relay SET (publish = 'insert, update, delete');
    END IF;
END
$$;
