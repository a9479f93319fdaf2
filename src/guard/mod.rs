//! The engine: check, record, checkpoint and recover, over generic records.
//!
//! It knows nothing of Kafka: a record is a lane (a named partition), an
//! offset and an optional content fingerprint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use roaring::RoaringTreemap;

use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::index::{LaneIndex, Reason};
use crate::store::{
    Chunk, ChunkWrite, Durability, EpochInfo, FORMAT_VERSION, LaneName, LanePosition, Manifest,
    Store, now_ms,
};

#[cfg(test)]
mod test;

/// A handle to one lane of a guard, from [`Guard::lane`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaneId(pub(crate) u32);

impl LaneId {
    /// The numeric id, stable for the life of the state folder.
    #[must_use]
    pub fn get(self) -> u32 {
        self.0
    }
}

/// The answer to "was this record handled already?".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Not seen within the retention: deliver it.
    Fresh,
    /// Handled already.
    Duplicate {
        /// Same position, or same content at another position.
        reason: Reason,
        /// The epoch in which it was handled.
        epoch: u64,
    },
}

impl Verdict {
    /// True for [`Verdict::Fresh`].
    #[must_use]
    pub fn is_fresh(self) -> bool {
        self == Verdict::Fresh
    }
}

/// Builds a [`Guard`]. Every setter states its default and bounds; `open`
/// validates them.
#[derive(Clone, Debug)]
#[must_use]
pub struct GuardBuilder {
    path: PathBuf,
    durability: Durability,
    retention_epochs: u32,
    retention_time: Option<Duration>,
    chunk_records: usize,
}

impl GuardBuilder {
    /// How chunk writes reach the disk. Default [`Durability::Process`].
    /// Checkpoints are always fsynced.
    pub fn durability(mut self, d: Durability) -> Self {
        self.durability = d;
        self
    }

    /// Completed epochs kept besides the open one. Default 0: the guard
    /// remembers everything since the previous completed checkpoint. Bounds:
    /// 0 to 1,000,000.
    pub fn retention_epochs(mut self, n: u32) -> Self {
        self.retention_epochs = n;
        self
    }

    /// Also keep every completed epoch closed less than this long ago.
    /// Default: none. Bounds: at most 365 days.
    pub fn retention_time(mut self, d: Option<Duration>) -> Self {
        self.retention_time = d;
        self
    }

    /// Records buffered per lane before they are written as one chunk.
    /// Default 10,000; bounds 1 to 10,000,000. [`Guard::flush`] writes
    /// sooner.
    pub fn chunk_records(mut self, n: usize) -> Self {
        self.chunk_records = n;
        self
    }

    /// Opens the guard, recovering the latest manifest and every live epoch.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an option out of bounds; the store's open
    /// errors ([`Error::InUse`], [`Error::ForeignState`],
    /// [`Error::UnsupportedVersion`], [`Error::Corrupt`], [`Error::Open`]).
    pub fn open(self) -> Result<Guard> {
        if self.retention_epochs > 1_000_000 {
            return Err(Error::Config(format!(
                "retention_epochs {} is above 1,000,000",
                self.retention_epochs
            )));
        }
        if self
            .retention_time
            .is_some_and(|d| d > Duration::from_secs(365 * 86_400))
        {
            return Err(Error::Config("retention_time is above 365 days".into()));
        }
        if !(1..=10_000_000).contains(&self.chunk_records) {
            return Err(Error::Config(format!(
                "chunk_records {} is outside 1..=10,000,000",
                self.chunk_records
            )));
        }
        Guard::open(self)
    }
}

/// A cheap snapshot of a guard's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Records checked.
    pub checked: u64,
    /// Records recorded as handled.
    pub recorded: u64,
    /// Duplicates found by position.
    pub duplicates_same_position: u64,
    /// Duplicates found by content at another position.
    pub duplicates_same_content: u64,
    /// Content fingerprints in memory.
    pub live_fingerprints: u64,
    /// Offsets in memory.
    pub live_offsets: u64,
    /// Live epochs (the open one included).
    pub live_epochs: u64,
    /// The open epoch.
    pub epoch: u64,
    /// Checkpoints completed since open.
    pub checkpoints: u64,
    /// Bytes on disk, as of the last checkpoint or open.
    pub disk_bytes: u64,
    /// Duration of the last checkpoint.
    pub last_checkpoint: Option<Duration>,
    /// Duration of the recovery at open.
    pub last_recovery: Duration,
}

/// What a checkpoint did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointReport {
    /// The epoch now open (the checkpoint's number).
    pub epoch: u64,
    /// Epochs dropped by retention.
    pub dropped_epochs: Vec<u64>,
    /// How long it took, fsync included.
    pub duration: Duration,
}

#[derive(Debug)]
struct Lane {
    name: LaneName,
    index: LaneIndex,
    pending: Chunk,
    pending_records: usize,
    persisted: bool,
    next_seq: u64,
    position: Option<u64>,
}

/// The engine over one state folder.
///
/// # Example
///
/// ```
/// use replayguard::{Fingerprint, Guard, Verdict};
/// # fn main() -> replayguard::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let mut guard = Guard::builder(dir.path()).open()?;
/// let lane = guard.lane("orders", 0);
/// let fp = Fingerprint::content(Some(b"k"), Some(b"v"));
/// assert_eq!(guard.record(lane, Some(7), Some(fp))?, Verdict::Fresh);
/// assert!(!guard.check(lane, Some(7), Some(fp))?.is_fresh());
/// guard.checkpoint(&[(lane, 8)], Vec::new())?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Guard {
    store: Store,
    cfg: GuardBuilder,
    lanes: Vec<Lane>,
    by_name: HashMap<LaneName, LaneId>,
    epoch: u64,
    epochs: Vec<EpochInfo>,
    manifest: Option<Manifest>,
    poisoned: Option<String>,
    stats: Stats,
    pending_total: usize,
}

impl Guard {
    /// Starts building a guard over the state folder `path`.
    pub fn builder(path: impl AsRef<Path>) -> GuardBuilder {
        GuardBuilder {
            path: path.as_ref().to_owned(),
            durability: Durability::default(),
            retention_epochs: 0,
            retention_time: None,
            chunk_records: 10_000,
        }
    }

    fn open(cfg: GuardBuilder) -> Result<Self> {
        let started = Instant::now();
        let (store, loaded) = Store::open(&cfg.path)?;
        let (epoch, epochs) = match &loaded.manifest {
            Some(m) => (m.epoch, m.epochs.clone()),
            None => (
                0,
                vec![EpochInfo {
                    epoch: 0,
                    opened_at_ms: now_ms(),
                    closed_at_ms: None,
                }],
            ),
        };
        let mut guard = Guard {
            store,
            cfg,
            lanes: Vec::new(),
            by_name: HashMap::new(),
            epoch,
            epochs,
            manifest: loaded.manifest,
            poisoned: None,
            stats: Stats::default(),
            pending_total: 0,
        };
        for (id, name) in loaded.lanes {
            if id as usize != guard.lanes.len() {
                return Err(Error::Corrupt {
                    path: guard.store.path().to_owned(),
                    what: format!(
                        "lane ids are not dense: found {id} at {}",
                        guard.lanes.len()
                    ),
                });
            }
            guard.push_lane(name, true);
        }
        if let Some(m) = guard.manifest.clone() {
            for p in &m.positions {
                let id = guard.lane(&p.lane.topic, p.lane.partition);
                guard.lanes[id.0 as usize].position = Some(p.next_offset);
            }
        }
        let oldest = guard.epochs.first().map_or(epoch, |e| e.epoch);
        let path = guard.store.path().to_owned();
        let lanes = &mut guard.lanes;
        // Chunks come in key order, so all of an (epoch, lane) arrive
        // together: their hashes are gathered and the table built once.
        let mut gathered: Option<(u64, u32, Vec<u128>)> = None;
        let build = |lanes: &mut Vec<Lane>, (e, lane, hashes): (u64, u32, Vec<u128>)| {
            if let Some(l) = lanes.get_mut(lane as usize) {
                l.index.epoch_mut(e).load_hashes(hashes, e < epoch);
            }
        };
        guard.store.load_chunks(oldest, |e, lane, chunk| {
            let l = lanes.get_mut(lane as usize).ok_or_else(|| Error::Corrupt {
                path: path.clone(),
                what: format!("a chunk names lane {lane}, which is not in the lane table"),
            })?;
            let idx = l.index.epoch_mut(e);
            idx.merge_offsets(&chunk.offsets);
            idx.merge_ids(&chunk.ids);
            match &mut gathered {
                Some((ge, gl, hashes)) if (*ge, *gl) == (e, lane) => {
                    hashes.extend_from_slice(&chunk.hashes);
                }
                _ => {
                    if let Some(done) = gathered.replace((e, lane, chunk.hashes)) {
                        build(lanes, done);
                    }
                }
            }
            Ok(())
        })?;
        if let Some(done) = gathered.take() {
            build(&mut guard.lanes, done);
        }
        // New chunks in the open epoch must not overwrite old ones.
        guard.resume_sequences()?;
        for l in &mut guard.lanes {
            l.index.seal_before(epoch);
        }
        guard.stats.last_recovery = started.elapsed();
        guard.stats.disk_bytes = guard.store.disk_bytes();
        guard.stats.epoch = epoch;
        guard.refresh_live();
        tracing::info!(
            path = %guard.store.path().display(),
            epoch,
            lanes = guard.lanes.len(),
            live_fingerprints = guard.stats.live_fingerprints,
            ms = guard.stats.last_recovery.as_millis() as u64,
            "replayguard state recovered"
        );
        Ok(guard)
    }

    /// Finds the next free chunk sequence of every lane in the open epoch.
    fn resume_sequences(&mut self) -> Result<()> {
        let epoch = self.epoch;
        let lanes = &mut self.lanes;
        self.store.chunk_seqs(epoch, |lane, seq| {
            if let Some(l) = lanes.get_mut(lane as usize) {
                l.next_seq = l.next_seq.max(seq + 1);
            }
        })
    }

    fn push_lane(&mut self, name: LaneName, persisted: bool) -> LaneId {
        let id = LaneId(self.lanes.len() as u32);
        self.by_name.insert(name.clone(), id);
        self.lanes.push(Lane {
            name,
            index: LaneIndex::default(),
            pending: Chunk::default(),
            pending_records: 0,
            persisted,
            next_seq: 0,
            position: None,
        });
        id
    }

    /// The lane for a topic partition, created on first use.
    pub fn lane(&mut self, topic: &str, partition: i32) -> LaneId {
        let name = LaneName {
            topic: topic.to_owned(),
            partition,
        };
        match self.by_name.get(&name) {
            Some(id) => *id,
            None => self.push_lane(name, false),
        }
    }

    /// The topic partition of a lane.
    #[must_use]
    pub fn lane_name(&self, lane: LaneId) -> Option<&LaneName> {
        self.lanes.get(lane.0 as usize).map(|l| &l.name)
    }

    /// The lane's next position as of the last checkpoint, if it has one.
    #[must_use]
    pub fn position(&self, lane: LaneId) -> Option<u64> {
        self.lanes.get(lane.0 as usize).and_then(|l| l.position)
    }

    /// The latest durable manifest.
    #[must_use]
    pub fn manifest(&self) -> Option<&Manifest> {
        self.manifest.as_ref()
    }

    /// The open epoch.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The state folder.
    #[must_use]
    pub fn path(&self) -> &Path {
        self.store.path()
    }

    fn ready(&self) -> Result<()> {
        match &self.poisoned {
            Some(cause) => Err(Error::Poisoned {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    fn lane_ref(&self, lane: LaneId) -> Result<&Lane> {
        self.lanes
            .get(lane.0 as usize)
            .ok_or(Error::UnknownLane(lane.0))
    }

    /// Was this record handled within the retention? Does not record it.
    ///
    /// `offset` is its position in the lane (`None` when it has none);
    /// `fp` its content identity (`None` for position-only identity).
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`] after a failed write; [`Error::UnknownLane`].
    pub fn check(
        &mut self,
        lane: LaneId,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        self.ready()?;
        let found = self.lane_ref(lane)?.index.find(offset, fp);
        self.stats.checked += 1;
        Ok(self.count(found))
    }

    fn count(&mut self, found: Option<(Reason, u64)>) -> Verdict {
        match found {
            None => Verdict::Fresh,
            Some((reason, epoch)) => {
                match reason {
                    Reason::SamePosition => self.stats.duplicates_same_position += 1,
                    Reason::SameContent => self.stats.duplicates_same_content += 1,
                }
                Verdict::Duplicate { reason, epoch }
            }
        }
    }

    /// Records a handled record in the open epoch, unless it is a duplicate,
    /// which is never recorded twice. Returns the verdict it had.
    ///
    /// The record is known in memory at once, and reaches the store with the
    /// lane's next chunk (every `chunk_records`, at [`Guard::flush`], or at a
    /// checkpoint).
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], [`Error::UnknownLane`], or a store error from a
    /// chunk write (which poisons the guard).
    pub fn record(
        &mut self,
        lane: LaneId,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        self.ready()?;
        let epoch = self.epoch;
        let l = self
            .lanes
            .get_mut(lane.0 as usize)
            .ok_or(Error::UnknownLane(lane.0))?;
        if let Some(found) = l.index.find(offset, fp) {
            return Ok(self.count(Some(found)));
        }
        let idx = l.index.epoch_mut(epoch);
        if let Some(o) = offset {
            idx.insert_offset(o);
            l.pending.offsets.insert(o);
            self.stats.live_offsets += 1;
        }
        match fp {
            Some(f @ Fingerprint::Hash(h)) => {
                idx.insert_fingerprint(f);
                l.pending.hashes.push(h);
                self.stats.live_fingerprints += 1;
            }
            Some(f @ Fingerprint::Id(id)) => {
                idx.insert_fingerprint(f);
                l.pending.ids.insert(id);
                self.stats.live_fingerprints += 1;
            }
            None => {}
        }
        l.pending_records += 1;
        self.pending_total += 1;
        self.stats.recorded += 1;
        if l.pending_records >= self.cfg.chunk_records {
            self.flush()?;
        }
        Ok(Verdict::Fresh)
    }

    /// Writes every pending chunk in one batch, with the configured
    /// durability.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], or a store error (which poisons the guard).
    pub fn flush(&mut self) -> Result<()> {
        self.ready()?;
        let r = self.write_pending(None, &[]);
        self.poison_on(r)
    }

    fn poison_on<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r
            && e.is_poisoning()
        {
            tracing::error!(error = %e, "replayguard store write failed; guard poisoned");
            self.poisoned = Some(e.to_string());
        }
        r
    }

    /// Writes every pending chunk of the open epoch, and with a manifest the
    /// `carried` chunks as the first chunks of the next epoch, in one batch.
    fn write_pending(
        &mut self,
        manifest: Option<&Manifest>,
        carried: &[(u32, Chunk)],
    ) -> Result<()> {
        if self.pending_total == 0 && manifest.is_none() {
            return Ok(());
        }
        let epoch = self.epoch;
        let mut writes: Vec<ChunkWrite<'_>> = carried
            .iter()
            .map(|(lane, chunk)| ChunkWrite {
                epoch: epoch + 1,
                lane: *lane,
                seq: 0,
                chunk,
            })
            .collect();
        let mut new_lanes = Vec::new();
        for (id, l) in self.lanes.iter().enumerate() {
            // Every lane not yet in the lane table goes in with any write, so
            // the persisted ids stay a dense prefix (recovery requires it)
            // even when an earlier lane has nothing to write yet.
            if !l.persisted {
                new_lanes.push((id as u32, &l.name));
            }
            if l.pending_records > 0 {
                writes.push(ChunkWrite {
                    epoch,
                    lane: id as u32,
                    seq: l.next_seq,
                    chunk: &l.pending,
                });
            }
        }
        self.store
            .write(&writes, &new_lanes, manifest, self.cfg.durability)?;
        let written: Vec<u32> = writes
            .iter()
            .filter(|w| w.epoch == epoch)
            .map(|w| w.lane)
            .collect();
        let named: Vec<u32> = new_lanes.iter().map(|(id, _)| *id).collect();
        for id in named {
            self.lanes[id as usize].persisted = true;
        }
        for id in written {
            let l = &mut self.lanes[id as usize];
            l.pending = Chunk::default();
            l.pending_records = 0;
            l.next_seq += 1;
        }
        self.pending_total = 0;
        Ok(())
    }

    /// Completes checkpoint `epoch + 1`: writes every pending chunk and the
    /// manifest in one atomic, fsynced batch, opens the next epoch, then
    /// drops the epochs that fall outside the retention, whole.
    ///
    /// `positions` gives the next offset of lanes whose position moved
    /// (others keep theirs); `sink` is stored as is (for example output end
    /// offsets).
    ///
    /// Offsets at or past a lane's new position that only a dropped epoch
    /// holds (a checkpoint taken while replaying records handled before a
    /// restart) move into the new epoch, so a restart from that position
    /// still finds them.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], [`Error::UnknownLane`], or a store error (which
    /// poisons the guard). On error nothing of the checkpoint is visible
    /// after a reopen except, possibly, the epoch drop of a completed one.
    pub fn checkpoint(
        &mut self,
        positions: &[(LaneId, u64)],
        sink: Vec<u8>,
    ) -> Result<CheckpointReport> {
        self.ready()?;
        let started = Instant::now();
        for (lane, _) in positions {
            self.lane_ref(*lane)?;
        }
        let now = now_ms();
        let next = self.epoch + 1;
        let mut epochs = self.epochs.clone();
        if let Some(open) = epochs.last_mut() {
            open.closed_at_ms = Some(now);
        }
        epochs.push(EpochInfo {
            epoch: next,
            opened_at_ms: now,
            closed_at_ms: None,
        });
        let keep_from = self.oldest_kept(&epochs, next, now);
        let dropped: Vec<u64> = epochs
            .iter()
            .map(|e| e.epoch)
            .filter(|e| *e < keep_from)
            .collect();
        epochs.retain(|e| e.epoch >= keep_from);
        let mut moved: HashMap<u32, u64> = positions.iter().map(|(l, p)| (l.0, *p)).collect();
        let carried = self.carried_offsets(&moved, keep_from);
        let manifest = Manifest {
            format: FORMAT_VERSION,
            epoch: next,
            positions: self
                .lanes
                .iter()
                .enumerate()
                .filter_map(|(id, l)| {
                    let p = moved.remove(&(id as u32)).or(l.position)?;
                    Some(LanePosition {
                        lane: l.name.clone(),
                        next_offset: p,
                    })
                })
                .collect(),
            sink,
            epochs: epochs.clone(),
            checkpointed_at_ms: now,
        };
        let r = self.write_pending(Some(&manifest), &carried);
        self.poison_on(r)?;
        // The manifest is durable: from here on, state follows it.
        for (lane, p) in positions {
            self.lanes[lane.0 as usize].position = Some(*p);
        }
        self.epoch = next;
        self.epochs = epochs;
        self.manifest = Some(manifest);
        for l in &mut self.lanes {
            l.next_seq = 0;
            l.index.drop_before(keep_from);
            l.index.seal_before(next);
        }
        for (id, chunk) in &carried {
            let l = &mut self.lanes[*id as usize];
            l.index.epoch_mut(next).merge_offsets(&chunk.offsets);
            l.next_seq = 1;
        }
        if !dropped.is_empty() {
            let r = self.store.drop_epochs_before(keep_from);
            self.poison_on(r)?;
        }
        self.refresh_live();
        let duration = started.elapsed();
        self.stats.checkpoints += 1;
        self.stats.last_checkpoint = Some(duration);
        self.stats.disk_bytes = self.store.disk_bytes();
        self.stats.epoch = next;
        tracing::debug!(
            epoch = next,
            ?dropped,
            ms = duration.as_millis() as u64,
            "checkpoint complete"
        );
        Ok(CheckpointReport {
            epoch: next,
            dropped_epochs: dropped,
            duration,
        })
    }

    /// Per lane, the offsets at or past its position (after this checkpoint)
    /// held by the epochs about to be dropped.
    ///
    /// They exist when a checkpoint lands while a restarted consumer is
    /// still replaying records it handled before the restart: those were
    /// handled in an older epoch, yet a restart from the new position would
    /// replay them again. Dropping them with their epoch would let them
    /// through as fresh, so their positions move into the next epoch, in
    /// the checkpoint's batch. Content fingerprints stay with their epoch:
    /// a replay repeats the position.
    fn carried_offsets(&self, moved: &HashMap<u32, u64>, keep_from: u64) -> Vec<(u32, Chunk)> {
        let mut carried = Vec::new();
        for (id, l) in self.lanes.iter().enumerate() {
            // A lane with no position yet replays from its start: every
            // offset it holds is still ahead of it.
            let p = moved.get(&(id as u32)).copied().or(l.position).unwrap_or(0);
            let mut offsets = RoaringTreemap::new();
            for (_, idx) in l.index.epochs().take_while(|(e, _)| *e < keep_from) {
                let set = idx.offset_set();
                if set.max().is_some_and(|m| m >= p) {
                    let mut tail = set.clone();
                    tail.remove_range(..p);
                    offsets |= tail;
                }
            }
            if !offsets.is_empty() {
                carried.push((
                    id as u32,
                    Chunk {
                        offsets,
                        ..Chunk::default()
                    },
                ));
            }
        }
        carried
    }

    /// The oldest epoch kept after opening `open` at `now`.
    fn oldest_kept(&self, epochs: &[EpochInfo], open: u64, now: u64) -> u64 {
        let by_count = open.saturating_sub(u64::from(self.cfg.retention_epochs));
        let by_time = self.cfg.retention_time.and_then(|keep| {
            let keep = keep.as_millis() as u64;
            epochs
                .iter()
                .find(|e| e.closed_at_ms.is_none_or(|c| now.saturating_sub(c) < keep))
                .map(|e| e.epoch)
        });
        by_time.map_or(by_count, |t| t.min(by_count))
    }

    fn refresh_live(&mut self) {
        let (mut fps, mut offs) = (0, 0);
        for l in &self.lanes {
            for (_, idx) in l.index.epochs() {
                fps += idx.fingerprints();
                offs += idx.offsets();
            }
        }
        self.stats.live_fingerprints = fps;
        self.stats.live_offsets = offs;
        self.stats.live_epochs = self.epochs.len() as u64;
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// Heap bytes held by the in-memory index (an estimate).
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.lanes
            .iter()
            .flat_map(|l| l.index.epochs())
            .map(|(_, i)| i.memory_bytes())
            .sum()
    }

    /// Per lane and live epoch: (lane, epoch, fingerprints, offsets).
    #[must_use]
    pub fn epoch_table(&self) -> Vec<(LaneName, u64, u64, u64)> {
        let mut out = Vec::new();
        for l in &self.lanes {
            for (e, idx) in l.index.epochs() {
                out.push((l.name.clone(), e, idx.fingerprints(), idx.offsets()));
            }
        }
        out
    }

    /// The offsets a lane handled in its live epochs (for tests and tools).
    #[must_use]
    pub fn live_offsets(&self, lane: LaneId) -> RoaringTreemap {
        let mut all = RoaringTreemap::new();
        if let Some(l) = self.lanes.get(lane.0 as usize) {
            for (_, idx) in l.index.epochs() {
                all |= idx.offset_set();
            }
        }
        all
    }

    /// Every lane the guard knows.
    pub fn lanes(&self) -> impl Iterator<Item = (LaneId, &LaneName)> {
        self.lanes
            .iter()
            .enumerate()
            .map(|(i, l)| (LaneId(i as u32), &l.name))
    }
}
