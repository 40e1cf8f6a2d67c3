//! Children: the processes that die. `measure child <mode> <args...>`.

use super::*;

/// Run a child mode; returns only if the fail point did not fire.
pub async fn child(args: &[String]) -> anyhow::Result<()> {
    outbox_relay::faults::configure_from_env().map_err(anyhow::Error::msg)?;
    let arg = |i: usize| args.get(i).cloned().ok_or_else(|| anyhow::anyhow!("child: argument {i} missing"));
    let (mode, url) = (arg(0)?, arg(1)?);
    match mode.as_str() {
        "dual-write" => child_dual_write(&url, &arg(2)?, &arg(3)?, &arg(4)?).await,
        "between-inserts" => child_between_inserts(&url, &arg(2)?).await,
        "after-commit" => child_after_commit(&url, &arg(2)?).await,
        "worker" => child_worker(&url, &arg(2)?, &arg(3)?).await,
        other => anyhow::bail!("child: unknown mode {other:?}"),
    }
}

/// What the outbox replaces: commit the job, then send the message.
async fn child_dual_write(url: &str, endpoint: &str, queue: &str, tag: &str) -> anyhow::Result<()> {
    let c = outbox_relay::db::connect(url).await?;
    let sqs = AwsPublisher::new("us-east-1", Some(endpoint)).await;
    let job_id = format!("dw-{tag}");
    c.execute(
        "INSERT INTO jobs (job_id, kind, payload, destination) VALUES ($1, 'effect', jsonb_build_object('tag', $2::text), 'jobs')",
        &[&job_id, &tag],
    )
    .await?;
    crash_point("dual_write::before_send");
    sqs.sqs().send_message().queue_url(queue).message_body(&job_id).send().await?;
    Ok(())
}

/// An application writing the job and its event as two statements of one
/// transaction, dying between them.
async fn child_between_inserts(url: &str, tag: &str) -> anyhow::Result<()> {
    let mut c = outbox_relay::db::connect(url).await?;
    let tx = c.transaction().await?;
    let payload = serde_json::json!({ "tag": tag });
    let id = outbox_consumer::job_id(&tx, "effect", &payload).await?;
    tx.execute(
        "INSERT INTO jobs (job_id, kind, payload, destination) VALUES ($1, 'effect', $2, 'jobs')",
        &[&id, &payload],
    )
    .await?;
    crash_point("enqueue::between_inserts");
    tx.execute(
        "INSERT INTO outbox (event_id, destination, body) VALUES ('effect:' || $1 || ':0', 'jobs', outbox_job_message($1, 'effect', 0))",
        &[&id],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// The library's enqueue, committed; the process dies right after.
async fn child_after_commit(url: &str, tag: &str) -> anyhow::Result<()> {
    let mut c = outbox_relay::db::connect(url).await?;
    let tx = c.transaction().await?;
    let payload = serde_json::json!({ "tag": tag });
    enqueue(
        &tx,
        &NewJob {
            kind: "effect",
            payload: &payload,
            destination: "jobs",
            group_key: None,
            job_id: None,
            traceparent: None,
        },
    )
    .await?;
    tx.commit().await?;
    crash_point("enqueue::after_commit");
    Ok(())
}

/// A worker whose handler dies after writing its effect.
async fn child_worker(url: &str, endpoint: &str, queue: &str) -> anyhow::Result<()> {
    // The connection the other modes use, made first here too.
    let _c = outbox_relay::db::connect(url).await?;
    let sqs = AwsPublisher::new("us-east-1", Some(endpoint)).await;
    let cons = Arc::new(consumer(url, "doomed", Duration::from_secs(1)).handle("effect", Effect));
    let q = SqsQueue::new(sqs.sqs().clone(), queue.to_string());
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        for m in q.receive(1, Duration::from_secs(1)).await? {
            cons.process(&q, &m).await?;
        }
    }
    anyhow::bail!("worker: no message to die on within 20 s");
}

/// Spawn `measure child ...` with `FAILPOINTS`; true if it died like kill -9.
pub(super) async fn spawn_child(p: &Params, args: &[&str], failpoints: &str) -> bool {
    let mut cmd = tokio::process::Command::new(&p.child_bin);
    cmd.arg("child")
        .args(args)
        .env("FAILPOINTS", failpoints)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let out =
        tokio::time::timeout(Duration::from_secs(60), cmd.output()).await.expect("child finishes within 60 s").unwrap();
    let died = died_like_kill_9(&out.status);
    if !died {
        eprintln!("measure: child {args:?} did not die: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    died
}
