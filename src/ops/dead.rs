//! `dead list` and `dead redrive`.

use tokio_postgres::Client;

/// A DEAD row, for `dead list`.
#[derive(Debug, serde::Serialize)]
pub struct DeadRow {
    pub id: i64,
    pub destination: String,
    pub event_id: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub created_at: String,
}

pub async fn dead_list(
    client: &Client,
    destination: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, destination, event_id, attempts, last_error, created_at::text
               FROM outbox
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1)
              ORDER BY id LIMIT $2",
            &[&destination, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| DeadRow {
            id: r.get(0),
            destination: r.get(1),
            event_id: r.get(2),
            attempts: r.get(3),
            last_error: r.get(4),
            created_at: r.get(5),
        })
        .collect())
}

pub fn format_dead(rows: &[DeadRow]) -> String {
    let mut out = format!("{:>10}  {:<16} {:<32} {:>8}  last_error\n", "id", "destination", "event_id", "attempts");
    for r in rows {
        out += &format!(
            "{:>10}  {:<16} {:<32} {:>8}  {}\n",
            r.id,
            r.destination,
            r.event_id,
            r.attempts,
            r.last_error.as_deref().unwrap_or("")
        );
    }
    out
}

/// DEAD → NEW with attempts reset and `next_attempt_at = now()`, so the table
/// path (the polling relay, or a CDC relay's spool drain) sends it again.
/// Returns rows redriven.
pub async fn dead_redrive(
    client: &Client,
    destination: Option<&str>,
    id: Option<i64>,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE outbox
                SET status = 'NEW', attempts = 0, last_error = NULL, next_attempt_at = now(), published_at = NULL
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1) AND ($2::bigint IS NULL OR id = $2)",
            &[&destination, &id],
        )
        .await
}
