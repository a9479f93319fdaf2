//! [`FpTable`]: one ordered linear-probing table of content hashes for all
//! the in-memory epochs of a lane, each entry tagged with its epoch, in
//! 12-byte slots.
//!
//! An entry keeps a hash in a 72-bit field beside an 8-bit distance from
//! its home and a 16-bit tag ([`Scale`] says how):
//!
//! - The hash's top 64 bits (`top`) are kept exactly: the product that
//!   places a hash (`top * homes`) gives its home in its high half, and
//!   in its low half a rest that grows with `top` within one home, by
//!   `homes` at least from one value to the next; so the rest's top
//!   `64 - s` bits (the offset, `s = floor(log2 homes)`) tell the values
//!   of a home apart, in order, and a division gives `top` back.
//! - The rest of the field keeps the leading bits of the hash's low 64
//!   bits, then a 1 (the end marker), then zeros: the lowest set bit says
//!   how many were kept. An entry made at scale `s` keeps `7 + s`; a
//!   rescale keeps what fits, never more than the entry had.
//! - Entries order by home, then offset (that is, by `top`); a lookup
//!   compares an entry's field with the query's only above the entry's
//!   marker.
//!
//! Two hashes are one identity in memory when they agree on the top 64
//! bits and on the leading low bits the entry kept: `71 + s` bits in all
//! for an entry made in a table of `2^s` homes or more. Of the entries a
//! table made at one scale, about `0.85 * 2^s`, a lookup falsely matches
//! one with a chance of about 0.85 * 2^-71, so a table grown from empty to
//! 1e9 entries (27 scales) gives at most about 2^-66.5 a lookup: at 1M
//! lookups a second, 8.4e-10 a day, within the design's bound of 1e-9 a
//! day. A table laid out from a recovery keeps all the bits of its own
//! scale. On disk an identity is the hash's top 104 bits ([`key_of`]).

mod slots;
use slots::Slots;

/// Low bits of a hash that are not part of its key: on disk, keys are the
/// top 104 bits ([`key_of`]), and an entry waiting to be placed
/// ([`tagged`]) holds its tag there. The table never reads them: it keeps
/// at most `7 + s` leading bits of the low half, fewer than 40 for any
/// table this machine could hold.
pub const LOW_BITS: u32 = 24;
const LOW_MASK: u128 = (1 << LOW_BITS) - 1;
const KEY_MASK: u128 = !LOW_MASK;

/// Bits of a slot that hold the entry's epoch tag (the epoch modulo 2^16).
pub const TAG_BITS: u32 = 16;
/// Tags are the epoch modulo this.
pub const TAG_SPAN: u64 = 1 << TAG_BITS;

/// Load, in percent of the homes, above which the table grows.
const MAX_LOAD_PCT: usize = 85;
/// Homes below which a table doubles when it grows; from there on it grows
/// by a fifth, which keeps a large table's memory near its entries. A
/// growth works out every entry's place again (a division an entry, in
/// each of two passes), so growth by a fifth from empty moves about six
/// times the final table's entries, and doubling about two. Below this size
/// (384 KiB of slots) a lane's table is cheap to hold half empty, and
/// growing from empty is most of what a short-lived or young lane spends
/// on its table (BENCHMARKS.md, "Growth by doubling up to 32,768 homes").
const DOUBLING_HOMES: usize = 1 << 15;
/// Load at which a table is laid out after a purge or a bulk load. Probes
/// get slower quickly above it (measured at 10M with 16-byte slots: about
/// 60 ns at 80%, 140 ns at 92%).
pub const PACKED_LOAD_PCT: usize = 85;

/// Slots (of all the tables a batch reads) above which a batched check
/// fetches into the second-level cache rather than the first, and fetches
/// `FAR_LINES` slot lines: 64 MiB of slots, about 4.8M entries at 85%
/// load. Measured in one process on this machine (AMD EPYC, 32 MiB of
/// L3) with 16-byte slots, sealed batched hits: at 1M entries (19 MB of
/// slots, mostly in L3) the second-level fetch ran 0.84 to 0.89 times the
/// rate of the first-level one, at 2M 0.97, at 4M 1.12 and at 10M 1.38 to
/// 1.45 (BENCHMARKS.md). Only speed depends on it.
pub const FAR_SLOTS: usize = (64 << 20) / SLOT;
/// Slot lines a batched check fetches ahead, into the first-level cache.
const NEAR_LINES: usize = 3;
/// Slot lines a batched check fetches ahead past `FAR_SLOTS`, into the
/// second-level cache, where lines past the third cost little and spare
/// the few hashes far from home a wait.
const FAR_LINES: usize = 5;

/// Slot lines an insert fetches ahead from its home into the first-level
/// cache. An insert reads from its home to the end of the cluster, which
/// in a rolling window's table (live entries and those below the floor,
/// up to 85%) often lies past the second line: with two lines alone, a
/// profile of 17 live epochs of 200,000 put 56% of the insert's samples
/// on the loads that look for that end. Only speed depends on this and
/// `INSERT_FAR_LINES` (BENCHMARKS.md, "Inserts that fetch the whole
/// cluster").
const INSERT_NEAR_LINES: usize = 2;
/// Slot lines past `INSERT_NEAR_LINES` that a batched insert fetches into
/// the second-level cache.
const INSERT_FAR_LINES: usize = 3;

/// Bytes of a slot.
const SLOT: usize = 12;

/// The part of a hash that is its identity on disk.
#[inline]
#[must_use]
pub fn key_of(h: u128) -> u128 {
    h & KEY_MASK
}

/// A hash with its tag in its low bits, as a lane keeps the entries that
/// wait to be placed.
#[inline]
#[must_use]
pub fn tagged(h: u128, tag: u32) -> u128 {
    key_of(h) | u128::from(tag) & LOW_MASK
}

/// The tag of an entry made by [`tagged`].
#[inline]
#[must_use]
pub fn tag_in(entry: u128) -> u32 {
    (entry & LOW_MASK) as u32
}

/// The tag of an epoch.
#[inline]
#[must_use]
pub fn tag_of(epoch: u64) -> u32 {
    (epoch & (TAG_SPAN - 1)) as u32
}

/// Bits of the field that holds an entry's hash.
pub const FIELD_BITS: u32 = 72;

/// A table's number of homes, and `s = floor(log2 homes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    homes: u64,
    s: u32,
    /// The reciprocal of `homes` shifted left until its top bit is set:
    /// `floor((2^128 - 1) / d) - 2^64`, for [`Scale::div`].
    recip: u64,
}

impl Scale {
    /// The scale of a table of `homes` homes: at least 16, as the table's,
    /// and below 2^57, so that a field's low `s + 8` bits (the kept low
    /// bits and the marker) fit in a 64-bit word.
    #[must_use]
    pub fn new(homes: u64) -> Self {
        debug_assert!(homes < 1 << 57, "{homes} homes");
        let homes = homes.max(16);
        let d = u128::from(homes << homes.leading_zeros());
        Scale {
            homes,
            s: 63 - homes.leading_zeros(),
            recip: (u128::MAX / d - (1 << 64)) as u64,
        }
    }

    /// Bits below the offset: the kept low bits, the marker and zeros.
    fn below(self) -> u32 {
        FIELD_BITS - (64 - self.s)
    }

    /// The home of a hash whose top 64 bits are `top`, as the table's.
    #[must_use]
    pub fn home(self, top: u64) -> u64 {
        self.home_rem(top).0
    }

    /// The home of `top` and the rest of the product that places it: the
    /// rests of one home's values grow with them, at least `homes` apart,
    /// so their top `64 - s` bits (the offset) tell them apart in order.
    #[inline]
    #[must_use]
    pub fn home_rem(self, top: u64) -> (u64, u64) {
        let p = u128::from(top) * u128::from(self.homes);
        ((p >> 64) as u64, p as u64)
    }

    /// The field of hash `hash` at this scale, with its home: every low
    /// bit that fits is kept (`7 + s`).
    #[inline]
    #[must_use]
    pub fn encode(self, hash: u128) -> (u64, u128) {
        let (home, rem) = self.home_rem((hash >> 64) as u64);
        let kept = self.below() - 1;
        let low = u128::from(hash as u64) >> (64 - kept);
        (
            home,
            u128::from(rem >> self.s) << self.below() | low << 1 | 1,
        )
    }

    /// The hash's top 64 bits, from an entry's home and field: the one
    /// multiple of `homes` among the products its offset allows, divided
    /// by `homes` (a division an entry, at a growth only).
    #[must_use]
    pub fn top(self, home: u64, field: u128) -> u64 {
        let low = u128::from(home) << 64 | (field >> self.below()) << self.s;
        let (q, r) = self.div(low);
        q + u64::from(r != 0)
    }

    /// `n / homes` and its remainder, for `n < homes * 2^64`: by the
    /// precomputed reciprocal, two multiplications and two corrections
    /// (Möller and Granlund's division by an invariant integer, 2011)
    /// instead of a 128-bit division.
    #[must_use]
    pub fn div(self, n: u128) -> (u64, u64) {
        let z = self.homes.leading_zeros();
        let d = self.homes << z;
        let n = n << z;
        let (u1, u0) = ((n >> 64) as u64, n as u64);
        let p = (u128::from(self.recip) * u128::from(u1))
            .wrapping_add(u128::from(u1 + 1) << 64 | u128::from(u0));
        let (mut q, low) = ((p >> 64) as u64, p as u64);
        let mut r = u0.wrapping_sub(q.wrapping_mul(d));
        if r > low {
            q = q.wrapping_sub(1);
            r = r.wrapping_add(d);
        }
        if r >= d {
            q += 1;
            r -= d;
        }
        (q, r >> z)
    }

    /// How many leading low bits of its hash an entry's field keeps, and
    /// those bits.
    #[must_use]
    pub fn kept(self, field: u128) -> (u32, u64) {
        let tz = field.trailing_zeros();
        let below = field & ((1u128 << self.below()) - 1);
        (self.below() - 1 - tz, (below >> (tz + 1)) as u64)
    }

    #[cfg(test)]
    /// The home and field of an entry of scale `self` at scale `to`: the
    /// same `top`, and the kept low bits that fit there.
    #[must_use]
    pub fn rescale(self, home: u64, field: u128, to: Scale) -> (u64, u128) {
        let (_, home, field) = self.rescaled(home, field, to);
        (home, field)
    }

    /// [`Scale::rescale`], with the entry's top 64 bits first (worked out
    /// on the way, by the one division).
    #[must_use]
    pub fn rescaled(self, home: u64, field: u128, to: Scale) -> (u64, u64, u128) {
        let top = self.top(home, field);
        let (kept, low) = self.kept(field);
        let fits = kept.min(to.below() - 1);
        let low = u128::from(low.checked_shr(kept - fits).unwrap_or(0));
        let (new_home, rem) = to.home_rem(top);
        let offset = u128::from(rem >> to.s);
        let marker = to.below() - 1 - fits;
        (
            top,
            new_home,
            offset << to.below() | low << (marker + 1) | 1u128 << marker,
        )
    }

    #[cfg(test)]
    /// Whether an entry's field stands for the query's full field (both at
    /// this scale, both at one home): equal offsets, and equal low bits as
    /// far as the entry kept them.
    #[must_use]
    pub fn matches(field: u128, query: u128) -> bool {
        // `field ^ (field - 1)`: the marker and every bit below it.
        (field ^ query) & !(field ^ field.wrapping_sub(1)) == 0
    }

    /// [`Scale::encode`] split as a slot holds it, on 64-bit words only:
    /// the home, the field's top 64 bits and its low 8 bits.
    #[inline]
    #[must_use]
    pub fn query(self, hash: u128) -> (usize, u64, u32) {
        let (home, rem) = self.home_rem((hash >> 64) as u64);
        let low = hash as u64;
        let mask = u64::MAX << self.s;
        let hi = (rem & mask) | low >> (64 - self.s);
        let lo8 = ((low >> (57 - self.s)) as u32 & 0x7f) << 1 | 1;
        (home as usize, hi, lo8)
    }

    #[cfg(test)]
    /// The offset part of a field, which orders entries of one home.
    #[must_use]
    pub fn offset(self, field: u128) -> u64 {
        (field >> self.below()) as u64
    }
}

/// Filter words for `homes` homes: 6 bits each.
fn filter_words(homes: usize) -> usize {
    (homes * 3 / 32).max(1)
}

/// The filter word and bits of a hash whose top 64 bits are `top`: the
/// word from its high bits, and the three bits from its low 18, which
/// every entry keeps exactly, so that a layout can fill a new filter from
/// the fields alone.
#[inline]
fn filter_bits(top: u64, words: usize) -> (usize, u64) {
    let word = ((u128::from(top) * words as u128) >> 64) as usize;
    let bits = (1u64 << (top & 63)) | (1u64 << ((top >> 6) & 63)) | (1u64 << ((top >> 12) & 63));
    (word, bits)
}

/// Slots of a table with `homes` homes: room past the last home for
/// clusters that spill over, and the always-empty last slot.
fn slots_for(homes: usize) -> usize {
    homes + homes / 512 + 32
}

/// An empty filter for `homes` homes. A large one is advised for huge
/// pages before it is first written, which costs no copy, as it is never
/// resized.
fn new_filter(homes: usize) -> Box<[u64]> {
    let filter = vec![0u64; filter_words(homes)].into_boxed_slice();
    advise_huge_pages(&filter);
    filter
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

/// A hash's stages in a batched lookup, worked out once: its filter word
/// and bits, then (once screened) its home and query field. Its stages
/// (fetch the word, test it and fetch the slots, look up) share them.
/// Valid while the table is not changed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Aim {
    hash: u128,
    word: usize,
    bits: u64,
    /// Whether the filter lets the hash through, once tested.
    pass: bool,
    home: usize,
    qhi: u64,
    q8: u32,
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

/// A slot's 64-bit and 32-bit words.
#[inline]
fn halves(w: &[u8; SLOT]) -> (u64, u32) {
    let (hi, lo) = w.split_at(8);
    (
        u64::from_le_bytes(hi.try_into().unwrap_or_default()),
        u32::from_le_bytes(lo.try_into().unwrap_or_default()),
    )
}

/// Whether a slot's entry (its words `hi` and `lo`) stands for the query
/// split as `qhi` and `q8`, their offsets (the bits of `mask`) being equal:
/// the field's low `s + 8` bits, on one 64-bit word, agree above the
/// entry's marker (`e ^ (e - 1)` is the marker and every bit below it).
#[inline(always)]
fn low_bits_match(hi: u64, lo: u32, qhi: u64, q8: u32, mask: u64) -> bool {
    let e = (hi & !mask) << 8 | u64::from(lo >> 24);
    let q = (qhi & !mask) << 8 | u64::from(q8);
    (e ^ q) & !(e ^ e.wrapping_sub(1)) == 0
}

/// The most slots an entry may sit past its home (its distance plus one
/// fits a byte, and 0 marks an empty slot).
const MAX_DIST: usize = 254;

/// 16-byte units of [`Slots`] that hold `n` slots.
fn units(n: usize) -> usize {
    (n * SLOT).div_ceil(16)
}

/// Whether a layout cannot put an entry whose home is `home` at `place`
/// in a table of `slots` slots: too far from home, or in the last slot,
/// which stays empty.
#[inline]
fn out_of_reach(place: usize, home: usize, slots: usize) -> bool {
    place - home > MAX_DIST || place + 1 >= slots
}

/// Layouts that grow the table for an entry that does not fit before it
/// goes to the stash instead.
const LAYOUT_TRIES: u32 = 2;

/// An entry kept beside the slots, with the bits of its hash its slot
/// kept (or, from an insert, the 40 leading low bits): one that could not
/// sit within `MAX_DIST` of its home. Uniform hashes never need it; it is
/// there so that hundreds of hashes that share their top bits (from a
/// weak or a hostile source) cost a scan of the stash instead of growing
/// the table without end.
#[derive(Clone, Copy, Debug)]
struct Stashed {
    top: u64,
    kept: u32,
    low: u64,
    tag: u32,
}

impl Stashed {
    /// The entry of `hash` with `tag`, made by an insert.
    fn of_hash(hash: u128, tag: u32) -> Self {
        let kept = 64 - LOW_BITS;
        Stashed {
            top: (hash >> 64) as u64,
            kept,
            low: (hash as u64) >> (64 - kept),
            tag,
        }
    }

    /// The entry of the field `f` at `home` of scale `from`.
    fn of_field(from: Scale, home: usize, f: u128, tag: u32) -> Self {
        let (kept, low) = from.kept(f);
        Stashed {
            top: from.top(home as u64, f),
            kept,
            low,
            tag,
        }
    }

    /// Whether it stands for `hash`: the same top 64 bits, and the same
    /// leading low bits as far as it kept them.
    fn holds(&self, hash: u128) -> bool {
        self.top == (hash >> 64) as u64
            && (hash as u64).checked_shr(64 - self.kept).unwrap_or(0) == self.low
    }
}

/// A set of uniform 128-bit hashes, each with a 16-bit tag: an ordered
/// linear-probing table of 12-byte slots.
///
/// A slot holds, little-endian, the field's top 64 bits, then a 32-bit
/// word of the field's low 8 bits, the distance from home plus one (8
/// bits) and the tag (16 bits); an empty slot is all zeros. A hash's home
/// is its top 64 bits scaled to the number of homes, so homes are
/// monotone in the hash. Invariants:
///
/// - the entries are in ascending (home, offset) order across the whole
///   table, and no two stand for one hash;
/// - every entry sits at or after its home, at most `MAX_DIST` past it,
///   with no empty slot between;
/// - the last slot is always empty, so a scan always ends.
///
/// A lookup starts at the home and scans while the slots hold smaller
/// keys: one cache miss and a few neighbours. An insert shifts the rest of
/// its cluster right by one.
///
/// In front of the slots sits a small Bloom filter, 6 bits a home in one
/// 64-bit word per lookup, the word chosen by the hash's top bits and the
/// three bits by its lowest 18 top bits. It is about 1/16 of the table,
/// so it mostly stays in the CPU cache, and it answers about 19 lookups
/// of an absent hash in 20 without touching the slots: fresh records are
/// the common case.
///
/// The table does not know which tags are live: [`FpTable::purge`] drops
/// the entries its caller no longer wants, in one in-place pass.
#[derive(Debug)]
pub struct FpTable {
    /// The slots, in 16-byte units ([`Slots`]: in place as it grows, on
    /// huge pages once large).
    raw: Slots,
    /// Slots in `raw`.
    n: usize,
    filter: Box<[u64]>,
    scale: Scale,
    /// Entries in the slots.
    len: usize,
    /// Entries no layout could place within `MAX_DIST` of their homes.
    stash: Vec<Stashed>,
    /// Entries dropped by purges since the filter was filled, whose bits
    /// it still has.
    stale: usize,
    /// Whether the slots and filter were given huge-page advice
    /// ([`FpTable::settle_pages`]) since they were last laid out.
    huge: bool,
}

impl Default for FpTable {
    /// An empty table that holds no memory until its first insert.
    fn default() -> Self {
        FpTable {
            raw: Slots::default(),
            n: 0,
            filter: Box::default(),
            scale: Scale::new(16),
            len: 0,
            stash: Vec::new(),
            stale: 0,
            huge: false,
        }
    }
}

impl FpTable {
    fn with_homes(homes: usize) -> Self {
        let n = slots_for(homes);
        FpTable {
            raw: Slots::zeroed(units(n)),
            n,
            filter: new_filter(homes),
            scale: Scale::new(homes as u64),
            len: 0,
            stash: Vec::new(),
            stale: 0,
            huge: false,
        }
    }

    /// The slots.
    #[inline]
    fn words(&self) -> &[[u8; SLOT]] {
        // SAFETY: `raw` holds `units(n) * 16 >= n * SLOT` initialized
        // bytes, owned by `self`, and `[u8; SLOT]` has alignment 1.
        unsafe { std::slice::from_raw_parts(self.raw.as_ptr().cast(), self.n) }
    }

    /// The slots, to write.
    #[inline]
    fn words_mut(&mut self) -> &mut [[u8; SLOT]] {
        // SAFETY: as in `words`, and `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.raw.as_mut_ptr().cast(), self.n) }
    }

    /// The field, distance and tag of slot `i` (field 0: empty).
    #[inline]
    fn slot(&self, i: usize) -> (u128, usize, u32) {
        let (hi, lo) = halves(&self.words()[i]);
        if lo == 0 {
            return (0, 0, 0);
        }
        (
            u128::from(hi) << 8 | u128::from(lo >> 24),
            ((lo >> 16) & 0xff) as usize - 1,
            lo & 0xffff,
        )
    }

    #[inline]
    fn put(&mut self, i: usize, field: u128, dist: usize, tag: u32) {
        let hi = (field >> 8) as u64;
        let lo = ((field & 0xff) as u32) << 24 | (dist as u32 + 1) << 16 | (tag & 0xffff);
        let w = &mut self.words_mut()[i];
        w[..8].copy_from_slice(&hi.to_le_bytes());
        w[8..].copy_from_slice(&lo.to_le_bytes());
    }

    /// Sets the filter bits of a hash whose top 64 bits are `top`.
    #[inline]
    fn mark(&mut self, top: u64) {
        let (word, bits) = filter_bits(top, self.filter.len());
        if let Some(w) = self.filter.get_mut(word) {
            *w |= bits;
        }
    }

    /// The tag held with `hash`, if the table holds it.
    #[inline]
    #[must_use]
    pub fn get(&self, hash: u128) -> Option<u32> {
        if !self.stash.is_empty() {
            return self.stash_tag(hash).or_else(|| self.get_in_slots(hash));
        }
        self.get_in_slots(hash)
    }

    /// [`FpTable::get`] in the slots alone.
    #[inline]
    fn get_in_slots(&self, hash: u128) -> Option<u32> {
        let (word, bits) = filter_bits((hash >> 64) as u64, self.filter.len());
        if !self.lets_through(word, bits) {
            return None;
        }
        let (home, qhi, q8) = self.scale.query(hash);
        self.scan(home, qhi, q8)
    }

    /// The tag of the stash's entry of `hash`, if it is there.
    fn stash_tag(&self, hash: u128) -> Option<u32> {
        self.stashed(hash).map(|i| self.stash[i].tag)
    }

    /// The place in the stash of the entry of `hash`, if it is there.
    #[cold]
    #[inline(never)]
    fn stashed(&self, hash: u128) -> Option<usize> {
        self.stash.iter().position(|s| s.holds(hash))
    }

    /// Whether the filter word `word` has all of `bits` set.
    #[inline]
    fn lets_through(&self, word: usize, bits: u64) -> bool {
        self.filter.get(word).is_some_and(|w| w & bits == bits)
    }

    /// Number of slots, empty ones included.
    #[must_use]
    pub fn slot_count(&self) -> usize {
        self.n
    }

    /// The scan of a lookup from `home` for the query field split as
    /// `qhi`, `q8`: each slot's entry is ordered by its home and offset as
    /// one 128-bit key (an empty slot's home is one past it, so it ends
    /// the run), one test a slot; the field's low bits are compared only
    /// at an equal key.
    #[inline]
    fn scan(&self, home: usize, qhi: u64, q8: u32) -> Option<u32> {
        let mask = u64::MAX << self.scale.s;
        let qkey = (home as u128) << 64 | u128::from(qhi & mask);
        for (k, w) in self
            .words()
            .get(home..)
            .unwrap_or_default()
            .iter()
            .enumerate()
        {
            let (hi, lo) = halves(w);
            let e = ((lo >> 16) & 0xff) as usize;
            let key = ((home + k + 1 - e) as u128) << 64 | u128::from(hi & mask);
            if key >= qkey {
                if key != qkey {
                    return None;
                }
                // Equal keys have equal offsets, so only the field's low
                // `s + 8` bits are left to compare.
                if low_bits_match(hi, lo, qhi, q8, mask) {
                    return Some(lo & 0xffff);
                }
            }
        }
        None
    }

    /// The filter word and bits of `hash`, with its filter word fetched;
    /// with `FAR` (past `FAR_SLOTS`) into the second-level cache.
    #[inline]
    pub fn aim<const FAR: bool>(&self, hash: u128) -> Aim {
        let (word, bits) = filter_bits((hash >> 64) as u64, self.filter.len());
        if let Some(w) = self.filter.get(word) {
            prefetch_to::<FAR, _>(w);
        }
        Aim {
            hash,
            word,
            bits,
            ..Aim::default()
        }
    }

    /// Tests an aim's filter word (fetched by [`FpTable::aim`]) and, if it
    /// lets the hash through, works out its home and query field and
    /// fetches `NEAR_LINES` slot lines from its home on; with `FAR`,
    /// `FAR_LINES` lines into the second-level cache.
    #[inline]
    pub fn screen<const FAR: bool>(&self, a: &mut Aim) {
        a.pass = self.lets_through(a.word, a.bits);
        if a.pass {
            (a.home, a.qhi, a.q8) = self.scale.query(a.hash);
            let lines = if FAR { FAR_LINES } else { NEAR_LINES };
            self.prefetch_lines::<FAR>(a.home, 0, lines);
        }
    }

    /// [`FpTable::get`] for a screened aim: nothing is read again when the
    /// filter said no.
    #[inline]
    #[must_use]
    pub fn get_aimed(&self, a: &Aim) -> Option<u32> {
        if !self.stash.is_empty()
            && let Some(t) = self.stash_tag(a.hash)
        {
            return Some(t);
        }
        if !a.pass {
            return None;
        }
        self.scan(a.home, a.qhi, a.q8)
    }

    /// Fetches the slot lines an insert of `hash` will read and write:
    /// `INSERT_NEAR_LINES` from its home on into the first-level cache
    /// and, with `ALL`, `INSERT_FAR_LINES` more into the second-level
    /// cache. A batch of records fetches them all. One call a record
    /// fetches the near lines only: with the far ones too, a table that
    /// fits in the caches (one live epoch of 200,000) took longer.
    #[inline(always)]
    pub fn prefetch_insert<const ALL: bool>(&self, hash: u128) {
        let home = self.scale.home((hash >> 64) as u64) as usize;
        self.prefetch_lines::<false>(home, 0, INSERT_NEAR_LINES);
        if ALL {
            self.prefetch_lines::<true>(
                home,
                INSERT_NEAR_LINES,
                INSERT_NEAR_LINES + INSERT_FAR_LINES,
            );
        }
    }

    /// Fetches the cache lines `from..to` counted from the home's slot.
    /// `FAR` as in [`prefetch_to`].
    #[inline(always)]
    fn prefetch_lines<const FAR: bool>(&self, home: usize, from: usize, to: usize) {
        if let Some(w) = self.words().get(home..) {
            let bytes = w.len() * SLOT;
            let at = w.as_ptr().cast::<u8>();
            for k in from..to {
                if 64 * k < bytes {
                    prefetch_to::<FAR, _>(at.wrapping_add(64 * k));
                }
            }
        }
    }

    /// Adds `hash` with `tag`, unless the table holds it already. An entry
    /// of `hash` whose tag `dead` accepts is replaced (its epoch left the
    /// memory).
    pub fn insert(&mut self, hash: u128, tag: u32, dead: impl Fn(u32) -> bool) -> Insert {
        self.insert_with::<false>(hash, tag, dead)
    }

    /// [`FpTable::insert`] into a table that holds dead entries: the first
    /// one the insert's shift meets gives its slot.
    pub fn insert_reusing(&mut self, hash: u128, tag: u32, dead: impl Fn(u32) -> bool) -> Insert {
        self.insert_with::<true>(hash, tag, dead)
    }

    #[inline]
    fn insert_with<const REUSE: bool>(
        &mut self,
        hash: u128,
        tag: u32,
        dead: impl Fn(u32) -> bool,
    ) -> Insert {
        if !self.stash.is_empty()
            && let Some(i) = self.stashed(hash)
        {
            let t = self.stash[i].tag;
            if !dead(t) {
                return Insert::Present(t);
            }
            self.stash[i].tag = tag;
            return Insert::Replaced;
        }
        let homes = self.scale.homes as usize;
        if self.n == 0 || (self.len + 1) * 100 > homes * MAX_LOAD_PCT {
            self.grow(if homes < DOUBLING_HOMES {
                homes * 2
            } else {
                homes + homes / 5
            });
        }
        loop {
            // The scan of a lookup: `i` ends at the first entry ordered
            // after the hash, or an empty slot.
            let (home, qhi, q8) = self.scale.query(hash);
            let mask = u64::MAX << self.scale.s;
            let qkey = (home as u128) << 64 | u128::from(qhi & mask);
            let mut i = home;
            loop {
                let (hi, lo) = halves(&self.words()[i]);
                let e = ((lo >> 16) & 0xff) as usize;
                let key = ((i + 1 - e) as u128) << 64 | u128::from(hi & mask);
                if key > qkey {
                    break;
                }
                if key == qkey && low_bits_match(hi, lo, qhi, q8, mask) {
                    let t = lo & 0xffff;
                    if !dead(t) {
                        return Insert::Present(t);
                    }
                    let lo = (lo & !0xffff) | (tag & 0xffff);
                    self.words_mut()[i][8..].copy_from_slice(&lo.to_le_bytes());
                    return Insert::Replaced;
                }
                i += 1;
            }
            // The entries from `i` move one slot right, up to the first
            // empty slot or, with `REUSE`, the first dead entry, which is
            // overwritten: a table that drops epochs then reuses their
            // slots instead of growing until the next purge, and shifts
            // less. Each moved entry stays in order, one slot further from
            // its home, and the cluster stays whole. A dead entry's
            // filter bits stay set, as they do until a purge.
            let mut end = i;
            let mut fits = i - home <= MAX_DIST;
            loop {
                let (_, lo) = halves(&self.words()[end]);
                if lo == 0 || (REUSE && dead(lo & 0xffff)) {
                    break;
                }
                fits &= ((lo >> 16) & 0xff) as usize <= MAX_DIST;
                end += 1;
            }
            if !fits || end + 1 >= self.n {
                // The cluster would take the last slot, or an entry would
                // sit too far from home: grow, then retry; but a table
                // this sparse would not place it by growing.
                let homes = self.scale.homes as usize;
                if self.len * 100 < homes * 60 {
                    self.stash.push(Stashed::of_hash(hash, tag));
                    return Insert::Added;
                }
                self.grow(homes + homes / 5 + 16);
                continue;
            }
            let reused = halves(&self.words()[end]).1 != 0;
            let words = self.words_mut();
            words.copy_within(i..end, i + 1);
            for w in &mut words[i + 1..=end] {
                // The distance plus one, in byte 10.
                w[10] += 1;
            }
            let lo = q8 << 24 | ((i - home + 1) as u32) << 16 | (tag & 0xffff);
            words[i][..8].copy_from_slice(&qhi.to_le_bytes());
            words[i][8..].copy_from_slice(&lo.to_le_bytes());
            self.mark((hash >> 64) as u64);
            if reused {
                return Insert::Replaced;
            }
            self.len += 1;
            return Insert::Added;
        }
    }

    /// Drops every entry whose tag `drop` accepts, moving the others left
    /// towards their homes in one pass. Then, if the table is much larger
    /// than `PACKED_LOAD_PCT` full with room for `room` more entries, it
    /// is laid out that full; otherwise the filter is refilled, once the
    /// entries dropped since it was filled are a quarter of those kept
    /// (until then their bits only let a few more absent hashes through
    /// to the slots). Returns the entries dropped.
    pub fn purge(&mut self, drop: impl Fn(u32) -> bool, room: usize) -> usize {
        let before = self.len();
        // Removing entries only moves the others left, towards their
        // homes, so one pass from the first slot up is safe: every slot
        // between `next` and the one read is already empty.
        let (mut next, mut kept) = (0, 0);
        for j in 0..self.n {
            let (f, d, t) = self.slot(j);
            if f == 0 {
                continue;
            }
            if drop(t) {
                self.words_mut()[j] = [0; SLOT];
                continue;
            }
            let home = j - d;
            let at = home.max(next);
            // An entry that stays is not written: most do.
            if at != j {
                self.words_mut()[j] = [0; SLOT];
                self.put(at, f, at - home, t);
            }
            next = at + 1;
            kept += 1;
        }
        self.len = kept;
        self.stash.retain(|e| !drop(e.tag));
        self.huge = false;
        let want = ((kept + room) * 100 / PACKED_LOAD_PCT + 1).max(16);
        if self.is_empty() {
            *self = if room == 0 {
                FpTable::default()
            } else {
                FpTable::with_homes(want)
            };
            return before;
        }
        self.stale += before - self.len();
        if want * 4 < self.scale.homes as usize * 3 {
            self.grow(want);
        } else if self.stale * 4 > self.len() {
            // The dropped entries' filter bits go: a division an entry
            // gives each kept entry's top bits back.
            self.filter = Box::default();
            let mut filter = new_filter(self.scale.homes as usize);
            for j in 0..self.n {
                let (f, d, _) = self.slot(j);
                if f != 0 {
                    let (word, bits) = filter_bits(self.scale.top((j - d) as u64, f), filter.len());
                    filter[word] |= bits;
                }
            }
            self.filter = filter;
            self.stale = 0;
        }
        before - self.len()
    }

    /// Lays the entries out over `homes` homes, each rescaled and placed
    /// at `max(home, previous + 1)`, with a new filter filled from their
    /// exact top bits: in place for more homes where the slots can grow
    /// without a copy, on a new array otherwise.
    fn grow(&mut self, homes: usize) {
        self.huge = false;
        if homes > self.scale.homes as usize && self.raw.resizes_in_place(units(slots_for(homes))) {
            self.grow_in_place(homes);
        } else {
            self.lay_out_copy(homes);
        }
    }

    /// [`FpTable::grow`] for more homes, in the same array, lengthened. An
    /// entry's home only moves right as the homes grow, and so does its
    /// place; so the entries are moved from the last one down, a block of
    /// old slots at a time. The first pass, from the first slot up, keeps
    /// only where each block starts placing (and checks that every entry
    /// fits); the second works each block's places out again into a
    /// buffer, clears the block's old slots and writes them.
    fn grow_in_place(&mut self, homes: usize) {
        const BLOCK: usize = 1024;
        let from = self.scale;
        let old = self.n;
        let mut homes = homes;
        let mut tries = 0;
        let starts = 'again: loop {
            let to = Scale::new(homes as u64);
            let n = slots_for(homes);
            let mut starts = Vec::with_capacity(old / BLOCK + 1);
            let mut at = 0;
            for j in 0..old {
                if j % BLOCK == 0 {
                    starts.push(at);
                }
                let (f, d, _) = self.slot(j);
                if f == 0 {
                    continue;
                }
                let (_, h, _) = from.rescaled((j - d) as u64, f, to);
                let h = h as usize;
                let place = h.max(at);
                if out_of_reach(place, h, n) {
                    if tries < LAYOUT_TRIES {
                        tries += 1;
                        homes += homes / 8 + 16;
                        continue 'again;
                    }
                    // The second pass stashes it.
                    continue;
                }
                at = place + 1;
            }
            break starts;
        };
        let to = Scale::new(homes as u64);
        let n = slots_for(homes);
        self.raw.resize(units(n));
        self.n = n;
        self.filter = Box::default();
        let mut filter = new_filter(homes);
        let mut buf = Vec::with_capacity(BLOCK);
        for (b, &start) in starts.iter().enumerate().rev() {
            let (lo, hi) = (b * BLOCK, ((b + 1) * BLOCK).min(old));
            buf.clear();
            let mut at = start;
            for j in lo..hi {
                let (f, d, t) = self.slot(j);
                if f == 0 {
                    continue;
                }
                let (top, h, nf) = from.rescaled((j - d) as u64, f, to);
                let h = h as usize;
                let place = h.max(at);
                if out_of_reach(place, h, n) {
                    self.stash.push(Stashed::of_field(from, j - d, f, t));
                    self.len -= 1;
                    continue;
                }
                debug_assert!(place >= j, "an entry would move left: {j} to {place}");
                buf.push((place, nf, place - h, t));
                let (word, bits) = filter_bits(top, filter.len());
                filter[word] |= bits;
                at = place + 1;
            }
            // The later blocks' entries all sit past this block's old
            // slots and past its new places.
            self.words_mut()[lo..hi].fill([0; SLOT]);
            for &(place, nf, d, t) in &buf {
                self.put(place, nf, d, t);
            }
        }
        self.filter = filter;
        self.stale = 0;
        self.scale = to;
    }

    /// [`FpTable::grow`] on a new array.
    fn lay_out_copy(&mut self, homes: usize) {
        let mut homes = homes;
        let mut tries = 0;
        'again: loop {
            let to = Scale::new(homes as u64);
            let mut next = FpTable::with_homes(homes);
            let mut at = 0;
            for j in 0..self.n {
                let (f, d, t) = self.slot(j);
                if f == 0 {
                    continue;
                }
                let (top, h, nf) = self.scale.rescaled((j - d) as u64, f, to);
                let h = h as usize;
                let place = h.max(at);
                if out_of_reach(place, h, next.n) {
                    if tries < LAYOUT_TRIES {
                        tries += 1;
                        homes += homes / 8 + 16;
                        continue 'again;
                    }
                    next.stash.push(Stashed::of_field(self.scale, j - d, f, t));
                    continue;
                }
                next.put(place, nf, place - h, t);
                next.mark(top);
                next.len += 1;
                at = place + 1;
            }
            next.stash.append(&mut self.stash);
            *self = next;
            return;
        }
    }

    /// A table holding `entries` (hashes with their tags, in any order),
    /// laid out `load_pct` full in one pass after a sort: every entry
    /// keeps all the low bits its scale has room for. Of two entries of
    /// one hash, the one with the higher tag is kept.
    #[must_use]
    #[cfg(test)]
    pub fn from_entries(mut entries: Vec<(u128, u32)>, load_pct: usize) -> Self {
        entries.sort_unstable();
        super::keep_last_of_each_key(&mut entries);
        Self::from_sorted(entries, load_pct)
    }

    /// [`FpTable::from_entries`] of entries sorted by hash, one a hash.
    #[must_use]
    pub fn from_sorted(entries: Vec<(u128, u32)>, load_pct: usize) -> Self {
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0), "unsorted");
        let mut homes = (entries.len() * 100 / load_pct + 1).max(16);
        let mut tries = 0;
        'again: loop {
            let mut t = FpTable::with_homes(homes);
            let mut at = 0;
            for &(hash, tag) in &entries {
                let (home, field) = t.scale.encode(hash);
                let home = home as usize;
                let place = home.max(at);
                if out_of_reach(place, home, t.n) {
                    if tries < LAYOUT_TRIES {
                        tries += 1;
                        homes += homes / 8 + 16;
                        continue 'again;
                    }
                    t.stash.push(Stashed::of_hash(hash, tag));
                    continue;
                }
                t.put(place, field, place - home, tag);
                t.mark((hash >> 64) as u64);
                t.len += 1;
                at = place + 1;
            }
            t.settle_pages();
            return t;
        }
    }

    /// Lays the table out `PACKED_LOAD_PCT` full, if it is emptier: the
    /// entries keep the low bits the smaller scale has room for.
    pub fn pack(&mut self) {
        let homes = self.len * 100 / PACKED_LOAD_PCT + 1;
        if homes < self.scale.homes as usize {
            self.grow(homes.max(16));
        }
    }

    /// Backs the slots and the filter with huge pages
    /// ([`collapse_huge_pages`], [`advise_huge_pages`]) if they were laid
    /// out since they last were: once per layout, not once per growth. A
    /// filter made while the table grows, and any slots the kernel gave
    /// small pages, are otherwise left on them for good, which slows every
    /// random lookup in a large table by a TLB miss (BENCHMARKS.md).
    pub fn settle_pages(&mut self) {
        if !self.huge {
            collapse_huge_pages(&self.raw);
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
        self.len + self.stash.len()
    }

    /// Whether the table is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes held: the slots and the filter.
    #[must_use]
    pub fn memory_bytes(&self) -> usize {
        self.raw.len() * 16
            + self.filter.len() * 8
            + self.stash.capacity() * std::mem::size_of::<Stashed>()
    }
}

#[cfg(test)]
mod test;
