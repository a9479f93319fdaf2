//! What a guarded consumer or pipeline shares between threads ([`Core`]),
//! and the consumer context that runs recovery and checkpoints in the
//! rebalance callbacks ([`GuardContext`]).
//!
//! The context knows the shared state and the engine; what only a pipeline
//! does (flushing its producer, reconciling its output, committing inside a
//! transaction) it asks of the adapter through [`Hooks`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, ConsumerGroupMetadata,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::statistics::Statistics;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;

use super::lease::Lease;
use super::setup::{self, kafka};
use super::shared::{Held, Offered, Partition, Position, Refusal, Shared, SinkPositions};
use super::trouble::{patiently, watermarks};
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, Identity};

/// What an adapter adds to the context's recovery and checkpoints. A
/// guarded consumer adds nothing; a pipeline flushes and reconciles its
/// output.
pub(crate) trait Hooks: Send + Sync {
    /// Whether the adapter writes outputs: it then reconciles them on
    /// recovery, and a new owner waits after an unclean handover.
    fn writes(&self) -> bool {
        false
    }

    /// Waits (blocking) until every output handed to the producer is acked.
    ///
    /// # Errors
    /// When they are not acked within `timeout`.
    fn flush(&self, _timeout: Duration) -> Result<()> {
        Ok(())
    }

    /// Reads the output back from the given sink positions and records the
    /// inputs found as handled (blocking).
    ///
    /// # Errors
    /// A read or store failure.
    fn reconcile(
        &self,
        _core: &Core,
        _manifest: Option<&SinkPositions>,
        _commits: &[SinkPositions],
    ) -> Result<()> {
        Ok(())
    }

    /// Commits input offsets itself (a transactional copy, inside its
    /// transaction): `true` when it did, `false` to commit them to the
    /// group.
    ///
    /// # Errors
    /// A failed transaction.
    fn commit(
        &self,
        _tpl: &TopicPartitionList,
        _group: Option<ConsumerGroupMetadata>,
    ) -> Result<bool> {
        Ok(false)
    }

    /// Drops every output still queued, so that none is sent.
    fn purge(&self) {}
}

/// The hooks of an adapter that writes nothing: a guarded consumer.
pub(crate) struct NoHooks;

impl Hooks for NoHooks {}

/// Everything a guarded consumer or pipeline shares between threads.
pub(crate) struct Core {
    pub shared: Arc<Mutex<Shared>>,
    pub hooks: Box<dyn Hooks>,
    /// How long broker calls and flushes may take.
    pub timeout: Duration,
    /// The bootstrap servers, for messages.
    pub brokers: String,
    /// This instance's token, written into commit metadata.
    pub instance: String,
    /// Whether fencing is on: the lease, and new owners' waits.
    pub fenced: bool,
    pub lease: Lease,
    /// The changelog, when the identities are kept in one.
    pub changelog: Option<super::changelog::Changelog>,
    /// The longest commit metadata the broker has taken from this run (see
    /// [`Core::commit`]).
    pub metadata_taken: AtomicUsize,
    /// `auto.offset.reset` points at a partition's end: where a partition
    /// with no position anywhere starts.
    pub start_at_end: bool,
    /// This guard's metric series (the same as `Shared::meters`).
    pub meters: Arc<super::telemetry::Meters>,
    /// The consumer group.
    pub group: String,
    /// Whether this instance is a static member of a classic group
    /// (`group.instance.id`), whose rejoins keep the group's old
    /// assignment ([`Core::watch_assignment`]).
    pub static_member: bool,
    /// What [`Core::watch_assignment`] saw last.
    pub watch: std::sync::Mutex<AssignmentWatch>,
}

/// The state of [`Core::watch_assignment`], shared with the thread that
/// checks the group ([`AssignmentWatcher`]).
#[derive(Debug, Default)]
pub(crate) struct AssignmentWatch {
    /// The partitions the group's assignment left out at the last check.
    left_out: BTreeSet<Partition>,
    /// Partitions left out at two checks in a row: the run loop rejoins
    /// the group for them at its next checkpoint.
    rejoin: Vec<Partition>,
    /// The brokers cannot describe groups (librdkafka's mock cluster):
    /// nothing to check.
    unsupported: bool,
}

/// How often a static member checks that its group's assignment covers
/// every partition of the inputs.
const WATCH_EVERY: Duration = Duration::from_secs(10);

/// The thread that checks a static member's group every `WATCH_EVERY`
/// ([`Core::watch_assignment`]). Its requests (the inputs' metadata, then
/// ListGroups to every broker and DescribeGroups to the coordinator) each
/// wait up to 2 s for a broker that is slow or gone, so they are kept off
/// the run loop, which only reads what the thread found. Dropping it stops
/// the thread and waits for a check under way; the thread holds the
/// consumer until then, so it must be dropped before the consumer's last
/// reference is meant to close it.
pub(crate) struct AssignmentWatcher {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for AssignmentWatcher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            // A panic of the thread was printed; there is nothing to undo.
            let _ = t.join();
        }
    }
}

impl AssignmentWatcher {
    /// Starts the thread for a static member of a classic group; `None`
    /// for any other member, or if the thread cannot start (the group's
    /// assignment then goes unchecked while the run lasts, with a WARN).
    pub(crate) fn start<C>(core: &Arc<Core>, consumer: &Arc<C>) -> Option<Self>
    where
        C: Consumer<GuardContext> + Send + Sync + 'static,
    {
        if !core.static_member {
            return None;
        }
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (core, consumer) = (core.clone(), consumer.clone());
        let thread = std::thread::Builder::new()
            .name("replayguard-group-watch".into())
            .spawn(move || {
                // The first check comes soon, as a restarted member's group
                // settles; its partitions are left out from the second on.
                let mut wait = Duration::from_secs(1);
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(wait)
                {
                    if !core.check_assignment(&*consumer) {
                        break;
                    }
                    wait = WATCH_EVERY;
                }
            });
        match thread {
            Ok(t) => Some(AssignmentWatcher {
                stop: Some(stop),
                thread: Some(t),
            }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the thread that checks the group's assignment; partitions added to an input while this static member was away may go unread until it restarts");
                None
            }
        }
    }
}

/// The partitions of a member's assignment as the classic consumer
/// protocol encodes it: a 16-bit version, then an array (32-bit count) of
/// topics, each a string (16-bit length) and an array of 32-bit partition
/// numbers, then user data, which is not read. Empty bytes are an empty
/// assignment. `None` if the bytes do not parse.
fn assignment_partitions(bytes: &[u8]) -> Option<Vec<Partition>> {
    fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = r.split_at_checked(n)?;
        *r = rest;
        Some(head)
    }
    fn int(r: &mut &[u8], n: usize) -> Option<i64> {
        let b = take(r, n)?;
        Some(match n {
            2 => i64::from(i16::from_be_bytes([b[0], b[1]])),
            _ => i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]])),
        })
    }
    let mut r = bytes;
    let mut out = Vec::new();
    if r.is_empty() {
        return Some(out);
    }
    int(&mut r, 2)?;
    for _ in 0..int(&mut r, 4)?.max(0) {
        let len = usize::try_from(int(&mut r, 2)?).ok()?;
        let topic = std::str::from_utf8(take(&mut r, len)?).ok()?.to_owned();
        for _ in 0..int(&mut r, 4)?.max(0) {
            out.push((topic.clone(), i32::try_from(int(&mut r, 4)?).ok()?));
        }
    }
    Some(out)
}

/// Offsets to commit, with metadata, as librdkafka takes them.
fn commit_list(positions: &[Position], meta: &str) -> Result<TopicPartitionList> {
    let mut tpl = TopicPartitionList::new();
    for (topic, p, pos) in positions {
        let mut e = tpl.add_partition(topic, *p);
        e.set_offset(Offset::Offset(*pos))
            .map_err(kafka("setting a commit offset"))?;
        e.set_metadata(meta);
    }
    Ok(tpl)
}

/// Whether a claim's refusal `e` may pass if the claim is made again: a
/// coordinator moving or loading, a rebalance under way (after which the
/// partitions are claimed in the new generation, or leave), a timeout.
fn claim_heals(e: &KafkaError) -> bool {
    e.rdkafka_error_code().is_some_and(|code| {
        super::trouble::is_transient(code)
            || matches!(
                code,
                RDKafkaErrorCode::IllegalGeneration
                    | RDKafkaErrorCode::UnknownMemberId
                    | RDKafkaErrorCode::StaleMemberEpoch
            )
    })
}

/// What to do about a claim's refusal that does not heal.
fn claim_hint(e: &KafkaError) -> &'static str {
    match e.rdkafka_error_code() {
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
            | RDKafkaErrorCode::GroupAuthorizationFailed
            | RDKafkaErrorCode::ClusterAuthorizationFailed,
        ) => super::trouble::hint(e),
        _ => {
            "it does not heal by itself, so the pipeline stops rather than write outputs a \
             successor would not wait for"
        }
    }
}

/// Partitions as messages name them: `in[0], in[1]`.
fn partition_list(starts: &[(String, i32, Option<i64>)]) -> String {
    starts
        .iter()
        .map(|(t, p, _)| format!("{t}[{p}]"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The failure to stop with when `e`, an offset commit's error, says the
/// broker refused the commit metadata as too large: a refusal every later
/// commit would get too.
fn metadata_too_large(e: &KafkaError, tpl: &TopicPartitionList) -> Option<Error> {
    if e.rdkafka_error_code() != Some(RDKafkaErrorCode::OffsetMetadataTooLarge) {
        return None;
    }
    let meta = tpl
        .elements()
        .first()
        .map(|e| e.metadata().to_owned())
        .unwrap_or_default();
    let partitions = serde_json::from_str::<SinkPositions>(&meta)
        .map(|s| s.ends.len() + s.changelog.len())
        .unwrap_or(0);
    Some(Error::CommitMetadataTooLarge {
        bytes: meta.len(),
        partitions,
    })
}

/// The partitions of a librdkafka list.
pub(crate) fn partitions(tpl: &TopicPartitionList) -> Vec<Partition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

impl Core {
    pub fn lock(&self) -> MutexGuard<'_, Shared> {
        super::shared::lock(&self.shared)
    }

    /// The failure that stopped the guard, if one did.
    pub fn failure(&self) -> Option<Error> {
        self.lock().failure()
    }

    /// Stops the guard with `e` and returns it for the caller to return.
    /// When the guard stopped already, `e` is returned as it is (it may be
    /// that first failure, handed out by [`Core::failure`]).
    pub fn stop(&self, e: Error) -> Error {
        let mut s = self.lock();
        if s.failed() {
            return e;
        }
        s.fail(e);
        s.failure().unwrap_or_else(|| Error::Stopped {
            reason: "stopped".into(),
            after: None,
        })
    }

    /// Admits a batch of polled records under one lock (see
    /// [`Shared::admit`]): each record's identity, and whether it is to be
    /// handed on. A failure stops the guard.
    pub fn admit_polled(
        &self,
        identity: &Identity,
        batch: &[BorrowedMessage<'_>],
    ) -> Result<Vec<(Option<Fingerprint>, bool)>> {
        let fps: Vec<Option<Fingerprint>> =
            batch.iter().map(|m| super::identify(identity, m)).collect();
        let offered: Vec<Offered<'_>> = batch
            .iter()
            .zip(&fps)
            .map(|(m, fp)| Offered {
                topic: m.topic(),
                partition: m.partition(),
                offset: m.offset(),
                fp: *fp,
            })
            .collect();
        let mut admitted = Vec::with_capacity(batch.len());
        let r = self.lock().admit(&offered, &mut admitted);
        if let Err(e) = r {
            return Err(self.stop(e));
        }
        Ok(fps.into_iter().zip(admitted).collect())
    }

    /// Fails when this instance's lease on its partitions lapsed (the
    /// process stood still longer than the lease) or librdkafka found its
    /// session timed out: another member may own them now. Queued outputs
    /// are purged, so that none of them is sent (their inputs stay
    /// unhandled).
    pub fn check_lease(&self, consumer: &impl Consumer<GuardContext>) -> Result<()> {
        let lapsed = self.lease.lapsed();
        let lost = self.lease.enabled && lapsed.is_none() && consumer.assignment_lost();
        if lapsed.is_none() && !lost {
            return Ok(());
        }
        let e = match lapsed {
            Some(since) => Error::LeaseLapsed {
                since,
                lease: self.lease.length,
            },
            None => Error::AssignmentLost,
        };
        // The guard stops first, so that the outputs the purge fails are
        // not taken for the cause.
        let e = self.stop(e);
        self.hooks.purge();
        Err(e)
    }

    pub fn is_aborted(&self) -> bool {
        self.lock().aborted
    }

    /// Stops as a crash would: callbacks turn inert, and the guard is
    /// dropped with whatever it had not written.
    pub fn abort(&self) {
        let guard = {
            let mut s = self.lock();
            s.aborted = true;
            // As a crash: inputs handled and not recorded are lost with it.
            s.abort_guard()
        };
        drop(guard);
    }

    /// Closes the state folder: drops the guard (after the consumer's close,
    /// whose last revoke checkpoints with it). Called by the adapters'
    /// close, so that whatever still holds the core does not keep the
    /// folder open; stats read later show the guard's last counters.
    pub fn close_state(&self) {
        let guard = self.lock().take_guard();
        drop(guard);
    }

    /// The partitions assigned to this instance, as its rebalance callback
    /// applied them.
    pub fn assigned(&self) -> Vec<Partition> {
        self.lock().assigned.iter().cloned().collect()
    }

    /// With `stop_at_end` and no partition assigned to this instance:
    /// whether its group has read every partition of the subscribed topics
    /// to its end (its committed offset at the log's end, or the log
    /// empty), so that nothing is left this instance could be given to
    /// read. No end event comes for partitions not assigned, and an empty
    /// assignment alone does not say it: a cooperative rebalance assigns
    /// nothing to a joining member in its first round and moves partitions
    /// to it in the second; under `group.protocol=consumer` librdkafka
    /// reports no empty assignment at all.
    ///
    /// Asked once a rebalance assigned (nothing included), or 5 s after
    /// the consumer was made (librdkafka reports no empty assignment under
    /// `group.protocol=consumer`); at most once a second; and reported once
    /// until a rebalance assigns again. Each request waits 2 s at most; a
    /// failure to ask the broker is logged at debug level and taken as not
    /// at the end.
    pub fn group_at_end(&self, consumer: &impl Consumer<GuardContext>) -> bool {
        {
            let mut s = self.lock();
            if !s.assigned.is_empty()
                || (!s.rebalanced && s.made.elapsed() < Duration::from_secs(5))
                || s.group_end_reported
                || s.group_checked
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
            {
                return false;
            }
            s.group_checked = Some(Instant::now());
        }
        match self.group_read_to_end(consumer) {
            Ok(true) => {
                let mut s = self.lock();
                // Unless a rebalance assigned something meanwhile.
                s.group_end_reported = s.assigned.is_empty();
                s.group_end_reported
            }
            Ok(false) => false,
            Err(e) => {
                tracing::debug!(error = %e, "asking the group's progress failed");
                false
            }
        }
    }

    /// Every partition of the subscribed topics, as the broker's metadata
    /// has them now.
    fn subscribed_partitions(
        consumer: &impl Consumer<GuardContext>,
        ask: Duration,
    ) -> Result<Vec<(Partition, Option<i64>)>> {
        let topics = consumer
            .subscription()
            .map_err(kafka("reading the subscription"))?;
        let mut all: Vec<(Partition, Option<i64>)> = Vec::new();
        for e in topics.elements() {
            let md = consumer
                .fetch_metadata(Some(e.topic()), ask)
                .map_err(kafka("reading the input's metadata"))?;
            for t in md.topics().iter().filter(|t| t.name() == e.topic()) {
                all.extend(
                    t.partitions()
                        .iter()
                        .map(|p| ((t.name().to_owned(), p.id()), None)),
                );
            }
        }
        Ok(all)
    }

    /// The partitions of the subscribed topics that no member of the
    /// group is assigned, as the group's coordinator describes a stable
    /// group; `None` when it cannot tell (a rebalance under way, a request
    /// refused or unanswered, an assignment it cannot read).
    fn unassigned(&self, consumer: &impl Consumer<GuardContext>) -> Option<BTreeSet<Partition>> {
        const ASK: Duration = Duration::from_secs(2);
        let all = Self::subscribed_partitions(consumer, ASK)
            .inspect_err(|e| tracing::debug!(error = %e, "reading the inputs' partitions failed"))
            .ok()?;
        let groups = consumer
            .fetch_group_list(Some(&self.group), ASK)
            .inspect_err(|e| {
                tracing::debug!(error = %e, "describing the group failed");
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::UnsupportedFeature) {
                    self.watch_lock().unsupported = true;
                }
            })
            .ok()?;
        let group = groups.groups().iter().find(|g| g.name() == self.group)?;
        if group.state() != "Stable" || group.protocol_type() != "consumer" {
            return None;
        }
        let mut taken = BTreeSet::new();
        for m in group.members() {
            taken.extend(assignment_partitions(m.assignment().unwrap_or_default())?);
        }
        Some(
            all.into_iter()
                .map(|(tp, _)| tp)
                .filter(|tp| !taken.contains(tp))
                .collect(),
        )
    }

    /// One check of [`AssignmentWatcher`]'s thread: notes the partitions
    /// the group's assignment leaves out, and asks the run loop to rejoin
    /// for those left out at two checks in a row. Returns false once the
    /// brokers cannot describe groups, which ends the thread.
    fn check_assignment(&self, consumer: &impl Consumer<GuardContext>) -> bool {
        let now = self.unassigned(consumer);
        let mut w = self.watch_lock();
        if let Some(now) = now {
            let again: Vec<Partition> = now.intersection(&w.left_out).cloned().collect();
            w.left_out = now;
            if !again.is_empty() {
                w.rejoin = again;
            }
        }
        !w.unsupported
    }

    /// For a static member: rejoins the group when its assignment left the
    /// same partitions out at two checks in a row of the group's watch
    /// ([`AssignmentWatcher`], every `WATCH_EVERY`). Called from the run
    /// loop at each checkpoint; it reads only what the watch found.
    ///
    /// A static member that rejoins a stable group (a restart within the
    /// session timeout) gets its old assignment back without a rebalance.
    /// If partitions were added to an input since, and this member leads
    /// the group, they are never assigned: the member's view of the topic
    /// is taken as it rejoins, so its metadata refreshes see no change.
    /// Kafka lets such a leader know that it skipped the assignment
    /// (KIP-814), which librdkafka does not act on. Seen on Kafka 4.4: a
    /// partition added while the only instance was stopped for a moment
    /// was not read, with `topic.metadata.refresh.interval.ms` at 1 s,
    /// for as long as it ran.
    pub fn watch_assignment(&self, consumer: &impl Consumer<GuardContext>) -> Result<()> {
        if !self.static_member {
            return Ok(());
        }
        let again = std::mem::take(&mut self.watch_lock().rejoin);
        if again.is_empty() {
            return Ok(());
        }
        self.rejoin(consumer, &again)
    }

    fn watch_lock(&self) -> std::sync::MutexGuard<'_, AssignmentWatch> {
        self.watch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Leaves the group's assignment and subscribes again, so that the
    /// group rebalances over the topics as they are now: the partitions
    /// assigned to this instance are revoked, with a checkpoint, and the
    /// new assignment follows.
    fn rejoin(&self, consumer: &impl Consumer<GuardContext>, missing: &[Partition]) -> Result<()> {
        let named: Vec<String> = missing.iter().map(|(t, p)| format!("{t}[{p}]")).collect();
        tracing::warn!(
            partitions = %named.join(", "),
            "input partitions are assigned to no member of the group (a static member that rejoined got its old assignment back, without partitions added since): rejoining so that the group assigns them"
        );
        let topics: Vec<String> = consumer
            .subscription()
            .map_err(kafka("reading the subscription"))?
            .elements()
            .iter()
            .map(|e| e.topic().to_owned())
            .collect();
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        {
            let mut w = self.watch_lock();
            w.left_out.clear();
            w.rejoin.clear();
        }
        consumer.unsubscribe();
        consumer
            .subscribe(&topics)
            .map_err(kafka("subscribing again"))
    }

    fn group_read_to_end(&self, consumer: &impl Consumer<GuardContext>) -> Result<bool> {
        // Each request briefly: the run loop waits for them, and a stop
        // asked meanwhile waits too.
        const ASK: Duration = Duration::from_secs(2);
        let all = Self::subscribed_partitions(consumer, ASK)?;
        if all.is_empty() {
            return Ok(false);
        }
        let mut asked = TopicPartitionList::new();
        for ((topic, p), _) in &all {
            asked.add_partition(topic, *p);
        }
        let committed = consumer
            .committed_offsets(asked, ASK)
            .map_err(kafka("reading the group's committed offsets"))?;
        let ends = log_offsets(consumer, &all, Offset::End, ASK)
            .map_err(kafka("reading input watermarks"))?;
        // The log's start is asked, as in `at_end`, only for partitions
        // whose committed offset is short of their end.
        let mut short = Vec::new();
        for ((topic, p), _) in &all {
            let hi = offset_of(&ends, topic, *p, "end")?;
            if position_in(&committed, topic, *p).unwrap_or(0) < hi {
                short.push(((topic.clone(), *p), None));
            }
        }
        if short.is_empty() {
            return Ok(true);
        }
        let starts = log_offsets(consumer, &short, Offset::Beginning, ASK)
            .map_err(kafka("reading input watermarks"))?;
        for ((topic, p), _) in &short {
            if offset_of(&starts, topic, *p, "start")? < offset_of(&ends, topic, *p, "end")? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Notes that partition `eof` reached its end, and tells whether every
    /// assigned partition was read to its high watermark. The watermarks
    /// are read only once every assigned partition has reported its end,
    /// all in one request to each leader: a request waits behind the
    /// consumer's own fetch on that connection, up to `fetch.wait.max.ms`
    /// at the tail, so asked one by one they took about half a second a
    /// partition (two minutes for 256, BENCHMARKS.md).
    ///
    /// A partition is read to where the guard's last record ends or, if
    /// further, to librdkafka's position in it: the log of a topic written
    /// in transactions ends with a transaction marker (and may hold
    /// aborted records before it), which the consumer steps over without
    /// handing on a record, so no record's offset reaches the watermark.
    /// The position counts only records already handed on, all of which
    /// the caller admitted before this call; no partition is at its end
    /// while any is held. A partition short of its end by both is at its
    /// end all the same when nothing is left it can read: its log starts
    /// at its end (retention deleted its records), or retention passed
    /// its position and its reading is reset to the end
    /// (`auto.offset.reset=latest`); the log's start is asked, again in
    /// one request a leader, only then. (A partition with no position at
    /// all starts at an end pinned when it arrived, under `latest`: see
    /// [`Core::start_at_ends`].)
    pub fn at_end(&self, consumer: &impl Consumer<GuardContext>, eof: i32) -> Result<bool> {
        let assigned = {
            let mut s = self.lock();
            s.at_eof.insert(eof);
            // A held partition's records, even those librdkafka handed on
            // before its pause took hold, are read again once released.
            if s.assigned.is_empty()
                || s.held.is_some()
                || s.assigned.iter().any(|(_, p)| !s.at_eof.contains(p))
            {
                return Ok(false);
            }
            assigned_nexts(&s)
        };
        let positions = consumer
            .position()
            .map_err(kafka("reading input positions"))?;
        let ends = log_offsets(consumer, &assigned, Offset::End, self.timeout)
            .map_err(kafka("reading input watermarks"))?;
        let mut short = Vec::new();
        for ((topic, p), next) in &assigned {
            let hi = offset_of(&ends, topic, *p, "end")?;
            let read = (*next).max(position_in(&positions, topic, *p));
            if read.unwrap_or(0) < hi {
                short.push(((topic.clone(), *p), read, hi));
            }
        }
        if short.is_empty() {
            return self.covered(consumer);
        }
        // Short of its end, a partition may still have nothing it can
        // read: its log starts at its end (retention deleted every record),
        // or its position is below the log's start and reading is reset to
        // the end (`auto.offset.reset=latest`). librdkafka has no position
        // for a partition until it hands on a record from it.
        let asked: Vec<(Partition, Option<i64>)> = short
            .iter()
            .map(|(tp, read, _)| (tp.clone(), *read))
            .collect();
        let starts = log_offsets(consumer, &asked, Offset::Beginning, self.timeout)
            .map_err(kafka("reading input watermarks"))?;
        for ((topic, p), read, hi) in short {
            let low = offset_of(&starts, &topic, p, "start")?;
            let from = match read {
                Some(o) if o >= low => o,
                // Below the log's start, or nowhere yet: reading starts
                // where auto.offset.reset says.
                _ if self.start_at_end => hi,
                _ => low,
            };
            if from < hi {
                return Ok(false);
            }
        }
        self.covered(consumer)
    }

    /// With every assigned partition at its end: whether the group's
    /// assignment covers the inputs, so that the end is the inputs' end.
    /// Otherwise (see [`Core::watch_assignment`]) it rejoins the group at
    /// once, and the end waits for the partitions it is given.
    fn covered(&self, consumer: &impl Consumer<GuardContext>) -> Result<bool> {
        if !self.static_member || self.watch_lock().unsupported {
            return Ok(true);
        }
        match self.unassigned(consumer) {
            Some(missing) if !missing.is_empty() => {
                let missing: Vec<Partition> = missing.into_iter().collect();
                self.rejoin(consumer, &missing)?;
                Ok(false)
            }
            _ => Ok(true),
        }
    }

    /// The error that stops the guard for a consumer error that does not
    /// heal, naming where it happened. librdkafka does not pass the failed
    /// record's partition through rdkafka, so the location is every
    /// assigned partition not yet read to its high watermark, with the
    /// offset it is stuck at.
    pub fn consume_failure(&self, consumer: &impl Consumer<GuardContext>, e: KafkaError) -> Error {
        let mut at = Vec::new();
        let positions = consumer.position().ok();
        let assigned = assigned_nexts(&self.lock());
        let ends = log_offsets(consumer, &assigned, Offset::End, Duration::from_secs(2)).ok();
        for ((topic, p), next) in assigned {
            let next = next.max(
                positions
                    .as_ref()
                    .and_then(|tpl| position_in(tpl, &topic, p)),
            );
            let high = ends.as_ref().and_then(|tpl| position_in(tpl, &topic, p));
            if next.zip(high).is_none_or(|(n, h)| n < h) {
                at.push(match next {
                    Some(o) => format!("{topic}[{p}] at offset {o}"),
                    None => format!("{topic}[{p}]"),
                });
            }
        }
        let location = match at.len() {
            0 => "the input".to_owned(),
            1 => at.remove(0),
            _ => format!("one of {}", at.join(", ")),
        };
        self.stop(Error::Consume {
            location,
            hint: super::trouble::hint(&e),
            source: Box::new(e),
        })
    }

    /// Sets the gauges of this instance's partitions: those assigned to it
    /// (as its rebalance callback applied them), and of them those held,
    /// paused with nothing written, for a previous owner's outputs in
    /// flight or for a claim the broker has not taken yet.
    fn publish_partitions(&self) {
        let assigned = self.lock().assigned.len();
        self.meters.assigned_partitions.set(assigned as f64);
        self.publish_held();
    }

    /// Sets the gauge of the held partitions alone: a release or a new
    /// hold leaves the assignment as it was.
    fn publish_held(&self) {
        let held = self.lock().held.as_ref().map_or(0, |h| h.partitions.len());
        self.meters.held_partitions.set(held as f64);
    }

    /// The held partitions, as a list to pause.
    fn held_list(&self) -> Option<TopicPartitionList> {
        let s = self.lock();
        let h = s.held.as_ref()?;
        let mut tpl = TopicPartitionList::new();
        for (t, p) in &h.partitions {
            tpl.add_partition(t, *p);
        }
        Some(tpl)
    }

    /// When the held partitions' wait is over: reconciles the output, then
    /// resumes them from their starts. Returns when the wait ends, if it has
    /// not yet.
    ///
    /// # Errors
    /// A failed reconciliation, seek or resume.
    pub fn recover_held(&self, consumer: &impl Consumer<GuardContext>) -> Result<Option<Instant>> {
        let now = Instant::now();
        let held = {
            let mut s = self.lock();
            match s.held.take_if(|h| h.until <= now) {
                Some(held) => held,
                // Nothing held, or held until later.
                None => return Ok(s.held.as_ref().map(|h| h.until)),
            }
        };
        let released = self.release(consumer, held);
        // Resumed, held again after a refused claim, or stopped: taken
        // from the state either way.
        self.publish_held();
        released
    }

    /// Reconciles the output of partitions whose wait is over (once),
    /// claims them, and resumes them from their starts; a refused claim
    /// holds them again, and returns when to try again.
    fn release(
        &self,
        consumer: &impl Consumer<GuardContext>,
        held: Held,
    ) -> Result<Option<Instant>> {
        if !held.reconciled {
            self.hooks
                .reconcile(self, held.manifest.as_ref(), &held.commits)?;
        }
        let starts: Vec<(String, i32, Option<i64>)> = {
            let mut s = self.lock();
            let mut starts = Vec::with_capacity(held.partitions.len());
            for (t, p) in &held.partitions {
                let next = s
                    .tracks
                    .get(t)
                    .and_then(|m| m.get(p))
                    .and_then(|tr| tr.next);
                starts.push((t.clone(), *p, next));
                // Its records skipped while held are read again.
                s.at_eof.remove(p);
            }
            starts
        };
        if let Some(error) = self.claim(consumer, &starts, held.manifest.as_ref(), &held.commits)? {
            return self
                .hold_unclaimed(&starts, held.from, error, held.refusal)
                .map(Some);
        }
        let mut tpl = TopicPartitionList::new();
        for (t, p, next) in &starts {
            if let Some(next) = next {
                tpl.add_partition_offset(t, *p, Offset::Offset(*next))
                    .map_err(kafka("building the list to resume"))?;
            }
        }
        if tpl.count() > 0 {
            consumer
                .seek_partitions(tpl.clone(), self.timeout)
                .map_err(kafka("seeking held partitions to their starts"))?;
            consumer
                .resume(&tpl)
                .map_err(kafka("resuming held partitions"))?;
        }
        tracing::info!(
            previous_owner = %held.from,
            partitions = tpl.count(),
            "held partitions reconciled and resumed"
        );
        Ok(None)
    }

    /// Writes a checkpoint and commits it. With `leaving`, it is a revoke's:
    /// every output handed on must be acked already (flushed by the
    /// caller), it commits the leaving partitions only, and it marks the
    /// handover clean.
    ///
    /// # Errors
    /// A store failure, outputs still unacked at a revoke, or a lease that
    /// lapsed: a process that stood still past it (frozen while it waited
    /// for acks, say) may no longer own what it would write down.
    pub fn checkpoint(
        &self,
        consumer: &impl Consumer<GuardContext>,
        leaving: Option<&[Partition]>,
        mode: CommitMode,
    ) -> Result<()> {
        self.check_lease(consumer)?;
        let (positions, meta) = {
            let mut s = self.lock();
            if let Some(e) = s.failure() {
                return Err(e);
            }
            if let Some(leaving) = leaving {
                let unacked = s.unacked_of(leaving);
                if unacked > 0 {
                    return Err(Error::Stopped {
                        reason: format!(
                            "{unacked} outputs still unacked after the flush timeout ({:?}) before a revoke",
                            self.timeout
                        ),
                        after: None,
                    });
                }
            }
            if let Some(cl) = &self.changelog {
                cl.before_checkpoint(&mut s)?;
            }
            let done = s.checkpoint(leaving, leaving.is_some())?;
            if let Some(cl) = &self.changelog {
                cl.after_checkpoint(&mut s)?;
            }
            done
        };
        let tpl = commit_list(&positions, &meta)?;
        self.commit(consumer, &tpl, mode)
    }

    /// Commits input offsets: to the group (advisory), or through the
    /// adapter (inside a transaction).
    fn commit(
        &self,
        consumer: &impl Consumer<GuardContext>,
        tpl: &TopicPartitionList,
        mode: CommitMode,
    ) -> Result<()> {
        if tpl.count() == 0 || self.hooks.commit(tpl, consumer.group_metadata())? {
            return Ok(());
        }
        // librdkafka reports no outcome of an asynchronous manual commit,
        // so a broker that refuses the metadata as too large would go
        // unseen. Metadata longer than any the broker has taken is
        // committed synchronously: the run's first commit, then one each
        // time an offset gains a digit or a partition is added.
        let len = tpl.elements().first().map_or(0, |e| e.metadata().len());
        let mode = if len > self.metadata_taken.load(Ordering::Relaxed) {
            CommitMode::Sync
        } else {
            mode
        };
        match consumer.commit(tpl, mode) {
            Ok(()) => {
                if matches!(mode, CommitMode::Sync) {
                    self.metadata_taken.fetch_max(len, Ordering::Relaxed);
                }
                Ok(())
            }
            Err(e) => match metadata_too_large(&e, tpl) {
                Some(refused) => Err(self.stop(refused)),
                // The manifest is the truth; a failed commit only slows down
                // a stateless newcomer, and the next checkpoint commits again.
                None => {
                    tracing::warn!(error = %e, "offset commit failed");
                    Ok(())
                }
            },
        }
    }

    /// Claims arriving partitions before any output of theirs is written:
    /// commits each at its start, with metadata that names this instance,
    /// no clean handover, and the sink positions its reconciliation started
    /// from. Without the claim the group would still hold the previous
    /// owner's clean handover, or nothing, until this instance's first
    /// checkpoint; a successor that took the partitions from this instance,
    /// frozen, cut off or killed before then, would neither wait for its
    /// outputs in flight nor read back those it wrote. Returns the broker's
    /// refusal, if it refused for a reason that may pass (a rebalance under
    /// way, a coordinator moving): the caller then holds the partitions and
    /// claims them again ([`Held`]); a partition with no start anywhere
    /// then gets the one claimed, to resume from. A refusal that does not
    /// pass (a missing permission; metadata too large, which every later
    /// commit would meet too) stops the pipeline.
    fn claim(
        &self,
        consumer: &impl Consumer<GuardContext>,
        starts: &[(String, i32, Option<i64>)],
        manifest: Option<&SinkPositions>,
        commits: &[SinkPositions],
    ) -> Result<Option<String>> {
        if !self.fenced || !self.hooks.writes() || starts.is_empty() {
            return Ok(None);
        }
        let meta = {
            let s = self.lock();
            let Some(sink) = s.sink.as_ref() else {
                return Ok(None);
            };
            // Reconciliation read each output partition from the lowest
            // position a source names, or from its start when none does;
            // the claim names the same, so that a successor reads at least
            // as much. After reconciliation the sink knows every output
            // partition.
            let ends: BTreeMap<i32, i64> = sink
                .ends
                .keys()
                .map(|p| {
                    let from = manifest
                        .into_iter()
                        .chain(commits)
                        .filter(|source| source.topic == sink.topic)
                        .filter_map(|source| source.ends.get(p).copied())
                        .min();
                    (*p, from.unwrap_or(0))
                })
                .collect();
            SinkPositions {
                topic: sink.topic.clone(),
                ends,
                instance: self.instance.clone(),
                clean: false,
                in_flight_ms: sink.in_flight_ms,
                changelog: BTreeMap::new(),
            }
        };
        let meta = meta.encode()?;
        let mut positions = Vec::with_capacity(starts.len());
        for (topic, p, start) in starts {
            let offset = match start {
                Some(o) => *o,
                // Under `latest` every start was pinned on arrival
                // (`start_at_ends`): one with none starts at the log's start.
                None => {
                    watermarks(consumer, topic, *p, self.timeout)
                        .map_err(kafka("reading input watermarks"))?
                        .0
                }
            };
            positions.push((topic.clone(), *p, offset));
        }
        let tpl = commit_list(&positions, &meta)?;
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => {
                self.metadata_taken.fetch_max(meta.len(), Ordering::Relaxed);
                tracing::debug!(partitions = tpl.count(), "arriving partitions claimed");
                Ok(None)
            }
            Err(e) => match metadata_too_large(&e, &tpl) {
                Some(refused) => Err(self.stop(refused)),
                None if !claim_heals(&e) => Err(Error::Stopped {
                    reason: format!(
                        "the broker refused this instance's claim of {} (the commit before their first output that makes a successor wait for their outputs in flight): {e}; {}",
                        partition_list(starts),
                        claim_hint(&e)
                    ),
                    after: None,
                }),
                None => {
                    let mut s = self.lock();
                    for ((topic, p, start), (_, _, claimed)) in starts.iter().zip(&positions) {
                        if start.is_none() {
                            s.track(topic, *p).next = Some(*claimed);
                        }
                    }
                    Ok(Some(e.to_string()))
                }
            },
        }
    }

    /// A revoke: flushes, checkpoints and commits the leaving partitions,
    /// then forgets them. Records of theirs still being processed are left
    /// to their next owner: their outputs are not written.
    fn on_revoke(&self, consumer: &BaseConsumer<GuardContext>, tpl: &TopicPartitionList) {
        let started = Instant::now();
        let span = tracing::info_span!("replayguard_revoke", partitions = tpl.count());
        let _e = span.enter();
        let leaving = partitions(tpl);
        let done = self
            .hooks
            .flush(self.timeout)
            .and_then(|()| self.checkpoint(consumer, Some(&leaving), CommitMode::Sync));
        if let Err(e) = done {
            // `fail` logs the stop, once.
            tracing::debug!(error = %e, error_kind = e.kind(), "checkpoint on revoke failed");
            self.lock().fail(e);
            return;
        }
        self.lock().forget(&leaving);
        self.meters
            .checkpoint_seconds
            .record(started.elapsed().as_secs_f64());
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            "revoked partitions checkpointed"
        );
    }

    /// A revoke of partitions already lost (the session timed out): nothing
    /// is committed for them, and queued outputs are purged, since another
    /// member may own them.
    fn on_lost(&self, consumer: &BaseConsumer<GuardContext>, tpl: &TopicPartitionList) {
        tracing::warn!("assignment lost: not committing for partitions another member may own");
        if self.fenced {
            let _ = self.check_lease(consumer);
        }
        self.lock().forget(&partitions(tpl));
    }

    /// Recovers arriving partitions and sets their start offsets in `tpl`.
    fn on_assign(
        &self,
        consumer: &BaseConsumer<GuardContext>,
        tpl: &mut TopicPartitionList,
    ) -> Result<()> {
        let started = Instant::now();
        let span = tracing::info_span!("replayguard_recover", partitions = tpl.count());
        let _e = span.enter();
        let committed = patiently(self.timeout, || {
            consumer.committed_offsets(tpl.clone(), self.timeout)
        })
        .map_err(kafka("reading committed offsets"))?;
        let manifest_sink: Option<SinkPositions> = self
            .lock()
            .guard_ref()
            .and_then(|g| g.manifest())
            .and_then(|m| serde_json::from_slice(&m.sink).ok());
        let mut arrival = Arrival::default();
        for e in committed.elements() {
            self.arrive(consumer, e, &mut arrival)?;
        }
        if self.start_at_end {
            self.start_at_ends(consumer, &mut arrival.starts)?;
        }
        if let Some(cl) = &self.changelog {
            self.restore(cl, &arrival.starts, manifest_sink.as_ref())?;
        }
        // An assignment that brings no partition (a cooperative rebalance's
        // first step) reconciles nothing: with no position named anywhere,
        // it would read the whole output.
        if self.hooks.writes() && !arrival.starts.is_empty() {
            match arrival.zombie.filter(|(w, _)| self.fenced && !w.is_zero()) {
                Some((wait, from)) => {
                    super::lease::note_wait(wait, &from, &self.meters);
                    self.hold(
                        &arrival.starts,
                        wait,
                        Held {
                            until: Instant::now(),
                            from,
                            partitions: Vec::new(),
                            manifest: manifest_sink,
                            commits: arrival.from_commits,
                            reconciled: false,
                            refusal: None,
                        },
                    );
                }
                None => {
                    self.hooks
                        .reconcile(self, manifest_sink.as_ref(), &arrival.from_commits)?;
                    if let Some(error) = self.claim(
                        consumer,
                        &arrival.starts,
                        manifest_sink.as_ref(),
                        &arrival.from_commits,
                    )? {
                        self.hold_unclaimed(
                            &arrival.starts,
                            "(none: a refused claim)".into(),
                            error,
                            None,
                        )?;
                    }
                }
            }
        }
        for (topic, p, start) in arrival.starts {
            if let Some(o) = start
                && let Some(mut el) = tpl.find_partition(&topic, p)
            {
                el.set_offset(Offset::Offset(o))
                    .map_err(kafka("setting a start offset"))?;
            }
        }
        let elapsed = started.elapsed();
        self.meters.recovery_seconds.record(elapsed.as_secs_f64());
        self.lock().publish_state();
        tracing::info!(
            ms = elapsed.as_millis() as u64,
            "assigned partitions recovered"
        );
        Ok(())
    }

    /// One arriving partition: where it starts (the further of this
    /// folder's position and the group's), a refusal when its topic ends
    /// below that (recreated), and what the group's metadata says of its
    /// previous owner.
    fn arrive(
        &self,
        consumer: &BaseConsumer<GuardContext>,
        e: rdkafka::topic_partition_list::TopicPartitionListElem<'_>,
        arrival: &mut Arrival,
    ) -> Result<()> {
        let (topic, p) = (e.topic().to_owned(), e.partition());
        let group_pos = match e.offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        };
        let (lane, local) = {
            let mut s = self.lock();
            let lane = s.lane(&topic, p);
            // As of the last checkpoint: handled inputs waiting to be
            // recorded do not move it.
            let local = lane
                .and_then(|l| s.guard_ref().and_then(|g| g.position(l)))
                .map(|o| o as i64);
            (lane, local)
        };
        let start = match (local, group_pos) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        if let Some(known) = start.filter(|o| *o > 0) {
            let (_, hi) = watermarks(consumer, &topic, p, self.timeout)
                .map_err(kafka("reading input watermarks"))?;
            if hi < known {
                return Err(Error::TopicRewound {
                    topic,
                    partition: p,
                    end: hi,
                    known,
                    done: "handled",
                    risk: "skip the new topic's records below that offset",
                });
            }
        }
        let sink = serde_json::from_str::<SinkPositions>(e.metadata()).ok();
        if let Some(sink) = &sink
            && group_pos >= local
            && !sink.clean
            && !sink.instance.is_empty()
            && sink.instance != self.instance
        {
            let wait = Duration::from_millis(sink.in_flight_ms);
            if arrival.zombie.as_ref().is_none_or(|(w, _)| wait > *w) {
                arrival.zombie = Some((wait, sink.instance.clone()));
            }
        }
        // Reconciliation starts at the group's sink positions too, even when
        // this folder is as far along: they are as of the partition's last
        // commit, while the folder's have moved on with its other partitions'
        // outputs since. An instance that owned the partition in between and
        // stopped before its first commit wrote in that gap.
        if let Some(sink) = sink {
            arrival.from_commits.push(sink);
        }
        if lane.is_some() && local.is_none() {
            tracing::info!(
                topic = %topic,
                partition = p,
                start = ?start,
                "partition arrives with no local state: it starts at the group's committed offset, and only identities within the output reconciliation (pipeline) or handled from now on (consumer) are known"
            );
        } else {
            tracing::debug!(topic = %topic, partition = p, ?start, ?local, ?group_pos, "partition assigned");
        }
        let mut s = self.lock();
        let t = s.track(&topic, p);
        t.next = start;
        t.inflight.clear();
        t.inflight_fps.clear();
        arrival.starts.push((topic, p, start));
        Ok(())
    }

    /// Under `auto.offset.reset=latest`, pins each arriving partition with
    /// no position anywhere (neither the folder's nor the group's) to its
    /// end as the isolation level sees it, asked in one request a leader,
    /// and starts it there. Left to librdkafka's own reset, such a
    /// partition has no position until a record of it is handed on: a
    /// checkpoint then has nothing to commit for it, so the next run,
    /// reset to the end again, skips every record written between the
    /// two; and a stop at the end could not tell a partition reset after
    /// records came from one with nothing to read.
    fn start_at_ends(
        &self,
        consumer: &BaseConsumer<GuardContext>,
        starts: &mut [(String, i32, Option<i64>)],
    ) -> Result<()> {
        let unknown: Vec<(Partition, Option<i64>)> = starts
            .iter()
            .filter(|(_, _, start)| start.is_none())
            .map(|(topic, p, _)| ((topic.clone(), *p), None))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        let ends = log_offsets(consumer, &unknown, Offset::End, self.timeout)
            .map_err(kafka("reading input watermarks"))?;
        let mut s = self.lock();
        for (topic, p, start) in starts.iter_mut().filter(|(_, _, start)| start.is_none()) {
            let end = offset_of(&ends, topic, *p, "end")?;
            *start = Some(end);
            s.track(topic, *p).next = Some(end);
        }
        Ok(())
    }

    /// Takes over, from the changelog, the identities other instances
    /// handled in the arriving partitions (see [`super::changelog`]).
    fn restore(
        &self,
        cl: &super::changelog::Changelog,
        arriving: &[(String, i32, Option<i64>)],
        manifest: Option<&SinkPositions>,
    ) -> Result<()> {
        if arriving.is_empty() {
            return Ok(());
        }
        let reader = cl.reader()?;
        for (topic, p, _) in arriving {
            let Some(lane) = self.lock().lane(topic, *p) else {
                continue;
            };
            let local_end = manifest.and_then(|m| m.changelog.get(p).copied());
            let started = Instant::now();
            let restored = cl.restore(&reader, &self.shared, lane, topic, *p, local_end)?;
            if restored.records > 0 {
                tracing::info!(
                    topic = %topic,
                    partition = p,
                    changelog = %cl.topic,
                    records = restored.records,
                    identities = restored.identities,
                    ms = started.elapsed().as_millis() as u64,
                    "identities handled by another instance restored from the changelog"
                );
            }
        }
        Ok(())
    }

    /// Holds arriving partitions until `wait` has passed, see [`Held`]:
    /// `why` gives the rest (its `until` and `partitions` are set here),
    /// merged into partitions held already. Returns when they are released.
    fn hold(&self, starts: &[(String, i32, Option<i64>)], wait: Duration, why: Held) -> Instant {
        let mut s = self.lock();
        let arriving = starts.iter().map(|(t, p, _)| (t.clone(), *p));
        let until = Instant::now() + wait;
        let until = match s.held.as_mut() {
            Some(h) => {
                h.until = h.until.max(until);
                h.partitions.extend(arriving);
                h.commits.extend(why.commits);
                h.reconciled &= why.reconciled;
                if h.refusal.is_none() {
                    h.refusal = why.refusal;
                }
                h.until
            }
            None => {
                s.held = Some(Held {
                    until,
                    partitions: arriving.collect(),
                    ..why
                });
                until
            }
        };
        s.wake.notify_one();
        until
    }

    /// Holds partitions whose claim the broker refused (after `earlier`
    /// refusals), their output already reconciled, until the claim is
    /// tried again. Returns when that is.
    ///
    /// # Errors
    /// When the broker has refused it for longer than the timeout: the
    /// pipeline stops rather than leave them unread for good.
    fn hold_unclaimed(
        &self,
        starts: &[(String, i32, Option<i64>)],
        from: String,
        error: String,
        earlier: Option<Refusal>,
    ) -> Result<Instant> {
        let refusal = Refusal::after(earlier, error);
        self.meters.claims_refused.increment(1);
        let refused_for = refusal.since.elapsed();
        if refused_for >= self.timeout {
            return Err(Error::Stopped {
                reason: format!(
                    "the broker refused {} times, for {} ms, to take this instance's claim of {} (a commit before their first output, without which a successor would not wait for their outputs in flight); the last refusal: {}",
                    refusal.attempts,
                    refused_for.as_millis(),
                    partition_list(starts),
                    refusal.error
                ),
                after: None,
            });
        }
        let delay = refusal.delay();
        tracing::warn!(
            error = %refusal.error,
            partitions = starts.len(),
            attempt = refusal.attempts,
            retry_ms = delay.as_millis() as u64,
            "the broker refused to claim arriving partitions: they stay paused, with nothing written for them, until a claim is taken"
        );
        Ok(self.hold(
            starts,
            delay,
            Held {
                until: Instant::now(),
                from,
                partitions: Vec::new(),
                manifest: None,
                commits: Vec::new(),
                reconciled: true,
                refusal: Some(refusal),
            },
        ))
    }
}

/// What [`Core::on_assign`] gathers over the arriving partitions.
#[derive(Default)]
struct Arrival {
    /// Sink positions from the group's metadata: reconciliation starts
    /// there too.
    from_commits: Vec<SinkPositions>,
    /// The longest a previous owner that left without a clean handover can
    /// still have outputs in flight, and who it was.
    zombie: Option<(Duration, String)>,
    starts: Vec<(String, i32, Option<i64>)>,
}

/// The consumer context of guarded consumers and pipelines.
///
/// On revoke it checkpoints before the callback returns (the pipeline's
/// outputs are flushed first); on assign it recovers the arriving
/// partitions (including output reconciliation in a pipeline) and sets
/// their start offsets before the assignment takes effect, so no record of
/// theirs is delivered before recovery.
pub struct GuardContext {
    pub(crate) core: Arc<Core>,
    /// Whether the group rebalances cooperatively (incremental assigns),
    /// as the configuration decides ([`setup::cooperative`]). Worked out
    /// once, so that the callback never asks librdkafka: its
    /// `rd_kafka_rebalance_protocol()` waits for the consumer group with no
    /// bound, and a closing consumer's group may never answer.
    cooperative: bool,
}

impl GuardContext {
    /// The context of a consumer made from `cfg`.
    pub(crate) fn new(core: Arc<Core>, cfg: &ClientConfig) -> Self {
        GuardContext {
            core,
            cooperative: setup::cooperative(cfg),
        }
    }
}

impl ClientContext for GuardContext {
    /// librdkafka's log, passed on as rdkafka does, and one line of ours
    /// at warning level when it moved an input partition's position
    /// because that offset was out of range: the records between were
    /// deleted (retention, compaction or DeleteRecords) before they were
    /// read, which the command line would not show otherwise (it leaves
    /// librdkafka's log out by default).
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        let warning = !matches!(
            level,
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info | RDKafkaLogLevel::Debug
        );
        if warning && fac == "OFFSET" && message.contains("offset reset") {
            tracing::warn!(
                reason = message,
                "an input partition's position was reset: the records deleted before they were read cannot reach the output"
            );
        }
        rdkafka::client::DefaultClientContext.log(level, fac, message);
    }

    /// A client-wide error that means the connection cannot work (refused
    /// credentials, TLS, an error librdkafka calls fatal) stops the guard;
    /// any other is logged at debug level, and librdkafka retries it.
    fn error(&self, error: KafkaError, reason: &str) {
        if super::trouble::global_is_fatal(&error) {
            let hint = super::trouble::hint(&error);
            self.core.lock().fail(Error::Connect {
                brokers: self.core.brokers.clone(),
                reason: format!("the consumer's connection failed: {reason}"),
                hint,
                source: Box::new(error),
            });
        } else {
            tracing::debug!(error = %error, reason, "kafka client error; librdkafka retries it");
        }
    }

    /// librdkafka's statistics, emitted every `statistics.interval.ms`
    /// (off by default): the consumer lag of each assigned partition, high
    /// watermark less the position, into [`super::PipelineStats::lag`] or
    /// [`super::ConsumerStats::lag`] and the `replayguard_consumer_lag`
    /// gauge.
    fn stats(&self, statistics: Statistics) {
        let mut watermarks = BTreeMap::new();
        for (topic, t) in &statistics.topics {
            for (p, part) in &t.partitions {
                if *p < 0 || part.hi_offset < 0 {
                    continue;
                }
                let known = |o: i64| (o >= 0).then_some(o);
                let fallback = known(part.app_offset)
                    .or(known(part.committed_offset))
                    .or(known(part.lo_offset));
                watermarks.insert((topic.clone(), *p), (part.hi_offset, fallback));
            }
        }
        self.core.lock().set_watermarks(watermarks);
    }
}

/// Each assigned partition with the offset after the last record the
/// guard admitted from it, if any.
fn assigned_nexts(s: &Shared) -> Vec<(Partition, Option<i64>)> {
    s.assigned
        .iter()
        .map(|(topic, p)| {
            let next = s
                .tracks
                .get(topic)
                .and_then(|m| m.get(p))
                .and_then(|t| t.next);
            ((topic.clone(), *p), next)
        })
        .collect()
}

/// The latest offset of each of `partitions` as `consumer`'s isolation
/// level sees it (the high watermark, or the last stable offset under
/// read_committed) with `which` [`Offset::End`], or the log's start with
/// [`Offset::Beginning`]; in one request to each leader: one a partition
/// would wait behind the consumer's own fetch each time (see
/// [`Core::at_end`]).
fn log_offsets(
    consumer: &impl Consumer<GuardContext>,
    partitions: &[(Partition, Option<i64>)],
    which: Offset,
    timeout: Duration,
) -> rdkafka::error::KafkaResult<TopicPartitionList> {
    let mut tpl = TopicPartitionList::new();
    for ((topic, p), _) in partitions {
        tpl.add_partition_offset(topic, *p, which)?;
    }
    patiently(timeout, || consumer.offsets_for_times(tpl.clone(), timeout))
}

/// The offset of `topic[p]` in an answer of [`log_offsets`]; `what` names
/// it (`end`, `start`) in the error when the broker gave none.
fn offset_of(tpl: &TopicPartitionList, topic: &str, p: i32, what: &str) -> Result<i64> {
    if let Some(Err(e)) = tpl.find_partition(topic, p).map(|e| e.error()) {
        return Err(Error::Kafka {
            operation: format!("reading the {what} offset of {topic}[{p}]"),
            source: e,
        });
    }
    position_in(tpl, topic, p).ok_or_else(|| Error::Stopped {
        reason: format!("the broker gave no {what} offset for input {topic}[{p}]"),
        after: None,
    })
}

/// The offset of `topic`'s partition `p` in `tpl` (from
/// [`Consumer::position`]), if it holds a real one.
pub(super) fn position_in(tpl: &TopicPartitionList, topic: &str, p: i32) -> Option<i64> {
    tpl.find_partition(topic, p)
        .and_then(|e| e.offset().to_raw())
        .filter(|o| *o >= 0)
}

impl ConsumerContext for GuardContext {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        if self.core.is_aborted() {
            let _ = consumer.unassign();
            return;
        }
        let cooperative = self.cooperative;
        let r = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                if let Err(e) = self.core.on_assign(consumer, tpl) {
                    // Assign nothing: the failure stops the guard, and no
                    // record is delivered unrecovered.
                    tracing::debug!(error = %e, error_kind = e.kind(), "recovery on assign failed");
                    self.core.lock().fail(e);
                    return;
                }
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if assigned.is_ok() {
                    let mut s = self.core.lock();
                    if !cooperative {
                        s.assigned.clear();
                    }
                    s.assigned.extend(partitions(tpl));
                    s.group_checked = None;
                    s.group_end_reported = false;
                    s.rebalanced = true;
                    // A rebalance that gave this instance nothing (more
                    // instances than partitions, or the first of a
                    // cooperative rebalance's two rounds): no end event
                    // comes, so a run loop that stops at the end asks the
                    // group's progress now.
                    if s.assigned.is_empty() {
                        s.wake.notify_one();
                    }
                }
                assigned.and_then(|()| match self.core.held_list() {
                    Some(held) => consumer.pause(&held),
                    None => Ok(()),
                })
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                if consumer.assignment_lost() {
                    self.core.on_lost(consumer, tpl);
                } else {
                    self.core.on_revoke(consumer, tpl);
                }
                if cooperative {
                    let leaving = partitions(tpl);
                    self.core.lock().assigned.retain(|tp| !leaving.contains(tp));
                    consumer.incremental_unassign(tpl)
                } else {
                    self.core.lock().assigned.clear();
                    consumer.unassign()
                }
            }
            other => {
                // Handled here (nothing is kept assigned, and the group
                // assigns again), so a warning: the one error line of a
                // run is the one that ends it.
                tracing::warn!(error = ?other, "rebalance error; this instance's partitions are unassigned until the group assigns again");
                self.core.lock().assigned.clear();
                consumer.unassign()
            }
        };
        if let Err(e) = r {
            self.core.lock().fail(Error::Kafka {
                operation: "applying the assignment".into(),
                source: e,
            });
        }
        // Nothing here asks librdkafka anything but to apply the
        // assignment: a request to the consumer group (the assignment, the
        // rebalance protocol) made by the callback of a closing consumer
        // can reach the group after it terminated, which drops it
        // unanswered, and the call never returns, so neither does the close.
        self.core.publish_partitions();
    }
}

#[cfg(test)]
mod test {
    use super::assignment_partitions;

    /// A consumer protocol assignment: version 1, topics with their
    /// partitions, then null user data.
    fn encoded(topics: &[(&str, &[i32])]) -> Vec<u8> {
        let mut b = 1i16.to_be_bytes().to_vec();
        b.extend((topics.len() as i32).to_be_bytes());
        for (name, partitions) in topics {
            b.extend((name.len() as i16).to_be_bytes());
            b.extend(name.as_bytes());
            b.extend((partitions.len() as i32).to_be_bytes());
            for p in *partitions {
                b.extend(p.to_be_bytes());
            }
        }
        b.extend((-1i32).to_be_bytes());
        b
    }

    #[test]
    fn a_members_assignment_is_read_as_the_consumer_protocol_encodes_it() {
        let b = encoded(&[("in", &[0, 2]), ("other", &[]), ("more", &[7])]);
        assert_eq!(
            assignment_partitions(&b),
            Some(vec![
                ("in".to_owned(), 0),
                ("in".to_owned(), 2),
                ("more".to_owned(), 7)
            ])
        );
        assert_eq!(assignment_partitions(&[]), Some(vec![]));
        assert_eq!(assignment_partitions(&encoded(&[])), Some(vec![]));
        // Cut short anywhere inside the topics: not read, not guessed.
        for cut in 1..b.len() - 4 {
            assert_eq!(assignment_partitions(&b[..cut]), None, "cut at {cut}");
        }
    }
}
