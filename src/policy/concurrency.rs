//! How many `SendMessageBatch` calls a lane keeps in flight: a limit between
//! 1 and the cap (`max_in_flight_batches`), found per lane by additive
//! increase and multiplicative decrease (AIMD, as TCP finds its window).
//!
//! - A call that succeeds while the lane used its whole limit, and whose
//!   round trip held (at most [`LATENCY_TOLERANCE`] times the lowest one seen
//!   lately, plus [`LATENCY_SLACK`]), raises the limit: by one per call in
//!   slow start (the limit doubles per round trip), by one per round trip
//!   past it. A lane that does not use its limit does not raise it.
//! - Each call that is throttled or fails takes half a call off the limit:
//!   a round of calls all throttled halves it, a round of which 5% are
//!   throttled shrinks it by 2.5%. The decrease follows the share throttled,
//!   so a queue throttled now and then keeps most of its throughput while
//!   one overloaded (most calls throttled) backs off fast. Slow start then
//!   ends at the lowered limit: growth probes past it by one per round.
//! - A round trip past the tolerance stops the growth (and ends slow start):
//!   more calls would only queue at the far end.

use std::time::Duration;

use super::retry::{slows_down, Failure};

/// The limit a lane starts at: the fixed number of earlier versions.
pub const INITIAL: usize = 8;
/// A round trip up to this many times the lowest one seen lately holds.
pub const LATENCY_TOLERANCE: f64 = 2.0;
/// ... plus this, so a round trip of microseconds does not stop growth on noise.
pub const LATENCY_SLACK: Duration = Duration::from_millis(5);
/// The lowest round trip is taken over the last two windows of this many calls.
const WINDOW: u32 = 256;
/// What a throttled or failed call takes off the limit, in calls.
const DECREASE: f64 = 0.5;

/// What a call's result says about the far end.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Signal {
    /// Taken (some entries may have been refused for themselves), in `rtt`.
    Sent { rtt: Duration },
    /// Told to slow down (`RequestThrottled`, `ThrottlingException`, ...).
    Throttled,
    /// Failed otherwise: the network, a timeout, a server error.
    Failed,
    /// The call never reached the queue (the objects its entries point at
    /// could not be written to S3): it says nothing of the queue.
    Silent,
}

impl Signal {
    /// The signal of a call that took `rtt`: `Err(failure)` for a call
    /// failed as a whole, or the failures of the entries it failed that may
    /// be retried.
    pub fn of(call: Result<impl IntoIterator<Item = Failure>, Failure>, rtt: Duration) -> Signal {
        match call {
            Err(failure) if slows_down(failure) => Signal::Throttled,
            Err(_) => Signal::Failed,
            Ok(retryable) => {
                let mut failed = false;
                for failure in retryable {
                    if slows_down(failure) {
                        return Signal::Throttled;
                    }
                    failed = true;
                }
                if failed {
                    Signal::Failed
                } else {
                    Signal::Sent { rtt }
                }
            }
        }
    }
}

/// What a call carries from its start to its signal.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    /// The times the lane had used its whole limit before the call started.
    saturations: u64,
}

/// One lane's limit.
#[derive(Debug, Clone)]
pub struct Limiter {
    cap: usize,
    limit: f64,
    /// Grow by one per call (not per round trip) while below this.
    slow_start_until: f64,
    /// Calls that started with the lane's whole limit in flight: a call
    /// during which this grew ran while the lane used its whole limit.
    saturations: u64,
    window_min: Option<Duration>,
    previous_min: Option<Duration>,
    window_calls: u32,
}

impl Limiter {
    /// A limit from [`INITIAL`] (or `cap`, if lower), at most `cap` (at least 1).
    pub fn new(cap: usize) -> Limiter {
        let cap = cap.max(1);
        Limiter {
            cap,
            limit: INITIAL.min(cap) as f64,
            slow_start_until: cap as f64,
            saturations: 0,
            window_min: None,
            previous_min: None,
            window_calls: 0,
        }
    }

    /// A limit from `last` (what an earlier lane of the destination found),
    /// at most `cap`; it grows fast again past it (slow start), up to the cap.
    pub fn resume(cap: usize, last: usize) -> Limiter {
        Limiter { limit: last.clamp(1, cap.max(1)) as f64, ..Limiter::new(cap) }
    }

    /// Calls the lane may have in flight now.
    pub fn limit(&self) -> usize {
        (self.limit as usize).clamp(1, self.cap)
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// A call starts, `in_flight` calls of the lane already in flight.
    pub fn start(&mut self, in_flight: usize) -> Ticket {
        let ticket = Ticket { saturations: self.saturations };
        if in_flight + 1 >= self.limit() {
            self.saturations += 1;
        }
        ticket
    }

    /// The call `ticket` started ended with `signal`. Returns whether the
    /// limit (as [`Limiter::limit`] gives it) changed.
    pub fn on(&mut self, ticket: Ticket, signal: Signal) -> bool {
        let before = self.limit();
        match signal {
            Signal::Sent { rtt } => self.sent(ticket, rtt),
            Signal::Throttled | Signal::Failed => {
                self.limit = (self.limit - DECREASE).max(1.0);
                self.slow_start_until = self.slow_start_until.min(self.limit);
            }
            Signal::Silent => {}
        }
        self.limit() != before
    }

    fn sent(&mut self, ticket: Ticket, rtt: Duration) {
        let held = self.baseline().is_none_or(|low| rtt <= low.mul_f64(LATENCY_TOLERANCE) + LATENCY_SLACK);
        self.note_rtt(rtt);
        if !held {
            self.slow_start_until = self.slow_start_until.min(self.limit);
            return;
        }
        // Limited: the lane's whole limit was in flight at some time during
        // the call (calls started together end together; only the last to
        // start sees the limit reached).
        let limited = self.saturations > ticket.saturations;
        if !limited {
            return;
        }
        let step = if self.limit < self.slow_start_until { 1.0 } else { 1.0 / self.limit };
        self.limit = (self.limit + step).min(self.cap as f64);
    }

    /// The lowest round trip of the last two windows.
    fn baseline(&self) -> Option<Duration> {
        match (self.window_min, self.previous_min) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn note_rtt(&mut self, rtt: Duration) {
        self.window_min = Some(self.window_min.map_or(rtt, |m| m.min(rtt)));
        self.window_calls += 1;
        if self.window_calls >= WINDOW {
            self.previous_min = self.window_min.take();
            self.window_calls = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const RTT: Duration = Duration::from_millis(15);

    /// One round of a busy lane: `limit` calls started together, all ending
    /// with `signal`.
    fn round(l: &mut Limiter, signal: Signal) {
        let tickets: Vec<Ticket> = (0..l.limit()).map(|i| l.start(i)).collect();
        for t in tickets {
            l.on(t, signal);
        }
    }

    /// A lane of cap 256 grown to 128 by four busy rounds of slow start.
    fn busy_at_128() -> Limiter {
        let mut l = Limiter::new(256);
        for _ in 0..4 {
            round(&mut l, Signal::Sent { rtt: RTT });
        }
        assert_eq!(l.limit(), 128);
        l
    }

    #[test]
    fn slow_start_doubles_per_round_up_to_the_cap() {
        let mut l = Limiter::new(256);
        assert_eq!(l.limit(), INITIAL);
        let mut limits = Vec::new();
        for _ in 0..6 {
            round(&mut l, Signal::Sent { rtt: RTT });
            limits.push(l.limit());
        }
        assert_eq!(limits, [16, 32, 64, 128, 256, 256]);
    }

    #[test]
    fn a_throttled_round_halves_once_and_growth_resumes_slowly_past_it() {
        let mut l = busy_at_128();
        round(&mut l, Signal::Throttled);
        assert_eq!(l.limit(), 64, "every call of the round throttled: halved");
        for _ in 0..10 {
            round(&mut l, Signal::Sent { rtt: RTT });
        }
        assert!((72..=74).contains(&l.limit()), "past the throttled point: one per round: {}", l.limit());
    }

    #[test]
    fn a_few_throttled_calls_shrink_it_by_their_share() {
        let mut l = busy_at_128();
        let tickets: Vec<Ticket> = (0..128).map(|i| l.start(i)).collect();
        for (i, t) in tickets.into_iter().enumerate() {
            l.on(t, if i % 20 == 0 { Signal::Throttled } else { Signal::Sent { rtt: RTT } });
        }
        assert!((123..=127).contains(&l.limit()), "7 of 128 throttled: 3.5 calls off, about one on: {}", l.limit());
    }

    #[test]
    fn a_resumed_limit_starts_where_the_last_lane_left_it() {
        assert_eq!(Limiter::resume(256, 40).limit(), 40);
        assert_eq!(Limiter::resume(32, 40).limit(), 32, "a lower cap holds");
        let mut l = Limiter::resume(256, 40);
        round(&mut l, Signal::Sent { rtt: RTT });
        assert_eq!(l.limit(), 80, "slow start from there");
    }

    #[test]
    fn a_lane_not_using_its_limit_does_not_grow_it() {
        let mut l = Limiter::new(64);
        for _ in 0..100 {
            let t = l.start(0);
            l.on(t, Signal::Sent { rtt: RTT });
        }
        assert_eq!(l.limit(), INITIAL);
    }

    #[test]
    fn a_round_trip_past_the_tolerance_stops_growth() {
        let mut l = Limiter::new(256);
        round(&mut l, Signal::Sent { rtt: RTT });
        assert_eq!(l.limit(), 16);
        round(&mut l, Signal::Sent { rtt: RTT * 4 });
        assert_eq!(l.limit(), 16, "calls queue at the far end: no growth");
        for _ in 0..10 {
            round(&mut l, Signal::Sent { rtt: RTT });
        }
        assert!((24..=26).contains(&l.limit()), "slow start ended where latency rose: {}", l.limit());
    }

    #[test]
    fn signals_of_results() {
        let none: [Failure; 0] = [];
        assert_eq!(Signal::of(Ok(none), RTT), Signal::Sent { rtt: RTT });
        assert_eq!(Signal::of(Ok([Failure::Passing]), RTT), Signal::Failed);
        assert_eq!(Signal::of(Ok([Failure::Passing, Failure::Throttled]), RTT), Signal::Throttled);
        assert_eq!(Signal::of(Err::<[Failure; 0], _>(Failure::Throttled), RTT), Signal::Throttled);
        assert_eq!(Signal::of(Err::<[Failure; 0], _>(Failure::Passing), RTT), Signal::Failed);
    }

    fn signal() -> impl Strategy<Value = Signal> {
        prop_oneof![
            6 => (1u64..100).prop_map(|ms| Signal::Sent { rtt: Duration::from_millis(ms) }),
            1 => Just(Signal::Throttled),
            1 => Just(Signal::Failed),
        ]
    }

    proptest! {
        /// Whatever the calls and their signals: the limit stays within 1 and
        /// the cap, a throttle or failure never raises it, and success never
        /// lowers it.
        #[test]
        fn the_limit_stays_in_bounds(cap in 1usize..300, calls in prop::collection::vec((0usize..300, signal()), 0..400)) {
            let mut l = Limiter::new(cap);
            for (in_flight, s) in calls {
                let before = l.limit();
                let t = l.start(in_flight.min(l.limit()));
                l.on(t, s);
                prop_assert!((1..=cap).contains(&l.limit()));
                match s {
                    Signal::Sent { .. } => prop_assert!(l.limit() >= before),
                    _ => prop_assert!(l.limit() <= before),
                }
            }
        }

        /// After any history, calls that succeed at a steady round trip with
        /// the lane using its limit bring it back to the cap within
        /// a bounded number of rounds (the cap's, past the throttled point).
        #[test]
        fn steady_success_reaches_the_cap(cap in 1usize..300, calls in prop::collection::vec(signal(), 0..200)) {
            let mut l = Limiter::new(cap);
            for s in calls {
                let t = l.start(l.limit());
                l.on(t, s);
            }
            for _ in 0..(2 * cap + 20) {
                round(&mut l, Signal::Sent { rtt: Duration::from_millis(1) });
            }
            prop_assert_eq!(l.limit(), cap);
        }
    }
}
