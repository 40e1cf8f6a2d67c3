//! Every destination the relay sends to: the configured ones, looked up at
//! start-up, and, with a queue-URL template, any other name a row routes to,
//! looked up the first time it is seen (`GetQueueAttributes`) and kept.
//!
//! A name whose queue does not exist is DEAD (`queue_not_found`) and the
//! verdict is kept for a while, so its rows cost no call each; a lookup that
//! fails otherwise (the network, the credentials) leaves the row to wait in
//! the table. Nothing else waits for either.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::metrics::Metrics;
use crate::pipeline::lane::LaneState;
use crate::policy::dead::DeadReason;
use crate::policy::retry::{classify_lookup, Lookup};
use crate::publish::kind::Target;
use crate::publish::template::AddressTemplate;
use crate::publish::{reread_limit, Publisher, READ_TIMEOUT};

/// A destination ready to send to: its target and its lane's state.
#[derive(Debug)]
pub struct Destination {
    pub name: Arc<str>,
    pub target: Target,
    /// Streaming or spooling; outlives sessions.
    pub state: Arc<LaneState>,
}

/// What a name comes to.
#[derive(Debug, Clone)]
pub enum Resolved {
    Ready(Arc<Destination>),
    /// Its rows are DEAD with this reason.
    Dead(DeadReason),
    /// The lookup failed for a reason that may pass: its rows wait.
    Unavailable(String),
}

/// How long a "no such queue" verdict is kept before the queue is looked
/// up again (it may have been created since).
const MISSING_FOR: Duration = Duration::from_secs(60);

/// How often every queue's `MaximumMessageSize` is read again
/// ([`Destinations::reread_limits`]): a limit raised under the relay holds
/// within this. (A lowered one holds at once: SQS refusing a message as too
/// long reads it again.)
pub const REREAD_EVERY: Duration = Duration::from_secs(300);

/// Turns a queue as SQS describes it into the relay's view of it (fair
/// queues, its S3 target): the same for configured and looked-up ones.
pub type Prepare = Box<dyn Fn(&str, Target) -> Target + Send + Sync>;

/// The destinations, and how to find more.
pub struct Destinations {
    ready: RwLock<BTreeMap<String, Arc<Destination>>>,
    missing: Mutex<HashMap<String, (DeadReason, Instant)>>,
    /// `None`: only the configured destinations exist.
    template: Option<AddressTemplate>,
    prepare: Prepare,
    publisher: Arc<dyn Publisher>,
    metrics: Arc<Metrics>,
}

impl Destinations {
    /// The configured destinations (already looked up, already prepared).
    pub fn new(
        configured: BTreeMap<String, Target>,
        template: Option<AddressTemplate>,
        prepare: Prepare,
        publisher: Arc<dyn Publisher>,
        metrics: Arc<Metrics>,
    ) -> Destinations {
        let ready = configured
            .into_iter()
            .map(|(name, target)| {
                known(&metrics, &name, &target);
                let state = LaneState::new(&name, target.fifo, Arc::clone(&metrics));
                let d = Destination { name: Arc::from(name.as_str()), target, state };
                (name, Arc::new(d))
            })
            .collect();
        Destinations { ready: RwLock::new(ready), missing: Mutex::default(), template, prepare, publisher, metrics }
    }

    /// A destination ready to send to, if it is.
    pub fn get(&self, name: &str) -> Option<Arc<Destination>> {
        self.ready.read().unwrap().get(name).cloned()
    }

    /// Every destination ready now, in name order.
    pub fn all(&self) -> Vec<Arc<Destination>> {
        self.ready.read().unwrap().values().cloned().collect()
    }

    /// Every ready destination's lane state.
    pub fn states(&self) -> Vec<Arc<LaneState>> {
        self.ready.read().unwrap().values().map(|d| Arc::clone(&d.state)).collect()
    }

    pub fn len(&self) -> usize {
        self.ready.read().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether names beyond the configured ones may exist.
    pub fn templated(&self) -> bool {
        self.template.is_some()
    }

    /// `name` as a destination: ready, DEAD (no template and not configured,
    /// a name no destination of the template's kind can have, no such
    /// destination), or unavailable for now.
    pub async fn resolve(&self, name: &str) -> Resolved {
        if let Some(d) = self.get(name) {
            return Resolved::Ready(d);
        }
        let Some(template) = &self.template else {
            return Resolved::Dead(DeadReason::unknown_destination(name));
        };
        if let Some(reason) = self.still_missing(name) {
            return Resolved::Dead(reason);
        }
        let url = match template.address(name) {
            Ok(url) => url,
            Err(reason) => return Resolved::Dead(reason),
        };
        let rules = template.kind().rules();
        let answer = tokio::time::timeout(READ_TIMEOUT, self.publisher.describe(rules.kind(), &url)).await;
        match answer {
            Ok(Ok(info)) => Resolved::Ready(self.add(name, (self.prepare)(name, info))),
            Ok(Err(e)) => match classify_lookup(rules.codes().failure(&e.code, e.sender_fault, &e.message)) {
                Lookup::Missing => {
                    let reason = DeadReason::new(
                        rules.missing(),
                        format!("destination {name:?}: no {} at {url} ({}: {})", rules.kind(), e.code, e.message),
                    );
                    self.missing.lock().unwrap().insert(name.to_string(), (reason.clone(), Instant::now()));
                    Resolved::Dead(reason)
                }
                Lookup::Retry => Resolved::Unavailable(format!("looking up {url}: {}: {}", e.code, e.message)),
            },
            Err(_) => Resolved::Unavailable(format!("looking up {url}: no answer within {READ_TIMEOUT:?}")),
        }
    }

    /// Read every ready destination's `MaximumMessageSize` again, one call
    /// at a time (a read that fails leaves the limit as it was); a changed
    /// one holds for the router and every lane from then on. Returns how
    /// many changed.
    pub async fn reread_limits(&self) -> usize {
        let mut changed = 0;
        for d in self.all() {
            let was = d.target.max_message_size();
            if reread_limit(self.publisher.as_ref(), &d.name, &d.target).await.is_ok_and(|now| now != was) {
                changed += 1;
            }
        }
        changed
    }

    /// A recent "no such queue" verdict on `name`.
    fn still_missing(&self, name: &str) -> Option<DeadReason> {
        let mut missing = self.missing.lock().unwrap();
        match missing.get(name) {
            Some((reason, at)) if at.elapsed() < MISSING_FOR => Some(reason.clone()),
            Some(_) => {
                missing.remove(name);
                None
            }
            None => None,
        }
    }

    /// Keep a looked-up destination (the first one added wins a race).
    fn add(&self, name: &str, target: Target) -> Arc<Destination> {
        let mut ready = self.ready.write().unwrap();
        if let Some(d) = ready.get(name) {
            return Arc::clone(d);
        }
        tracing::info!(destination = %name, kind = %target.kind, address = %target.address, fifo = target.fifo, "destination looked up on first use");
        known(&self.metrics, name, &target);
        let state = LaneState::new(name, target.fifo, Arc::clone(&self.metrics));
        let d = Arc::new(Destination { name: Arc::from(name), target, state });
        ready.insert(name.to_string(), Arc::clone(&d));
        d
    }
}

/// A destination known from now on, in the metrics.
fn known(metrics: &Metrics, name: &str, target: &Target) {
    let fifo = if target.fifo { "true" } else { "false" };
    metrics.destination_info.with_label_values(&[name, target.kind.as_str(), fifo]).set(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::memory::MemoryPublisher;

    fn destinations(p: &MemoryPublisher) -> Destinations {
        let t = AddressTemplate::new("http://memory.invalid/{region}/{destination}", "r1").unwrap();
        Destinations::new(BTreeMap::new(), Some(t), Box::new(|_, q| q), Arc::new(p.clone()), Metrics::new())
    }

    #[tokio::test]
    async fn a_name_is_looked_up_once_and_a_missing_queue_is_dead() {
        let p = MemoryPublisher::new();
        p.add_queue("http://memory.invalid/r1/orders", false, 1024);
        let d = destinations(&p);
        let Resolved::Ready(orders) = d.resolve("orders").await else { panic!("orders is there") };
        assert_eq!(orders.target.max_message_size(), 1024);
        assert!(Arc::ptr_eq(&orders, &d.get("orders").unwrap()));
        let Resolved::Dead(r) = d.resolve("billing").await else { panic!("billing has no queue") };
        assert_eq!(r.code, crate::policy::dead::DeadCode::QueueNotFound);
        // Created since: still DEAD until the verdict expires.
        p.add_queue("http://memory.invalid/r1/billing", false, 1024);
        assert!(matches!(d.resolve("billing").await, Resolved::Dead(_)));
        assert_eq!(d.len(), 1);
    }

    #[tokio::test]
    async fn a_limit_changed_under_the_relay_is_read_again() {
        let p = MemoryPublisher::new();
        p.add_queue("http://memory.invalid/r1/orders", false, 1024);
        let d = destinations(&p);
        let Resolved::Ready(orders) = d.resolve("orders").await else { panic!("orders is there") };
        let lanes_copy = orders.target.clone();
        assert_eq!(d.reread_limits().await, 0);
        p.add_queue("http://memory.invalid/r1/orders", false, 4096);
        assert_eq!(d.reread_limits().await, 1);
        assert_eq!((orders.target.max_message_size(), lanes_copy.max_message_size()), (4096, 4096));
    }
}
