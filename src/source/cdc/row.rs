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

/// The id of a deleted outbox row, from its key (or full old) tuple.
pub(crate) fn deleted_id(rel: &Relation, t: &Tuple) -> Option<i64> {
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
