//! Delayed delivery (`deliver_at`): SQS's `DelaySeconds` within 15 minutes
//! on a standard queue, the row held in the table otherwise (later, or on a
//! FIFO queue), the slot never waiting for a held row. "Two hours later" is
//! reached by moving the row's `deliver_at`, not by waiting.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::QueueAttributeName;
use outbox_relay::config::Mode;
use outbox_relay::publish::memory::MemoryPublisher;
use testkit::*;

fn bodies(msgs: &[(String, Option<String>)]) -> Vec<&str> {
    msgs.iter().map(|(b, _)| b.as_str()).collect()
}

fn gauge(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

async fn delayed_in_queue(sqs: &outbox_relay::publish::aws::AwsPublisher, url: &str) -> i64 {
    let a = sqs
        .sqs()
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .unwrap();
    a.attributes()
        .and_then(|m| m.get(&QueueAttributeName::ApproximateNumberOfMessagesDelayed))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

/// 0 s, 5 s and 899 s go at once with their `DelaySeconds`; 2 hours (a
/// persistent row and a transient one) are held in the table, shown by
/// `status` and the metrics, kept through a restart, and sent once due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_delays_go_by_delay_seconds_and_long_ones_wait_in_the_table() {
    let db = TestDb::new("delay").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "later", false, None).await;
    let cfg = config(&db, &[("later", &q)]);
    let relay = start(cfg.clone(), Arc::new(sqs.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let written = Instant::now();
    c.batch_execute(
        "INSERT INTO outbox (event_id, destination, body, deliver_at) VALUES
             ('d0', 'later', 'd0', now()), ('d5', 'later', 'd5', now() + interval '5 s'),
             ('d899', 'later', 'd899', now() + interval '899 s'), ('d2h', 'later', 'd2h', now() + interval '2 h');
         BEGIN;
         INSERT INTO outbox (event_id, destination, body, deliver_at) VALUES ('t2h', 'later', 't2h', now() + interval '2 h');
         DELETE FROM outbox WHERE event_id = 't2h';
         COMMIT;",
    )
    .await
    .unwrap();
    let after = db.current_lsn().await;
    wait_for("the slot confirmed past every row, the held ones too", Duration::from_secs(30), || async {
        db.confirmed_flush_lsn().await >= after
    })
    .await;
    assert_eq!(bodies(&receive_all(&sqs, &q, 1, Duration::from_secs(10)).await), ["d0"]);
    let d5 = receive_all(&sqs, &q, 1, Duration::from_secs(20)).await;
    assert_eq!(bodies(&d5), ["d5"]);
    assert!(written.elapsed() >= Duration::from_millis(4_500), "d5 came after {:?}", written.elapsed());
    // 899 s: in the queue, delayed (not waited out).
    assert_eq!(delayed_in_queue(&sqs, &q).await, 1, "d899 waits in SQS");
    // 2 hours: both rows in the table (the transient one written back), held.
    let held = "status = 'NEW' AND next_attempt_at IS NOT NULL AND deliver_at > now() + interval '1 h'";
    wait_for("both 2-hour rows held in the table", Duration::from_secs(30), || async { db.count(held).await == 2 })
        .await;
    let s = outbox_relay::ops::status(&c, &cfg).await.unwrap();
    let later = s.destinations.iter().find(|d| d.destination == "later").unwrap();
    assert_eq!((later.held, later.new, later.spooled), (2, 0, 0), "{later:?}");
    assert!(later.next_due_in_seconds.is_some_and(|s| s > 7_000.0), "{later:?}");
    wait_for("the metrics show the held rows", Duration::from_secs(30), || async {
        let m = relay.metrics.render();
        gauge(&m, "outbox_relay_held_events{destination=\"later\"}") == Some(2.0)
            && gauge(&m, "outbox_relay_backlog_events{destination=\"later\"}") == Some(0.0)
            && gauge(&m, "outbox_relay_held_next_due_seconds{destination=\"later\"}").is_some_and(|s| s > 7_000.0)
    })
    .await;
    let m = relay.metrics.render();
    assert_eq!(gauge(&m, "outbox_relay_events_delayed_total{destination=\"later\"}"), Some(2.0), "{m}");
    assert_eq!(gauge(&m, "outbox_relay_events_held_total{destination=\"later\"}"), Some(2.0), "{m}");

    // A restart keeps them held: neither replayed nor sent early.
    relay.stop().await;
    let relay = start(cfg.clone(), Arc::new(sqs.clone()));
    let round = receive_round(&sqs, &q, 2).await.unwrap();
    assert!(round.messages.is_empty(), "nothing is due: {:?}", round.messages);
    // Two hours pass (for these rows).
    c.execute("UPDATE outbox SET deliver_at = now() WHERE event_id IN ('d2h', 't2h')", &[]).await.unwrap();
    let due = receive_all(&sqs, &q, 2, Duration::from_secs(30)).await;
    assert_eq!(bodies(&due).into_iter().collect::<BTreeSet<_>>(), BTreeSet::from(["d2h", "t2h"]));
    wait_for("the table empty", Duration::from_secs(30), || async { db.count("true").await == 0 }).await;
    let round = receive_round(&sqs, &q, 2).await.unwrap();
    assert!(round.messages.is_empty(), "each row once: {:?}", round.messages);
    relay.stop().await;
}

/// A FIFO queue takes no per-message delay: the delayed row is held in the
/// table and sent when due, and its group's other rows do not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_queue_holds_the_delayed_row_and_its_group_goes_on() {
    let db = TestDb::new("delay_fifo").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "laterf", true, None).await;
    let relay = start(config(&db, &[("laterf", &q)]), Arc::new(sqs.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let written = Instant::now();
    c.batch_execute(
        "INSERT INTO outbox (event_id, destination, body, group_key, deliver_at) VALUES
             ('a', 'laterf', 'a', 'g', NULL), ('b', 'laterf', 'b', 'g', now() + interval '3 s'),
             ('c', 'laterf', 'c', 'g', now() - interval '1 s'),
             ('far', 'laterf', 'far', 'g', '294276-12-31 23:59:59+00')",
    )
    .await
    .unwrap();
    let first = receive_all(&sqs, &q, 2, Duration::from_secs(15)).await;
    assert_eq!(bodies(&first), ["a", "c"], "the group goes on in order without the held row");
    assert!(written.elapsed() < Duration::from_secs(3), "a and c did not wait for b: {:?}", written.elapsed());
    let second = receive_all(&sqs, &q, 1, Duration::from_secs(20)).await;
    assert_eq!(bodies(&second), ["b"]);
    assert!(written.elapsed() >= Duration::from_secs(3), "b came after {:?}", written.elapsed());
    let m = relay.metrics.render();
    assert_eq!(gauge(&m, "outbox_relay_events_held_total{destination=\"laterf\"}"), Some(2.0), "{m}");
    wait_for("the table empty but the row of year 294276", Duration::from_secs(30), || async {
        db.count("true").await == 1
    })
    .await;
    let far = "event_id = 'far' AND status = 'NEW' AND next_attempt_at IS NOT NULL AND last_error LIKE 'held until deliver_at: a FIFO%'";
    assert_eq!(db.count(far).await, 1, "the last time PostgreSQL stores is far, not never");
    relay.stop().await;
}

/// Polling mode claims what SQS can delay (with its `DelaySeconds`) and
/// leaves the rest in the table until due; `infinity` ends DEAD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_mode_delays_holds_and_refuses_never() {
    const STD: &str = "http://memory.invalid/std";
    const FIFO: &str = "http://memory.invalid/f.fifo";
    let db = TestDb::new("delay_poll").await;
    let p = MemoryPublisher::new();
    p.add_queue(STD, false, 262_144);
    p.add_queue(FIFO, true, 262_144);
    let mut cfg = config(&db, &[("std", STD), ("f", FIFO)]);
    cfg.mode = Mode::Polling;
    let relay = start(cfg, Arc::new(p.clone()));
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox (event_id, destination, body, group_key, deliver_at) VALUES
             ('p5', 'std', 'p5', NULL, now() + interval '5 s'), ('p2h', 'std', 'p2h', NULL, now() + interval '2 h'),
             ('never', 'std', 'never', NULL, 'infinity'), ('far', 'std', 'far', NULL, '290000-01-01 00:00:00+00'),
             ('fa', 'f', 'fa', 'g', NULL), ('fb', 'f', 'fb', 'g', now() + interval '2 h'), ('fc', 'f', 'fc', 'g', NULL)",
    )
    .await
    .unwrap();
    wait_for("p5 sent and fa, fc sent", Duration::from_secs(30), || async {
        p.sent(STD).len() == 1 && p.sent(FIFO).len() == 2
    })
    .await;
    let std = p.sent(STD);
    assert_eq!(std[0].body, "p5");
    assert!(std[0].delay_seconds.is_some_and(|s| (1..=5).contains(&s)), "{:?}", std[0].delay_seconds);
    let fifo: Vec<String> = p.sent(FIFO).iter().map(|s| s.body.clone()).collect();
    assert_eq!(fifo, ["fa", "fc"], "the held row does not hold its group");
    assert!(p.sent(FIFO).iter().all(|s| s.delay_seconds.is_none()));
    wait_for("infinity DEAD", Duration::from_secs(30), || async {
        db.count("event_id = 'never' AND status = 'DEAD' AND last_error LIKE 'invalid_deliver_at%'").await == 1
    })
    .await;
    c.execute("UPDATE outbox SET deliver_at = now() WHERE event_id IN ('p2h', 'fb')", &[]).await.unwrap();
    wait_for("the two-hour rows sent once due", Duration::from_secs(30), || async {
        p.sent(STD).len() == 2 && p.sent(FIFO).len() == 3
    })
    .await;
    assert_eq!(p.sent(STD)[1].body, "p2h");
    assert_eq!(p.sent(STD)[1].delay_seconds, None);
    assert_eq!(p.sent(FIFO)[2].body, "fb");
    assert_eq!(db.count("event_id = 'far' AND status = 'NEW'").await, 1, "year 290000 is held, not DEAD");
    relay.stop().await;
}

/// Two features crossed: a FIFO lane that spooled streams again once its
/// spool is drained, though a row held for hours waits in the same table
/// (held rows keep no order with the stream, so they do not count as spool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_row_does_not_keep_a_spooled_fifo_lane_from_streaming_again() {
    const F: &str = "http://memory.invalid/held.fifo";
    let db = TestDb::new("delay_spool").await;
    let p = MemoryPublisher::new();
    p.add_queue(F, true, 262_144);
    let mut cfg = config(&db, &[("f", F)]);
    cfg.lane_stall_timeout = Duration::from_secs(1);
    cfg.retry_base = Duration::from_millis(200);
    cfg.retry_max = Duration::from_secs(1);
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let spooled = |v: f64| {
        let metrics = Arc::clone(&relay.metrics);
        move || {
            let m = metrics.render();
            async move { gauge(&m, "outbox_relay_lane_spooled{destination=\"f\"}") == Some(v) }
        }
    };
    let down = outbox_relay::publish::CallError {
        code: "ServiceUnavailable".into(),
        message: "down".into(),
        sender_fault: false,
    };
    p.break_queue(F, down);
    c.execute(
        "INSERT INTO outbox (event_id, destination, body, group_key, deliver_at) VALUES ('held', 'f', 'held', 'g0', now() + interval '2 h')",
        &[],
    )
    .await
    .unwrap();
    insert_rows(&c, "before", "f", 20, Some(2)).await;
    wait_for("the lane spools", Duration::from_secs(30), spooled(1.0)).await;
    p.fix_queue(F);
    wait_for("the spool drained", Duration::from_secs(60), || async { p.sent(F).len() == 20 }).await;
    wait_for("the lane streams again", Duration::from_secs(30), spooled(0.0)).await;
    insert_rows(&c, "after", "f", 10, Some(2)).await;
    wait_for("later rows delivered", Duration::from_secs(30), || async { p.sent(F).len() == 30 }).await;
    assert!(p.sent(F).iter().all(|s| s.body != "held"), "the held row waits for its time");
    assert_eq!(db.count("event_id = 'held' AND status = 'NEW' AND next_attempt_at IS NOT NULL").await, 1);
    relay.stop().await;
}
