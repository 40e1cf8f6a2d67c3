//! Waiting for rows whose transaction the stream decoded before it became
//! visible to new snapshots.

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::event::PublishedColumn;

use super::sql::{XID_SNAPSHOT, XID_VISIBLE};

/// How long [`super::mark()`] waits, at most, for a row whose transaction is not
/// visible yet (a safety net: that window lasts microseconds).
pub(super) const VISIBILITY_DEADLINE: Duration = Duration::from_secs(10);

/// Of (key, inserting xid) pairs not marked, those to try again, in one
/// snapshot: the row is there with the column NULL (it became visible after
/// the marking statement's snapshot), or its transaction is not visible yet.
/// A row with the column set, or gone, is done.
pub(super) async fn not_visible_yet<C: GenericClient>(
    client: &C,
    table: &PublishedColumn,
    name: &str,
    rows: &[(&str, Option<i64>)],
) -> Result<HashSet<String>, tokio_postgres::Error> {
    if rows.is_empty() {
        return Ok(HashSet::new());
    }
    let (keys, xids): (Vec<&str>, Vec<Option<i64>>) = rows.iter().copied().unzip();
    let sql = format!(
        "SELECT u.key FROM unnest($1::text[], $2::bigint[]) AS u(key, xid) {XID_SNAPSHOT}
          WHERE NOT {XID_VISIBLE} OR EXISTS (SELECT 1 FROM {name} x WHERE {} AND x.{} IS NULL)",
        table.key_is("x", "u.key"),
        table.column
    );
    Ok(client.query(&sql, &[&keys, &xids]).await?.iter().map(|r| r.get(0)).collect())
}
