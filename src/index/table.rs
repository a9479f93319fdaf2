//! [`FpTable`]: one ordered linear-probing table of content hashes for all
//! the in-memory epochs of a lane, each entry tagged with its epoch.

/// Bits of a slot that hold the entry's epoch tag (the epoch modulo 2^24).
/// The other 104 bits are the top of the 128-bit hash: two hashes that
/// agree there are one identity in memory and on disk. At 1M records/s
/// with a window of 1e9 identities that merges two real events about once
/// in 2.3e11 days (8.64e10 * 1e9 / 2^104 = 4.3e-12 a day), within the
/// design's bound of 1e-9 a day.
pub const TAG_BITS: u32 = 24;
/// Tags are the epoch modulo this.
pub const TAG_SPAN: u64 = 1 << TAG_BITS;
const TAG_MASK: u128 = (1 << TAG_BITS) - 1;
const KEY_MASK: u128 = !TAG_MASK;

mod slots;
use slots::Slots;

/// Load, in percent of the home slots, above which the table grows.
const MAX_LOAD_PCT: usize = 85;
/// Load at which a table is laid out after a purge or a bulk load. Probes
/// get slower quickly above it (measured at 10M: about 60 ns at 80%,
/// 140 ns at 92%).
pub const PACKED_LOAD_PCT: usize = 85;

/// Slots (of all the tables a batch reads) above which a batched check
/// fetches into the second-level cache rather than the first, and fetches
/// `FAR_LINES` slot lines: 64 MiB of slots, about 3.4M entries at 85%
/// load. Measured in one process on this machine (AMD EPYC, 32 MiB of
/// L3), sealed batched hits: at 1M entries (19 MB of slots, mostly in L3)
/// the second-level fetch ran 0.84 to 0.89 times the rate of the
/// first-level one, at 2M 0.97, at 4M 1.12 and at 10M 1.38 to 1.45
/// (BENCHMARKS.md). Only speed depends on it.
pub const FAR_SLOTS: usize = (64 << 20) / 16;
/// Slot lines a batched check fetches ahead, into the first-level cache:
/// a hash past the second line would otherwise be a cache miss the lookup
/// waits for (sealed hits at 10M: 1.09 to 1.12 times the rate with two
/// lines, BENCHMARKS.md).
const NEAR_LINES: usize = 3;
/// Slot lines a batched check fetches ahead past `FAR_SLOTS`, into the
/// second-level cache, where lines past the third cost little and spare
/// the few hashes far from home a wait (sealed hits at 10M: four lines
/// 0.94 times the rate of five, three 0.87 times that of four, six no
/// faster than five).
const FAR_LINES: usize = 5;

/// The part of a hash that the table compares.
#[inline]
#[must_use]
pub fn key_of(h: u128) -> u128 {
    h & KEY_MASK
}

/// A hash with its tag, as a slot holds it.
#[inline]
#[must_use]
pub fn tagged(h: u128, tag: u32) -> u128 {
    key_of(h) | u128::from(tag) & TAG_MASK
}

/// The tag of an entry made by [`tagged`].
#[inline]
#[must_use]
pub fn tag_in(entry: u128) -> u32 {
    (entry & TAG_MASK) as u32
}

/// The tag of an epoch.
#[inline]
#[must_use]
pub fn tag_of(epoch: u64) -> u32 {
    (epoch & (TAG_SPAN - 1)) as u32
}

/// A set of uniform 128-bit hashes, each with a 24-bit tag: an ordered
/// linear-probing table.
///
/// A slot holds the hash's top 104 bits and the tag in the low 24 bits,
/// 16 bytes in all; 0 marks an empty slot, and the one key that would be
/// 0 is kept beside the slots. A hash's home slot is its top 64 bits
/// scaled to the number of home slots, so homes are monotone in the hash.
/// Invariants:
///
/// - the non-empty slots are in ascending order across the whole table,
///   and no two share a key;
/// - every entry sits at or after its home, with no empty slot between;
/// - the last slot is always empty, so a scan always ends.
///
/// A lookup starts at the home and scans while the slots hold smaller
/// keys: one cache miss and a few neighbours. An insert shifts the rest of
/// its cluster right by one.
///
/// In front of the slots sits a small Bloom filter, 6 bits a home slot in
/// one 64-bit word per lookup. The word is chosen by the home (so a batch
/// can fetch both at once), the three bits by the hash's middle bits. It
/// is about 1/20 of the table, so it mostly stays in the CPU cache, and
/// it answers about 19 lookups of an absent hash in 20 without touching
/// the slots: fresh records are the common case.
///
/// The table does not know which tags are live: [`FpTable::purge`] drops
/// the entries its caller no longer wants, in one in-place pass.
#[derive(Debug, Default)]
pub struct FpTable {
    slots: Slots,
    filter: Box<[u64]>,
    homes: usize,
    len: usize,
    /// The tag of the hash whose key is 0, if it is held.
    zero: Option<u32>,
    /// Whether the slots and filter were given huge-page advice
    /// ([`FpTable::settle_pages`]) since they were last laid out.
    huge: bool,
}

/// Filter words for `homes` home slots: 6 bits each.
fn filter_words(homes: usize) -> usize {
    (homes * 3 / 32).max(1)
}

/// The filter word of `h` among `words`, and the bits it sets there.
#[inline]
fn filter_bits(h: u128, words: usize) -> (usize, u64) {
    let word = ((u128::from((h >> 64) as u64) * words as u128) >> 64) as usize;
    let mid = (h >> TAG_BITS) as u64;
    let bits = (1u64 << (mid & 63)) | (1u64 << ((mid >> 6) & 63)) | (1u64 << ((mid >> 12) & 63));
    (word, bits)
}

/// The home slot of `h` in a table of `homes` home slots.
#[inline]
fn home_of(h: u128, homes: usize) -> usize {
    ((u128::from((h >> 64) as u64) * homes as u128) >> 64) as usize
}

/// Slots of a table with `homes` home slots: room past the last home for
/// clusters that spill over, and the always-empty last slot.
fn slots_for(homes: usize) -> usize {
    homes + homes / 512 + 32
}

/// Old slots whose entries a layout that moves them right places as one
/// block: it keeps only where each block's first entry may go, and works
/// out the places within a block again, into a buffer on the stack, as it
/// moves them.
const BLOCK: usize = 1024;

/// An empty filter for `homes` home slots. A large one is advised for
/// huge pages before it is first written, which costs no copy, as it is
/// never resized.
fn new_filter(homes: usize) -> Box<[u64]> {
    let filter = vec![0u64; filter_words(homes)].into_boxed_slice();
    advise_huge_pages(&filter);
    filter
}

/// Sets the filter bits of `h`.
#[inline]
fn mark(filter: &mut [u64], h: u128) {
    let (word, bits) = filter_bits(h, filter.len());
    filter[word] |= bits;
}

/// Lays out the entries held in `v` (ascending, with any number of empty
/// slots between them) over at least `homes` home slots, and fills a new
/// filter for them on the way. With `huge`, for a table that is then
/// mostly read, the slots are collapsed into huge pages once laid out
/// (the pages the kernel could not give huge when they were first
/// written). Returns the slots, the number of home slots used and the
/// filter.
///
/// The layout is canonical: each entry goes to `max(home, previous + 1)`.
/// A first pass works out which way the entries move, without storing
/// their places. When every entry moves right (a bigger table, or a
/// compact sorted vector), it is done in place: the array is extended
/// ([`Slots::resize`], which never copies a large one) and the entries are
/// moved from the last block down; a heap array that grows large is moved
/// into a mapping of its own instead ([`move_right`]). When every entry
/// moves left (a smaller table), it is done in place from the first one
/// up. Otherwise a new array is laid out.
fn lay_out(v: Slots, homes: usize, huge: bool) -> (Slots, usize, Box<[u64]>) {
    let (slots, homes, filter) = place(v, homes);
    if huge {
        collapse_huge_pages(&slots);
    }
    (slots, homes, filter)
}

/// [`lay_out`] but for the slots' huge pages.
fn place(mut v: Slots, homes: usize) -> (Slots, usize, Box<[u64]>) {
    let mut homes = homes.max(16);
    loop {
        let len = slots_for(homes);
        // Which way the entries move, and the first slot free for an
        // entry where each block of old slots begins.
        let (mut right, mut left) = (true, true);
        let mut starts = Vec::with_capacity(v.len().div_ceil(BLOCK));
        let mut next = 0;
        let fits = 'scan: {
            for (b, block) in v.chunks(BLOCK).enumerate() {
                starts.push(next);
                for (j, &h) in block.iter().enumerate() {
                    if h == 0 {
                        continue;
                    }
                    let q = b * BLOCK + j;
                    let at = home_of(h, homes).max(next);
                    // Keep the last slot empty; spill-over this long is rare.
                    if at + 1 >= len {
                        break 'scan false;
                    }
                    right &= at >= q;
                    left &= at <= q;
                    next = at + 1;
                }
            }
            true
        };
        if !fits {
            homes += homes / 8 + 16;
            continue;
        }
        let mut filter = new_filter(homes);
        if right && len >= v.len() && !v.resizes_in_place(len) {
            return (
                move_right(v.into_heap(), &starts, len, homes, &mut filter),
                homes,
                filter,
            );
        }
        if right && len >= v.len() {
            let old = v.len();
            v.resize(len);
            // Entries only move right, so those of a block land past the
            // old slots of the blocks before it: moved from the last block
            // down, every slot written to is free or already moved from.
            let mut places = [0usize; BLOCK];
            for (b, &start) in starts.iter().enumerate().rev() {
                let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(old));
                let mut next = start;
                let mut k = 0;
                for &h in &v[lo..hi] {
                    if h != 0 {
                        let at = home_of(h, homes).max(next);
                        places[k] = at;
                        k += 1;
                        next = at + 1;
                    }
                }
                for q in (lo..hi).rev() {
                    let h = v[q];
                    if h != 0 {
                        k -= 1;
                        let at = places[k];
                        mark(&mut filter, h);
                        if at != q {
                            v[at] = h;
                            v[q] = 0;
                        }
                    }
                }
            }
            return (v, homes, filter);
        }
        if left {
            // Every entry before `q` already sits before the place of the
            // one at `q`, so that place is free or already moved from.
            let mut next = 0;
            for q in 0..v.len() {
                let h = v[q];
                if h != 0 {
                    let at = home_of(h, homes).max(next);
                    mark(&mut filter, h);
                    if at != q {
                        v[at] = h;
                        v[q] = 0;
                    }
                    next = at + 1;
                }
            }
            v.resize(len);
            return (v, homes, filter);
        }
        let mut slots = Slots::zeroed(len);
        let mut next = 0;
        for &h in v.iter().filter(|&&s| s != 0) {
            let at = home_of(h, homes).max(next);
            slots[at] = h;
            mark(&mut filter, h);
            next = at + 1;
        }
        return (slots, homes, filter);
    }
}

/// Old blocks after which [`move_right`] gives back the part of the old
/// array it has moved: 64 MiB of slots (fewer in tests, which are
/// smaller).
const RELEASE_BLOCKS: usize = if cfg!(test) { 16 } else { 4096 };

/// The right-moving layout of [`place`] into a new array of `len` slots,
/// for a heap array that grows large enough for a mapping of its own.
/// It moves the entries from the last block down and gives back the old
/// array's tail as it goes (a `realloc` that shrinks a large allocation
/// unmaps its end), so that the two are not both whole at once.
fn move_right(
    mut v: Vec<u128>,
    starts: &[usize],
    len: usize,
    homes: usize,
    filter: &mut [u64],
) -> Slots {
    let mut slots = Slots::zeroed(len);
    let old = v.len();
    for (b, &start) in starts.iter().enumerate().rev() {
        let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(old));
        let mut next = start;
        for &h in &v[lo..hi] {
            if h != 0 {
                let at = home_of(h, homes).max(next);
                slots[at] = h;
                mark(filter, h);
                next = at + 1;
            }
        }
        if b % RELEASE_BLOCKS == 0 {
            v.truncate(lo);
            v.shrink_to_fit();
        }
    }
    slots
}

/// Asks the kernel to back a large array with 2 MiB pages, now, and to
/// give its pages not yet touched huge pages too. For arrays that are
/// never resized in place (the filters); the table's slots are
/// [`collapse_huge_pages`].
///
/// A lookup in a table of hundreds of megabytes touches a random page
/// each time; with 4 KiB pages nearly every one is also a TLB miss, which
/// a prefetch waits for too. `MADV_HUGEPAGE` marks the range, so that its
/// first writes get huge pages; `MADV_COLLAPSE` (Linux 6.1 and later)
/// moves the pages already touched into huge pages at once, one copy.
/// Elsewhere, or when the kernel says no, nothing changes but speed.
pub fn advise_huge_pages<T>(s: &[T]) {
    #[cfg(target_os = "linux")]
    madvise_huge(s, &[libc::MADV_HUGEPAGE, libc::MADV_COLLAPSE]);
    #[cfg(not(target_os = "linux"))]
    let _ = s;
}

/// [`advise_huge_pages`] for the table's slots: only `MADV_COLLAPSE`,
/// which moves the touched pages into huge pages without marking the
/// range. A large table's slots have a mapping of its own, marked as a
/// whole when it was made ([`Slots`]), so this only collapses the pages
/// the kernel could not give huge at their first write. (A mark on part
/// of a mapping splits it, and the kernel refuses to move a range that
/// spans several (`mremap` fails with `EFAULT`): when the slots were on
/// the heap, every growth after one copied the whole table,
/// BENCHMARKS.md.)
pub fn collapse_huge_pages<T>(s: &[T]) {
    #[cfg(target_os = "linux")]
    madvise_huge(s, &[libc::MADV_COLLAPSE]);
    #[cfg(not(target_os = "linux"))]
    let _ = s;
}

/// Gives `advice`, in turn, for the whole 2 MiB pages inside `s`, if it
/// is large enough to be worth it.
#[cfg(target_os = "linux")]
fn madvise_huge<T>(s: &[T], advice: &[libc::c_int]) {
    const HUGE: usize = 2 << 20;
    let bytes = std::mem::size_of_val(s);
    if bytes < 2 * HUGE {
        return;
    }
    let start = s.as_ptr() as usize;
    let from = start.div_ceil(HUGE) * HUGE;
    let to = (start + bytes) / HUGE * HUGE;
    if to > from {
        for &a in advice {
            // SAFETY: madvise only changes how the kernel backs these
            // pages, which lie inside the live allocation `s`; their
            // contents stay as they are. Errors are ignored: it is advice.
            unsafe {
                libc::madvise(from as *mut libc::c_void, to - from, a);
            }
        }
    }
}

/// Hints the CPU to fetch the cache line at `p`. A hint only: it never
/// faults, and without it the lookups are the same, only slower.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    prefetch_to::<false, T>(p);
}

/// [`prefetch`] into the first-level cache or, with `FAR`, into the
/// second-level cache only. A batched check over tables much larger than
/// the last-level cache has many more lines on their way than the first
/// level can track; on this machine (AMD EPYC) fetching them into the
/// second let sealed hits at 10M run 1.3 to 1.5 times as fast, misses the
/// same (BENCHMARKS.md). Reading the line later costs a second-level hit,
/// a few nanoseconds.
#[inline(always)]
pub fn prefetch_to<const FAR: bool, T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is a hint; it does not dereference `p` and
    // cannot fault, whatever the address. SSE is part of x86_64.
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T2, _mm_prefetch};
        if FAR {
            _mm_prefetch::<_MM_HINT_T2>(p.cast::<i8>());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A hash's filter word and bits in one table, worked out once for a
/// batched check: its stages (fetch the word, test it and fetch the slots,
/// look up) then share them. Valid while the table is not changed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Aim {
    key: u128,
    word: usize,
    bits: u64,
    /// Whether the filter lets the hash through, once tested.
    pass: bool,
}

/// What an insert found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Insert {
    /// The hash was added with the given tag, in a free slot.
    Added,
    /// The hash was added with the given tag, in the place of an entry
    /// whose tag `dead` accepted: the table holds no more entries.
    Replaced,
    /// The hash is there already, with this tag; nothing changed.
    Present(u32),
}

impl FpTable {
    /// The tag held with `h`, if the table holds it.
    #[inline]
    #[must_use]
    pub fn get(&self, h: u128) -> Option<u32> {
        let key = key_of(h);
        if key == 0 {
            return self.zero;
        }
        let (word, bits) = filter_bits(key, self.filter.len());
        if !self.lets_through(word, bits) {
            return None;
        }
        self.scan(key)
    }

    /// Number of slots, empty ones included.
    #[must_use]
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Whether the filter word `word` has all of `bits` set.
    #[inline]
    fn lets_through(&self, word: usize, bits: u64) -> bool {
        self.filter.get(word).is_some_and(|w| w & bits == bits)
    }

    /// The slot scan of [`FpTable::get`], past the filter.
    #[inline]
    fn scan(&self, key: u128) -> Option<u32> {
        let from = home_of(key, self.homes);
        for &s in self.slots.get(from..).unwrap_or_default() {
            if s == 0 || s >= key {
                return (s != 0 && s & KEY_MASK == key).then_some(tag_in(s));
            }
        }
        None
    }

    /// The filter word and bits of `h`, with its filter word fetched; with
    /// `FAR` (past `FAR_SLOTS`) into the second-level cache (sealed batched
    /// hits at 10M 1.07 times as fast as into the first, at 1M 0.99;
    /// misses the same).
    #[inline]
    pub fn aim<const FAR: bool>(&self, h: u128) -> Aim {
        let key = key_of(h);
        let (word, bits) = filter_bits(key, self.filter.len());
        if let Some(w) = self.filter.get(word) {
            prefetch_to::<FAR, _>(w);
        }
        Aim {
            key,
            word,
            bits,
            pass: false,
        }
    }

    /// Tests an aim's filter word (fetched by [`FpTable::aim`]) and, if it
    /// lets the hash through, fetches `NEAR_LINES` slot lines from its home
    /// on; with `FAR`, `FAR_LINES` lines into the second-level cache.
    #[inline]
    pub fn screen<const FAR: bool>(&self, a: &mut Aim) {
        a.pass = if a.key == 0 {
            self.zero.is_some()
        } else {
            self.lets_through(a.word, a.bits)
        };
        if a.pass {
            let lines = if FAR { FAR_LINES } else { NEAR_LINES };
            self.prefetch_slots::<FAR>(a.key, lines);
        }
    }

    /// [`FpTable::get`] for a screened aim: nothing is read again when the
    /// filter said no.
    #[inline]
    #[must_use]
    pub fn get_aimed(&self, a: &Aim) -> Option<u32> {
        if !a.pass {
            return None;
        }
        if a.key == 0 {
            return self.zero;
        }
        self.scan(a.key)
    }

    /// Fetches `lines` cache lines from the home slot of `h` on: the home
    /// slot's and the ones after it. A hash sits a few slots past its home
    /// in a full table, often across a line boundary (4 slots a line): at
    /// 85% load about 86% of hashes lie within two lines of the home slot's
    /// start and 96% within three. `FAR` as in [`prefetch_to`].
    #[inline(always)]
    pub fn prefetch_slots<const FAR: bool>(&self, h: u128, lines: usize) {
        let home = home_of(h, self.homes);
        for k in 0..lines {
            if let Some(s) = self.slots.get(home + 4 * k) {
                prefetch_to::<FAR, _>(s);
            }
        }
    }

    /// Adds `h` with `tag`, unless the table holds it already. An entry of
    /// `h` whose tag `dead` accepts is replaced (its epoch left the memory).
    pub fn insert(&mut self, h: u128, tag: u32, dead: impl Fn(u32) -> bool) -> Insert {
        self.insert_with::<false>(h, tag, dead)
    }

    /// [`FpTable::insert`] into a table that holds dead entries: the first
    /// one the insert's shift meets gives its slot.
    pub fn insert_reusing(&mut self, h: u128, tag: u32, dead: impl Fn(u32) -> bool) -> Insert {
        self.insert_with::<true>(h, tag, dead)
    }

    #[inline]
    fn insert_with<const REUSE: bool>(
        &mut self,
        h: u128,
        tag: u32,
        dead: impl Fn(u32) -> bool,
    ) -> Insert {
        let key = key_of(h);
        let entry = tagged(h, tag);
        if key == 0 {
            return match self.zero {
                Some(t) if !dead(t) => Insert::Present(t),
                was => {
                    self.zero = Some(tag);
                    if was.is_some() {
                        Insert::Replaced
                    } else {
                        Insert::Added
                    }
                }
            };
        }
        if (self.len + 1) * 100 > self.homes * MAX_LOAD_PCT {
            let grown = if self.homes < 4096 {
                (self.homes * 2).max(16)
            } else {
                self.homes + self.homes / 5
            };
            self.grow(grown);
        }
        loop {
            let from = home_of(key, self.homes);
            // The last slot is empty, so both scans find a slot.
            let i = from
                + self.slots[from..]
                    .iter()
                    .position(|&s| s >= key || s == 0)
                    .unwrap_or(0);
            let s = self.slots[i];
            if s != 0 && s & KEY_MASK == key {
                let t = tag_in(s);
                if !dead(t) {
                    return Insert::Present(t);
                }
                self.slots[i] = entry;
                return Insert::Replaced;
            }
            // The entries from `i` on move one slot right, up to the first
            // free slot or, with `REUSE`, the first dead entry, which is
            // overwritten: a table that drops epochs then reuses their
            // slots instead of growing until the next purge, and shifts
            // less. Each moved entry stays sorted and past its home, and
            // the cluster stays whole. The dead entry's filter bits stay
            // set, as they do until a purge.
            let end = self.slots[i..]
                .iter()
                .position(|&s| s == 0 || (REUSE && dead(tag_in(s))));
            match end.map(|e| i + e) {
                Some(j) if j + 1 < self.slots.len() => {
                    let reused = self.slots[j] != 0;
                    self.slots.copy_within(i..j, i + 1);
                    self.slots[i] = entry;
                    let (word, bits) = filter_bits(key, self.filter.len());
                    if let Some(w) = self.filter.get_mut(word) {
                        *w |= bits;
                    }
                    if reused {
                        return Insert::Replaced;
                    }
                    self.len += 1;
                    return Insert::Added;
                }
                // The cluster would take the last slot: grow, then retry.
                _ => self.grow(self.homes + self.homes / 5 + 16),
            }
        }
    }

    #[cfg(test)]
    /// Makes room for `additional` more hashes without growing.
    pub fn reserve(&mut self, additional: usize) {
        let need = (self.len + additional) * 100 / MAX_LOAD_PCT + 1;
        if need > self.homes {
            self.rebuild(need);
        }
    }

    #[cfg(test)]
    /// A table holding `entries`, each a hash with its tag (in any order),
    /// laid out `load_pct` full: a sort and one pass, much faster than
    /// inserting one by one into a large table. Of two entries with the
    /// same key, the one with the higher tag is kept.
    #[must_use]
    pub fn from_entries(entries: impl IntoIterator<Item = (u128, u32)>, load_pct: usize) -> Self {
        let v: Vec<u128> = entries.into_iter().map(|(h, t)| tagged(h, t)).collect();
        Self::from_tagged(v, load_pct)
    }

    /// [`FpTable::from_entries`] over entries already made by [`tagged`].
    #[must_use]
    pub fn from_tagged(mut v: Vec<u128>, load_pct: usize) -> Self {
        v.sort_unstable();
        // Sorted, equal keys are adjacent and the highest tag is last.
        v.dedup_by(|later, earlier| {
            let same = *later & KEY_MASK == *earlier & KEY_MASK;
            if same {
                *earlier = *later;
            }
            same
        });
        let mut zero = None;
        if v.first().is_some_and(|&s| s & KEY_MASK == 0) {
            zero = Some(tag_in(v.remove(0)));
        }
        let len = v.len();
        let (slots, homes, filter) = lay_out(Slots::from(v), len * 100 / load_pct + 1, true);
        FpTable {
            slots,
            filter,
            homes,
            len,
            zero,
            huge: true,
        }
    }

    /// Drops every entry whose tag `drop` accepts, then lays the table out
    /// again, one growth step emptier than `PACKED_LOAD_PCT` full, if it is
    /// much emptier than that. One pass over the slots, in place, and one
    /// over the filter. Returns the number of entries dropped.
    pub fn purge(&mut self, drop: impl Fn(u32) -> bool) -> usize {
        let before = self.len();
        if self.zero.is_some_and(&drop) {
            self.zero = None;
        }
        // Removing entries only moves the others left, towards their
        // homes, so one pass from the first slot up is safe: every slot
        // between `next` and the one read is already empty.
        let mut next = 0;
        let mut kept = 0;
        for q in 0..self.slots.len() {
            let s = self.slots[q];
            if s == 0 {
                continue;
            }
            self.slots[q] = 0;
            if drop(tag_in(s)) {
                continue;
            }
            let at = home_of(s, self.homes).max(next);
            self.slots[at] = s;
            next = at + 1;
            kept += 1;
        }
        self.len = kept;
        if self.is_empty() {
            *self = FpTable::default();
            return before;
        }
        // Purges come while the open epoch takes inserts. Laid out exactly
        // packed full, the table would grow again at its next insert, a
        // second pass over it; it gets the room of one growth step instead.
        let packed = kept * 100 / PACKED_LOAD_PCT + 1;
        let roomy = packed + packed / 5;
        if roomy * 4 < self.homes * 3 {
            self.grow(roomy);
        } else {
            self.refill();
        }
        before - self.len()
    }

    /// Lays the table out `PACKED_LOAD_PCT` full, if it is emptier.
    pub fn pack(&mut self) {
        let homes = self.len * 100 / PACKED_LOAD_PCT + 1;
        if homes < self.homes {
            self.rebuild(homes);
        }
    }

    /// Calls `f(hash_key, tag)` for every entry, in ascending key order
    /// (the key is the hash with its tag bits cleared).
    pub fn for_each(&self, mut f: impl FnMut(u128, u32)) {
        for (k, t) in self.iter() {
            f(k, t);
        }
    }

    /// Every entry as `(hash_key, tag)`, in ascending key order.
    pub fn iter(&self) -> impl Iterator<Item = (u128, u32)> + '_ {
        self.zero.map(|t| (0, t)).into_iter().chain(
            self.slots
                .iter()
                .filter(|&&s| s != 0)
                .map(|&s| (s & KEY_MASK, tag_in(s))),
        )
    }

    /// [`FpTable::rebuild`] for a table that grows under inserts or is
    /// purged: no collapse into huge pages, which would scan the table at
    /// every growth; [`FpTable::settle_pages`] does it once the epoch
    /// closes.
    fn grow(&mut self, homes: usize) {
        self.lay_out(homes, false);
    }

    /// Lays the slots out over `homes` home slots with a new filter, the
    /// old one freed first; on huge pages with `huge` ([`lay_out`]).
    fn lay_out(&mut self, homes: usize, huge: bool) {
        let slots = std::mem::take(&mut self.slots);
        self.filter = Box::default();
        (self.slots, self.homes, self.filter) = lay_out(slots, homes, huge);
        self.huge = huge;
    }

    /// Lays the entries out again over `homes` home slots (at least), for
    /// a table that is then mostly read: its pages are collapsed into huge
    /// pages.
    fn rebuild(&mut self, homes: usize) {
        self.lay_out(homes, true);
    }

    /// Sizes the filter for the home slots and sets every entry's bits.
    fn refill(&mut self) {
        self.filter = Box::default();
        let mut filter = new_filter(self.homes);
        for &h in self.slots.iter().filter(|&&s| s != 0) {
            mark(&mut filter, h);
        }
        self.filter = filter;
        self.huge = false;
    }

    /// Backs the slots and the filter with huge pages
    /// ([`collapse_huge_pages`], [`advise_huge_pages`]) if they were laid
    /// out since they last were: once per layout, not once per growth. A
    /// filter made while the table grows, and any slots the kernel gave
    /// small pages, are otherwise left on them for good, which slows every
    /// random lookup in a large table by a TLB miss (BENCHMARKS.md).
    pub fn settle_pages(&mut self) {
        if !self.huge {
            collapse_huge_pages(&self.slots);
            advise_huge_pages(&self.filter);
            self.huge = true;
        }
    }

    /// Whether [`FpTable::settle_pages`] has nothing left to do.
    #[cfg(test)]
    #[must_use]
    pub fn is_settled(&self) -> bool {
        self.huge
    }

    /// Number of entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Whether the table is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes held: the slots and the filter.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.slots.len() * 16 + self.filter.len() * 8
    }
}

#[cfg(test)]
mod test;
