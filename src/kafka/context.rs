//! The state shared by a guarded consumer or pipeline, its producer's
//! delivery callbacks and its rebalance callbacks; and the consumer context.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::KafkaResult;
use rdkafka::producer::{Producer, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use serde::{Deserialize, Serialize};

use super::lease::Lease;
use super::pipeline::{DeliveryContext, Mode};
use super::reconcile::Reconciler;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::{Guard, LaneId};

/// One input record whose outputs are not all acked yet.
#[derive(Debug)]
pub(crate) struct Pending {
    pub remaining: u32,
    pub fp: Option<Fingerprint>,
}

/// What the adapter knows of one input partition in this session.
#[derive(Debug, Default)]
pub(crate) struct Track {
    pub lane: Option<LaneId>,
    /// The next offset to dispatch; records below it were dispatched (or
    /// were below the start position) and are skipped. `None` until the
    /// first record when the start position was not known.
    pub next: Option<i64>,
    /// Dispatched but not yet handled (outputs not acked, or not acked by
    /// the application).
    pub inflight: BTreeMap<i64, Pending>,
    /// The content identities of `inflight`: a resend that arrives before
    /// its first copy is handled is a duplicate too.
    pub inflight_fps: std::collections::HashSet<Fingerprint>,
}

impl Track {
    /// The position that may be committed: nothing before it is unhandled.
    pub fn position(&self) -> Option<i64> {
        self.inflight.keys().next().copied().or(self.next)
    }
}

/// The sink positions stored in the manifest and in commit metadata: where
/// output reconciliation starts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SinkPositions {
    /// Output topic.
    #[serde(rename = "t")]
    pub topic: String,
    /// Output partition to the next offset after the last acked output.
    #[serde(rename = "e")]
    pub ends: BTreeMap<i32, i64>,
    /// The instance that wrote it (its state folder's token).
    #[serde(rename = "i", default)]
    pub instance: String,
    /// Written by a revoke that flushed and checkpointed: the next owner
    /// need not wait for outputs in flight.
    #[serde(rename = "c", default)]
    pub clean: bool,
    /// How long the writer's outputs can stay in flight, in milliseconds:
    /// how long a new owner that got no clean handover waits.
    #[serde(rename = "w", default)]
    pub in_flight_ms: u64,
}

/// Counters shared across threads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub records_in: u64,
    pub duplicates: u64,
    pub outputs: u64,
    pub checkpoints: u64,
}

pub(crate) struct Shared {
    pub guard: Option<Guard>,
    pub tracks: HashMap<String, HashMap<i32, Track>>,
    pub sink: Option<SinkPositions>,
    pub failure: Option<String>,
    pub counters: Counters,
    /// Set by `abort`: callbacks then do nothing, as in a dead process.
    pub aborted: bool,
    /// Inputs of which reconciliation found some outputs but not all:
    /// (topic, partition, offset) to the indices already written. Their
    /// replay writes only the missing ones.
    pub partial: HashMap<(String, i32, i64), std::collections::BTreeSet<u32>>,
    /// Partition numbers that reported end-of-partition with no record
    /// since; the exact end check runs only when all assigned ones did.
    pub at_eof: std::collections::HashSet<i32>,
    /// Partitions assigned but not recovered yet, see [`Held`].
    pub held: Option<Held>,
}

/// Partitions whose previous owner (another instance) left without a clean
/// handover: its outputs may be in flight until `until`. They stay paused,
/// and any record of theirs is skipped, until then; then the output is
/// reconciled and they resume from their start. The wait happens outside
/// the rebalance callback, so that the member keeps taking part in its
/// group meanwhile.
#[derive(Debug)]
pub(crate) struct Held {
    pub until: Instant,
    /// The previous owner, for logs.
    pub from: String,
    pub partitions: Vec<(String, i32)>,
    /// Where reconciliation starts, as on assign.
    pub manifest: Option<SinkPositions>,
    pub commits: Vec<SinkPositions>,
}

impl Shared {
    /// Shared state around a guard (none in the baseline modes).
    pub fn new(guard: Option<Guard>) -> Arc<Mutex<Self>> {
        Arc::new(Mutex::new(Shared {
            guard,
            tracks: HashMap::new(),
            sink: None,
            failure: None,
            counters: Counters::default(),
            aborted: false,
            partial: HashMap::new(),
            at_eof: std::collections::HashSet::new(),
            held: None,
        }))
    }

    pub fn track(&mut self, topic: &str, partition: i32) -> &mut Track {
        if !self.tracks.contains_key(topic) {
            self.tracks.insert(topic.to_owned(), HashMap::new());
        }
        self.tracks
            .get_mut(topic)
            .map(|m| m.entry(partition).or_default())
            .unwrap_or_else(|| unreachable!("inserted above"))
    }

    pub fn lane(&mut self, topic: &str, partition: i32) -> Option<LaneId> {
        if let Some(l) = self
            .tracks
            .get(topic)
            .and_then(|m| m.get(&partition))
            .and_then(|t| t.lane)
        {
            return Some(l);
        }
        let lane = self.guard.as_mut()?.lane(topic, partition);
        self.track(topic, partition).lane = Some(lane);
        Some(lane)
    }

    /// One output of the input at `offset` was acked (or, for a guarded
    /// consumer, the application acked it). Records the input as handled
    /// when it was the last.
    pub fn complete(&mut self, topic: &str, partition: i32, offset: i64) -> Result<()> {
        let Some(track) = self
            .tracks
            .get_mut(topic)
            .and_then(|m| m.get_mut(&partition))
        else {
            return Ok(());
        };
        let Some(p) = track.inflight.get_mut(&offset) else {
            return Ok(());
        };
        p.remaining = p.remaining.saturating_sub(1);
        if p.remaining > 0 {
            return Ok(());
        }
        let fp = p.fp;
        track.inflight.remove(&offset);
        if let Some(f) = fp {
            track.inflight_fps.remove(&f);
        }
        let lane = track.lane;
        if let (Some(guard), Some(lane)) = (self.guard.as_mut(), lane) {
            guard.record(lane, Some(offset as u64), fp)?;
        }
        Ok(())
    }

    /// Admits a received record: `false` when it must be skipped, because
    /// it is below the partition's next offset (already dispatched in this
    /// session) or a duplicate of a handled or in-flight record (counted).
    /// An admitted record's position is passed: the caller dispatches it
    /// with [`Shared::begin`].
    pub fn admit(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        fp: Option<Fingerprint>,
    ) -> Result<bool> {
        // Fetched before its pause took hold: read again once released.
        if self.held.as_ref().is_some_and(|h| {
            h.partitions
                .iter()
                .any(|(t, p)| t == topic && *p == partition)
        }) {
            return Ok(false);
        }
        self.counters.records_in += 1;
        metrics::counter!("replayguard_records_in_total").increment(1);
        self.at_eof.remove(&partition);
        let lane = self.lane(topic, partition);
        let t = self.track(topic, partition);
        if t.next.is_some_and(|n| offset < n) {
            return Ok(false);
        }
        t.next = Some(offset + 1);
        let reason = if fp.is_some_and(|f| t.inflight_fps.contains(&f)) {
            Some(crate::Reason::SameContent)
        } else if let (Some(lane), Some(g)) = (lane, self.guard.as_mut()) {
            match g.check(lane, Some(offset as u64), fp)? {
                crate::Verdict::Fresh => None,
                crate::Verdict::Duplicate { reason, .. } => Some(reason),
            }
        } else {
            None
        };
        if let Some(reason) = reason {
            self.counters.duplicates += 1;
            let label = match reason {
                crate::Reason::SamePosition => "position",
                crate::Reason::SameContent => "content",
            };
            metrics::counter!("replayguard_duplicates_total", "reason" => label).increment(1);
            return Ok(false);
        }
        Ok(true)
    }

    /// Marks an admitted record in flight until `remaining` completions.
    pub fn begin(
        &mut self,
        topic: &str,
        partition: i32,
        offset: i64,
        fp: Option<Fingerprint>,
        remaining: u32,
    ) {
        let t = self.track(topic, partition);
        t.inflight.insert(offset, Pending { remaining, fp });
        if let Some(f) = fp {
            t.inflight_fps.insert(f);
        }
    }

    /// Every partition's committable position.
    pub fn positions(&self) -> Vec<(String, i32, i64, Option<LaneId>)> {
        let mut out = Vec::new();
        for (topic, parts) in &self.tracks {
            for (p, t) in parts {
                if let Some(pos) = t.position() {
                    out.push((topic.clone(), *p, pos, t.lane));
                }
            }
        }
        out
    }

    pub fn inflight(&self) -> usize {
        self.tracks
            .values()
            .flat_map(|m| m.values())
            .map(|t| t.inflight.len())
            .sum()
    }

    /// Writes the manifest (guarded mode) and returns the offsets to commit,
    /// with the sink positions as commit metadata; `clean` marks a revoke
    /// that flushed every output first.
    pub fn checkpoint(
        &mut self,
        only: Option<&TopicPartitionList>,
        clean: bool,
    ) -> Result<TopicPartitionList> {
        let positions = self.positions();
        let meta = self.commit_metadata(clean)?;
        let sink_json = meta.clone().into_bytes();
        if let Some(guard) = self.guard.as_mut() {
            let lanes: Vec<(LaneId, u64)> = positions
                .iter()
                .filter_map(|(_, _, pos, lane)| lane.map(|l| (l, *pos as u64)))
                .collect();
            guard.checkpoint(&lanes, sink_json.clone())?;
        }
        let mut tpl = TopicPartitionList::new();
        for (topic, p, pos, _) in positions {
            if only.is_some_and(|o| o.find_partition(&topic, p).is_none()) {
                continue;
            }
            let mut e = tpl.add_partition(&topic, p);
            e.set_offset(Offset::Offset(pos))
                .map_err(super::setup::kafka("setting a commit offset"))?;
            e.set_metadata(meta.clone());
        }
        self.counters.checkpoints += 1;
        if let Some(g) = self.guard.as_ref() {
            let st = g.stats();
            metrics::gauge!("replayguard_live_fingerprints").set(st.live_fingerprints as f64);
            metrics::gauge!("replayguard_live_epochs").set(st.live_epochs as f64);
        }
        Ok(tpl)
    }

    /// Forgets held partitions that left.
    pub fn release_held(&mut self, gone: &TopicPartitionList) {
        if let Some(h) = self.held.as_mut() {
            h.partitions
                .retain(|(t, p)| gone.find_partition(t, *p).is_none());
            if h.partitions.is_empty() {
                self.held = None;
            }
        }
    }

    /// The commit metadata: the sink positions with who wrote them, and
    /// whether this is a clean handover. Empty without a sink (a guarded
    /// consumer).
    pub fn commit_metadata(&mut self, clean: bool) -> Result<String> {
        match self.sink.as_mut() {
            Some(sink) => {
                sink.clean = clean;
                serde_json::to_string(sink)
                    .map_err(|e| Error::Config(format!("sink encoding: {e}")))
            }
            None => Ok(String::new()),
        }
    }

    pub fn fail(&mut self, what: String) {
        tracing::error!(error = %what, "replayguard stopped");
        self.failure.get_or_insert(what);
    }
}

/// Everything a guarded consumer or pipeline shares between threads.
pub(crate) struct Core {
    pub shared: Arc<Mutex<Shared>>,
    pub producer: Option<Arc<ThreadedProducer<DeliveryContext>>>,
    pub reconciler: Option<Reconciler>,
    pub mode: Mode,
    pub flush_timeout: Duration,
    /// This instance's token, written into commit metadata.
    pub instance: String,
    /// Whether new owners wait for a previous owner's outputs in flight.
    pub fenced: bool,
    pub lease: Lease,
}

impl Core {
    pub fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock leaves counters, not the store,
        // half-updated; the store has its own poisoning.
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Fails when this instance's lease on its partitions lapsed (the
    /// process stood still longer than the lease) or librdkafka found its
    /// session timed out: another member may own them now. A pipeline's
    /// queued outputs are purged first, so that none of them is sent
    /// (their inputs stay unhandled).
    pub fn check_lease(&self, consumer: &impl Consumer<GuardContext>) -> Result<()> {
        let lapsed = self.lease.lapsed();
        let lost = self.lease.enabled && lapsed.is_none() && consumer.assignment_lost();
        if lapsed.is_none() && !lost {
            return Ok(());
        }
        if let Some(p) = &self.producer {
            p.purge(rdkafka::producer::PurgeConfig::default().queue());
        }
        let e = match lapsed {
            Some(since) => Error::LeaseLapsed {
                since,
                lease: self.lease.length,
            },
            None => Error::AssignmentLost,
        };
        self.lock().fail(e.to_string());
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
            s.guard.take()
        };
        drop(guard);
    }

    /// Notes that partition `eof` reached its end, and tells whether every
    /// assigned partition was dispatched to its high watermark. The
    /// watermarks (one round trip each) are read only once every assigned
    /// partition has reported its end.
    pub fn at_end(
        &self,
        consumer: &impl Consumer<GuardContext>,
        eof: i32,
        timeout: Duration,
    ) -> Result<bool> {
        let assignment = consumer
            .assignment()
            .map_err(super::setup::kafka("reading the assignment"))?;
        {
            let mut s = self.lock();
            s.at_eof.insert(eof);
            if assignment.count() == 0
                || assignment
                    .elements()
                    .iter()
                    .any(|e| !s.at_eof.contains(&e.partition()))
            {
                return Ok(false);
            }
        }
        for e in assignment.elements() {
            let (_, hi) = consumer
                .fetch_watermarks(e.topic(), e.partition(), timeout)
                .map_err(super::setup::kafka("reading input watermarks"))?;
            let s = self.lock();
            let next = s
                .tracks
                .get(e.topic())
                .and_then(|m| m.get(&e.partition()))
                .and_then(|t| t.next);
            if next.unwrap_or(0) < hi {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The error that stops the guard for a consumer error that does not
    /// heal, naming where it happened. librdkafka does not pass the failed
    /// record's partition through rdkafka, so the location is every
    /// assigned partition not yet read to its high watermark, with the
    /// offset it is stuck at.
    pub fn consume_failure(
        &self,
        consumer: &impl Consumer<GuardContext>,
        e: rdkafka::error::KafkaError,
    ) -> Error {
        let mut at = Vec::new();
        if let Ok(assignment) = consumer.assignment() {
            let positions = consumer.position().ok();
            let nexts: Vec<Option<i64>> = {
                let s = self.lock();
                assignment
                    .elements()
                    .iter()
                    .map(|el| {
                        s.tracks
                            .get(el.topic())
                            .and_then(|m| m.get(&el.partition()))
                            .and_then(|t| t.next)
                    })
                    .collect()
            };
            for (el, next) in assignment.elements().iter().zip(nexts) {
                let (topic, p) = (el.topic(), el.partition());
                let next = next.or_else(|| {
                    positions
                        .as_ref()
                        .and_then(|tpl| tpl.find_partition(topic, p))
                        .and_then(|e| e.offset().to_raw())
                        .filter(|o| *o >= 0)
                });
                let high = consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(2))
                    .ok()
                    .map(|(_, h)| h);
                if next.zip(high).is_none_or(|(n, h)| n < h) {
                    at.push(match next {
                        Some(o) => format!("{topic}[{p}] at offset {o}"),
                        None => format!("{topic}[{p}]"),
                    });
                }
            }
        }
        let location = match at.len() {
            0 => "the input".to_owned(),
            1 => at.remove(0),
            _ => format!("one of {}", at.join(", ")),
        };
        Error::Consume {
            location,
            hint: super::trouble::hint(&e),
            source: Box::new(e),
        }
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

    /// When the held partitions' wait is over: reconciles the output,
    /// then resumes them from their starts. Returns when the wait ends, if
    /// it has not yet.
    pub fn recover_held(&self, consumer: &impl Consumer<GuardContext>) -> Result<Option<Instant>> {
        let held = {
            let mut s = self.lock();
            match &s.held {
                None => return Ok(None),
                Some(h) if h.until > Instant::now() => return Ok(Some(h.until)),
                Some(_) => s.held.take(),
            }
        };
        let Some(held) = held else {
            return Ok(None);
        };
        if let Some(r) = &self.reconciler {
            r.reconcile(self, held.manifest.as_ref(), &held.commits)?;
        }
        let mut tpl = TopicPartitionList::new();
        {
            let mut s = self.lock();
            for (t, p) in &held.partitions {
                if let Some(next) = s
                    .tracks
                    .get(t)
                    .and_then(|m| m.get(p))
                    .and_then(|tr| tr.next)
                {
                    tpl.add_partition_offset(t, *p, Offset::Offset(next))
                        .map_err(super::setup::kafka("building the list to resume"))?;
                }
                // Its records skipped while held are read again.
                s.at_eof.remove(p);
            }
        }
        if tpl.count() > 0 {
            consumer
                .seek_partitions(tpl.clone(), self.flush_timeout)
                .map_err(super::setup::kafka(
                    "seeking held partitions to their starts",
                ))?;
            consumer
                .resume(&tpl)
                .map_err(super::setup::kafka("resuming held partitions"))?;
        }
        tracing::info!(
            previous_owner = %held.from,
            partitions = tpl.count(),
            "held partitions reconciled and resumed"
        );
        Ok(None)
    }

    pub fn failure(&self) -> Option<String> {
        self.lock().failure.clone()
    }

    /// Waits (blocking) until every output is acked, then checkpoints.
    /// Used from rebalance callbacks, which must finish before they return.
    fn checkpoint_blocking(
        &self,
        consumer: &BaseConsumer<GuardContext>,
        only: Option<&TopicPartitionList>,
    ) -> Result<()> {
        if let Some(p) = &self.producer {
            p.flush(self.flush_timeout)
                .map_err(super::setup::kafka("flushing outputs before a revoke"))?;
        }
        let tpl = {
            let mut s = self.lock();
            if let Some(f) = &s.failure {
                return Err(Error::Stopped(format!(
                    "not checkpointing after a failure: {f}"
                )));
            }
            let unacked = only.map_or_else(
                || s.inflight(),
                |o| {
                    o.elements()
                        .iter()
                        .filter_map(|e| s.tracks.get(e.topic()).and_then(|m| m.get(&e.partition())))
                        .map(|t| t.inflight.len())
                        .sum()
                },
            );
            if self.producer.is_some() && unacked > 0 {
                return Err(Error::Stopped(format!(
                    "{unacked} outputs still unacked after the flush timeout"
                )));
            }
            s.checkpoint(only, only.is_some())?
        };
        self.commit(consumer, &tpl, CommitMode::Sync)
    }

    /// Commits input offsets: to the group (advisory), or inside the
    /// transaction in transactional mode.
    pub fn commit(
        &self,
        consumer: &impl Consumer<GuardContext>,
        tpl: &TopicPartitionList,
        mode: CommitMode,
    ) -> Result<()> {
        if tpl.count() == 0 {
            return Ok(());
        }
        if self.mode == Mode::Transactional {
            let Some(p) = &self.producer else {
                return Ok(());
            };
            let meta = consumer
                .group_metadata()
                .ok_or_else(|| Error::Config("transactional mode needs a consumer group".into()))?;
            p.send_offsets_to_transaction(tpl, &meta, self.flush_timeout)
                .map_err(super::setup::kafka("sending offsets to the transaction"))?;
            p.commit_transaction(self.flush_timeout)
                .map_err(super::setup::kafka("committing the transaction"))?;
            p.begin_transaction()
                .map_err(super::setup::kafka("beginning a transaction"))?;
            // librdkafka's mock cluster acknowledges transactional offsets
            // without storing them; a plain commit of the same offsets makes
            // the baseline resumable there. On a real broker it is redundant.
            if let Err(e) = consumer.commit(tpl, CommitMode::Sync) {
                tracing::warn!(error = %e, "offset commit after the transaction failed");
            }
            return Ok(());
        }
        match consumer.commit(tpl, mode) {
            Ok(()) => Ok(()),
            // The manifest is the truth; a failed advisory commit only slows
            // down a stateless newcomer.
            Err(e) => {
                tracing::warn!(error = %e, "advisory offset commit failed");
                Ok(())
            }
        }
    }

    fn on_revoke(&self, consumer: &BaseConsumer<GuardContext>, tpl: &TopicPartitionList) {
        let started = Instant::now();
        let span = tracing::info_span!("replayguard_revoke", partitions = tpl.count());
        let _e = span.enter();
        if let Err(e) = self.checkpoint_blocking(consumer, Some(tpl)) {
            self.lock()
                .fail(format!("checkpoint on revoke failed: {e}"));
            return;
        }
        let mut s = self.lock();
        for e in tpl.elements() {
            if let Some(m) = s.tracks.get_mut(e.topic()) {
                m.remove(&e.partition());
            }
        }
        s.release_held(tpl);
        metrics::histogram!("replayguard_checkpoint_seconds")
            .record(started.elapsed().as_secs_f64());
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            "revoked partitions checkpointed"
        );
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
        let committed = consumer
            .committed_offsets(tpl.clone(), self.flush_timeout)
            .map_err(super::setup::kafka("reading committed offsets"))?;
        let mut from_commits: Vec<SinkPositions> = Vec::new();
        // The longest a previous owner that left without a clean handover
        // can still have outputs in flight, and who it was.
        let mut zombie: Option<(Duration, String)> = None;
        let mut starts = Vec::new();
        let mut s = self.lock();
        let manifest_sink: Option<SinkPositions> = s
            .guard
            .as_ref()
            .and_then(|g| g.manifest())
            .and_then(|m| serde_json::from_slice(&m.sink).ok());
        for e in committed.elements() {
            let (topic, p) = (e.topic().to_owned(), e.partition());
            let group_pos = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            let lane = s.lane(&topic, p);
            let local = lane
                .and_then(|l| s.guard.as_ref().and_then(|g| g.position(l)))
                .map(|o| o as i64);
            let start = match (local, group_pos) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            if let Some(known) = start.filter(|o| *o > 0) {
                drop(s);
                let (_, hi) = consumer
                    .fetch_watermarks(&topic, p, self.flush_timeout)
                    .map_err(super::setup::kafka("reading input watermarks"))?;
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
                s = self.lock();
            }
            let sink = serde_json::from_str::<SinkPositions>(e.metadata()).ok();
            if let Some(sink) = &sink
                && group_pos >= local
                && !sink.clean
                && !sink.instance.is_empty()
                && sink.instance != self.instance
            {
                let wait = Duration::from_millis(sink.in_flight_ms);
                if zombie.as_ref().is_none_or(|(w, _)| wait > *w) {
                    zombie = Some((wait, sink.instance.clone()));
                }
            }
            if group_pos > local
                && let Some(sink) = sink
            {
                from_commits.push(sink);
            }
            match (lane, local) {
                (Some(_), None) => tracing::info!(
                    partition = %format!("{topic}[{p}]"),
                    start = ?start,
                    "partition arrives with no local state: it starts at the group's committed offset, and only identities within the output reconciliation (pipeline) or handled from now on (consumer) are known"
                ),
                _ => {
                    tracing::debug!(partition = %format!("{topic}[{p}]"), ?start, ?local, ?group_pos, "partition assigned")
                }
            }
            let t = s.track(&topic, p);
            t.next = start;
            t.inflight.clear();
            starts.push((topic, p, start));
        }
        drop(s);
        if let Some(r) = &self.reconciler {
            match zombie.filter(|(wait, _)| self.fenced && !wait.is_zero()) {
                Some((wait, from)) => {
                    super::lease::note_wait(wait, &from);
                    let mut s = self.lock();
                    let arriving = starts.iter().map(|(t, p, _)| (t.clone(), *p));
                    match s.held.as_mut() {
                        Some(h) => {
                            h.until = h.until.max(Instant::now() + wait);
                            h.partitions.extend(arriving);
                            h.commits.extend(from_commits);
                        }
                        None => {
                            s.held = Some(Held {
                                until: Instant::now() + wait,
                                from,
                                partitions: arriving.collect(),
                                manifest: manifest_sink,
                                commits: from_commits,
                            });
                        }
                    }
                }
                None => {
                    r.reconcile(self, manifest_sink.as_ref(), &from_commits)?;
                }
            }
        }
        for (topic, p, start) in starts {
            if let Some(o) = start
                && let Some(mut el) = tpl.find_partition(&topic, p)
            {
                el.set_offset(Offset::Offset(o))
                    .map_err(super::setup::kafka("setting a start offset"))?;
            }
        }
        let elapsed = started.elapsed();
        metrics::histogram!("replayguard_recovery_seconds").record(elapsed.as_secs_f64());
        tracing::info!(
            ms = elapsed.as_millis() as u64,
            "assigned partitions recovered"
        );
        Ok(())
    }
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
}

impl ClientContext for GuardContext {
    /// A client-wide error that means the connection cannot work (refused
    /// credentials, TLS, an error librdkafka calls fatal) stops the guard;
    /// any other is logged at debug level, and librdkafka retries it.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        if super::trouble::global_is_fatal(&error) {
            let hint = super::trouble::hint(&error);
            self.core.lock().fail(format!(
                "the consumer's connection failed: {reason}; {hint}"
            ));
        } else {
            tracing::debug!(error = %error, reason, "kafka client error; librdkafka retries it");
        }
    }
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
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let r: KafkaResult<()> = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                if let Err(e) = self.core.on_assign(consumer, tpl) {
                    // Assign nothing: the failure stops the guard, and no
                    // record is delivered unrecovered.
                    self.core
                        .lock()
                        .fail(format!("recovery on assign failed: {e}"));
                    return;
                }
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                assigned.and_then(|()| match self.core.held_list() {
                    Some(held) => consumer.pause(&held),
                    None => Ok(()),
                })
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                if !consumer.assignment_lost() {
                    self.core.on_revoke(consumer, tpl);
                } else {
                    tracing::warn!(
                        "assignment lost: not committing for partitions another member may own"
                    );
                    // Outputs still queued for them must not be sent: the
                    // new owner writes them.
                    if self.core.fenced {
                        let _ = self.core.check_lease(consumer);
                    }
                    let mut s = self.core.lock();
                    for e in tpl.elements() {
                        if let Some(m) = s.tracks.get_mut(e.topic()) {
                            m.remove(&e.partition());
                        }
                    }
                    s.release_held(tpl);
                }
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                tracing::error!(error = ?other, "rebalance error");
                consumer.unassign()
            }
        };
        if let Err(e) = r {
            self.core
                .lock()
                .fail(format!("applying the assignment failed: {e}"));
        }
    }
}
