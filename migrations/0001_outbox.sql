-- The outbox table: one row per message to publish, written in the same
-- transaction as the business change it announces.
CREATE TABLE IF NOT EXISTS outbox (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        text UNIQUE NOT NULL,
    destination     text NOT NULL,
    body            text NOT NULL,
    group_key       text,
    attributes      jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    status          text NOT NULL DEFAULT 'NEW'
                    CHECK (status IN ('NEW', 'PUBLISHED', 'DEAD')),
    attempts        int NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    last_error      text,
    published_at    timestamptz
);

-- The table path (catch-up, polling, spool drain) reads NEW rows per
-- destination in id order; a partial index keeps that cheap however many
-- PUBLISHED rows accumulate.
CREATE INDEX IF NOT EXISTS outbox_new_by_destination
    ON outbox (destination, id) WHERE status = 'NEW';
