//! The guarded consumer: wraps a `StreamConsumer` and yields each record
//! once within the retention (G2).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use rdkafka::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Message, OwnedMessage};

use super::context::{Core, GuardContext, Shared};
use super::lease::{Lease, Watchdog};
use super::pipeline::{Mode, PipelineStats};
use super::setup::{self, kafka};
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, Identity};
use crate::guard::Guard;
use crate::job::{Job, JobKind};
use crate::store::Durability;

/// A fresh record, to be acked with [`GuardedConsumer::ack`] once handled.
#[derive(Debug)]
pub struct GuardedRecord {
    message: OwnedMessage,
    fingerprint: Option<Fingerprint>,
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

/// Builds a [`GuardedConsumer`].
#[must_use]
pub struct GuardedConsumerBuilder {
    config: ClientConfig,
    state: PathBuf,
    topics: Vec<String>,
    identity: Identity,
    checkpoint_interval: Duration,
    retention_epochs: u32,
    retention_time: Option<Duration>,
    durability: Durability,
    stop_at_end: bool,
    connect_attempts: u32,
    timeout: Duration,
    lease: Option<Duration>,
    rebind: bool,
}

impl GuardedConsumerBuilder {
    /// Adds a topic to subscribe to (at least one is required).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topics.push(topic.into());
        self
    }

    /// The identity of a record. Default [`Identity::Content`], which also
    /// catches upstream resends at new offsets.
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = identity;
        self
    }

    /// Time between automatic checkpoints. Default 1 s; 10 ms to 1 h.
    pub fn checkpoint_interval(mut self, d: Duration) -> Self {
        self.checkpoint_interval = d;
        self
    }

    /// Completed epochs kept besides the open one. Default 0. Upstream
    /// resends are caught only within the retention.
    pub fn retention_epochs(mut self, n: u32) -> Self {
        self.retention_epochs = n;
        self
    }

    /// Also keep epochs closed less than this long ago. Default none.
    pub fn retention_time(mut self, d: Option<Duration>) -> Self {
        self.retention_time = d;
        self
    }

    /// Durability of chunk writes. Default [`Durability::Process`].
    pub fn durability(mut self, d: Durability) -> Self {
        self.durability = d;
        self
    }

    /// [`GuardedConsumer::recv`] returns `None` once every assigned
    /// partition is read to its high watermark. Default false.
    pub fn stop_at_end(mut self, yes: bool) -> Self {
        self.stop_at_end = yes;
        self
    }

    /// The longest stall (the process frozen or starved) after which this
    /// consumer still delivers records; after a longer one it stops, since
    /// the group coordinator may have expired it. Default: the session
    /// timeout less the heartbeat interval less a tenth (at least 1 s), 4 s
    /// with the adapters' defaults; 5 s under `group.protocol=consumer`. It
    /// must stay below the time the coordinator takes to expire a silent
    /// member.
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = Some(d);
        self
    }

    /// Re-bind the state folder to this consumer even when it belongs to
    /// another job (another group or identity, or no topic in common),
    /// instead of refusing it with [`Error::JobMismatch`]. Default false.
    /// Only for a folder moved to another job on purpose.
    pub fn rebind(mut self, yes: bool) -> Self {
        self.rebind = yes;
        self
    }

    /// Attempts to reach the brokers at build. Default 10.
    pub fn connect_attempts(mut self, n: u32) -> Self {
        self.connect_attempts = n;
        self
    }

    /// Opens the state, reaches the brokers and subscribes.
    ///
    /// # Errors
    ///
    /// [`Error::Config`], [`Error::Unreachable`], [`Error::UnknownTopic`],
    /// the state folder's open errors, and [`Error::Kafka`].
    pub fn build(self) -> Result<GuardedConsumer> {
        if self.topics.is_empty() {
            return Err(Error::Config("no topic given".into()));
        }
        setup::check_interval(self.checkpoint_interval)?;
        let group = setup::group_id(&self.config)?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        setup::probe_topics(&self.config, &topics, self.connect_attempts)?;
        let guard = Guard::builder(&self.state)
            .durability(self.durability)
            .retention_epochs(self.retention_epochs)
            .retention_time(self.retention_time)
            .open()?;
        let job = Job::new(
            JobKind::Consumer,
            &group,
            &self.topics,
            self.identity.label(),
        );
        crate::job::bind(&self.state, &job, self.rebind)?;
        let instance = setup::instance_id(&self.state, &group, &self.topics)?;
        let cfg = setup::guarded_consumer_config(&self.config, &instance)?;
        let fenced = !setup::fault("no-fencing");
        let lease = self.lease.unwrap_or_else(|| setup::lease_length(&cfg));
        let core = Arc::new(Core {
            shared: Shared::new(Some(guard)),
            producer: None,
            reconciler: None,
            mode: Mode::Guarded,
            flush_timeout: self.timeout,
            instance: setup::instance_token(&self.state)?,
            fenced,
            lease: Lease::new(lease, fenced),
        });
        let consumer: Arc<StreamConsumer<GuardContext>> = Arc::new(
            cfg.create_with_context(GuardContext { core: core.clone() })
                .map_err(kafka("creating the consumer"))?,
        );
        consumer.subscribe(&topics).map_err(kafka("subscribing"))?;
        let watchdog = core.lease.watch();
        Ok(GuardedConsumer {
            consumer,
            _watchdog: watchdog,
            core,
            identity: self.identity,
            interval: self.checkpoint_interval,
            last_checkpoint: Mutex::new(Instant::now()),
            stop_at_end: self.stop_at_end,
            timeout: self.timeout,
            transient: Mutex::default(),
        })
    }
}

/// A guarded wrapper around a `StreamConsumer`.
///
/// It turns off auto-commit (`enable.auto.commit=false`): positions are
/// written to its manifest at each checkpoint and then committed to the
/// group as advice. A record is filtered only when its identity was acked
/// within the retention; an unacked record is delivered again after a
/// restart.
pub struct GuardedConsumer {
    consumer: Arc<StreamConsumer<GuardContext>>,
    /// Watches for stalls while the consumer lives.
    _watchdog: Option<Watchdog>,
    core: Arc<Core>,
    identity: Identity,
    interval: Duration,
    last_checkpoint: Mutex<Instant>,
    stop_at_end: bool,
    timeout: Duration,
    transient: Mutex<super::trouble::TransientLog>,
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
            identity: Identity::Content,
            checkpoint_interval: Duration::from_secs(1),
            retention_epochs: 0,
            retention_time: None,
            durability: Durability::Process,
            stop_at_end: false,
            connect_attempts: 10,
            timeout: Duration::from_secs(30),
            lease: None,
            rebind: false,
        }
    }

    /// The wrapped consumer.
    pub fn consumer(&self) -> &StreamConsumer<GuardContext> {
        &self.consumer
    }

    /// The next fresh record; `None` at the end of the input with
    /// `stop_at_end`. Duplicates are skipped and counted. Checkpoints run
    /// here when the interval has passed.
    ///
    /// # Errors
    ///
    /// A failed recovery, checkpoint or store write.
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
            let msg = match tokio::time::timeout(due, self.consumer.recv()).await {
                Err(_) => continue,
                Ok(m) => m,
            };
            self.check_failure()?;
            let m = match msg {
                Ok(m) => m,
                Err(KafkaError::PartitionEOF(p)) => {
                    if self.stop_at_end && self.core.at_end(&*self.consumer, p, self.timeout)? {
                        return Ok(None);
                    }
                    continue;
                }
                Err(e) if super::trouble::heals(&e) => {
                    if let Ok(mut log) = self.transient.lock() {
                        log.note(&e);
                    }
                    continue;
                }
                Err(e) => {
                    let e = self.core.consume_failure(&*self.consumer, e);
                    self.core.lock().fail(e.to_string());
                    return Err(e);
                }
            };
            let (topic, partition, offset) = (m.topic(), m.partition(), m.offset());
            let fp = super::identify(&self.identity, &m);
            let mut s = self.core.lock();
            if !s.admit(topic, partition, offset, fp)? {
                continue;
            }
            s.begin(topic, partition, offset, fp, 1);
            drop(s);
            // Not delivered once this consumer may have lost its partitions;
            // the record stays unacked, so its next owner delivers it.
            self.core.check_lease(&*self.consumer)?;
            return Ok(Some(GuardedRecord {
                message: m.detach(),
                fingerprint: fp,
            }));
        }
    }

    /// Marks a record handled. Its identity is recorded in the open epoch
    /// and written to the store at once (handed to the operating system, or
    /// fsynced with [`Durability::Sync`]), so a crash after `ack` returns
    /// does not deliver it again. The position may move past it at the next
    /// checkpoint.
    ///
    /// # Errors
    ///
    /// A store write failure (which poisons the guard).
    pub fn ack(&self, r: &GuardedRecord) -> Result<()> {
        self.ack_many(std::slice::from_ref(r))
    }

    /// Marks several records handled with one store write.
    ///
    /// # Errors
    ///
    /// A store write failure (which poisons the guard).
    pub fn ack_many(&self, records: &[GuardedRecord]) -> Result<()> {
        let mut s = self.core.lock();
        for r in records {
            s.complete(r.message.topic(), r.message.partition(), r.message.offset())?;
        }
        match s.guard.as_mut() {
            Some(g) => g.flush(),
            None => Ok(()),
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
        let tpl = self.core.lock().checkpoint(None, false)?;
        self.core.commit(&*self.consumer, &tpl, CommitMode::Async)?;
        if let Ok(mut t) = self.last_checkpoint.lock() {
            *t = Instant::now();
        }
        metrics::counter!("replayguard_checkpoints_total").increment(1);
        metrics::histogram!("replayguard_checkpoint_seconds")
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

    /// Stops at once, as `kill -9` would: no checkpoint, no commit, and
    /// identities not yet written to the store are lost. For demonstrations
    /// and tests of recovery.
    pub fn abort(self) {
        self.core.abort();
        let GuardedConsumer { consumer, core, .. } = self;
        std::thread::spawn(move || {
            drop(consumer);
            drop(core);
        });
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> PipelineStats {
        let s = self.core.lock();
        PipelineStats {
            records_in: s.counters.records_in,
            duplicates: s.counters.duplicates,
            outputs: 0,
            checkpoints: s.counters.checkpoints,
            guard: s.guard.as_ref().map(Guard::stats),
        }
    }

    fn check_failure(&self) -> Result<()> {
        match self.core.failure() {
            Some(f) => Err(Error::Stopped(format!("consumer stopped: {f}"))),
            None => Ok(()),
        }
    }
}
