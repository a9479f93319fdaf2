//! The rdkafka adapters.
//!
//! - [`GuardedConsumer`] wraps a `StreamConsumer` built from the user's own
//!   `ClientConfig` and yields only fresh records (G2).
//! - [`GuardedPipeline`] is consumer, then a user function, then an
//!   idempotent producer, with output reconciliation (G1).
//! - [`GuardContext`] is the rebalance-aware consumer context both use: on
//!   revoke it checkpoints the leaving partitions before returning, on assign
//!   it recovers the arriving ones before their first record is delivered.
//!
//! - [`GuardOptions`] is how both guard: identity, checkpoints, retention,
//!   durability, memory, fencing, broker patience.
//!
//! Opening is async ([`GuardedPipelineBuilder::build`],
//! [`GuardedConsumerBuilder::build`]): the broker probes and the state's
//! recovery run on tokio's blocking threads. Closing is bounded
//! ([`GuardedPipeline::close`], [`GuardedConsumer::close`]). Recovery of
//! partitions that arrive later runs inside librdkafka's rebalance callback,
//! which rdkafka calls from the poll of `recv`, so a rebalance holds that
//! task up for as long as recovery reads (bounded by the options' timeout).
//!
//! The baselines the guard is measured against (an at-least-once copy, a
//! transactional copy) and the crash simulation `abort()` are behind the
//! `baselines` feature, in [`baseline`] when it is on.
//!
//! ## Metrics
//!
//! Both adapters emit counters, gauges and histograms through the `metrics`
//! facade; the library installs no recorder. [`describe_metrics`] lists
//! them and gives each its unit and help. The consumer lag
//! (`replayguard_consumer_lag`, [`PipelineStats::lag`],
//! [`ConsumerStats::lag`]) comes from librdkafka's statistics, so it is
//! there only when the configuration sets `statistics.interval.ms`.
//!
//! ## What the adapters change in the user's configuration
//!
//! - `enable.auto.commit=false` and `enable.auto.offset.store=false`: the
//!   manifest is the truth, and group offsets are committed (advisorily) at
//!   each checkpoint.
//! - `enable.partition.eof=true` with `stop_at_end` only: the end of the
//!   input is found from partition-end events.
//! - `auto.offset.reset=earliest` when not set: a partition with no
//!   position anywhere (no state, no committed offset) is read from its
//!   start, not from its end, so nothing already in it is skipped. Set to
//!   `latest`, such a partition starts at its end as asked when it is
//!   assigned, and that end is its position from then on: committed at
//!   the next checkpoint, so a later run starts there, not at a new end.
//! - `linger.ms=5` for the pipeline's producer when not set.
//! - `group.instance.id`, when not set, is derived from the state folder
//!   (static membership, KIP-345), so that a restart after `kill -9` gets
//!   its partitions back at once instead of waiting out the session
//!   timeout: on Apache Kafka 4 the first output of the restarted pipeline
//!   came about 0.2 s after the kill. librdkafka's mock cluster matches
//!   members by member id only, so there the restart waits for the session
//!   timeout; hence also:
//! - `session.timeout.ms=6000` when not set (the usual broker minimum),
//!   which bounds that wait.
//! - `partition.assignment.strategy=cooperative-sticky` when not set, so that
//!   the revoke callback can commit synchronously.
//! - With the new group protocol (`group.protocol=consumer`, KIP-848) the
//!   broker assigns partitions and owns the session timeout, so neither of
//!   the two settings above is made, and the member is dynamic: a static
//!   member killed without leaving keeps its instance id until the broker's
//!   `group.consumer.session.timeout.ms` (45 s by default), and librdkafka
//!   treats its successor's rejoin as fatal. A restart then waits that
//!   session timeout before it gets its partitions back.
//! - `heartbeat.interval.ms`, when not set, is a sixth of the session
//!   timeout (librdkafka's 3 s at most): the lease below is the session
//!   timeout less the heartbeat interval less a margin.
//! - The pipeline's producer gets `enable.idempotence=true` and `acks=all`; a
//!   configuration that turns idempotence off is refused. In guarded mode it
//!   also gets `message.timeout.ms` (the pipeline's `delivery_timeout`, 10 s)
//!   and `request.timeout.ms` (at most 5 s) unless they are set: they bound
//!   how long an output can stay in flight, which is how long a new owner
//!   waits after an unclean handover.
//!
//! ## Fencing without transactions
//!
//! An instance frozen or cut off past its session timeout must not write
//! what its successor writes. It hands work on only within its lease, and
//! stops, with its queued outputs purged, after the process stood still
//! longer than the lease ([`crate::Error::LeaseLapsed`]) or once librdkafka
//! finds its group session timed out ([`crate::Error::AssignmentLost`]). Every output has a
//! bounded delivery time. A member given a partition by another instance
//! without a clean handover (commit metadata says who wrote it and whether
//! a revoke flushed first) keeps it paused for that instance's delivery
//! bound before it reconciles the output. Every owner commits such
//! metadata for a partition it takes (a claim) before the partition's
//! first output, so that its successor waits for it even when it left
//! before its first checkpoint; a claim the broker refuses keeps the
//! partition paused and is tried again. A broker that refuses that
//! metadata as too long stops the pipeline
//! ([`crate::Error::CommitMetadataTooLarge`]). The README's guarantees say
//! what this covers and what it does not.

#[cfg(feature = "baselines")]
pub mod baseline;
mod changelog;
mod consumer;
mod context;
mod headers;
mod lease;
mod options;
mod pipeline;
mod reconcile;
mod setup;
mod shared;
mod telemetry;
mod trouble;

pub use consumer::{ConsumerStats, GuardedConsumer, GuardedConsumerBuilder, GuardedRecord};
pub use context::GuardContext;
pub use headers::{FINGERPRINT_HEADER, PART_HEADER, SOURCE_HEADER, SourcePosition};
pub use options::GuardOptions;
pub use pipeline::output::OutputRecord;
pub use pipeline::{GuardedPipeline, GuardedPipelineBuilder, PipelineStats, StatsHandle};
pub use telemetry::describe_metrics;

use rdkafka::message::{Headers, Message};

use crate::fingerprint::{Fingerprint, Identity};

/// Runs `close` (dropping Kafka clients, which can block for seconds) on a
/// thread of its own, waiting at most `timeout`. Not on tokio's blocking
/// pool: a runtime waits for its blocking tasks when it shuts down, so a
/// close that never ended would keep the program from ending too.
async fn close_bounded(
    close: impl FnOnce() + Send + 'static,
    timeout: std::time::Duration,
) -> crate::Result<()> {
    let (done, closed) = tokio::sync::oneshot::channel();
    close_on_thread(close, move || {
        let _ = done.send(());
    })
    .map_err(|e| crate::Error::Stopped {
        reason: format!("cannot start a thread to close the Kafka clients: {e}"),
        after: None,
    })?;
    match tokio::time::timeout(timeout, closed).await {
        Ok(Ok(())) => Ok(()),
        // The thread ended without saying it closed: the close panicked
        // (the panic is printed), so the clients and the state may not
        // have been closed cleanly.
        Ok(Err(_)) => Err(crate::Error::Stopped {
            reason: CLOSE_PANICKED.into(),
            after: None,
        }),
        Err(_) => Err(crate::Error::Stopped {
            reason: format!(
                "closing the Kafka clients took longer than {timeout:?}; they go on closing in the background"
            ),
            after: None,
        }),
    }
}

const CLOSE_PANICKED: &str = "closing the Kafka clients panicked; the state folder may not have been closed cleanly (the next start recovers from its last checkpoint)";

/// Runs `close` on a thread named for it, then `done`; `done` is not run
/// when `close` panics.
fn close_on_thread(
    close: impl FnOnce() + Send + 'static,
    done: impl FnOnce() + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("replayguard-close".into())
        .spawn(move || {
            close();
            done();
        })
        .map(drop)
}

/// What closing an adapter blocks on: the last references to its Kafka
/// clients and its core, whose drops leave the group, flush and close the
/// state folder. `close` hands it to [`close_bounded`]. An adapter dropped
/// without `close` (on an error's way out, say) closes it on a thread of
/// its own and waits at most `bound`: a consumer dropped inline waits for
/// the group's answer with no bound, so a broker that stopped answering
/// would hang the drop.
pub(crate) struct Closer {
    close: Option<Box<dyn FnOnce() + Send + Sync>>,
    bound: std::time::Duration,
}

impl Closer {
    /// Starts the group's watch on `consumer`
    /// ([`context::AssignmentWatcher`]) and makes the closer of the
    /// adapter's clients. The close drops them in this order:
    /// - the watch, whose thread holds a reference to the consumer;
    /// - the consumer, whose close runs its last revoke, which checkpoints
    ///   with the guard;
    /// - `rest` (the producer, if any).
    ///
    /// Then it closes the state folder, whoever else still holds `core`.
    /// Dropping the `Closer` runs it, waiting at most `bound`.
    pub(crate) fn watching<C>(
        core: &std::sync::Arc<context::Core>,
        consumer: &std::sync::Arc<C>,
        rest: impl Send + Sync + 'static,
        bound: std::time::Duration,
    ) -> Self
    where
        C: rdkafka::consumer::Consumer<context::GuardContext> + Send + Sync + 'static,
    {
        // A tuple drops its fields in order.
        let clients = (
            context::AssignmentWatcher::start(core, consumer),
            consumer.clone(),
            rest,
        );
        let core = core.clone();
        Closer {
            close: Some(Box::new(move || {
                drop(clients);
                core.close_state();
            })),
            bound,
        }
    }

    /// The close itself, to run bounded or in the background; the `Closer`
    /// is then spent and its drop does nothing.
    pub(crate) fn take(mut self) -> impl FnOnce() + Send + 'static {
        let close = self.close.take();
        move || {
            if let Some(close) = close {
                close();
            }
        }
    }
}

impl Drop for Closer {
    fn drop(&mut self) {
        let Some(close) = self.close.take() else {
            return;
        };
        let bound = self.bound;
        let (done, closed) = std::sync::mpsc::channel();
        if let Err(e) = close_on_thread(close, move || {
            let _ = done.send(());
        }) {
            // The close went down with the thread that could not start,
            // so the clients were closed here, without a bound.
            tracing::warn!(error = %e, "cannot start a thread to close the Kafka clients; closed them on the dropping thread");
            return;
        }
        match closed.recv_timeout(bound) {
            Ok(()) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => tracing::warn!(
                ?bound,
                "dropped without close: closing the Kafka clients took longer than the options' timeout; they go on closing in the background"
            ),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                tracing::error!("dropped without close: {CLOSE_PANICKED}");
            }
        }
    }
}

/// The content identity of a Kafka record under `identity`.
pub(crate) fn identify(identity: &Identity, m: &impl Message) -> Option<Fingerprint> {
    identity.fingerprint(m.key(), m.payload(), |name| {
        let headers = m.headers()?;
        headers.iter().find(|h| h.key == name).map(|h| h.value)
    })
}

#[cfg(test)]
mod test {
    use std::time::Duration;

    use super::close_bounded;

    #[tokio::test]
    async fn a_bounded_close_tells_a_close_that_ended_from_one_that_did_not() {
        assert!(close_bounded(|| (), Duration::from_secs(5)).await.is_ok());
        let panicked =
            close_bounded(|| panic!("a close that panics"), Duration::from_secs(5)).await;
        assert!(
            panicked.is_err_and(|e| e.to_string().contains("panicked")),
            "a close that panicked is an error"
        );
        let slow = close_bounded(
            || std::thread::sleep(Duration::from_secs(2)),
            Duration::from_millis(100),
        )
        .await;
        assert!(
            slow.is_err_and(|e| e.to_string().contains("took longer than")),
            "a close past the bound is an error"
        );
    }
}
