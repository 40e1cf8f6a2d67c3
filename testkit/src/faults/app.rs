//! Scenarios 1-3: the application process dies.

use super::*;

pub(super) async fn app_child_scenario(p: &Params, mode: &str, point: &str) -> Counters {
    let db = effects_db(&mode.replace('-', "_")).await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "jobs", false, None).await;
    let relay_cfg = RelayConfig::new(&db, "cdc", &[("jobs", &q)], "");
    if mode == "after-commit" {
        create_slot(&db, &relay_cfg).await;
    }
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    for rep in 0..p.repetitions {
        let tag = format!("{rep}");
        let args: Vec<&str> = match mode {
            "dual-write" => vec![mode, &db.url, &stack().sqs_url, &q, &tag],
            _ => vec![mode, &db.url, &tag],
        };
        if spawn_child(p, &args, &format!("{point}=return")).await {
            c.killed += 1;
        }
    }
    let jobs = count_where(&db, "SELECT count(*) FROM jobs").await;
    c.committed = jobs as u64;
    let jobs_without_event =
        count_where(&db, "SELECT count(*) FROM jobs j WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = j.kind || ':' || j.job_id || ':0')").await;
    let events_without_job = count_where(
        &db,
        "SELECT count(*) FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE o.event_id = j.kind || ':' || j.job_id || ':0')",
    )
    .await;
    c.missing_publish_intents = jobs_without_event as u64;
    match mode {
        "dual-write" => dual_write_deliveries(&db, &sqs, &q, &mut c).await,
        "between-inserts" => c.partial_commits = (jobs_without_event + events_without_job) as u64,
        _ => {
            c.partial_commits = (jobs_without_event + events_without_job) as u64;
            relay_afterwards(&db, &sqs, &q, &relay_cfg, &mut c).await;
        }
    }
    c
}

/// No outbox: a job whose message is not in the queue is lost.
async fn dual_write_deliveries(db: &TestDb, sqs: &AwsPublisher, q: &str, c: &mut Counters) {
    let expected: HashSet<String> =
        db.client().await.query("SELECT job_id FROM jobs", &[]).await.unwrap().into_iter().map(|r| r.get(0)).collect();
    let got = collect(sqs, &[q.to_string()], &expected, Duration::from_secs(3)).await;
    tally(c, &expected, &got);
}

/// The relay runs after the application died: it publishes every row.
async fn relay_afterwards(db: &TestDb, sqs: &AwsPublisher, q: &str, relay_cfg: &RelayConfig, c: &mut Counters) {
    let lsn = db.current_lsn().await;
    let relay = relay_cfg.spawn();
    settled(db, "true", lsn, Duration::from_secs(120)).await;
    let expected = bodies(db, "true").await;
    let got = collect(sqs, &[q.to_string()], &expected, Duration::from_secs(60)).await;
    relay.terminate(Duration::from_secs(15)).await;
    tally(c, &expected, &got);
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
}
