use proptest::prelude::*;

use super::*;

impl FpTable {
    /// Checks the invariants the lookups rely on.
    fn check_invariants(&self) {
        let mut prev: Option<(usize, u64, u128)> = None;
        let mut count = 0;
        for i in 0..self.n {
            let (f, d, _) = self.slot(i);
            if f == 0 {
                continue;
            }
            count += 1;
            let home = i - d;
            assert!(d <= MAX_DIST, "slot {i} {d} past its home");
            let key = (home, self.scale.offset(f), f);
            if let Some(p) = prev {
                assert!((p.0, p.1) <= (key.0, key.1), "slot {i} out of order");
                assert!(p != key, "slot {i} repeats an entry");
            }
            prev = Some(key);
            assert!(
                (home..i).all(|j| self.slot(j).0 != 0),
                "gap between home {home} and slot {i}"
            );
            let (word, bits) = filter_bits(self.scale.top(home as u64, f), self.filter.len());
            assert_eq!(self.filter[word] & bits, bits, "filter misses slot {i}");
        }
        assert_eq!(count, self.len);
        assert_eq!(self.slot(self.n - 1).0, 0, "last slot used");
        assert_eq!(self.filter.len(), filter_words(self.scale.homes as usize));
    }
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn never(_: u32) -> bool {
    false
}

fn added(t: &mut FpTable, h: u128) -> bool {
    add(t, h, 1)
}

fn add(t: &mut FpTable, h: u128, tag: u32) -> bool {
    t.insert(h, tag, never) == Insert::Added
}

#[test]
fn table_stays_within_its_memory_bound_while_growing() {
    // A small table doubles, so it may be half empty: at most twice the
    // bound of a large one, which grows by a fifth.
    let mut t = FpTable::default();
    let mut doubled = 0;
    for i in 0..300_000u64 {
        added(&mut t, xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()));
        if i > 10_000 && i % 1_000 == 0 {
            let per = t.memory_bytes() as f64 / t.len() as f64;
            let small = t.scale.homes as usize <= DOUBLING_HOMES;
            doubled += usize::from(small);
            let bound = if small { 37.0 } else { 18.5 };
            assert!(per <= bound, "{per} bytes a hash at {i}");
        }
    }
    assert!(
        doubled > 0 && doubled < 100,
        "{doubled} samples of a small table"
    );
    t.check_invariants();
}

fn top_of(h: u128) -> u64 {
    (h >> 64) as u64
}

proptest! {
    #[test]
    fn an_offset_fits_its_bits_and_names_the_top_bits(homes in 16u64..(1 << 44), top in any::<u64>()) {
        let sc = Scale::new(homes);
        let (home, field) = sc.encode(u128::from(top) << 64);
        prop_assert!(field < 1u128 << FIELD_BITS);
        prop_assert_eq!(sc.top(home, field), top);
    }

    #[test]
    fn top_bits_survive_any_rescales_and_low_bits_shrink_to_the_smallest_scale(
        hash in any::<u128>(),
        sizes in prop::collection::vec(16u64..(1 << 44), 1..12),
    ) {
        let first = Scale::new(sizes[0]);
        let (mut home, mut field) = first.encode(hash);
        let mut sc = first;
        let mut least = first.below() - 1;
        for &n in &sizes[1..] {
            let to = Scale::new(n);
            (home, field) = sc.rescale(home, field, to);
            sc = to;
            least = least.min(sc.below() - 1);
            prop_assert_eq!(sc.top(home, field), top_of(hash));
            prop_assert_eq!(home, sc.home(top_of(hash)));
        }
        let (kept, low) = sc.kept(field);
        prop_assert_eq!(kept, least);
        prop_assert_eq!(low, (hash as u64) >> (64 - kept));
        // The hash itself, asked at the last scale, matches.
        let (qh, q) = sc.encode(hash);
        prop_assert_eq!(qh, home);
        prop_assert!(Scale::matches(field, q));
        // So does any hash that agrees on the kept bits, and none
        // that differs in one of them or in its top 64 bits.
        let below_kept = if kept == 64 { 0 } else { u128::from(u64::MAX >> kept) };
        prop_assert!(Scale::matches(field, sc.encode(hash ^ below_kept).1));
        if kept > 0 {
            let flip = 1u128 << (64 - kept);
            prop_assert!(!Scale::matches(field, sc.encode(hash ^ flip).1));
        }
        let other = hash ^ (1u128 << 64);
        let (oh, o) = sc.encode(other);
        prop_assert!(oh != home || !Scale::matches(field, o));
    }

    #[test]
    fn home_and_offset_order_entries_as_their_top_bits(
        a in any::<u128>(), b in any::<u128>(), homes in 16u64..(1 << 44),
    ) {
        let sc = Scale::new(homes);
        let ((ha, fa), (hb, fb)) = (sc.encode(a), sc.encode(b));
        prop_assert_eq!(
            (ha, sc.offset(fa)).cmp(&(hb, sc.offset(fb))),
            top_of(a).cmp(&top_of(b))
        );
    }
}

proptest! {
    #[test]
    fn the_reciprocal_divides_as_a_division(homes in 16u64..(1 << 57), home in any::<u64>(), low in any::<u64>()) {
        let scale = Scale::new(homes);
        let n = u128::from(home % homes) << 64 | u128::from(low);
        let d = u128::from(homes);
        prop_assert_eq!(scale.div(n), ((n / d) as u64, (n % d) as u64));
    }

    #[test]
    fn the_reciprocal_divides_at_the_edges(homes in 16u64..(1 << 57)) {
        let scale = Scale::new(homes);
        let d = u128::from(homes);
        for n in [0, d - 1, d, d + 1, (d - 1) << 64, ((d - 1) << 64) | u128::from(u64::MAX), (d << 64) - 1] {
            prop_assert_eq!(scale.div(n), ((n / d) as u64, (n % d) as u64), "n = {}", n);
        }
    }

    #[test]
    fn a_query_is_the_field_split(homes in 16u64..(1 << 44), hash in any::<u128>()) {
        let scale = Scale::new(homes);
        let (home, field) = scale.encode(hash);
        let (qhome, hi, lo8) = scale.query(hash);
        prop_assert_eq!((home as usize, field), (qhome, u128::from(hi) << 8 | u128::from(lo8)));
    }
}

#[test]
fn a_field_is_never_empty_and_fits_its_bits() {
    for homes in [16u64, 17, 4096, 10_000_000, 1 << 40] {
        let sc = Scale::new(homes);
        for hash in [0u128, u128::MAX, 1 << 64, u128::from(u64::MAX)] {
            let (_, f) = sc.encode(hash);
            assert_ne!(f, 0);
            assert!(f < 1u128 << FIELD_BITS, "{homes} {hash:x}");
        }
    }
}

#[test]
fn a_table_finds_what_it_holds_through_its_growths_and_nothing_else() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let held: Vec<u128> = (0..200_000).map(|_| rng.random()).collect();
    let mut t = FpTable::default();
    for (k, &h) in held.iter().enumerate() {
        assert!(add(&mut t, h, k as u32 & 0xffff));
        assert!(!add(&mut t, h, 1), "inserted twice");
    }
    for (k, &h) in held.iter().enumerate() {
        assert_eq!(t.get(h), Some(k as u32 & 0xffff));
    }
    // Hashes that share a held one's top 64 bits, or differ from it in
    // its leading low bits, are not held.
    for &h in &held[..1000] {
        assert_eq!(t.get(h ^ (1 << 127)), None);
        assert_eq!(t.get(h ^ (1 << 63)), None);
    }
    let absent = (0..200_000)
        .filter(|_| t.get(rng.random()).is_some())
        .count();
    assert_eq!(absent, 0);
    assert_eq!(t.len, held.len());
}

/// One step of the model test below.
#[derive(Clone, Debug)]
enum Op {
    /// Inserts the pool's hash at this index with the open epoch's tag.
    Insert(usize),
    /// Looks the pool's hash up.
    Get(usize),
    /// Closes the open epoch; the oldest live one dies once `LIVE` are.
    Checkpoint,
    /// Drops the dead entries.
    Purge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        300 => (0..4_000usize).prop_map(Op::Insert),
        100 => (0..4_000usize).prop_map(Op::Get),
        2 => Just(Op::Checkpoint),
        1 => Just(Op::Purge),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// Against a map: a live entry is always found with its tag, a
    /// dead one with its old tag or not at all, and no other hash is
    /// found; an insert finds what the map holds live. The pool mixes
    /// random hashes with groups of four that share their top 64 bits
    /// (and differ in the low bits every scale keeps), and long runs
    /// grow the table through several scales.
    #[test]
    fn a_table_agrees_with_a_map(seed in any::<u64>(), ops in prop::collection::vec(op(), 1..6_000)) {
        use rand::{Rng, SeedableRng};
        use std::collections::HashMap;
        use super::Insert;
        const LIVE: u32 = 8;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut top = 0u64;
        let pool: Vec<u128> = (0..4_000u64)
            .map(|k| {
                let h: u128 = rng.random();
                // A quarter of the hashes come in groups of four with
                // one top; within a group the low half's two leading
                // bits differ, which even the smallest scale keeps
                // (real hashes share a top with a chance of 2^-64).
                if k % 16 < 4 {
                    if k % 16 == 0 {
                        top = rng.random();
                    }
                    let low = (k % 4) << 62 | (h as u64) >> 2;
                    u128::from(top) << 64 | u128::from(low)
                } else {
                    h
                }
            })
            .collect();
        let long = ops.len() > 3_000;
        let mut widest = 0;
        let (mut t, mut model) = (FpTable::default(), HashMap::<u128, u32>::new());
        let mut open = LIVE;
        for op in ops {
            let floor = open + 1 - LIVE;
            let dead = |g: u32| g < floor;
            match op {
                Op::Insert(k) => {
                    let h = pool[k];
                    // Both inserts, the one that reuses dead slots and the one
                        // that only replaces a dead entry of the same hash.
                        let got = if k % 2 == 0 {
                            t.insert_reusing(h, open, dead)
                        } else {
                            t.insert(h, open, dead)
                        };
                    match model.get(&h) {
                        Some(&g) if !dead(g) => prop_assert_eq!(got, Insert::Present(g)),
                        _ => {
                            prop_assert!(got != Insert::Present(open) && !matches!(got, Insert::Present(_)), "{got:?}");
                            model.insert(h, open);
                        }
                    }
                }
                Op::Get(k) => {
                    let h = pool[k];
                    let got = t.get(h);
                    match model.get(&h) {
                        Some(&g) if !dead(g) => prop_assert_eq!(got, Some(g)),
                        Some(&g) => prop_assert!(got == Some(g) || got.is_none(), "{got:?} for dead {g}"),
                        None => prop_assert_eq!(got, None),
                    }
                }
                Op::Checkpoint => open += 1,
                Op::Purge => {
                    t.purge(dead, 5);
                    t.check_invariants();
                    model.retain(|_, g| !dead(*g));
                }
            }
            widest = widest.max(t.scale.s);
        }
        t.check_invariants();
        prop_assert!(!long || widest >= 9, "the table stayed at scale {widest}");
        let floor = open + 1 - LIVE;
        for (h, g) in &model {
            if *g >= floor {
                prop_assert_eq!(t.get(*h), Some(*g));
            }
        }
    }
}

#[test]
fn a_table_laid_out_at_once_or_packed_finds_what_it_holds() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut entries: Vec<(u128, u32)> = (0..300_000u32).map(|k| (rng.random(), k % 7)).collect();
    // Two entries of one hash: the higher tag stays.
    entries.push((entries[10].0, 99));
    let fresh: Vec<u128> = (0..100_000).map(|_| rng.random()).collect();
    let mut t = FpTable::from_entries(entries.clone(), 85);
    assert_eq!(t.len, 300_000);
    let want = |k: usize| if k == 10 { 99 } else { entries[k].1 };
    for (k, &(h, _)) in entries[..300_000].iter().enumerate() {
        assert_eq!(t.get(h), Some(want(k)), "entry {k}");
    }
    assert!(fresh.iter().all(|&h| t.get(h).is_none()));
    assert!(
        t.memory_bytes() < 300_000 * 16,
        "{} bytes",
        t.memory_bytes()
    );
    // Grown, then most entries dropped and the rest packed: a smaller
    // scale, whose fields keep fewer low bits.
    for &h in &fresh {
        add(&mut t, h, 1);
    }
    let before = t.scale;
    t.purge(|g| g != 3, 5);
    t.pack();
    assert!(t.scale.s < before.s, "{:?} after {before:?}", t.scale);
    for (k, &(h, g)) in entries[..300_000].iter().enumerate() {
        assert_eq!(t.get(h), (want(k) == 3).then_some(3), "entry {k}, tag {g}");
    }
    assert!(fresh.iter().all(|&h| t.get(h).is_none()));
}

#[test]
fn a_purge_keeps_the_live_and_inserts_reuse_the_dead() {
    use super::Insert;
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let hashes: Vec<u128> = (0..100_000).map(|_| rng.random()).collect();
    let mut t = FpTable::default();
    for (k, &h) in hashes.iter().enumerate() {
        assert_eq!(
            t.insert_reusing(h, 1 + (k % 5) as u32, |_| false),
            Insert::Added
        );
    }
    let tag = |k: usize| 1 + (k % 5) as u32;
    assert_eq!(t.purge(|g| g <= 2, 5), 40_000);
    assert_eq!(t.len, 60_000);
    for (k, &h) in hashes.iter().enumerate() {
        assert_eq!(t.get(h), (tag(k) > 2).then_some(tag(k)), "entry {k}");
    }
    // Tags 3 are dead from here: their hashes come back with tag 6,
    // and fresh hashes take their slots or empty ones.
    let dead = |g: u32| g == 3;
    let (mut added, mut replaced) = (0, 0);
    for (k, &h) in hashes.iter().enumerate() {
        match t.insert_reusing(h, 6, dead) {
            Insert::Present(g) => assert!(g > 3 && g == tag(k), "entry {k}: {g}"),
            Insert::Replaced => replaced += 1,
            Insert::Added => added += 1,
        }
    }
    assert_eq!(replaced, 20_000, "the dead entries of the same hashes");
    assert_eq!(added, 40_000, "the purged ones");
    // Now tags 4 are dead: fresh hashes shifting entries stop at the
    // first of them and overwrite it, and the table holds no more.
    let dead = |g: u32| g == 4;
    let fresh: Vec<u128> = (0..50_000).map(|_| rng.random()).collect();
    let before = t.len;
    let mut reused = 0;
    for &h in &fresh {
        match t.insert_reusing(h, 7, dead) {
            Insert::Present(g) => panic!("a fresh hash held with tag {g}"),
            Insert::Replaced => reused += 1,
            Insert::Added => {}
        }
    }
    assert!(reused > 1_000, "{reused} dead slots reused");
    assert_eq!(t.len, before + 50_000 - reused);
    for &h in &fresh {
        assert_eq!(t.get(h), Some(7));
    }
    for (k, &h) in hashes.iter().enumerate() {
        match tag(k) {
            4 => assert!(matches!(t.get(h), Some(4) | None), "entry {k}"),
            5 => assert_eq!(t.get(h), Some(5), "entry {k}"),
            _ => assert_eq!(t.get(h), Some(6), "entry {k}"),
        }
    }
}

#[test]
fn a_table_with_many_equal_top_bits_keeps_them_apart() {
    // Hundreds of hashes a top, at the ends of the range and between:
    // they differ only in leading low bits, which an entry made at the
    // smallest scale keeps (11 of them).
    let mut t = FpTable::default();
    let tops = [0u64, 1, u64::MAX, 1 << 40, 12345];
    let hash = |top: u64, k: u128| u128::from(top) << 64 | k << 53 | k;
    for (n, &top) in tops.iter().enumerate() {
        for k in 0..200u128 {
            assert!(add(&mut t, hash(top, k), (n * 1000 + k as usize) as u32));
        }
    }
    t.check_invariants();
    // Four of the tops share home 0 until the table has 2^24 homes: 800
    // entries, of which at most 255 fit there, the rest in the stash.
    assert!(t.stash.len() >= 800 - 255, "{} stashed", t.stash.len());
    assert!(
        t.len() == 1_000 && t.slot_count() < 10_000,
        "{} slots",
        t.slot_count()
    );
    for (n, &top) in tops.iter().enumerate() {
        for k in 0..200u128 {
            assert_eq!(
                t.get(hash(top, k)),
                Some((n * 1000 + k as usize) as u32),
                "{top} {k}"
            );
            assert!(!add(&mut t, hash(top, k), 1));
        }
        assert_eq!(t.get(hash(top, 200)), None);
    }
    t.pack();
    t.check_invariants();
    assert!((0..200).all(|k| t.get(hash(1, k)).is_some()));
    // A purge keeps the stash's live entries and drops its dead ones.
    t.purge(|g| g >= 1000, 8);
    t.check_invariants();
    assert_eq!(t.len(), 200);
    assert!((0..200).all(|k| t.get(hash(1, k)).is_none() && t.get(hash(0, k)).is_some()));
}

/// An aimed lookup, with the fetches of a small table or of a large one.
fn aimed<const FAR: bool>(t: &FpTable, h: u128) -> Option<u32> {
    let mut aim = t.aim::<FAR>(h);
    t.screen::<FAR>(&mut aim);
    t.get_aimed(&aim)
}

#[test]
fn an_aimed_lookup_answers_as_get() {
    let mut t = FpTable::default();
    let h = |i: u64| xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
    assert_eq!(aimed::<false>(&t, h(1)), None);
    assert_eq!(aimed::<true>(&t, h(1)), None);
    for i in 0..20_000u64 {
        t.insert(h(i), (i % 7) as u32, never);
    }
    // Epochs 0 and 1 dropped: their entries stay until a purge.
    let dead = |tag: u32| tag < 2;
    for i in 20_000..25_000u64 {
        t.insert_reusing(h(i), 9, dead);
    }
    for i in (0..40_000u64).map(h) {
        assert_eq!(aimed::<false>(&t, i), t.get(i), "{i:x}");
        assert_eq!(aimed::<true>(&t, i), t.get(i), "{i:x}");
    }
    t.purge(dead, 5);
    for i in (0..40_000u64).map(h) {
        assert_eq!(aimed::<false>(&t, i), t.get(i), "{i:x}");
        assert_eq!(aimed::<true>(&t, i), t.get(i), "{i:x}");
    }
}

/// The mappings in `/proc/self/smaps` that overlap `s`: the bytes the
/// kernel backs with huge pages in each.
#[cfg(target_os = "linux")]
fn mappings<T>(s: &[T]) -> Vec<u64> {
    let (start, end) = (s.as_ptr() as u64, s.as_ptr() as u64 + size_of_val(s) as u64);
    let smaps = std::fs::read_to_string("/proc/self/smaps")
        .unwrap_or_else(|e| panic!("read /proc/self/smaps: {e}"));
    let mut huge = Vec::new();
    let mut overlaps = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            overlaps = a < end && start < b;
            if overlaps {
                huge.push(0);
            }
        } else if overlaps
            && first == "AnonHugePages:"
            && let Some(last) = huge.last_mut()
        {
            *last += 1024
                * words
                    .next()
                    .and_then(|w| w.parse::<u64>().ok())
                    .unwrap_or(0);
        }
    }
    huge
}

#[cfg(target_os = "linux")]
#[test]
fn a_grown_table_settles_on_huge_pages() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.is_empty() || thp.contains("[never]") {
        eprintln!("transparent huge pages are off here: nothing to check");
        return;
    }
    // Grown by inserts to about 12 MiB of slots: laid out again at every
    // growth, with a new filter each time that is not advised.
    let mut t = FpTable::default();
    let mut x = 7;
    while t.len() < 600_000 {
        added(
            &mut t,
            u128::from(xorshift(&mut x)) << 64 | u128::from(xorshift(&mut x)),
        );
    }
    assert!(!t.huge, "a table grown by inserts counts as advised");
    // Its slots have a mapping of their own, on huge pages from the first
    // write: settling has no copy to make.
    assert!(t.raw.is_mapped(), "about 12 MiB of slots on the heap");
    let huge: u64 = mappings(&t.raw).iter().sum();
    assert!(
        huge * 2 >= size_of_val(&*t.raw) as u64,
        "{huge} B of {} B of slots on huge pages before settling",
        size_of_val(&*t.raw)
    );
    t.settle_pages();
    assert!(t.huge);
    let slots: u64 = mappings(&t.raw).iter().sum();
    assert!(
        slots >= 4 << 20,
        "{slots} B of {} B of slots on huge pages after settling",
        size_of_val(&*t.raw)
    );
    // In one mapping still, so that the next growth moves it rather than
    // copying it (a range marked for huge pages is a mapping of its own).
    assert_eq!(
        mappings(&t.raw).len(),
        1,
        "the settled slots span several mappings"
    );
    t.check_invariants();
    // Settled once, the next epoch's growth makes it settle again.
    let before = t.raw.len();
    while t.raw.len() == before {
        added(
            &mut t,
            u128::from(xorshift(&mut x)) << 64 | u128::from(xorshift(&mut x)),
        );
    }
    assert!(!t.huge, "a grown table counts as settled");
}

#[cfg(target_os = "linux")]
#[test]
fn a_mapping_keeps_its_slots_and_reads_zero_past_them() {
    let Some(mut s) = Slots::mapped_with_room(1000, 1000) else {
        panic!("no mapping of 2 MiB");
    };
    let room = s.reserved() / 16;
    let fill = |s: &mut Slots, from: usize| {
        for (i, v) in s.iter_mut().enumerate().skip(from) {
            *v = i as u128 + 1;
        }
    };
    fill(&mut s, 0);
    // Within the reservation, then past it (the pages move), then past it
    // again by far.
    for len in [room, room + 1, room * 3 + 5, room * 20] {
        let before = s.len();
        s.resize(len);
        assert!(s.is_mapped());
        assert_eq!(s.len(), len);
        assert!(
            s[..before]
                .iter()
                .enumerate()
                .all(|(i, &v)| v == i as u128 + 1),
            "slots changed growing from {before} to {len}"
        );
        assert!(s[before..].iter().all(|&v| v == 0), "new slots not empty");
        fill(&mut s, before);
    }
    // Shrunk to a length inside a huge page, and to a boundary, then grown
    // back: what was past the end reads zero again.
    for len in [room * 7 + 3, room * 2] {
        let top = s.len();
        s.resize(len);
        assert!(s.iter().enumerate().all(|(i, &v)| v == i as u128 + 1));
        s.resize(top);
        assert!(
            s[len..].iter().all(|&v| v == 0),
            "slots past {len} not zeroed"
        );
        fill(&mut s, len);
    }
}
