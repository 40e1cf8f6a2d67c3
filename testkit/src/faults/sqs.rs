//! Scenario 8: one lane's queue gone for a while; the other lanes carry on.

use super::*;

pub(super) async fn sqs_down_one_lane(p: &Params) -> Counters {
    let db = TestDb::new("sqsdown").await;
    db.audit_inserts().await;
    let sqs = sqs().await;
    let parallel = p.outage_parallel.clamp(1, p.repetitions.max(1));
    let healthy = create_queue(&sqs, "healthy", false, None).await;
    let mut sick = Vec::new();
    for i in 0..parallel {
        sick.push((format!("s{i}"), create_queue(&sqs, &format!("sick{i}"), false, None).await));
    }
    let mut dests: Vec<(&str, &str)> = vec![("h", healthy.as_str())];
    dests.extend(sick.iter().map(|(l, q)| (l.as_str(), q.as_str())));
    let cfg = RelayConfig::new(
        &db,
        "cdc",
        &dests,
        "lane_stall_timeout = \"10s\"\nretry_base = \"500ms\"\nretry_max = \"5s\"",
    );
    let relay = cfg.spawn();
    wait_for("the relay streams", Duration::from_secs(60), || async { slot_active(&db).await }).await;
    let lanes = Lanes::start(&db, &sqs, healthy, sick).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut c = Counters { repetitions: p.repetitions as u64, ..Default::default() };
    let windows = lanes.outages(&db, &sqs, p, parallel, &mut c).await;
    // Let the spools drain, then stop writing and collect the rest.
    let (expected_all, received) = lanes.finish(&db).await;
    relay.terminate(Duration::from_secs(15)).await;
    let got: Vec<String> = received.values().flatten().cloned().collect();
    report_missing(&db, &expected_all, &got, &windows).await;
    c.committed = expected_all.len() as u64;
    tally(&mut c, &expected_all, &got);
    let healthy_expected = bodies(&db, "destination = 'h'").await;
    let healthy_got: HashSet<String> = received.get("h").cloned().unwrap_or_default().into_iter().collect();
    c.extra.insert(
        "healthy_lane_missing".into(),
        healthy_expected.iter().filter(|b| !healthy_got.contains(*b)).count() as f64,
    );
    c.dead_rows = db.count("status = 'DEAD'").await as u64;
    // Every mark counts an attempt: a row deferred to the table and sent later has two or more.
    c.extra.insert("rows_deferred_to_table".into(), db.count("attempts > 1").await as f64);
    healthy_latency(&db, &windows, &mut c).await;
    c.extra.insert("outage_seconds".into(), p.sqs_outage.as_secs_f64());
    c.extra.insert("outages_side_by_side".into(), parallel as f64);
    c
}

/// The lanes of sqs_down_one_lane while rows flow: a receiver per queue, all
/// the time, into one list per lane; a writer committing a transaction every
/// 100 ms with 2 rows per lane, whose sick lanes' rows can be held back while
/// their queues are drained.
struct Lanes {
    /// (lane, queue URL) of the lanes whose queues go away.
    sick: Vec<(String, String)>,
    received: Arc<Mutex<HashMap<String, Vec<String>>>>,
    stop_receivers: Arc<AtomicBool>,
    receivers: Vec<tokio::task::JoinHandle<()>>,
    stop_writer: Arc<AtomicBool>,
    hold_sick: Arc<AtomicBool>,
    writer: tokio::task::JoinHandle<()>,
}

impl Lanes {
    async fn start(db: &TestDb, sqs: &AwsPublisher, healthy: String, sick: Vec<(String, String)>) -> Lanes {
        let received: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
        let stop_receivers = Arc::new(AtomicBool::new(false));
        let mut receivers = Vec::new();
        for (lane, url) in std::iter::once(("h".to_string(), healthy)).chain(sick.iter().cloned()) {
            let (sqs, received, stop) = (sqs.clone(), Arc::clone(&received), Arc::clone(&stop_receivers));
            receivers.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let got = receive_batch(&sqs, &url, 1).await;
                    received.lock().unwrap().entry(lane.clone()).or_default().extend(got);
                }
            }));
        }
        let stop_writer = Arc::new(AtomicBool::new(false));
        let hold_sick = Arc::new(AtomicBool::new(false));
        let lanes: Vec<String> = sick.iter().map(|(l, _)| l.clone()).collect();
        let writer = lane_writer(db.client().await, lanes, Arc::clone(&stop_writer), Arc::clone(&hold_sick));
        Lanes { sick, received, stop_receivers, receivers, stop_writer, hold_sick, writer }
    }

    /// `p.repetitions` outages, `parallel` side by side: the sick queues
    /// deleted for `p.sqs_outage`, then created again. The outages' windows
    /// (epoch seconds of the database clock).
    async fn outages(
        &self,
        db: &TestDb,
        sqs: &AwsPublisher,
        p: &Params,
        parallel: usize,
        c: &mut Counters,
    ) -> Vec<(f64, f64)> {
        let mut windows = Vec::new();
        let mut done = 0;
        while done < p.repetitions {
            let k = parallel.min(p.repetitions - done);
            self.drain_sick(db).await;
            for (_, url) in self.sick.iter().take(k) {
                sqs.sqs().delete_queue().queue_url(url).send().await.unwrap();
            }
            let from = db_epoch(db).await;
            self.hold_sick.store(false, Ordering::Relaxed);
            tokio::time::sleep(p.sqs_outage).await;
            for (_, url) in self.sick.iter().take(k) {
                let name = url.rsplit('/').next().unwrap();
                let again = sqs.sqs().create_queue().queue_name(name).send().await.unwrap().queue_url.unwrap();
                assert_eq!(&again, url, "ministack gives a recreated queue its old URL");
            }
            windows.push((from, db_epoch(db).await));
            c.killed += k as u64;
            done += k;
        }
        windows
    }

    /// Everything already sent to the doomed queues must be received first:
    /// deleting a queue deletes its messages, which is not the relay's loss.
    /// Holds the sick lanes' rows back until the outage starts.
    async fn drain_sick(&self, db: &TestDb) {
        let sick_list = self.sick.iter().map(|(l, _)| format!("'{l}'")).collect::<Vec<_>>().join(",");
        self.hold_sick.store(true, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        wait_for("sick lanes drained before the outage", Duration::from_secs(120), || async {
            if db.count(&format!("status = 'NEW' AND destination IN ({sick_list})")).await != 0 {
                return false;
            }
            let published: HashSet<String> = bodies(db, &format!("destination IN ({sick_list})")).await;
            let r = self.received.lock().unwrap();
            let got: HashSet<&String> = r.iter().filter(|(l, _)| *l != "h").flat_map(|(_, v)| v.iter()).collect();
            published.iter().all(|b| got.contains(b))
        })
        .await;
    }

    /// Stop writing, wait until every row is settled and received (60 s at
    /// most) and for stragglers, stop receiving. Every row's body, and what
    /// each lane received.
    async fn finish(self, db: &TestDb) -> (HashSet<String>, HashMap<String, Vec<String>>) {
        self.stop_writer.store(true, Ordering::Relaxed);
        self.writer.await.unwrap();
        let lsn = db.current_lsn().await;
        settled(db, "true", lsn, Duration::from_secs(120)).await;
        let expected_all = bodies(db, "true").await;
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let all: HashSet<String> = self.received.lock().unwrap().values().flatten().cloned().collect();
            if expected_all.iter().all(|b| all.contains(b)) || Instant::now() > end {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await; // stragglers (duplicates)
        self.stop_receivers.store(true, Ordering::Relaxed);
        for r in self.receivers {
            let _ = r.await;
        }
        let received = std::mem::take(&mut *self.received.lock().unwrap());
        (expected_all, received)
    }
}

/// The writer of [`Lanes`]: 2 rows per lane every 100 ms; the sick lanes'
/// rows only while `hold` is false.
fn lane_writer(
    c: Client,
    lanes: Vec<String>,
    stop: Arc<AtomicBool>,
    hold: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut k = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let mut ls = vec!["h".to_string()];
            if !hold.load(Ordering::Relaxed) {
                ls.extend(lanes.iter().cloned());
            }
            c.execute(
                "INSERT INTO outbox (event_id, destination, body) SELECT 'w' || $1 || l || i, l, 'w' || $1 || l || i FROM unnest($2::text[]) l, generate_series(1, 2) i",
                &[&k.to_string(), &ls],
            )
            .await
            .unwrap();
            k += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// The database's clock, in epoch seconds.
async fn db_epoch(db: &TestDb) -> f64 {
    let c = db.client().await;
    c.query_one("SELECT extract(epoch FROM clock_timestamp())::float8", &[]).await.unwrap().get::<_, f64>(0)
}

/// Name up to five missing rows with their state, for the log.
async fn report_missing(db: &TestDb, expected: &HashSet<String>, got: &[String], windows: &[(f64, f64)]) {
    let got_set: HashSet<&String> = got.iter().collect();
    let missing: Vec<&String> = expected.iter().filter(|b| !got_set.contains(b)).take(5).collect();
    for b in missing {
        let r = db
            .client()
            .await
            .query_opt("SELECT destination, status, attempts, created_at::text, published_at::text FROM outbox WHERE body = $1", &[b])
            .await
            .unwrap();
        let Some(r) = r else {
            eprintln!("measure: sqs_down_one_lane: {b} missing: published and deleted; outages {windows:?}");
            continue;
        };
        eprintln!(
            "measure: sqs_down_one_lane: {b} missing: {:?} {:?} attempts {:?} created {:?} published {:?}; outages {windows:?}",
            r.get::<_, String>(0),
            r.get::<_, String>(1),
            r.get::<_, i32>(2),
            r.get::<_, String>(3),
            r.get::<_, Option<String>>(4)
        );
    }
}

/// The healthy lane's commit-to-mark latency outside and inside the outages.
async fn healthy_latency(db: &TestDb, windows: &[(f64, f64)], c: &mut Counters) {
    let lat = db
        .client()
        .await
        .query(
            "SELECT extract(epoch FROM created_at)::float8, extract(epoch FROM published_at - created_at)::float8 * 1000 FROM outbox WHERE destination = 'h' AND published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let (mut inside, mut outside): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for r in lat {
        let (at, ms): (f64, f64) = (r.get(0), r.get(1));
        if windows.iter().any(|(a, b)| at >= *a && at <= *b) {
            inside.push(ms);
        } else {
            outside.push(ms);
        }
    }
    c.extra.insert("healthy_p50_ms_outside_outages".into(), round1(percentile(&mut outside.clone(), 0.5)));
    c.extra.insert("healthy_p99_ms_outside_outages".into(), round1(percentile(&mut outside, 0.99)));
    c.extra.insert("healthy_p50_ms_during_outages".into(), round1(percentile(&mut inside.clone(), 0.5)));
    c.extra.insert("healthy_p99_ms_during_outages".into(), round1(percentile(&mut inside, 0.99)));
}
