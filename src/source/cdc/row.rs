//! A decoded pgoutput tuple of the outbox table, mapped by column name.

use replication::{Relation, Tuple, TupleValue};

use crate::db::settled::Holder;
#[cfg(test)]
use crate::event::parse_iso_timestamptz;
use crate::event::{deliver_at, Commit, DeliverAt, Origin, OutboxEvent, PublishedColumn};
use crate::mapping::{Mapping, MappingError, Value};
use sha2::Digest;
use std::collections::HashMap;

use super::CdcError;

/// A column's text value by name (`None`: NULL or absent from the tuple).
fn text<'t>(rel: &Relation, t: &'t Tuple, name: &str) -> Option<&'t str> {
    match t.0.get(rel.column_index(name)?) {
        Some(TupleValue::Null) | None => None,
        Some(v) => v.as_str().and_then(Result::ok),
    }
}

/// The id of an outbox row, from a tuple: a deleted row's key (or full old)
/// tuple, an updated row's new one.
pub(crate) fn tuple_id(rel: &Relation, t: &Tuple) -> Option<i64> {
    text(rel, t, "id")?.parse().ok()
}

/// An inserted row the table path owns: written back by the relay itself
/// (a transient row ended DEAD or deferred) or inserted as already handed to
/// the table. The stream skips it; the spool drain or `dead` finds it.
pub(crate) fn owned_by_table(rel: &Relation, t: &Tuple) -> bool {
    Holder::of(text(rel, t, "status"), text(rel, t, "next_attempt_at").is_some()) != Holder::Stream
}

/// The outbox columns, by name, from a decoded row.
pub(crate) fn row_from_tuple(
    rel: &Relation,
    t: &Tuple,
    commit_time_us: i64,
    commit: Commit,
) -> Result<OutboxEvent, CdcError> {
    let col = |name: &str| -> Result<Option<&str>, CdcError> {
        let i = rel
            .column_index(name)
            .ok_or_else(|| CdcError::Protocol(format!("the outbox table has no column {name:?}")))?;
        match t.0.get(i) {
            None | Some(TupleValue::Null) => Ok(None),
            Some(v) => match v.as_str() {
                Some(Ok(s)) => Ok(Some(s)),
                Some(Err(e)) => Err(e.into()),
                None => Err(CdcError::Protocol(format!("column {name:?}: not a text value"))),
            },
        }
    };
    let id = col("id")?
        .and_then(|s| s.parse::<i64>().ok())
        .ok_or_else(|| CdcError::Protocol("outbox row without a numeric id".into()))?;
    Ok(OutboxEvent {
        event_id: col("event_id")?.unwrap_or_default().to_owned(),
        destination: col("destination")?.unwrap_or_default().to_owned(),
        body: col("body")?.unwrap_or_default().to_owned(),
        group_key: col("group_key")?.map(str::to_owned),
        attributes: col("attributes")?.map(str::to_owned),
        commit_time_us,
        // Optional: a table migrated before `deliver_at` existed has none.
        deliver_at: text(rel, t, "deliver_at").map_or(DeliverAt::Unset, deliver_at),
        // Optional too: a table migrated before replays existed has none.
        replay_of: text(rel, t, "replay_of").and_then(|r| r.parse().ok()),
        origin: Origin::Own { id, commit: Some(commit) },
    })
}

/// A row of a mapped table, by its mapping ([`Mapping::event`]); `before`:
/// the event as inserted, for a row its own transaction updated. A column
/// the mapping can do without that the table no longer has reads as NULL; a
/// row that cannot become an event (no key, a needed column gone, a value
/// that is not text) is one the route makes DEAD with the reason
/// ([`Mapping::unreadable`]; `fallback`: its key if it has none).
pub(crate) fn mapped_row(
    mapping: &Mapping,
    rel: &Relation,
    t: &Tuple,
    before: Option<&OutboxEvent>,
    commit_time_us: i64,
    published: Option<&std::sync::Arc<PublishedColumn>>,
    fallback: impl FnOnce() -> String,
) -> OutboxEvent {
    let table = || format!("{}.{}", rel.namespace, rel.name);
    let col = |name: &str| -> Result<Value<'_>, MappingError> {
        let Some(i) = rel.column_index(name) else {
            if !mapping.requires(name) {
                return Ok(Value::Null);
            }
            return Err(MappingError {
                table: table(),
                what: format!(
                    "no column {name:?} in the stream (dropped, or renamed): restore it, or fix the mapping in \
                     [[outbox]]; this row's copy in the relay's table can be corrected and sent by \
                     `outbox-relay dead redrive`"
                ),
            });
        };
        match t.0.get(i) {
            None | Some(TupleValue::Null) => Ok(Value::Null),
            Some(TupleValue::UnchangedToast) => Ok(Value::Unchanged),
            Some(v) => match v.as_str() {
                Some(Ok(s)) => Ok(Value::Text(s.into())),
                _ => Err(MappingError { table: table(), what: format!("column {name:?}: not a UTF-8 text value") }),
            },
        }
    };
    let bytea = |name: &str| rel.column_index(name).is_some_and(|i| rel.columns[i].type_oid == BYTEA_OID);
    match mapping.event(col, bytea, before, commit_time_us, published) {
        Ok(ev) => ev,
        Err(e) => mapping.unreadable(col, &e, &fallback(), commit_time_us, published),
    }
}

/// A mapped table's row inserted with its published column set: not one to
/// send (copied in as it was, or published by whoever wrote it).
pub(crate) fn inserted_published(mapping: &Mapping, rel: &Relation, t: &Tuple) -> bool {
    mapping.published.as_deref().is_some_and(|c| text(rel, t, c).is_some())
}

/// An UPDATE that left a mapped row's published column NULL where it was
/// set: the way to ask for the row again. Without the old row (a replica
/// identity other than FULL) an update that leaves it NULL counts too: the
/// claim that follows finds it published already, or sends it (at least
/// once).
pub(crate) fn unpublished_again(mapping: &Mapping, rel: &Relation, new: &Tuple, old: Option<&Tuple>) -> bool {
    let Some(i) = mapping.published.as_deref().and_then(|c| rel.column_index(c)) else { return false };
    let null = |t: &Tuple| matches!(t.0.get(i), Some(TupleValue::Null));
    null(new) && old.is_none_or(|o| !null(o))
}

/// The key of a mapped table's row in a tuple (a delete's key, an update's
/// new row), as text.
pub(crate) fn mapped_key(mapping: &Mapping, rel: &Relation, t: &Tuple) -> Option<String> {
    text(rel, t, &mapping.id).map(str::to_owned)
}

/// PostgreSQL's `bytea` type.
const BYTEA_OID: u32 = 17;

/// A row its own transaction updated after inserting it: the new tuple's
/// values over the row held for the transaction. A TOASTed value the update
/// left unchanged is not in the stream: the held one stays.
pub(crate) fn updated_row(rel: &Relation, new: &Tuple, held: &OutboxEvent) -> Result<OutboxEvent, CdcError> {
    // None: unchanged (or not in the tuple); Some(None): NULL.
    let col = |name: &str| -> Result<Option<Option<String>>, CdcError> {
        match rel.column_index(name).and_then(|i| new.0.get(i)) {
            None | Some(TupleValue::UnchangedToast) => Ok(None),
            Some(TupleValue::Null) => Ok(Some(None)),
            Some(v) => match v.as_str() {
                Some(Ok(s)) => Ok(Some(Some(s.to_owned()))),
                Some(Err(e)) => Err(e.into()),
                None => Err(CdcError::Protocol(format!("column {name:?}: not a text value"))),
            },
        }
    };
    let mut ev = held.clone();
    if let Some(v) = col("event_id")? {
        ev.event_id = v.unwrap_or_default();
    }
    if let Some(v) = col("destination")? {
        ev.destination = v.unwrap_or_default();
    }
    if let Some(v) = col("body")? {
        ev.body = v.unwrap_or_default();
    }
    if let Some(v) = col("group_key")? {
        ev.group_key = v;
    }
    if let Some(v) = col("attributes")? {
        ev.attributes = v;
    }
    if let Some(v) = col("deliver_at")? {
        ev.deliver_at = v.as_deref().map_or(DeliverAt::Unset, deliver_at);
    }
    Ok(ev)
}

/// The rows of a chunk as committed, for a transaction that goes on past the
/// chunk: the rest of it (committed, not decoded yet) may update them, so
/// each row still in the table under its event id is taken as the table has
/// it (body, destination, group, attributes). Rows gone from the table keep
/// what the stream said (deleted by this transaction or a later one).
///
/// A body over [`READ_BACK_BODY`] comes back only if it changed (its SHA-256
/// differs from the one read from the stream): a transaction of bodies of
/// tens of MiB, each a chunk of its own, is not read twice, nor held twice.
pub(crate) async fn as_committed(sql: &tokio_postgres::Client, buf: &mut [OutboxEvent]) -> Result<(), CdcError> {
    // A mapped table's rows are not in the relay's table: sent as inserted.
    let at: HashMap<i64, usize> = buf.iter().enumerate().filter_map(|(i, e)| Some((e.row_id()?, i))).collect();
    if at.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = at.keys().copied().collect();
    let hashes: Vec<Option<Vec<u8>>> = ids
        .iter()
        .map(|id| {
            let body = &buf[at[id]].body;
            (body.len() > READ_BACK_BODY).then(|| sha2::Sha256::digest(body.as_bytes()).to_vec())
        })
        .collect();
    for r in sql.query(AS_COMMITTED_SQL.as_str(), &[&ids, &hashes]).await.map_err(CdcError::Pg)? {
        let Some(&i) = at.get(&r.get::<_, i64>(0)) else { continue };
        let ev = &mut buf[i];
        if ev.event_id == r.get::<_, &str>(1) {
            ev.destination = r.get(2);
            if let Some(body) = r.get::<_, Option<String>>(3) {
                ev.body = body;
            }
            ev.group_key = r.get(4);
            ev.attributes = r.get(5);
            ev.deliver_at = r.get::<_, Option<i64>>(6).map_or(DeliverAt::Unset, DeliverAt::at);
        }
    }
    Ok(())
}

/// Bodies up to this many bytes are read back whole by [`as_committed`];
/// larger ones only if their hash changed.
const READ_BACK_BODY: usize = 64 << 10;

/// [`as_committed`]'s read-back: the rows of `$1` (ids), the body NULL where
/// `$2` (their SHA-256, NULL for small bodies) says it is unchanged.
static AS_COMMITTED_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT o.id, o.event_id, o.destination,
                CASE WHEN u.hash IS NOT NULL AND sha256(convert_to(o.body, 'UTF8')) = u.hash THEN NULL ELSE o.body END,
                o.group_key, o.attributes::text, {}
           FROM unnest($1::bigint[], $2::bytea[]) AS u(id, hash) JOIN outbox o ON o.id = u.id",
        crate::event::DELIVER_AT_MICROS.replace("deliver_at", "o.deliver_at")
    )
});

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn iso_times_as_pgoutput_sends_them() {
        // Expected values from Python's datetime.
        assert_eq!(parse_iso_timestamptz("1970-01-01 00:00:00+00"), Some(0));
        assert_eq!(parse_iso_timestamptz("2026-12-04 19:04:25.123456+00"), Some(1_796_411_065_123_456));
        assert_eq!(parse_iso_timestamptz("2000-02-29 12:00:00-05:30"), Some(951_845_400_000_000));
        assert_eq!(parse_iso_timestamptz("0001-01-01 00:00:00+00"), Some(-62_135_596_800_000_000));
        assert_eq!(parse_iso_timestamptz("0001-01-01 00:00:00+00 BC"), Some(-62_167_219_200_000_000));
        assert_eq!(parse_iso_timestamptz("9999-12-31 23:59:59.5+14"), Some(253_402_250_399_500_000));
        assert_eq!(parse_iso_timestamptz("2026-12-04 19:04:25.1+00"), Some(1_796_411_065_100_000));
        // The last years PostgreSQL stores: far, not never.
        for s in ["290000-01-01 00:00:00+00", "294276-12-31 23:59:59+00", "280000-01-01 00:00:00+00"] {
            let DeliverAt::At(us) = deliver_at(s) else { panic!("{s}") };
            assert!(us > 8_000_000_000_000_000_000 && us <= DeliverAt::LATEST, "{s}: {us}");
        }
        assert_eq!(deliver_at("infinity"), DeliverAt::At(DeliverAt::NEVER));
        assert_eq!(deliver_at("-infinity"), DeliverAt::At(-DeliverAt::NEVER));
        // Not ISO (DateStyle Postgres, SQL, German): unreadable, never a guess.
        for s in ["Fri Dec 04 19:04:25 2026 UTC", "12/04/2026 19:04:25 UTC", "04.12.2026 19:04:25 UTC", ""] {
            assert_eq!(deliver_at(s), DeliverAt::Unreadable, "{s}");
        }
    }

    proptest! {
        /// A zone offset moves the instant by exactly that much, and the
        /// fraction adds its microseconds.
        #[test]
        fn offsets_and_fractions_add_up(
            y in 1i64..9999, mo in 1i64..=12, d in 1i64..=28, h in 0i64..24, mi in 0i64..60, s in 0i64..60,
            us in 0i64..1_000_000, zh in 0i64..15, zm in 0i64..60, west: bool,
        ) {
            let base = format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}");
            let utc = parse_iso_timestamptz(&format!("{base}+00")).unwrap();
            let sign = if west { '-' } else { '+' };
            let zoned = parse_iso_timestamptz(&format!("{base}.{us:06}{sign}{zh:02}:{zm:02}")).unwrap();
            let offset = (zh * 3600 + zm * 60) * 1_000_000 * if west { -1 } else { 1 };
            prop_assert_eq!(zoned, utc + us - offset);
            let next_day = parse_iso_timestamptz(&format!("{y:04}-{mo:02}-{:02} {h:02}:{mi:02}:{s:02}+00", d + 1)).unwrap();
            prop_assert_eq!(next_day - utc, 86_400_000_000);
        }

        /// Any text: a time or unreadable, never a panic.
        #[test]
        fn any_text_is_read_or_refused(s in ".{0,40}") {
            let _ = deliver_at(&s);
        }
    }
}
