//! Fencing without transactions: the old owner's lease, and the new
//! owner's wait.
//!
//! A zombie is an instance frozen or cut off past its session timeout
//! while it still had work under way; the group has meanwhile given its
//! partitions to another member. Three parts keep it from writing (or, for
//! a guarded consumer, delivering) anything the new owner also writes:
//!
//! - **The lease.** An instance hands work on only while it cannot have
//!   been expired by the group coordinator. A watchdog thread ticks every
//!   50 ms; a gap between ticks (or since the last tick) longer than the
//!   lease means the whole process stood still that long, frozen or
//!   starved, and the lease is the session timeout less the heartbeat
//!   interval less a margin: shorter than any silence after which the
//!   coordinator can expire the member. librdkafka's own verdict counts
//!   too: once it finds its session timed out (no heartbeat answered for
//!   the session timeout, as when the network is cut), the assignment is
//!   lost. Either way the instance stops, its queued outputs purged and
//!   never counted as handled.
//! - **A bounded delivery time.** Every output is produced with
//!   `message.timeout.ms = T`: librdkafka times a queued output out before
//!   it builds a request with it (it scans for timeouts on its first serve
//!   after a pause, and every second).
//! - **The new owner's wait.** Commit metadata names the instance that
//!   wrote it, whether it was a clean handover (a revoke that flushed and
//!   checkpointed) and how long that instance's outputs can stay in flight
//!   (`T` + the request timeout + a second of timeout-scan granularity). A
//!   member that takes a partition without a clean handover from another
//!   instance keeps it paused that long before it reconciles the output, so
//!   whatever the old owner could still write has landed and is read back.
//!   After a clean handover, or its own earlier run (the state folder's lock
//!   proves that one dead), it does not wait.
//!
//! The wait happens outside the rebalance callback (the partitions are
//! paused, see [`super::context::Held`]): a callback that blocks for long
//! keeps the member from rejoining a rebalance, and a broker whose
//! rebalance timeout is short then expires it.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the watchdog ticks.
const TICK: Duration = Duration::from_millis(50);

/// What the watchdog saw: its last tick, and the longest stall.
#[derive(Debug)]
struct Ticks {
    last: Instant,
    /// The first stall longer than the lease, latched: the instance may
    /// have been expired by then, whatever happened since.
    stalled: Option<Duration>,
}

/// The lease of an instance on its partitions.
#[derive(Debug, Clone)]
pub(crate) struct Lease {
    /// The longest stall the instance survives as a member.
    pub length: Duration,
    /// Off in the baselines and in the fencing-off control of the tests.
    pub enabled: bool,
    ticks: Arc<Mutex<Ticks>>,
}

impl Lease {
    pub fn new(length: Duration, enabled: bool) -> Self {
        Lease {
            length,
            enabled,
            ticks: Arc::new(Mutex::new(Ticks {
                last: Instant::now(),
                stalled: None,
            })),
        }
    }

    fn ticks(&self) -> std::sync::MutexGuard<'_, Ticks> {
        self.ticks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The watchdog's tick: notes a stall longer than the lease.
    fn tick(&self) {
        let mut t = self.ticks();
        let gap = t.last.elapsed();
        if gap > self.length && t.stalled.is_none() {
            t.stalled = Some(gap);
        }
        t.last = Instant::now();
    }

    /// How long the process stood still, when that is longer than the
    /// lease: since the watchdog's last tick (the check may run before the
    /// watchdog does, after a thaw), or a stall it latched before.
    pub fn lapsed(&self) -> Option<Duration> {
        if !self.enabled {
            return None;
        }
        let t = self.ticks();
        t.stalled
            .or_else(|| Some(t.last.elapsed()).filter(|g| *g > self.length))
    }

    /// Starts the watchdog; it stops when the returned handle drops.
    pub fn watch(&self) -> Option<Watchdog> {
        if !self.enabled {
            return None;
        }
        let (stop, stopped) = std::sync::mpsc::channel();
        let lease = self.clone();
        let spawned = std::thread::Builder::new()
            .name("replayguard-watchdog".into())
            .spawn(move || watch(&lease, &stopped));
        match spawned {
            Ok(_) => Some(Watchdog { _stop: stop }),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the lease watchdog; the lease then lapses at once");
                None
            }
        }
    }
}

/// The thread that watches for stalls. Dropping it stops the thread.
pub(crate) struct Watchdog {
    _stop: Sender<()>,
}

fn watch(lease: &Lease, stopped: &Receiver<()>) {
    loop {
        match stopped.recv_timeout(TICK) {
            Err(RecvTimeoutError::Timeout) => lease.tick(),
            _ => return,
        }
    }
}

/// Says that arriving partitions wait `wait` for the outputs `from` may
/// still have in flight before they are reconciled.
pub(crate) fn note_wait(wait: Duration, from: &str, meters: &super::telemetry::Meters) {
    tracing::warn!(
        previous_owner = from,
        seconds = wait.as_secs_f64(),
        "partitions arrive without a clean handover; they stay paused while outputs their previous owner may still have in flight land, then the output is reconciled"
    );
    meters.fence_wait_seconds.record(wait.as_secs_f64());
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_stall_longer_than_the_lease_lapses_it_for_good() {
        let lease = Lease::new(Duration::from_millis(200), true);
        let dog = lease.watch();
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(lease.lapsed(), None, "the watchdog ticked all along");
        // A stall the watchdog has not ticked over yet is seen at once.
        lease.ticks().last = Instant::now() - Duration::from_millis(500);
        assert!(
            lease
                .lapsed()
                .is_some_and(|g| g >= Duration::from_millis(500))
        );
        // Once the watchdog ticks over it, the stall stays latched.
        std::thread::sleep(Duration::from_millis(150));
        assert!(lease.ticks().last.elapsed() < Duration::from_millis(100));
        assert!(lease.lapsed().is_some());
        drop(dog);
        let off = Lease::new(Duration::ZERO, false);
        assert!(off.watch().is_none());
        assert_eq!(off.lapsed(), None);
    }
}
