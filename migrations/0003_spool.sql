-- Rows handed to the table path by a spooling lane or `dead redrive` carry a
-- next_attempt_at; the spool drain reads them per destination in id order.
CREATE INDEX IF NOT EXISTS outbox_spooled_by_destination
    ON outbox (destination, id) WHERE status = 'NEW' AND next_attempt_at IS NOT NULL;

-- The retention sweeper deletes PUBLISHED rows by age, a small batch at a time.
CREATE INDEX IF NOT EXISTS outbox_published_at
    ON outbox (published_at) WHERE status = 'PUBLISHED';

-- `dead list`, `dead redrive` and `status` find DEAD rows without a scan.
CREATE INDEX IF NOT EXISTS outbox_dead_by_destination
    ON outbox (destination, id) WHERE status = 'DEAD';
