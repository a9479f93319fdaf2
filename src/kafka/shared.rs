//! The state a guarded consumer or pipeline shares between its caller, its
//! producer's delivery callbacks and its rebalance callbacks. It knows the
//! engine and nothing of the Kafka client.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::guard::{Guard, LaneId, Probe};
use crate::{Reason, Verdict};

/// How many handled inputs [`Shared::complete`] lets wait before it
/// records them: enough for the batch to overlap its memory misses, few
/// enough that a delivery callback that records them stays short.
const RECORD_BATCH: usize = 512;

/// A topic partition.
pub(crate) type Partition = (String, i32);

/// A position to commit: topic, partition, next offset.
pub(crate) type Position = (String, i32, i64);

/// One input record not handled yet.
#[derive(Debug)]
pub(crate) struct Pending {
    /// Completions still awaited: outputs not acked, or the application's
    /// ack.
    pub remaining: u32,
    pub fp: Option<Fingerprint>,
    /// Its outputs were handed to the producer (a pipeline); until then it
    /// is being processed.
    pub dispatched: bool,
}

/// What the adapter knows of one input partition in this session.
#[derive(Debug, Default)]
pub(crate) struct Track {
    pub lane: Option<LaneId>,
    /// The next offset to admit; records below it were admitted (or were
    /// below the start position) and are skipped. `None` until the first
    /// record when the start position was not known.
    pub next: Option<i64>,
    /// Admitted but not yet handled (being processed, outputs not acked,
    /// or not acked by the application).
    pub inflight: BTreeMap<i64, Pending>,
    /// The content identities of `inflight`: a resend that arrives before
    /// its first copy is handled is a duplicate too.
    pub inflight_fps: FxHashSet<Fingerprint>,
    /// Which tenure of the partition this is: a track made after the
    /// partition left (and perhaps came back) has a higher one, so that an
    /// ack of a record delivered before is told apart.
    pub generation: u64,
}

impl Track {
    /// The position that may be committed: nothing before it is unhandled.
    pub fn position(&self) -> Option<i64> {
        self.inflight.keys().next().copied().or(self.next)
    }
}

/// The sink positions stored in the manifest and in commit metadata: where
/// output reconciliation starts, and who wrote them.
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
    /// With a changelog: changelog partition to the offset after this
    /// instance's last acked record there, as of the checkpoint.
    #[serde(rename = "l", default, skip_serializing_if = "BTreeMap::is_empty")]
    pub changelog: BTreeMap<i32, i64>,
}

impl SinkPositions {
    /// As commit metadata and in the manifest: JSON.
    pub fn encode(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|source| Error::Encode {
            what: "the sink positions",
            source,
        })
    }
}

/// The sink positions a run starts with: those of the folder's last
/// checkpoint, when it wrote to `output` (`""` for a guarded consumer,
/// which keeps only the changelog's), and this instance's token.
pub(crate) fn resumed_sink(
    guard: Option<&Guard>,
    output: &str,
    token: &str,
    in_flight: std::time::Duration,
) -> SinkPositions {
    let last = guard
        .and_then(Guard::manifest)
        .and_then(|m| serde_json::from_slice::<SinkPositions>(&m.sink).ok())
        .unwrap_or_default();
    SinkPositions {
        topic: output.to_owned(),
        ends: if last.topic == output {
            last.ends
        } else {
            BTreeMap::new()
        },
        instance: token.to_owned(),
        clean: false,
        in_flight_ms: in_flight.as_millis() as u64,
        changelog: last.changelog,
    }
}

/// Counters shared across threads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub records_in: u64,
    pub duplicates: u64,
    /// Records handed to the application (a guarded consumer).
    pub delivered: u64,
    /// Records the application acked (a guarded consumer).
    pub acked: u64,
    /// Acks refused: the record's partition left since it was delivered
    /// (a guarded consumer).
    pub acks_refused: u64,
    /// Outputs acked by the broker (a pipeline).
    pub outputs: u64,
    pub checkpoints: u64,
}

/// Partitions not yet safe to write for: their previous owner (another
/// instance) left without a clean handover, so its outputs may be in
/// flight until `until`; or the broker refused their claim. They stay
/// paused, and any record of theirs is skipped, until then; then the
/// output is reconciled (unless it was already), they are claimed, and
/// they resume from their start. A claim refused again holds them again.
/// The wait happens outside the rebalance callback, so that the member
/// keeps taking part in its group meanwhile.
#[derive(Debug)]
pub(crate) struct Held {
    pub until: Instant,
    /// The previous owner, for logs.
    pub from: String,
    pub partitions: Vec<Partition>,
    /// Where reconciliation starts, as on assign.
    pub manifest: Option<SinkPositions>,
    pub commits: Vec<SinkPositions>,
    /// Whether their output is reconciled already (only the claim is left).
    pub reconciled: bool,
    /// The broker's refusals of their claim so far.
    pub refusal: Option<Refusal>,
}

/// A claim the broker refused ([`Held`]): it is tried again after a delay
/// that doubles from [`Refusal::FIRST_DELAY`] up to [`Refusal::MAX_DELAY`].
#[derive(Debug, Clone)]
pub(crate) struct Refusal {
    /// The first refusal.
    pub since: Instant,
    pub attempts: u32,
    /// The broker's last answer.
    pub error: String,
}

impl Refusal {
    pub const FIRST_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
    pub const MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

    /// A first refusal, or one more after `earlier`.
    pub fn after(earlier: Option<Refusal>, error: String) -> Self {
        match earlier {
            Some(r) => Refusal {
                since: r.since,
                attempts: r.attempts + 1,
                error,
            },
            None => Refusal {
                since: Instant::now(),
                attempts: 1,
                error,
            },
        }
    }

    /// How long to wait before the next claim.
    pub fn delay(&self) -> std::time::Duration {
        Self::FIRST_DELAY
            .saturating_mul(1 << self.attempts.saturating_sub(1).min(8))
            .min(Self::MAX_DELAY)
    }
}

/// The failure that stopped the guard: the first is handed out as it is
/// (so that [`Error::is_poisoning`] still holds after it crossed a
/// callback), later calls get [`Error::Stopped`] naming it.
#[derive(Debug, Default)]
pub(crate) struct Failure {
    first: Option<Error>,
    reason: Option<String>,
    kind: Option<&'static str>,
}

/// One record offered for admission.
pub(crate) struct Offered<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub fp: Option<Fingerprint>,
}

pub(crate) struct Shared {
    /// The engine. Reached through [`Shared::engine`], which records the
    /// [`Shared::handled`] inputs first, or [`Shared::guard_ref`] for what
    /// only an open or a checkpoint changes.
    guard: Option<Guard>,
    /// Inputs handled (their last output acked, or acked by the
    /// application) and not yet recorded: recorded together, with one
    /// [`Guard::record_many`], before the engine is next asked or changed,
    /// or once [`RECORD_BATCH`] wait. Until then the engine answers no
    /// check, so a resend behind them is still caught.
    handled: Vec<Probe>,
    pub tracks: FxHashMap<String, FxHashMap<i32, Track>>,
    pub sink: Option<SinkPositions>,
    failure: Failure,
    pub counters: Counters,
    /// Set by `abort`: callbacks then do nothing, as in a dead process.
    pub aborted: bool,
    /// Inputs of which reconciliation found some outputs but not all:
    /// (topic, partition, offset) to the indices already written. Their
    /// replay writes only the missing ones.
    pub partial: FxHashMap<(String, i32, i64), BTreeSet<u32>>,
    /// Partition numbers that reported end-of-partition with no record
    /// since; the exact end check runs only when all assigned ones did.
    pub at_eof: FxHashSet<i32>,
    /// Partitions assigned but not recovered yet, see [`Held`].
    pub held: Option<Held>,
    /// The partitions assigned to this instance, as its rebalance callback
    /// applied them (kept here rather than asked of librdkafka there: see
    /// `GuardContext::rebalance`).
    pub assigned: BTreeSet<Partition>,
    /// With no partition assigned: when the group's progress was last
    /// asked (see `Core::group_at_end`), and whether the end it found was
    /// reported; both cleared by the next rebalance that assigns.
    pub group_checked: Option<std::time::Instant>,
    pub group_end_reported: bool,
    /// Whether a rebalance has given this instance its partitions (none
    /// among them) since it was made; and when it was made.
    pub rebalanced: bool,
    pub made: std::time::Instant,
    /// High watermark of each assigned partition, and a position to count
    /// lag from until the guard has one, from librdkafka's last
    /// statistics; empty without them.
    watermarks: BTreeMap<Partition, (i64, Option<i64>)>,
    /// The guard's counters as it closed (see `Core::close_state`), for
    /// stats read after that.
    closed_guard: Option<crate::guard::Stats>,
    /// Scratch space of [`Shared::admit`]'s batched checks.
    probes: Vec<Probe>,
    verdicts: Vec<Verdict>,
    /// The generation of the last track made ([`Track::generation`]).
    generations: u64,
    /// Signalled when a run loop waiting for records (or for its next
    /// checkpoint) must look again: partitions were held, which send no
    /// records, and it learns when to release them; or a callback
    /// (rebalance, delivery, client error) stopped the guard.
    pub wake: std::sync::Arc<tokio::sync::Notify>,
    /// This guard's metric series.
    pub meters: std::sync::Arc<super::telemetry::Meters>,
}

/// Locks the shared state. A panic while it was held leaves counters, not
/// the store, half-updated; the store has its own poisoning.
pub(crate) fn lock(shared: &std::sync::Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// Shared state around a guard (none in the baselines), emitting to
    /// `meters`.
    pub fn new(guard: Option<Guard>, meters: std::sync::Arc<super::telemetry::Meters>) -> Self {
        Shared {
            meters,
            guard,
            tracks: FxHashMap::default(),
            sink: None,
            failure: Failure::default(),
            counters: Counters::default(),
            aborted: false,
            partial: FxHashMap::default(),
            at_eof: FxHashSet::default(),
            group_checked: None,
            group_end_reported: false,
            rebalanced: false,
            made: std::time::Instant::now(),
            held: None,
            assigned: BTreeSet::new(),
            watermarks: BTreeMap::new(),
            closed_guard: None,
            handled: Vec::new(),
            probes: Vec::new(),
            wake: Default::default(),
            verdicts: Vec::new(),
            generations: 0,
        }
    }

    pub fn track(&mut self, topic: &str, partition: i32) -> &mut Track {
        if !self.tracks.contains_key(topic) {
            self.tracks.insert(topic.to_owned(), FxHashMap::default());
        }
        let generations = &mut self.generations;
        self.tracks
            .get_mut(topic)
            .map(|m| {
                m.entry(partition).or_insert_with(|| {
                    *generations += 1;
                    Track {
                        generation: *generations,
                        ..Track::default()
                    }
                })
            })
            .unwrap_or_else(|| unreachable!("inserted above"))
    }

    /// The generation of the partition's track, if it has one: records
    /// delivered under another were delivered before the partition last
    /// left this instance.
    pub fn generation(&self, topic: &str, partition: i32) -> Option<u64> {
        self.tracks
            .get(topic)
            .and_then(|m| m.get(&partition))
            .map(|t| t.generation)
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
    /// consumer, the application acked it). When it was the last, the input
    /// is handled: it leaves the in-flight records and joins those to
    /// record ([`Shared::handled`]).
    ///
    /// # Errors
    /// A store failure while it records a full batch.
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
        if self.guard.is_some()
            && let Some(lane) = track.lane
        {
            self.handled.push(Probe::new(lane, Some(offset as u64), fp));
            if self.handled.len() >= RECORD_BATCH {
                self.record_handled()?;
            }
        }
        Ok(())
    }

    /// Records the handled inputs waiting in [`Shared::handled`], in one
    /// batch. After an error the ones not recorded stay, so that no later
    /// checkpoint takes their positions without their identities.
    fn record_handled(&mut self) -> Result<()> {
        if self.handled.is_empty() {
            return Ok(());
        }
        let Some(guard) = self.guard.as_mut() else {
            self.handled.clear();
            return Ok(());
        };
        let mut verdicts = std::mem::take(&mut self.verdicts);
        // Cleared here too: a call refused before it starts leaves it as
        // it was, and its length says how many were recorded.
        verdicts.clear();
        let r = guard.record_many(&self.handled, &mut verdicts);
        match r {
            Ok(()) => self.handled.clear(),
            Err(_) => drop(self.handled.drain(..verdicts.len())),
        }
        self.verdicts = verdicts;
        r
    }

    /// The engine, with every handled input recorded in it.
    ///
    /// # Errors
    /// A store failure while it records them.
    pub fn engine(&mut self) -> Result<Option<&mut Guard>> {
        self.record_handled()?;
        Ok(self.guard.as_mut())
    }

    /// The engine as it is, for what only its open or a checkpoint changes
    /// (its manifest, its lanes' positions): inputs handled since the last
    /// check or checkpoint may not be recorded in it yet.
    pub fn guard_ref(&self) -> Option<&Guard> {
        self.guard.as_ref()
    }

    fn is_held(&self, topic: &str, partition: i32) -> bool {
        self.held.as_ref().is_some_and(|h| {
            h.partitions
                .iter()
                .any(|(t, p)| t == topic && *p == partition)
        })
    }

    /// Admits received records, in order, appending one answer each to
    /// `admitted`: `true` for a record to handle, which is then in flight
    /// (its fingerprint too, so that a resend behind it is caught) until
    /// [`Shared::complete`]; `false` for one to skip, because it is below
    /// its partition's next offset (admitted already in this session), its
    /// partition waits for a previous owner ([`Held`]), or it duplicates a
    /// handled or in-flight record (counted). The engine is asked once for
    /// the whole batch.
    pub fn admit(&mut self, records: &[Offered<'_>], admitted: &mut Vec<bool>) -> Result<()> {
        self.record_handled()?;
        self.probes.clear();
        let mut asked = Vec::with_capacity(records.len());
        for r in records {
            let lane = self.lane(r.topic, r.partition);
            asked.push(lane.is_some());
            if let Some(lane) = lane {
                self.probes
                    .push(Probe::new(lane, Some(r.offset as u64), r.fp));
            }
        }
        let mut verdicts = std::mem::take(&mut self.verdicts);
        verdicts.clear();
        if let Some(g) = self.guard.as_mut()
            && !self.probes.is_empty()
        {
            g.check_many(&self.probes, &mut verdicts)?;
        }
        let mut verdict = verdicts.iter();
        for (r, asked) in records.iter().zip(asked) {
            let v = if asked { verdict.next().copied() } else { None };
            let ok = self.admit_one(r, v);
            admitted.push(ok);
        }
        self.verdicts = verdicts;
        Ok(())
    }

    /// One record of [`Shared::admit`], with the engine's verdict (taken
    /// before any record of the batch was admitted).
    fn admit_one(&mut self, r: &Offered<'_>, verdict: Option<Verdict>) -> bool {
        if self.is_held(r.topic, r.partition) {
            // Fetched before its pause took hold: read again once released.
            return false;
        }
        self.counters.records_in += 1;
        self.meters.records_in.increment(1);
        self.at_eof.remove(&r.partition);
        let t = self.track(r.topic, r.partition);
        if t.next.is_some_and(|n| r.offset < n) {
            return false;
        }
        t.next = Some(r.offset + 1);
        let reason = if r.fp.is_some_and(|f| t.inflight_fps.contains(&f)) {
            Some(Reason::SameContent)
        } else {
            match verdict {
                Some(Verdict::Duplicate { reason, .. }) => Some(reason),
                _ => None,
            }
        };
        if let Some(reason) = reason {
            self.counters.duplicates += 1;
            match reason {
                Reason::SamePosition => self.meters.duplicates_position.increment(1),
                Reason::SameContent => self.meters.duplicates_content.increment(1),
            }
            return false;
        }
        // In flight from here: a checkpoint while it is processed does not
        // move the position past it.
        t.inflight.insert(
            r.offset,
            Pending {
                remaining: 1,
                fp: r.fp,
                dispatched: false,
            },
        );
        if let Some(f) = r.fp {
            t.inflight_fps.insert(f);
        }
        true
    }

    /// Marks an admitted record's outputs handed to the producer, and how
    /// many acks it waits for (at least one). `false` when it is no longer
    /// in flight here: its partition left while it was processed, and the
    /// new owner handles it; its outputs must then not be written.
    pub fn dispatch(&mut self, topic: &str, partition: i32, offset: i64, outputs: u32) -> bool {
        match self
            .tracks
            .get_mut(topic)
            .and_then(|m| m.get_mut(&partition))
            .and_then(|t| t.inflight.get_mut(&offset))
        {
            Some(p) => {
                p.remaining = outputs.max(1);
                p.dispatched = true;
                true
            }
            None => false,
        }
    }

    /// Inputs whose outputs were handed to the producer and are not all
    /// acked.
    pub fn unacked(&self) -> usize {
        self.tracks
            .values()
            .flat_map(|m| m.values())
            .flat_map(|t| t.inflight.values())
            .filter(|p| p.dispatched)
            .count()
    }

    /// Outputs handed to the producer and not acked, among `partitions`.
    pub fn unacked_of(&self, partitions: &[Partition]) -> usize {
        partitions
            .iter()
            .filter_map(|(t, p)| self.tracks.get(t).and_then(|m| m.get(p)))
            .flat_map(|t| t.inflight.values())
            .filter(|p| p.dispatched)
            .count()
    }

    /// Every partition's committable position. A held partition has none:
    /// until its output is reconciled it is not this instance's to commit,
    /// and the group's commit (the previous owner's sink positions, and
    /// that its handover was not clean) must stay for its next owner.
    pub fn positions(&self) -> Vec<(String, i32, i64, Option<LaneId>)> {
        let mut out = Vec::new();
        for (topic, parts) in &self.tracks {
            for (p, t) in parts {
                if self.is_held(topic, *p) {
                    continue;
                }
                if let Some(pos) = t.position() {
                    out.push((topic.clone(), *p, pos, t.lane));
                }
            }
        }
        out
    }

    /// Writes the manifest (with a guard) and returns the positions to
    /// commit, of `only` these partitions when given, and the commit
    /// metadata; `clean` marks a revoke that flushed every output first.
    pub fn checkpoint(
        &mut self,
        only: Option<&[Partition]>,
        clean: bool,
    ) -> Result<(Vec<Position>, String)> {
        self.record_handled()?;
        let positions = self.positions();
        let meta = self.commit_metadata(clean)?;
        if let Some(guard) = self.guard.as_mut() {
            let lanes: Vec<(LaneId, u64)> = positions
                .iter()
                .filter_map(|(_, _, pos, lane)| lane.map(|l| (l, *pos as u64)))
                .collect();
            guard.checkpoint(&lanes, meta.clone().into_bytes())?;
        }
        let commit = positions
            .into_iter()
            .filter(|(t, p, _, _)| only.is_none_or(|o| o.iter().any(|(ot, op)| ot == t && op == p)))
            .map(|(t, p, pos, _)| (t, p, pos))
            .collect();
        self.counters.checkpoints += 1;
        self.meters.checkpoints.increment(1);
        self.publish_state();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.meters.last_checkpoint.set(now.as_secs_f64());
        Ok((commit, meta))
    }

    /// The guard's counters: the live guard's, or its last ones once it
    /// closed.
    pub fn guard_stats(&self) -> Option<crate::guard::Stats> {
        self.guard
            .as_ref()
            .map(Guard::stats)
            .or_else(|| self.closed_guard.clone())
    }

    /// Takes the guard out to be closed, with every handled input recorded
    /// (a failure to is logged: the guard is then poisoned and writes no
    /// more), keeping its last counters.
    pub fn take_guard(&mut self) -> Option<Guard> {
        if let Err(e) = self.record_handled() {
            tracing::warn!(error = %e, "recording the last handled inputs before the state folder closed");
        }
        let guard = self.guard.take();
        if let Some(g) = &guard {
            self.closed_guard = Some(g.stats());
        }
        guard
    }

    /// Takes the guard out as a crash would: inputs handled and not yet
    /// recorded are dropped with it.
    pub fn abort_guard(&mut self) -> Option<Guard> {
        self.handled.clear();
        self.guard.take()
    }

    /// Sets the gauges of the state's size from the engine's snapshot (as
    /// of its last checkpoint or open).
    pub fn publish_state(&self) {
        if let Some(g) = self.guard.as_ref() {
            let st = g.stats();
            let m = &self.meters;
            m.live_fingerprints.set(st.live_fingerprints as f64);
            m.live_epochs.set(st.live_epochs as f64);
            m.live_offsets.set(st.live_offsets as f64);
            m.epoch.set(st.epoch as f64);
            m.state_memory_bytes.set(st.memory_bytes as f64);
            m.state_disk_bytes.set(st.disk_bytes as f64);
            m.disk_fingerprints.set(st.disk_fingerprints as f64);
            m.state_disk_filter_bytes.set(st.disk_filter_bytes as f64);
            m.state_disk_index_bytes.set(st.disk_index_bytes as f64);
            // Counted by the engine since it opened.
            m.disk_reads.absolute(st.disk_reads);
            m.disk_hits.absolute(st.disk_hits);
        }
    }

    /// Takes librdkafka's view of the assigned partitions from its
    /// statistics: partition to its high watermark, and the position to
    /// count from while the guard has none of its own or is behind it
    /// (librdkafka's, the group's or the partition's start). Sets the
    /// `replayguard_consumer_lag` gauges; a partition that left this
    /// instance reads 0 there, so that a sum over instances counts each
    /// partition once.
    pub fn set_watermarks(&mut self, watermarks: BTreeMap<Partition, (i64, Option<i64>)>) {
        let old = std::mem::replace(&mut self.watermarks, watermarks);
        let lag = self.lag();
        for (topic, partition) in old.keys() {
            if !lag.contains_key(&(topic.clone(), *partition)) {
                self.meters.lag(topic, *partition).set(0.0);
            }
        }
        for ((topic, partition), l) in &lag {
            self.meters.lag(topic, *partition).set(*l as f64);
        }
    }

    /// The consumer lag of each assigned partition: its high watermark as
    /// of librdkafka's last statistics less its position now, or
    /// librdkafka's position in those statistics if that is further (it
    /// steps over transaction markers and aborted records, which no
    /// record handed on reaches). Empty without statistics.
    pub fn lag(&self) -> BTreeMap<Partition, i64> {
        self.watermarks
            .iter()
            .filter_map(|((topic, p), (high, fallback))| {
                let track = self.tracks.get(topic)?.get(p)?;
                let position = track.next.max(*fallback)?;
                Some(((topic.clone(), *p), (high - position).max(0)))
            })
            .collect()
    }

    /// Forgets the tracks, and any hold, of partitions that left.
    pub fn forget(&mut self, gone: &[Partition]) {
        if gone.iter().any(|tp| self.watermarks.contains_key(tp)) {
            let mut kept = self.watermarks.clone();
            kept.retain(|tp, _| !gone.contains(tp));
            self.set_watermarks(kept);
        }
        for (t, p) in gone {
            if let Some(m) = self.tracks.get_mut(t) {
                m.remove(p);
            }
        }
        if let Some(h) = self.held.as_mut() {
            h.partitions.retain(|tp| !gone.contains(tp));
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
                sink.encode()
            }
            None => Ok(String::new()),
        }
    }

    /// Stops the guard with `e`, unless it stopped already. Logged once, as
    /// a warning: the adapter's next call returns the error, and its caller
    /// reports it (the command line's one error line).
    pub fn fail(&mut self, e: Error) {
        if self.failure.reason.is_none() {
            tracing::warn!(error = %e, error_kind = e.kind(), "replayguard stopped");
            self.failure.reason = Some(e.to_string());
            self.failure.kind = Some(e.kind());
            self.failure.first = Some(e);
            self.wake.notify_one();
        }
    }

    /// Whether the guard stopped.
    pub fn failed(&self) -> bool {
        self.failure.reason.is_some()
    }

    /// The failure that stopped the guard: the first time the error itself,
    /// later [`Error::Stopped`] naming it.
    pub fn failure(&mut self) -> Option<Error> {
        let reason = self.failure.reason.as_ref()?;
        Some(self.failure.first.take().unwrap_or_else(|| Error::Stopped {
            reason: format!("stopped after an earlier failure: {reason}"),
            after: self.failure.kind,
        }))
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn tp(topic: &str, p: i32) -> Partition {
        (topic.to_owned(), p)
    }

    #[test]
    fn lag_is_the_watermark_less_the_position_now() {
        let mut s = Shared::new(None, Default::default());
        s.track("t", 0).next = Some(5);
        // No position of the guard's yet: librdkafka's is used.
        s.track("t", 1);
        s.set_watermarks(BTreeMap::from([
            (tp("t", 0), (12, Some(3))),
            (tp("t", 1), (9, Some(4))),
            // Not assigned here: no lag.
            (tp("t", 2), (100, Some(0))),
        ]));
        assert_eq!(s.lag(), BTreeMap::from([(tp("t", 0), 7), (tp("t", 1), 5)]));
        // Reading on lowers it at once, down to 0, never below.
        s.track("t", 0).next = Some(11);
        s.track("t", 1).next = Some(20);
        assert_eq!(s.lag(), BTreeMap::from([(tp("t", 0), 1), (tp("t", 1), 0)]));
        // librdkafka's position past the guard's last record (a
        // transaction marker after it) counts.
        s.set_watermarks(BTreeMap::from([
            (tp("t", 0), (12, Some(12))),
            (tp("t", 1), (22, Some(20))),
        ]));
        assert_eq!(s.lag(), BTreeMap::from([(tp("t", 0), 0), (tp("t", 1), 2)]));
        // A partition that leaves has no lag here any more.
        s.forget(&[tp("t", 0)]);
        assert_eq!(s.lag(), BTreeMap::from([(tp("t", 1), 2)]));
    }

    #[test]
    fn a_refused_claim_is_tried_again_after_a_doubling_delay_up_to_two_seconds() {
        let mut r = Refusal::after(None, "first".into());
        let mut delays = vec![r.delay().as_millis()];
        for n in 0..40 {
            r = Refusal::after(Some(r), format!("again {n}"));
            delays.push(r.delay().as_millis());
        }
        assert_eq!(&delays[..7], [100, 200, 400, 800, 1600, 2000, 2000]);
        assert!(delays.iter().all(|&d| (100..=2000).contains(&d)));
        assert_eq!((r.attempts, r.error.as_str()), (41, "again 39"));
    }

    /// Offers records of partition `in`[0], one batch, from `offset` on
    /// with these identities, and says which were admitted.
    fn offer_many(s: &mut Shared, offset: i64, fps: &[u64]) -> Result<Vec<bool>> {
        let mut admitted = Vec::new();
        let records: Vec<Offered<'_>> = (offset..)
            .zip(fps)
            .map(|(offset, fp)| Offered {
                topic: "in",
                partition: 0,
                offset,
                fp: Some(Fingerprint::id(*fp)),
            })
            .collect();
        s.admit(&records, &mut admitted)?;
        Ok(admitted)
    }

    fn offer(s: &mut Shared, offset: i64, fp: u64) -> Result<bool> {
        Ok(offer_many(s, offset, &[fp])? == [true])
    }

    #[test]
    fn handled_inputs_are_recorded_in_batches_and_still_catch_a_resend() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let guard = Guard::builder(dir.path()).open()?;
        let mut s = Shared::new(Some(guard), Default::default());
        let recorded = |s: &Shared| s.guard_stats().map_or(0, |g| g.recorded);
        let n = RECORD_BATCH as i64 + 3;
        let fps: Vec<u64> = (0..n as u64).collect();
        assert!(offer_many(&mut s, 0, &fps)?.iter().all(|a| *a));
        for o in 0..n {
            s.complete("in", 0, o)?;
        }
        // One full batch went in as the last ack filled it; three wait.
        assert_eq!(recorded(&s), RECORD_BATCH as u64);
        assert_eq!(s.handled.len(), 3);
        // A resend of a waiting one, at a new offset, is caught: the next
        // admission records the three before it asks.
        assert!(!offer(&mut s, n, (n - 1) as u64)?, "a resend is caught");
        assert_eq!(recorded(&s), n as u64);
        assert!(s.handled.is_empty());
        // A checkpoint takes the waiting ones with it: none is left out of
        // the state its positions are committed with.
        assert!(offer(&mut s, n + 1, 1_000_000)?);
        s.complete("in", 0, n + 1)?;
        assert_eq!(s.handled.len(), 1);
        let (commit, _) = s.checkpoint(None, false)?;
        assert_eq!(commit, vec![("in".to_owned(), 0, n + 2)]);
        assert_eq!(recorded(&s), n as u64 + 1);
        // As does the engine handed out, and the close.
        assert!(offer(&mut s, n + 2, 1_000_001)?);
        s.complete("in", 0, n + 2)?;
        let engine = s.engine()?.map(|g| g.stats().recorded);
        assert_eq!(engine, Some(n as u64 + 2));
        assert!(offer(&mut s, n + 3, 1_000_002)?);
        s.complete("in", 0, n + 3)?;
        let closed = s.take_guard().map(|g| g.stats().recorded);
        assert_eq!(closed, Some(n as u64 + 3));
        Ok(())
    }

    #[test]
    fn a_write_failure_while_recording_keeps_what_was_not_recorded() -> Result<()> {
        use crate::store::FAIL_HERE;
        let dir = tempfile::tempdir()?;
        let guard = Guard::builder(dir.path())
            .chunk_records(10)
            .retention_epochs(1)
            .open()?;
        let mut s = Shared::new(Some(guard), Default::default());
        // The state to come back to: five inputs, checkpointed.
        assert!(offer_many(&mut s, 0, &[0, 1, 2, 3, 4])?.iter().all(|a| *a));
        for o in 0..5 {
            s.complete("in", 0, o)?;
        }
        assert_eq!(s.checkpoint(None, false)?.0, vec![("in".to_owned(), 0, 5)]);
        // A full batch waits; the ack that fills it records it, and the
        // tenth record fills a chunk whose write fails.
        let n = RECORD_BATCH as i64;
        let fps: Vec<u64> = (100..100 + n as u64).collect();
        assert!(offer_many(&mut s, 5, &fps)?.iter().all(|a| *a));
        for o in 5..4 + n {
            s.complete("in", 0, o)?;
        }
        assert_eq!(s.handled.len(), RECORD_BATCH - 1);
        FAIL_HERE.with(|f| f.set(Some("store-write")));
        let failed = s.complete("in", 0, 4 + n);
        FAIL_HERE.with(|f| f.set(None));
        assert!(matches!(failed, Err(Error::Io(_))), "{failed:?}");
        // The nine recorded before it left the list; the rest stay.
        assert_eq!(s.handled.len(), RECORD_BATCH - 9);
        assert_eq!(s.handled[0].offset, Some(14));
        // The guard is poisoned: no checkpoint moves a position past what
        // it holds, nothing is admitted, and the list is kept.
        let checkpoint = s.checkpoint(None, false);
        assert!(
            matches!(checkpoint, Err(Error::Poisoned { .. })),
            "{checkpoint:?}"
        );
        let admitted = offer(&mut s, 4 + n + 1, 1);
        assert!(
            matches!(admitted, Err(Error::Poisoned { .. })),
            "{admitted:?}"
        );
        assert!(s.engine().is_err());
        assert_eq!(s.handled.len(), RECORD_BATCH - 9);
        // Opened again, the state is the checkpoint's: position 5, and
        // what it held still known.
        drop(s.abort_guard());
        let mut g = Guard::builder(dir.path()).retention_epochs(1).open()?;
        let lane = g.lane("in", 0);
        assert_eq!(g.position(lane), Some(5));
        let known = g.check(lane, Some(9_000), Some(Fingerprint::id(3)))?;
        assert!(matches!(known, Verdict::Duplicate { .. }), "{known:?}");
        let unrecorded = g.check(lane, Some(9_001), Some(Fingerprint::id(100)))?;
        assert_eq!(unrecorded, Verdict::Fresh);
        Ok(())
    }

    #[test]
    fn a_held_partition_is_neither_checkpointed_nor_committed_until_released() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let guard = Guard::builder(dir.path()).open()?;
        let mut s = Shared::new(Some(guard), Default::default());
        s.sink = Some(SinkPositions {
            topic: "out".into(),
            ends: BTreeMap::from([(0, 40)]),
            instance: "b".into(),
            in_flight_ms: 16_000,
            ..SinkPositions::default()
        });
        let lanes = [s.lane("in", 0), s.lane("in", 1)];
        assert!(lanes.iter().all(Option::is_some), "a guard gives lanes");
        s.track("in", 0).next = Some(7);
        // Partition 1 came from an instance that left without a clean
        // handover, at the group's offset 3.
        s.track("in", 1).next = Some(3);
        s.held = Some(Held {
            until: std::time::Instant::now() + std::time::Duration::from_secs(60),
            from: "a".into(),
            partitions: vec![tp("in", 1)],
            manifest: None,
            commits: Vec::new(),
            reconciled: false,
            refusal: None,
        });
        // Neither a periodic checkpoint nor a revoke's (clean) one names it.
        let (commit, _) = s.checkpoint(None, false)?;
        assert_eq!(commit, vec![("in".to_owned(), 0, 7)]);
        let (commit, meta) = s.checkpoint(Some(&[tp("in", 0), tp("in", 1)]), true)?;
        assert_eq!(commit, vec![("in".to_owned(), 0, 7)]);
        assert!(meta.contains("\"c\":true"), "{meta}");
        let position = |l: Option<LaneId>| s.guard.as_ref()?.position(l?);
        assert_eq!(position(lanes[0]), Some(7));
        assert_eq!(
            position(lanes[1]),
            None,
            "the manifest names the held partition"
        );
        // Once released (reconciled), it is this instance's again.
        s.held = None;
        let (mut commit, _) = s.checkpoint(None, false)?;
        commit.sort();
        assert_eq!(
            commit,
            vec![("in".to_owned(), 0, 7), ("in".to_owned(), 1, 3)]
        );
        Ok(())
    }
}
