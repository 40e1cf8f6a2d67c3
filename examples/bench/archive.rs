//! The stream's drain with the archive on beside the same drain without
//! it, in one run, at each body size, alternating (off, on, off, on): the
//! relay binary drains a backlog from its slot (`published_rows =
//! "delete"`); with `[archive]` every event is also written to ministack's
//! S3 before it is settled. Beside the rates: the relay's CPU, and the WAL
//! the primary wrote per row after the backlog (settlement: the archive
//! adds none, it writes to S3).

use super::*;

#[derive(serde::Serialize)]
pub(super) struct ArchiveDrain {
    events: usize,
    body_bytes: usize,
    rows_per_txn: usize,
    archive: bool,
    rows_per_s: f64,
    cpu_s_per_100k: f64,
    /// WAL the primary wrote from the end of the backlog until every row
    /// was published and the slot confirmed it, per row.
    settle_wal_bytes_per_row: f64,
    /// Compressed bytes written to S3 per event (0 without the archive).
    archive_bytes_per_event: f64,
}

/// Both drains at each size of `sizes`, twice each, alternating.
pub(super) async fn archive_drains(a: &Args, sqs: &AwsPublisher, n: usize, sizes: &[usize]) -> Vec<ArchiveDrain> {
    let mut out = Vec::new();
    for &size in sizes {
        for archive in [false, true, false, true] {
            let row = archive_drain(a, sqs, n, size, archive).await;
            eprintln!("bench: archive {archive}, {size} B bodies: {:.0}/s", row.rows_per_s);
            out.push(row);
        }
    }
    out
}

async fn archive_drain(a: &Args, sqs: &AwsPublisher, n: usize, size: usize, archive: bool) -> ArchiveDrain {
    let db = TestDb::new("bench_archive").await;
    create_slot(&db, &db.slot).await;
    let queues = create_queues(sqs, 1).await;
    let end_lsn = insert_backlog(&db, "a", n, 1, a.txn_size, size).await;
    let addr = free_addr();
    let mut extra = format!("metrics_addr = \"{addr}\"");
    if archive {
        let bucket = create_bucket("bench").await;
        extra += &format!("\n[archive]\nbucket = \"{bucket}\"\n[s3]\nendpoint_url = \"{}\"", stack().sqs_url);
    }
    let cfg = RelayConfig::new(&db, "cdc", &dests(&queues), &extra);
    let t = Instant::now();
    let relay = cfg.spawn();
    let end = t + Duration::from_secs(1800);
    let mut last = (0.0, 0);
    let mut secs = None;
    let archived = loop {
        if let Some(text) = scrape(&addr).await {
            let published = series(&text, "outbox_relay_events_published_total").iter().map(|(_, v)| v).sum::<f64>();
            if secs.is_none() && published >= n as f64 {
                secs = Some(t.elapsed().as_secs_f64());
            }
            let confirmed = series(&text, "outbox_relay_confirmed_lsn").first().map(|(_, v)| *v).unwrap_or(0.0);
            let archived = series(&text, "outbox_relay_archived_bytes_total").first().map(|(_, v)| *v);
            if secs.is_some() && confirmed >= end_lsn as f64 {
                break archived.unwrap_or(0.0);
            }
        }
        if let Some(s) = cpu_and_peak_rss(relay.pid()) {
            last = s;
        }
        assert!(Instant::now() < end, "archive drain: not drained in 30 min");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let secs = secs.unwrap();
    let wal = db.current_lsn().await - end_lsn;
    let (cpu, _) = cpu_and_peak_rss(relay.pid()).unwrap_or(last);
    relay.terminate(Duration::from_secs(15)).await;
    delete_queues(sqs, &queues).await;
    ArchiveDrain {
        events: n,
        body_bytes: size,
        rows_per_txn: a.txn_size,
        archive,
        rows_per_s: (n as f64 / secs).round(),
        cpu_s_per_100k: (cpu * 100_000.0 / n as f64 * 100.0).round() / 100.0,
        settle_wal_bytes_per_row: (wal as f64 / n as f64).round(),
        archive_bytes_per_event: (archived / n as f64).round(),
    }
}

pub(super) fn print_archives(rows: &[ArchiveDrain]) {
    println!("\n| stream drain (delete mode, SQS and S3 stand-in) | archive | rows/s | on / off (target ≥ 0.9) | CPU s/100k | primary's WAL B/row after the backlog | archive B/event (gzip) |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let off: Vec<f64> =
            rows.iter().filter(|o| !o.archive && o.body_bytes == r.body_bytes).map(|o| o.rows_per_s).collect();
        let ratio = if r.archive { r.rows_per_s / (off.iter().sum::<f64>() / off.len() as f64) } else { 1.0 };
        println!(
            "| {} events of {} B, {} per txn | {} | {:.0} | {:.2} | {:.2} | {:.0} | {:.0} |",
            r.events,
            r.body_bytes,
            r.rows_per_txn,
            if r.archive { "on" } else { "off" },
            r.rows_per_s,
            ratio,
            r.cpu_s_per_100k,
            r.settle_wal_bytes_per_row,
            r.archive_bytes_per_event,
        );
    }
}
