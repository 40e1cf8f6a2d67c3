//! Operations: standby takeover, a leader losing its lock, readiness under a
//! stuck slot, and the shipped alert rules and dashboard.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use outbox_relay::publish::memory::MemoryPublisher;
use testkit::*;

const Q: &str = "http://memory.invalid/orders";

fn gauge(metrics: &str, prefix: &str) -> Option<f64> {
    metrics.lines().find_map(|l| l.strip_prefix(prefix)).and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_the_leader_and_a_standby_takes_over_within_the_timeout() {
    let (times, total, received) = testkit::takeover::run(1).await;
    eprintln!("takeover after kill -9: {times:?}; {received} of {total} rows received");
    assert!(times[0] < Duration::from_secs(10), "takeover took {:?}", times[0]);
    assert_eq!(received, total, "every row arrives");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lock_connection_stops_and_leads_again() {
    let db = TestDb::new("lockloss").await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.takeover_timeout = Duration::from_secs(1);
    let relay = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("leading", Duration::from_secs(30), || async {
        gauge(&relay.metrics.render(), "outbox_relay_is_leader ") == Some(1.0)
    })
    .await;
    // A second relay with the same config waits.
    let standby = start(cfg, Arc::new(p.clone()));
    let c = db.client().await;
    wait_for("the standby tried the leader lock", Duration::from_secs(30), || async {
        let tried: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE '%pg_try_advisory_lock%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        tried >= 2
    })
    .await;
    assert_eq!(gauge(&standby.metrics.render(), "outbox_relay_is_leader "), Some(0.0));
    // The leader's lock connection dies.
    let admin = db.client().await;
    let killed: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND a.datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1);
    wait_for("old leader stepped down", Duration::from_secs(10), || async {
        let m = relay.metrics.render();
        gauge(&m, "outbox_relay_is_leader ") == Some(0.0)
            || gauge(&m, "outbox_relay_leader_changes_total ") >= Some(2.0)
    })
    .await;
    wait_for("someone leads again", Duration::from_secs(20), || async {
        gauge(&relay.metrics.render(), "outbox_relay_is_leader ") == Some(1.0)
            || gauge(&standby.metrics.render(), "outbox_relay_is_leader ") == Some(1.0)
    })
    .await;
    let c = db.client().await;
    insert_rows(&c, "after", "orders", 100, None).await;
    wait_for("rows published by the new leader", Duration::from_secs(30), || async {
        db.count("status = 'NEW'").await == 0
    })
    .await;
    let bodies: std::collections::HashSet<String> = p.sent(Q).into_iter().map(|s| s.body).collect();
    assert_eq!(bodies.len(), 100);
    relay.stop().await;
    standby.stop().await;
}

/// Kubernetes' probes: a standby that can take over is ready (a rolling
/// update of a leader and a standby must finish), `/leader` answers 200 only
/// on the leader, and `/healthz` asks nothing of PostgreSQL: with the
/// database unreachable the relay is alive and not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_is_ready_and_only_the_leader_says_it_leads() {
    let db = TestDb::new("probes").await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    let addr = || {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        format!("127.0.0.1:{port}")
    };
    let get = |a: &str, path: &'static str| {
        let a = a.to_string();
        async move { tokio::task::spawn_blocking(move || http_get(&a, path)).await.unwrap() }
    };
    let (first, second) = (addr(), addr());
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.metrics_addr = Some(first.parse().unwrap());
    let leader = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("the leader is ready", Duration::from_secs(30), || async { get(&first, "/readyz").await.0 == 200 }).await;
    cfg.metrics_addr = Some(second.parse().unwrap());
    let standby = start(cfg.clone(), Arc::new(p.clone()));
    wait_for("the standby is ready", Duration::from_secs(30), || async { get(&second, "/readyz").await.0 == 200 })
        .await;
    let (_, body) = get(&second, "/readyz").await;
    assert!(body.contains("standby"), "{body}");
    assert_eq!(get(&first, "/leader").await.0, 200);
    assert_eq!(get(&second, "/leader").await.0, 503);
    assert_eq!(gauge(&standby.metrics.render(), "outbox_relay_is_leader "), Some(0.0));
    // The leader goes (a rolling update replaced its pod): the standby leads.
    leader.stop().await;
    wait_for("the standby leads", Duration::from_secs(30), || async { get(&second, "/leader").await.0 == 200 }).await;
    let c = db.client().await;
    insert_rows(&c, "after", "orders", 10, None).await;
    wait_for("rows sent by the new leader", Duration::from_secs(30), || async { p.sent(Q).len() >= 10 }).await;
    standby.stop().await;

    // PostgreSQL unreachable under a running relay: alive (liveness must
    // not restart it), not ready, and ready again when it is back.
    let upstream = db.url.split('@').nth(1).and_then(|r| r.split('/').next()).unwrap().to_string();
    let proxy = testkit::proxy::Proxy::start(&upstream).await;
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.database_url = db.url.replacen(&upstream, proxy.url.trim_start_matches("http://"), 1);
    cfg.metrics_addr = Some(first.parse().unwrap());
    let relay = start(cfg, Arc::new(p.clone()));
    wait_for("ready through the proxy", Duration::from_secs(30), || async { get(&first, "/readyz").await.0 == 200 })
        .await;
    proxy.down();
    wait_for("not ready without PostgreSQL", Duration::from_secs(30), || async {
        get(&first, "/readyz").await.0 == 503
    })
    .await;
    assert_eq!(get(&first, "/healthz").await.0, 200, "alive without PostgreSQL");
    proxy.up();
    wait_for("ready again", Duration::from_secs(60), || async { get(&first, "/readyz").await.0 == 200 }).await;
    relay.stop().await;
}

fn http_get(addr: &str, path: &str) -> (u16, String) {
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_slot_does_not_advance_under_lag() {
    let db = TestDb::new("ready").await;
    let p = MemoryPublisher::new();
    p.add_queue(Q, false, 262_144);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut cfg = config(&db, &[("orders", Q)]);
    cfg.metrics_addr = Some(addr.parse().unwrap());
    cfg.readiness_stall = Duration::from_secs(3);
    cfg.lane_stall_timeout = Duration::from_secs(3600);
    cfg.max_retained_wal = 1 << 40;
    let relay = start(cfg, Arc::new(p.clone()));
    let probe = addr.clone();
    wait_for("ready", Duration::from_secs(30), || {
        let a = probe.clone();
        async move { tokio::task::spawn_blocking(move || http_get(&a, "/readyz").0).await.unwrap() == 200 }
    })
    .await;
    assert_eq!(http_get(&addr, "/healthz").0, 200);
    // A send that never completes: the watermark stops while WAL moves on.
    p.close_gate();
    let c = db.client().await;
    insert_rows(&c, "stuck", "orders", 5, None).await;
    let probe = addr.clone();
    wait_for("not ready", Duration::from_secs(30), || {
        let a = probe.clone();
        async move { tokio::task::spawn_blocking(move || http_get(&a, "/readyz").0).await.unwrap() == 503 }
    })
    .await;
    assert_eq!(http_get(&addr, "/healthz").0, 200, "alive, only not ready");
    p.open_gate();
    let probe = addr.clone();
    wait_for("ready again", Duration::from_secs(30), || {
        let a = probe.clone();
        async move { tokio::task::spawn_blocking(move || http_get(&a, "/readyz").0).await.unwrap() == 200 }
    })
    .await;
    let (_, body) = http_get(&addr, "/metrics");
    for name in [
        "outbox_relay_slot_wal_status{status=\"reserved\"} 1",
        "outbox_relay_is_leader 1",
        "outbox_relay_heartbeat_rtt_seconds",
        "process_resident_memory_bytes",
    ] {
        assert!(body.contains(name), "/metrics lacks {name}");
    }
    relay.stop().await;
}

/// Metric names in an expression (histogram series reduced to their family).
fn names_in(expr: &str, out: &mut Vec<String>) {
    let mut rest = expr;
    while let Some(i) = rest.find("outbox_relay_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        let mut name = tail[..end].to_string();
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(base) = name.strip_suffix(suffix) {
                if base.ends_with("_seconds") || base.ends_with("_entries") || base.ends_with("_bytes") {
                    name = base.to_string();
                }
            }
        }
        out.push(name);
        rest = &tail[end..];
    }
}

#[test]
fn alert_rules_and_dashboard_name_only_exported_metrics() {
    let exported = outbox_relay::metrics::Metrics::new().names();
    let root = env!("CARGO_MANIFEST_DIR");
    let alerts: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(format!("{root}/deploy/prometheus-alerts.yml")).unwrap())
            .unwrap();
    let mut named = Vec::new();
    let mut rules = 0;
    for g in alerts["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            assert!(r["alert"].as_str().is_some() && r["annotations"]["summary"].as_str().is_some(), "{r:?}");
            names_in(r["expr"].as_str().unwrap(), &mut named);
            rules += 1;
        }
    }
    assert!(rules >= 8);
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{root}/deploy/grafana-dashboard.json")).unwrap())
            .unwrap();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            names_in(t["expr"].as_str().unwrap(), &mut named);
        }
    }
    for n in &named {
        assert!(exported.contains(n), "{n} is named in deploy/ but not exported");
    }
    for must in [
        "outbox_relay_slot_lag_bytes",
        "outbox_relay_slot_active",
        "outbox_relay_slot_wal_status",
        "outbox_relay_events_dead_total",
        "outbox_relay_oldest_unpublished_seconds",
        "outbox_relay_is_leader",
    ] {
        assert!(named.iter().any(|n| n == must), "no alert or panel uses {must}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sharded_relays_over_disjoint_destinations_deliver_every_row_to_its_queue() {
    let db = TestDb::new("shard").await;
    let (qa, qb, qc) = ("http://memory.invalid/a", "http://memory.invalid/b", "http://memory.invalid/c");
    let p = MemoryPublisher::new();
    for q in [qa, qb, qc] {
        p.add_queue(q, false, 262_144);
    }
    let c = db.client().await;
    insert_rows(&c, "early_a", "a", 30, None).await;
    insert_rows(&c, "early_c", "c", 30, None).await;
    // Each shard: its destinations, its publication (created by `slot create`
    // with a row filter), its slot.
    let mut ab = config(&db, &[("a", qa), ("b", qb)]);
    ab.publication = "outbox_ab".into();
    ab.slot = format!("{}_ab", db.slot);
    let mut only_c = config(&db, &[("c", qc)]);
    only_c.publication = "outbox_c".into();
    only_c.slot = format!("{}_c", db.slot);
    let created = outbox_relay::ops::slot_create(&ab).await.unwrap();
    assert_eq!(created.handed_to_table, 30, "only this shard's earlier rows");
    outbox_relay::ops::slot_create(&only_c).await.unwrap();
    let filter: String = c
        .query_one("SELECT rowfilter FROM pg_publication_tables WHERE pubname = 'outbox_ab'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(filter.contains("'a'") && filter.contains("'b'"), "{filter}");
    // Overlapping shards are refused, before anything is created.
    let mut overlap = config(&db, &[("b", qb)]);
    overlap.publication = "outbox_b".into();
    overlap.slot = format!("{}_b", db.slot);
    let e = outbox_relay::ops::slot_create(&overlap).await.unwrap_err().to_string();
    assert!(e.contains("outbox_ab") && e.contains("disjoint"), "{e}");
    // A relay whose destinations differ from its publication's filter is refused.
    let mut wrong = config(&db, &[("a", qa)]);
    wrong.publication = "outbox_ab".into();
    let e = start_up_error(wrong, Arc::new(p.clone())).await;
    assert!(e.contains("must be the same"), "{e}");

    let r1 = start(ab.clone(), Arc::new(p.clone()));
    let r2 = start(only_c, Arc::new(p.clone()));
    for k in 0..5 {
        for d in ["a", "b", "c"] {
            insert_rows(&c, &format!("{d}{k}"), d, 40, None).await;
        }
    }
    wait_for("every row published", Duration::from_secs(60), || async { db.count("status = 'NEW'").await == 0 }).await;
    assert_eq!(db.count("status = 'DEAD'").await, 0, "no shard marks another's rows DEAD");
    let bodies = |q: &str| p.sent(q).into_iter().map(|s| s.body).collect::<Vec<_>>();
    for (q, d, n) in [(qa, "a", 230), (qb, "b", 200), (qc, "c", 230)] {
        let got = bodies(q);
        assert_eq!(got.len(), n, "queue {q}");
        assert!(
            got.iter().all(|b| b.starts_with(d) || b.starts_with(&format!("early_{d}"))),
            "{q} got another shard's row"
        );
    }
    r1.stop().await;
    r2.stop().await;
    // A shard's relay polling (the fallback while its slot is repaired) is
    // still a shard: the other shard's rows wait for their own relay, past
    // the first sweep for unknown destinations (5 s after start-up).
    insert_rows(&c, "late_c", "c", 20, None).await;
    let mut polling = ab;
    polling.mode = outbox_relay::config::Mode::Polling;
    let r3 = start(polling, Arc::new(p.clone()));
    insert_rows(&c, "late_a", "a", 20, None).await;
    wait_for("the polling shard sends its own rows", Duration::from_secs(30), || async { bodies(qa).len() == 250 })
        .await;
    let until = std::time::Instant::now() + Duration::from_secs(7);
    while std::time::Instant::now() < until {
        assert_eq!(db.count("status = 'DEAD'").await, 0, "a polling shard marked another shard's rows DEAD");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(db.count("status = 'NEW' AND destination = 'c'").await, 20, "the other shard's rows wait for it");
    r3.stop().await;
}
