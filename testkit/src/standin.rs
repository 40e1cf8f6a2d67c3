//! A latency-injecting SQS stand-in, for measurement and tests: a small
//! server speaking SQS's JSON protocol (`X-Amz-Target: AmazonSQS.<Action>`)
//! for the calls the relay and a raw client make (`SendMessageBatch`,
//! `SendMessage`, `GetQueueAttributes`, `GetQueueUrl`, `CreateQueue`,
//! `DeleteQueue`). Every queue exists and takes everything; each answer is
//! held for the configured round trip. It can throttle a share of the calls
//! (`RequestThrottled`), fail a share of the entries (`InternalError`), and
//! throttle whatever goes over a rate of calls per second, so a sender's
//! adaptivity shows. It is not a product feature: it keeps no messages
//! (unless told to record their bodies) and serves no receives.
//!
//! In-process: [`Standin::start`]; settings can change while it runs
//! ([`Standin::set`]). Out of process, the benchmark runs it in a child of
//! its own, driven through `POST /_standin/settings` and read through
//! `GET /_standin/stats`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// What the stand-in does to the calls it is sent; changeable while it runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Settings {
    /// Every answer is held this long (the network's round trip and SQS's own time).
    #[serde(with = "humantime_serde_ms")]
    pub rtt: Duration,
    /// Share of the calls refused as a whole with `RequestThrottled` (0..=1).
    pub throttle_rate: f64,
    /// Share of the entries failed with `InternalError` (0..=1).
    pub failure_rate: f64,
    /// Calls over this many per second (per queue) are refused with
    /// `RequestThrottled`; 0: no limit.
    pub calls_per_s: u32,
    /// Keep every message body (tests; the benchmark keeps counts only).
    pub record: bool,
}

/// A duration as whole milliseconds in JSON.
mod humantime_serde_ms {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let ms: u64 = serde::Deserialize::deserialize(d)?;
        Ok(Duration::from_millis(ms))
    }
}

/// What the stand-in has seen.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Stats {
    /// Calls answered, any action.
    pub calls: u64,
    /// `SendMessageBatch` and `SendMessage` calls accepted (some entries may have failed).
    pub send_calls: u64,
    /// Messages accepted.
    pub messages: u64,
    /// Calls refused with `RequestThrottled`.
    pub throttled: u64,
    /// Entries failed with `InternalError`.
    pub failed_entries: u64,
}

/// One queue's rate window and, recording, its bodies.
#[derive(Default)]
struct Queue {
    window_start: Option<Instant>,
    window_calls: u32,
    /// Recording: each body taken, and when.
    bodies: Vec<(String, SystemTime)>,
}

struct Inner {
    endpoint: String,
    settings: Mutex<Settings>,
    queues: Mutex<HashMap<String, Queue>>,
    calls: AtomicU64,
    send_calls: AtomicU64,
    messages: AtomicU64,
    throttled: AtomicU64,
    failed_entries: AtomicU64,
    message_ids: AtomicU64,
}

/// A running stand-in; stops when dropped.
#[derive(Clone)]
pub struct Standin {
    inner: Arc<Inner>,
    _stop: Arc<tokio::sync::oneshot::Sender<()>>,
}

impl Standin {
    /// Serve on `addr` (port 0: any free one) with `settings`.
    pub async fn start(addr: SocketAddr, settings: Settings) -> std::io::Result<Standin> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let inner = Arc::new(Inner {
            endpoint,
            settings: Mutex::new(settings),
            queues: Mutex::default(),
            calls: AtomicU64::new(0),
            send_calls: AtomicU64::new(0),
            messages: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            failed_entries: AtomicU64::new(0),
            message_ids: AtomicU64::new(0),
        });
        let app = axum::Router::new()
            .route("/_standin/stats", get(stats))
            .route("/_standin/settings", post(set_settings))
            .fallback(post(handle))
            .with_state(Arc::clone(&inner));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Standin { inner, _stop: Arc::new(stop) })
    }

    /// The endpoint URL, for a client's `endpoint_url`.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The URL of queue `name`.
    pub fn queue_url(&self, name: &str) -> String {
        format!("{}/000000000000/{name}", self.inner.endpoint)
    }

    pub fn settings(&self) -> Settings {
        self.inner.settings.lock().unwrap().clone()
    }

    /// Change the settings from now on.
    pub fn set(&self, change: impl FnOnce(&mut Settings)) {
        change(&mut self.inner.settings.lock().unwrap());
    }

    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// The bodies queue `name` accepted, in the order accepted (recording only).
    pub fn bodies(&self, name: &str) -> Vec<String> {
        self.arrivals(name).into_iter().map(|(b, _)| b).collect()
    }

    /// [`Standin::bodies`], each with when it arrived (before the answer's
    /// round trip).
    pub fn arrivals(&self, name: &str) -> Vec<(String, SystemTime)> {
        self.inner.queues.lock().unwrap().get(name).map(|q| q.bodies.clone()).unwrap_or_default()
    }
}

impl Inner {
    fn stats(&self) -> Stats {
        Stats {
            calls: self.calls.load(Ordering::Relaxed),
            send_calls: self.send_calls.load(Ordering::Relaxed),
            messages: self.messages.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
            failed_entries: self.failed_entries.load(Ordering::Relaxed),
        }
    }

    /// Whether a call to `queue` now is throttled: by chance, or over the
    /// queue's calls per second.
    fn throttles(&self, queue: &str, s: &Settings) -> bool {
        if s.throttle_rate > 0.0 && rand::random::<f64>() < s.throttle_rate {
            return true;
        }
        if s.calls_per_s == 0 {
            return false;
        }
        let mut queues = self.queues.lock().unwrap();
        let q = queues.entry(queue.to_string()).or_default();
        let now = Instant::now();
        if q.window_start.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            q.window_start = Some(now);
            q.window_calls = 0;
        }
        q.window_calls += 1;
        q.window_calls > s.calls_per_s
    }

    fn message_id(&self) -> String {
        format!("standin-{}", self.message_ids.fetch_add(1, Ordering::Relaxed))
    }

    /// Accept `bodies` (their ids) to `queue`: each fails by chance, the rest
    /// are counted (and recorded). The SendMessageBatch answer.
    fn accept(&self, queue: &str, entries: Vec<(String, String)>, s: &Settings) -> serde_json::Value {
        let (mut ok, mut failed, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        for (id, body) in entries {
            if s.failure_rate > 0.0 && rand::random::<f64>() < s.failure_rate {
                failed.push(json!({"Id": id, "SenderFault": false, "Code": "InternalError", "Message": "injected"}));
                continue;
            }
            ok.push(json!({"Id": id, "MessageId": self.message_id(), "MD5OfMessageBody": "00000000000000000000000000000000"}));
            if s.record {
                kept.push((body, SystemTime::now()));
            }
        }
        self.messages.fetch_add(ok.len() as u64, Ordering::Relaxed);
        self.failed_entries.fetch_add(failed.len() as u64, Ordering::Relaxed);
        if s.record {
            self.queues.lock().unwrap().entry(queue.to_string()).or_default().bodies.extend(kept);
        }
        json!({"Successful": ok, "Failed": failed})
    }
}

async fn stats(State(inner): State<Arc<Inner>>) -> Response {
    answer(serde_json::to_value(inner.stats()).unwrap_or_default())
}

async fn set_settings(State(inner): State<Arc<Inner>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Settings>(&body) {
        Ok(s) => {
            *inner.settings.lock().unwrap() = s;
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Request {
    #[serde(default)]
    queue_url: String,
    #[serde(default)]
    queue_name: String,
    #[serde(default)]
    entries: Vec<RequestEntry>,
    #[serde(default)]
    message_body: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RequestEntry {
    id: String,
    message_body: String,
}

/// An SQS JSON-protocol error.
fn error(code: &str, message: &str) -> Response {
    let body = json!({"__type": format!("com.amazonaws.sqs#{code}"), "message": message});
    let headers =
        [("content-type", "application/x-amz-json-1.0".to_string()), ("x-amzn-query-error", format!("{code};Sender"))];
    (StatusCode::BAD_REQUEST, headers, body.to_string()).into_response()
}

fn answer(body: serde_json::Value) -> Response {
    ([("content-type", "application/x-amz-json-1.0")], body.to_string()).into_response()
}

/// The queue name at the end of a queue URL.
fn queue_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap_or(url)
}

async fn handle(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    let settings = inner.settings.lock().unwrap().clone();
    let started = Instant::now();
    let response = respond(&inner, &headers, &body, &settings);
    inner.calls.fetch_add(1, Ordering::Relaxed);
    tokio::time::sleep(settings.rtt.saturating_sub(started.elapsed())).await;
    response
}

fn respond(inner: &Inner, headers: &HeaderMap, body: &[u8], s: &Settings) -> Response {
    let action = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("AmazonSQS."))
        .unwrap_or("");
    let req: Request = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return error("InvalidParameterValue", &format!("unreadable request: {e}")),
    };
    let queue = queue_name(&req.queue_url).to_string();
    match action {
        "SendMessageBatch" | "SendMessage" if inner.throttles(&queue, s) => {
            inner.throttled.fetch_add(1, Ordering::Relaxed);
            error("RequestThrottled", "injected")
        }
        "SendMessageBatch" => {
            inner.send_calls.fetch_add(1, Ordering::Relaxed);
            let entries = req.entries.into_iter().map(|e| (e.id, e.message_body)).collect();
            answer(inner.accept(&queue, entries, s))
        }
        "SendMessage" => {
            inner.send_calls.fetch_add(1, Ordering::Relaxed);
            let out = inner.accept(&queue, vec![("0".into(), req.message_body)], s);
            match out["Successful"].get(0) {
                Some(ok) => answer(json!({"MessageId": ok["MessageId"], "MD5OfMessageBody": ok["MD5OfMessageBody"]})),
                None => error("InternalError", "injected"),
            }
        }
        "GetQueueAttributes" => answer(json!({"Attributes": {
            "MaximumMessageSize": "1048576",
            "FifoQueue": if queue.ends_with(".fifo") { "true" } else { "false" },
        }})),
        "GetQueueUrl" | "CreateQueue" => {
            answer(json!({"QueueUrl": format!("{}/000000000000/{}", inner.endpoint, req.queue_name)}))
        }
        "DeleteQueue" | "PurgeQueue" => answer(json!({})),
        other => error("UnsupportedOperation", &format!("the stand-in does not serve {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_relay::event::OutboxEvent;
    use outbox_relay::policy::retry::{classify_call, Remedy};
    use outbox_relay::publish::aws::AwsPublisher;
    use outbox_relay::publish::entry::Entry;
    use outbox_relay::publish::kind::{Kind, Target};
    use outbox_relay::publish::{EntryResult, Publisher};

    #[test]
    fn settings_travel_as_json() {
        let s = Settings { rtt: Duration::from_millis(15), throttle_rate: 0.05, ..Settings::default() };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"rtt\":15"), "{text}");
        assert_eq!(serde_json::from_str::<Settings>(&text).unwrap(), s);
        assert_eq!(serde_json::from_str::<Settings>("{}").unwrap(), Settings::default());
    }

    fn entries(n: i64) -> Vec<Entry> {
        let queue = Target::queue("q", false, 1 << 20);
        (0..n).map(|i| queue.prepare(Arc::new(OutboxEvent::for_test(i, "q", &format!("body {i}")))).unwrap()).collect()
    }

    /// The relay's own SQS client against the stand-in: queue attributes, a
    /// batch taken and recorded, the round trip held, a throttled call seen
    /// with the code the retry policy knows, failed entries one by one.
    #[tokio::test]
    async fn the_relays_client_is_answered_as_sqs_would() {
        let rtt = Duration::from_millis(30);
        let standin = Standin::start(([127, 0, 0, 1], 0).into(), Settings { rtt, record: true, ..Settings::default() })
            .await
            .unwrap();
        let sqs = AwsPublisher::new("us-east-1", Some(standin.endpoint())).await;
        let url = standin.queue_url("orders.fifo");
        let info = sqs.describe(Kind::Queue, &url).await.unwrap();
        assert_eq!((info.fifo, info.max_message_size()), (true, 1 << 20));
        let url = Target::queue(standin.queue_url("orders"), false, 1 << 20);
        let started = Instant::now();
        let sent = sqs.send_batch(&url, &entries(3)).await.unwrap();
        assert!(started.elapsed() >= rtt, "held for the round trip: {:?}", started.elapsed());
        assert!(sent.iter().all(|r| matches!(r, EntryResult::Sent)), "{sent:?}");
        assert_eq!(standin.bodies("orders"), ["body 0", "body 1", "body 2"]);

        standin.set(|s| s.throttle_rate = 1.0);
        let e = sqs.send_batch(&url, &entries(2)).await.unwrap_err();
        assert_eq!(e.code, "RequestThrottled");
        assert_eq!(classify_call(url.failure(&e.code, e.sender_fault, &e.message), 2), Remedy::Retry);

        standin.set(|s| (s.throttle_rate, s.failure_rate) = (0.0, 1.0));
        let failed = sqs.send_batch(&url, &entries(2)).await.unwrap();
        assert!(failed
            .iter()
            .all(|r| matches!(r, EntryResult::Failed { code, sender_fault: false, .. } if code == "InternalError")));

        standin.set(|s| (s.failure_rate, s.calls_per_s) = (0.0, 2));
        let mut throttled = 0;
        for _ in 0..4 {
            throttled += usize::from(sqs.send_batch(&url, &entries(1)).await.is_err());
        }
        assert_eq!(throttled, 2, "two calls a second pass");
        let stats = standin.stats();
        assert_eq!((stats.messages, stats.throttled, stats.failed_entries), (5, 3, 2));
    }
}
