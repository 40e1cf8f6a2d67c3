//! Scenarios 4-6: the relay dies at a fail point (a fresh relay takes
//! over), or by SIGKILL while several lanes hold batches in flight.

use super::*;

pub(super) async fn relay_fail_point(p: &Params, point: &str) -> Counters {
    let db = TestDb::new(&point.replace("::", "_")).await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let (qa, qb) = (create_queue(&sqs, "fa", false, None).await, create_queue(&sqs, "fb", false, None).await);
    let cfg = RelayConfig::new(&db, "cdc", &[("a", &qa), ("b", &qb)], "");
    create_slot(&db, &cfg).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut marked_at_death = 0u64;
    let mut unconfirmed_marked = 0u64;
    let w = db.client().await;
    for rep in 0..p.repetitions {
        // Three transactions over two lanes, committed before the relay starts.
        for t in 0..3 {
            insert_rows(&w, &format!("r{rep}t{t}a"), "a", 10, None).await;
            insert_rows(&w, &format!("r{rep}t{t}b"), "b", 10, None).await;
        }
        let lsn = db.current_lsn().await;
        let before = db.confirmed_flush_lsn().await;
        let skip = rand::rng().random_range(0..3);
        let actions = if skip == 0 { "return".to_string() } else { format!("{skip}*off->return") };
        let mut r = cfg.spawn_with(&[("FAILPOINTS", &format!("{point}={actions}"))]);
        match r.wait_exit(Duration::from_secs(60)).await {
            Some(s) if died_like_kill_9(&s) => c.killed += 1,
            other => eprintln!("measure: {point}: relay did not die at the fail point: {other:?}"),
        }
        drop(r);
        let filter = format!("event_id LIKE 'r{rep}t%'");
        let marked = count_where(
            &db,
            &format!("SELECT count(*) FROM outbox_audit a WHERE {filter} AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = a.event_id AND o.status = 'NEW')"),
        )
        .await as u64;
        marked_at_death += marked;
        let confirmed = db.confirmed_flush_lsn().await;
        if marked > 0 && confirmed < lsn && confirmed >= before {
            unconfirmed_marked += 1;
        }
        let r = cfg.spawn();
        settled(&db, &filter, lsn, Duration::from_secs(60)).await;
        let expected = bodies(&db, &filter).await;
        c.committed += expected.len() as u64;
        let got = collect(&sqs, &[qa.clone(), qb.clone()], &expected, Duration::from_secs(60)).await;
        r.terminate(Duration::from_secs(15)).await;
        tally(&mut c, &expected, &got);
    }
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    c.extra.insert("rows_marked_when_killed".into(), marked_at_death as f64);
    c.extra.insert("kills_with_marked_rows_unconfirmed".into(), unconfirmed_marked as f64);
    c
}

// ---------------------------------------------------------------------------
// Scenario 6: SIGKILL while several lanes hold batches in flight.

/// Lanes holding unsettled events, and messages published so far, from
/// /metrics.
async fn in_flight(addr: &str) -> Option<(usize, f64)> {
    let text = scrape(addr).await?;
    let lanes = series(&text, "outbox_relay_in_flight_events").iter().filter(|(_, v)| *v > 0.0).count();
    let published = series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum();
    Some((lanes, published))
}

pub(super) async fn relay_killed_mid_batch(p: &Params) -> Counters {
    let db = TestDb::new("midbatch").await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let mut queues = Vec::new();
    for l in ["a", "b", "c", "d"] {
        queues.push((l, create_queue(&sqs, &format!("m{l}"), false, None).await));
    }
    let dests: Vec<(&str, &str)> = queues.iter().map(|(l, q)| (*l, q.as_str())).collect();
    let urls: Vec<String> = queues.iter().map(|(_, q)| q.clone()).collect();
    let addr = free_addr();
    let cfg = RelayConfig::new(&db, "cdc", &dests, &format!("metrics_addr = \"{addr}\""));
    create_slot(&db, &cfg).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let mut lanes_at_kill = Vec::new();
    let w = db.client().await;
    // A repetition whose kill did not land mid-batch (the relay had drained,
    // or had not started, when the condition was checked) is run again, up
    // to twice, with rows of its own: each try's rows are checked for loss.
    let (mut tries, mut rep, mut this_rep) = (0, 0, 0);
    while rep < p.repetitions {
        tries += 1;
        this_rep += 1;
        let tag = format!("r{tries}");
        for (l, _) in &queues {
            insert_rows(&w, &format!("{tag}{l}"), l, 400, None).await;
        }
        let lsn = db.current_lsn().await;
        let filter = format!("event_id LIKE '{tag}_:%'");
        // Each batch held 100 ms before its call: with 40 batches a lane and
        // 8 in flight, all four lanes hold batches for half a second, so the
        // kill below lands mid-batch on a loaded machine too (without the
        // hold, ministack drained the 1,600 rows between two scrapes).
        let r = cfg.spawn_with(&[("FAILPOINTS", "lane::before_send=return(100)")]);
        // Kill once some batches were accepted and at least two lanes still
        // hold unsettled events.
        let end = Instant::now() + Duration::from_secs(30);
        let (mut lanes, mut seen) = (0, None);
        while Instant::now() < end {
            if let Some((held, published)) = in_flight(&addr).await {
                (lanes, seen) = (held, Some(published));
                if lanes >= 2 && published > 0.0 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        r.kill();
        let in_place = lanes >= 2;
        if in_place {
            c.killed += 1;
        } else {
            eprintln!(
                "mid-batch kill missed (try {tries}): lanes in flight {lanes}, published at the last scrape {seen:?}"
            );
        }
        lanes_at_kill.push(lanes as f64);
        if in_place || this_rep == 3 {
            (rep, this_rep) = (rep + 1, 0);
        }
        let r = cfg.spawn();
        settled(&db, &filter, lsn, Duration::from_secs(60)).await;
        let expected = bodies(&db, &filter).await;
        c.committed += expected.len() as u64;
        let got = collect(&sqs, &urls, &expected, Duration::from_secs(60)).await;
        r.terminate(Duration::from_secs(15)).await;
        tally(&mut c, &expected, &got);
    }
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    c.extra.insert("tries".into(), tries as f64);
    c.extra.insert(
        "mean_lanes_in_flight_at_kill".into(),
        round1(lanes_at_kill.iter().sum::<f64>() / lanes_at_kill.len().max(1) as f64),
    );
    c
}
