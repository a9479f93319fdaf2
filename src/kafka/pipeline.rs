//! The guarded pipeline: consumer, then a user function, then an idempotent
//! producer, with output reconciliation (G1).

use std::fmt::Display;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};

use super::context::{Core, GuardContext, Shared, SinkPositions};
use super::headers::{FINGERPRINT_HEADER, SOURCE_HEADER, SourcePosition};
use super::lease::{Lease, Watchdog};
use super::reconcile::Reconciler;
use super::setup::{self, kafka};
use crate::error::{Error, Result};
use crate::fingerprint::Identity;
use crate::guard::{Guard, Stats};
use crate::job::{Job, JobKind};
use crate::store::Durability;

/// How the pipeline makes its output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// replayguard: idempotent producer, replays filtered, output visible at
    /// once. Exactly once.
    #[default]
    Guarded,
    /// A plain copy: idempotent producer, offsets committed at each
    /// checkpoint, no guard. Duplicates after a crash (the baseline).
    AtLeastOnce,
    /// Kafka transactions committed at every checkpoint: exactly once, but
    /// output is hidden from `read_committed` readers until the commit.
    Transactional,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "guarded" => Ok(Mode::Guarded),
            "at-least-once" => Ok(Mode::AtLeastOnce),
            "transactional" => Ok(Mode::Transactional),
            other => Err(Error::Config(format!(
                "unknown mode {other:?}: use guarded, at-least-once or transactional"
            ))),
        }
    }
}

/// One record the user function wants written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputRecord {
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Value.
    pub value: Option<Vec<u8>>,
    /// Headers (the guard adds its own two).
    pub headers: Vec<(String, Vec<u8>)>,
    /// Output partition; `None` picks the input's partition when the output
    /// has enough partitions, else the key's.
    pub partition: Option<i32>,
}

impl OutputRecord {
    /// An output with a value only.
    #[must_use]
    pub fn value(value: impl Into<Vec<u8>>) -> Self {
        OutputRecord {
            value: Some(value.into()),
            ..Self::default()
        }
    }

    /// A copy of an input record: key, value and headers.
    #[must_use]
    pub fn copy_of(m: &impl Message) -> Self {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .filter(|h| {
                        ![
                            FINGERPRINT_HEADER,
                            SOURCE_HEADER,
                            super::headers::PART_HEADER,
                        ]
                        .contains(&h.key)
                    })
                    .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        OutputRecord {
            key: m.key().map(<[u8]>::to_vec),
            value: m.payload().map(<[u8]>::to_vec),
            headers,
            partition: None,
        }
    }
}

/// Counters of a pipeline run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PipelineStats {
    /// Input records received.
    pub records_in: u64,
    /// Inputs filtered as already handled.
    pub duplicates: u64,
    /// Outputs acked by the broker.
    pub outputs: u64,
    /// Checkpoints completed.
    pub checkpoints: u64,
    /// The engine's snapshot (guarded mode).
    pub guard: Option<Stats>,
}

/// Which input an output belongs to, carried through the producer.
pub struct Ticket {
    topic: Arc<str>,
    partition: i32,
    offset: i64,
}

/// The producer context: delivery reports record inputs as handled.
pub struct DeliveryContext {
    shared: Arc<Mutex<Shared>>,
}

impl ClientContext for DeliveryContext {
    /// As the consumer's: a connection that cannot work stops the guard.
    fn error(&self, error: KafkaError, reason: &str) {
        if super::trouble::global_is_fatal(&error) {
            let hint = super::trouble::hint(&error);
            self.shared
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .fail(format!(
                    "the producer's connection failed: {reason}; {hint}"
                ));
        } else {
            tracing::debug!(error = %error, reason, "kafka client error; librdkafka retries it");
        }
    }
}

impl ProducerContext for DeliveryContext {
    type DeliveryOpaque = Box<Ticket>;

    fn delivery(&self, result: &DeliveryResult<'_>, t: Box<Ticket>) {
        let mut s = self
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match result {
            Ok(_) if super::setup::fault("after-ack") => {
                // As if the process died after the broker acked the output
                // and before the input's identity was recorded.
                s.fail(format!(
                    "injected crash after the ack of {}[{}]@{}",
                    t.topic, t.partition, t.offset
                ));
            }
            Ok(m) => {
                s.counters.outputs += 1;
                metrics::counter!("replayguard_outputs_total").increment(1);
                if let Some(sink) = s.sink.as_mut() {
                    let end = sink.ends.entry(m.partition()).or_insert(0);
                    *end = (*end).max(m.offset() + 1);
                }
                if let Err(e) = s.complete(&t.topic, t.partition, t.offset) {
                    s.fail(format!(
                        "recording {}[{}]@{} failed: {e}",
                        t.topic, t.partition, t.offset
                    ));
                }
            }
            Err((e, _)) => {
                s.fail(format!(
                    "output of {}[{}]@{} was not delivered: {e}",
                    t.topic, t.partition, t.offset
                ));
            }
        }
    }
}

/// Builds a [`GuardedPipeline`].
#[must_use]
pub struct GuardedPipelineBuilder {
    consumer: ClientConfig,
    producer: Option<ClientConfig>,
    state: PathBuf,
    inputs: Vec<String>,
    output: Option<String>,
    identity: Identity,
    mode: Mode,
    checkpoint_interval: Duration,
    retention_epochs: u32,
    retention_time: Option<Duration>,
    durability: Durability,
    stop_at_end: bool,
    connect_attempts: u32,
    flush_timeout: Duration,
    reconcile: bool,
    delivery_timeout: Duration,
    lease: Option<Duration>,
    rebind: bool,
}

impl GuardedPipelineBuilder {
    /// Read the output back on recovery (guarded mode). Default true.
    /// Turning it off reopens the window between an output's ack and its
    /// input's identity reaching disk, so a crash there duplicates the
    /// output: it exists to measure and demonstrate that window.
    pub fn reconcile_output(mut self, yes: bool) -> Self {
        self.reconcile = yes;
        self
    }

    /// Adds an input topic (at least one is required).
    pub fn input(mut self, topic: impl Into<String>) -> Self {
        self.inputs.push(topic.into());
        self
    }

    /// The output topic (required).
    pub fn output(mut self, topic: impl Into<String>) -> Self {
        self.output = Some(topic.into());
        self
    }

    /// The producer's configuration. Default: the connection settings of the
    /// consumer configuration. `enable.idempotence=true` and `acks=all` are
    /// set; a configuration turning either off is refused at `build`.
    pub fn producer_config(mut self, cfg: ClientConfig) -> Self {
        self.producer = Some(cfg);
        self
    }

    /// The identity of an input record. Default [`Identity::Content`].
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = identity;
        self
    }

    /// Guarded (default), at-least-once or transactional.
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Time between checkpoints. Default 1 s; bounds 10 ms to 1 h.
    pub fn checkpoint_interval(mut self, d: Duration) -> Self {
        self.checkpoint_interval = d;
        self
    }

    /// Completed epochs kept besides the open one. Default 0.
    pub fn retention_epochs(mut self, n: u32) -> Self {
        self.retention_epochs = n;
        self
    }

    /// Also keep epochs closed less than this long ago. Default none.
    pub fn retention_time(mut self, d: Option<Duration>) -> Self {
        self.retention_time = d;
        self
    }

    /// Durability of the engine's chunk writes. Default
    /// [`Durability::Process`].
    pub fn durability(mut self, d: Durability) -> Self {
        self.durability = d;
        self
    }

    /// Stop once every assigned input partition is consumed to its high
    /// watermark, after a final checkpoint. Default false.
    pub fn stop_at_end(mut self, yes: bool) -> Self {
        self.stop_at_end = yes;
        self
    }

    /// How long an output may take to reach the broker: the producer's
    /// `message.timeout.ms`, unless the producer configuration sets it.
    /// Default 10 s. It bounds how long an instance that lost its
    /// partitions while frozen or cut off can still have outputs in flight,
    /// and so how long a new owner that got no clean handover waits before
    /// it reconciles (this, plus the producer's `request.timeout.ms`,
    /// at most 5 s unless set, plus 1 s). An output not acked within it
    /// stops the pipeline with an error.
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = d;
        self
    }

    /// The longest stall (the process frozen or starved) after which this
    /// instance still hands outputs to the producer; after a longer one it
    /// stops, since the group coordinator may have expired it. Default: the
    /// session timeout less the heartbeat interval less a tenth (at least
    /// 1 s), 4 s with the adapters' defaults; 5 s under
    /// `group.protocol=consumer`, whose session timeout is the broker's. It
    /// must stay below the time the coordinator takes to expire a silent
    /// member.
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = Some(d);
        self
    }

    /// Re-bind the state folder to this pipeline even when it belongs to
    /// another job (another group, output, identity, or no input in
    /// common), instead of refusing it with [`Error::JobMismatch`]. Default
    /// false. Only for a folder moved to another job on purpose: its
    /// positions and identities are then taken as this job's.
    pub fn rebind(mut self, yes: bool) -> Self {
        self.rebind = yes;
        self
    }

    /// Attempts to reach the brokers at build before giving up. Default 10.
    pub fn connect_attempts(mut self, n: u32) -> Self {
        self.connect_attempts = n;
        self
    }

    /// How long to wait for outputs to be acked at a checkpoint, and for
    /// broker calls. Default 30 s.
    pub fn flush_timeout(mut self, d: Duration) -> Self {
        self.flush_timeout = d;
        self
    }

    /// Checks the configuration, opens the state, reaches the brokers and
    /// subscribes.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] (missing topics, idempotence turned off, bad
    /// bounds), [`Error::Unreachable`], [`Error::UnknownTopic`], the state
    /// folder's open errors, and [`Error::Kafka`].
    pub fn build(self) -> Result<GuardedPipeline> {
        let output = self
            .output
            .clone()
            .ok_or_else(|| Error::Config("no output topic given".into()))?;
        if self.inputs.is_empty() {
            return Err(Error::Config("no input topic given".into()));
        }
        if self.inputs.contains(&output) {
            return Err(Error::Config(format!(
                "topic {output:?} is both an input and the output: the pipeline would copy its own output into itself without end; write to another topic"
            )));
        }
        setup::check_interval(self.checkpoint_interval)?;
        let group = setup::group_id(&self.consumer)?;
        let mut producer_cfg = setup::idempotent_producer_config(
            &self
                .producer
                .clone()
                .unwrap_or_else(|| setup::connection_config(&self.consumer)),
        )?;
        let mut topics: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        topics.push(&output);
        let counts = setup::probe_topics(&self.consumer, &topics, self.connect_attempts)?;
        let out_partitions = counts.last().copied().unwrap_or(1);
        let guard = Guard::builder(&self.state)
            .durability(self.durability)
            .retention_epochs(self.retention_epochs)
            .retention_time(self.retention_time)
            .open()?;
        let job = Job::new(
            JobKind::Pipeline,
            &group,
            &self.inputs,
            self.identity.label(),
        )
        .with_output(&output);
        crate::job::bind(&self.state, &job, self.rebind)?;
        let instance = setup::instance_id(&self.state, &group, &self.inputs)?;
        let token = setup::instance_token(&self.state)?;
        let consumer_cfg = setup::guarded_consumer_config(&self.consumer, &instance)?;
        let fenced = self.mode == Mode::Guarded && !setup::fault("no-fencing");
        let in_flight = if fenced {
            setup::bound_delivery(&mut producer_cfg, self.delivery_timeout)
        } else {
            Duration::ZERO
        };
        let lease = self
            .lease
            .unwrap_or_else(|| setup::lease_length(&consumer_cfg));
        if self.mode == Mode::Transactional {
            producer_cfg.set("transactional.id", format!("{instance}-tx"));
        }
        producer_cfg.set(
            "linger.ms",
            producer_cfg.get("linger.ms").unwrap_or("5").to_owned(),
        );
        let reconciler = match self.mode {
            Mode::Guarded if self.reconcile => Some(Reconciler::new(
                &setup::connection_config(&self.consumer),
                &group,
                &output,
                out_partitions,
                self.flush_timeout,
            )?),
            _ => None,
        };
        let shared = Shared::new((self.mode == Mode::Guarded).then_some(guard));
        if let Ok(mut s) = shared.lock() {
            // Sink positions carry on from the last manifest; reconciliation
            // advances them once it has read the output.
            let ends = s
                .guard
                .as_ref()
                .and_then(|g| g.manifest())
                .and_then(|m| serde_json::from_slice::<SinkPositions>(&m.sink).ok())
                .filter(|sink| sink.topic == output)
                .map(|sink| sink.ends)
                .unwrap_or_default();
            s.sink = Some(SinkPositions {
                topic: output.clone(),
                ends,
                instance: token.clone(),
                clean: false,
                in_flight_ms: in_flight.as_millis() as u64,
            });
        }
        let producer: ThreadedProducer<DeliveryContext> = producer_cfg
            .create_with_context(DeliveryContext {
                shared: shared.clone(),
            })
            .map_err(kafka("creating the producer"))?;
        let producer = Arc::new(producer);
        if self.mode == Mode::Transactional {
            producer
                .init_transactions(self.flush_timeout)
                .map_err(kafka("initialising transactions"))?;
            producer
                .begin_transaction()
                .map_err(kafka("beginning a transaction"))?;
        }
        let core = Arc::new(Core {
            shared,
            producer: Some(producer.clone()),
            reconciler,
            mode: self.mode,
            flush_timeout: self.flush_timeout,
            instance: token,
            fenced,
            lease: Lease::new(lease, fenced),
        });
        let consumer: Arc<StreamConsumer<GuardContext>> = Arc::new(
            consumer_cfg
                .create_with_context(GuardContext { core: core.clone() })
                .map_err(kafka("creating the consumer"))?,
        );
        let inputs: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        consumer.subscribe(&inputs).map_err(kafka("subscribing"))?;
        let watchdog = core.lease.watch();
        tracing::info!(inputs = ?self.inputs, %output, mode = ?self.mode, state = %self.state.display(), "pipeline started");
        Ok(GuardedPipeline {
            consumer,
            _watchdog: watchdog,
            producer,
            core,
            identity: self.identity,
            output,
            out_partitions: out_partitions as i32,
            interval: self.checkpoint_interval,
            stop_at_end: self.stop_at_end,
            flush_timeout: self.flush_timeout,
        })
    }
}

/// Reads a pipeline's counters from another task; see
/// [`GuardedPipeline::stats_handle`]. While it lives it keeps the
/// pipeline's state open (and its folder locked), so drop it with the
/// pipeline.
#[derive(Clone)]
pub struct StatsHandle {
    core: Arc<Core>,
}

impl StatsHandle {
    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> PipelineStats {
        let s = self.core.lock();
        PipelineStats {
            records_in: s.counters.records_in,
            duplicates: s.counters.duplicates,
            outputs: s.counters.outputs,
            checkpoints: s.counters.checkpoints,
            guard: s.guard.as_ref().map(Guard::stats),
        }
    }
}

/// Consumer, then a user function, then an idempotent producer: the outputs
/// of every input appear exactly once (G1), visible as soon as acked.
///
/// Every output carries the headers [`FINGERPRINT_HEADER`] and
/// [`SOURCE_HEADER`], which recovery reads back to close the window between
/// an output's ack and its input's identity reaching disk.
pub struct GuardedPipeline {
    consumer: Arc<StreamConsumer<GuardContext>>,
    /// Watches for stalls while the pipeline lives.
    _watchdog: Option<Watchdog>,
    producer: Arc<ThreadedProducer<DeliveryContext>>,
    core: Arc<Core>,
    identity: Identity,
    output: String,
    out_partitions: i32,
    interval: Duration,
    stop_at_end: bool,
    flush_timeout: Duration,
}

impl GuardedPipeline {
    /// Starts building a pipeline from the user's consumer configuration
    /// (which must name `group.id` and `bootstrap.servers`) and a state
    /// folder of its own.
    pub fn builder(consumer: ClientConfig, state: impl AsRef<Path>) -> GuardedPipelineBuilder {
        GuardedPipelineBuilder {
            consumer,
            producer: None,
            state: state.as_ref().to_owned(),
            inputs: Vec::new(),
            output: None,
            identity: Identity::Content,
            mode: Mode::Guarded,
            checkpoint_interval: Duration::from_secs(1),
            retention_epochs: 0,
            retention_time: None,
            durability: Durability::Process,
            stop_at_end: false,
            connect_attempts: 10,
            flush_timeout: Duration::from_secs(30),
            reconcile: true,
            delivery_timeout: Duration::from_secs(10),
            lease: None,
            rebind: false,
        }
    }

    /// The wrapped consumer.
    pub fn consumer(&self) -> &StreamConsumer<GuardContext> {
        &self.consumer
    }

    /// Stops at once, as `kill -9` would: no flush, no checkpoint, no
    /// commit, and identities not yet written to the store are lost. Outputs
    /// already handed to the producer may or may not reach the broker. For
    /// demonstrations and tests of recovery; a restart over the same state
    /// folder recovers from the last durable state and the output.
    pub fn abort(self) {
        self.core.abort();
        let GuardedPipeline {
            consumer,
            producer,
            core,
            ..
        } = self;
        // Dropping a consumer can block for seconds; do it off the caller.
        std::thread::spawn(move || {
            drop(consumer);
            drop(producer);
            drop(core);
        });
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> PipelineStats {
        self.stats_handle().stats()
    }

    /// A handle that reads the counters while [`GuardedPipeline::run_until`]
    /// holds the pipeline, for example for a progress display.
    #[must_use]
    pub fn stats_handle(&self) -> StatsHandle {
        StatsHandle {
            core: self.core.clone(),
        }
    }

    /// Runs until an error, or until the end of the input with
    /// `stop_at_end`.
    ///
    /// # Errors
    ///
    /// See [`GuardedPipeline::run_until`].
    pub async fn run<F, Fut, E>(&mut self, f: F) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
    {
        self.run_until(f, std::future::pending()).await
    }

    /// Runs until `stop` completes, an error, or (with `stop_at_end`) the
    /// end of the input; then flushes, takes a final checkpoint and returns
    /// the counters.
    ///
    /// # Errors
    ///
    /// [`Error::Process`] when `f` fails (the input is not recorded, so it
    /// is processed again after a restart); a delivery failure, a store
    /// failure or a failed recovery as [`Error::Config`]/[`Error::Store`]/
    /// [`Error::Kafka`]. Positions never pass an input whose outputs were
    /// not all acked.
    pub async fn run_until<F, Fut, E, S>(&mut self, mut f: F, stop: S) -> Result<PipelineStats>
    where
        F: FnMut(OwnedMessage) -> Fut,
        Fut: Future<Output = std::result::Result<Vec<OutputRecord>, E>>,
        E: Display,
        S: Future<Output = ()>,
    {
        let mut stop = std::pin::pin!(stop);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let mut transient = super::trouble::TransientLog::default();
        loop {
            // Partitions waiting for a previous owner's outputs in flight
            // are recovered once the wait is over.
            let held = self.core.recover_held(&*self.consumer)?;
            let release = async move {
                match held {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let msg = tokio::select! {
                m = self.consumer.recv() => m,
                _ = tick.tick() => {
                    self.checkpoint(CommitMode::Async).await?;
                    continue;
                }
                () = release => continue,
                () = &mut stop => break,
            };
            self.check_failure()?;
            let m = match msg {
                Ok(m) => m,
                Err(KafkaError::PartitionEOF(p)) => {
                    if self.stop_at_end
                        && self.core.at_end(&*self.consumer, p, self.flush_timeout)?
                    {
                        break;
                    }
                    continue;
                }
                Err(e) if super::trouble::heals(&e) => {
                    transient.note(&e);
                    continue;
                }
                Err(e) => {
                    let e = self.core.consume_failure(&*self.consumer, e);
                    self.core.lock().fail(e.to_string());
                    return Err(e);
                }
            };
            let (topic, partition, offset) = (m.topic().to_owned(), m.partition(), m.offset());
            let fp = super::identify(&self.identity, &m);
            if !self.core.lock().admit(&topic, partition, offset, fp)? {
                continue;
            }
            let input = m.detach();
            let outputs = f(input).await.map_err(|e| Error::Process {
                topic: topic.clone(),
                partition,
                offset,
                message: e.to_string(),
            })?;
            self.dispatch(&topic, partition, offset, fp, outputs)
                .await?;
        }
        self.checkpoint(CommitMode::Sync).await?;
        Ok(self.stats())
    }

    async fn dispatch(
        &self,
        topic: &str,
        partition: i32,
        offset: i64,
        fp: Option<crate::Fingerprint>,
        outputs: Vec<OutputRecord>,
    ) -> Result<()> {
        let count = outputs.len() as u32;
        let mut outputs: Vec<(u32, OutputRecord)> = (0..count).zip(outputs).collect();
        {
            let mut s = self.core.lock();
            if !s.partial.is_empty()
                && let Some(written) = s.partial.remove(&(topic.to_owned(), partition, offset))
            {
                // The function must be deterministic for this to hold: the
                // same input gives the same outputs in the same order.
                outputs.retain(|(i, _)| !written.contains(i));
            }
            s.begin(topic, partition, offset, fp, outputs.len().max(1) as u32);
            if outputs.is_empty() {
                s.complete(topic, partition, offset)?;
                return Ok(());
            }
        }
        // Not a single output more once this instance may have lost its
        // partitions.
        self.core.check_lease(&*self.consumer)?;
        let src = SourcePosition {
            topic: topic.to_owned(),
            partition,
            offset,
        }
        .encode();
        let fp_bytes = fp.map(crate::Fingerprint::to_bytes);
        let topic: Arc<str> = Arc::from(topic);
        for (index, out) in outputs {
            let mut headers = OwnedHeaders::new_with_capacity(out.headers.len() + 3);
            let part = super::headers::encode_part(index, count);
            if count > 1 {
                headers = headers.insert(Header {
                    key: super::headers::PART_HEADER,
                    value: Some(&part[..]),
                });
            }
            for (k, v) in &out.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v),
                });
            }
            headers = headers.insert(Header {
                key: SOURCE_HEADER,
                value: Some(&src),
            });
            if let Some(b) = &fp_bytes {
                headers = headers.insert(Header {
                    key: FINGERPRINT_HEADER,
                    value: Some(&b[..]),
                });
            }
            let ticket = Box::new(Ticket {
                topic: topic.clone(),
                partition,
                offset,
            });
            let mut record: BaseRecord<'_, [u8], [u8], Box<Ticket>> =
                BaseRecord::with_opaque_to(&self.output, ticket).headers(headers);
            if let Some(k) = &out.key {
                record = record.key(&k[..]);
            }
            if let Some(v) = &out.value {
                record = record.payload(&v[..]);
            }
            match out.partition {
                Some(p) => record = record.partition(p),
                None if partition < self.out_partitions => record = record.partition(partition),
                None => {}
            }
            loop {
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                        record = r;
                        self.check_failure()?;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err((e, _)) => {
                        let msg = format!(
                            "producing the output of {topic}[{partition}]@{offset} failed: {e}"
                        );
                        self.core.lock().fail(msg.clone());
                        return Err(Error::Stopped(msg));
                    }
                }
            }
            if count > 1 && super::setup::fault("mid-outputs") {
                // As if the process died between two outputs of one input.
                let msg =
                    format!("injected crash between the outputs of {topic}[{partition}]@{offset}");
                self.core.lock().fail(msg.clone());
                return Err(Error::Stopped(msg));
            }
        }
        // A pause between the check above and the sends (a frozen process
        // thawed, say) shows here: the outputs just queued are purged
        // before librdkafka's linger lets them go.
        self.core.check_lease(&*self.consumer)
    }

    fn check_failure(&self) -> Result<()> {
        match self.core.failure() {
            Some(f) => Err(Error::Stopped(format!("pipeline stopped: {f}"))),
            None => Ok(()),
        }
    }

    /// Waits for every output to be acked, then writes a checkpoint and
    /// commits input offsets.
    async fn checkpoint(&self, mode: CommitMode) -> Result<()> {
        let started = std::time::Instant::now();
        let span = tracing::debug_span!("replayguard_checkpoint");
        let _e = span.enter();
        loop {
            self.check_failure()?;
            if self.core.lock().inflight() == 0 {
                break;
            }
            if started.elapsed() > self.flush_timeout {
                return Err(Error::Stopped(format!(
                    "outputs not acked within {:?}; is the broker up?",
                    self.flush_timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let tpl = self.core.lock().checkpoint(None, false)?;
        self.core.commit(&*self.consumer, &tpl, mode)?;
        metrics::counter!("replayguard_checkpoints_total").increment(1);
        metrics::histogram!("replayguard_checkpoint_seconds")
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }
}
