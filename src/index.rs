//! In-memory sets of what was handled, per (lane, epoch).
//!
//! - Offsets and dense user ids go into roaring bitmaps: a dense run of
//!   offsets costs a fraction of a byte each.
//! - 128-bit content fingerprints are already uniform hashes. The open
//!   epoch keeps them in a hash table whose hasher takes the low 64 bits as
//!   they are (no second hash). A sealed epoch never changes again, so it
//!   becomes a sorted array, 16 bytes an entry, probed by interpolation
//!   search.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};

use roaring::RoaringTreemap;

use crate::fingerprint::Fingerprint;

/// A hasher for values that are already uniform hashes: it passes the low
/// 64 bits through. Wrong for dense keys (offsets, ids), which is why those
/// live in roaring instead.
#[derive(Clone, Copy, Default)]
pub struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for types other than u128; fold the bytes in.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

impl BuildHasher for PassThrough {
    type Hasher = PassThrough;
    fn build_hasher(&self) -> PassThrough {
        PassThrough(0)
    }
}

type HashSet = hashbrown::HashSet<u128, PassThrough>;

/// The content fingerprints of one epoch.
#[derive(Debug)]
enum Hashes {
    Open(HashSet),
    Sealed(Box<[u128]>),
}

impl Default for Hashes {
    fn default() -> Self {
        Hashes::Open(HashSet::default())
    }
}

impl Hashes {
    fn contains(&self, h: u128) -> bool {
        match self {
            Hashes::Open(set) => set.contains(&h),
            Hashes::Sealed(sorted) => interpolation_search(sorted, h),
        }
    }

    fn len(&self) -> usize {
        match self {
            Hashes::Open(set) => set.len(),
            Hashes::Sealed(sorted) => sorted.len(),
        }
    }

    fn memory_bytes(&self) -> usize {
        match self {
            // hashbrown: 16 bytes a bucket plus one control byte.
            Hashes::Open(set) => set.capacity().next_power_of_two() * 17 * 8 / 7,
            Hashes::Sealed(sorted) => sorted.len() * 16,
        }
    }
}

/// Finds `key` in a sorted slice of uniform hashes. Interpolation narrows
/// the window in a few steps; binary search finishes it.
#[must_use]
pub fn interpolation_search(sorted: &[u128], key: u128) -> bool {
    let (mut lo, mut hi) = (0usize, sorted.len());
    let mut steps = 0;
    while hi - lo > 16 && steps < 3 {
        let (a, b) = (sorted[lo], sorted[hi - 1]);
        if key < a || key > b {
            return false;
        }
        // Interpolate on the top 64 bits, which keeps the product in u128.
        let span = ((b - a) >> 64) as u64;
        let off = ((key - a) >> 64) as u64;
        let n = (hi - lo - 1) as u128;
        let guess = if span == 0 {
            0
        } else {
            (u128::from(off) * n / u128::from(span)) as usize
        };
        let pos = lo + guess.min(hi - lo - 1);
        // Probe a small window around the guess to shrink the range fast.
        let w = ((hi - lo) >> 6).max(8);
        let (wlo, whi) = (pos.saturating_sub(w).max(lo), (pos + w + 1).min(hi));
        if sorted[wlo] <= key && key <= sorted[whi - 1] {
            lo = wlo;
            hi = whi;
        } else if key < sorted[wlo] {
            hi = wlo;
        } else {
            lo = whi;
        }
        steps += 1;
    }
    sorted[lo..hi].binary_search(&key).is_ok()
}

/// What one epoch of one lane handled.
#[derive(Debug, Default)]
pub struct EpochIndex {
    offsets: RoaringTreemap,
    ids: RoaringTreemap,
    hashes: Hashes,
}

impl EpochIndex {
    /// Records a position.
    pub fn insert_offset(&mut self, offset: u64) {
        self.offsets.insert(offset);
    }

    /// Records a content fingerprint. Sealed epochs are read-only: inserting
    /// into one is a logic error and is ignored (debug builds assert).
    pub fn insert_fingerprint(&mut self, fp: Fingerprint) {
        match fp {
            Fingerprint::Id(id) => {
                self.ids.insert(id);
            }
            Fingerprint::Hash(h) => match &mut self.hashes {
                Hashes::Open(set) => {
                    set.insert(h);
                }
                Hashes::Sealed(_) => debug_assert!(false, "insert into a sealed epoch"),
            },
        }
    }

    /// Adds a batch of hashes to the open epoch (used on load).
    pub fn extend_hashes(&mut self, hashes: impl ExactSizeIterator<Item = u128>) {
        if let Hashes::Open(set) = &mut self.hashes {
            set.reserve(hashes.len());
            set.extend(hashes);
        }
    }

    /// Merges a bitmap of offsets (used on load).
    pub fn merge_offsets(&mut self, offsets: &RoaringTreemap) {
        self.offsets |= offsets;
    }

    /// Merges a bitmap of ids (used on load).
    pub fn merge_ids(&mut self, ids: &RoaringTreemap) {
        self.ids |= ids;
    }

    /// Whether this epoch handled the offset.
    #[must_use]
    pub fn contains_offset(&self, offset: u64) -> bool {
        self.offsets.contains(offset)
    }

    /// Whether this epoch handled the fingerprint.
    #[must_use]
    pub fn contains_fingerprint(&self, fp: Fingerprint) -> bool {
        match fp {
            Fingerprint::Id(id) => self.ids.contains(id),
            Fingerprint::Hash(h) => self.hashes.contains(h),
        }
    }

    /// Turns the fingerprint table into a sorted array: 16 bytes an entry.
    pub fn seal(&mut self) {
        if let Hashes::Open(set) = &mut self.hashes {
            let mut v: Vec<u128> = std::mem::take(set).into_iter().collect();
            v.sort_unstable();
            self.hashes = Hashes::Sealed(v.into_boxed_slice());
        }
        self.offsets.optimize();
        self.ids.optimize();
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

    #[test]
    fn interpolation_search_finds_all_and_only_members() {
        let mut x = 0x9e37_79b9_7f4a_7c15_u128;
        let mut v: Vec<u128> = (0..50_000)
            .map(|_| {
                x = x
                    .wrapping_mul(0x2545_f491_4f6c_dd1d_0000_0000_0000_0001)
                    .wrapping_add(0x1234_5678_9abc_def1);
                xxhash_rust::xxh3::xxh3_128(&x.to_le_bytes())
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        for &h in &v {
            assert!(interpolation_search(&v, h));
        }
        for i in 0..50_000u64 {
            let probe = xxhash_rust::xxh3::xxh3_128(&i.to_be_bytes());
            assert_eq!(
                interpolation_search(&v, probe),
                v.binary_search(&probe).is_ok()
            );
        }
        assert!(!interpolation_search(&[], 5));
        assert!(interpolation_search(&[1, 2, 3], 2));
        assert!(interpolation_search(&[0, u128::MAX], u128::MAX));
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
