//! The one error type of the crate.

use std::path::PathBuf;

/// The result type of every fallible call in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong, named after the operation that failed.
///
/// The `Display` text says what failed and what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The state folder could not be created or opened.
    #[error("cannot open state folder {path}: {source}; check that it exists and is writable")]
    Open {
        /// The state folder.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// Another process (or another guard in this one) holds the state folder.
    #[error(
        "state folder {path} is in use by another replayguard instance; stop it, or give this one a state folder of its own"
    )]
    InUse {
        /// The state folder.
        path: PathBuf,
    },

    /// The folder is not empty and was not written by replayguard.
    #[error(
        "{path} is not a replayguard state folder (it is not empty and has no REPLAYGUARD marker); refusing to touch it: use an empty or new folder"
    )]
    ForeignState {
        /// The folder.
        path: PathBuf,
    },

    /// The state folder belongs to another job: another consumer group,
    /// output, identity or changelog, or none of the same inputs. Taking
    /// its positions and identities as this job's would skip records.
    #[error(
        "state folder {path} belongs to another job: {what} (the folder's job: {folder}; this one: {given}); give this job a state folder of its own, or re-bind the folder to this job on purpose"
    )]
    JobMismatch {
        /// The state folder.
        path: PathBuf,
        /// What differs.
        what: String,
        /// The job the folder belongs to.
        folder: Box<crate::job::Job>,
        /// The job of this run.
        given: Box<crate::job::Job>,
    },

    /// The state was written by a format version this build does not know.
    #[error(
        "state folder {path} has format version {found}, but this build reads versions up to {supported}; use a replayguard release that reads it"
    )]
    UnsupportedVersion {
        /// The state folder.
        path: PathBuf,
        /// The version found on disk.
        found: u32,
        /// The newest version this build reads, and the one it writes.
        supported: u32,
    },

    /// The state is damaged: a checksum failed, a key or value is malformed, or a part is missing.
    #[error(
        "state folder {path} is corrupt ({what}); nothing was reset: restore it from a backup, or move it aside to start empty and let the pipeline reconcile from its output"
    )]
    Corrupt {
        /// The state folder.
        path: PathBuf,
        /// What was found wrong.
        what: String,
    },

    /// The storage engine failed while reading or writing.
    #[error(
        "state store I/O failed in {path}: {source}; the guard is stopped, reopen it after fixing the disk"
    )]
    Store {
        /// The state folder.
        path: PathBuf,
        /// The underlying storage error.
        #[source]
        source: StoreError,
    },

    /// An earlier write or fsync failed, so the guard refuses further work.
    #[error(
        "the guard is poisoned by an earlier failed write ({cause}); reopen it to recover from the last durable state"
    )]
    Poisoned {
        /// The first failure.
        cause: String,
    },

    /// A caller passed an invalid option or argument.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A lane id that this guard did not hand out, or one that was released.
    #[error("unknown lane {0}: it was released or belongs to another guard")]
    UnknownLane(u32),

    #[cfg(feature = "kafka")]
    /// A Kafka client call failed.
    #[error("kafka {operation} failed: {source}")]
    Kafka {
        /// What was being done.
        operation: String,
        /// The client error.
        #[source]
        source: rdkafka::error::KafkaError,
    },

    #[cfg(feature = "kafka")]
    /// An output was not delivered: not acked within the delivery timeout,
    /// refused by the broker, or purged. Its input is not recorded as
    /// handled, so a restart writes it again.
    #[error(
        "the output of {input} was not delivered: {source}; its input is not recorded as handled, so a restart writes it again{hint}"
    )]
    Delivery {
        /// The input, `topic[partition]@offset`.
        input: String,
        /// The producer's error.
        #[source]
        source: Box<rdkafka::error::KafkaError>,
        /// What to change before that restart, if the error says (empty
        /// otherwise; it starts with `"; "`).
        hint: &'static str,
    },

    #[cfg(feature = "kafka")]
    /// The output producer failed for good (a fatal error of librdkafka's,
    /// such as a producer id the brokers refuse), so an output was not
    /// delivered and no later one can be. Its input is not recorded as
    /// handled, so a restart writes it again.
    #[error(
        "the output producer failed for good, so the output of {input} was not delivered: {reason}; its input is not recorded as handled, so a restart writes it again{hint}"
    )]
    ProducerFailed {
        /// The input, `topic[partition]@offset`.
        input: String,
        /// What librdkafka said of the fatal error.
        reason: String,
        /// The fatal error.
        #[source]
        source: Box<rdkafka::error::KafkaError>,
        /// What to change before that restart, if the error says (empty
        /// otherwise; it starts with `"; "`).
        hint: &'static str,
    },

    /// Acks of records whose partition left this consumer in a rebalance
    /// after they were delivered (it may have come back since): they are
    /// not recorded, and the partition's owner delivers them again. The
    /// other records of the call were acked, and the consumer goes on.
    #[error(
        "{} record(s) not acked ({}): their partition left this consumer in a rebalance after they were delivered, and its owner delivers them again; undo what handling them did, or they are handled twice (the other records were acked)",
        records.len(),
        positions(records)
    )]
    Revoked {
        /// The records: topic, partition and offset.
        records: Vec<(String, i32, i64)>,
    },

    /// A Kafka topic does not exist.
    #[error("topic {topic:?} does not exist on {brokers}; create it first or check the name")]
    UnknownTopic {
        /// The topic.
        topic: String,
        /// The bootstrap servers asked.
        brokers: String,
    },

    #[cfg(feature = "kafka")]
    /// The brokers answered, but the connection cannot work: the
    /// credentials or the TLS settings are refused. Retrying would not help.
    #[error("connecting to {brokers} failed: {reason}; {hint}")]
    Connect {
        /// The bootstrap servers.
        brokers: String,
        /// What librdkafka said.
        reason: String,
        /// The client error.
        #[source]
        source: Box<rdkafka::error::KafkaError>,
        /// What to do about it.
        hint: &'static str,
    },

    /// No broker answered within the retry budget.
    #[error(
        "no broker reachable at {brokers} after {attempts} attempts ({last}); check bootstrap.servers and that the broker is up"
    )]
    Unreachable {
        /// The bootstrap servers tried.
        brokers: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last error.
        last: String,
    },

    #[cfg(feature = "kafka")]
    /// The consumer met an error that does not heal by itself: a record
    /// this build cannot decode, a missing permission, a topic that is gone.
    #[error("reading {location} failed: {source}; {hint}")]
    Consume {
        /// Where: the topic, partition and offset (or the candidates, when
        /// librdkafka does not say which partition failed).
        location: String,
        /// The client error.
        #[source]
        source: Box<rdkafka::error::KafkaError>,
        /// What to do about it.
        hint: &'static str,
    },

    /// The process stood still (frozen, or starved) longer than its lease:
    /// the group coordinator may have expired it and given its partitions
    /// to another member, so it stopped before handing on more work
    /// (fencing without transactions). Outputs still queued were purged,
    /// and their inputs are not recorded as handled.
    #[error(
        "this instance stood still for {since:?}, longer than its lease of {lease:?}: its consumer group may have given its partitions to another member, so it stopped before handing on more work, and nothing unfinished is counted as handled; start it again"
    )]
    LeaseLapsed {
        /// How long it stood still.
        since: std::time::Duration,
        /// The lease's length.
        lease: std::time::Duration,
    },

    /// librdkafka found the consumer's group session timed out (no
    /// heartbeat answered for the session timeout, as when the network is
    /// cut): its partitions may belong to another member now, so it stopped
    /// before handing on more work. Outputs still queued were purged.
    #[error(
        "the consumer group session timed out and the assignment is lost (no heartbeat answered for the session timeout): another member may own the partitions now, so this instance stopped before handing on more work, and nothing unfinished is counted as handled; start it again"
    )]
    AssignmentLost,

    /// The broker refused an offset commit because its metadata is larger
    /// than the broker allows (`offset.metadata.max.bytes`). The metadata
    /// carries this instance's output positions, from which a new owner of
    /// the partitions reconciles and learns to wait for outputs still in
    /// flight; without it that owner could write them again, so the
    /// instance stops.
    #[error(
        "the broker refused the offset commit: its metadata of {bytes} bytes, the positions of {partitions} output and changelog partitions, is over the broker's offset.metadata.max.bytes (Kafka's default is 4096). A new owner of the input partitions reads those positions to know what this instance wrote and what may still be in flight, so this instance stopped rather than leave them out; raise offset.metadata.max.bytes on the brokers (about 16 bytes a partition), or write to a topic with fewer partitions"
    )]
    CommitMetadataTooLarge {
        /// The metadata's length.
        bytes: usize,
        /// How many partitions' positions it holds.
        partitions: usize,
    },

    /// A topic ends below an offset this state folder (or its consumer
    /// group) already handled (an input) or wrote (the output): it was
    /// deleted and recreated, or truncated. Going on would skip the new
    /// topic's records below that offset, or misread its output.
    #[error(
        "{topic}[{partition}] ends at offset {end}, below offset {known} that this state folder or its consumer group has already {done}: the topic was deleted and recreated, or truncated, and going on would {risk}; if that was on purpose, give this job a new state folder and a new consumer group"
    )]
    TopicRewound {
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// Its high watermark now.
        end: i64,
        /// The offset known to have been reached.
        known: i64,
        /// "handled" (input) or "written" (output).
        done: &'static str,
        /// What going on would do.
        risk: &'static str,
    },

    /// The user's processing function failed.
    #[error("the processing function failed on {topic}[{partition}]@{offset}: {message}")]
    Process {
        /// Input topic.
        topic: String,
        /// Input partition.
        partition: i32,
        /// Input offset.
        offset: i64,
        /// The function's error text.
        message: String,
    },

    /// A pipeline or consumer stopped at run time: an output not delivered
    /// or not acked in time, an injected fault. When an earlier failure
    /// stopped it, later calls get this, naming it; the first call got the
    /// failure itself.
    #[error("{reason}")]
    Stopped {
        /// What stopped it.
        reason: String,
        /// The kind ([`Error::kind`]) of the earlier failure that stopped
        /// it, when there was one.
        after: Option<&'static str>,
    },

    /// A value could not be encoded for storage or for commit metadata.
    #[error("encoding {what} failed: {source}")]
    Encode {
        /// What was being encoded.
        what: &'static str,
        /// The encoder's error.
        #[source]
        source: serde_json::Error,
    },

    /// The state folder path is unusable before anything is opened: a file
    /// where a folder should be, or a missing parent folder (most likely a
    /// typo, which would otherwise start from empty state).
    #[error("{path}: {what}")]
    StateFolder {
        /// The path given.
        path: PathBuf,
        /// What is wrong with it, and what to do.
        what: String,
    },

    /// The changelog topic cannot serve as one, or what it holds cannot be
    /// read: its layout is wrong, it was deleted or truncated, a record is
    /// damaged or foreign, or its records are not acked. Never an empty
    /// restore in its place.
    #[error("changelog topic {topic}{}{}: {what}", partition.map(|p| format!(" partition {p}")).unwrap_or_default(), offset.map(|o| format!(" at offset {o}")).unwrap_or_default())]
    Changelog {
        /// The changelog topic.
        topic: String,
        /// The changelog partition, when one is concerned.
        partition: Option<i32>,
        /// The offset, when one is concerned.
        offset: Option<i64>,
        /// What is wrong, and what to do.
        what: String,
    },

    /// An I/O error outside the store.
    #[error("I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

/// An error from the embedded storage engine, with a readable `Display`.
#[derive(Debug)]
pub struct StoreError(pub(crate) fjall::Error);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            fjall::Error::Io(e) => write!(f, "{e}"),
            fjall::Error::Poisoned => {
                f.write_str("the store refused a write after an earlier failure")
            }
            fjall::Error::Locked => f.write_str("the store is locked by another process"),
            fjall::Error::Storage(e) => write!(f, "storage engine: {e}"),
            other => write!(f, "storage engine: {other}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl Error {
    /// [`Error::Delivery`] of the output of `input` (`topic[partition]@offset`),
    /// with a hint where the producer's error has one.
    #[cfg(feature = "kafka")]
    pub(crate) fn delivery(input: String, source: rdkafka::error::KafkaError) -> Self {
        let hint = write_hint(&source);
        Error::Delivery {
            input,
            source: Box::new(source),
            hint,
        }
    }

    /// [`Error::ProducerFailed`] for the output of `input`: `cause` is the
    /// producer's fatal error, `reason` librdkafka's text for it.
    #[cfg(feature = "kafka")]
    pub(crate) fn producer_failed(
        input: String,
        cause: rdkafka::error::KafkaError,
        reason: String,
    ) -> Self {
        use rdkafka::types::RDKafkaErrorCode;
        let hint = match cause.rdkafka_error_code() {
            // An idempotent producer's id is refused: since Kafka 3.0 the
            // broker grants one to a principal with WRITE on any topic, or
            // IDEMPOTENT_WRITE on the cluster.
            Some(RDKafkaErrorCode::ClusterAuthorizationFailed) => {
                "; the brokers refused this client a producer id, which an idempotent producer needs: grant its principal WRITE on the output topic (or IDEMPOTENT_WRITE on the cluster)"
            }
            _ => write_hint(&cause),
        };
        Error::ProducerFailed {
            input,
            reason,
            source: Box::new(cause),
            hint,
        }
    }

    /// True for errors that poison a guard: a failed write or fsync.
    #[must_use]
    pub fn is_poisoning(&self) -> bool {
        matches!(self, Error::Store { .. } | Error::Io(_))
    }

    /// True when the instance stopped because it may no longer own its
    /// partitions: its lease lapsed or its group session timed out, or a
    /// call after such a stop. It did nothing wrong, and starting it again
    /// (with the same state folder) is the remedy; the command line exits
    /// with status 75 for it.
    #[must_use]
    pub fn is_fenced(&self) -> bool {
        let kind = match self {
            Error::Stopped {
                after: Some(kind), ..
            } => kind,
            e => e.kind(),
        };
        matches!(kind, "lease_lapsed" | "assignment_lost")
    }

    /// A short, stable name of the kind of failure, in snake case (for
    /// example `store`, `poisoned`, `lease_lapsed`): for structured logs
    /// and alerts, which should not match on the `Display` text.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Open { .. } => "open",
            Error::InUse { .. } => "in_use",
            Error::ForeignState { .. } => "foreign_state",
            Error::JobMismatch { .. } => "job_mismatch",
            Error::UnsupportedVersion { .. } => "unsupported_version",
            Error::Corrupt { .. } => "corrupt",
            Error::Store { .. } => "store",
            Error::Poisoned { .. } => "poisoned",
            Error::Config(_) => "config",
            Error::UnknownLane(_) => "unknown_lane",
            #[cfg(feature = "kafka")]
            Error::Kafka { .. } => "kafka",
            #[cfg(feature = "kafka")]
            Error::Delivery { .. } => "delivery",
            #[cfg(feature = "kafka")]
            Error::ProducerFailed { .. } => "producer_failed",
            Error::Revoked { .. } => "revoked",
            Error::UnknownTopic { .. } => "unknown_topic",
            #[cfg(feature = "kafka")]
            Error::Connect { .. } => "connect",
            Error::Unreachable { .. } => "unreachable",
            #[cfg(feature = "kafka")]
            Error::Consume { .. } => "consume",
            Error::LeaseLapsed { .. } => "lease_lapsed",
            Error::AssignmentLost => "assignment_lost",
            Error::CommitMetadataTooLarge { .. } => "commit_metadata_too_large",
            Error::TopicRewound { .. } => "topic_rewound",
            Error::Process { .. } => "process",
            Error::Stopped { .. } => "stopped",
            Error::Encode { .. } => "encode",
            Error::StateFolder { .. } => "state_folder",
            Error::Changelog { .. } => "changelog",
            Error::Io(_) => "io",
        }
    }
}

/// Records as `topic[partition]@offset`, separated by commas.
fn positions(records: &[(String, i32, i64)]) -> String {
    records
        .iter()
        .map(|(t, p, o)| format!("{t}[{p}]@{o}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What to change before a restart, for an output the producer could not
/// write (empty, or starting with `"; "`).
#[cfg(feature = "kafka")]
fn write_hint(e: &rdkafka::error::KafkaError) -> &'static str {
    use rdkafka::types::RDKafkaErrorCode;
    match e.rdkafka_error_code() {
        // The input fitted its topic; its output is larger by the
        // guard's headers (see `kafka::headers`).
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => {
            "; an output is its input and replayguard's headers (62 bytes and the input topic's name, 26 more where an input has several outputs): raise the output topic's max.message.bytes, and the producer's message.max.bytes (-X)"
        }
        // Nothing acked it in time: the cause is on the broker's side or
        // the way to it, which the code does not say.
        Some(RDKafkaErrorCode::MessageTimedOut) => {
            "; no broker acknowledged it within the delivery timeout (the producer's message.timeout.ms): check that the output topic exists, that its partitions have a leader, and that the brokers are reachable"
        }
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => {
            "; the brokers do not let this client write the output topic: grant its principal WRITE on that topic"
        }
        // A copy keeps its input's timestamp (`OutputRecord::copy_of`).
        Some(RDKafkaErrorCode::InvalidTimestamp) => {
            "; the output topic refused the output's timestamp (a copy keeps its input's): it lies outside the topic's message.timestamp.before.max.ms or message.timestamp.after.max.ms, which can be raised, or an output can carry no timestamp of its own"
        }
        // Kafka validates each record against the topic: a compacted
        // topic takes none without a key.
        Some(RDKafkaErrorCode::InvalidRecord) => {
            "; the output topic refused the record as invalid for it: a compacted topic (cleanup.policy=compact) takes only records with a key, so give each output one, or write to a topic that is not compacted (the broker's log names any other rule)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Error;

    #[test]
    fn a_stop_for_lost_ownership_is_fenced_and_so_is_a_later_call_after_one() {
        let lapsed = Error::LeaseLapsed {
            since: Duration::from_secs(12),
            lease: Duration::from_secs(4),
        };
        assert!(lapsed.is_fenced());
        assert!(Error::AssignmentLost.is_fenced());
        let after = |kind| Error::Stopped {
            reason: "stopped after an earlier failure".into(),
            after: kind,
        };
        assert!(after(Some("assignment_lost")).is_fenced());
        assert!(after(Some("lease_lapsed")).is_fenced());
        assert!(!after(Some("delivery")).is_fenced());
        assert!(!after(None).is_fenced());
        assert!(!Error::Config("x".into()).is_fenced());
    }
}
