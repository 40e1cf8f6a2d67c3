-- Delayed delivery: a row's message goes no earlier than its deliver_at
-- (NULL: at once). Due within 15 minutes on a standard queue, SQS delays
-- it (DelaySeconds); due later, or on a FIFO queue, the row is held in the
-- table (NEW, next_attempt_at set) and the table path sends it when due.
-- A nullable column without a default: no table rewrite, a brief lock.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS deliver_at timestamptz;
-- The held rows per destination, earliest due first: the metrics' and
-- `status`'s count and next due time without a scan. The column is new, so
-- the index starts empty (its build still reads the table once).
CREATE INDEX IF NOT EXISTS outbox_held_by_destination
    ON outbox (destination, deliver_at) WHERE status = 'NEW' AND deliver_at IS NOT NULL;
