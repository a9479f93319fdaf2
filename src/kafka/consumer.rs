//! The guarded consumer: a `StreamConsumer` built from the user's own
//! configuration that yields each record once within the retention (G2).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{FutureExt, Stream};
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};

use super::context::{Core, GuardContext, NoHooks};
use super::lease::{Lease, Watchdog};
use super::options::GuardOptions;
use super::setup::{self, kafka};
use super::shared::Shared;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::Stats;
use crate::job::{Job, JobKind};

/// Records admitted with one engine call, at most.
const ADMIT_BATCH: usize = 256;

/// A fresh record, to be acked with [`GuardedConsumer::ack`] once handled.
#[derive(Debug)]
pub struct GuardedRecord {
    message: OwnedMessage,
    fingerprint: Option<Fingerprint>,
    /// The generation of its partition's track when it was admitted: an
    /// ack under another is refused (see [`Error::Revoked`]).
    generation: u64,
}

impl GuardedRecord {
    /// The record.
    #[must_use]
    pub fn message(&self) -> &OwnedMessage {
        &self.message
    }

    /// Its content identity (`None` for position-only identity or a missing
    /// identity header).
    #[must_use]
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        self.fingerprint
    }
}

/// Counters of a guarded consumer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConsumerStats {
    /// Records received.
    pub records_in: u64,
    /// Records filtered as already handled.
    pub duplicates: u64,
    /// Fresh records handed to the application.
    pub delivered: u64,
    /// Records the application acked.
    pub acked: u64,
    /// Acks refused ([`Error::Revoked`]): the record's partition left this
    /// consumer after it was delivered, and its owner delivers it again.
    pub acks_refused: u64,
    /// Checkpoints completed.
    pub checkpoints: u64,
    /// The engine's snapshot.
    pub guard: Option<Stats>,
    /// Consumer lag of each assigned partition, (topic, partition) to the
    /// high watermark less the position, from librdkafka's statistics:
    /// empty unless `statistics.interval.ms` is set.
    pub lag: BTreeMap<(String, i32), i64>,
}

/// Builds a [`GuardedConsumer`].
#[must_use]
pub struct GuardedConsumerBuilder {
    config: ClientConfig,
    state: PathBuf,
    topics: Vec<String>,
    options: GuardOptions,
}

impl GuardedConsumerBuilder {
    /// Adds a topic to subscribe to (at least one is required).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// How the consumer guards: identity, checkpoints, retention, and the
    /// rest ([`GuardOptions`]). Default [`GuardOptions::default`].
    pub fn options(mut self, options: GuardOptions) -> Self {
        self.options = options;
        self
    }

    /// Opens the state, reaches the brokers and subscribes. The broker
    /// probes and the state's recovery block, so they run on tokio's
    /// blocking threads.
    ///
    /// # Errors
    ///
    /// [`Error::Config`], [`Error::Unreachable`], [`Error::UnknownTopic`],
    /// [`Error::Connect`], [`Error::JobMismatch`], the state folder's open
    /// errors, and [`Error::Kafka`].
    pub async fn build(self) -> Result<GuardedConsumer> {
        crate::kafka::setup::on_blocking_thread("building the consumer", move || self.open()).await
    }

    fn open(self) -> Result<GuardedConsumer> {
        if self.topics.is_empty() {
            return Err(Error::Config("no topic given".into()));
        }
        setup::check_named_once(&self.topics, "topics")?;
        let o = &self.options;
        o.validate()?;
        // First, so that an endpoint serving already shows every series,
        // at zero, while the rest opens.
        let meters = Arc::new(super::telemetry::Meters::new(&o.metric_labels));
        let group = setup::group_id(&self.config)?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        setup::check_changelog_apart(o.changelog.as_deref(), &topics)?;
        setup::check_consumer_config(&self.config, o.stop_at_end, o.lease)?;
        let counts = setup::probe_topics(&self.config, &topics, o.connect_attempts)?;
        let guard = o.open(&self.state)?;
        let job = Job::new(JobKind::Consumer, &group, &self.topics, o.identity.label())
            .with_changelog(o.changelog.clone());
        // The changelog is checked before the folder is bound to it.
        let token = setup::instance_token(&self.state)?;
        let changelog = super::changelog::Changelog::for_options(
            &self.config,
            o,
            counts.iter().copied().max().unwrap_or(1),
            &token,
            &meters,
        )?;
        crate::job::bind(&self.state, &job, o.rebind)?;
        let instance = setup::instance_id(&self.state, &group, &self.topics)?;
        let cfg = setup::guarded_consumer_config(&self.config, &instance, o.stop_at_end)?;
        let fenced = !setup::fault("no-fencing");
        let lease = o.lease.unwrap_or_else(|| setup::lease_length(&cfg));
        let mut shared = Shared::new(Some(guard), meters.clone());
        if changelog.is_some() {
            // The changelog's ends go into the manifest and commit metadata.
            shared.sink = Some(super::shared::resumed_sink(
                shared.guard_ref(),
                "",
                &token,
                Duration::ZERO,
            ));
        }
        let core = Arc::new(Core {
            shared: Arc::new(Mutex::new(shared)),
            hooks: Box::new(NoHooks),
            timeout: o.timeout,
            brokers: setup::brokers(&self.config),
            instance: token,
            fenced,
            lease: Lease::new(lease, fenced),
            changelog,
            metadata_taken: Default::default(),
            start_at_end: setup::starts_at_end(&cfg),
            meters,
            group,
            static_member: setup::is_static_member(&cfg),
            watch: Default::default(),
        });
        let consumer: Arc<StreamConsumer<GuardContext>> = Arc::new(
            cfg.create_with_context(GuardContext::new(core.clone(), &cfg))
                .map_err(kafka("creating the consumer"))?,
        );
        consumer.subscribe(&topics).map_err(kafka("subscribing"))?;
        let watchdog = core.lease.watch();
        let wake = core.lock().wake.clone();
        let closer = super::Closer::watching(&core, &consumer, (), o.timeout);
        Ok(GuardedConsumer {
            consumer,
            _watchdog: watchdog,
            core,
            identity: self.options.identity.clone(),
            interval: self.options.checkpoint_interval,
            last_checkpoint: Mutex::new(Instant::now()),
            stop_at_end: self.options.stop_at_end,
            transient: Mutex::default(),
            ended: AtomicBool::new(false),
            ready: Mutex::default(),
            wake,
            closer,
        })
    }
}

/// A guarded consumer: built from the user's configuration, it yields each
/// record once within the retention; an unacked record is delivered again
/// after a restart.
///
/// It turns off auto-commit (`enable.auto.commit=false`): positions are
/// written to its manifest at each checkpoint and then committed to the
/// group as advice. Its consumer context is the guard's own, which must see
/// every rebalance first (to checkpoint what leaves and recover what
/// arrives), so a consumer context of the application's cannot be used; and
/// the consumer is not handed out, since a seek or a commit of the
/// application's would move positions behind the manifest's back.
/// [`GuardedConsumer::assignment`] tells which partitions it holds.
///
/// Close it with [`GuardedConsumer::close`], which checkpoints first. One
/// dropped without it (on an error's way out, say) takes no checkpoint and
/// closes its client on a thread of its own, waiting at most the options'
/// timeout ([`GuardOptions::timeout`]).
pub struct GuardedConsumer {
    consumer: Arc<StreamConsumer<GuardContext>>,
    /// Watches for stalls while the consumer lives.
    _watchdog: Option<Watchdog>,
    core: Arc<Core>,
    identity: crate::Identity,
    interval: Duration,
    last_checkpoint: Mutex<Instant>,
    stop_at_end: bool,
    transient: Mutex<super::trouble::TransientLog>,
    /// With `stop_at_end`: the end of the input was seen; what is left to
    /// deliver is in `ready`.
    ended: AtomicBool,
    /// Records admitted in a batch, not yet handed out.
    ready: Mutex<VecDeque<GuardedRecord>>,
    /// The core's wake-up (see `Shared::wake`), kept so that a wait for
    /// records need not lock the core to listen.
    wake: Arc<tokio::sync::Notify>,
    /// Holds the last references to `consumer` and `core`, and closes them
    /// bounded when the consumer is dropped without [`Self::close`]. Last,
    /// so that the fields above are dropped before it.
    closer: super::Closer,
}

impl GuardedConsumer {
    /// Starts building a guarded consumer from the user's configuration
    /// (which must name `group.id` and `bootstrap.servers`) and a state
    /// folder of its own.
    pub fn builder(config: ClientConfig, state: impl AsRef<Path>) -> GuardedConsumerBuilder {
        GuardedConsumerBuilder {
            config,
            state: state.as_ref().to_owned(),
            topics: Vec::new(),
            options: GuardOptions::default(),
        }
    }

    /// The partitions assigned to this consumer now, as its rebalance
    /// callback applied them (read without asking librdkafka, whose own
    /// answer waits for the group with no bound).
    #[must_use]
    pub fn assignment(&self) -> Vec<(String, i32)> {
        self.core.assigned()
    }

    /// The next fresh record; `None` at the end of the input with
    /// `stop_at_end` (once per end: a later call reads what arrived since). Duplicates are skipped and counted. Checkpoints run
    /// here when the interval has passed.
    ///
    /// # Errors
    ///
    /// A failed recovery, checkpoint or store write, a consumer error that
    /// does not heal ([`Error::Consume`]), a lapsed lease.
    pub async fn recv(&self) -> Result<Option<GuardedRecord>> {
        loop {
            self.check_failure()?;
            let due = self.last_checkpoint.lock().map_or(Duration::ZERO, |t| {
                self.interval.saturating_sub(t.elapsed())
            });
            if due.is_zero() {
                self.checkpoint().await?;
                continue;
            }
            let ready = self
                .ready
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop_front();
            // Once per end seen: a later call reads on, and ends again at
            // the next end event.
            if ready.is_none() && self.ended.swap(false, Ordering::Relaxed) {
                return Ok(None);
            }
            if ready.is_none() && self.stop_at_end && self.core.group_at_end(&*self.consumer) {
                tracing::warn!(
                    "no input partition is assigned to this consumer, and its group has read the input to its end: it is at its end (a group with more members than partitions leaves some with none)"
                );
                return Ok(None);
            }
            if let Some(record) = ready {
                // Not delivered once its partition left (in a rebalance
                // since it was polled): its owner delivers it.
                if !self.holds(&record) {
                    continue;
                }
                // Not delivered once this consumer may have lost its
                // partitions; the record stays unacked, so its next owner
                // delivers it.
                self.core.check_lease(&*self.consumer)?;
                self.core.lock().counters.delivered += 1;
                return Ok(Some(record));
            }
            // A callback that stopped the guard (a failed recovery on
            // assign, say) wakes the wait: the next round returns it.
            let msg = tokio::select! {
                biased;
                () = self.wake.notified() => continue,
                m = tokio::time::timeout(due, self.consumer.recv()) => match m {
                    Err(_) => continue,
                    Ok(m) => m,
                },
            };
            self.read(msg)?;
        }
    }

    /// Takes a received record and whatever else is ready, and admits them
    /// with one engine call; with `stop_at_end`, notes the end of the input.
    fn read(&self, first: std::result::Result<BorrowedMessage<'_>, KafkaError>) -> Result<()> {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(m) = next.take() {
            match m {
                Ok(m) => batch.push(m),
                Err(KafkaError::PartitionEOF(p)) if self.stop_at_end => {
                    // The records polled before the end event first: a
                    // record admitted after it would clear the partition's
                    // end again.
                    self.admit(std::mem::take(&mut batch))?;
                    if self.core.at_end(&*self.consumer, p)? {
                        self.ended.store(true, Ordering::Relaxed);
                        break;
                    }
                }
                Err(KafkaError::PartitionEOF(_)) => {}
                Err(e) if super::trouble::heals(&e) => {
                    if let Ok(mut log) = self.transient.lock() {
                        log.note(&e);
                    }
                }
                Err(e) => return Err(self.core.consume_failure(&*self.consumer, e)),
            }
            if batch.len() < ADMIT_BATCH {
                next = self.consumer.recv().now_or_never();
            }
        }
        self.admit(batch)
    }

    fn admit(&self, mut batch: Vec<BorrowedMessage<'_>>) -> Result<()> {
        // Records polled before a rebalance that took their partition away
        // (its callback runs inside a poll) belong to its new owner.
        {
            let s = self.core.lock();
            batch.retain(|m| {
                s.assigned
                    .iter()
                    .any(|(t, p)| *p == m.partition() && t == m.topic())
            });
        }
        if batch.is_empty() {
            return Ok(());
        }
        let verdicts = self.core.admit_polled(&self.identity, &batch)?;
        let admitted: Vec<_> = {
            let s = self.core.lock();
            batch
                .into_iter()
                .zip(verdicts)
                .filter(|(_, (_, ok))| *ok)
                .map(|(m, (fp, _))| {
                    let generation = s.generation(m.topic(), m.partition()).unwrap_or(0);
                    GuardedRecord {
                        message: m.detach(),
                        fingerprint: fp,
                        generation,
                    }
                })
                .collect()
        };
        self.ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(admitted);
        Ok(())
    }

    /// Whether this consumer still holds the partition of `r` as it did
    /// when `r` was admitted.
    fn holds(&self, r: &GuardedRecord) -> bool {
        self.core
            .lock()
            .generation(r.message.topic(), r.message.partition())
            == Some(r.generation)
    }

    /// Marks a record handled. Its identity is recorded in the open epoch
    /// and written to the store at once (handed to the operating system, or
    /// fsynced with [`crate::Durability::Sync`]), so a crash after `ack`
    /// returns does not deliver it again. The position may move past it at
    /// the next checkpoint.
    ///
    /// What survives the loss of the machine (its disk with it): without a
    /// changelog ([`GuardOptions::changelog`]), the positions committed at
    /// checkpoints only, so a resend of an acked record passes at the next
    /// owner. With one, every record acked before the last completed
    /// checkpoint, by position and by content: acks since then (at most
    /// one checkpoint interval) are in this folder only, and the next
    /// owner delivers those records again.
    ///
    /// A record whose partition left this consumer in a rebalance after
    /// it was delivered (even if it came back since) is not recorded: its
    /// position was committed before it when the partition left, so the
    /// partition's owner delivers it again. `ack` says so with
    /// [`Error::Revoked`], and the consumer goes on: an application that
    /// can undo its handling (a database transaction not yet committed,
    /// say) keeps each record handled once.
    ///
    /// # Errors
    ///
    /// A store write failure (which poisons the guard); [`Error::Revoked`]
    /// for a record whose partition left since it was delivered.
    pub fn ack(&self, r: &GuardedRecord) -> Result<()> {
        self.ack_many(std::slice::from_ref(r))
    }

    /// Marks several records handled with one store write.
    ///
    /// # Errors
    ///
    /// A store write failure (which poisons the guard); [`Error::Revoked`]
    /// naming the records whose partition left since they were delivered,
    /// after the others were acked.
    pub fn ack_many(&self, records: &[GuardedRecord]) -> Result<()> {
        let mut s = self.core.lock();
        let mut moved = Vec::new();
        let mut done = || -> Result<()> {
            for r in records {
                let (topic, partition) = (r.message.topic(), r.message.partition());
                if s.generation(topic, partition) != Some(r.generation) {
                    moved.push((topic.to_owned(), partition, r.message.offset()));
                    continue;
                }
                s.complete(topic, partition, r.message.offset())?;
                s.counters.acked += 1;
            }
            // The batch is recorded here, and written as durability says.
            match s.engine()? {
                Some(g) => g.flush(),
                None => Ok(()),
            }
        };
        let r = done();
        if !moved.is_empty() {
            s.counters.acks_refused += moved.len() as u64;
            s.meters.acks_refused.increment(moved.len() as u64);
        }
        drop(s);
        r.map_err(|e| self.core.stop(e))?;
        if moved.is_empty() {
            Ok(())
        } else {
            Err(Error::Revoked { records: moved })
        }
    }

    /// Writes a checkpoint now: pending identities and the manifest, fsynced;
    /// then commits the group offsets.
    ///
    /// # Errors
    ///
    /// A store failure.
    pub async fn checkpoint(&self) -> Result<()> {
        let started = Instant::now();
        if let Err(e) = self
            .core
            .checkpoint(&*self.consumer, None, CommitMode::Async)
        {
            return Err(self.core.stop(e));
        }
        if let Ok(mut t) = self.last_checkpoint.lock() {
            *t = Instant::now();
        }
        if let Err(e) = self.core.watch_assignment(&*self.consumer) {
            return Err(self.core.stop(e));
        }
        self.core
            .meters
            .checkpoint_seconds
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }

    /// The fresh records as a stream; it ends at the end of the input with
    /// `stop_at_end`.
    pub fn stream(&self) -> impl Stream<Item = Result<GuardedRecord>> + '_ {
        futures::stream::unfold(self, |c| async move {
            match c.recv().await {
                Ok(Some(r)) => Some((Ok(r), c)),
                Ok(None) => None,
                Err(e) => Some((Err(e), c)),
            }
        })
    }

    /// Takes a final checkpoint (unless the consumer stopped with an
    /// error), then closes the Kafka client and the state, waiting at most
    /// `timeout`: closing a consumer can block for seconds.
    ///
    /// # Errors
    /// A failed checkpoint; [`Error::Stopped`] when closing takes longer
    /// than `timeout` (the client then goes on closing in the background).
    pub async fn close(self, timeout: Duration) -> Result<()> {
        let checkpointed = if self.core.lock().failed() {
            Ok(())
        } else {
            self.checkpoint().await
        };
        let GuardedConsumer {
            consumer,
            core,
            _watchdog,
            closer,
            ..
        } = self;
        // The closer's references become the last ones.
        drop((_watchdog, consumer, core));
        let closed = super::close_bounded(closer.take(), timeout).await;
        checkpointed.and(closed)
    }

    /// Stops at once, as `kill -9` would: no checkpoint, no commit, and
    /// identities not yet written to the store are lost. For demonstrations
    /// and tests of recovery.
    #[cfg(feature = "baselines")]
    pub fn abort(self) {
        self.core.abort();
        let GuardedConsumer {
            consumer,
            core,
            closer,
            ..
        } = self;
        drop((consumer, core));
        std::thread::spawn(closer.take());
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> ConsumerStats {
        let s = self.core.lock();
        ConsumerStats {
            records_in: s.counters.records_in,
            duplicates: s.counters.duplicates,
            delivered: s.counters.delivered,
            acked: s.counters.acked,
            acks_refused: s.counters.acks_refused,
            checkpoints: s.counters.checkpoints,
            guard: s.guard_stats(),
            lag: s.lag(),
        }
    }

    fn check_failure(&self) -> Result<()> {
        match self.core.failure() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
