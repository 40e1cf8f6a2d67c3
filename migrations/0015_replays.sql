-- Replay: what was published is sent again (`outbox-relay replay`). A
-- replay copies the rows it selects into the outbox as new rows, which the
-- relay sends as it sends any row; `replay_of` names the replay that wrote
-- a copy (the message says it is a replay, and a later replay does not
-- select copies). `outbox_replays` records each replay: its selection, its
-- totals, and a cursor moved in the same transaction as the copies it
-- wrote, so a replay interrupted at any point resumes without copying an
-- event twice.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS replay_of bigint;

CREATE TABLE IF NOT EXISTS outbox_replays (
    id            bigserial PRIMARY KEY,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    state         text NOT NULL DEFAULT 'RUNNING' CHECK (state IN ('RUNNING', 'DONE', 'CANCELLED')),
    -- The selection, as `replay` was given it (destination, since, until,
    -- event ids, to), its upper bound fixed when it started.
    selection     jsonb NOT NULL,
    total         bigint NOT NULL,
    total_bytes   bigint NOT NULL,
    copied        bigint NOT NULL DEFAULT 0,
    copied_bytes  bigint NOT NULL DEFAULT 0,
    -- The last row copied, in (published_at, id) order.
    cursor_at     timestamptz,
    cursor_id     bigint
);
