//! The relay's own schema: the migrations, and the start-up checks that the
//! tables exist with the privileges the role needs.

use tokio_postgres::Client;

use super::DbError;

/// The migrations, in order; each runs once, recorded in `outbox_relay_migrations`.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "outbox", include_str!("../../migrations/0001_outbox.sql")),
    (2, "publication", include_str!("../../migrations/0002_publication.sql")),
    (3, "spool", include_str!("../../migrations/0003_spool.sql")),
    // The consumer's jobs table and functions, from its own crate.
    (outbox_consumer::JOBS_MIGRATION, "jobs", outbox_consumer::JOBS_SQL),
    (5, "published", include_str!("../../migrations/0005_published.sql")),
    // The consumer's protocol functions, from its own crate.
    (outbox_consumer::PROTOCOL_MIGRATION, "job protocol", outbox_consumer::PROTOCOL_SQL),
    (7, "runs survive id reuse", include_str!("../../migrations/0007_runs_reuse.sql")),
    (8, "publish updates", include_str!("../../migrations/0008_publish_updates.sql")),
    (9, "durable slot hand-off", include_str!("../../migrations/0009_handoffs.sql")),
    (10, "runs list the table path's event ids", include_str!("../../migrations/0010_runs_event_ids.sql")),
    (11, "delayed delivery", include_str!("../../migrations/0011_deliver_at.sql")),
    // `outbox_enqueue_job` takes the producer's trace context (the consumer's crate).
    (outbox_consumer::TRACE_MIGRATION, "job trace context", outbox_consumer::TRACE_SQL),
];

/// Apply the migrations not applied yet, under an advisory lock so concurrent
/// deploys do not race. Returns the versions applied now.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, DbError> {
    Ok(outbox_consumer::apply_migrations(client, MIGRATIONS).await?)
}

/// The migrations `migrate` would apply now, in order, with their SQL;
/// nothing is written (`migrate --dry-run`).
pub async fn pending(client: &Client) -> Result<Vec<(i32, &'static str, &'static str)>, DbError> {
    let recorded = client.query_one("SELECT to_regclass('outbox_relay_migrations') IS NOT NULL", &[]).await?.get(0);
    let applied: Vec<i32> = if recorded {
        client.query("SELECT version FROM outbox_relay_migrations", &[]).await?.iter().map(|r| r.get(0)).collect()
    } else {
        Vec::new()
    };
    Ok(MIGRATIONS.iter().filter(|(v, _, _)| !applied.contains(v)).copied().collect())
}

/// The outbox table exists (every mode needs it).
pub async fn check_outbox_table(client: &Client) -> Result<(), DbError> {
    let outbox = client.query_opt("SELECT to_regclass('outbox')::text", &[]).await?;
    if outbox.and_then(|r| r.get::<_, Option<String>>(0)).is_none() {
        return Err(DbError::Check(
            "the outbox table does not exist in this database: run `outbox-relay migrate --database-url ...` first"
                .into(),
        ));
    }
    let row = client
        .query_one(
            "SELECT current_user::text, has_table_privilege('outbox', 'SELECT'), has_table_privilege('outbox', 'UPDATE')",
            &[],
        )
        .await?;
    let (user, select, update): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    let missing: Vec<&str> =
        [("SELECT", select), ("UPDATE", update)].iter().filter(|(_, ok)| !ok).map(|(p, _)| *p).collect();
    if !missing.is_empty() {
        return Err(DbError::Check(format!(
            "role {user:?} lacks {} on the outbox table: GRANT {} ON outbox TO {user}",
            missing.join(" and "),
            missing.join(", ")
        )));
    }
    Ok(())
}

/// A new slot's hand-off is recorded in `outbox_relay_handoffs` while it runs
/// (CDC mode): the table and the role's SELECT, INSERT and DELETE on it.
pub async fn check_handoffs(client: &Client) -> Result<(), DbError> {
    let exists: bool = client.query_one("SELECT to_regclass('outbox_relay_handoffs') IS NOT NULL", &[]).await?.get(0);
    if !exists {
        return Err(DbError::Check(
            "the table outbox_relay_handoffs does not exist: run `outbox-relay migrate --database-url ...` (migration 9)"
                .into(),
        ));
    }
    let user: String = client.query_one("SELECT current_user::text", &[]).await?.get(0);
    for privilege in ["SELECT", "INSERT", "DELETE"] {
        let ok: bool =
            client.query_one("SELECT has_table_privilege('outbox_relay_handoffs', $1)", &[&privilege]).await?.get(0);
        if !ok {
            return Err(DbError::Check(format!(
                "role {user:?} lacks {privilege} on outbox_relay_handoffs, where a new slot's hand-off is recorded: GRANT SELECT, INSERT, DELETE ON outbox_relay_handoffs TO {user}"
            )));
        }
    }
    Ok(())
}

/// Whether the current role may DELETE from the outbox (the retention sweeper).
pub async fn can_delete_outbox(client: &Client) -> Result<bool, DbError> {
    Ok(client.query_one("SELECT has_table_privilege('outbox', 'DELETE')", &[]).await?.get(0))
}
