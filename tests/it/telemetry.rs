//! The relay's own spans over OTLP/HTTP: the release binary, pointed at a
//! collector by the standard environment, exports its route, send and
//! settle spans, the send span linked to the producer's trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use testkit::process::RelayConfig;
use testkit::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// A collector that takes every OTLP/HTTP request and keeps its body.
async fn collector() -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&bodies);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let kept = Arc::clone(&kept);
            tokio::spawn(async move {
                let mut r = BufReader::new(stream);
                loop {
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    r.read_exact(&mut body).await.unwrap();
                    kept.lock().unwrap().extend_from_slice(&body);
                    r.get_mut().write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await.unwrap();
                }
            });
        }
    });
    (url, bodies)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_spans_reach_an_otlp_collector_linked_to_the_producer() {
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let (url, bodies) = collector().await;
    let db = TestDb::new("otlp").await;
    let sqs = sqs().await;
    let q = create_queue(&sqs, "traced", false, None).await;
    let config = RelayConfig::new(&db, "cdc", &[("orders", &q)], "");
    let relay = config.spawn_with(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &url), ("OTEL_BSP_SCHEDULE_DELAY", "100")]);
    wait_for("slot created", Duration::from_secs(30), || async { db.confirmed_flush_lsn().await > 0 }).await;
    let c = db.client().await;
    let attributes = format!(r#"{{"traceparent": "00-{trace}-00f067aa0ba902b7-01"}}"#);
    c.execute(
        "INSERT INTO outbox (event_id, destination, body, attributes) VALUES ('traced', 'orders', 'x', $1::text::jsonb)",
        &[&attributes],
    )
    .await
    .unwrap();
    wait_for("the row published", Duration::from_secs(30), || async { db.count("true").await == 0 }).await;
    let trace_id = hex::decode(trace).unwrap();
    wait_for("the spans exported", Duration::from_secs(30), || async {
        let b = bodies.lock().unwrap();
        ["outbox_relay.route", "outbox_relay.send", "outbox_relay.settle", "outbox-relay"]
            .iter()
            .all(|name| contains(&b, name.as_bytes()))
            && contains(&b, &trace_id)
    })
    .await;
    relay.terminate(Duration::from_secs(15)).await;
}
