use super::*;

fn hash(i: u64) -> Fingerprint {
    Fingerprint::content(None, Some(&i.to_le_bytes()))
}

fn found(lane: &LaneIndex, offset: Option<u64>, fp: Option<Fingerprint>) -> Option<(Reason, u64)> {
    match lane.lookup(offset, fp) {
        Lookup::Found(r, e) => Some((r, e)),
        Lookup::Fresh => None,
        Lookup::Disk { .. } => panic!("nothing is on disk here"),
    }
}

#[test]
fn sealed_epoch_keeps_its_members() {
    let mut lane = LaneIndex::new(0, 0, 0);
    for i in 0..1000u64 {
        lane.insert(0, Some(i), Some(hash(i)));
        lane.insert(0, None, Some(Fingerprint::id(i * 3)));
    }
    lane.close(1);
    for i in 0..1000u64 {
        assert_eq!(found(&lane, Some(i), None), Some((Reason::SamePosition, 0)));
        assert_eq!(
            found(&lane, None, Some(hash(i))),
            Some((Reason::SameContent, 0))
        );
        assert_eq!(
            found(&lane, None, Some(Fingerprint::id(i * 3))),
            Some((Reason::SameContent, 0))
        );
    }
    assert_eq!(found(&lane, Some(1000), None), None);
    assert_eq!(found(&lane, None, Some(Fingerprint::id(1))), None);
    let e = lane.epochs().next().map(EpochIndex::fingerprints);
    assert_eq!(e, Some(2000));
    assert_eq!(lane.live_fingerprints(), 2000);
    assert_eq!(lane.live_offset_count(), 1000);
}

#[test]
fn lane_reports_reason_and_epoch() {
    let mut lane = LaneIndex::new(1, 1, 1);
    lane.insert(1, Some(10), None);
    lane.close(2);
    lane.insert(2, None, Some(Fingerprint::id(99)));
    assert_eq!(
        found(&lane, Some(10), None),
        Some((Reason::SamePosition, 1))
    );
    assert_eq!(
        found(&lane, Some(11), Some(Fingerprint::id(99))),
        Some((Reason::SameContent, 2))
    );
    lane.drop_before(2);
    assert_eq!(found(&lane, Some(10), None), None);
}

#[test]
fn many_epochs_answer_like_one() {
    // 3,000 sealed epochs of 20 records each, then the newest answers first
    // and a dropped epoch never answers, whether or not it was purged.
    let mut lane = LaneIndex::new(0, 0, 0);
    for e in 0..3_000u64 {
        for k in 0..20 {
            let i = e * 20 + k;
            lane.insert(e, Some(i), Some(hash(i)));
        }
        lane.close(e + 1);
    }
    for i in (0..60_000u64).step_by(7) {
        assert_eq!(
            found(&lane, Some(i), None),
            Some((Reason::SamePosition, i / 20))
        );
        assert_eq!(
            found(&lane, None, Some(hash(i))),
            Some((Reason::SameContent, i / 20))
        );
    }
    assert_eq!(found(&lane, Some(60_000), Some(hash(60_000))), None);
    // Drop a few (below the purge threshold), then most (above it).
    for keep in [100u64, 2_500] {
        lane.drop_before(keep);
        for i in (0..60_000u64).step_by(13) {
            let want = (i / 20 >= keep).then_some((Reason::SameContent, i / 20));
            assert_eq!(found(&lane, None, Some(hash(i))), want, "{i} after {keep}");
            let want = (i / 20 >= keep).then_some((Reason::SamePosition, i / 20));
            assert_eq!(found(&lane, Some(i), None), want, "{i} after {keep}");
        }
        assert_eq!(lane.live_fingerprints(), (3_000 - keep) * 20);
    }
    // A hash of a dropped epoch can be recorded again.
    assert_eq!(found(&lane, None, Some(hash(5))), None);
    lane.insert(3_000, Some(5), Some(hash(5)));
    assert_eq!(
        found(&lane, None, Some(hash(5))),
        Some((Reason::SameContent, 3_000))
    );
    assert_eq!(
        found(&lane, Some(5), None),
        Some((Reason::SamePosition, 3_000))
    );
}

#[test]
fn newer_content_beats_older_position() {
    let mut lane = LaneIndex::new(0, 0, 0);
    lane.insert(0, Some(5), Some(hash(5)));
    lane.close(1);
    lane.insert(1, Some(6), Some(hash(6)));
    assert_eq!(
        found(&lane, Some(5), Some(hash(6))),
        Some((Reason::SameContent, 1))
    );
    assert_eq!(
        found(&lane, Some(6), Some(hash(6))),
        Some((Reason::SamePosition, 1))
    );
    assert_eq!(
        found(&lane, Some(5), Some(hash(7))),
        Some((Reason::SamePosition, 0))
    );
    assert_eq!(resolve(None, None), None);
}

#[test]
fn epochs_below_the_floor_go_to_the_disk_filter() {
    let mut lane = LaneIndex::new(0, 0, 0);
    for i in 0..100u64 {
        lane.insert(0, Some(i), Some(hash(i)));
    }
    lane.close(1);
    lane.insert(1, Some(100), Some(hash(100)));
    assert_eq!(lane.epoch_hashes(0), 100);
    // The guard writes an epoch's hashes to disk from its chunks.
    let mut filter = DiskFilter::with_capacity(100);
    for i in 0..100u64 {
        let Fingerprint::Hash(h) = hash(i) else {
            panic!("a hash")
        };
        filter.insert(key_of(h));
    }
    lane.disk_mut().filter = Some(filter);
    lane.lower_to_disk(1);
    assert_eq!(lane.disk().live, 100);
    assert_eq!(lane.floor(), 1);
    // Positions stay in memory; content goes to disk.
    assert_eq!(found(&lane, Some(3), None), Some((Reason::SamePosition, 0)));
    let Fingerprint::Hash(h) = hash(3) else {
        panic!("a hash")
    };
    assert_eq!(
        lane.lookup(None, Some(hash(3))),
        Lookup::Disk {
            key: key_of(h),
            position: None
        }
    );
    // A position in memory newer than anything on disk needs no read.
    assert_eq!(
        found(&lane, Some(100), Some(hash(3))),
        Some((Reason::SamePosition, 1))
    );
    assert_eq!(
        found(&lane, None, Some(hash(100))),
        Some((Reason::SameContent, 1))
    );
    assert!(lane.disk_epoch_is_live(0));
    lane.drop_before(1);
    assert!(!lane.disk_epoch_is_live(0));
    assert_eq!(lane.disk().live, 0);
}

#[test]
fn a_table_that_grew_during_an_epoch_is_settled_when_it_closes() {
    let mut lane = LaneIndex::new(0, 0, 0);
    for i in 0..300_000u64 {
        lane.insert(0, None, Some(hash(i)));
    }
    lane.close(1);
    assert!(lane.hashes.is_settled(), "a packed table is on huge pages");
    // The packed table grows at the next few inserts; the epoch stays far
    // below a quarter of it, so closing it does not pack the table.
    let slots = lane.hashes.slot_count();
    let mut i = 300_000u64;
    while lane.hashes.slot_count() == slots {
        lane.insert(1, None, Some(hash(i)));
        i += 1;
    }
    assert!(i - 300_000 < 75_000);
    assert!(!lane.hashes.is_settled(), "a grown table is laid out anew");
    lane.close(2);
    assert!(lane.hashes.is_settled(), "closing the epoch settles it");
    // So does a checkpoint whose purge laid the table out again, though
    // no record came in the epoch it closes.
    lane.drop_before(2);
    assert!(!lane.hashes.is_settled(), "a purged table is laid out anew");
    lane.close(3);
    assert!(
        lane.hashes.is_settled(),
        "closing an empty epoch settles it"
    );
    for k in 300_000..i {
        assert_eq!(found(&lane, None, Some(hash(k))), None, "dropped {k}");
    }
}

#[test]
fn a_window_of_two_large_epochs_rolls_without_growing() {
    const EPOCH: u64 = 50_000;
    let mut lane = LaneIndex::new(0, 0, 0);
    for e in 0..6u64 {
        let laid_out = lane.hashes.slot_count();
        for i in e * EPOCH..(e + 1) * EPOCH {
            lane.insert(e, None, Some(hash(i)));
        }
        // Once rolling, the purge keeps room for the next epoch and the
        // close leaves it: the epoch's inserts do not grow the table.
        assert!(
            e < 3 || lane.hashes.slot_count() == laid_out,
            "epoch {e} grew the table from {laid_out} slots to {}",
            lane.hashes.slot_count()
        );
        // A retention of two live epochs: each checkpoint from the second
        // on drops the epoch before the one it closes, half the table,
        // and purges it.
        lane.drop_before(e.saturating_sub(1));
        lane.close(e + 1);
    }
    for i in 0..4 * EPOCH {
        assert_eq!(found(&lane, None, Some(hash(i))), None, "dropped {i}");
    }
    for i in 4 * EPOCH..6 * EPOCH {
        assert_eq!(
            found(&lane, None, Some(hash(i))),
            Some((Reason::SameContent, i / EPOCH))
        );
    }
}

#[test]
fn a_purge_that_empties_the_table_keeps_room_for_the_next_epoch() {
    let mut lane = LaneIndex::new(0, 0, 0);
    for i in 0..50_000u64 {
        lane.insert(0, None, Some(hash(i)));
    }
    // A retention of one epoch: the checkpoint drops the epoch it closes.
    lane.drop_before(1);
    lane.close(1);
    assert!(lane.hashes.is_empty());
    let slots = lane.hashes.slot_count();
    assert!(slots >= 50_000, "{slots} slots");
    // An epoch as large as the last one does not grow it.
    for i in 50_000..100_000u64 {
        lane.insert(1, None, Some(hash(i)));
    }
    assert_eq!(
        lane.hashes.slot_count(),
        slots,
        "the next epoch grew the table"
    );
    for i in 0..50_000u64 {
        assert_eq!(found(&lane, None, Some(hash(i))), None, "dropped {i}");
    }
    for i in 50_000..100_000u64 {
        assert_eq!(
            found(&lane, None, Some(hash(i))),
            Some((Reason::SameContent, 1))
        );
    }
}

#[test]
fn a_sealed_run_of_offsets_is_kept_as_its_range_and_answers_as_a_bitmap_did() {
    let mut lane = LaneIndex::new(0, 0, 0);
    // Epoch 0: one run, 100..140. Epoch 1: a run with a gap at 150.
    for o in 100..140 {
        lane.insert(0, Some(o), None);
    }
    lane.close(1);
    for o in (140..160).filter(|o| *o != 150) {
        lane.insert(1, Some(o), None);
    }
    lane.close(2);
    let sealed: Vec<(bool, u64, bool)> = lane
        .epochs()
        .map(|e| (e.dense, e.offsets(), e.offsets.is_empty()))
        .collect();
    assert_eq!(sealed, vec![(true, 40, true), (false, 19, false)]);
    for o in 90..170 {
        let want = match o {
            100..140 => Some((Reason::SamePosition, 0)),
            150 => None,
            140..160 => Some((Reason::SamePosition, 1)),
            _ => None,
        };
        assert_eq!(found(&lane, Some(o), None), want, "offset {o}");
    }
    assert_eq!(lane.live_offset_count(), 59);
    let live: Vec<u64> = lane.live_offsets().iter().collect();
    let want: Vec<u64> = (100..160).filter(|o| *o != 150).collect();
    assert_eq!(live, want);
    // What a drop carries into the open epoch comes from the range.
    let carried: Vec<u64> = lane.carried(1, 130).iter().collect();
    assert_eq!(carried, (130..140).collect::<Vec<_>>());
    // A merge into the dense epoch (as a load does) makes a bitmap again.
    let mut more = RoaringTreemap::new();
    more.insert(145);
    lane.merge_offsets(0, &more);
    let first = lane.epochs().next().map(|e| (e.dense, e.offsets()));
    assert_eq!(first, Some((false, 41)));
    assert_eq!(
        found(&lane, Some(145), None),
        Some((Reason::SamePosition, 1))
    );
    assert_eq!(
        found(&lane, Some(139), None),
        Some((Reason::SamePosition, 0))
    );
    // The drop takes the epoch's offsets out of the sealed union.
    lane.drop_before(1);
    assert_eq!(found(&lane, Some(120), None), None);
    assert_eq!(
        found(&lane, Some(141), None),
        Some((Reason::SamePosition, 1))
    );
    assert_eq!(lane.live_offset_count(), 19);
}
