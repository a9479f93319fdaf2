//! What was handled, per lane, over all its live epochs at once.
//!
//! A lookup costs the same whether a lane has 1 live epoch or 3,600:
//!
//! - **Content hashes** of every epoch held in memory, the open one
//!   included, live in one [`FpTable`] per lane, each entry tagged with its
//!   epoch. Sealing an epoch costs nothing; dropping one only raises the
//!   lane's floor, below which entries no longer answer. An insert takes
//!   the slot of the first such entry its shift meets, and the table is
//!   purged at a checkpoint, in one in-place pass, once an eighth of it is
//!   below the floor.
//!   Hashes recorded one call at a time wait in a small buffer of the lane
//!   (read by every lookup) and are placed sixteen at a time, so that the
//!   cache misses of their inserts overlap as a batch's do.
//! - **Offsets and user ids** of the open epoch are in its own roaring
//!   bitmaps; those of all sealed epochs are also in one union per lane,
//!   so a record that none of them holds is answered by two bitmap
//!   lookups. Only a duplicate walks the epochs (newest first, skipping
//!   those whose range cannot hold it) to name the epoch.
//! - **Sealed epochs kept on disk** (under a memory budget) leave the
//!   table; their hashes are answered by one [`DiskFilter`] per lane, and a
//!   "maybe" becomes a disk read by the guard. Offsets and ids stay in
//!   memory: in dense runs they cost a fraction of a byte.

mod bloom;
mod table;

use std::collections::VecDeque;

use roaring::RoaringTreemap;

pub use bloom::DiskFilter;
pub use table::{Aim, FAR_SLOTS, FpTable, Insert, TAG_SPAN, key_of, tag_in, tag_of, tagged};

use crate::fingerprint::Fingerprint;

/// What one epoch of one lane handled.
#[derive(Debug)]
pub struct EpochIndex {
    epoch: u64,
    /// Empty while `dense`.
    offsets: RoaringTreemap,
    /// The range of the offsets: a record outside it (the usual fresh
    /// record) is answered without a bitmap lookup.
    offset_range: Option<(u64, u64)>,
    /// The offsets are every one of `offset_range`, and `offsets` holds
    /// none of them. A sealed epoch whose offsets are one run is kept so:
    /// a bitmap costs a tree node and a container whatever it holds, about
    /// 480 bytes for a lane's epoch of a few dozen records (BENCHMARKS.md,
    /// "Many live epochs").
    dense: bool,
    ids: RoaringTreemap,
    id_range: Option<(u64, u64)>,
    /// Content hashes recorded in this epoch.
    hashes: u64,
}

fn widen(range: &mut Option<(u64, u64)>, lo: u64, hi: u64) {
    *range = Some(match *range {
        None => (lo, hi),
        Some((a, b)) => (a.min(lo), b.max(hi)),
    });
}

/// Bytes of a bitmap (its serialized size; nothing when empty).
fn bitmap_bytes(b: &RoaringTreemap) -> usize {
    if b.is_empty() { 0 } else { b.serialized_size() }
}

fn in_range(range: Option<(u64, u64)>, v: u64) -> bool {
    range.is_some_and(|(lo, hi)| lo <= v && v <= hi)
}

impl EpochIndex {
    fn new(epoch: u64) -> Self {
        EpochIndex {
            epoch,
            offsets: RoaringTreemap::new(),
            offset_range: None,
            dense: false,
            ids: RoaringTreemap::new(),
            id_range: None,
            hashes: 0,
        }
    }

    /// Whether this epoch handled the offset.
    #[must_use]
    pub fn contains_offset(&self, offset: u64) -> bool {
        in_range(self.offset_range, offset) && (self.dense || self.offsets.contains(offset))
    }

    /// Whether this epoch handled the user id.
    #[must_use]
    pub fn contains_id(&self, id: u64) -> bool {
        in_range(self.id_range, id) && self.ids.contains(id)
    }

    /// The epoch number.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Number of content fingerprints (hashes and ids).
    #[must_use]
    pub fn fingerprints(&self) -> u64 {
        self.hashes + self.ids.len()
    }

    /// Number of offsets.
    #[must_use]
    pub fn offsets(&self) -> u64 {
        match (self.dense, self.offset_range) {
            (true, Some((lo, hi))) => hi - lo + 1,
            _ => self.offsets.len(),
        }
    }

    fn bitmap_bytes(&self) -> usize {
        bitmap_bytes(&self.offsets) + bitmap_bytes(&self.ids)
    }

    /// The offsets as a bitmap: made from the range when `dense`.
    fn offset_bitmap(&self) -> std::borrow::Cow<'_, RoaringTreemap> {
        match (self.dense, self.offset_range) {
            (true, Some((lo, hi))) => {
                let mut b = RoaringTreemap::new();
                b.insert_range(lo..=hi);
                std::borrow::Cow::Owned(b)
            }
            _ => std::borrow::Cow::Borrowed(&self.offsets),
        }
    }

    /// The offsets' bitmap, to change: made from the range first when
    /// `dense`.
    fn offsets_mut(&mut self) -> &mut RoaringTreemap {
        if self.dense {
            self.offsets = self.offset_bitmap().into_owned();
            self.dense = false;
        }
        &mut self.offsets
    }

    /// Packs the bitmaps of an epoch that no longer records, and keeps its
    /// offsets as their range when they are one run.
    fn seal(&mut self) {
        self.ids.optimize();
        if let Some((lo, hi)) = self.offset_range
            && self.offsets.len() == hi - lo + 1
        {
            self.offsets = RoaringTreemap::new();
            self.dense = true;
        } else {
            self.offsets.optimize();
        }
    }
}

/// Why a record is a duplicate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The same (lane, offset) was handled: the application's own replay.
    SamePosition,
    /// The same content identity was handled at another position: an
    /// upstream resend.
    SameContent,
}

/// The answer of the in-memory index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// A duplicate, and the newest epoch that handled it.
    Found(Reason, u64),
    /// Not handled within the retention.
    Fresh,
    /// The content hash may be in a sealed epoch kept on disk: the caller
    /// reads `key` there and calls [`resolve`] with what it found.
    Disk {
        /// The hash as it is keyed on disk (its tag bits cleared).
        key: u128,
        /// The newest epoch that handled the offset, if any.
        position: Option<u64>,
    },
}

/// Keeps one entry of each key of a vector sorted by `(key, value)`: the
/// last, with the highest value (the newest epoch, or the higher tag).
pub fn keep_last_of_each_key<T: Copy>(v: &mut Vec<(u128, T)>) {
    v.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            *earlier = *later;
        }
        same
    });
}

/// The epoch of a tag, read relative to the open epoch: the newest epoch
/// at or below it with that tag.
#[inline]
fn epoch_of_tag(open: u64, tag: u32) -> u64 {
    let back = (tag_of(open).wrapping_sub(tag) as u64) & (TAG_SPAN - 1);
    open.wrapping_sub(back)
}

/// Whether a tag's epoch, read relative to `open`, is below `floor`: its
/// entry no longer answers and its slot may be taken or purged.
#[inline]
fn below(open: u64, floor: u64) -> impl Fn(u32) -> bool + Copy {
    move |tag| epoch_of_tag(open, tag) < floor
}

/// Combines the newest epoch holding the position with the newest epoch
/// holding the content: the newer one answers, and position wins a tie.
#[must_use]
pub fn resolve(position: Option<u64>, content: Option<u64>) -> Option<(Reason, u64)> {
    match (position, content) {
        (Some(p), Some(c)) if c > p => Some((Reason::SameContent, c)),
        (Some(p), _) => Some((Reason::SamePosition, p)),
        (None, Some(c)) => Some((Reason::SameContent, c)),
        (None, None) => None,
    }
}

/// The content hashes of one lane kept on disk, as the memory sees them.
#[derive(Debug, Default)]
pub struct DiskTier {
    /// The filter in front of them; `None` before the first spill.
    pub filter: Option<DiskFilter>,
    /// Live hashes on disk (epochs at or above the oldest live one and
    /// below the memory floor).
    pub live: u64,
}

/// All live epochs of one lane.
#[derive(Debug, Default)]
pub struct LaneIndex {
    /// Content hashes of the epochs at or above `floor`, tagged.
    hashes: FpTable,
    /// Entries of `hashes` below `floor` (an upper bound: some may have
    /// been replaced in place).
    below_floor: u64,
    /// Whether this checkpoint's drop purged the table, keeping room for
    /// the next epoch: the close then leaves it as it is.
    room_kept: bool,
    /// The open epoch: tags are decoded relative to it.
    open: u64,
    /// The oldest live epoch.
    oldest: u64,
    /// Epochs below it are not answered from `hashes`: they were dropped,
    /// or their hashes are on disk.
    floor: u64,
    /// Live epochs that handled something, oldest first.
    epochs: VecDeque<EpochIndex>,
    /// Union of the offsets of the sealed epochs, and its range: a record
    /// past it (the usual fresh record) skips the bitmap.
    sealed_offsets: RoaringTreemap,
    sealed_offset_range: Option<(u64, u64)>,
    /// Union of the ids of the sealed epochs, and its range.
    sealed_ids: RoaringTreemap,
    sealed_id_range: Option<(u64, u64)>,
    /// Hashes kept on disk.
    disk: DiskTier,
    /// Live content fingerprints (hashes and ids) and offsets.
    live_fps: u64,
    live_offsets: u64,
    /// Serialized bytes of the sealed epochs' bitmaps and unions, as of
    /// the last change.
    sealed_bitmap_bytes: usize,
    /// Hashes of the open epoch recorded one call at a time and not yet in
    /// `hashes`, made by [`tagged`]: they go in `DEFERRED` at a time, each
    /// one's slots fetched as it joins, so that their cache misses overlap
    /// with the calls in between. Every lookup reads them too; anything
    /// else that reads or reshapes the table places them first.
    deferred: Vec<u128>,
}

/// Hashes recorded one call at a time that wait to be placed in the table
/// together (see `LaneIndex::deferred`). Tests wait for fewer, so that
/// their small runs fill the buffer often.
const DEFERRED: usize = if cfg!(test) { 4 } else { 16 };

/// The table is purged at a checkpoint once more than one entry in this
/// many is below the floor (BENCHMARKS.md, "The lanes' table in 12-byte
/// slots").
const PURGE_SHARE: u64 = 8;
/// A purge lays the table out with room for one more live entry in this
/// many (or for an epoch as large as the newest, if that is more), so that
/// the open epoch's inserts do not grow it at once.
const PURGE_ROOM: u64 = 8;

impl LaneIndex {
    /// A lane whose open epoch is `open` and whose oldest live epoch is
    /// `oldest`; epochs below `floor` keep their hashes on disk.
    #[must_use]
    pub fn new(open: u64, oldest: u64, floor: u64) -> Self {
        LaneIndex {
            open,
            oldest,
            floor: floor.max(oldest),
            ..LaneIndex::default()
        }
    }

    /// The epoch of a tag, relative to the open epoch.
    #[inline]
    fn epoch_of(&self, tag: u32) -> u64 {
        epoch_of_tag(self.open, tag)
    }

    /// The epoch's index, created when absent. Epochs are created in
    /// ascending order, except on load.
    fn epoch_mut(&mut self, epoch: u64) -> &mut EpochIndex {
        // The open epoch, last, is the one records go to.
        if self.epochs.back().is_some_and(|e| e.epoch == epoch) {
            let last = self.epochs.len() - 1;
            return &mut self.epochs[last];
        }
        let at = match self.epochs.binary_search_by_key(&epoch, |e| e.epoch) {
            Ok(at) => at,
            Err(at) => {
                self.epochs.insert(at, EpochIndex::new(epoch));
                at
            }
        };
        &mut self.epochs[at]
    }

    fn is_open(&self, e: &EpochIndex) -> bool {
        e.epoch == self.open
    }

    /// The newest live epoch that handled the offset.
    #[inline]
    fn position(&self, offset: u64) -> Option<u64> {
        if let Some(last) = self.epochs.back()
            && self.is_open(last)
            && last.contains_offset(offset)
        {
            return Some(last.epoch);
        }
        if !in_range(self.sealed_offset_range, offset) || !self.sealed_offsets.contains(offset) {
            return None;
        }
        self.epochs
            .iter()
            .rev()
            .find(|e| e.epoch < self.open && e.contains_offset(offset))
            .map(|e| e.epoch)
    }

    /// The newest live epoch that handled the user id.
    fn id_epoch(&self, id: u64) -> Option<u64> {
        if let Some(last) = self.epochs.back()
            && self.is_open(last)
            && last.contains_id(id)
        {
            return Some(last.epoch);
        }
        if !in_range(self.sealed_id_range, id) || !self.sealed_ids.contains(id) {
            return None;
        }
        self.epochs
            .iter()
            .rev()
            .find(|e| e.epoch < self.open && e.contains_id(id))
            .map(|e| e.epoch)
    }

    /// The epoch of the hash in memory, if it is there and at or above the
    /// floor.
    #[inline]
    fn hash_epoch(&self, h: u128) -> Option<u64> {
        let tag = self.hashes.get(h);
        self.epoch_of_hash(h, tag)
    }

    /// [`LaneIndex::hash_epoch`] for a hash aimed and screened ahead.
    /// Forced inline, as [`LaneIndex::lookup_with`] is: with a plain
    /// `#[inline]` the batched check loop called it once a probe, and
    /// batched misses at 10M ran 5 to 10% slower (BENCHMARKS.md, "Batched
    /// misses without a call a probe"). Single lookups keep their call,
    /// as before: the gain was measured on the batched path only.
    #[inline(always)]
    fn hash_epoch_aimed(&self, h: u128, aim: &Aim) -> Option<u64> {
        let tag = self.hashes.get_aimed(aim);
        self.epoch_of_hash(h, tag)
    }

    /// What the table's `tag` for `h` says, or else the deferred hashes.
    #[inline(always)]
    fn epoch_of_hash(&self, h: u128, tag: Option<u32>) -> Option<u64> {
        if let Some(t) = tag {
            let e = self.epoch_of(t);
            if e >= self.floor {
                return Some(e);
            }
        }
        if self.deferred.is_empty() {
            None
        } else {
            self.deferred_epoch(h)
        }
    }

    /// The epoch of the hash among those not yet placed in the table: the
    /// open one, if it is there.
    #[inline(never)]
    fn deferred_epoch(&self, h: u128) -> Option<u64> {
        let key = key_of(h);
        self.deferred
            .iter()
            .any(|&d| key_of(d) == key)
            .then_some(self.open)
    }

    /// Looks a record up in every live epoch.
    #[must_use]
    pub fn lookup(&self, offset: Option<u64>, fp: Option<Fingerprint>) -> Lookup {
        self.lookup_with(offset, fp, None)
    }

    /// [`LaneIndex::lookup`] with the hash's [`Aim`] in the table worked
    /// out and screened ahead, by [`LaneIndex::aim`] and
    /// [`LaneIndex::screen`], while the index did not change.
    #[inline]
    #[must_use]
    pub fn lookup_aimed(&self, offset: Option<u64>, fp: Option<Fingerprint>, aim: &Aim) -> Lookup {
        self.lookup_with(offset, fp, Some(aim))
    }

    /// Forced inline: with a plain `#[inline]` the batched check loop
    /// called it once a probe and took its answer back through memory;
    /// inlined, batched checks at 1M sealed ran 1.02 to 1.15 times as
    /// fast, and at 10M the same (BENCHMARKS.md). A single check had it
    /// inlined already.
    #[inline(always)]
    fn lookup_with(
        &self,
        offset: Option<u64>,
        fp: Option<Fingerprint>,
        aim: Option<&Aim>,
    ) -> Lookup {
        let position = offset.and_then(|o| self.position(o));
        let content = match fp {
            None => None,
            Some(Fingerprint::Id(id)) => self.id_epoch(id),
            Some(Fingerprint::Hash(h)) => {
                let found = match aim {
                    Some(a) => self.hash_epoch_aimed(h, a),
                    None => self.hash_epoch(h),
                };
                match found {
                    Some(e) => Some(e),
                    None => {
                        // Anything on disk is older than the floor, so older
                        // than a position held in memory at or above it.
                        let newer = position.is_some_and(|p| p >= self.floor);
                        if !newer && self.disk.filter.as_ref().is_some_and(|f| f.may_hold(h)) {
                            return Lookup::Disk {
                                key: key_of(h),
                                position,
                            };
                        }
                        None
                    }
                }
            }
        };
        match resolve(position, content) {
            Some((r, e)) => Lookup::Found(r, e),
            None => Lookup::Fresh,
        }
    }

    /// Whether an epoch read from disk for a hash is live. Entries of
    /// dropped epochs stay on disk until compaction removes them; they
    /// never answer.
    #[must_use]
    pub fn disk_epoch_is_live(&self, epoch: u64) -> bool {
        epoch >= self.oldest && epoch <= self.open
    }

    /// First stage of a batched record: fetches the filter words the
    /// lookup of `fp` will read, as [`LaneIndex::aim`] does.
    #[inline]
    pub fn prefetch_filters(&self, fp: Option<Fingerprint>) {
        let _ = self.aim::<false>(fp);
    }

    /// First stage of a batched check: the filter word and bits of a
    /// hash in the table, its word fetched, and the disk filter's block.
    /// `FAR` as in [`FpTable::aim`].
    #[inline]
    #[must_use]
    pub fn aim<const FAR: bool>(&self, fp: Option<Fingerprint>) -> Aim {
        match fp {
            Some(Fingerprint::Hash(h)) => {
                if let Some(f) = &self.disk.filter {
                    f.prefetch(h);
                }
                self.hashes.aim::<FAR>(h)
            }
            _ => Aim::default(),
        }
    }

    /// Second stage of a batched check: tests the aim's filter word and,
    /// past it, fetches the slot lines ([`FpTable::screen`]).
    #[inline]
    pub fn screen<const FAR: bool>(&self, aim: &mut Aim) {
        self.hashes.screen::<FAR>(aim);
    }

    /// Slots of the lane's table, empty ones included: what decides where
    /// a batched check fetches to ([`FAR_SLOTS`]).
    #[must_use]
    pub fn table_slots(&self) -> usize {
        self.hashes.slot_count()
    }

    /// Second stage of a batched record: fetches the slots the insert of
    /// `fp` will read and write, whatever the filter says
    /// ([`FpTable::prefetch_insert`]).
    #[inline]
    pub fn prefetch_insert(&self, fp: Option<Fingerprint>) {
        if let Some(Fingerprint::Hash(h)) = fp {
            self.hashes.prefetch_insert::<true>(h);
        }
    }

    /// Records a handled record in `epoch` (the open one, or on load an
    /// older one). The caller has looked it up first: inserting a duplicate
    /// is a logic error.
    pub fn insert(&mut self, epoch: u64, offset: Option<u64>, fp: Option<Fingerprint>) {
        let sealed = epoch < self.open;
        if let Some(Fingerprint::Hash(h)) = fp {
            self.place_deferred();
            if !self.place(tagged(h, tag_of(epoch))) {
                return self.insert_bitmaps(epoch, offset, None, sealed);
            }
            self.epoch_mut(epoch).hashes += 1;
            self.live_fps += 1;
        }
        let id = match fp {
            Some(Fingerprint::Id(id)) => Some(id),
            _ => None,
        };
        self.insert_bitmaps(epoch, offset, id, sealed);
    }

    /// [`LaneIndex::insert`] into the open epoch, `epoch`, for a caller
    /// that records one record at a time: a hash joins the table with the
    /// lane's next `DEFERRED` - 1 such hashes. Its slots are fetched now
    /// and read when it is placed, so that the cache miss overlaps with
    /// the calls in between (BENCHMARKS.md, "One call a record" and
    /// "Inserts that fetch the whole cluster"). Lookups find it at once.
    pub fn insert_open(&mut self, epoch: u64, offset: Option<u64>, fp: Option<Fingerprint>) {
        debug_assert_eq!(epoch, self.open, "records go to the open epoch");
        let open = self.open;
        let id = match fp {
            Some(Fingerprint::Hash(h)) => {
                self.deferred.push(tagged(h, tag_of(open)));
                self.hashes.prefetch_insert::<false>(h);
                self.epoch_mut(open).hashes += 1;
                self.live_fps += 1;
                if self.deferred.len() >= DEFERRED {
                    self.place_deferred();
                }
                None
            }
            Some(Fingerprint::Id(id)) => Some(id),
            None => None,
        };
        self.insert_bitmaps(open, offset, id, false);
    }

    /// Places the deferred hashes in the table. Their slots were fetched
    /// as each joined the list ([`LaneIndex::insert_open`]).
    fn place_deferred(&mut self) {
        if self.deferred.is_empty() {
            return;
        }
        let mut deferred = std::mem::take(&mut self.deferred);
        for &d in &deferred {
            if !self.place(d) {
                // The caller looked each one up first, so this is not
                // expected; the counts stay true if it happens.
                let e = self.epoch_of(tag_in(d));
                let at = self.epoch_mut(e);
                at.hashes = at.hashes.saturating_sub(1);
                self.live_fps = self.live_fps.saturating_sub(1);
            }
        }
        deferred.clear();
        self.deferred = deferred;
    }

    /// Puts an entry made by [`tagged`] in the table, in the place of a
    /// dead entry where the insert meets one. False if a live entry holds
    /// its key already.
    fn place(&mut self, entry: u128) -> bool {
        let dead = below(self.open, self.floor);
        let tag = tag_in(entry);
        let added = if self.below_floor > 0 {
            self.hashes.insert_reusing(entry, tag, dead)
        } else {
            self.hashes.insert(entry, tag, dead)
        };
        match added {
            Insert::Added => true,
            // One entry fewer below the floor for the next purge to find.
            Insert::Replaced => {
                self.below_floor = self.below_floor.saturating_sub(1);
                true
            }
            Insert::Present(_) => false,
        }
    }

    fn insert_bitmaps(&mut self, epoch: u64, offset: Option<u64>, id: Option<u64>, sealed: bool) {
        if offset.is_none() && id.is_none() {
            return;
        }
        let e = self.epoch_mut(epoch);
        let mut added = (0, 0);
        if let Some(o) = offset {
            added.0 = u64::from(e.offsets_mut().insert(o));
            widen(&mut e.offset_range, o, o);
        }
        if let Some(i) = id {
            added.1 = u64::from(e.ids.insert(i));
            widen(&mut e.id_range, i, i);
        }
        self.live_offsets += added.0;
        self.live_fps += added.1;
        if sealed {
            if let Some(o) = offset {
                self.sealed_offsets.insert(o);
            }
            if let Some(i) = id {
                self.sealed_ids.insert(i);
            }
            self.refresh_ranges();
        }
    }

    /// Re-reads the ranges of the sealed unions after they changed.
    fn refresh_ranges(&mut self) {
        let range = |b: &RoaringTreemap| b.min().zip(b.max());
        self.sealed_offset_range = range(&self.sealed_offsets);
        self.sealed_id_range = range(&self.sealed_ids);
    }

    /// Merges a bitmap of offsets into `epoch` (on load, and for offsets
    /// carried into the open epoch).
    pub fn merge_offsets(&mut self, epoch: u64, offsets: &RoaringTreemap) {
        if offsets.is_empty() {
            return;
        }
        let sealed = epoch < self.open;
        let e = self.epoch_mut(epoch);
        let before = e.offsets();
        *e.offsets_mut() |= offsets;
        let added = e.offsets() - before;
        if let (Some(lo), Some(hi)) = (offsets.min(), offsets.max()) {
            widen(&mut e.offset_range, lo, hi);
        }
        self.live_offsets += added;
        if sealed {
            self.sealed_offsets |= offsets;
            self.refresh_ranges();
        }
    }

    /// Merges a bitmap of ids into `epoch` (on load).
    pub fn merge_ids(&mut self, epoch: u64, ids: &RoaringTreemap) {
        if ids.is_empty() {
            return;
        }
        let sealed = epoch < self.open;
        let e = self.epoch_mut(epoch);
        let before = e.ids.len();
        e.ids |= ids;
        let added = e.ids.len() - before;
        if let (Some(lo), Some(hi)) = (ids.min(), ids.max()) {
            widen(&mut e.id_range, lo, hi);
        }
        self.live_fps += added;
        if sealed {
            self.sealed_ids |= ids;
            self.refresh_ranges();
        }
    }

    /// Adds the hashes recovered for the epochs kept in memory, as
    /// `(key, epoch)`: all of a lane's epochs at once, so the table is
    /// laid out once. A hash in two epochs counts in the newer one.
    pub fn load_hashes(&mut self, mut entries: Vec<(u128, u64)>) {
        debug_assert!(self.deferred.is_empty(), "a lane loads before it records");
        entries.sort_unstable();
        keep_last_of_each_key(&mut entries);
        let mut counts: std::collections::BTreeMap<u64, u64> = Default::default();
        for &(_, e) in &entries {
            *counts.entry(e).or_default() += 1;
        }
        // Still sorted by key, one entry a key: laid out without a sort.
        let tagged = entries.into_iter().map(|(k, e)| (k, tag_of(e))).collect();
        self.hashes = FpTable::from_sorted(tagged, table::PACKED_LOAD_PCT);
        for (e, n) in counts {
            self.epoch_mut(e).hashes = n;
            self.live_fps += n;
        }
    }

    /// Counts hashes recovered for an epoch kept on disk.
    pub fn count_disk_hashes(&mut self, epoch: u64, n: u64) {
        self.epoch_mut(epoch).hashes += n;
        self.disk.live += n;
        self.live_fps += n;
    }

    /// Packs the sealed epochs' bitmaps and counts their bytes (after a
    /// load).
    pub fn seal_loaded(&mut self) {
        let open = self.open;
        let mut bytes = 0;
        for e in self.epochs.iter_mut().filter(|e| e.epoch < open) {
            e.seal();
            bytes += e.bitmap_bytes();
        }
        self.sealed_offsets.optimize();
        self.sealed_ids.optimize();
        self.refresh_ranges();
        self.sealed_bitmap_bytes = bytes;
    }

    /// Closes the open epoch: its bitmaps join the sealed unions, packed,
    /// and `next` opens. When the closed epoch holds a quarter of the table
    /// or more, the table is laid out fuller, in one pass that costs at
    /// most four times what the epoch's inserts did, unless this
    /// checkpoint's purge has just laid it out with room for the next
    /// epoch; smaller epochs leave it as it is, so a checkpoint never
    /// costs a pass over many epochs.
    /// A table laid out again during the epoch (grown or purged) is
    /// moved onto huge pages, one copy of it, at most once a checkpoint.
    pub fn close(&mut self, next: u64) {
        self.place_deferred();
        let room_kept = std::mem::take(&mut self.room_kept);
        // A lane that records no more gives the buffer back.
        self.deferred = Vec::new();
        if let Some(last) = self.epochs.back_mut()
            && last.epoch == self.open
        {
            // Not when the drop just purged it: the purge laid it out with
            // room for the next epoch, which a pack would take away, and
            // the epoch's inserts would then grow it again from packed, a
            // pass over the table at each growth (BENCHMARKS.md, "A
            // rolling window of large epochs").
            if last.hashes * 4 >= self.hashes.len() as u64 && !room_kept {
                self.hashes.pack();
            }
            self.sealed_offsets |= &last.offsets;
            last.seal();
            self.sealed_bitmap_bytes += last.bitmap_bytes();
            self.sealed_ids |= &last.ids;
            self.sealed_offsets.optimize();
            self.sealed_ids.optimize();
            self.refresh_ranges();
        }
        // After the pack, and whether or not the epoch took records: the
        // checkpoint's purge may have laid the table out again.
        self.hashes.settle_pages();
        self.open = next;
    }

    /// The offsets at or past `position` held by the epochs older than
    /// `oldest_live` (see `Guard::checkpoint`). Reads only those epochs.
    #[must_use]
    pub fn carried(&self, oldest_live: u64, position: u64) -> RoaringTreemap {
        let mut carried = RoaringTreemap::new();
        for e in self.epochs.iter().take_while(|e| e.epoch < oldest_live) {
            if e.offset_range.is_some_and(|(_, hi)| hi >= position) {
                let mut tail = e.offset_bitmap().into_owned();
                tail.remove_range(..position);
                carried |= tail;
            }
        }
        carried
    }

    /// Drops every epoch older than `oldest_live`, whole: the cost is that
    /// of the dropped epochs' bitmaps, not of the live ones. The table is
    /// purged once an eighth of it is below the floor, or when its oldest
    /// tags would soon be ambiguous.
    pub fn drop_before(&mut self, oldest_live: u64) {
        self.place_deferred();
        // Read before the drop, which may take the newest epoch too.
        let newest = self.epochs.back().map_or(0, |e| e.hashes);
        while self.epochs.front().is_some_and(|e| e.epoch < oldest_live) {
            let Some(e) = self.epochs.pop_front() else {
                break;
            };
            self.sealed_offsets -= e.offset_bitmap().as_ref();
            self.sealed_ids -= &e.ids;
            if e.epoch < self.open {
                self.sealed_bitmap_bytes =
                    self.sealed_bitmap_bytes.saturating_sub(e.bitmap_bytes());
            }
            self.live_fps = self.live_fps.saturating_sub(e.fingerprints());
            self.live_offsets = self.live_offsets.saturating_sub(e.offsets());
            if e.epoch >= self.floor {
                self.below_floor += e.hashes;
            } else {
                self.disk.live = self.disk.live.saturating_sub(e.hashes);
            }
        }
        self.refresh_ranges();
        self.oldest = self.oldest.max(oldest_live);
        self.floor = self.floor.max(self.oldest);
        self.room_kept = self.maybe_purge(newest);
    }

    /// Marks the epochs below `floor` as kept on disk: their hashes leave
    /// the table (the caller has written them to disk and into the lane's
    /// filter first).
    pub fn lower_to_disk(&mut self, floor: u64) {
        if floor <= self.floor {
            return;
        }
        self.place_deferred();
        for e in self.epochs.iter() {
            if e.epoch >= self.floor && e.epoch < floor {
                self.below_floor += e.hashes;
                self.disk.live += e.hashes;
            }
        }
        self.floor = floor;
        self.purge(self.epochs.back().map_or(0, |e| e.hashes));
    }

    /// Purges the table if it is due: whether it did.
    fn maybe_purge(&mut self, newest: u64) -> bool {
        let stale = self.below_floor * PURGE_SHARE > self.hashes.len() as u64;
        // Tags repeat every TAG_SPAN epochs: entries must leave before
        // they could be read as a newer epoch.
        let aging = self.open.saturating_sub(self.floor) > TAG_SPAN / 4 && self.below_floor > 0;
        if stale || aging {
            self.purge(newest);
        }
        stale || aging
    }

    /// Drops the entries below the floor. The table is laid out with room
    /// for an eighth more live entries, and at least for `newest` (the
    /// hashes of the newest epoch): the next epoch's inserts then rarely
    /// grow it, even in a table the purge emptied.
    fn purge(&mut self, newest: u64) {
        let live = (self.hashes.len() as u64).saturating_sub(self.below_floor);
        let room = (live / PURGE_ROOM).max(newest);
        self.hashes
            .purge(below(self.open, self.floor), room as usize);
        self.below_floor = 0;
    }

    /// Content hashes recorded in `epoch`.
    #[must_use]
    pub fn epoch_hashes(&self, epoch: u64) -> u64 {
        self.epochs
            .binary_search_by_key(&epoch, |e| e.epoch)
            .map_or(0, |at| self.epochs[at].hashes)
    }

    /// The lane's disk tier.
    pub fn disk_mut(&mut self) -> &mut DiskTier {
        &mut self.disk
    }

    /// The lane's disk tier.
    #[must_use]
    pub fn disk(&self) -> &DiskTier {
        &self.disk
    }

    /// The memory floor: epochs below it keep their hashes on disk.
    #[cfg(test)]
    #[must_use]
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// The live epochs, oldest first.
    pub fn epochs(&self) -> impl Iterator<Item = &EpochIndex> {
        self.epochs.iter()
    }

    /// Every live offset.
    #[must_use]
    pub fn live_offsets(&self) -> RoaringTreemap {
        let mut all = self.sealed_offsets.clone();
        if let Some(last) = self.epochs.back()
            && self.is_open(last)
        {
            all |= last.offset_bitmap().as_ref();
        }
        all
    }

    /// Live content fingerprints (hashes and ids), on disk or not.
    #[must_use]
    pub fn live_fingerprints(&self) -> u64 {
        self.live_fps
    }

    /// Live offsets.
    #[must_use]
    pub fn live_offset_count(&self) -> u64 {
        self.live_offsets
    }

    /// Heap bytes held in memory: the table, the bitmaps and the disk
    /// filter. Cheap: sealed bitmaps are counted as they are sealed.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        let open = self
            .epochs
            .back()
            .filter(|e| self.is_open(e))
            .map_or(0, EpochIndex::bitmap_bytes);
        self.hashes.memory_bytes()
            + self.deferred.capacity() * std::mem::size_of::<u128>()
            + open
            + self.sealed_bitmap_bytes
            + bitmap_bytes(&self.sealed_offsets)
            + bitmap_bytes(&self.sealed_ids)
            + self
                .disk
                .filter
                .as_ref()
                .map_or(0, DiskFilter::memory_bytes)
    }

    /// Bytes of the table alone, and its entries (live or not), those
    /// waiting to be placed included.
    #[must_use]
    pub fn table_bytes(&self) -> (usize, usize) {
        (
            self.hashes.memory_bytes(),
            self.hashes.len() + self.deferred.len(),
        )
    }
}

#[cfg(test)]
mod test;
