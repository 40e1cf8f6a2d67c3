//! Setting the published column of mapped rows settled here.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::event::{MappedRow, PublishedColumn, TableNow};
use crate::pipeline::owed::Owed;

use super::outcome::Settlement;
use super::visible::{not_visible_yet, VISIBILITY_DEADLINE};

/// Set the published column of mapped rows settled here (sent, or written
/// to the relay's table just now, in the same transaction): one statement
/// per table. Rows set already, or deleted by their producers, are left. A
/// row whose transaction the stream decoded before it became visible to new
/// snapshots is waited for and marked then, as [`super::mark::mark_rows`] does for the
/// relay's own. A table the statement cannot run on now (a grant taken,
/// moved out of reach) has its rows' keys kept in `owed`.
pub(super) async fn mark_mapped_published<C: GenericClient>(
    client: &C,
    settled: &[&Settlement],
    owed: &mut Owed,
) -> Result<u64, tokio_postgres::Error> {
    let mut by_table: std::collections::HashMap<&Arc<PublishedColumn>, Vec<(&str, Option<i64>)>> =
        std::collections::HashMap::new();
    for s in settled {
        if let Some(MappedRow { key, published: Some(p), .. }) = s.event.mapped() {
            by_table.entry(p).or_default().push((key, s.event.commit().map(|c| i64::from(c.xid))));
        }
    }
    let mut n = 0;
    for (table, rows) in by_table {
        // By its oid: renamed or moved since start-up, it is marked under
        // its name of the day; dropped, its rows have nothing to mark.
        let name = match table.table_now(client).await? {
            TableNow::Ready(name) => name,
            TableNow::Gone => {
                tracing::warn!(table = %table.table, rows = rows.len(), "mapped table dropped: its rows were settled, no published column is left to set");
                continue;
            }
            // Sent (or in the relay's table) all the same: marked once the
            // statement can run.
            TableNow::Refused(why) => {
                tracing::error!(table = %table.table, rows = rows.len(), "mapped rows settled but their published column not set now (set once it can be): {why}");
                owed.owe(table, rows.iter().map(|(k, _)| k.to_string()));
                continue;
            }
        };
        n += mark_visible(client, table, &name, rows).await?;
    }
    Ok(n)
}

/// Set the published column of `rows` of `table` (named `name` now), and
/// of those whose transaction is not visible yet once it is (within
/// [`VISIBILITY_DEADLINE`]); rows set already or gone are left. Returns
/// the rows set.
async fn mark_visible<C: GenericClient>(
    client: &C,
    table: &PublishedColumn,
    name: &str,
    mut rows: Vec<(&str, Option<i64>)>,
) -> Result<u64, tokio_postgres::Error> {
    let mark_sql = table.mark_sql(name);
    let (started, mut waits, mut n) = (std::time::Instant::now(), 0, 0);
    loop {
        let keys: Vec<&str> = rows.iter().map(|(k, _)| *k).collect();
        let marked: HashSet<String> = client.query(&mark_sql, &[&keys]).await?.iter().map(|r| r.get(0)).collect();
        n += marked.len() as u64;
        rows.retain(|(k, _)| !marked.contains(*k));
        let invisible = not_visible_yet(client, table, name, &rows).await?;
        let done: Vec<&str> = rows.iter().map(|(k, _)| *k).filter(|k| !invisible.contains(*k)).collect();
        if !done.is_empty() {
            tracing::debug!(table = %table.table, keys = ?done, "mapped rows published already or gone: not marked");
        }
        rows.retain(|(k, _)| invisible.contains(*k));
        if rows.is_empty() {
            return Ok(n);
        }
        if started.elapsed() > VISIBILITY_DEADLINE {
            let keys: Vec<&str> = rows.iter().map(|(k, _)| *k).take(5).collect();
            tracing::warn!(table = %table.table, ?keys, "mapped rows to mark published did not become visible; their published column stays NULL (they may be sent again)");
            return Ok(n);
        }
        let wait = crate::policy::retry::backoff(waits, Duration::from_millis(1), Duration::from_millis(100));
        tokio::time::sleep(wait).await;
        waits += 1;
    }
}
