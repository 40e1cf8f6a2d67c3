//! The LSN watermark: which position may be confirmed to the server.
//!
//! Transactions are registered in commit order; each counts its unsettled
//! events. The confirmable LSN is the end LSN of the newest transaction whose
//! events, and every earlier transaction's, are all settled (published or DEAD,
//! and marked in PostgreSQL). Acks may arrive in any order; the watermark only
//! ever moves forward over a settled prefix.

use std::collections::VecDeque;

use replication::Lsn;

/// A transaction's place in the watermark.
pub type TxnSeq = u64;

#[derive(Debug)]
struct Txn {
    seq: TxnSeq,
    /// `None` until the Commit has been seen.
    end_lsn: Option<Lsn>,
    pending: usize,
}

#[derive(Debug, Default)]
pub struct Watermark {
    txns: VecDeque<Txn>,
    next_seq: TxnSeq,
    confirmed: Lsn,
}

impl Watermark {
    pub fn new(start: Lsn) -> Self {
        Self { txns: VecDeque::new(), next_seq: 0, confirmed: start }
    }

    /// A transaction began (or a catch-up pseudo-transaction).
    pub fn begin(&mut self) -> TxnSeq {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.txns.push_back(Txn { seq, end_lsn: None, pending: 0 });
        seq
    }

    fn txn_mut(&mut self, seq: TxnSeq) -> Option<&mut Txn> {
        let front = self.txns.front()?.seq;
        let idx = seq.checked_sub(front)? as usize;
        self.txns.get_mut(idx)
    }

    /// `n` more events of `seq` are on their way; must precede their settlement.
    pub fn add(&mut self, seq: TxnSeq, n: usize) {
        let t = self.txn_mut(seq).expect("add to a transaction that is still open");
        t.pending += n;
    }

    /// The transaction's Commit was read.
    pub fn commit(&mut self, seq: TxnSeq, end_lsn: Lsn) {
        let t = self.txn_mut(seq).expect("commit of a known transaction");
        t.end_lsn = Some(end_lsn);
        self.advance();
    }

    /// One event of `seq` is settled.
    pub fn settle(&mut self, seq: TxnSeq) {
        let t = self.txn_mut(seq).expect("settle of a known transaction");
        assert!(t.pending > 0, "settled more events than were added");
        t.pending -= 1;
        self.advance();
    }

    fn advance(&mut self) {
        while let Some(front) = self.txns.front() {
            match front.end_lsn {
                Some(end) if front.pending == 0 => {
                    if end > self.confirmed {
                        self.confirmed = end;
                    }
                    self.txns.pop_front();
                }
                _ => break,
            }
        }
    }

    /// Nothing read is unsettled: a keepalive's position may be confirmed.
    pub fn is_idle(&self) -> bool {
        self.txns.is_empty()
    }

    /// With nothing in flight, confirm a position the server reported
    /// (keepalive), so an idle slot does not hold WAL.
    pub fn observe_idle(&mut self, lsn: Lsn) {
        if self.is_idle() && lsn > self.confirmed {
            self.confirmed = lsn;
        }
    }

    /// The LSN that may be confirmed now.
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Unsettled events across all transactions.
    pub fn unsettled(&self) -> usize {
        self.txns.iter().map(|t| t.pending).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn waits_for_the_oldest() {
        let mut w = Watermark::new(Lsn(10));
        let a = w.begin();
        w.add(a, 2);
        w.commit(a, Lsn(100));
        let b = w.begin();
        w.add(b, 1);
        w.commit(b, Lsn(200));
        w.settle(b);
        assert_eq!(w.confirmed(), Lsn(10));
        w.settle(a);
        assert_eq!(w.confirmed(), Lsn(10));
        w.settle(a);
        assert_eq!(w.confirmed(), Lsn(200));
        assert!(w.is_idle());
        w.observe_idle(Lsn(300));
        assert_eq!(w.confirmed(), Lsn(300));
    }

    #[test]
    fn an_open_transaction_holds_the_watermark() {
        let mut w = Watermark::new(Lsn(0));
        let a = w.begin();
        w.add(a, 1);
        w.settle(a);
        assert_eq!(w.confirmed(), Lsn(0), "no commit yet");
        w.observe_idle(Lsn(50));
        assert_eq!(w.confirmed(), Lsn(0), "not idle while a transaction is open");
        w.commit(a, Lsn(60));
        assert_eq!(w.confirmed(), Lsn(60));
        let empty = w.begin();
        w.commit(empty, Lsn(70));
        assert_eq!(w.confirmed(), Lsn(70), "an empty transaction (heartbeat) settles at once");
    }

    proptest! {
        /// Whatever order acks arrive in, the confirmed LSN never passes the
        /// end of a transaction with an unsettled event, and reaches the last
        /// end once everything is settled.
        #[test]
        fn never_passes_an_unsettled_event(
            sizes in proptest::collection::vec(0usize..5, 1..40),
            order_seed in proptest::collection::vec(any::<u32>(), 0..200),
        ) {
            let mut w = Watermark::new(Lsn(1));
            let mut ends = Vec::new();
            let mut events: Vec<(TxnSeq, usize)> = Vec::new(); // (txn, index in sizes)
            for (i, n) in sizes.iter().enumerate() {
                let s = w.begin();
                w.add(s, *n);
                let end = Lsn(100 * (i as u64 + 1));
                w.commit(s, end);
                ends.push(end);
                for _ in 0..*n { events.push((s, i)); }
            }
            let mut unsettled: Vec<usize> = sizes.clone();
            // Settle in an arbitrary order driven by the seed.
            let mut k = 0usize;
            while !events.is_empty() {
                let pick = order_seed.get(k).copied().unwrap_or(0) as usize % events.len();
                k += 1;
                let (s, i) = events.swap_remove(pick);
                w.settle(s);
                unsettled[i] -= 1;
                if let Some(first) = unsettled.iter().position(|&n| n > 0) {
                    prop_assert!(w.confirmed() < ends[first]);
                    let expect = if first == 0 { Lsn(1) } else { ends[first - 1] };
                    prop_assert_eq!(w.confirmed(), expect);
                }
            }
            prop_assert_eq!(w.confirmed(), *ends.last().unwrap());
            prop_assert!(w.is_idle());
        }
    }
}
