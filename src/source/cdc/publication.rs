//! The publication the slot reads: CDC's prerequisites, and the shard rules
//! of a row-filtered publication.

use tokio_postgres::Client;

use crate::db::schema::check_outbox_table;
use crate::db::server::Platform;
use crate::db::DbError;

/// Start-up checks for CDC mode that SQL can answer; each failure says how to
/// fix it. Whether the role may replicate is decided by trying
/// (`source::cdc::check_cdc`), not from its attributes: managed services
/// grant it through roles of their own.
pub async fn check_cdc_prerequisites(client: &Client, publication: &str) -> Result<(), DbError> {
    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level != "logical" {
        let fix = Platform::detect(client).await?.wal_level_fix();
        return Err(DbError::CdcUnavailable(format!("wal_level is '{wal_level}', CDC mode needs 'logical': {fix}")));
    }
    check_outbox_table(client).await?;
    let publ = client.query_opt("SELECT 1 FROM pg_publication WHERE pubname = $1", &[&publication]).await?;
    if publ.is_none() {
        return Err(DbError::CdcUnavailable(format!(
            "publication {publication:?} does not exist: run `outbox-relay migrate`, or CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert, update, delete')"
        )));
    }
    Ok(())
}

/// The destinations a publication's row filter lets through, from
/// `pg_publication_tables.rowfilter` (`None`: no filter, every row).
pub fn filter_destinations(rowfilter: Option<&str>) -> Option<std::collections::BTreeSet<String>> {
    let f = rowfilter?;
    let mut out = std::collections::BTreeSet::new();
    let mut chars = f.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\'' {
            continue;
        }
        let mut lit = String::new();
        loop {
            match chars.next() {
                Some('\'') if chars.peek() == Some(&'\'') => {
                    chars.next();
                    lit.push('\'');
                }
                Some('\'') | None => break,
                Some(ch) => lit.push(ch),
            }
        }
        out.insert(lit);
    }
    Some(out)
}

/// Shards: the publication's row filter must be exactly this relay's
/// destinations, and no other filtered publication of the outbox may carry
/// any of them (two relays would both send those rows). Returns whether this
/// relay's publication is filtered (sharded).
pub async fn check_shard(client: &Client, publication: &str, destinations: &[String]) -> Result<bool, DbError> {
    let rows = client
        .query(
            "SELECT pubname::text, rowfilter FROM pg_publication_tables WHERE tablename = 'outbox' AND schemaname = current_schema()",
            &[],
        )
        .await?;
    let mine: std::collections::BTreeSet<String> = destinations.iter().cloned().collect();
    let mut sharded = false;
    let mut shards = Vec::new();
    for r in &rows {
        let (name, filter): (String, Option<String>) = (r.get(0), r.get(1));
        let set = filter_destinations(filter.as_deref());
        if name == publication {
            if let Some(set) = set {
                sharded = true;
                if set != mine {
                    return Err(DbError::Check(format!(
                        "publication {publication:?} carries destinations {set:?} but this relay is configured for {mine:?}: they must be the same (or use another publication)"
                    )));
                }
            }
            continue;
        }
        if let Some(set) = set {
            let shared: Vec<&String> = set.intersection(&mine).collect();
            if !shared.is_empty() {
                return Err(DbError::Check(format!(
                    "destinations {shared:?} are also carried by publication {name:?} (another relay's shard): shards must have disjoint destinations"
                )));
            }
            shards.push(name);
        }
    }
    if !sharded && !shards.is_empty() {
        tracing::warn!(
            publication,
            ?shards,
            "this relay reads every row of the outbox while shard publications exist beside it: rows of the shards' destinations, which this relay does not know, end DEAD (unknown_destination) unless they are in its destinations; give this relay a shard of its own (`slot create` with a publication filtered to its destinations)"
        );
    }
    Ok(sharded)
}
