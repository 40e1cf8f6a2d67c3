//! What producers call: enqueue a job with its outbox event, redrive it, ask
//! it not to run. Each is one SQL function call, in the caller's transaction.

use tokio_postgres::GenericClient;

/// What to enqueue.
#[derive(Debug, Clone)]
pub struct NewJob<'a> {
    pub kind: &'a str,
    pub payload: &'a serde_json::Value,
    /// The outbox destination (lane) its messages go to.
    pub destination: &'a str,
    /// FIFO MessageGroupId, for a FIFO queue.
    pub group_key: Option<&'a str>,
    /// Your own idempotency key; by default the hash of kind and payload.
    pub job_id: Option<&'a str>,
    /// The producer's W3C `traceparent`: the job's handler runs with it
    /// ([`crate::Job::traceparent`]) and in a span that names it.
    pub traceparent: Option<&'a str>,
}

/// Enqueue a job with its outbox event in `client`'s transaction. Identical
/// work enqueued again is a no-op returning the same id; the same `job_id`
/// with a different kind or payload is an error (SQLSTATE 23505).
pub async fn enqueue<C: GenericClient>(client: &C, job: &NewJob<'_>) -> Result<String, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT outbox_enqueue_job($1, $2, $3, $4, $5, $6)",
            &[&job.kind, &job.payload, &job.destination, &job.group_key, &job.job_id, &job.traceparent],
        )
        .await?;
    Ok(row.get(0))
}

/// The id `enqueue` gives this work (computed by the database, so every
/// language agrees).
pub async fn job_id<C: GenericClient>(
    client: &C,
    kind: &str,
    payload: &serde_json::Value,
) -> Result<String, tokio_postgres::Error> {
    Ok(client.query_one("SELECT outbox_job_id($1, $2)", &[&kind, payload]).await?.get(0))
}

/// Redrive a job: new generation, reset, new outbox event, in `client`'s
/// transaction. Returns the new generation.
pub async fn redrive<C: GenericClient>(client: &C, job_id: &str) -> Result<i32, tokio_postgres::Error> {
    Ok(client.query_one("SELECT outbox_redrive_job($1)", &[&job_id]).await?.get(0))
}

/// Ask a job not to run (again). A claimed job's handler sees it through its
/// lease heartbeat; a rescue keeps it; the next claim ends the job DEAD
/// ('CANCELLED'). Returns false if the job is already terminal.
pub async fn request_cancel<C: GenericClient>(client: &C, job_id: &str) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "UPDATE jobs SET cancel_requested = true, updated_at = now()
              WHERE job_id = $1 AND status IN ('PENDING', 'CLAIMED')",
            &[&job_id],
        )
        .await?;
    Ok(n == 1)
}
