//! A decoded pgoutput tuple of the outbox table, mapped by column name.

use replication::{Lsn, Relation, Tuple, TupleValue};

use crate::event::OutboxEvent;

use super::*;

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
    text(rel, t, "status").is_some_and(|s| s != "NEW") || text(rel, t, "next_attempt_at").is_some()
}

/// The outbox columns, by name, from a decoded row.
pub(crate) fn row_from_tuple(
    rel: &Relation,
    t: &Tuple,
    commit_time_us: i64,
    xid: Option<u32>,
    commit_lsn: Lsn,
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
        id,
        event_id: col("event_id")?.unwrap_or_default().to_owned(),
        destination: col("destination")?.unwrap_or_default().to_owned(),
        body: col("body")?.unwrap_or_default().to_owned(),
        group_key: col("group_key")?.map(str::to_owned),
        attributes: col("attributes")?.map(str::to_owned),
        commit_time_us,
        xid,
        commit_lsn: Some(commit_lsn),
        transient: false,
    })
}

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
    Ok(ev)
}

/// The rows of a chunk as committed, for a transaction that goes on past the
/// chunk: the rest of it (committed, not decoded yet) may update them, so
/// each row still in the table under its event id is taken as the table has
/// it (body, destination, group, attributes). Rows gone from the table keep
/// what the stream said (deleted by this transaction or a later one).
pub(crate) async fn as_committed(sql: &tokio_postgres::Client, buf: &mut [OutboxEvent]) -> Result<(), CdcError> {
    let at: HashMap<i64, usize> = buf.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    let ids: Vec<i64> = buf.iter().map(|e| e.id).collect();
    let sql_text = format!("SELECT {} FROM outbox WHERE id = ANY($1)", crate::event::OUTBOX_COLUMNS);
    for r in sql.query(&sql_text, &[&ids]).await.map_err(CdcError::Pg)? {
        let table = OutboxEvent::from_row(&r);
        let Some(&i) = at.get(&table.id) else { continue };
        let ev = &mut buf[i];
        if ev.event_id == table.event_id {
            ev.destination = table.destination;
            ev.body = table.body;
            ev.group_key = table.group_key;
            ev.attributes = table.attributes;
        }
    }
    Ok(())
}
