-- Rows handed to the table path by a spooling lane or `dead redrive` carry a
-- next_attempt_at; the spool drain reads them per destination in id order.
CREATE INDEX IF NOT EXISTS outbox_spooled_by_destination
    ON outbox (destination, id) WHERE status = 'NEW' AND next_attempt_at IS NOT NULL;

-- `dead list`, `dead redrive` and `status` find DEAD rows without a scan.
CREATE INDEX IF NOT EXISTS outbox_dead_by_destination
    ON outbox (destination, id) WHERE status = 'DEAD';
