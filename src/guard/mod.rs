//! The engine: check, record, checkpoint and recover, over generic records.
//!
//! It knows nothing of Kafka: a record is a lane (a named partition), an
//! offset and an optional content fingerprint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use crate::changelog::{Shipment, Shipped};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::index::{
    Aim, DiskFilter, FAR_SLOTS, LaneIndex, Lookup, Reason, TAG_SPAN, keep_last_of_each_key, key_of,
    resolve,
};
use crate::store::{
    Chunk, ChunkWrite, Durability, EpochInfo, FORMAT_VERSION, LaneName, LanePosition, Manifest,
    Store, now_ms,
};

/// Bytes a content hash is reckoned to take in memory when recovery
/// decides, before loading, which sealed epochs fit the memory budget: a
/// table laid out at recovery, 12-byte slots 85% full and their filter.
const EST_BYTES_PER_HASH: u64 = 15;
/// Largest memory budget accepted: 1 PiB.
const MAX_MEMORY_BYTES: u64 = 1 << 50;
/// How far ahead a batch of records fetches: filter words this many records
/// ahead, slots half as many.
const PREFETCH_AHEAD: usize = 16;
/// How far ahead a batch of checks fetches filter words, and how far ahead
/// it tests them and fetches the slots they let through to. A check that
/// the filter turns away costs little, so a batch of fresh records moves
/// fast and needs its words fetched from further ahead than a batch of
/// records, which inserts (misses at 10M: 1.3 to 1.4 times the rate of
/// the path that fetched at 16 and 8 and worked out each probe's filter
/// position three times, BENCHMARKS.md).
const CHECK_AHEAD: usize = 32;
const CHECK_SCREEN_AHEAD: usize = 12;

#[cfg(test)]
mod test;
mod view;

pub use view::{EpochContent, FolderView};

/// The error for a chunk of a lane the lane table does not name.
fn unknown_lane(path: &std::path::Path, lane: u32) -> Error {
    Error::Corrupt {
        path: path.to_owned(),
        what: format!("a chunk names lane {lane}, which is not in the lane table"),
    }
}

/// One record of a batch for [`Guard::check_many`] and
/// [`Guard::record_many`]: what [`Guard::check`] takes, in one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The record's lane.
    pub lane: LaneId,
    /// Its position in the lane, if it has one.
    pub offset: Option<u64>,
    /// Its content identity, if it has one.
    pub fp: Option<Fingerprint>,
}

impl Probe {
    /// A probe for one record.
    #[must_use]
    pub fn new(lane: LaneId, offset: Option<u64>, fp: Option<Fingerprint>) -> Self {
        Probe { lane, offset, fp }
    }
}

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
    max_memory_bytes: Option<u64>,
    journal: bool,
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

    /// How much memory the index may hold before sealed epochs keep their
    /// content hashes on disk. Default `None`: no limit, every live epoch
    /// in memory. Bounds: 0 to 1 PiB (`Some(0)` keeps every sealed epoch
    /// on disk).
    ///
    /// Over the budget, each checkpoint moves the oldest sealed epochs'
    /// hashes to disk until the index is under 90% of it; recovery loads
    /// only the newest sealed epochs that fit. A hash on disk costs about
    /// 1.8 bytes of memory (a filter in front of it) instead of 20 to 31 in
    /// memory (about 20 in a packed table, 31 in a window that has dropped
    /// epochs for a while, as `benches/index.rs` measures them),
    /// and a record whose hash the filter lets through (every resend, and
    /// about 1 fresh record in 500 when the filter is full, fewer before)
    /// pays a disk read: 10 to 35 µs of CPU for one that finds its hash,
    /// measured with 10M and 100M hashes on disk. The open
    /// epoch, and the offsets and user ids of every live epoch, always
    /// stay in memory, so the budget is a target, not a cap: it is
    /// exceeded when they alone exceed it.
    pub fn max_memory_bytes(mut self, bytes: Option<u64>) -> Self {
        self.max_memory_bytes = bytes;
        self
    }

    /// Keep, besides the index, each lane's content of the open epoch, so
    /// that it can be shipped to a changelog ([`Guard::ship_open`]).
    /// Default false. It costs a copy of the open epoch's identities in
    /// memory.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn journal(mut self, yes: bool) -> Self {
        self.journal = yes;
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
        if self.max_memory_bytes.is_some_and(|b| b > MAX_MEMORY_BYTES) {
            return Err(Error::Config(
                "max_memory_bytes is above 1 PiB (2^50 bytes)".into(),
            ));
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
    /// Live content fingerprints (hashes and ids), in memory or on disk.
    pub live_fingerprints: u64,
    /// Of those, the ones held in memory.
    pub memory_fingerprints: u64,
    /// Of those, the content hashes of sealed epochs kept on disk.
    pub disk_fingerprints: u64,
    /// Bytes the index holds in memory, the disk filters included (an
    /// estimate, as of the last checkpoint or open).
    pub memory_bytes: u64,
    /// Of those, the filters in front of the hashes on disk.
    pub disk_filter_bytes: u64,
    /// Bytes on disk of the index of the hashes kept there.
    pub disk_index_bytes: u64,
    /// Epochs below this one keep their content hashes on disk.
    pub memory_floor: u64,
    /// Lookups that read the disk (filter said "maybe").
    pub disk_reads: u64,
    /// Of those, the ones that found a live duplicate.
    pub disk_hits: u64,
    /// Offsets in memory (all of them: offsets never go to disk).
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
    /// With a journal: what the lane handled in the open epoch, all of it
    /// (every chunk written, the pending one not yet).
    journal: Chunk,
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
    /// The oldest live epoch.
    oldest: u64,
    /// Epochs below it keep their content hashes on disk.
    floor: u64,
    /// With a journal: the number of changelog parts of each lane's sealed
    /// live epochs, (lane, epoch) to parts, for their tombstones.
    shipped: BTreeMap<(u32, u64), u32>,
    /// With a journal: what a checkpoint leaves to ship after it (the
    /// offsets carried into the new epoch, the dropped epochs' tombstones).
    after: Vec<Shipment>,
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
            max_memory_bytes: None,
            journal: false,
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
        let oldest = epochs.first().map_or(epoch, |e| e.epoch);
        store.set_oldest_live(oldest);
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
            oldest,
            floor: oldest,
            shipped: BTreeMap::new(),
            after: Vec::new(),
        };
        guard.restore_lanes(loaded.lanes)?;
        let (floor, disk_counts) = guard.memory_floor()?;
        guard.load_epochs(floor, &disk_counts)?;
        guard.stats.epoch = epoch;
        guard.refresh_live();
        guard.stats.last_recovery = started.elapsed();
        tracing::info!(
            path = %guard.store.path().display(),
            epoch,
            lanes = guard.lanes.len(),
            live_fingerprints = guard.stats.live_fingerprints,
            disk_fingerprints = guard.stats.disk_fingerprints,
            ms = guard.stats.last_recovery.as_millis() as u64,
            "replayguard state recovered"
        );
        Ok(guard)
    }

    /// The lane table and, from the manifest, each lane's position.
    fn restore_lanes(&mut self, loaded: Vec<(u32, LaneName)>) -> Result<()> {
        for (id, name) in loaded {
            if id as usize != self.lanes.len() {
                return Err(Error::Corrupt {
                    path: self.store.path().to_owned(),
                    what: format!("lane ids are not dense: found {id} at {}", self.lanes.len()),
                });
            }
            self.push_lane(name, true);
        }
        if let Some(m) = self.manifest.clone() {
            for p in &m.positions {
                let id = self.lane(&p.lane.topic, p.lane.partition);
                self.lanes[id.0 as usize].position = Some(p.next_offset);
            }
        }
        Ok(())
    }

    /// Which sealed epochs keep their hashes in memory: all, or under a
    /// budget the newest that fit (a first pass reads only the counts).
    /// Returns the lowest epoch kept in memory, and each lane's count of
    /// hashes below it.
    fn memory_floor(&mut self) -> Result<(u64, Vec<u64>)> {
        let (epoch, oldest) = (self.epoch, self.oldest);
        let mut disk_counts: Vec<u64> = vec![0; self.lanes.len()];
        let mut per_lane: Vec<(u64, u32, u64)> = Vec::new();
        let floor = match self.cfg.max_memory_bytes {
            None => oldest,
            Some(budget) => {
                let mut per_epoch: BTreeMap<u64, u64> = BTreeMap::new();
                self.store.count_hashes(oldest, |e, lane, n| {
                    *per_epoch.entry(e).or_default() += n;
                    per_lane.push((e, lane, n));
                })?;
                let mut used = per_epoch.get(&epoch).copied().unwrap_or(0) * EST_BYTES_PER_HASH;
                let mut floor = oldest;
                for (&e, &n) in per_epoch.range(..epoch).rev() {
                    used += n * EST_BYTES_PER_HASH;
                    if used > budget {
                        floor = e + 1;
                        break;
                    }
                }
                // Epochs without hashes cost nothing where they are; above
                // the floor they would only make it depend on them (with a
                // budget of 0, an empty newest sealed epoch would keep the
                // floor below it).
                while floor < epoch && per_epoch.get(&floor).is_none_or(|&n| n == 0) {
                    floor += 1;
                }
                floor
            }
        };
        let floor = floor.max(epoch.saturating_sub(TAG_SPAN / 4)).min(epoch);
        if floor > oldest && self.cfg.max_memory_bytes.is_none() {
            self.store.count_hashes(oldest, |e, lane, n| {
                per_lane.push((e, lane, n));
            })?;
        }
        for (e, lane, n) in per_lane {
            if e < floor
                && let Some(c) = disk_counts.get_mut(lane as usize)
            {
                *c += n;
            }
        }
        Ok((floor, disk_counts))
    }

    /// Loads every live epoch's chunks: offsets and ids into the lanes'
    /// bitmaps, hashes from `floor` on into memory, older ones into the
    /// disk filter (and the on-disk index where it does not cover them
    /// yet), and the next free chunk sequence of each lane in the open
    /// epoch.
    fn load_epochs(&mut self, floor: u64, disk_counts: &[u64]) -> Result<()> {
        let (epoch, oldest) = (self.epoch, self.oldest);
        self.floor = floor;
        for (l, &n) in self.lanes.iter_mut().zip(disk_counts) {
            l.index = LaneIndex::new(epoch, oldest, floor);
            if floor > oldest {
                l.index.disk_mut().filter = Some(DiskFilter::with_capacity(n * 3 / 2));
            }
        }
        // Epochs below the floor that the disk index does not cover yet.
        let covered = self.store.spilled()?.map_or(oldest, |s| s + 1).max(oldest);
        let mut to_spill: Vec<Vec<(u128, u64)>> = vec![Vec::new(); self.lanes.len()];
        let mut in_memory: Vec<Vec<(u128, u64)>> = vec![Vec::new(); self.lanes.len()];
        let path = self.store.path().to_owned();
        let lanes = &mut self.lanes;
        let journal = self.cfg.journal;
        let mut counts: BTreeMap<(u32, u64), [u64; 3]> = BTreeMap::new();
        let mut seen_below = vec![0u64; lanes.len()];
        self.store.load_chunks(oldest, |e, lane, seq, chunk| {
            let l = lanes
                .get_mut(lane as usize)
                .ok_or_else(|| unknown_lane(&path, lane))?;
            if e == epoch {
                // New chunks in the open epoch must not overwrite old ones.
                l.next_seq = l.next_seq.max(seq + 1);
            }
            if journal && e == epoch {
                crate::changelog::merge(&mut l.journal, chunk.clone());
            } else if journal {
                let c = counts.entry((lane, e)).or_default();
                c[0] += chunk.hashes.len() as u64;
                c[1] += chunk.ids.len();
                c[2] += chunk.offsets.len();
            }
            l.index.merge_offsets(e, &chunk.offsets);
            l.index.merge_ids(e, &chunk.ids);
            if e >= floor {
                in_memory[lane as usize].extend(chunk.hashes.iter().map(|&h| (key_of(h), e)));
            } else {
                l.index.count_disk_hashes(e, chunk.hashes.len() as u64);
                if let Some(n) = seen_below.get_mut(lane as usize) {
                    *n += chunk.hashes.len() as u64;
                }
                if let Some(f) = l.index.disk_mut().filter.as_mut() {
                    f.insert_many(&chunk.hashes);
                }
                if e >= covered {
                    to_spill[lane as usize].extend(chunk.hashes.iter().map(|&h| (key_of(h), e)));
                }
            }
            Ok(())
        })?;
        if seen_below != disk_counts {
            // Only the sizes of the disk filters came from the counts: the
            // filters hold every hash, so answers stay right, but a filter
            // sized too small lets more absent hashes through to a disk read.
            tracing::warn!(
                path = %path.display(),
                counted = disk_counts.iter().sum::<u64>(),
                found = seen_below.iter().sum::<u64>(),
                "the stored chunk counts disagree with the chunks; the disk filters may be sized wrongly"
            );
        }
        for (l, hashes) in self.lanes.iter_mut().zip(in_memory) {
            l.index.load_hashes(hashes);
            l.index.seal_loaded();
        }
        self.shipped = counts
            .into_iter()
            .map(|(k, [h, i, o])| (k, crate::changelog::parts_for(h, i, o)))
            .collect();
        if floor > covered {
            // One entry a key, in its newest epoch, as the spill keeps it:
            // the oldest would read as dropped while a newer epoch still
            // holds the key.
            for v in &mut to_spill {
                v.sort_unstable();
                keep_last_of_each_key(v);
            }
            let entries = to_spill
                .iter()
                .enumerate()
                .flat_map(|(lane, v)| v.iter().map(move |&(k, e)| (lane as u32, k, e)));
            self.store.spill(entries, floor - 1)?;
        }
        Ok(())
    }

    fn push_lane(&mut self, name: LaneName, persisted: bool) -> LaneId {
        let id = LaneId(self.lanes.len() as u32);
        self.by_name.insert(name.clone(), id);
        self.lanes.push(Lane {
            name,
            index: LaneIndex::new(self.epoch, self.oldest, self.floor),
            pending: Chunk::default(),
            pending_records: 0,
            persisted,
            next_seq: 0,
            position: None,
            journal: Chunk::default(),
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
    /// [`Error::Poisoned`] after a failed write; [`Error::UnknownLane`];
    /// a store error when the hash had to be read from disk and the read
    /// failed (never a "fresh" in its place).
    pub fn check(
        &mut self,
        lane: LaneId,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        self.ready()?;
        self.lane_ref(lane)?;
        self.check_one(lane.0 as usize, offset, fp)
    }

    /// [`Guard::check`] for a batch of records, such as one poll's worth:
    /// `verdicts` is cleared and gets one verdict per probe, in order.
    ///
    /// The same answers as one `check` per probe, faster: while it answers
    /// one record it fetches what the lookups of the next ones will read
    /// (their filter words, then the table slots those let through), so
    /// their cache misses overlap instead of coming one after another.
    ///
    /// # Errors
    ///
    /// As [`Guard::check`]. An unknown lane changes nothing: `verdicts` is
    /// left empty and the counters as they were. After a disk read error,
    /// `verdicts` holds the verdicts of the probes before it.
    ///
    /// # Example
    ///
    /// ```
    /// use replayguard::{Fingerprint, Guard, Probe, Verdict};
    /// # fn main() -> replayguard::Result<()> {
    /// let dir = tempfile::tempdir()?;
    /// let mut guard = Guard::builder(dir.path()).open()?;
    /// let lane = guard.lane("orders", 0);
    /// let batch: Vec<Probe> = (0..4u64)
    ///     .map(|o| Probe::new(lane, Some(o), Some(Fingerprint::id(o))))
    ///     .collect();
    /// let mut verdicts = Vec::new();
    /// guard.record_many(&batch[..2], &mut verdicts)?;
    /// guard.check_many(&batch, &mut verdicts)?;
    /// assert!(!verdicts[0].is_fresh() && !verdicts[1].is_fresh());
    /// assert_eq!(&verdicts[2..], &[Verdict::Fresh, Verdict::Fresh]);
    /// # Ok(()) }
    /// ```
    pub fn check_many(&mut self, probes: &[Probe], verdicts: &mut Vec<Verdict>) -> Result<()> {
        // The lanes are checked in the loop, not in a pass before it: a
        // batch built elsewhere is then read from memory once, not twice
        // (BENCHMARKS.md, "Batched misses without a call a probe").
        self.start_batch(probes.len(), verdicts)?;
        // Where the fetches go depends on how much the tables hold in all,
        // against the caches: decided once a batch, so that neither loop
        // tests it probe by probe.
        let slots: usize = self.lanes.iter().map(|l| l.index.table_slots()).sum();
        if slots > FAR_SLOTS {
            self.check_batch::<true>(probes, verdicts)
        } else {
            self.check_batch::<false>(probes, verdicts)
        }
    }

    /// [`Guard::check_many`] past its start, fetching as `FAR` says
    /// ([`FAR_SLOTS`]). Kept out of line, so each loop is compiled on its
    /// own (at 1M, in one process, the loop for small tables ran as fast
    /// as the one before the choice, BENCHMARKS.md).
    #[inline(never)]
    fn check_batch<const FAR: bool>(
        &mut self,
        probes: &[Probe],
        verdicts: &mut Vec<Verdict>,
    ) -> Result<()> {
        // Each probe's filter word and bits are worked out once: its word
        // is fetched `CHECK_AHEAD` probes ahead, then tested and its slots
        // fetched `CHECK_SCREEN_AHEAD` ahead, and a hash the filter turned
        // away is not looked at again. Nothing changes the index meanwhile.
        const RING: usize = 64;
        const _: () = assert!(CHECK_AHEAD < RING && CHECK_SCREEN_AHEAD <= CHECK_AHEAD);
        let mut aims = [Aim::default(); RING];
        // A probe of an unknown lane is skipped here, and stops the batch
        // when its turn comes.
        let aim = |lanes: &[Lane], aims: &mut [Aim; RING], i: usize| {
            if let Some(q) = probes.get(i)
                && let Some(l) = lanes.get(q.lane.0 as usize)
            {
                aims[i % RING] = l.index.aim::<FAR>(q.fp);
            }
        };
        let screen = |lanes: &[Lane], aims: &mut [Aim; RING], i: usize| {
            if let Some(q) = probes.get(i)
                && let Some(l) = lanes.get(q.lane.0 as usize)
            {
                l.index.screen::<FAR>(&mut aims[i % RING]);
            }
        };
        let counted = self.stats.clone();
        for i in 0..CHECK_AHEAD {
            aim(&self.lanes, &mut aims, i);
        }
        for i in 0..CHECK_SCREEN_AHEAD {
            screen(&self.lanes, &mut aims, i);
        }
        for (i, p) in probes.iter().enumerate() {
            aim(&self.lanes, &mut aims, i + CHECK_AHEAD);
            screen(&self.lanes, &mut aims, i + CHECK_SCREEN_AHEAD);
            let lane = p.lane.0 as usize;
            let Some(l) = self.lanes.get(lane) else {
                self.stats = counted;
                verdicts.clear();
                return Err(Error::UnknownLane(p.lane.0));
            };
            let lookup = l.index.lookup_aimed(p.offset, p.fp, &aims[i % RING]);
            let found = self.settle(lane, lookup)?;
            verdicts.push(self.checked(found));
        }
        Ok(())
    }

    /// [`Guard::record`] for a batch of records, with the prefetching of
    /// [`Guard::check_many`]: `verdicts` is cleared and gets one verdict
    /// per probe, in order. A record that repeats an earlier one of the
    /// same batch is a duplicate of it, as with one `record` per probe.
    ///
    /// # Errors
    ///
    /// As [`Guard::record`]. Every lane is checked before any record is;
    /// after an error, the probes before it are recorded and `verdicts`
    /// holds their verdicts.
    pub fn record_many(&mut self, probes: &[Probe], verdicts: &mut Vec<Verdict>) -> Result<()> {
        self.start_batch(probes.len(), verdicts)?;
        if let Some(bad) = probes
            .iter()
            .find(|p| p.lane.0 as usize >= self.lanes.len())
        {
            return Err(Error::UnknownLane(bad.lane.0));
        }
        let far = PREFETCH_AHEAD;
        let near = PREFETCH_AHEAD / 2;
        // A record that turns out fresh is inserted, so every slot is
        // fetched. Inserts change the table, so nothing is worked out ahead
        // but the fetches.
        let prefetch = |lanes: &[Lane], q: Option<&Probe>, slots: bool| {
            if let Some(q) = q
                && let Some(l) = lanes.get(q.lane.0 as usize)
            {
                if slots {
                    l.index.prefetch_insert(q.fp);
                } else {
                    l.index.prefetch_filters(q.fp);
                }
            }
        };
        for i in 0..far.min(probes.len()) {
            prefetch(&self.lanes, probes.get(i), false);
            if i < near {
                prefetch(&self.lanes, probes.get(i), true);
            }
        }
        for (i, p) in probes.iter().enumerate() {
            prefetch(&self.lanes, probes.get(i + far), false);
            prefetch(&self.lanes, probes.get(i + near), true);
            let lane = p.lane.0 as usize;
            let found = self.find(lane, p.offset, p.fp)?;
            let v = self.record_found::<false>(lane, p.offset, p.fp, found)?;
            verdicts.push(v);
        }
        Ok(())
    }

    /// What both batched calls do first: the guard is usable, and
    /// `verdicts` is empty with room for a batch of `len`.
    fn start_batch(&self, len: usize, verdicts: &mut Vec<Verdict>) -> Result<()> {
        self.ready()?;
        verdicts.clear();
        verdicts.reserve(len);
        Ok(())
    }

    /// Looks a record up in memory and, when the filter in front of the
    /// disk lets its hash through, on disk. Only the disk read can fail.
    #[inline]
    fn find(
        &mut self,
        lane: usize,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Option<(Reason, u64)>> {
        let lookup = self.lanes[lane].index.lookup(offset, fp);
        self.settle(lane, lookup)
    }

    /// What a lookup found, reading the disk when it asks to. A batch of
    /// checks looks up with its aims and settles here as [`Guard::find`]
    /// does; forced inline so that nothing of it is a call in that loop.
    #[inline(always)]
    fn settle(&mut self, lane: usize, lookup: Lookup) -> Result<Option<(Reason, u64)>> {
        match lookup {
            Lookup::Found(r, e) => Ok(Some((r, e))),
            Lookup::Fresh => Ok(None),
            Lookup::Disk { key, position } => self.read_disk(lane, key, position),
        }
    }

    #[cold]
    fn read_disk(
        &mut self,
        lane: usize,
        key: u128,
        position: Option<u64>,
    ) -> Result<Option<(Reason, u64)>> {
        self.stats.disk_reads += 1;
        let index = &self.lanes[lane].index;
        let content = self
            .store
            .sealed_get(lane as u32, key)?
            .filter(|&e| index.disk_epoch_is_live(e));
        if content.is_some() {
            self.stats.disk_hits += 1;
        }
        Ok(resolve(position, content))
    }

    fn check_one(
        &mut self,
        lane: usize,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        let found = self.find(lane, offset, fp)?;
        Ok(self.checked(found))
    }

    /// The verdict of a checked record, counted.
    #[inline]
    fn checked(&mut self, found: Option<(Reason, u64)>) -> Verdict {
        self.stats.checked += 1;
        self.count(found)
    }

    #[inline]
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
    /// checkpoint). Records that arrive together, such as one poll's worth,
    /// go faster through [`Guard::record_many`], which fetches what the
    /// next lookups will read while it answers this one.
    ///
    /// # Errors
    ///
    /// [`Error::Poisoned`], [`Error::UnknownLane`], a store error from a
    /// chunk write (which poisons the guard), or from a disk read of a
    /// hash (which records nothing).
    pub fn record(
        &mut self,
        lane: LaneId,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        self.ready()?;
        self.lane_ref(lane)?;
        self.record_one(lane.0 as usize, offset, fp)
    }

    fn record_one(
        &mut self,
        lane: usize,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
    ) -> Result<Verdict> {
        let found = self.find(lane, offset, fp)?;
        self.record_found::<true>(lane, offset, fp, found)
    }

    /// Records a looked-up record unless it was found. `ONE`: the caller
    /// records one record a call, so the index places its hash with the
    /// lane's next ones ([`LaneIndex::insert_open`]); a batch has fetched
    /// its slots already.
    #[inline]
    fn record_found<const ONE: bool>(
        &mut self,
        lane: usize,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
        found: Option<(Reason, u64)>,
    ) -> Result<Verdict> {
        if found.is_some() {
            return Ok(self.count(found));
        }
        let epoch = self.epoch;
        let l = &mut self.lanes[lane];
        if ONE {
            l.index.insert_open(epoch, offset, fp);
        } else {
            l.index.insert(epoch, offset, fp);
        }
        if let Some(o) = offset {
            l.pending.offsets.insert(o);
            self.stats.live_offsets += 1;
        }
        match fp {
            Some(Fingerprint::Hash(h)) => {
                l.pending.hashes.push(h);
                self.stats.live_fingerprints += 1;
                self.stats.memory_fingerprints += 1;
            }
            Some(Fingerprint::Id(id)) => {
                l.pending.ids.insert(id);
                self.stats.live_fingerprints += 1;
                self.stats.memory_fingerprints += 1;
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
            // A warning: the call returns the error, and its caller reports it.
            tracing::warn!(error = %e, error_kind = e.kind(), epoch = self.epoch, "replayguard store write failed; guard poisoned");
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
        let journal = self.cfg.journal;
        for id in written {
            let l = &mut self.lanes[id as usize];
            let pending = std::mem::take(&mut l.pending);
            if journal {
                crate::changelog::merge(&mut l.journal, pending);
            }
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
    /// Under a memory budget ([`GuardBuilder::max_memory_bytes`]), the
    /// oldest sealed epochs then move their content hashes to disk until
    /// the index fits.
    ///
    /// Its cost does not grow with the number of live epochs, except for
    /// the manifest, which lists them (about 60 bytes each).
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
        let gone = epochs.iter().take_while(|e| e.epoch < keep_from).count();
        let dropped: Vec<u64> = epochs.drain(..gone).map(|e| e.epoch).collect();
        let mut moved: HashMap<u32, u64> = positions.iter().map(|(l, p)| (l.0, *p)).collect();
        let carried = if dropped.is_empty() {
            Vec::new()
        } else {
            self.carried_offsets(&moved, keep_from)
        };
        let manifest = Manifest {
            format: FORMAT_VERSION,
            epoch: next,
            positions: self.positions_after(&mut moved),
            sink,
            epochs,
            checkpointed_at_ms: now,
        };
        let r = self.write_pending(Some(&manifest), &carried);
        self.poison_on(r)?;
        self.advance(
            positions,
            manifest,
            keep_from,
            !dropped.is_empty(),
            &carried,
        );
        if !dropped.is_empty() {
            let r = self.store.drop_epochs_before(keep_from);
            self.poison_on(r)?;
        }
        let r = self.fit_memory();
        self.poison_on(r)?;
        self.refresh_live();
        let duration = started.elapsed();
        self.stats.checkpoints += 1;
        self.stats.last_checkpoint = Some(duration);
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

    /// Every lane's position once the lanes in `moved` have moved.
    fn positions_after(&self, moved: &mut HashMap<u32, u64>) -> Vec<LanePosition> {
        self.lanes
            .iter()
            .enumerate()
            .filter_map(|(id, l)| {
                let p = moved.remove(&(id as u32)).or(l.position)?;
                Some(LanePosition {
                    lane: l.name.clone(),
                    next_offset: p,
                })
            })
            .collect()
    }

    /// With `manifest` durable, the state in memory follows it: positions,
    /// the open epoch, the epochs dropped (below `keep_from`, when any
    /// were) and the offsets carried into the new epoch.
    fn advance(
        &mut self,
        positions: &[(LaneId, u64)],
        manifest: Manifest,
        keep_from: u64,
        dropping: bool,
        carried: &[(u32, Chunk)],
    ) {
        let next = manifest.epoch;
        for (lane, p) in positions {
            self.lanes[lane.0 as usize].position = Some(*p);
        }
        if self.cfg.journal {
            self.journal_advance(next, keep_from, carried);
        }
        self.epoch = next;
        self.epochs = manifest.epochs.clone();
        self.manifest = Some(manifest);
        self.oldest = self.oldest.max(keep_from);
        self.floor = self.floor.max(self.oldest);
        self.store.set_oldest_live(self.oldest);
        for l in &mut self.lanes {
            l.next_seq = 0;
            // Drop first: an epoch closed and dropped at once (the default
            // retention) is never packed.
            if dropping {
                l.index.drop_before(keep_from);
            }
            l.index.close(next);
        }
        for (id, chunk) in carried {
            let l = &mut self.lanes[*id as usize];
            l.index.merge_offsets(next, &chunk.offsets);
            l.next_seq = 1;
        }
    }

    /// The journal at a checkpoint that opens `next`: the closed epoch's
    /// parts are noted, the dropped epochs' tombstones and the carried
    /// offsets are left to ship after the checkpoint.
    fn journal_advance(&mut self, next: u64, keep_from: u64, carried: &[(u32, Chunk)]) {
        let closed = self.epoch;
        for (id, l) in self.lanes.iter_mut().enumerate() {
            let c = std::mem::take(&mut l.journal);
            if c != Chunk::default() {
                let parts = crate::changelog::parts_for(
                    c.hashes.len() as u64,
                    c.ids.len(),
                    c.offsets.len(),
                );
                self.shipped.insert((id as u32, closed), parts);
            }
        }
        for ((lane, epoch), parts) in std::mem::take(&mut self.shipped) {
            if epoch < keep_from {
                let name = &self.lanes[lane as usize].name;
                self.after.push(Shipment {
                    topic: name.topic.clone(),
                    partition: name.partition,
                    epoch,
                    what: Shipped::Tombstones(parts),
                });
            } else {
                self.shipped.insert((lane, epoch), parts);
            }
        }
        for (id, chunk) in carried {
            let l = &mut self.lanes[*id as usize];
            l.journal = chunk.clone();
            self.after.insert(
                0,
                Shipment {
                    topic: l.name.topic.clone(),
                    partition: l.name.partition,
                    epoch: next,
                    what: Shipped::Parts(crate::changelog::split(chunk)),
                },
            );
        }
    }

    /// For a changelog: writes every pending chunk, then returns the parts
    /// of each lane's open epoch, all of it, to be shipped (and acked)
    /// before the checkpoint that closes it. Needs
    /// [`GuardBuilder::journal`]; empty without it.
    ///
    /// # Errors
    /// [`Error::Poisoned`], or a store error (which poisons the guard).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn ship_open(&mut self) -> Result<Vec<Shipment>> {
        self.flush()?;
        let epoch = self.epoch;
        Ok(self
            .lanes
            .iter()
            .filter(|l| l.journal != Chunk::default())
            .map(|l| Shipment {
                topic: l.name.topic.clone(),
                partition: l.name.partition,
                epoch,
                what: Shipped::Parts(crate::changelog::split(&l.journal)),
            })
            .collect())
    }

    /// For a changelog: what the last checkpoints left to ship after them,
    /// the offsets they carried into the open epoch first, then the
    /// tombstones of the epochs they dropped.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn take_after_checkpoint(&mut self) -> Vec<Shipment> {
        std::mem::take(&mut self.after)
    }

    /// Takes over identities another instance handled (restored from a
    /// changelog): every offset, hash and id of `chunk` not live in the
    /// lane already is recorded in the open epoch, as handled now. Returns
    /// how many were.
    ///
    /// # Errors
    /// As [`Guard::record`].
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn import(&mut self, lane: LaneId, chunk: &Chunk) -> Result<u64> {
        self.ready()?;
        self.lane_ref(lane)?;
        let lane = lane.0 as usize;
        let mut n = 0;
        let mut one = |g: &mut Guard, offset: Option<u64>, fp: Option<Fingerprint>| -> Result<()> {
            if g.find(lane, offset, fp)?.is_none() {
                g.record_found::<true>(lane, offset, fp, None)?;
                n += 1;
            }
            Ok(())
        };
        for &h in &chunk.hashes {
            one(self, None, Some(Fingerprint::Hash(h)))?;
        }
        for id in &chunk.ids {
            one(self, None, Some(Fingerprint::Id(id)))?;
        }
        for o in &chunk.offsets {
            one(self, Some(o), None)?;
        }
        Ok(n)
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
            let offsets = l.index.carried(keep_from, p);
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

    /// Moves the content hashes of the oldest sealed epochs to disk while
    /// the index is over its memory budget (down to 90% of it), and in any
    /// case before an epoch is so old that its tag could be misread.
    fn fit_memory(&mut self) -> Result<()> {
        let mut floor = self.floor.max(self.epoch.saturating_sub(TAG_SPAN / 4));
        if let Some(budget) = self.cfg.max_memory_bytes {
            let used = self.memory_bytes() as u64;
            if used > budget && self.floor < self.epoch {
                let (bytes, entries) = self.lanes.iter().fold((0, 0), |(b, n), l| {
                    let (tb, tn) = l.index.table_bytes();
                    (b + tb, n + tn)
                });
                let per = bytes
                    .checked_div(entries)
                    .map_or(EST_BYTES_PER_HASH, |b| b.max(1) as u64);
                let mut excess = used - budget / 10 * 9;
                let mut f = floor;
                while f < self.epoch && excess > 0 {
                    let n: u64 = self.lanes.iter().map(|l| l.index.epoch_hashes(f)).sum();
                    excess = excess.saturating_sub(n * per);
                    f += 1;
                }
                floor = floor.max(f);
            }
        }
        if floor > self.floor {
            self.spill_to(floor)?;
        }
        Ok(())
    }

    /// Writes the content hashes of the epochs in `self.floor..floor` to
    /// disk and into each lane's disk filter, then lets them leave memory.
    /// The table keeps too few bits of a hash to give it back, so they are
    /// read from the epochs' chunks, as a recovery reads them.
    fn spill_to(&mut self, floor: u64) -> Result<()> {
        let from = self.floor;
        let counts: Vec<u64> = self
            .lanes
            .iter()
            .map(|l| (from..floor).map(|e| l.index.epoch_hashes(e)).sum())
            .collect();
        let moving = if counts.iter().any(|&n| n > 0) {
            self.hashes_in(from, floor)?
        } else {
            vec![Vec::new(); self.lanes.len()]
        };
        for ((id, l), &count) in self.lanes.iter_mut().enumerate().zip(&counts) {
            if count == 0 && l.index.disk().filter.is_some() {
                continue;
            }
            let tier = l.index.disk();
            let fits = tier
                .filter
                .as_ref()
                .is_some_and(|f| f.inserted() + count <= f.capacity());
            if !fits {
                // A new filter, sized with room to grow, holding the live
                // hashes already on disk: it also forgets dropped epochs.
                let mut filter = DiskFilter::with_capacity((tier.live + count) * 3 / 2);
                if tier.live > 0 {
                    let oldest = self.oldest;
                    self.store.sealed_scan(id as u32, |key, e| {
                        if e >= oldest && e < from {
                            filter.insert(key);
                        }
                    })?;
                }
                l.index.disk_mut().filter = Some(filter);
            }
            if let (Some(f), Some(keys)) = (l.index.disk_mut().filter.as_mut(), moving.get(id)) {
                for &(key, _) in keys {
                    f.insert(key);
                }
            }
        }
        if moving.iter().any(|v| !v.is_empty()) {
            let entries = moving
                .iter()
                .enumerate()
                .flat_map(|(id, v)| v.iter().map(move |&(k, e)| (id as u32, k, e)));
            self.store.spill(entries, floor - 1)?;
        }
        for l in &mut self.lanes {
            l.index.lower_to_disk(floor);
        }
        self.floor = floor;
        tracing::debug!(from, to = floor, "sealed epochs moved to disk");
        Ok(())
    }

    /// Per lane, the keys of the content hashes its chunks hold for the
    /// epochs in `from..to`, with their epochs, in key order: one entry a
    /// key, in the newest epoch that holds it.
    fn hashes_in(&self, from: u64, to: u64) -> Result<Vec<Vec<(u128, u64)>>> {
        let mut per_lane: Vec<Vec<(u128, u64)>> = vec![Vec::new(); self.lanes.len()];
        let path = self.store.path().to_owned();
        self.store
            .read_chunks(from, Some(to), |e, lane, _, chunk| {
                let keys = per_lane
                    .get_mut(lane as usize)
                    .ok_or_else(|| unknown_lane(&path, lane))?;
                keys.extend(chunk.hashes.iter().map(|&h| (key_of(h), e)));
                Ok(())
            })?;
        for keys in &mut per_lane {
            keys.sort_unstable();
            keep_last_of_each_key(keys);
        }
        Ok(per_lane)
    }

    fn refresh_live(&mut self) {
        let (mut fps, mut offs, mut disk, mut mem, mut filters) = (0, 0, 0, 0, 0);
        for l in &self.lanes {
            fps += l.index.live_fingerprints();
            offs += l.index.live_offset_count();
            disk += l.index.disk().live;
            mem += l.index.memory_bytes() as u64;
            filters += l
                .index
                .disk()
                .filter
                .as_ref()
                .map_or(0, |f| f.memory_bytes() as u64);
        }
        self.stats.live_fingerprints = fps;
        self.stats.live_offsets = offs;
        self.stats.disk_fingerprints = disk;
        self.stats.memory_fingerprints = fps - disk.min(fps);
        self.stats.memory_bytes = mem;
        self.stats.disk_filter_bytes = filters;
        self.stats.memory_floor = self.floor;
        self.stats.live_epochs = self.epochs.len() as u64;
        self.stats.disk_bytes = self.store.disk_bytes();
        self.stats.disk_index_bytes = self.store.sealed_disk_bytes();
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        self.stats.clone()
    }

    /// Heap bytes held by the in-memory index (an estimate): the tables,
    /// the bitmaps and the filters in front of the disk.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.lanes.iter().map(|l| l.index.memory_bytes()).sum()
    }

    /// Per lane and live epoch: (lane, epoch, fingerprints, offsets).
    #[must_use]
    pub fn epoch_table(&self) -> Vec<(LaneName, u64, u64, u64)> {
        let mut out = Vec::new();
        for l in &self.lanes {
            for idx in l.index.epochs() {
                out.push((
                    l.name.clone(),
                    idx.epoch(),
                    idx.fingerprints(),
                    idx.offsets(),
                ));
            }
        }
        out
    }

    /// The offsets a lane handled in its live epochs (for tests and tools).
    #[must_use]
    pub fn live_offsets(&self, lane: LaneId) -> crate::OffsetSet {
        crate::OffsetSet(
            self.lanes
                .get(lane.0 as usize)
                .map(|l| l.index.live_offsets())
                .unwrap_or_default(),
        )
    }

    /// Every lane the guard knows.
    pub fn lanes(&self) -> impl Iterator<Item = (LaneId, &LaneName)> {
        self.lanes
            .iter()
            .enumerate()
            .map(|(i, l)| (LaneId(i as u32), &l.name))
    }
}
