-- A new slot never streams the rows committed before it: the session that
-- creates it hands them to the table path. A relay killed between creating
-- the slot and the end of that hand-off used to leave those rows NEW and
-- unstreamed for good. The hand-off is now recorded here before the slot is
-- created and deleted once it is done: a session that finds its slot with
-- a hand-off still recorded hands every NEW row not yet in the table path's
-- care to it (the stream skips those it brings too) before streaming.
CREATE TABLE IF NOT EXISTS outbox_relay_handoffs (
    slot  text PRIMARY KEY,
    since timestamptz NOT NULL DEFAULT now()
);
