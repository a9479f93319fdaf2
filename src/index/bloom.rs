//! [`DiskFilter`]: the small in-memory filter in front of a lane's content
//! hashes kept on disk.
//!
//! It is a blocked Bloom filter: one 64-byte block per lookup (one cache
//! line), chosen by the hash's top bits, with 7 bits set in it from the
//! hash's middle bits. At its capacity it spends 14 bits a hash (1.75 B,
//! within the 2 B an identity on disk may cost) and lets about 1 absent
//! hash in 400 through to a disk read; below it, fewer.
//!
//! Unlike a static filter it takes inserts, so every spill of sealed
//! epochs adds to the one filter of its lane and a miss costs one probe
//! however many epochs are on disk. It cannot forget: the hashes of
//! dropped epochs stay set until the filter is rebuilt from the epochs
//! still live, which the guard does once they make up a third of it.
//! A wrong "maybe" only costs a disk read that finds nothing (or an
//! entry of a dropped epoch, which does not count).

use super::table::{LOW_BITS, advise_huge_pages, prefetch};

/// Bits spent per hash at the filter's capacity.
const BITS_PER_HASH: usize = 14;

/// Bits set per hash, 9 bits of the hash each.
const PROBES: usize = 7;

#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Block([u64; 8]);

/// A blocked Bloom filter over 128-bit hashes.
#[derive(Debug, Default)]
pub struct DiskFilter {
    blocks: Box<[Block]>,
    /// Hashes it was sized for.
    capacity: u64,
    /// Hashes inserted since it was built, dead ones included.
    inserted: u64,
}

#[inline]
fn block_of(h: u128, blocks: usize) -> usize {
    ((u128::from((h >> 64) as u64) * blocks as u128) >> 64) as usize
}

impl DiskFilter {
    /// An empty filter for up to `capacity` hashes.
    #[must_use]
    pub fn with_capacity(capacity: u64) -> Self {
        let capacity = capacity.max(1024);
        let blocks = vec![Block::default(); Self::blocks_for(capacity)].into_boxed_slice();
        advise_huge_pages(&blocks);
        DiskFilter {
            blocks,
            capacity,
            inserted: 0,
        }
    }

    fn blocks_for(capacity: u64) -> usize {
        (capacity.max(1024) as usize * BITS_PER_HASH).div_ceil(512)
    }

    /// Heap bytes of a filter made for `capacity` hashes.
    #[must_use]
    pub fn bytes_for(capacity: u64) -> u64 {
        Self::blocks_for(capacity) as u64 * 64
    }

    /// Adds a hash.
    pub fn insert(&mut self, h: u128) {
        let n = self.blocks.len();
        if let Some(b) = self.blocks.get_mut(block_of(h, n)) {
            let mut mid = (h >> LOW_BITS) as u64;
            for _ in 0..PROBES {
                let bit = (mid & 511) as usize;
                b.0[bit >> 6] |= 1 << (bit & 63);
                mid >>= 9;
            }
        }
        self.inserted += 1;
    }

    /// Adds hashes, fetching each one's block a few hashes ahead: a filter
    /// larger than the cache then pays its memory misses side by side,
    /// not one after another (recovery adds millions at once).
    pub fn insert_many(&mut self, hashes: &[u128]) {
        const AHEAD: usize = 16;
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(&next) = hashes.get(i + AHEAD) {
                self.prefetch(next);
            }
            self.insert(h);
        }
    }

    /// False when the hash is surely not among those inserted.
    #[inline]
    #[must_use]
    pub fn may_hold(&self, h: u128) -> bool {
        let Some(b) = self.blocks.get(block_of(h, self.blocks.len())) else {
            return false;
        };
        let mut mid = (h >> LOW_BITS) as u64;
        for _ in 0..PROBES {
            let bit = (mid & 511) as usize;
            if b.0[bit >> 6] & (1 << (bit & 63)) == 0 {
                return false;
            }
            mid >>= 9;
        }
        true
    }

    /// Fetches the block of `h` into the cache.
    #[inline]
    pub fn prefetch(&self, h: u128) {
        if let Some(b) = self.blocks.get(block_of(h, self.blocks.len())) {
            prefetch(b);
        }
    }

    /// Hashes it was sized for.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Hashes inserted since it was built.
    #[must_use]
    pub fn inserted(&self) -> u64 {
        self.inserted
    }

    /// Heap bytes held.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.blocks.len() * 64
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn filter_never_forgets_and_rarely_lies() {
        let n = 100_000u64;
        let mut f = DiskFilter::with_capacity(n);
        let h = |i: u64| xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
        for i in 0..n / 2 {
            f.insert(h(i));
        }
        f.insert_many(&(n / 2..n).map(h).collect::<Vec<_>>());
        assert!((0..n).all(|i| f.may_hold(h(i))));
        let wrong = (n..2 * n).filter(|&i| f.may_hold(h(i))).count();
        // 14 bits a hash, 7 bits set in one cache line: about 1 in 400.
        assert!(wrong < n as usize / 250, "{wrong} false positives in {n}");
        assert_eq!(f.inserted(), n);
        let per = f.memory_bytes() as f64 / n as f64;
        assert!(per <= 1.76, "{per} bytes a hash");
        assert!(!DiskFilter::default().may_hold(h(1)));
    }
}
