//! Outbox rows: the committed row as the relay reads it, from the slot or
//! the table. The SQS entries made from them are [`crate::publish::entry`].

/// A committed outbox row, as read from the slot or the table.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    pub id: i64,
    pub event_id: String,
    pub destination: String,
    pub body: String,
    pub group_key: Option<String>,
    /// The `attributes` column's JSON text, if not NULL.
    pub attributes: Option<String>,
    /// Commit time of the row's transaction, microseconds since the Unix epoch.
    pub commit_time_us: i64,
    /// The inserting transaction's id, when read from the stream: settlement
    /// tells a row not visible yet from one deleted by it.
    pub xid: Option<u32>,
    /// The commit record's position of the inserting transaction, when read
    /// from the stream: a run of published ids proves this row was published
    /// only if it was written after this commit (ids can be reused).
    pub commit_lsn: Option<replication::Lsn>,
    /// Deleted by the transaction that inserted it (seen in the stream): it
    /// has no row to settle, only the watermark records it.
    pub transient: bool,
    /// The `deliver_at` column: when the message may be delivered.
    pub deliver_at: DeliverAt,
    /// Read from a mapped table ([`crate::mapping`]), not the relay's own:
    /// its `id` is not one of the relay's table (it is 0), so neither the
    /// replay filter nor a read-back looks it up there, and a write-back
    /// takes a new id.
    pub mapped: bool,
}

/// A row's `deliver_at`, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeliverAt {
    /// NULL: deliver at once.
    #[default]
    Unset,
    /// Microseconds since the Unix epoch ([`DeliverAt::NEVER`]: `infinity`).
    At(i64),
    /// The stream gave a text the relay cannot read as a time (the
    /// server's `DateStyle` is not ISO).
    Unreadable,
}

impl DeliverAt {
    /// `'infinity'`: never due. No time PostgreSQL can store reaches it
    /// (its last ones pass `i64` microseconds since 1970 and are read as
    /// [`Self::LATEST`]).
    pub const NEVER: i64 = i64::MAX;
    /// The latest time the relay tells apart (about year 287,000): later
    /// ones are read as this, still a time, held until then.
    pub const LATEST: i64 = 9_000_000_000_000_000_000;

    /// A time in microseconds: [`Self::NEVER`] (either sign) stays what it
    /// is, any other time is clamped to [`Self::LATEST`].
    pub fn at(us: i64) -> DeliverAt {
        if us == Self::NEVER || us == -Self::NEVER {
            return DeliverAt::At(us);
        }
        DeliverAt::At(us.clamp(-Self::LATEST, Self::LATEST))
    }

    /// The microseconds, for writing the row back (`None`: NULL).
    pub fn micros(self) -> Option<i64> {
        match self {
            DeliverAt::At(us) => Some(us),
            DeliverAt::Unset | DeliverAt::Unreadable => None,
        }
    }
}

/// The outbox columns the table path selects, in [`OutboxEvent::from_row`]'s
/// order (the creation time stands in for the commit time).
/// `deliver_at` as [`DeliverAt::at`] reads it: `±infinity` as
/// `±`[`DeliverAt::NEVER`], other times clamped to [`DeliverAt::LATEST`].
pub const OUTBOX_COLUMNS: &str = "id, event_id, destination, body, group_key, attributes::text,
    (extract(epoch FROM created_at) * 1000000)::bigint,
    CASE WHEN deliver_at = 'infinity' THEN 9223372036854775807
         WHEN deliver_at = '-infinity' THEN -9223372036854775807
         WHEN deliver_at IS NOT NULL
         THEN (greatest(least(extract(epoch FROM deliver_at), 9000000000000), -9000000000000) * 1000000)::bigint END";

impl OutboxEvent {
    /// A row selected with [`OUTBOX_COLUMNS`] first.
    pub fn from_row(r: &tokio_postgres::Row) -> Self {
        OutboxEvent {
            id: r.get(0),
            event_id: r.get(1),
            destination: r.get(2),
            body: r.get(3),
            group_key: r.get(4),
            attributes: r.get(5),
            commit_time_us: r.get(6),
            xid: None,
            commit_lsn: None,
            transient: false,
            deliver_at: r.get::<_, Option<i64>>(7).map_or(DeliverAt::Unset, DeliverAt::at),
            mapped: false,
        }
    }

    /// Bytes the event holds in memory, for the unsettled budget.
    pub fn size(&self) -> usize {
        self.body.len()
            + self.event_id.len()
            + self.destination.len()
            + self.group_key.as_ref().map_or(0, String::len)
            + self.attributes.as_ref().map_or(0, String::len)
            + 96
    }
}

#[cfg(test)]
impl OutboxEvent {
    /// A row for tests: event id `e:{id}`, no group, no attributes.
    pub(crate) fn for_test(id: i64, destination: &str, body: &str) -> Self {
        OutboxEvent {
            id,
            event_id: format!("e:{id}"),
            destination: destination.into(),
            body: body.into(),
            group_key: None,
            attributes: None,
            commit_time_us: 0,
            xid: None,
            commit_lsn: None,
            transient: false,
            deliver_at: DeliverAt::Unset,
            mapped: false,
        }
    }
}
