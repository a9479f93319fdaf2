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
            assert!(
                prev == 0 || s & KEY_MASK != prev & KEY_MASK,
                "slot {i} repeats a key"
            );
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

fn never(_: u32) -> bool {
    false
}

fn added(t: &mut FpTable, h: u128) -> bool {
    t.insert(h, 1, never) == Insert::Added
}

#[test]
fn table_matches_a_hash_set() {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let mut t = FpTable::default();
    let mut model = std::collections::HashSet::new();
    assert!(t.get(1 << 24).is_none() && t.get(0).is_none() && t.is_empty());
    for round in 0..40_000u64 {
        let h = xxhash_rust::xxh3::xxh3_128(&(xorshift(&mut x) % 30_000).to_le_bytes());
        let h = if round % 997 == 0 { 0 } else { h };
        assert_eq!(added(&mut t, h), model.insert(key_of(h)));
        if round % 5_000 == 0 {
            t.check_invariants();
        }
    }
    t.check_invariants();
    assert_eq!(t.len(), model.len());
    for i in 0..60_000u64 {
        let h = xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
        assert_eq!(t.get(h).is_some(), model.contains(&key_of(h)), "{i}");
    }
    let open = t.memory_bytes();
    t.pack();
    t.check_invariants();
    assert!(t.memory_bytes() <= open);
    for &h in &model {
        assert_eq!(t.get(h), Some(1));
    }
    assert_eq!(t.get(0), Some(1));
    // Packed, the table is 85% full, and the filter adds 6 bits a slot.
    let per = t.memory_bytes() as f64 / t.len() as f64;
    assert!((19.5..21.5).contains(&per), "{per} bytes a hash");
    let built = FpTable::from_entries(
        model
            .iter()
            .map(|&h| (h, 3))
            .chain([(5 << 24, 2), (5 << 24, 4), (0, 1)]),
        80,
    );
    built.check_invariants();
    assert_eq!(built.len(), model.len() + 1);
    assert!(model.iter().all(|&h| built.get(h).is_some()));
    // Of two entries with one key, the higher tag is kept.
    assert_eq!(built.get(5 << 24), Some(4));
    assert_eq!(built.get(0), Some(3));
    assert!(built.get(6 << 24).is_none());
}

#[test]
fn table_stays_within_its_memory_bound_while_growing() {
    let mut t = FpTable::default();
    for i in 0..300_000u64 {
        added(&mut t, xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()));
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
        all.push(i << 24);
        all.push((7u128 << 64) | (i << 24));
        all.push(u128::MAX - (i << 24));
    }
    for &h in all.iter().rev() {
        assert!(added(&mut t, h));
    }
    t.check_invariants();
    for &h in &all {
        assert!(!added(&mut t, h));
        assert!(t.get(h).is_some());
    }
    assert!(t.get(2_000 << 24).is_none() && t.get(u128::MAX).is_none() && t.get(0).is_none());
    t.pack();
    t.check_invariants();
    assert!(all.iter().all(|&h| t.get(h).is_some()));
    let mut reserved = FpTable::default();
    reserved.reserve(1_000);
    let homes = reserved.homes;
    for i in 0..1_000u64 {
        added(&mut reserved, xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()));
    }
    assert_eq!(reserved.homes, homes, "grew despite the reservation");
}

#[test]
fn tags_are_kept_and_dead_entries_are_replaced_or_purged() {
    let mut t = FpTable::default();
    let hashes: Vec<u128> = (0..20_000u64)
        .map(|i| xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes()))
        .collect();
    for (i, &h) in hashes.iter().enumerate() {
        assert_eq!(t.insert(h, (i % 10) as u32, never), Insert::Added);
    }
    // The tag bits of the hash do not matter: the key is the rest.
    assert_eq!(t.get(hashes[3] ^ 0xff_ffff), Some(3));
    assert_eq!(t.insert(hashes[3], 9, never), Insert::Present(3));
    // A dead entry gives way to the new one.
    assert_eq!(t.insert(hashes[3], 9, |tag| tag < 5), Insert::Replaced);
    assert_eq!(t.get(hashes[3]), Some(9));
    t.check_invariants();
    let before = t.memory_bytes();
    let dropped = t.purge(|tag| tag < 8);
    t.check_invariants();
    assert_eq!(dropped, 20_000 / 10 * 8 - 1);
    assert_eq!(t.len(), 20_000 - dropped);
    for (i, &h) in hashes.iter().enumerate() {
        let want = match i {
            3 => Some(9),
            _ if i % 10 >= 8 => Some((i % 10) as u32),
            _ => None,
        };
        assert_eq!(t.get(h), want, "{i}");
    }
    // Four fifths gone: the table was laid out again, smaller.
    assert!(
        t.memory_bytes() * 3 < before,
        "{} of {before}",
        t.memory_bytes()
    );
    let mut keys = Vec::new();
    t.for_each(|k, _| keys.push(k));
    assert!(keys.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(keys.len(), t.len());
    let left = t.len();
    assert_eq!(t.purge(|_| true), left);
    assert!(t.is_empty());
}

#[test]
fn inserts_reuse_the_slots_of_dead_entries() {
    let h = |i: u64| xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
    let mut t = FpTable::default();
    for i in 0..40_000u64 {
        assert_eq!(t.insert(h(i), (i % 10) as u32, never), Insert::Added);
    }
    let (len, homes) = (t.len(), t.homes);
    // Tags 0 to 4 are dead: 20,000 entries that no longer answer.
    let dead = |tag: u32| tag < 5;
    let mut replaced = 0;
    for i in 40_000..60_000u64 {
        match t.insert_reusing(h(i), 10, dead) {
            Insert::Replaced => replaced += 1,
            Insert::Added => {}
            Insert::Present(_) => panic!("{i} was never inserted"),
        }
        if i % 5_000 == 0 {
            t.check_invariants();
        }
    }
    t.check_invariants();
    assert!(
        replaced > 5_000,
        "only {replaced} of 20,000 reused a dead slot"
    );
    assert_eq!(t.len(), len + 20_000 - replaced);
    assert!(
        t.homes <= homes + homes / 5,
        "grew from {homes} to {}",
        t.homes
    );
    // Every live entry answers with its tag; a dead one never answers as live.
    for i in 0..60_000u64 {
        let want = if i >= 40_000 { 10 } else { (i % 10) as u32 };
        match t.get(h(i)) {
            Some(tag) => assert!(tag == want && (!dead(want) || i < 40_000), "{i}: tag {tag}"),
            None => assert!(dead(want), "{i} (tag {want}) is lost"),
        }
    }
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
    t.insert(0, 5, never);
    // Epochs 0 and 1 dropped: their entries stay until a purge.
    let dead = |tag: u32| tag < 2;
    for i in 20_000..25_000u64 {
        t.insert_reusing(h(i), 9, dead);
    }
    for i in (0..40_000u64).map(h).chain([0, 1 << 24]) {
        assert_eq!(aimed::<false>(&t, i), t.get(i), "{i:x}");
        assert_eq!(aimed::<true>(&t, i), t.get(i), "{i:x}");
    }
    t.purge(dead);
    assert_eq!(aimed::<false>(&t, 0), Some(5));
    assert_eq!(aimed::<true>(&t, 0), Some(5));
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
    assert!(t.slots.is_mapped(), "about 12 MiB of slots on the heap");
    let huge: u64 = mappings(&t.slots).iter().sum();
    assert!(
        huge * 2 >= size_of_val(&*t.slots) as u64,
        "{huge} B of {} B of slots on huge pages before settling",
        size_of_val(&*t.slots)
    );
    t.settle_pages();
    assert!(t.huge);
    let slots: u64 = mappings(&t.slots).iter().sum();
    assert!(
        slots >= 4 << 20,
        "{slots} B of {} B of slots on huge pages after settling",
        size_of_val(&*t.slots)
    );
    // In one mapping still, so that the next growth moves it rather than
    // copying it (a range marked for huge pages is a mapping of its own).
    assert_eq!(
        mappings(&t.slots).len(),
        1,
        "the settled slots span several mappings"
    );
    t.check_invariants();
    // Settled once, the next epoch's growth makes it settle again.
    let before = t.slots.len();
    while t.slots.len() == before {
        added(
            &mut t,
            u128::from(xorshift(&mut x)) << 64 | u128::from(xorshift(&mut x)),
        );
    }
    assert!(!t.huge, "a grown table counts as settled");
}

/// The canonical layout of sorted `hashes` over `homes` home slots, and
/// its filter, made the plain way.
fn canonical(hashes: &[u128], homes: usize) -> (Vec<u128>, Vec<u64>) {
    let mut slots = vec![0u128; slots_for(homes)];
    let mut filter = vec![0u64; filter_words(homes)];
    let mut next = 0;
    for &h in hashes {
        let at = home_of(h, homes).max(next);
        slots[at] = h;
        mark(&mut filter, h);
        next = at + 1;
    }
    (slots, filter)
}

/// `slots` copied into an array of the kind a table of their length gets
/// when it is made empty: a mapping of its own once they are large.
fn made(slots: &[u128]) -> Slots {
    let mut s = Slots::zeroed(slots.len());
    s.copy_from_slice(slots);
    s
}

#[test]
fn layouts_in_either_direction_match_the_canonical_one() {
    // Small tables stay on the heap; large ones are laid out from the
    // heap into a mapping and within it.
    for n in [20_000, 300_000] {
        let mut x = 11;
        let mut hashes: Vec<u128> = (0..n)
            .map(|_| (u128::from(xorshift(&mut x)) << 64 | u128::from(xorshift(&mut x))) | 1)
            .collect();
        hashes.sort_unstable();
        hashes.dedup();
        let n = hashes.len();
        let large = slots_for(n) * 16 >= slots::MAPPED_BYTES;
        // From a compact vector (every entry moves right), then from each
        // layout to smaller (left), slightly larger (mostly right, some
        // left: a new vector) and much larger (right) tables, over many
        // blocks, from the heap and from a mapping.
        for first in [n * 100 / 85, n * 100 / 60, n * 3] {
            let (slots, homes, filter) = lay_out(Slots::from(hashes.clone()), first, false);
            assert_eq!(slots.is_mapped(), large && cfg!(target_os = "linux"));
            let (want, want_filter) = canonical(&hashes, homes);
            assert_eq!(&*slots, &want[..], "from compact to {homes} homes");
            assert_eq!(&*filter, &want_filter[..]);
            for to in [n * 100 / 90, n * 100 / 85, homes + homes / 12, homes * 4] {
                for from in [Slots::from(slots.to_vec()), made(&slots)] {
                    let mapped = from.is_mapped();
                    let (again, to_homes, filter) = lay_out(from, to, false);
                    let (want, want_filter) = canonical(&hashes, to_homes);
                    assert_eq!(
                        &*again,
                        &want[..],
                        "from {homes} to {to_homes} homes (mapped: {mapped})"
                    );
                    assert_eq!(&*filter, &want_filter[..]);
                    assert!(!mapped || again.is_mapped(), "a mapping left for the heap");
                }
            }
        }
        // Spread out, then compact: over four times as many homes the first
        // half moves both ways and the second half right, so a new vector.
        let mut spread = Vec::new();
        for (i, &h) in hashes.iter().enumerate() {
            spread.push(h);
            if i < n / 2 {
                spread.extend([0; 3]);
            }
        }
        let (slots, homes, filter) = lay_out(Slots::from(spread), n * 4, false);
        let (want, want_filter) = canonical(&hashes, homes);
        assert_eq!(&*slots, &want[..], "from spread out to {homes} homes");
        assert_eq!(&*filter, &want_filter[..]);
    }
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
