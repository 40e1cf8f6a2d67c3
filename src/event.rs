//! Outbox rows: the committed row as the relay reads it, from the slot or
//! the table. The SQS entries made from them are [`crate::publish::entry`].

/// A committed outbox row, as read from the slot or the table.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    pub event_id: String,
    pub destination: String,
    pub body: String,
    pub group_key: Option<String>,
    /// The `attributes` column's JSON text, if not NULL.
    pub attributes: Option<String>,
    /// Commit time of the row's transaction, microseconds since the Unix epoch.
    pub commit_time_us: i64,
    /// The `deliver_at` column: when the message may be delivered.
    pub deliver_at: DeliverAt,
    /// The `replay_of` column: the replay that wrote this row, a copy of a
    /// row published before ([`crate::ops::replay`]).
    pub replay_of: Option<i64>,
    /// Where the row came from: what settles it, and where.
    pub origin: Origin,
}

/// Where an event's row came from, which says how it is settled. The
/// stages match on it: a row of the relay's table is marked by its id, a
/// transient one only counted, a mapped one marked in its own table.
#[derive(Debug, Clone)]
pub enum Origin {
    /// A row of the relay's table, settled there by its id and event id;
    /// `commit` when the stream brought it (`None`: read from the table).
    Own { id: i64, commit: Option<Commit> },
    /// A row of the relay's table deleted by the transaction that inserted
    /// it (seen in the stream): it has no row to settle, only the watermark
    /// records it; written to the table only if it cannot go out now.
    Transient { id: i64, commit: Commit },
    /// A row of a mapped table ([`crate::mapping`]): not in the relay's
    /// table, so neither the replay filter nor a read-back looks it up
    /// there, and a write-back takes a new id. `commit` when the stream
    /// brought it (`None`: claimed from its table).
    Mapped { row: MappedRow, commit: Option<Commit> },
}

/// The transaction that committed a row, as the stream tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    /// The inserting transaction's id: settlement tells a row not visible
    /// yet from one deleted by it.
    pub xid: u32,
    /// The commit record's position: a run of published ids proves the row
    /// was published only if it was written after this commit (ids can be
    /// reused).
    pub lsn: replication::Lsn,
    /// The row's place among its transaction's rows (0 first): with `lsn`,
    /// the order a FIFO group's rows handed to the table are sent in.
    pub seq: u32,
}

impl OutboxEvent {
    /// The row's id in the relay's table ([`Origin::Own`] and
    /// [`Origin::Transient`]); a mapped row has none.
    pub fn row_id(&self) -> Option<i64> {
        match self.origin {
            Origin::Own { id, .. } | Origin::Transient { id, .. } => Some(id),
            Origin::Mapped { .. } => None,
        }
    }

    /// The transaction the stream read the row in (`None`: read from a table).
    pub fn commit(&self) -> Option<&Commit> {
        match &self.origin {
            Origin::Own { commit, .. } | Origin::Mapped { commit, .. } => commit.as_ref(),
            Origin::Transient { commit, .. } => Some(commit),
        }
    }

    /// The mapped table's row, if the event is one.
    pub fn mapped(&self) -> Option<&MappedRow> {
        match &self.origin {
            Origin::Mapped { row, .. } => Some(row),
            Origin::Own { .. } | Origin::Transient { .. } => None,
        }
    }

    /// The commit's position, as the text the statements take.
    pub fn commit_lsn_text(&self) -> Option<String> {
        self.commit().map(|c| c.lsn.to_string())
    }

    /// The event as the stream read it, in `commit`'s transaction.
    pub fn read_in(mut self, commit: Commit) -> Self {
        match &mut self.origin {
            Origin::Own { commit: c, .. } | Origin::Mapped { commit: c, .. } => *c = Some(commit),
            Origin::Transient { commit: c, .. } => *c = commit,
        }
        self
    }
}

impl Origin {
    /// A row of the relay's table the stream brought, deleted by the
    /// transaction that inserted it: transient. Any other stays as it is.
    pub fn deleted_by_its_transaction(&mut self) {
        if let Origin::Own { id, commit: Some(commit) } = *self {
            *self = Origin::Transient { id, commit };
        }
    }
}

/// A mapped table's row: its key, and the table's published column if it
/// has one.
#[derive(Debug, Clone)]
pub struct MappedRow {
    /// The mapped table, `schema.table` as configured (the archive names
    /// it, for a replay of one table).
    pub table: std::sync::Arc<str>,
    /// The key column's value, as text.
    pub key: String,
    pub published: Option<std::sync::Arc<PublishedColumn>>,
    /// The row could not become an event (no key, a column the mapping
    /// needs is gone, a value that is not text): why, naming the table, the
    /// column and the fix. It is DEAD in the relay's table with this
    /// reason, and nothing stops on it.
    pub unreadable: Option<String>,
}

/// A mapped table whose rows say whether they were published (the
/// `topic-payload` convention's `published_at`, NULL until then): the relay
/// sets it once a row is sent or handed to its own table, and a row with
/// it set is not sent again.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PublishedColumn {
    /// `"schema"."table"` as configured (for the log; the SQL names the
    /// table by [`Self::table_now`]).
    pub table: String,
    /// The table's oid, read at start-up: its name of the day is looked up
    /// by it, so a renamed or moved table's rows are still marked.
    pub oid: Option<u32>,
    /// The key column, quoted.
    pub id: String,
    /// The key column's type (`format_type`), read at start-up; `None`:
    /// compared as text (no index).
    pub id_type: Option<String>,
    /// The published column, quoted.
    pub column: String,
}

impl PublishedColumn {
    /// The table's name now, `"schema"."table"` as [`Self::table`], by its oid (renamed, moved to
    /// another schema), if the relay's statements on it can run: the table
    /// and its published column are there, and the role may read the key
    /// and set the column.
    pub async fn table_now<C: tokio_postgres::GenericClient>(
        &self,
        client: &C,
    ) -> Result<TableNow, tokio_postgres::Error> {
        let Some(oid) = self.oid else { return Ok(TableNow::Ready(self.table.clone())) };
        let (id, column) = (unquote(&self.id), unquote(&self.column));
        // The privileges are asked only of columns that are there (asked of
        // a column that is not, the function raises).
        let Some(row) = client
            .query_opt(
                "SELECT format('\"%s\".\"%s\"', replace(n.nspname, '\"', '\"\"'), replace(c.relname, '\"', '\"\"')),
                        has_schema_privilege(n.oid, 'USAGE'), p.there,
                        CASE WHEN p.there THEN has_column_privilege(c.oid, $2::text, 'SELECT') END,
                        CASE WHEN p.there THEN has_column_privilege(c.oid, $3::text, 'SELECT') END,
                        CASE WHEN p.there THEN has_column_privilege(c.oid, $3::text, 'UPDATE') END, current_user::text,
                        format('\"%s\"', replace(n.nspname, '\"', '\"\"'))
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  CROSS JOIN LATERAL (SELECT count(*) = 2 AS there FROM pg_attribute a
                          WHERE a.attrelid = c.oid AND a.attname IN ($2, $3) AND NOT a.attisdropped) p
                  WHERE c.oid = $1",
                &[&oid, &id, &column],
            )
            .await?
        else {
            return Ok(TableNow::Gone);
        };
        let (name, usage, there, role): (String, bool, bool, String) = (row.get(0), row.get(1), row.get(2), row.get(6));
        if !there {
            return Ok(TableNow::Refused(format!(
                "{name} has no column {id:?} or {column:?} any more: restore it, or fix the mapping in [[outbox]]"
            )));
        }
        let granted = |i: usize| row.get::<_, Option<bool>>(i).unwrap_or(false);
        let missing = match (usage, granted(3), granted(4), granted(5)) {
            (false, ..) => Some(format!("USAGE ON SCHEMA {}", row.get::<_, String>(7))),
            (_, false, ..) => Some(format!("SELECT ({}) ON {name}", self.id)),
            (_, _, false, _) => Some(format!("SELECT ({}) ON {name}", self.column)),
            (_, _, _, false) => Some(format!("UPDATE ({}) ON {name}", self.column)),
            _ => None,
        };
        Ok(match missing {
            Some(grant) => TableNow::Refused(format!("role {role:?} lacks it: GRANT {grant} TO {role}")),
            None => TableNow::Ready(name),
        })
    }

    /// The rows whose key is among `$1` (text[]), by the key's index.
    pub fn keys_in(&self) -> String {
        match &self.id_type {
            Some(t) => format!("{} = ANY($1::text[]::{t}[])", self.id),
            None => format!("{}::text = ANY($1::text[])", self.id),
        }
    }

    /// Sets the column on the rows of `table` ([`Self::table_now`]) whose
    /// key is among `$1` and that have it NULL; returns their keys.
    pub fn mark_sql(&self, table: &str) -> String {
        let (c, id) = (&self.column, &self.id);
        format!("UPDATE {table} SET {c} = now() WHERE {} AND {c} IS NULL RETURNING {id}::text", self.keys_in())
    }

    /// `row`'s key (`row` an alias of the table) equals the text `key`.
    pub fn key_is(&self, row: &str, key: &str) -> String {
        match &self.id_type {
            Some(t) => format!("{row}.{} = {key}::{t}", self.id),
            None => format!("{row}.{}::text = {key}", self.id),
        }
    }

    /// Of the keys in `$1`, those whose row of `table` has the column set.
    pub fn published_sql(&self, table: &str) -> String {
        let (c, id) = (&self.column, &self.id);
        format!("SELECT {id}::text FROM {table} WHERE {} AND {c} IS NOT NULL", self.keys_in())
    }
}

/// A mapped table's published column as the relay finds it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableNow {
    /// Its name of the day, quoted for SQL: the statements can run.
    Ready(String),
    /// Dropped.
    Gone,
    /// There, but a column is gone or the role lacks a privilege: why,
    /// with the fix.
    Refused(String),
}

/// An identifier [`crate::mapping::quote_ident`] quoted, as it is.
fn unquote(quoted: &str) -> String {
    quoted.strip_prefix('"').and_then(|q| q.strip_suffix('"')).unwrap_or(quoted).replace("\"\"", "\"")
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

/// A `deliver_at` value as text (pgoutput's, in the server's `DateStyle`;
/// the relay asks for ISO: `2026-12-04 19:04:25.5+01`, `infinity`, `-infinity`).
pub fn deliver_at(text: &str) -> DeliverAt {
    match text {
        "infinity" => DeliverAt::At(DeliverAt::NEVER),
        "-infinity" => DeliverAt::At(-DeliverAt::NEVER),
        _ => parse_iso_timestamptz(text).map_or(DeliverAt::Unreadable, DeliverAt::at),
    }
}

/// Microseconds since the Unix epoch of an ISO `timestamptz` text:
/// `YYYY-MM-DD HH:MM:SS[.ffffff]±HH[:MM[:SS]]`, with ` BC` after it for
/// years before 1 AD.
pub fn parse_iso_timestamptz(s: &str) -> Option<i64> {
    let (s, bc) = s.strip_suffix(" BC").map_or((s, false), |r| (r, true));
    let (date, rest) = s.split_once(' ')?;
    let zone_at = rest.rfind(['+', '-'])?;
    let (time, zone) = rest.split_at(zone_at);
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let year = if bc { 1 - year } else { year };
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (h, m, sec) = (t.next()??, t.next()??, t.next()??);
    let in_range = (0..=300_000).contains(&year.abs()) && (1..=12).contains(&month) && (1..=31).contains(&day);
    if !in_range || !(0..=24).contains(&h) || !(0..=59).contains(&m) || !(0..=60).contains(&sec) || frac.len() > 6 {
        return None;
    }
    let micros = if frac.is_empty() { 0 } else { frac.parse::<i64>().ok()? * 10i64.pow(6 - frac.len() as u32) };
    let sign = if zone.starts_with('-') { -1 } else { 1 };
    let mut z = zone[1..].splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (zh, zm, zs) = (z.next()??, z.next().unwrap_or(Some(0))?, z.next().unwrap_or(Some(0))?);
    if !(0..=24).contains(&zh) || !(0..=59).contains(&zm) || !(0..=59).contains(&zs) {
        return None;
    }
    let zone_s = zh * 3600 + zm * 60 + zs;
    let secs = days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + sec - sign * zone_s;
    // PostgreSQL's last years pass i64 microseconds: [`DeliverAt::at`]
    // clamps what saturates here to its latest time, never to `infinity`.
    Some(secs.saturating_mul(1_000_000).saturating_add(micros).clamp(-DeliverAt::LATEST, DeliverAt::LATEST))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `deliver_at` as microseconds since the Unix epoch, in SQL (a macro, so
/// that [`OUTBOX_COLUMNS`] can `concat!` it).
macro_rules! deliver_at_micros {
    () => {
        "CASE WHEN deliver_at = 'infinity' THEN 9223372036854775807
         WHEN deliver_at = '-infinity' THEN -9223372036854775807
         WHEN deliver_at IS NOT NULL
         THEN (greatest(least(extract(epoch FROM deliver_at), 9000000000000), -9000000000000) * 1000000)::bigint END"
    };
}

/// The outbox columns the table path selects, in [`OutboxEvent::from_row`]'s
/// order (the creation time stands in for the commit time).
/// `deliver_at` as [`DeliverAt::at`] reads it: `±infinity` as
/// `±`[`DeliverAt::NEVER`], other times clamped to [`DeliverAt::LATEST`].
pub const OUTBOX_COLUMNS: &str = concat!(
    "id, event_id, destination, body, group_key, attributes::text,
    (extract(epoch FROM created_at) * 1000000)::bigint, ",
    deliver_at_micros!(),
    ", replay_of"
);

/// How many columns [`OUTBOX_COLUMNS`] selects: what a statement selects
/// after them starts here.
pub const OUTBOX_COLUMN_COUNT: usize = 9;

/// `deliver_at` as microseconds since the Unix epoch ([`DeliverAt::at`]).
pub const DELIVER_AT_MICROS: &str = deliver_at_micros!();

impl OutboxEvent {
    /// A row selected with [`OUTBOX_COLUMNS`] first.
    pub fn from_row(r: &tokio_postgres::Row) -> Self {
        OutboxEvent {
            event_id: r.get(1),
            destination: r.get(2),
            body: r.get(3),
            group_key: r.get(4),
            attributes: r.get(5),
            commit_time_us: r.get(6),
            deliver_at: r.get::<_, Option<i64>>(7).map_or(DeliverAt::Unset, DeliverAt::at),
            replay_of: r.get(8),
            origin: Origin::Own { id: r.get(0), commit: None },
        }
    }

    /// Bytes the event holds in memory, for the unsettled budget: its
    /// texts, and [`PER_EVENT`] for what holds them.
    pub fn size(&self) -> usize {
        self.body.len()
            + self.event_id.len()
            + self.destination.len()
            + self.group_key.as_ref().map_or(0, String::len)
            + self.attributes.as_ref().map_or(0, String::len)
            + PER_EVENT
    }
}

/// What an unsettled event holds beside its texts' bytes (2026-12-07,
/// `size_of`): the event behind its `Arc` (264 bytes), its lane item in a
/// lane's queue or channel (208; its settlement, 120, takes its place), and
/// the allocator's overhead on each text (16–32 each).
const PER_EVENT: usize = 512;

#[cfg(any(test, feature = "test-utils"))]
impl OutboxEvent {
    /// A row for tests: event id `e:{id}`, no group, no attributes.
    pub fn for_test(id: i64, destination: &str, body: &str) -> Self {
        OutboxEvent {
            event_id: format!("e:{id}"),
            destination: destination.into(),
            body: body.into(),
            group_key: None,
            attributes: None,
            commit_time_us: 0,
            deliver_at: DeliverAt::Unset,
            replay_of: None,
            origin: Origin::Own { id, commit: None },
        }
    }
}
