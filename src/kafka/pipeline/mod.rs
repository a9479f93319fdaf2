//! The guarded pipeline: consumer, then a user function, then an idempotent
//! producer, with output reconciliation (G1).
//!
//! - `mod.rs`: the builder and the pipeline's handle;
//! - [`output`]: what the function returns, and the delivery reports;
//! - `hooks`: what the pipeline adds to the context's recovery and
//!   checkpoints (flushing, reconciling, a transaction);
//! - `run`: the read, process and write loop.

mod hooks;
pub(crate) mod output;
mod run;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{BaseProducer, Producer, ThreadedProducer};

use super::context::{Core, GuardContext};
use super::lease::{Lease, Watchdog};
use super::options::GuardOptions;
use super::reconcile::Reconciler;
use super::setup::{self, kafka};
use super::shared::Shared;
use crate::error::{Error, Result};
use crate::guard::Stats;
use crate::job::{Job, JobKind};
use hooks::PipelineHooks;
use output::DeliveryContext;

/// What the pipeline writes and how: the product (guarded) or one of the
/// baselines it is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Guarded,
    AtLeastOnce,
    Transactional,
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
    /// The engine's snapshot (none in the baselines). Inputs whose outputs
    /// were acked are recorded in batches, before the next poll's records
    /// are checked and at each checkpoint, so while the pipeline runs its
    /// counters may leave out the last few hundred.
    pub guard: Option<Stats>,
    /// Consumer lag of each assigned partition, (topic, partition) to the
    /// high watermark less the position, from librdkafka's statistics:
    /// empty unless `statistics.interval.ms` is set.
    pub lag: BTreeMap<(String, i32), i64>,
}

/// Builds a [`GuardedPipeline`].
#[must_use]
pub struct GuardedPipelineBuilder {
    consumer: ClientConfig,
    producer: Option<ClientConfig>,
    state: PathBuf,
    inputs: Vec<String>,
    output: Option<String>,
    options: GuardOptions,
    delivery_timeout: Duration,
    pub(crate) mode: Mode,
    pub(crate) reconcile: bool,
}

impl GuardedPipelineBuilder {
    /// Adds an input topic (at least one is required).
    pub fn input(mut self, topic: impl Into<String>) -> Self {
        self.inputs.push(topic.into());
        self
    }

    /// The output topic (required; not one of the inputs).
    pub fn output(mut self, topic: impl Into<String>) -> Self {
        self.output = Some(topic.into());
        self
    }

    /// How the pipeline guards: identity, checkpoints, retention, and the
    /// rest ([`GuardOptions`]). Default [`GuardOptions::default`].
    pub fn options(mut self, options: GuardOptions) -> Self {
        self.options = options;
        self
    }

    /// The producer's configuration. Default: the connection settings of the
    /// consumer configuration. `enable.idempotence=true` and `acks=all` are
    /// set; a configuration turning either off is refused at `build`.
    pub fn producer_config(mut self, cfg: ClientConfig) -> Self {
        self.producer = Some(cfg);
        self
    }

    /// How long an output may take to reach the broker: the producer's
    /// `message.timeout.ms`, unless the producer configuration sets it.
    /// Default 10 s. It bounds how long an instance that lost its
    /// partitions while frozen or cut off can still have outputs in flight,
    /// and so how long a new owner that got no clean handover waits before
    /// it reconciles (this, plus the producer's `request.timeout.ms`, at
    /// most 5 s unless set, plus 1 s). An output not acked within it stops
    /// the pipeline with [`Error::Delivery`]. Between 100 ms and 1 h, and so
    /// must a `message.timeout.ms` the producer configuration sets
    /// (librdkafka takes 0 as no bound): `build` refuses others.
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = d;
        self
    }

    /// Checks the configuration, opens the state, reaches the brokers and
    /// subscribes. The broker probes and the state's recovery block, so
    /// they run on tokio's blocking threads.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] (missing topics, an input that is also the output,
    /// idempotence turned off, options out of bounds),
    /// [`Error::Unreachable`], [`Error::UnknownTopic`], [`Error::Connect`],
    /// [`Error::JobMismatch`], the state folder's open errors, and
    /// [`Error::Kafka`].
    pub async fn build(self) -> Result<GuardedPipeline> {
        crate::kafka::setup::on_blocking_thread("building the pipeline", move || self.open()).await
    }

    /// The output topic, once the topics given make a pipeline.
    fn checked_output(&self) -> Result<String> {
        let output = self
            .output
            .clone()
            .ok_or_else(|| Error::Config("no output topic given".into()))?;
        if self.inputs.is_empty() {
            return Err(Error::Config("no input topic given".into()));
        }
        setup::check_named_once(&self.inputs, "inputs")?;
        if self.inputs.contains(&output) {
            return Err(Error::Config(format!(
                "topic {output:?} is both an input and the output: the pipeline would copy its own output into itself without end; write to another topic"
            )));
        }
        Ok(output)
    }

    /// Completes the producer's configuration for this mode.
    fn finish_producer_config(&self, cfg: &mut ClientConfig, instance: &str) {
        if self.mode == Mode::Transactional {
            cfg.set("transactional.id", format!("{instance}-tx"));
        }
        cfg.set("linger.ms", cfg.get("linger.ms").unwrap_or("5").to_owned());
    }

    fn open(self) -> Result<GuardedPipeline> {
        let output = self.checked_output()?;
        let o = &self.options;
        o.validate()?;
        // First, so that an endpoint serving already shows every series,
        // at zero, while the rest opens.
        let meters = Arc::new(super::telemetry::Meters::new(&o.metric_labels));
        let group = setup::group_id(&self.consumer)?;
        let mut producer_cfg = setup::idempotent_producer_config(
            &self
                .producer
                .clone()
                .unwrap_or_else(|| setup::connection_config(&self.consumer)),
        )?;
        let guarded = self.mode == Mode::Guarded;
        let unused = o.guard_only();
        if !guarded && !unused.is_empty() {
            return Err(Error::Config(format!(
                "{} {} for the guarded mode only: the baselines keep no identities and hold no lease",
                unused.join(", "),
                if unused.len() == 1 { "is" } else { "are" },
            )));
        }
        let fenced = guarded && !setup::fault("no-fencing");
        // How long an output can stay in flight (zero when unbounded).
        let in_flight = if fenced {
            setup::bound_delivery(&mut producer_cfg, self.delivery_timeout)?
        } else {
            Duration::ZERO
        };
        setup::check_client_config::<BaseProducer>(&producer_cfg, "output producer")?;
        setup::check_consumer_config(&self.consumer, o.stop_at_end, o.lease)?;
        let mut topics: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        topics.push(&output);
        setup::check_changelog_apart(o.changelog.as_deref(), &topics)?;
        let counts = setup::probe_topics(&self.consumer, &topics, o.connect_attempts)?;
        let out_partitions = counts.last().copied().unwrap_or(1);
        let guard = o.open(&self.state)?;
        let job = Job::new(JobKind::Pipeline, &group, &self.inputs, o.identity.label())
            .with_output(&output)
            .with_changelog(o.changelog.clone());
        // The changelog is checked before the folder is bound to it.
        let token = setup::instance_token(&self.state)?;
        let changelog = match self.mode {
            Mode::Guarded => super::changelog::Changelog::for_options(
                &self.consumer,
                o,
                counts[..counts.len().saturating_sub(1)]
                    .iter()
                    .copied()
                    .max()
                    .unwrap_or(1),
                &token,
                &meters,
            )?,
            _ => None,
        };
        crate::job::bind(&self.state, &job, o.rebind)?;
        let instance = setup::instance_id(&self.state, &group, &self.inputs)?;
        let consumer_cfg =
            setup::guarded_consumer_config(&self.consumer, &instance, o.stop_at_end)?;
        self.finish_producer_config(&mut producer_cfg, &instance);
        let lease = o
            .lease
            .unwrap_or_else(|| setup::lease_length(&consumer_cfg));
        let reconciler = match self.mode {
            Mode::Guarded if self.reconcile => Some(Reconciler::new(
                &setup::connection_config(&self.consumer),
                &group,
                &output,
                out_partitions,
                &self.inputs,
                o.timeout,
            )?),
            _ => None,
        };
        let mut shared = Shared::new(guarded.then_some(guard), meters.clone());
        shared.sink = Some(crate::kafka::shared::resumed_sink(
            shared.guard_ref(),
            &output,
            &token,
            in_flight,
        ));
        let shared = Arc::new(Mutex::new(shared));
        let brokers = setup::brokers(&self.consumer);
        let producer = Arc::new(start_producer(
            &producer_cfg,
            DeliveryContext {
                shared: shared.clone(),
                brokers: brokers.clone(),
                trouble: std::sync::Mutex::default(),
            },
            self.mode == Mode::Transactional,
            o.timeout,
        )?);
        let core = Arc::new(Core {
            shared,
            hooks: Box::new(PipelineHooks {
                producer: producer.clone(),
                reconciler,
                transactional: self.mode == Mode::Transactional,
                timeout: o.timeout,
            }),
            timeout: o.timeout,
            brokers,
            instance: token,
            fenced,
            lease: Lease::new(lease, fenced),
            changelog,
            metadata_taken: Default::default(),
            start_at_end: setup::starts_at_end(&consumer_cfg),
            meters,
            group: group.clone(),
            static_member: setup::is_static_member(&consumer_cfg),
            watch: Default::default(),
        });
        let consumer: Arc<StreamConsumer<GuardContext>> = Arc::new(
            consumer_cfg
                .create_with_context(GuardContext::new(core.clone(), &consumer_cfg))
                .map_err(kafka("creating the consumer"))?,
        );
        let inputs: Vec<&str> = self.inputs.iter().map(String::as_str).collect();
        consumer.subscribe(&inputs).map_err(kafka("subscribing"))?;
        let watchdog = core.lease.watch();
        tracing::info!(inputs = ?self.inputs, %output, mode = ?self.mode, state = %self.state.display(), "pipeline started");
        let closer = super::Closer::watching(&core, &consumer, producer.clone(), o.timeout);
        Ok(GuardedPipeline {
            consumer,
            _watchdog: watchdog,
            producer,
            core,
            identity: self.options.identity.clone(),
            output,
            out_partitions: out_partitions as i32,
            interval: self.options.checkpoint_interval,
            stop_at_end: self.options.stop_at_end,
            timeout: self.options.timeout,
            closer,
        })
    }
}

/// Creates the output producer; a transactional one has its first
/// transaction begun.
fn start_producer(
    cfg: &ClientConfig,
    context: DeliveryContext,
    transactional: bool,
    timeout: Duration,
) -> Result<ThreadedProducer<DeliveryContext>> {
    let producer: ThreadedProducer<DeliveryContext> = cfg
        .create_with_context(context)
        .map_err(kafka("creating the producer"))?;
    if transactional {
        producer
            .init_transactions(timeout)
            .map_err(kafka("initialising transactions"))?;
        producer
            .begin_transaction()
            .map_err(kafka("beginning a transaction"))?;
    }
    Ok(producer)
}

/// Reads a pipeline's counters from another task; see
/// [`GuardedPipeline::stats_handle`]. It may outlive the pipeline: it holds
/// only the counters, so the pipeline's close (or drop) closes the state
/// folder and the Kafka clients all the same, and the handle then reads
/// the last counters.
#[derive(Clone)]
pub struct StatsHandle {
    shared: Arc<std::sync::Mutex<super::shared::Shared>>,
}

impl StatsHandle {
    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> PipelineStats {
        let s = super::shared::lock(&self.shared);
        PipelineStats {
            records_in: s.counters.records_in,
            duplicates: s.counters.duplicates,
            outputs: s.counters.outputs,
            checkpoints: s.counters.checkpoints,
            guard: s.guard_stats(),
            lag: s.lag(),
        }
    }
}

/// Consumer, then a user function, then an idempotent producer: the outputs
/// of every input appear exactly once (G1), visible as soon as acked.
///
/// Every output carries the headers [`super::FINGERPRINT_HEADER`] and
/// [`super::SOURCE_HEADER`], which recovery reads back to close the window
/// between an output's ack and its input's identity reaching disk.
///
/// The consumer and producer are not handed out: a seek, a commit or a
/// write of one's own would move positions behind the guard's back.
///
/// Close it with [`GuardedPipeline::close`]. One dropped without it (on an
/// error's way out, say) closes its clients on a thread of its own,
/// waiting at most the options' timeout ([`GuardOptions::timeout`]);
/// whatever was not checkpointed is recovered by the next run.
pub struct GuardedPipeline {
    consumer: Arc<StreamConsumer<GuardContext>>,
    /// Watches for stalls while the pipeline lives.
    _watchdog: Option<Watchdog>,
    producer: Arc<ThreadedProducer<DeliveryContext>>,
    core: Arc<Core>,
    identity: crate::Identity,
    output: String,
    out_partitions: i32,
    interval: Duration,
    stop_at_end: bool,
    timeout: Duration,
    /// Holds the last references to `consumer`, `producer` and `core`, and
    /// closes them bounded when the pipeline is dropped without
    /// [`Self::close`]. Last, so that the fields above are dropped before
    /// it.
    closer: super::Closer,
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
            options: GuardOptions::default(),
            delivery_timeout: Duration::from_secs(10),
            mode: Mode::Guarded,
            reconcile: true,
        }
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
            shared: self.core.shared.clone(),
        }
    }

    /// The partitions assigned to this instance now, as its rebalance
    /// callback applied them (read without asking librdkafka, whose own
    /// answer waits for the group with no bound).
    #[must_use]
    pub fn assignment(&self) -> Vec<(String, i32)> {
        self.core.assigned()
    }

    /// Closes the Kafka clients and the state, waiting at most `timeout`:
    /// closing a consumer can block for seconds. Run the pipeline to its
    /// end first ([`GuardedPipeline::run_until`] takes a final checkpoint);
    /// whatever was not checkpointed is recovered by the next run, as after
    /// a crash.
    ///
    /// # Errors
    /// [`Error::Stopped`] when closing takes longer than `timeout`; the
    /// clients then go on closing in the background.
    pub async fn close(self, timeout: Duration) -> Result<()> {
        let GuardedPipeline {
            consumer,
            producer,
            core,
            _watchdog,
            closer,
            ..
        } = self;
        // The closer's references become the last ones.
        drop((_watchdog, consumer, producer, core));
        super::close_bounded(closer.take(), timeout).await
    }

    /// Stops at once, as `kill -9` would: no flush, no checkpoint, no
    /// commit, and identities not yet written to the store are lost. Outputs
    /// already handed to the producer may or may not reach the broker. For
    /// demonstrations and tests of recovery; a restart over the same state
    /// folder recovers from the last durable state and the output.
    #[cfg(feature = "baselines")]
    pub fn abort(self) {
        self.core.abort();
        let GuardedPipeline {
            consumer,
            producer,
            core,
            closer,
            ..
        } = self;
        drop((consumer, producer, core));
        // Dropping a consumer can block for seconds; do it off the caller.
        std::thread::spawn(closer.take());
    }
}
