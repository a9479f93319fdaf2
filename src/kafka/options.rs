//! The guard's knobs, one type for both adapters (and the command line).

use std::path::Path;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::fingerprint::Identity;
use crate::guard::Guard;
use crate::store::Durability;

/// How a guarded consumer or pipeline guards: identity, checkpoints,
/// retention, durability, memory, fencing and broker patience. Both
/// builders take one ([`GuardedConsumerBuilder::options`],
/// [`GuardedPipelineBuilder::options`]); every setter states its default
/// and bounds, and the builders check them when they build.
///
/// [`GuardedConsumerBuilder::options`]: super::GuardedConsumerBuilder::options
/// [`GuardedPipelineBuilder::options`]: super::GuardedPipelineBuilder::options
///
/// ```
/// use std::time::Duration;
/// use replayguard::kafka::GuardOptions;
///
/// let options = GuardOptions::default()
///     .checkpoint_interval(Duration::from_millis(500))
///     .retention_time(Some(Duration::from_secs(3600)));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct GuardOptions {
    pub(crate) identity: Identity,
    pub(crate) checkpoint_interval: Duration,
    pub(crate) retention_epochs: u32,
    pub(crate) retention_time: Option<Duration>,
    pub(crate) durability: Durability,
    pub(crate) max_memory_bytes: Option<u64>,
    pub(crate) stop_at_end: bool,
    pub(crate) connect_attempts: u32,
    pub(crate) timeout: Duration,
    pub(crate) lease: Option<Duration>,
    pub(crate) rebind: bool,
    pub(crate) changelog: Option<String>,
    pub(crate) metric_labels: Vec<(String, String)>,
}

impl Default for GuardOptions {
    fn default() -> Self {
        GuardOptions {
            identity: Identity::Content,
            checkpoint_interval: Duration::from_secs(1),
            retention_epochs: 0,
            retention_time: None,
            durability: Durability::Process,
            max_memory_bytes: None,
            stop_at_end: false,
            connect_attempts: 10,
            timeout: Duration::from_secs(30),
            lease: None,
            rebind: false,
            changelog: None,
            metric_labels: Vec::new(),
        }
    }
}

impl GuardOptions {
    /// The identity of a record. Default [`Identity::Content`], which also
    /// catches upstream resends at new offsets. A state folder keeps the
    /// identity it was first used with.
    pub fn identity(mut self, identity: Identity) -> Self {
        self.identity = identity;
        self
    }

    /// Time between checkpoints. Default 1 s; bounds 10 ms to 1 h.
    pub fn checkpoint_interval(mut self, d: Duration) -> Self {
        self.checkpoint_interval = d;
        self
    }

    /// Completed epochs kept besides the open one. Default 0: everything
    /// since the previous completed checkpoint, which covers the guard's
    /// own replays. Upstream resends are caught only within the retention.
    /// Bounds: 0 to 1,000,000.
    pub fn retention_epochs(mut self, n: u32) -> Self {
        self.retention_epochs = n;
        self
    }

    /// Also keep epochs closed less than this long ago. Default none;
    /// bounds: at most 365 days.
    pub fn retention_time(mut self, d: Option<Duration>) -> Self {
        self.retention_time = d;
        self
    }

    /// How hard identity writes try to reach the disk. Default
    /// [`Durability::Process`]; checkpoints are always fsynced.
    pub fn durability(mut self, d: Durability) -> Self {
        self.durability = d;
        self
    }

    /// Memory for the identities of sealed epochs; older sealed epochs
    /// beyond it stay on disk with a small filter in memory. Default none
    /// (everything in memory).
    pub fn max_memory_bytes(mut self, bytes: Option<u64>) -> Self {
        self.max_memory_bytes = bytes;
        self
    }

    /// End once every assigned partition is read to its end as a
    /// `read_committed` reader sees it (its high watermark, or the first
    /// record of a transaction still open; past any transaction marker,
    /// and at once where nothing is left to read, every record deleted by
    /// retention), after a final checkpoint. An instance to which its group
    /// gives no partition at all (more members than partitions) ends too,
    /// with a warning, once the group's committed offsets reach the end of
    /// every input partition: nothing is left it could be given to read.
    /// Where a partition's log ends in a transaction marker, the owner's
    /// committed offset stays before the marker, so such an instance ends
    /// only once the owners leave and it is given the partitions. Default
    /// false.
    pub fn stop_at_end(mut self, yes: bool) -> Self {
        self.stop_at_end = yes;
        self
    }

    /// Metadata probes (about 3.5 s each) before unreachable brokers are an
    /// error. Default 10; bounds 1 to 1,000.
    pub fn connect_attempts(mut self, n: u32) -> Self {
        self.connect_attempts = n;
        self
    }

    /// How long broker calls may take, outputs (of a pipeline) to be acked
    /// at a checkpoint, and a consumer or pipeline dropped without `close`
    /// to close its clients (past it they go on closing in the
    /// background). Default 30 s; bounds 1 s to 1 h.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// The longest stall (the process frozen or starved) after which the
    /// instance still hands on work; after a longer one it stops, since the
    /// group coordinator may have expired it. Default: the session timeout
    /// less the heartbeat interval less a tenth (at least 1 s), 4 s with
    /// the adapters' defaults; 5 s under `group.protocol=consumer`, whose
    /// session timeout is the broker's. It must stay below the time the
    /// coordinator takes to expire a silent member: under the classic group
    /// protocol, a lease longer than `session.timeout.ms` less
    /// `heartbeat.interval.ms` is refused ([`Error::Config`] at build).
    /// Bounds: 100 ms to 1 h.
    pub fn lease(mut self, d: Duration) -> Self {
        self.lease = Some(d);
        self
    }

    /// Hand the state folder to this job even when it belongs to another
    /// (another group, output, or no input in common) instead of refusing
    /// it with [`Error::JobMismatch`]: its positions and identities are
    /// then taken as this job's. The identity cannot change this way.
    /// Default false.
    pub fn rebind(mut self, yes: bool) -> Self {
        self.rebind = yes;
        self
    }

    /// Keep the identities in a changelog topic too, so that they outlive
    /// this machine: a partition that moves to an instance with an empty
    /// or older state folder takes them over from the topic before it
    /// delivers anything. Default none: identities live only in this
    /// instance's folder, and a partition that moves keeps only its
    /// positions (a resend of a record handled elsewhere passes).
    ///
    /// The topic is created if missing (compacted, with as many partitions
    /// as the inputs have); one that exists must be compacted, and is
    /// grown to as many (input partition `p` is kept in its partition
    /// `p`), at start and when an input gains partitions. Each checkpoint
    /// ships the open epoch's identities and waits for the acks before it
    /// moves, so an acked record survives the loss of the machine from the
    /// next checkpoint on (at most one `checkpoint_interval` later). A
    /// state folder without a changelog takes one (each partition's first
    /// assign then reads it whole); one with a changelog keeps it (another
    /// topic, or none, needs `rebind`). It keeps a copy of the open epoch's
    /// identities in memory (about 16 bytes each), to ship at the
    /// checkpoint. The topic is created and checked through the admin API,
    /// which librdkafka's mock cluster did not answer here: the changelog
    /// needs a real broker.
    pub fn changelog(mut self, topic: impl Into<String>) -> Self {
        self.changelog = Some(topic.into());
        self
    }

    /// Labels on every metric series this consumer or pipeline emits
    /// (through the `metrics` facade, to the recorder installed when it is
    /// built), so that several in one process keep their series apart:
    /// `[("pipeline", "orders")]` gives
    /// `replayguard_live_fingerprints{pipeline="orders"}`. Default none.
    /// Without distinct labels, guards in one process share their series,
    /// and each overwrites the others' gauges. Names must be Prometheus
    /// label names, given once, and not `reason`, `kind`, `topic` or
    /// `partition`, which the adapters set on some series themselves.
    pub fn metric_labels<K, V>(mut self, labels: impl IntoIterator<Item = (K, V)>) -> Self
    where
        K: Into<String>,
        V: Into<String>,
    {
        self.metric_labels = labels
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        self
    }

    /// The options set here that only the guarded mode uses, by name:
    /// the baselines keep no identities and hold no lease, so they would
    /// drop them without a word.
    pub(crate) fn guard_only(&self) -> Vec<&'static str> {
        [
            ("retention_epochs", self.retention_epochs != 0),
            ("retention_time", self.retention_time.is_some()),
            ("max_memory_bytes", self.max_memory_bytes.is_some()),
            ("changelog", self.changelog.is_some()),
            ("lease", self.lease.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }

    /// Checks every option against its bounds (the engine checks its own
    /// when it opens).
    ///
    /// # Errors
    /// [`Error::Config`] naming the option.
    pub fn validate(&self) -> Result<()> {
        let within = |d: Duration, lo: Duration, hi: Duration| (lo..=hi).contains(&d);
        if !within(
            self.checkpoint_interval,
            Duration::from_millis(10),
            Duration::from_secs(3600),
        ) {
            return Err(Error::Config(
                "checkpoint_interval must be between 10ms and 1h".into(),
            ));
        }
        if !(1..=1000).contains(&self.connect_attempts) {
            return Err(Error::Config(
                "connect_attempts must be between 1 and 1000".into(),
            ));
        }
        if !within(
            self.timeout,
            Duration::from_secs(1),
            Duration::from_secs(3600),
        ) {
            return Err(Error::Config("timeout must be between 1s and 1h".into()));
        }
        if self
            .changelog
            .as_deref()
            .is_some_and(|t| !super::setup::is_topic_name(t))
        {
            return Err(Error::Config(
                "changelog must be a topic name: 1 to 249 of a-z, A-Z, 0-9, '.', '_' and '-'"
                    .into(),
            ));
        }
        if self
            .lease
            .is_some_and(|l| !within(l, Duration::from_millis(100), Duration::from_secs(3600)))
        {
            return Err(Error::Config("lease must be between 100ms and 1h".into()));
        }
        super::telemetry::check_labels(&self.metric_labels).map_err(Error::Config)?;
        Ok(())
    }

    /// Opens the engine over `state` with these options.
    pub(crate) fn open(&self, state: &Path) -> Result<Guard> {
        Guard::builder(state)
            .durability(self.durability)
            .retention_epochs(self.retention_epochs)
            .retention_time(self.retention_time)
            .max_memory_bytes(self.max_memory_bytes)
            .journal(self.changelog.is_some())
            .open()
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn out_of_bounds_options_are_refused_by_name() {
        assert!(GuardOptions::default().validate().is_ok());
        assert!(
            GuardOptions::default()
                .metric_labels([("pipeline", "orders"), ("_zone", "b")])
                .validate()
                .is_ok()
        );
        for (options, name) in [
            (
                GuardOptions::default().checkpoint_interval(Duration::from_millis(1)),
                "checkpoint_interval",
            ),
            (
                GuardOptions::default().connect_attempts(0),
                "connect_attempts",
            ),
            (GuardOptions::default().timeout(Duration::ZERO), "timeout"),
            (
                GuardOptions::default().lease(Duration::from_millis(1)),
                "lease",
            ),
            (
                GuardOptions::default().metric_labels([("1st", "a")]),
                "not a Prometheus label name",
            ),
            (
                GuardOptions::default().metric_labels([("a-b", "a")]),
                "not a Prometheus label name",
            ),
            (
                GuardOptions::default().metric_labels([("__name", "a")]),
                "not a Prometheus label name",
            ),
            (
                GuardOptions::default().metric_labels([("topic", "a")]),
                "the adapters set themselves",
            ),
            (
                GuardOptions::default().metric_labels([("job", "a"), ("job", "b")]),
                "given twice",
            ),
        ] {
            match options.validate() {
                Err(Error::Config(m)) => assert!(m.contains(name), "{m}"),
                other => panic!("{name}: {other:?}"),
            }
        }
    }
}
