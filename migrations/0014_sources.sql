-- A mapped table ([[outbox]]) is known by its oid: the stream names a
-- relation by it, so rows of a table renamed or moved to another schema are
-- still read. Each relay start records the oid of every mapped table under
-- the name its configuration gives; a relay started again after a rename,
-- its configuration not updated yet, finds the table by that oid (and says
-- its new name) instead of refusing to start and holding back every other
-- table's rows.
CREATE TABLE IF NOT EXISTS outbox_relay_sources (
    name    text PRIMARY KEY,        -- schema.table as configured
    relid   oid NOT NULL,
    seen_at timestamptz NOT NULL DEFAULT now()
);
