//! Sending a batch until every entry is settled: one call at a time (an SQS
//! queue's `SendMessageBatch`), its result reconciled entry by entry
//! ([`reconcile`], pure, by what the destination's kind says its service's
//! answers mean), the entries the service may still take retried alone after a backoff (the stream) or
//! deferred to the table (the table path).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use tracing::Instrument;

use super::ctx::{spooling, Ctx, RetryPolicy, Unsent};
use super::item::{ordering_groups, LaneItem};
use super::state::Flow;
use crate::metrics::Service;
use crate::pipeline::settle::{Due, Outcome};
use crate::policy::concurrency::Signal;
use crate::policy::dead::DeadReason;
use crate::policy::retry::{backoff, classify_call, classify_entry, Failure, Remedy};
use crate::publish::entry::{Entry, TRACEPARENT};
use crate::publish::kind::Target;
use crate::publish::limit::BatchSlot;
use crate::publish::{reread_limit, CallError, EntryResult};

/// What becomes of one entry after a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Published,
    Dead(DeadReason),
    /// The service may take it later; the text is the error, for `last_error`.
    Retry(String),
    /// Refused as longer than the queue takes ([`Remedy::Reread`]).
    TooLong(String),
}

/// A call's result, entry by entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// One verdict per entry, in order.
    Entries(Vec<Verdict>),
    /// Refused as a whole for a reason one entry may have caused: send each alone.
    Split,
}

/// Reconcile a batch's result of `n` entries sent to `target`: successful
/// entries are published (never resent), failed ones retried or DEAD as the
/// retry policy classifies what `target`'s kind says they mean; a failed
/// call retries, splits or kills them all.
pub fn reconcile(target: &Target, result: &Result<Vec<EntryResult>, CallError>, n: usize) -> CallOutcome {
    match result {
        Ok(results) => CallOutcome::Entries(results.iter().map(|r| verdict(target, r)).collect()),
        Err(e) => match classify_call(target.failure(&e.code, e.sender_fault, &e.message), n) {
            Remedy::Retry => CallOutcome::Entries(vec![Verdict::Retry(e.to_string()); n]),
            Remedy::Split => CallOutcome::Split,
            Remedy::Reread => CallOutcome::Entries(vec![Verdict::TooLong(e.to_string()); n]),
            Remedy::Dead => CallOutcome::Entries(vec![Verdict::Dead(target.rejected(e.to_string())); n]),
        },
    }
}

/// One entry's verdict.
fn verdict(target: &Target, r: &EntryResult) -> Verdict {
    let EntryResult::Failed { code, sender_fault, message } = r else { return Verdict::Published };
    let error = format!("{code}: {message}");
    match classify_entry(target.failure(code, *sender_fault, message)) {
        Remedy::Dead => Verdict::Dead(target.rejected(error)),
        Remedy::Reread => Verdict::TooLong(error),
        Remedy::Retry | Remedy::Split => Verdict::Retry(error),
    }
}

/// What a failed entry means, if it may be retried.
fn retryable(target: &Target, r: &EntryResult) -> Option<Failure> {
    let EntryResult::Failed { code, sender_fault, message } = r else { return None };
    let failure = target.failure(code, *sender_fault, message);
    (classify_entry(failure) == Remedy::Retry && !s3_failure(code)).then_some(failure)
}

/// Send `batch` until every entry is published, DEAD or deferred (or, the
/// lane closing, abandoned). Returns the FIFO groups of the entries deferred
/// and abandoned. The entries whose body goes through S3 and is not written
/// yet (with, FIFO, the rest of their groups) are sent beside the others,
/// not with them: nothing orders them, so an entry that needs no object goes
/// out now and does not wait for a slow or failing write. `slot` is the
/// batch's place under the cap of batches formed, given back while it
/// waits to retry.
pub(super) async fn send_until_settled(
    ctx: &Ctx,
    batch: Vec<LaneItem>,
    spool: Option<watch::Receiver<Flow>>,
    mut slot: BatchSlot,
) -> Unsent {
    let (mut now, later) = apart_from_objects(batch);
    let mut unsent = Unsent::default();
    let later = if s3_to_table(ctx) && ctx.metrics.is_failing(&ctx.cfg.name, Service::S3) {
        // S3 fails for this destination: the entries whose objects are not
        // written wait in the table, where the table path writes them once
        // it answers (its own backoff; it alone tries, and its success
        // opens this path again), rather than hold a call, and the lane
        // behind them, for a write's deadline.
        unsent.deferred.extend(ordering_groups(&later));
        for item in later {
            ctx.defer(item, S3_FAILING, Due::Backoff);
        }
        Vec::new()
    } else {
        later
    };
    if now.is_empty() || later.is_empty() {
        now.extend(later);
        unsent.extend(send_retrying(ctx, now, spool, &mut slot).await);
        return unsent;
    }
    let mut beside = BatchSlot::free();
    let (sent, other) =
        tokio::join!(send_retrying(ctx, now, spool.clone(), &mut slot), send_retrying(ctx, later, spool, &mut beside));
    unsent.extend(sent);
    unsent.extend(other);
    unsent
}

/// Why an entry whose object is not written went to the table.
const S3_FAILING: &str = "S3 failing for this destination: its body is written from the table once S3 answers";

/// Whether this lane hands entries whose object cannot be written to the
/// table at once: a stream lane of a standard queue (nothing orders its
/// entries; a FIFO lane keeps the group in memory behind its entry, and
/// spools if it must). The table path hands every failure back anyway.
fn s3_to_table(ctx: &Ctx) -> bool {
    ctx.cfg.retry == RetryPolicy::InMemory && !ctx.cfg.target.fifo
}

/// Whether `err` (an entry's last error) is a failed write to S3.
fn s3_failure(err: &str) -> bool {
    err.starts_with("S3.")
}

/// Split `batch` into the entries that can go now and those that wait for an
/// object to be written: an unwritten object's entry, and the entries of its
/// FIFO group (which keep their order behind it).
fn apart_from_objects(batch: Vec<LaneItem>) -> (Vec<LaneItem>, Vec<LaneItem>) {
    let unwritten = |i: &LaneItem| i.entry.offload.as_ref().is_some_and(|o| !o.is_written());
    let waiting = ordering_groups(batch.iter().filter(|i| unwritten(i)));
    batch
        .into_iter()
        .partition(|i| !unwritten(i) && i.entry.ordering_group().is_none_or(|g| !waiting.iter().any(|w| w == g)))
}

/// [`send_until_settled`] for entries sent together.
async fn send_retrying(
    ctx: &Ctx,
    batch: Vec<LaneItem>,
    mut spool: Option<watch::Receiver<Flow>>,
    slot: &mut BatchSlot,
) -> Unsent {
    let mut todo = batch;
    let mut attempt = 0u32;
    let mut unsent = Unsent::default();
    while !todo.is_empty() {
        if spooling(&spool) {
            unsent.deferred.extend(ordering_groups(&todo));
            for item in todo.drain(..) {
                // Tried and failed already, or not tried yet.
                ctx.defer(item, "spooled", if attempt == 0 { Due::Now } else { Due::Backoff });
            }
            break;
        }
        let verdicts = match send_once(ctx, &todo, attempt).await {
            CallOutcome::Split if todo.len() > 1 => {
                // Find the entry the service objects to: each alone.
                for item in todo.drain(..) {
                    unsent.extend(Box::pin(send_retrying(ctx, vec![item], spool.clone(), &mut *slot)).await);
                }
                break;
            }
            CallOutcome::Split => vec![Verdict::Retry("refused as a whole".into()); todo.len()],
            CallOutcome::Entries(v) => v,
        };
        let (mut retry, too_long) = apply(ctx, todo.drain(..).zip(verdicts));
        retry.extend(judge_anew(ctx, too_long).await);
        if retry.is_empty() {
            break;
        }
        let retry = to_table_or_memory(ctx, retry, &mut unsent);
        if retry.is_empty() {
            break;
        }
        todo = retry.into_iter().map(|(i, _)| i).collect();
        slot.release();
        if !wait_to_retry(ctx, &mut spool, attempt).await {
            // Stopping: these stay unsettled and are read again from the slot.
            tracing::debug!(destination = %ctx.cfg.name, entries = todo.len(), "shutdown: entries to retry abandoned");
            unsent.abandoned.extend(ordering_groups(&todo));
            break;
        }
        slot.retake().await;
        attempt = attempt.saturating_add(1);
    }
    unsent
}

/// Of entries to retry, those the lane hands back to the table are settled
/// deferred (their groups recorded in `unsent`); the rest, returned, are
/// retried from memory. The table path hands every failure back to the
/// table; a standard queue's stream lane hands it failed writes to S3, and
/// retries the rest (a queue's failures are the lane's to wait out or spool
/// on).
fn to_table_or_memory(ctx: &Ctx, retry: Retries, unsent: &mut Unsent) -> Retries {
    let (table, memory): (Retries, Retries) = match ctx.cfg.retry {
        RetryPolicy::ToTable => (retry, Vec::new()),
        RetryPolicy::InMemory if s3_to_table(ctx) => retry.into_iter().partition(|(_, err)| s3_failure(err)),
        RetryPolicy::InMemory => (Vec::new(), retry),
    };
    for (item, err) in table {
        unsent.deferred.extend(item.entry.ordering_group().map(str::to_string));
        ctx.settle(item, Outcome::Deferred(err, Due::Backoff));
    }
    memory
}

/// Entries refused as longer than the destination takes ([`Remedy::Reread`]):
/// its `MaximumMessageSize` is read again, and holds from then on for every
/// copy of the destination's description (the router's, every lane's). An
/// entry over the limit read is prepared anew for it (through S3, or DEAD
/// `too_large`) and retried; one within it was refused for a reason the
/// relay cannot tell: DEAD as its kind's refusal (`sqs_rejected`). The read failing, they are
/// retried (and read again if refused again).
async fn judge_anew(ctx: &Ctx, refused: Vec<(LaneItem, String)>) -> Vec<(LaneItem, String)> {
    if refused.is_empty() {
        return refused;
    }
    let target = &ctx.cfg.target;
    let limit = match reread_limit(ctx.publisher.as_ref(), &ctx.cfg.name, target).await {
        Ok(limit) => limit,
        Err(why) => {
            let again =
                |(i, e): (LaneItem, String)| (i, format!("{e}; reading the {}'s limit again: {why}", target.kind));
            return refused.into_iter().map(again).collect();
        }
    };
    let mut retry = Vec::new();
    for (mut item, err) in refused {
        if item.entry.size <= limit {
            ctx.settle(item, Outcome::Dead(target.rejected(err)));
            continue;
        }
        match target.prepare(Arc::clone(&item.entry.event)) {
            Ok(entry) => {
                item.entry = Entry { delay_seconds: item.entry.delay_seconds, ..entry };
                retry.push((item, err));
            }
            Err(reason) => ctx.settle(item, Outcome::Dead(reason)),
        }
    }
    retry
}

/// Write the objects of the entries whose bodies go through S3 and are not
/// written yet, counted per destination.
async fn offload_objects(ctx: &Ctx, entries: &[Entry]) -> Result<(), CallError> {
    let unwritten: Vec<&Entry> =
        entries.iter().filter(|e| e.offload.as_ref().is_some_and(|o| !o.is_written())).collect();
    if unwritten.is_empty() {
        return Ok(());
    }
    let bodies = unwritten.iter().filter_map(|e| e.offload.as_ref().map(|o| (o, &e.event)));
    let result = crate::publish::offload::write_objects(bodies).await;
    match &result {
        Ok(()) => ctx.metrics.succeeded(&ctx.cfg.name, Service::S3),
        Err(e) => ctx.metrics.failed(&ctx.cfg.name, Service::S3, &e.to_string()),
    }
    let written: Vec<usize> = unwritten
        .iter()
        .filter(|e| e.offload.as_ref().is_some_and(|o| o.is_written()))
        .map(|e| e.event.body.len())
        .collect();
    ctx.metrics.offloaded(&ctx.cfg.name, written.len() as u64, written.iter().sum::<usize>() as u64);
    result
}

/// Bodies through S3 first: no message points at an object not written.
/// When some objects could not be written, the other entries are sent
/// without them (on a FIFO queue, but for the entries of the same groups,
/// which keep their order) and those entries fail with the S3 error, to be
/// retried: one bad write does not hold the rest of the batch back.
async fn send_with_objects(ctx: &Ctx, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
    let Err(s3) = offload_objects(ctx, entries).await else {
        return send_batch(ctx, entries).await;
    };
    let unwritten = |e: &Entry| e.offload.as_ref().is_some_and(|o| !o.is_written());
    let held_groups: Vec<&str> = entries.iter().filter(|e| unwritten(e)).filter_map(Entry::ordering_group).collect();
    let blocked: Vec<bool> =
        entries.iter().map(|e| unwritten(e) || e.ordering_group().is_some_and(|g| held_groups.contains(&g))).collect();
    let go: Vec<Entry> = entries.iter().zip(&blocked).filter(|(_, b)| !**b).map(|(e, _)| e.clone()).collect();
    if go.is_empty() {
        return Err(s3);
    }
    let mut sent = send_batch(ctx, &go).await?.into_iter();
    let failed = || EntryResult::Failed { code: s3.code.clone(), sender_fault: false, message: s3.message.clone() };
    Ok(blocked.iter().map(|b| if *b { failed() } else { sent.next().unwrap_or_else(failed) }).collect())
}

/// One call, its failure or success noted for the destination's health
/// (`status`, `/status`): failures the service may recover from, not
/// entries it refuses for good.
async fn send_batch(ctx: &Ctx, entries: &[Entry]) -> Result<Vec<EntryResult>, CallError> {
    let target = &ctx.cfg.target;
    let result = ctx.publisher.send_batch(target, entries).await;
    let (name, service) = (&*ctx.cfg.name, target.rules().service());
    match &result {
        Ok(results) if results.iter().any(|r| matches!(r, EntryResult::Sent)) => ctx.metrics.succeeded(name, service),
        Ok(results) => {
            let passing = results.iter().find(|r| retryable(target, r).is_some());
            if let Some(EntryResult::Failed { code, message, .. }) = passing {
                ctx.metrics.failed(name, service, &format!("{code}: {message}"));
            }
        }
        Err(e)
            if classify_call(target.failure(&e.code, e.sender_fault, &e.message), entries.len()) == Remedy::Retry =>
        {
            ctx.metrics.failed(name, service, &e.to_string())
        }
        Err(_) => {}
    }
    result
}

/// One call, measured, and its result reconciled. A call in flight finishes
/// even if the lane starts spooling meanwhile (the SQS client's timeouts bound
/// it): what it published stays published.
async fn send_once(ctx: &Ctx, todo: &[LaneItem], attempt: u32) -> CallOutcome {
    let entries: Vec<Entry> = todo.iter().map(|i| i.entry.clone()).collect();
    let name = &*ctx.cfg.name;
    ctx.metrics.batch_entries.with_label_values(&[name]).observe(entries.len() as f64);
    ctx.metrics.batch_bytes.with_label_values(&[name]).observe(entries.iter().map(|e| e.size).sum::<usize>() as f64);
    crate::faults::delay_point("lane::before_send").await;
    let started = Instant::now();
    let span = tracing::info_span!("outbox_relay.send", destination = name, entries = entries.len(), attempt);
    for tp in entries.iter().filter_map(|e| e.attributes.iter().find(|a| a.name == TRACEPARENT)) {
        crate::telemetry::link_producer(&span, &tp.value);
    }
    let ticket = ctx.call_starts();
    let result = send_with_objects(ctx, &entries).instrument(span).await;
    ctx.call_ended(ticket, signal(&ctx.cfg.target, &result, started.elapsed()));
    ctx.metrics.publish_seconds.with_label_values(&[name]).observe(started.elapsed().as_secs_f64());
    match &result {
        Ok(results) => {
            crate::faults::crash_point("lane::after_send");
            for r in results {
                if let EntryResult::Failed { code, .. } = r {
                    ctx.metrics.sqs_entry_failures.with_label_values(&[name, code.as_str()]).inc();
                }
            }
        }
        Err(e) => {
            ctx.metrics.sqs_entry_failures.with_label_values(&[name, e.code.as_str()]).inc();
            if ctx.cfg.retry == RetryPolicy::InMemory && ctx.warn_due() {
                tracing::warn!(destination = %name, error = %e, attempt, call = ctx.cfg.target.rules().call_name(), "the call failed");
            } else {
                tracing::debug!(destination = %name, error = %e, attempt, call = ctx.cfg.target.rules().call_name(), "the call failed");
            }
        }
    }
    reconcile(&ctx.cfg.target, &result, todo.len())
}

/// What a call's result says about the far end, for the lane's limit.
fn signal(target: &Target, result: &Result<Vec<EntryResult>, CallError>, rtt: std::time::Duration) -> Signal {
    match result {
        // Nothing was sent: every entry waited on an object not written.
        Err(e) if s3_failure(&e.code) => Signal::Silent,
        Err(e) => Signal::of(Err::<[Failure; 0], _>(target.failure(&e.code, e.sender_fault, &e.message)), rtt),
        // Entries failed on S3 say nothing of the destination.
        Ok(results) => Signal::of(Ok(results.iter().filter_map(|r| retryable(target, r))), rtt),
    }
}

/// Settle the published and DEAD entries; return those to retry, with their error.
/// Those refused as too long come apart, to be judged anew ([`judge_anew`]).
fn apply(ctx: &Ctx, verdicts: impl Iterator<Item = (LaneItem, Verdict)>) -> (Retries, Retries) {
    let (mut retry, mut too_long) = (Vec::new(), Vec::new());
    for (item, v) in verdicts {
        match v {
            Verdict::Published => {
                if item.entry.delay_seconds.is_some() {
                    ctx.metrics.events_delayed.with_label_values(&[&ctx.cfg.name]).inc();
                }
                ctx.settle(item, Outcome::Published)
            }
            Verdict::Dead(reason) => ctx.settle(item, Outcome::Dead(reason)),
            Verdict::Retry(err) => {
                tracing::debug!(event_id = %item.entry.event.event_id, error = %err, "entry failed, will retry");
                if let Some(s) = &ctx.state {
                    s.set_last_error(err.clone());
                }
                retry.push((item, err));
            }
            Verdict::TooLong(err) => too_long.push((item, err)),
        }
    }
    (retry, too_long)
}

/// Entries to send again, each with its last error.
type Retries = Vec<(LaneItem, String)>;

/// Wait out the in-memory backoff (cut short by spooling). False when the
/// lane is closing: its entries are abandoned rather than retried.
async fn wait_to_retry(ctx: &Ctx, spool: &mut Option<watch::Receiver<Flow>>, attempt: u32) -> bool {
    if *ctx.closing.borrow() {
        return false;
    }
    let wait = tokio::time::sleep(backoff(attempt, ctx.cfg.retry_base, ctx.cfg.retry_cap));
    let mut closing = ctx.closing.subscribe();
    match spool.as_mut() {
        Some(rx) => tokio::select! {
            _ = wait => {}
            _ = rx.wait_for(|s| *s == Flow::Spooling) => {}
            _ = closing.wait_for(|c| *c) => {}
        },
        None => tokio::select! {
            _ = wait => {}
            _ = closing.wait_for(|c| *c) => {}
        },
    }
    !*ctx.closing.borrow() || spooling(spool)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> Target {
        Target::queue("http://q", false, 1 << 20)
    }

    fn failed(code: &str, sender_fault: bool) -> EntryResult {
        EntryResult::Failed { code: code.into(), sender_fault, message: "m".into() }
    }

    #[test]
    fn entries_are_reconciled_one_by_one() {
        let r = Ok(vec![EntryResult::Sent, failed("InvalidMessageContents", true), failed("InternalError", false)]);
        let CallOutcome::Entries(v) = reconcile(&queue(), &r, 3) else { panic!("entries") };
        assert_eq!(v[0], Verdict::Published);
        assert!(
            matches!(&v[1], Verdict::Dead(d) if d.code == crate::policy::dead::DeadCode::SqsRejected && d.detail == "InvalidMessageContents: m")
        );
        assert_eq!(v[2], Verdict::Retry("InternalError: m".into()));
    }

    #[test]
    fn a_failed_call_retries_splits_or_kills() {
        let e = |code: &str, sf| Err(CallError { code: code.into(), message: "m".into(), sender_fault: sf });
        assert_eq!(
            reconcile(&queue(), &e("transport", false), 2),
            CallOutcome::Entries(vec![Verdict::Retry("transport: m".into()); 2])
        );
        assert_eq!(reconcile(&queue(), &e("BatchRequestTooLong", true), 2), CallOutcome::Split);
        let CallOutcome::Entries(v) = reconcile(&queue(), &e("InvalidParameterValue", true), 1) else { panic!() };
        assert!(matches!(&v[0], Verdict::Dead(d) if d.detail == "InvalidParameterValue: m"));
    }
}
