//! In-memory sets of what was handled, per (lane, epoch).
//!
//! - Offsets and dense user ids go into roaring bitmaps: a dense run of
//!   offsets costs a fraction of a byte each.
//! - 128-bit content fingerprints are already uniform hashes, so they go
//!   into [`FpTable`], an ordered linear-probing table that uses the
//!   hash's top bits as its slot (no second hash). A sealed epoch never
//!   changes again, so its table is rebuilt fuller.

use std::collections::BTreeMap;

use roaring::RoaringTreemap;

use crate::fingerprint::Fingerprint;

/// Load, in percent of the home slots, above which an open table grows.
const MAX_LOAD_PCT: usize = 85;
/// Load at which a sealed table is rebuilt. Probes get slower quickly
/// above it (measured at 10M: about 60 ns at 80%, 140 ns at 92%).
const SEALED_LOAD_PCT: usize = 80;
/// Load at which a recovered open epoch is laid out, leaving room to grow.
const LOADED_OPEN_LOAD_PCT: usize = 70;

/// A set of uniform 128-bit hashes: an ordered linear-probing table.
///
/// Slots hold the hashes themselves, 16 bytes each; 0 marks an empty slot
/// and the hash 0 is kept in a flag. A hash's home slot is its top 64 bits
/// scaled to the number of home slots, so homes are monotone in the hash.
/// Invariants:
///
/// - the non-empty slots are in ascending order across the whole table;
/// - every hash sits at or after its home, with no empty slot between;
/// - the last slot is always empty, so a scan always ends.
///
/// A lookup starts at the home and scans while the slots hold smaller
/// hashes: one cache miss and a few neighbours. An insert shifts the rest
/// of its cluster right by one.
///
/// In front of the slots sits a small Bloom filter, 6 bits a home slot in
/// one 64-bit word per lookup, set from the hash's low bits (the home uses
/// the top bits). It is about 1/20 of the table, so it mostly stays in the
/// CPU cache, and it answers about 19 lookups of an absent hash in 20
/// without touching the slots: fresh records are the common case.
///
/// An open table grows by a fifth at 85% load, so it stays 71-85% full:
/// 18.9 to 23.8 bytes a hash, filter included. Growing is one sequential
/// pass, since the order is kept. A sealed table is laid out 80% full
/// (21.1 bytes a hash).
#[derive(Debug, Default)]
pub struct FpTable {
    slots: Box<[u128]>,
    filter: Box<[u64]>,
    homes: usize,
    len: usize,
    zero: bool,
}

/// Filter words for `homes` home slots: 6 bits each.
fn filter_words(homes: usize) -> usize {
    (homes * 3 / 32).max(1)
}

/// The filter word of `h` among `words`, and the bits it sets there.
fn filter_bits(h: u128, words: usize) -> (usize, u64) {
    let lo = h as u64;
    let word = ((u128::from(lo) * words as u128) >> 64) as usize;
    let bits = (1u64 << (lo & 63)) | (1u64 << ((lo >> 6) & 63)) | (1u64 << ((lo >> 12) & 63));
    (word, bits)
}

/// The home slot of `h` in a table of `homes` home slots.
fn home_of(h: u128, homes: usize) -> usize {
    ((u128::from((h >> 64) as u64) * homes as u128) >> 64) as usize
}

/// Slots of a table with `homes` home slots: room past the last home for
/// clusters that spill over, and the always-empty last slot.
fn slots_for(homes: usize) -> usize {
    homes + homes / 512 + 32
}

/// Lays out the hashes held in `v` (ascending, with any number of empty
/// slots between them) over at least `homes` home slots. Returns the slots
/// and the number of home slots used.
///
/// The layout is canonical: each hash goes to `max(home, previous + 1)`.
/// When every hash moves right (a bigger table, or a compact sorted
/// vector), it is done in place: the vector is extended (a `realloc`,
/// which for large tables remaps pages rather than copying them) and the
/// hashes are moved from the last one down. When every hash moves left (a
/// smaller table), it is done in place from the first one up. Otherwise a
/// new vector is laid out.
fn lay_out(mut v: Vec<u128>, homes: usize) -> (Box<[u128]>, usize) {
    let mut homes = homes.max(16);
    let count = v.iter().filter(|&&s| s != 0).count();
    loop {
        let len = slots_for(homes);
        // Where each hash goes, and which way they all move.
        let (mut right, mut left, mut fits) = (true, true, true);
        let track = len <= u32::MAX as usize;
        let mut places: Vec<u32> = Vec::with_capacity(if track { count } else { 0 });
        let mut next = 0;
        for (q, &h) in v.iter().enumerate().filter(|(_, s)| **s != 0) {
            let at = home_of(h, homes).max(next);
            // Keep the last slot empty; spill-over this long is rare.
            if at + 1 >= len {
                fits = false;
                break;
            }
            right &= at >= q;
            left &= at <= q;
            if track {
                places.push(at as u32);
            }
            next = at + 1;
        }
        if !fits {
            homes += homes / 8 + 16;
            continue;
        }
        if track && right && len >= v.len() {
            let old = v.len();
            v.reserve_exact(len - old);
            v.resize(len, 0);
            let mut k = places.len();
            for q in (0..old).rev() {
                let h = v[q];
                if h != 0 {
                    k -= 1;
                    let at = places[k] as usize;
                    if at != q {
                        v[at] = h;
                        v[q] = 0;
                    }
                }
            }
            return (v.into_boxed_slice(), homes);
        }
        if track && left {
            let mut k = 0;
            for q in 0..v.len() {
                let h = v[q];
                if h != 0 {
                    let at = places[k] as usize;
                    k += 1;
                    if at != q {
                        v[at] = h;
                        v[q] = 0;
                    }
                }
            }
            v.resize(len, 0);
            return (v.into_boxed_slice(), homes);
        }
        let mut slots = vec![0u128; len].into_boxed_slice();
        let mut next = 0;
        for &h in v.iter().filter(|&&s| s != 0) {
            let at = home_of(h, homes).max(next);
            slots[at] = h;
            next = at + 1;
        }
        return (slots, homes);
    }
}

impl FpTable {
    /// Whether the set holds `h`.
    #[must_use]
    pub fn contains(&self, h: u128) -> bool {
        if h == 0 {
            return self.zero;
        }
        let (word, bits) = filter_bits(h, self.filter.len());
        if self.filter.get(word).is_none_or(|w| w & bits != bits) {
            return false;
        }
        let from = home_of(h, self.homes);
        for &s in self.slots.get(from..).unwrap_or_default() {
            if s >= h || s == 0 {
                return s == h;
            }
        }
        false
    }

    /// Adds `h`; false when it was there already.
    pub fn insert(&mut self, h: u128) -> bool {
        if h == 0 {
            let new = !self.zero;
            self.zero = true;
            return new;
        }
        if (self.len + 1) * 100 > self.homes * MAX_LOAD_PCT {
            let grown = if self.homes < 4096 {
                (self.homes * 2).max(16)
            } else {
                self.homes + self.homes / 5
            };
            self.rebuild(grown);
        }
        loop {
            let from = home_of(h, self.homes);
            // The last slot is empty, so both scans find a slot.
            let i = from
                + self.slots[from..]
                    .iter()
                    .position(|&s| s >= h || s == 0)
                    .unwrap_or(0);
            if self.slots[i] == h {
                return false;
            }
            let free = self.slots[i..].iter().position(|&s| s == 0);
            match free.map(|e| i + e) {
                Some(j) if j + 1 < self.slots.len() => {
                    self.slots.copy_within(i..j, i + 1);
                    self.slots[i] = h;
                    self.len += 1;
                    let (word, bits) = filter_bits(h, self.filter.len());
                    if let Some(w) = self.filter.get_mut(word) {
                        *w |= bits;
                    }
                    return true;
                }
                // The cluster would take the last slot: grow, then retry.
                _ => self.rebuild(self.homes + self.homes / 5 + 16),
            }
        }
    }

    /// Makes room for `additional` more hashes without growing.
    pub fn reserve(&mut self, additional: usize) {
        let need = (self.len + additional) * 100 / MAX_LOAD_PCT + 1;
        if need > self.homes {
            self.rebuild(need);
        }
    }

    /// A table holding `hashes` (in any order, duplicates allowed), laid
    /// out `load_pct` full: a sort and one pass, much faster than inserting
    /// one by one into a large table.
    #[must_use]
    pub fn from_hashes(mut hashes: Vec<u128>, load_pct: usize) -> Self {
        hashes.sort_unstable();
        hashes.dedup();
        let zero = hashes.first() == Some(&0);
        if zero {
            hashes.remove(0);
        }
        let len = hashes.len();
        let (slots, homes) = lay_out(hashes, len * 100 / load_pct + 1);
        let mut t = FpTable {
            slots,
            filter: Box::default(),
            homes,
            len,
            zero,
        };
        t.refill();
        t
    }

    /// Lays a table that will not change again out fuller, if it is not
    /// already.
    pub fn seal(&mut self) {
        let homes = self.len * 100 / SEALED_LOAD_PCT + 1;
        if homes < self.homes {
            self.rebuild(homes);
        }
    }

    /// Lays the hashes out again over `homes` home slots (at least).
    fn rebuild(&mut self, homes: usize) {
        let slots = std::mem::take(&mut self.slots).into_vec();
        (self.slots, self.homes) = lay_out(slots, homes);
        self.refill();
    }

    /// Sizes the filter for the home slots and sets every hash's bits.
    fn refill(&mut self) {
        let words = filter_words(self.homes);
        let mut filter = vec![0u64; words].into_boxed_slice();
        for &h in self.slots.iter().filter(|&&s| s != 0) {
            let (word, bits) = filter_bits(h, words);
            filter[word] |= bits;
        }
        self.filter = filter;
    }

    /// Number of hashes.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero)
    }

    /// Heap bytes held: the slots and the filter.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * 16 + self.filter.len() * 8
    }
}

/// What one epoch of one lane handled.
#[derive(Debug, Default)]
pub struct EpochIndex {
    offsets: RoaringTreemap,
    /// The highest offset: a record past it (the usual fresh record) is
    /// answered without a bitmap lookup.
    max_offset: Option<u64>,
    ids: RoaringTreemap,
    hashes: FpTable,
    sealed: bool,
}

impl EpochIndex {
    /// Records a position.
    pub fn insert_offset(&mut self, offset: u64) {
        self.offsets.insert(offset);
        self.max_offset = self.max_offset.max(Some(offset));
    }

    /// Records a content fingerprint. Sealed epochs are read-only: inserting
    /// into one is a logic error and is ignored (debug builds assert).
    pub fn insert_fingerprint(&mut self, fp: Fingerprint) {
        match fp {
            Fingerprint::Id(id) => {
                self.ids.insert(id);
            }
            Fingerprint::Hash(h) => {
                debug_assert!(!self.sealed, "insert into a sealed epoch");
                self.hashes.insert(h);
            }
        }
    }

    /// Adds the hashes recovered for this epoch; `sealed` when the epoch is
    /// closed, so the table is laid out for good at once.
    pub fn load_hashes(&mut self, hashes: Vec<u128>, sealed: bool) {
        if self.hashes.len() == 0 {
            let load = if sealed {
                SEALED_LOAD_PCT
            } else {
                LOADED_OPEN_LOAD_PCT
            };
            self.hashes = FpTable::from_hashes(hashes, load);
        } else {
            self.hashes.reserve(hashes.len());
            for h in hashes {
                self.hashes.insert(h);
            }
        }
    }

    /// Merges a bitmap of offsets (used on load).
    pub fn merge_offsets(&mut self, offsets: &RoaringTreemap) {
        self.offsets |= offsets;
        self.max_offset = self.max_offset.max(offsets.max());
    }

    /// Merges a bitmap of ids (used on load).
    pub fn merge_ids(&mut self, ids: &RoaringTreemap) {
        self.ids |= ids;
    }

    /// Whether this epoch handled the offset.
    #[must_use]
    pub fn contains_offset(&self, offset: u64) -> bool {
        self.max_offset.is_some_and(|m| offset <= m) && self.offsets.contains(offset)
    }

    /// Whether this epoch handled the fingerprint.
    #[must_use]
    pub fn contains_fingerprint(&self, fp: Fingerprint) -> bool {
        match fp {
            Fingerprint::Id(id) => self.ids.contains(id),
            Fingerprint::Hash(h) => self.hashes.contains(h),
        }
    }

    /// Packs the epoch for good: a fuller fingerprint table, run-length
    /// bitmaps.
    pub fn seal(&mut self) {
        if !self.sealed {
            self.hashes.seal();
            self.offsets.optimize();
            self.ids.optimize();
            self.sealed = true;
        }
    }

    /// Number of content fingerprints (hashes and ids).
    #[must_use]
    pub fn fingerprints(&self) -> u64 {
        self.hashes.len() as u64 + self.ids.len()
    }

    /// The offsets handled.
    #[must_use]
    pub fn offset_set(&self) -> &RoaringTreemap {
        &self.offsets
    }

    /// Number of offsets.
    #[must_use]
    pub fn offsets(&self) -> u64 {
        self.offsets.len()
    }

    /// Approximate heap bytes held.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.hashes.memory_bytes() + self.offsets.serialized_size() + self.ids.serialized_size()
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

/// All live epochs of one lane, newest first on lookup.
#[derive(Debug, Default)]
pub struct LaneIndex {
    epochs: BTreeMap<u64, EpochIndex>,
}

impl LaneIndex {
    /// The epoch's index, created when absent.
    pub fn epoch_mut(&mut self, epoch: u64) -> &mut EpochIndex {
        self.epochs.entry(epoch).or_default()
    }

    /// Looks a record up in every live epoch, newest first.
    #[must_use]
    pub fn find(&self, offset: Option<u64>, fp: Option<Fingerprint>) -> Option<(Reason, u64)> {
        for (&epoch, idx) in self.epochs.iter().rev() {
            if offset.is_some_and(|o| idx.contains_offset(o)) {
                return Some((Reason::SamePosition, epoch));
            }
            if fp.is_some_and(|f| idx.contains_fingerprint(f)) {
                return Some((Reason::SameContent, epoch));
            }
        }
        None
    }

    /// Seals every epoch older than `open`.
    pub fn seal_before(&mut self, open: u64) {
        for (_, idx) in self.epochs.range_mut(..open) {
            idx.seal();
        }
    }

    /// Drops every epoch older than `oldest_live`, whole.
    pub fn drop_before(&mut self, oldest_live: u64) {
        self.epochs = self.epochs.split_off(&oldest_live);
    }

    /// The live epochs.
    pub fn epochs(&self) -> impl Iterator<Item = (u64, &EpochIndex)> {
        self.epochs.iter().map(|(e, i)| (*e, i))
    }
}

#[cfg(test)]
mod test {
    use super::*;

    impl FpTable {
        /// Checks the invariants the lookups rely on.
        fn check_invariants(&self) {
            let mut prev = 0u128;
            let mut count = 0;
            for (i, &s) in self.slots.iter().enumerate() {
                if s == 0 {
                    continue;
                }
                count += 1;
                assert!(s > prev, "slot {i} out of order");
                prev = s;
                let home = home_of(s, self.homes);
                assert!(home <= i, "slot {i} before its home {home}");
                assert!(
                    self.slots[home..i].iter().all(|&x| x != 0),
                    "gap between home {home} and slot {i}"
                );
            }
            assert_eq!(count, self.len);
            assert_eq!(self.slots.last().copied().unwrap_or(0), 0, "last slot used");
            if self.homes > 0 {
                assert_eq!(self.filter.len(), filter_words(self.homes));
            }
            for &h in self.slots.iter().filter(|&&s| s != 0) {
                let (word, bits) = filter_bits(h, self.filter.len());
                assert_eq!(self.filter[word] & bits, bits, "filter misses {h:x}");
            }
        }
    }

    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn table_matches_a_hash_set() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut t = FpTable::default();
        let mut model = std::collections::HashSet::new();
        assert!(!t.contains(1) && !t.contains(0) && t.len() == 0);
        for round in 0..40_000u64 {
            let h = xxhash_rust::xxh3::xxh3_128(&(xorshift(&mut x) % 30_000).to_le_bytes());
            let h = if round % 997 == 0 { 0 } else { h };
            assert_eq!(t.insert(h), model.insert(h));
            if round % 5_000 == 0 {
                t.check_invariants();
            }
        }
        t.check_invariants();
        assert_eq!(t.len(), model.len());
        for i in 0..60_000u64 {
            let h = xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
            assert_eq!(t.contains(h), model.contains(&h), "{i}");
        }
        let open = t.memory_bytes();
        t.seal();
        t.check_invariants();
        assert!(t.memory_bytes() <= open);
        for &h in &model {
            assert!(t.contains(h));
        }
        assert!(t.contains(0));
        // Sealed, the table is 80 to 85% full, and the filter adds 6 bits a
        // slot.
        let per = t.memory_bytes() as f64 / t.len() as f64;
        assert!((19.5..21.5).contains(&per), "{per} bytes a hash");
        let built = FpTable::from_hashes(model.iter().copied().chain([5, 5, 0]).collect(), 80);
        built.check_invariants();
        assert_eq!(built.len(), model.len() + 1);
        assert!(model.iter().all(|&h| built.contains(h)) && built.contains(5));
        assert!(!built.contains(6));
    }

    #[test]
    fn table_stays_within_its_memory_bound_while_growing() {
        let mut t = FpTable::default();
        for i in 0..300_000u64 {
            t.insert(xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()));
            if i > 10_000 && i % 1_000 == 0 {
                let per = t.memory_bytes() as f64 / t.len() as f64;
                assert!(per <= 24.0, "{per} bytes a hash at {i}");
            }
        }
        t.check_invariants();
    }

    #[test]
    fn table_survives_skewed_hashes() {
        // Not uniform at all: every home is 0, or the top bits are equal,
        // or the values sit at the extremes. Slow, but correct.
        let mut t = FpTable::default();
        let mut all = Vec::new();
        for i in 1..2_000u128 {
            all.push(i);
            all.push((7u128 << 64) | i);
            all.push(u128::MAX - i);
        }
        for &h in all.iter().rev() {
            assert!(t.insert(h));
        }
        t.check_invariants();
        for &h in &all {
            assert!(!t.insert(h));
            assert!(t.contains(h));
        }
        assert!(!t.contains(2_000) && !t.contains(u128::MAX) && !t.contains(0));
        t.seal();
        t.check_invariants();
        assert!(all.iter().all(|&h| t.contains(h)));
        let mut reserved = FpTable::default();
        reserved.reserve(1_000);
        let homes = reserved.homes;
        for i in 0..1_000u64 {
            reserved.insert(xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()));
        }
        assert_eq!(reserved.homes, homes, "grew despite the reservation");
    }

    #[test]
    fn sealed_epoch_keeps_its_members() {
        let mut e = EpochIndex::default();
        for i in 0..1000u64 {
            e.insert_offset(i);
            e.insert_fingerprint(Fingerprint::content(None, Some(&i.to_le_bytes())));
            e.insert_fingerprint(Fingerprint::id(i * 3));
        }
        e.seal();
        for i in 0..1000u64 {
            assert!(e.contains_offset(i));
            assert!(e.contains_fingerprint(Fingerprint::content(None, Some(&i.to_le_bytes()))));
            assert!(e.contains_fingerprint(Fingerprint::id(i * 3)));
        }
        assert!(!e.contains_offset(1000));
        assert!(!e.contains_fingerprint(Fingerprint::id(1)));
        assert_eq!(e.fingerprints(), 2000);
    }

    #[test]
    fn lane_reports_reason_and_epoch() {
        let mut lane = LaneIndex::default();
        lane.epoch_mut(1).insert_offset(10);
        lane.epoch_mut(2).insert_fingerprint(Fingerprint::id(99));
        assert_eq!(lane.find(Some(10), None), Some((Reason::SamePosition, 1)));
        assert_eq!(
            lane.find(Some(11), Some(Fingerprint::id(99))),
            Some((Reason::SameContent, 2))
        );
        lane.drop_before(2);
        assert_eq!(lane.find(Some(10), None), None);
    }
}
