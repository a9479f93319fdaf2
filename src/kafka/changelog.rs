//! The changelog topic: a guard's identities kept in Kafka, so that a
//! partition that moves to an instance without its state folder (a lost
//! machine, a scale-out, a reschedule) still filters what was handled.
//!
//! - **Layout.** One changelog partition per input partition number
//!   (input partition `p`, of any input topic, goes to changelog
//!   partition `p`), `cleanup.policy=compact`. Created if missing, and
//!   grown when an input has more partitions than it (at open, or when an
//!   input gains partitions while the guard runs); an existing topic
//!   without compaction is refused.
//! - **Writes.** Before each checkpoint, every lane's open epoch is
//!   produced whole (see [`crate::changelog`] for the records), with the
//!   idempotent producer, and the checkpoint waits for the acks: the
//!   manifest and the committed offsets never move past identities the
//!   changelog does not hold. After it, the offsets the checkpoint carried
//!   into the new epoch, then the tombstones of the epochs it dropped.
//!   The changelog's end offsets go into the manifest and the commit
//!   metadata.
//! - **Restore.** On assign, a partition whose changelog partition ends
//!   where this folder's last checkpoint left it reads nothing. Otherwise
//!   the records written since are read; if another instance of the same
//!   group wrote any, the whole partition is read, and every live identity
//!   another instance of the group shipped for the arriving lane is taken
//!   into the open epoch
//!   (so it lives one retention from now), before any record of the lane
//!   is delivered. The next checkpoint ships them as this instance's, and
//!   then writes tombstones over the other instance's records.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{
    AdminClient, AdminOptions, NewPartitions, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Message};
use rdkafka::producer::{BaseRecord, Producer, ProducerContext, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};

use super::setup::{self, kafka};
use super::shared::Shared;
use super::trouble::watermarks;
use crate::changelog::{ChangelogKey, Shipment, Shipped, decode_value, encode_value};
use crate::error::{Error, Result};
use crate::guard::LaneId;

/// Topic settings of a changelog this guard creates: compacted, with
/// segments that roll often enough for compaction to reach them, and
/// tombstones kept a day for slow readers.
const CREATED_CONFIG: [(&str, &str); 4] = [
    ("cleanup.policy", "compact"),
    ("segment.ms", "3600000"),
    ("segment.bytes", "67108864"),
    ("delete.retention.ms", "86400000"),
];

/// The acks of the changelog producer.
#[derive(Default)]
struct Acks {
    /// Changelog partition to the offset after its last acked record.
    ends: BTreeMap<i32, i64>,
    /// The first failed delivery.
    failed: Option<String>,
}

/// The changelog producer's context: it notes acks and failures.
pub(crate) struct AckContext {
    acks: Mutex<Acks>,
}

impl AckContext {
    fn lock(&self) -> std::sync::MutexGuard<'_, Acks> {
        self.acks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl ClientContext for AckContext {}

impl ProducerContext for AckContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        let mut a = self.lock();
        match result {
            Ok(m) => {
                let end = a.ends.entry(m.partition()).or_insert(0);
                *end = (*end).max(m.offset() + 1);
            }
            Err((e, m)) => {
                if a.failed.is_none() {
                    a.failed = Some(format!("partition {}: {e}", m.partition()));
                }
            }
        }
    }
}

/// A guard's changelog: its producer, and how to read it back.
pub(crate) struct Changelog {
    pub topic: String,
    /// This instance's token, the writer in every key it writes.
    writer: String,
    /// The job's consumer group, in every key: a restore takes only its
    /// own group's records.
    group: String,
    producer: ThreadedProducer<AckContext>,
    /// Connection settings, for the restore reader.
    connection: ClientConfig,
    timeout: Duration,
    /// Other instances' records whose identities were taken over: their
    /// tombstones follow the next checkpoint, which ships those
    /// identities as this instance's.
    taken_over: Mutex<Vec<ChangelogKey>>,
    /// Its metric series, under the guard's labels.
    meters: super::telemetry::ChangelogMeters,
}

/// What one restore did, for logs and tests.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Restored {
    pub records: u64,
    pub identities: u64,
}

impl Changelog {
    /// The changelog the options name, if they name one.
    ///
    /// # Errors
    /// As [`Changelog::open`].
    pub fn for_options(
        user: &ClientConfig,
        o: &super::GuardOptions,
        partitions: usize,
        writer: &str,
        meters: &super::telemetry::Meters,
    ) -> Result<Option<Self>> {
        let group = setup::group_id(user)?;
        o.changelog
            .as_deref()
            .map(|topic| {
                let meters = meters.changelog();
                Self::open(user, topic, partitions, &group, writer, o.timeout, meters)
            })
            .transpose()
    }

    /// Checks or creates the topic (with at least `partitions`
    /// partitions), and starts the producer.
    ///
    /// # Errors
    /// [`Error::Changelog`] for a topic of the wrong layout;
    /// [`Error::Kafka`] when the broker cannot be asked.
    pub fn open(
        user: &ClientConfig,
        topic: &str,
        partitions: usize,
        group: &str,
        writer: &str,
        timeout: Duration,
        meters: super::telemetry::ChangelogMeters,
    ) -> Result<Self> {
        let connection = setup::connection_config(user);
        ensure_topic(&connection, topic, partitions, timeout)?;
        let mut cfg = setup::idempotent_producer_config(&connection)?;
        cfg.set("linger.ms", "5");
        cfg.set("compression.type", "lz4");
        let producer: ThreadedProducer<AckContext> = cfg
            .create_with_context(AckContext {
                acks: Mutex::new(Acks::default()),
            })
            .map_err(kafka("creating the changelog producer"))?;
        Ok(Changelog {
            topic: topic.to_owned(),
            writer: writer.to_owned(),
            group: group.to_owned(),
            producer,
            connection,
            timeout,
            taken_over: Mutex::new(Vec::new()),
            meters,
        })
    }

    fn error(&self, partition: Option<i32>, offset: Option<i64>, what: String) -> Error {
        Error::Changelog {
            topic: self.topic.clone(),
            partition,
            offset,
            what,
        }
    }

    /// What went wrong in writing the changelog: `what`, unless the
    /// producer failed for good (a fatal error of librdkafka's), which then
    /// fails every send, flush and delivery with a code that names no
    /// cause; that error is named instead.
    fn write_error(&self, partition: Option<i32>, what: String) -> Error {
        let what = match self.producer.client().fatal_error() {
            Some((code, reason)) => {
                let grant = match code {
                    // An idempotent producer's id is refused to a principal
                    // that may write no topic.
                    RDKafkaErrorCode::ClusterAuthorizationFailed
                    | RDKafkaErrorCode::TopicAuthorizationFailed => {
                        "; grant this client's principal WRITE on the changelog topic"
                    }
                    _ => "",
                };
                format!("its producer failed for good: {reason}{grant}")
            }
            None => what,
        };
        self.error(partition, None, what)
    }

    /// Hands one record to the producer, waiting while its queue is full.
    fn send(&self, partition: i32, key: &[u8], value: Option<&[u8]>) -> Result<()> {
        let started = Instant::now();
        loop {
            let mut record = BaseRecord::<[u8], [u8]>::to(&self.topic)
                .partition(partition)
                .key(key);
            if let Some(v) = value {
                record = record.payload(v);
            }
            match self.producer.send(record) {
                Ok(()) => {
                    let kind = if value.is_some() {
                        &self.meters.parts
                    } else {
                        &self.meters.tombstones
                    };
                    kind.increment(1);
                    return Ok(());
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                    if started.elapsed() < self.timeout =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err((e, _)) => {
                    return Err(self.write_error(Some(partition), format!("cannot produce: {e}")));
                }
            }
        }
    }

    /// Hands shipments to the producer (no wait for their acks).
    fn send_all(&self, shipments: &[Shipment]) -> Result<()> {
        for s in shipments {
            let key = |part: u32| {
                ChangelogKey {
                    group: self.group.clone(),
                    writer: self.writer.clone(),
                    topic: s.topic.clone(),
                    partition: s.partition,
                    epoch: s.epoch,
                    part,
                }
                .encode()
            };
            match &s.what {
                Shipped::Parts(parts) => {
                    for (i, part) in parts.iter().enumerate() {
                        let value = encode_value(part)?;
                        self.send(s.partition, &key(i as u32), Some(&value))?;
                    }
                }
                Shipped::Tombstones(n) => {
                    for i in 0..*n {
                        self.send(s.partition, &key(i), None)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits until every record handed over is acked, and returns the
    /// changelog's end offsets.
    fn wait_acked(&self) -> Result<BTreeMap<i32, i64>> {
        self.producer.flush(self.timeout).map_err(|e| {
            self.write_error(
                None,
                format!("records not acked within {:?}: {e}", self.timeout),
            )
        })?;
        let failed = self.producer.context().lock().failed.clone();
        if let Some(f) = failed {
            return Err(self.write_error(None, format!("a record was not written: {f}")));
        }
        let a = self.producer.context().lock();
        Ok(a.ends.clone())
    }

    /// Before a checkpoint: ships every lane's open epoch and waits for the
    /// acks, then notes the end offsets where the checkpoint records them.
    ///
    /// # Errors
    /// A store failure, or records not acked (the checkpoint must then not
    /// be taken).
    pub fn before_checkpoint(&self, s: &mut Shared) -> Result<()> {
        let Some(guard) = s.engine()? else {
            return Ok(());
        };
        let open = guard.ship_open()?;
        self.send_all(&open)?;
        let started = Instant::now();
        let ends = self.wait_acked()?;
        self.meters
            .wait_seconds
            .record(started.elapsed().as_secs_f64());
        if let Some(sink) = s.sink.as_mut() {
            sink.changelog.extend(ends);
        }
        Ok(())
    }

    /// After a checkpoint: ships what it carried into the new epoch, the
    /// tombstones of the epochs it dropped, and those of other instances'
    /// records taken over before it.
    ///
    /// # Errors
    /// Records that cannot be handed to the producer.
    pub fn after_checkpoint(&self, s: &mut Shared) -> Result<()> {
        let Some(guard) = s.engine()? else {
            return Ok(());
        };
        let after = guard.take_after_checkpoint();
        self.send_all(&after)?;
        let taken: Vec<ChangelogKey> = std::mem::take(
            &mut *self
                .taken_over
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for k in taken {
            self.send(k.partition, &k.encode(), None)?;
        }
        Ok(())
    }

    /// Restores an arriving lane from the changelog when another instance
    /// wrote to its changelog partition since this folder's last
    /// checkpoint (`local_end`, `None` when it has none).
    ///
    /// # Errors
    /// [`Error::Changelog`] for a topic that is missing, ends below what
    /// this folder wrote, or holds a record that is not a replayguard
    /// changelog record; a store failure while importing.
    pub fn restore(
        &self,
        reader: &BaseConsumer,
        s: &std::sync::Mutex<Shared>,
        lane: LaneId,
        topic: &str,
        partition: i32,
        local_end: Option<i64>,
    ) -> Result<Restored> {
        let mut read = watermarks(reader, &self.topic, partition, self.timeout);
        if read
            .as_ref()
            .is_err_and(|e| e.rdkafka_error_code() == Some(RDKafkaErrorCode::UnknownPartition))
        {
            // Made with as many partitions as the inputs had then: an
            // input gained partitions since.
            self.grow_for(reader, topic, partition)?;
            read = watermarks(reader, &self.topic, partition, self.timeout);
        }
        let (lo, hi) = read.map_err(|e| {
            self.error(
                Some(partition),
                None,
                format!("cannot read its watermarks (was it deleted?): {e}"),
            )
        })?;
        if let Some(end) = local_end {
            if hi < end {
                return Err(self.error(
                    Some(partition),
                    Some(hi),
                    format!(
                        "it ends at offset {hi}, below offset {end} where this state folder's last checkpoint left it: it was deleted, recreated or truncated; the identities it held are gone (restore the topic, or re-bind the folder with a new changelog on purpose)"
                    ),
                ));
            }
            if lo > end {
                return Err(self.error(
                    Some(partition),
                    Some(lo),
                    format!(
                        "it starts at offset {lo}, past offset {end} where this state folder's last checkpoint left it: records were deleted (retention or DeleteRecords), so what other instances wrote may be gone; a changelog must be compacted, not deleted"
                    ),
                ));
            }
            if hi == end {
                return Ok(Restored::default());
            }
        }
        if hi <= lo {
            return Ok(Restored::default());
        }
        let from = local_end.unwrap_or(lo);
        if local_end.is_some() {
            let mut foreign = false;
            self.read(reader, partition, from, hi, |key, _| {
                foreign |= key.writer != self.writer && key.group == self.group;
                Ok(())
            })?;
            if !foreign {
                return Ok(Restored::default());
            }
        }
        // The whole partition, the latest record of each key, this lane's
        // only, written by other instances.
        let mut live: HashMap<ChangelogKey, (i64, Vec<u8>)> = HashMap::new();
        self.read(reader, partition, lo, hi, |key, record| {
            if key.group != self.group
                || key.topic != topic
                || key.partition != partition
                || key.writer == self.writer
            {
                return Ok(());
            }
            match record {
                Some((offset, value)) => {
                    live.insert(key, (offset, value.to_vec()));
                }
                None => {
                    live.remove(&key);
                }
            }
            Ok(())
        })?;
        let mut restored = Restored::default();
        let mut keys: Vec<ChangelogKey> = live.keys().cloned().collect();
        keys.sort();
        for key in keys {
            let Some((offset, value)) = live.remove(&key) else {
                continue;
            };
            let chunk = decode_value(&value).map_err(|what| {
                self.error(
                    Some(partition),
                    Some(offset),
                    format!(
                        "record of {}'s epoch {} is damaged: {what}",
                        key.writer, key.epoch
                    ),
                )
            })?;
            let mut shared = super::shared::lock(s);
            let Some(guard) = shared.engine()? else {
                return Ok(restored);
            };
            let n = guard.import(lane, &chunk)?;
            self.meters.restored.increment(n);
            restored.identities += n;
            restored.records += 1;
            if setup::fault("kill-mid-restore") {
                // As a SIGKILL in the middle of a restore, with what it
                // imported so far on disk.
                guard.flush()?;
                // SAFETY: a signal to this process; nothing follows.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            drop(shared);
            self.taken_over
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(key);
        }
        Ok(restored)
    }

    /// Grows the changelog to hold input partition `partition` of
    /// `input` (and every partition the input has now), and waits until
    /// the reader and the producer both know the new partitions.
    fn grow_for(&self, reader: &BaseConsumer, input: &str, partition: i32) -> Result<()> {
        let t = self.timeout;
        let wanted = partition_count(reader.client(), input, t).max(partition as usize + 1);
        grow_topic(&self.connection, &self.topic, wanted, self.timeout)?;
        tracing::info!(changelog = %self.topic, input, partition, partitions = wanted, "changelog grown to the input's partitions");
        // Each client reads the new count at its next metadata refresh,
        // which asking for the topic's metadata brings forward.
        let started = Instant::now();
        loop {
            let known = partition_count(reader.client(), &self.topic, t).min(partition_count(
                self.producer.client(),
                &self.topic,
                t,
            ));
            if known > partition as usize {
                return Ok(());
            }
            if started.elapsed() > self.timeout {
                return Err(self.error(
                    Some(partition),
                    None,
                    format!(
                        "it was grown to {wanted} partitions, but after {:?} its metadata still shows {known}",
                        self.timeout
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A reader of the changelog: no group, nothing committed. One serves
    /// every partition of an assignment.
    pub fn reader(&self) -> Result<BaseConsumer> {
        let mut cfg = self.connection.clone();
        cfg.set("group.id", format!("replayguard-changelog-{}", self.writer))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .set("auto.offset.reset", "earliest");
        cfg.create().map_err(kafka("creating the changelog reader"))
    }

    /// Reads `partition` from `from` up to `hi`, handing each record's key
    /// and, unless it is a tombstone, its offset and value to `f`.
    fn read(
        &self,
        reader: &BaseConsumer,
        partition: i32,
        from: i64,
        hi: i64,
        mut f: impl FnMut(ChangelogKey, Option<(i64, &[u8])>) -> Result<()>,
    ) -> Result<()> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, partition, Offset::Offset(from))
            .map_err(kafka("building the changelog reader's assignment"))?;
        reader
            .assign(&tpl)
            .map_err(kafka("assigning the changelog partition"))?;
        // A long restore is fine; one that stops moving is not.
        let mut deadline = Instant::now() + self.timeout;
        let mut next = from;
        while next < hi {
            if Instant::now() > deadline {
                return Err(self.error(
                    Some(partition),
                    Some(next),
                    format!(
                        "read up to offset {next} of {hi}, then nothing more within {:?}",
                        self.timeout
                    ),
                ));
            }
            let Some(m) = reader.poll(Duration::from_millis(200)) else {
                continue;
            };
            let m = match m {
                Ok(m) => m,
                Err(KafkaError::PartitionEOF(_)) => {
                    // Compaction may have removed the last records.
                    let (_, now_hi) = watermarks(reader, &self.topic, partition, self.timeout)
                        .map_err(kafka("reading changelog watermarks"))?;
                    if let Ok(pos) = reader.position()
                        && let Some(Offset::Offset(p)) = pos
                            .find_partition(&self.topic, partition)
                            .map(|e| e.offset())
                        && p >= hi.min(now_hi)
                    {
                        break;
                    }
                    continue;
                }
                Err(e) => {
                    return Err(self.error(
                        Some(partition),
                        Some(next),
                        format!("cannot read: {e}"),
                    ));
                }
            };
            next = m.offset() + 1;
            deadline = Instant::now() + self.timeout;
            if m.offset() >= hi {
                break;
            }
            let key = m.key().ok_or_else(|| {
                self.error(
                    Some(partition),
                    Some(m.offset()),
                    "a record has no key: something other than replayguard writes to this topic"
                        .into(),
                )
            })?;
            let key = ChangelogKey::decode(key).map_err(|what| {
                self.error(
                    Some(partition),
                    Some(m.offset()),
                    format!("{what}; something other than replayguard writes to this topic"),
                )
            })?;
            f(key, m.payload().map(|v| (m.offset(), v)))?;
        }
        Ok(())
    }
}

impl Drop for Changelog {
    /// The records handed over after the last checkpoint (carried offsets,
    /// tombstones) are sent before the producer goes, within a bound.
    fn drop(&mut self) {
        if let Err(e) = self
            .producer
            .flush(self.timeout.min(Duration::from_secs(5)))
        {
            tracing::warn!(topic = %self.topic, error = %e, "changelog records not all sent at close: a dropped epoch whose tombstones were not sent stays in the changelog until another instance takes its partition over");
        }
    }
}

/// Creates the changelog topic, or checks that an existing one has at
/// least `partitions` partitions and is compacted.
fn ensure_topic(
    connection: &ClientConfig,
    topic: &str,
    partitions: usize,
    timeout: Duration,
) -> Result<()> {
    let wrong = |what: String| Error::Changelog {
        topic: topic.to_owned(),
        partition: None,
        offset: None,
        what,
    };
    let admin: AdminClient<DefaultClientContext> = connection
        .create()
        .map_err(kafka("creating an admin client"))?;
    let opts = AdminOptions::new().operation_timeout(Some(timeout));
    let metadata: BaseConsumer = connection
        .create()
        .map_err(kafka("creating a metadata client"))?;
    let found = metadata
        .fetch_metadata(Some(topic), timeout)
        .map_err(kafka("reading the changelog topic's metadata"))?;
    let existing = found
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len());
    match existing {
        None | Some(0) => {
            let new = NewTopic::new(topic, partitions as i32, TopicReplication::Fixed(-1));
            let new = CREATED_CONFIG.iter().fold(new, |t, (k, v)| t.set(k, v));
            let r = futures::executor::block_on(admin.create_topics([&new], &opts))
                .map_err(kafka("creating the changelog topic"))?;
            for t in r {
                match t {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((_, code)) => {
                        return Err(wrong(format!("cannot create it: {code}")));
                    }
                }
            }
            tracing::info!(topic, partitions, "changelog topic created");
            Ok(())
        }
        Some(n) => {
            let described = futures::executor::block_on(
                admin.describe_configs([&ResourceSpecifier::Topic(topic)], &opts),
            )
            .map_err(kafka("reading the changelog topic's configuration"))?;
            let policy = described
                .into_iter()
                .flatten()
                .flat_map(|r| r.entries)
                .find(|e| e.name == "cleanup.policy")
                .and_then(|e| e.value)
                .unwrap_or_default();
            if !policy.split(',').any(|p| p.trim() == "compact") {
                return Err(wrong(format!(
                    "its cleanup.policy is {policy:?}: a changelog must be compacted (cleanup.policy=compact), or identities still live would be deleted"
                )));
            }
            if policy.split(',').any(|p| p.trim() == "delete") {
                tracing::warn!(
                    topic,
                    policy,
                    "changelog topic also deletes by retention: live identities older than its retention.ms are lost from it"
                );
            }
            // Input partition p is kept in changelog partition p.
            if n < partitions {
                grow_topic(connection, topic, partitions, timeout)?;
                tracing::info!(
                    topic,
                    from = n,
                    partitions,
                    "changelog topic grown to the inputs' partitions"
                );
            }
            Ok(())
        }
    }
}

/// The partitions of `topic` that `client` finds in a metadata request
/// (which also refreshes its own view of them), 0 if it cannot tell.
fn partition_count<C: ClientContext>(
    client: &rdkafka::client::Client<C>,
    topic: &str,
    timeout: Duration,
) -> usize {
    client
        .fetch_metadata(Some(topic), timeout)
        .ok()
        .and_then(|m| {
            m.topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none())
                .map(|t| t.partitions().len())
        })
        .unwrap_or(0)
}

/// Grows a topic to `partitions` partitions. A topic that has that many
/// already (another instance grew it first) is left as it is.
fn grow_topic(
    connection: &ClientConfig,
    topic: &str,
    partitions: usize,
    timeout: Duration,
) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = connection
        .create()
        .map_err(kafka("creating an admin client"))?;
    let opts = AdminOptions::new().operation_timeout(Some(timeout));
    let grow = NewPartitions::new(topic, partitions);
    let answers = futures::executor::block_on(admin.create_partitions([&grow], &opts))
        .map_err(kafka("adding partitions to the changelog topic"))?;
    for answer in answers {
        match answer {
            // The broker refuses a count the topic has reached already.
            Ok(_) | Err((_, RDKafkaErrorCode::InvalidPartitions)) => {}
            Err((_, code)) => {
                return Err(Error::Changelog {
                    topic: topic.to_owned(),
                    partition: None,
                    offset: None,
                    what: format!(
                        "it has fewer partitions than the inputs ({partitions}: input partition p is kept in changelog partition p), and adding them failed: {code}"
                    ),
                });
            }
        }
    }
    Ok(())
}
