//! What settlement needs the relay's role to be granted, checked at start-up.

use crate::config::PublishedRows;

/// What settlement writes, by `published_rows`: DELETE (and INSERT, for
/// transient rows ended DEAD or deferred) on the outbox, and the runs of
/// published ids. Each missing privilege is named with its GRANT.
pub async fn check_privileges(
    client: &tokio_postgres::Client,
    published: PublishedRows,
) -> Result<(), crate::db::DbError> {
    let runs: bool = client.query_one("SELECT to_regclass('outbox_published_runs') IS NOT NULL", &[]).await?.get(0);
    if !runs {
        return Err(crate::db::DbError::Check(
            "the table outbox_published_runs does not exist: run `outbox-relay migrate --database-url ...` (migration 5)"
                .into(),
        ));
    }
    let mut needed = vec![("outbox", "INSERT"), ("outbox_published_runs", "SELECT")];
    if published == PublishedRows::Delete {
        needed.extend([("outbox", "DELETE"), ("outbox_published_runs", "INSERT"), ("outbox_published_runs", "DELETE")]);
    }
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    for (table, privilege) in needed {
        let ok: bool = client.query_one("SELECT has_table_privilege($1, $2)", &[&table, &privilege]).await?.get(0);
        if !ok {
            return Err(crate::db::DbError::Check(format!(
                "role {user:?} lacks {privilege} on {table}, which settlement needs (published_rows = {published:?}): GRANT {privilege} ON {table} TO {user}"
            )));
        }
    }
    Ok(())
}
