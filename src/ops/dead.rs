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

/// Which DEAD rows: of a destination, of a mapped table (`schema.table`:
/// its rows' event ids start with `schema.table:`), or all.
#[derive(Debug, Default, Clone, Copy)]
pub struct DeadFilter<'a> {
    pub destination: Option<&'a str>,
    pub table: Option<&'a str>,
}

impl DeadFilter<'_> {
    /// The mapped table's event-id prefix.
    fn prefix(&self) -> Option<String> {
        self.table.map(|t| if t.contains('.') { format!("{t}:") } else { format!("public.{t}:") })
    }
}

pub async fn dead_list(
    client: &Client,
    filter: DeadFilter<'_>,
    limit: i64,
) -> Result<Vec<DeadRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id, destination, event_id, attempts, last_error, created_at::text
               FROM outbox
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1)
                AND ($3::text IS NULL OR starts_with(event_id, $3))
              ORDER BY id LIMIT $2",
            &[&filter.destination, &limit, &filter.prefix()],
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
    filter: DeadFilter<'_>,
    id: Option<i64>,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE outbox
                SET status = 'NEW', attempts = 0, last_error = NULL, next_attempt_at = now(), published_at = NULL
              WHERE status = 'DEAD' AND ($1::text IS NULL OR destination = $1) AND ($2::bigint IS NULL OR id = $2)
                AND ($3::text IS NULL OR starts_with(event_id, $3))",
            &[&filter.destination, &id, &filter.prefix()],
        )
        .await
}
