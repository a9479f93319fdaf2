//! Unit tests of the guard, and a model-based property test that runs random
//! operation sequences (with simulated crashes) against a plain reference.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::*;

fn hash(i: u64) -> Fingerprint {
    Fingerprint::content(Some(b"unit"), Some(&i.to_be_bytes()))
}

fn dup(reason: Reason, epoch: u64) -> Verdict {
    Verdict::Duplicate { reason, epoch }
}

#[test]
fn position_is_checked_before_content() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    assert_eq!(g.record(lane, Some(7), Some(hash(1)))?, Verdict::Fresh);
    assert_eq!(
        g.check(lane, Some(7), Some(hash(1)))?,
        dup(Reason::SamePosition, 0)
    );
    assert_eq!(
        g.check(lane, Some(7), Some(hash(2)))?,
        dup(Reason::SamePosition, 0)
    );
    assert_eq!(
        g.check(lane, Some(8), Some(hash(1)))?,
        dup(Reason::SameContent, 0)
    );
    assert_eq!(
        g.check(lane, None, Some(hash(1)))?,
        dup(Reason::SameContent, 0)
    );
    assert_eq!(g.check(lane, Some(8), Some(hash(2)))?, Verdict::Fresh);
    assert_eq!(g.check(lane, None, None)?, Verdict::Fresh);
    Ok(())
}

#[test]
fn lanes_are_independent() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let a = g.lane("t", 0);
    let b = g.lane("t", 1);
    assert_ne!(a, b);
    assert_eq!(g.lane("t", 0), a);
    g.record(a, Some(1), Some(hash(1)))?;
    assert_eq!(g.check(b, Some(1), Some(hash(1)))?, Verdict::Fresh);
    assert_eq!(
        g.lane_name(b),
        Some(&LaneName {
            topic: "t".into(),
            partition: 1
        })
    );
    Ok(())
}

#[test]
fn a_duplicate_is_never_recorded_twice() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    g.record(lane, Some(1), Some(hash(1)))?;
    // Same content at a new offset: not recorded, so offset 2 stays fresh.
    assert_eq!(
        g.record(lane, Some(2), Some(hash(1)))?,
        dup(Reason::SameContent, 0)
    );
    assert_eq!(g.check(lane, Some(2), None)?, Verdict::Fresh);
    // Same offset with new content: not recorded, so the content stays fresh.
    assert_eq!(
        g.record(lane, Some(1), Some(hash(2)))?,
        dup(Reason::SamePosition, 0)
    );
    assert_eq!(g.check(lane, None, Some(hash(2)))?, Verdict::Fresh);
    let s = g.stats();
    assert_eq!(s.recorded, 1);
    assert_eq!(s.live_fingerprints, 1);
    assert_eq!(s.live_offsets, 1);
    assert_eq!(s.duplicates_same_content, 1);
    assert_eq!(s.duplicates_same_position, 1);
    assert_eq!(s.checked, 2);
    Ok(())
}

#[test]
fn newest_epoch_answers_first() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).retention_epochs(1).open()?;
    let lane = g.lane("t", 0);
    g.record(lane, Some(5), Some(hash(5)))?;
    g.checkpoint(&[(lane, 6)], Vec::new())?;
    g.record(lane, Some(6), Some(hash(6)))?;
    // Offset 5 is in epoch 0, content 6 in epoch 1: epoch 1 is asked first.
    assert_eq!(
        g.check(lane, Some(5), Some(hash(6)))?,
        dup(Reason::SameContent, 1)
    );
    assert_eq!(
        g.check(lane, Some(5), Some(hash(7)))?,
        dup(Reason::SamePosition, 0)
    );
    Ok(())
}

#[test]
fn default_retention_forgets_the_closed_epoch_at_checkpoint() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    g.record(lane, Some(1), Some(hash(1)))?;
    let report = g.checkpoint(&[(lane, 2)], Vec::new())?;
    assert_eq!(report.epoch, 1);
    assert_eq!(report.dropped_epochs, vec![0]);
    assert_eq!(g.check(lane, Some(1), Some(hash(1)))?, Verdict::Fresh);
    assert_eq!(g.stats().live_epochs, 1);
    assert_eq!(g.stats().live_fingerprints, 0);
    Ok(())
}

#[test]
fn a_checkpoint_during_a_replay_keeps_the_replayed_positions() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    for o in 0..10 {
        g.record(lane, Some(o), Some(hash(o)))?;
    }
    // Handled up to 10, but the checkpoint says 5: a restart replays 5..10.
    let report = g.checkpoint(&[(lane, 5)], Vec::new())?;
    assert_eq!(report.dropped_epochs, vec![0]);
    let check = |g: &mut Guard| -> Result<()> {
        for o in 0..10 {
            let v = g.check(lane, Some(o), Some(hash(o)))?;
            if o < 5 {
                assert_eq!(v, Verdict::Fresh, "{o}");
            } else {
                assert_eq!(v, dup(Reason::SamePosition, 1), "{o}");
            }
        }
        Ok(())
    };
    check(&mut g)?;
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    check(&mut g)?;
    // Records after the reopen do not overwrite the carried positions.
    g.record(lane, Some(10), None)?;
    g.flush()?;
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    check(&mut g)?;
    assert!(!g.check(lane, Some(10), None)?.is_fresh());
    // Once a checkpoint passes them, they go with their epoch.
    g.checkpoint(&[(lane, 11)], Vec::new())?;
    assert!(g.check(lane, Some(7), None)?.is_fresh());
    assert_eq!(g.stats().live_offsets, 0);
    Ok(())
}

#[test]
fn retention_in_epochs_keeps_that_many_closed_epochs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).retention_epochs(2).open()?;
    let lane = g.lane("t", 0);
    for e in 0..5u64 {
        g.record(lane, Some(e), Some(hash(e)))?;
        let report = g.checkpoint(&[(lane, e + 1)], Vec::new())?;
        let expect: Vec<u64> = if e >= 2 { vec![e - 2] } else { Vec::new() };
        assert_eq!(report.dropped_epochs, expect);
    }
    // Open epoch 5 plus closed epochs 3 and 4.
    assert_eq!(g.stats().live_epochs, 3);
    for e in 0..5u64 {
        let v = g.check(lane, Some(e), Some(hash(e)))?;
        if e >= 3 {
            assert_eq!(v, dup(Reason::SamePosition, e));
        } else {
            assert_eq!(v, Verdict::Fresh, "epoch {e} should be dropped");
        }
    }
    drop(g);
    let mut g = Guard::builder(dir.path()).retention_epochs(2).open()?;
    assert_eq!(g.epoch(), 5);
    for e in 0..5u64 {
        assert_eq!(g.check(lane, None, Some(hash(e)))?.is_fresh(), e < 3);
    }
    Ok(())
}

#[test]
fn retention_in_time_keeps_recent_epochs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path())
        .retention_time(Some(Duration::from_secs(3600)))
        .open()?;
    let lane = g.lane("t", 0);
    for e in 0..4u64 {
        g.record(lane, Some(e), None)?;
        let report = g.checkpoint(&[(lane, e + 1)], Vec::new())?;
        assert!(report.dropped_epochs.is_empty());
    }
    for e in 0..4u64 {
        assert_eq!(g.check(lane, Some(e), None)?, dup(Reason::SamePosition, e));
    }
    drop(g);
    // Reopened with a zero time retention, the next checkpoint drops all
    // closed epochs.
    let mut g = Guard::builder(dir.path())
        .retention_time(Some(Duration::ZERO))
        .open()?;
    assert!(!g.check(lane, Some(0), None)?.is_fresh());
    let dropped = g.checkpoint(&[], Vec::new())?.dropped_epochs;
    assert_eq!(dropped, vec![0, 1, 2, 3, 4]);
    assert!(g.check(lane, Some(0), None)?.is_fresh());
    Ok(())
}

#[test]
fn builder_refuses_out_of_bounds_options() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cases = [
        Guard::builder(dir.path()).chunk_records(0),
        Guard::builder(dir.path()).chunk_records(10_000_001),
        Guard::builder(dir.path()).retention_epochs(1_000_001),
        Guard::builder(dir.path()).retention_time(Some(Duration::from_secs(366 * 86_400))),
        Guard::builder(dir.path()).max_memory_bytes(Some((1 << 50) + 1)),
    ];
    for b in cases {
        let r = b.clone().open();
        assert!(matches!(r, Err(Error::Config(_))), "{b:?} gave {r:?}");
    }
    // Nothing was created by a refused open.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 0);
    Guard::builder(dir.path())
        .chunk_records(10_000_000)
        .retention_epochs(1_000_000)
        .retention_time(Some(Duration::from_secs(365 * 86_400)))
        .max_memory_bytes(Some(1 << 50))
        .open()?;
    Ok(())
}

#[test]
fn unknown_lane_is_an_error_and_changes_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    let bogus = LaneId(9);
    assert!(matches!(
        g.check(bogus, Some(1), None),
        Err(Error::UnknownLane(9))
    ));
    assert!(matches!(
        g.record(bogus, Some(1), None),
        Err(Error::UnknownLane(9))
    ));
    assert!(matches!(
        g.checkpoint(&[(lane, 1), (bogus, 1)], Vec::new()),
        Err(Error::UnknownLane(9))
    ));
    assert_eq!(g.epoch(), 0);
    assert_eq!(g.position(lane), None);
    assert!(g.manifest().is_none());
    // Not a poisoning error: the guard still works.
    assert_eq!(g.record(lane, Some(1), None)?, Verdict::Fresh);
    Ok(())
}

#[test]
fn positions_follow_checkpoints_only() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let a = g.lane("t", 0);
    let b = g.lane("t", 1);
    assert_eq!(g.position(a), None);
    g.checkpoint(&[(a, 10), (b, 20)], b"sink-1".to_vec())?;
    g.checkpoint(&[(a, 11)], b"sink-2".to_vec())?;
    assert_eq!((g.position(a), g.position(b)), (Some(11), Some(20)));
    let m = g.manifest().cloned();
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    assert_eq!(g.manifest().cloned(), m);
    assert_eq!(
        g.manifest().map(|m| m.sink.clone()),
        Some(b"sink-2".to_vec())
    );
    assert_eq!(g.epoch(), 2);
    let (a, b) = (g.lane("t", 0), g.lane("t", 1));
    assert_eq!((g.position(a), g.position(b)), (Some(11), Some(20)));
    Ok(())
}

#[test]
fn flushed_records_survive_a_crash_and_unflushed_ones_do_not() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    g.record(lane, Some(1), Some(hash(1)))?;
    g.flush()?;
    g.record(lane, Some(2), Some(hash(2)))?;
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    assert_eq!(g.check(lane, Some(1), None)?, dup(Reason::SamePosition, 0));
    assert_eq!(
        g.check(lane, None, Some(hash(1)))?,
        dup(Reason::SameContent, 0)
    );
    assert_eq!(g.check(lane, Some(2), Some(hash(2)))?, Verdict::Fresh);
    // A new chunk after the reopen does not overwrite the recovered one.
    g.record(lane, Some(3), Some(hash(3)))?;
    g.flush()?;
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    assert!(!g.check(lane, Some(1), None)?.is_fresh());
    assert!(!g.check(lane, Some(3), None)?.is_fresh());
    assert_eq!(g.stats().live_fingerprints, 2);
    Ok(())
}

#[test]
fn a_full_chunk_is_written_without_a_flush() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).chunk_records(3).open()?;
    let lane = g.lane("t", 0);
    for o in 0..4 {
        g.record(lane, Some(o), None)?;
    }
    drop(g);
    let mut g = Guard::builder(dir.path()).chunk_records(3).open()?;
    for o in 0..3 {
        assert!(!g.check(lane, Some(o), None)?.is_fresh(), "offset {o}");
    }
    assert!(g.check(lane, Some(3), None)?.is_fresh());
    Ok(())
}

#[test]
fn a_lane_created_but_never_written_does_not_break_reopen() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let _idle = g.lane("idle", 0);
    let busy = g.lane("busy", 0);
    g.record(busy, Some(1), None)?;
    g.flush()?;
    drop(g);
    let mut g = Guard::builder(dir.path()).open()?;
    let busy = g.lane("busy", 0);
    assert!(!g.check(busy, Some(1), None)?.is_fresh());
    Ok(())
}

#[test]
fn user_ids_and_hashes_survive_sealing_and_reopen() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path())
        .retention_epochs(1)
        .chunk_records(97)
        .open()?;
    let lane = g.lane("t", 0);
    for i in 0..2_000u64 {
        g.record(lane, None, Some(Fingerprint::id(i * 2)))?;
        g.record(lane, None, Some(hash(i)))?;
    }
    g.checkpoint(&[], Vec::new())?;
    let check_all = |g: &mut Guard| -> Result<()> {
        for i in 0..2_000u64 {
            assert_eq!(
                g.check(lane, None, Some(Fingerprint::id(i * 2)))?,
                dup(Reason::SameContent, 0)
            );
            assert!(
                g.check(lane, None, Some(Fingerprint::id(i * 2 + 1)))?
                    .is_fresh()
            );
            assert_eq!(
                g.check(lane, None, Some(hash(i)))?,
                dup(Reason::SameContent, 0)
            );
            assert!(g.check(lane, None, Some(hash(i + 1_000_000)))?.is_fresh());
        }
        Ok(())
    };
    check_all(&mut g)?;
    drop(g);
    let mut g = Guard::builder(dir.path()).retention_epochs(1).open()?;
    check_all(&mut g)?;
    assert_eq!(g.stats().live_fingerprints, 4_000);
    Ok(())
}

#[test]
fn a_record_without_identity_is_fresh_and_counted() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).open()?;
    let lane = g.lane("t", 0);
    assert_eq!(g.record(lane, None, None)?, Verdict::Fresh);
    assert_eq!(g.record(lane, None, None)?, Verdict::Fresh);
    assert_eq!(g.stats().recorded, 2);
    g.flush()?;
    drop(g);
    Guard::builder(dir.path()).open()?;
    Ok(())
}

#[test]
fn stats_describe_the_state() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).retention_epochs(1).open()?;
    let lane = g.lane("t", 0);
    for o in 0..100 {
        g.record(lane, Some(o), Some(hash(o)))?;
    }
    g.checkpoint(&[(lane, 100)], Vec::new())?;
    for o in 100..150 {
        g.record(lane, Some(o), Some(Fingerprint::id(o)))?;
    }
    let s = g.stats();
    assert_eq!(s.recorded, 150);
    assert_eq!(s.live_fingerprints, 150);
    assert_eq!(s.live_offsets, 150);
    assert_eq!(s.live_epochs, 2);
    assert_eq!(s.epoch, 1);
    assert_eq!(s.checkpoints, 1);
    assert!(s.last_checkpoint.is_some());
    assert!(s.disk_bytes > 0);
    let table = g.epoch_table();
    assert_eq!(table.len(), 2);
    assert_eq!((table[0].1, table[0].2, table[0].3), (0, 100, 100));
    assert_eq!((table[1].1, table[1].2, table[1].3), (1, 50, 50));
    assert_eq!(g.live_offsets(lane).len(), 150);
    drop(g);
    let g = Guard::builder(dir.path()).retention_epochs(1).open()?;
    let s = g.stats();
    assert_eq!((s.checked, s.recorded, s.checkpoints), (0, 0, 0));
    // The 50 records of the open epoch were never flushed.
    assert_eq!(s.live_fingerprints, 100);
    assert_eq!(s.live_epochs, 2);
    assert!(s.last_recovery > Duration::ZERO);
    Ok(())
}

#[test]
fn memory_estimate_grows_with_content_and_shrinks_when_sealed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).retention_epochs(1).open()?;
    let lane = g.lane("t", 0);
    assert_eq!(g.memory_bytes(), 0);
    let n = 100_000u64;
    for i in 0..n {
        g.record(lane, Some(i), Some(hash(i)))?;
    }
    let open = g.memory_bytes();
    // A table of 12-byte slots, at least 70% full, with its filter (6 bits
    // a home), plus a few KiB of dense offsets (about 1/8 byte each in
    // bitmap containers).
    assert!(open as u64 > 12 * n, "{open}");
    assert!(
        (open as f64) < (12.75 / 0.7 + 1.0 / 7.0) * n as f64,
        "{open}"
    );
    g.checkpoint(&[(lane, n)], Vec::new())?;
    let sealed = g.memory_bytes();
    // Sealed: packed 85% full, and the offsets as one run.
    assert!(sealed as u64 >= 14 * n, "{sealed}");
    assert!((sealed as u64) < 16 * n, "{sealed}");
    assert!(sealed < open);
    Ok(())
}

// ---------------------------------------------------------------------------
// Model-based test.

/// Small domains, so that duplicates of every kind are frequent.
const OFFSETS: u64 = 24;
const IDS: u64 = 12;

#[derive(Clone, Copy, Debug)]
enum Fp {
    Id(u64),
    Hash(u64),
}

impl Fp {
    fn get(self) -> Fingerprint {
        match self {
            Fp::Id(i) => Fingerprint::id(i),
            Fp::Hash(i) => Fingerprint::content(Some(b"model"), Some(&i.to_le_bytes())),
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Check(usize, Option<u64>, Option<Fp>),
    Record(usize, Option<u64>, Option<Fp>),
    /// `check_many` and `record_many`: the same answers as one call a
    /// probe, with hashes recorded one call at a time still waiting to be
    /// placed in the table.
    CheckMany(Vec<(usize, Option<u64>, Option<Fp>)>),
    RecordMany(Vec<(usize, Option<u64>, Option<Fp>)>),
    Flush,
    Checkpoint(Vec<(usize, u64)>),
    /// Drop the guard without a checkpoint and reopen; then ask about the
    /// lanes starting from the given one (lanes get ids in that order).
    Crash(usize),
    /// Checkpoint, then drop the guard and reopen.
    CleanReopen(Vec<(usize, u64)>, usize),
}

fn fp_strategy() -> impl Strategy<Value = Option<Fp>> {
    prop_oneof![
        1 => Just(None),
        3 => (0..IDS).prop_map(|i| Some(Fp::Id(i))),
        3 => (0..IDS).prop_map(|i| Some(Fp::Hash(i))),
    ]
}

fn op_strategy(lanes: usize) -> impl Strategy<Value = Op> {
    let lane = 0..lanes;
    let offset = prop::option::weighted(0.8, 0..OFFSETS);
    // Positions mostly inside the offset domain, so that checkpoints often
    // land behind offsets already handled (as while replaying).
    let position = prop_oneof![3 => 0..OFFSETS + 2, 1 => 0..1_000u64];
    let positions = prop::collection::vec((0..lanes, position), 0..=lanes);
    let batch = || prop::collection::vec((0..lanes, offset.clone(), fp_strategy()), 1..6);
    prop_oneof![
        20 => (lane.clone(), offset.clone(), fp_strategy()).prop_map(|(l, o, f)| Op::Check(l, o, f)),
        30 => (lane, offset.clone(), fp_strategy()).prop_map(|(l, o, f)| Op::Record(l, o, f)),
        3 => batch().prop_map(Op::CheckMany),
        4 => batch().prop_map(Op::RecordMany),
        3 => Just(Op::Flush),
        4 => positions.clone().prop_map(Op::Checkpoint),
        3 => (0..lanes).prop_map(Op::Crash),
        2 => (positions, 0..lanes).prop_map(|(p, first)| Op::CleanReopen(p, first)),
    ]
}

#[derive(Clone, Debug, Default)]
struct EpochSet {
    offsets: BTreeSet<u64>,
    fps: HashSet<Fingerprint>,
}

type Epochs = BTreeMap<u64, EpochSet>;

/// The reference: plain sets per (lane, epoch), and a copy of what is durable.
struct Model {
    retention: u64,
    /// Sealed epochs keep their hashes on disk (a memory budget of 0).
    on_disk: bool,
    chunk_records: usize,
    epoch: u64,
    live: Vec<Epochs>,
    durable: Vec<Epochs>,
    pending: Vec<usize>,
    positions: Vec<Option<u64>>,
    checked: u64,
    recorded: u64,
    dup_position: u64,
    dup_content: u64,
}

impl Model {
    fn new(lanes: usize, retention: u64, chunk_records: usize, on_disk: bool) -> Self {
        Model {
            retention,
            on_disk,
            chunk_records,
            epoch: 0,
            live: vec![Epochs::new(); lanes],
            durable: vec![Epochs::new(); lanes],
            pending: vec![0; lanes],
            positions: vec![None; lanes],
            checked: 0,
            recorded: 0,
            dup_position: 0,
            dup_content: 0,
        }
    }

    fn find(&self, lane: usize, offset: Option<u64>, fp: Option<Fingerprint>) -> Verdict {
        for (&epoch, set) in self.live[lane].iter().rev() {
            if offset.is_some_and(|o| set.offsets.contains(&o)) {
                return dup(Reason::SamePosition, epoch);
            }
            if fp.is_some_and(|f| set.fps.contains(&f)) {
                return dup(Reason::SameContent, epoch);
            }
        }
        Verdict::Fresh
    }

    fn count(&mut self, v: Verdict) {
        match v {
            Verdict::Duplicate {
                reason: Reason::SamePosition,
                ..
            } => self.dup_position += 1,
            Verdict::Duplicate {
                reason: Reason::SameContent,
                ..
            } => self.dup_content += 1,
            Verdict::Fresh => {}
        }
    }

    fn check(&mut self, lane: usize, offset: Option<u64>, fp: Option<Fingerprint>) -> Verdict {
        let v = self.find(lane, offset, fp);
        self.checked += 1;
        self.count(v);
        v
    }

    fn record(&mut self, lane: usize, offset: Option<u64>, fp: Option<Fingerprint>) -> Verdict {
        let v = self.find(lane, offset, fp);
        if v != Verdict::Fresh {
            self.count(v);
            return v;
        }
        let set = self.live[lane].entry(self.epoch).or_default();
        set.offsets.extend(offset);
        set.fps.extend(fp);
        self.recorded += 1;
        self.pending[lane] += 1;
        // A full chunk on one lane writes the pending chunks of every lane.
        if self.pending[lane] >= self.chunk_records {
            self.flush();
        }
        v
    }

    fn flush(&mut self) {
        self.durable = self.live.clone();
        self.pending.iter_mut().for_each(|p| *p = 0);
    }

    fn checkpoint(&mut self, positions: &[(usize, u64)]) {
        self.flush();
        for &(lane, p) in positions {
            self.positions[lane] = Some(p);
        }
        self.epoch += 1;
        let keep_from = self.epoch.saturating_sub(self.retention);
        for (lane, epochs) in self.live.iter_mut().enumerate() {
            // Offsets at or past the lane's position (its start, when it
            // has none yet) move out of dropped epochs into the new one.
            let p = self.positions[lane].unwrap_or(0);
            let carried: BTreeSet<u64> = epochs
                .range(..keep_from)
                .flat_map(|(_, set)| set.offsets.range(p..).copied())
                .collect();
            *epochs = epochs.split_off(&keep_from);
            if !carried.is_empty() {
                epochs
                    .entry(self.epoch)
                    .or_default()
                    .offsets
                    .extend(carried);
            }
        }
        self.durable = self.live.clone();
    }

    fn crash(&mut self) {
        self.live = self.durable.clone();
        self.pending.iter_mut().for_each(|p| *p = 0);
        self.checked = 0;
        self.recorded = 0;
        self.dup_position = 0;
        self.dup_content = 0;
    }

    /// Content hashes of the sealed epochs.
    fn sealed_hashes(&self) -> u64 {
        let sealed = self.live.iter().flat_map(|e| e.range(..self.epoch));
        sealed
            .flat_map(|(_, s)| s.fps.iter())
            .filter(|f| matches!(f, Fingerprint::Hash(_)))
            .count() as u64
    }

    fn live_counts(&self) -> (u64, u64) {
        let sets = self.live.iter().flat_map(|e| e.values());
        sets.fold((0, 0), |(f, o), s| {
            (f + s.fps.len() as u64, o + s.offsets.len() as u64)
        })
    }
}

/// A guard whose lane ids are resolved on first use, so that lanes are
/// created in a different order after each reopen.
struct Subject {
    dir: std::path::PathBuf,
    builder: GuardBuilder,
    guard: Option<Guard>,
    ids: Vec<Option<LaneId>>,
}

impl Subject {
    fn guard(&mut self) -> std::result::Result<&mut Guard, TestCaseError> {
        self.guard
            .as_mut()
            .ok_or_else(|| TestCaseError::fail("no guard"))
    }

    fn lane(&mut self, lane: usize) -> std::result::Result<LaneId, TestCaseError> {
        if let Some(id) = self.ids[lane] {
            return Ok(id);
        }
        let id = self.guard()?.lane("model", lane as i32);
        self.ids[lane] = Some(id);
        Ok(id)
    }

    fn reopen(&mut self) -> std::result::Result<(), TestCaseError> {
        drop(self.guard.take());
        self.guard = Some(self.builder.clone().open()?);
        self.ids.iter_mut().for_each(|i| *i = None);
        Ok(())
    }

    fn checkpoint(&mut self, positions: &[(usize, u64)]) -> std::result::Result<(), TestCaseError> {
        let mut ps = Vec::new();
        for &(lane, p) in positions {
            ps.push((self.lane(lane)?, p));
        }
        self.guard()?.checkpoint(&ps, Vec::new())?;
        Ok(())
    }
}

fn compare(s: &mut Subject, m: &Model) -> std::result::Result<(), TestCaseError> {
    let g = s.guard()?;
    let stats = g.stats();
    prop_assert_eq!(g.epoch(), m.epoch);
    prop_assert_eq!(stats.epoch, m.epoch);
    prop_assert_eq!(stats.checked, m.checked);
    prop_assert_eq!(stats.recorded, m.recorded);
    prop_assert_eq!(stats.duplicates_same_position, m.dup_position);
    prop_assert_eq!(stats.duplicates_same_content, m.dup_content);
    prop_assert_eq!(
        stats.live_epochs,
        m.epoch.min(m.retention) + 1,
        "live epochs"
    );
    let (fps, offs) = m.live_counts();
    prop_assert_eq!(stats.live_fingerprints, fps);
    prop_assert_eq!(stats.live_offsets, offs);
    // With a budget of 0 every sealed epoch's hashes are on disk.
    let disk = if m.on_disk { m.sealed_hashes() } else { 0 };
    prop_assert_eq!(stats.disk_fingerprints, disk, "hashes on disk");
    prop_assert_eq!(stats.memory_fingerprints, fps - disk);
    // Only lanes already in use: asking creates a lane, and the order in
    // which lanes are created is part of what is tested.
    for lane in 0..m.live.len() {
        let Some(id) = s.ids[lane] else { continue };
        let g = s.guard()?;
        prop_assert_eq!(
            g.position(id),
            m.positions[lane],
            "position of lane {}",
            lane
        );
        let want: BTreeSet<u64> = m.live[lane]
            .values()
            .flat_map(|e| e.offsets.iter().copied())
            .collect();
        let got: BTreeSet<u64> = g.live_offsets(id).iter().collect();
        prop_assert_eq!(got, want, "live offsets of lane {}", lane);
    }
    Ok(())
}

/// Asks every identity of the domain, on every lane, starting from `first`.
fn sweep(s: &mut Subject, m: &mut Model, first: usize) -> std::result::Result<(), TestCaseError> {
    let fps = (0..IDS).flat_map(|i| [Fp::Id(i), Fp::Hash(i)]);
    let fps: Vec<Fingerprint> = fps.map(Fp::get).collect();
    let lanes = m.live.len();
    for lane in (0..lanes).map(|l| (l + first) % lanes) {
        let id = s.lane(lane)?;
        prop_assert_eq!(
            s.guard()?.position(id),
            m.positions[lane],
            "position of lane {}",
            lane
        );
        for o in 0..OFFSETS {
            let got = s.guard()?.check(id, Some(o), None)?;
            prop_assert_eq!(got, m.check(lane, Some(o), None), "offset {}", o);
        }
        for &f in &fps {
            let got = s.guard()?.check(id, None, Some(f))?;
            prop_assert_eq!(got, m.check(lane, None, Some(f)), "fingerprint {}", f);
        }
    }
    Ok(())
}

fn run_model(
    lanes: usize,
    retention: u32,
    chunk_records: usize,
    on_disk: bool,
    ops: Vec<Op>,
) -> std::result::Result<(), TestCaseError> {
    let dir = tempfile::tempdir()?;
    let builder = Guard::builder(dir.path())
        .retention_epochs(retention)
        .chunk_records(chunk_records)
        .max_memory_bytes(on_disk.then_some(0));
    let mut s = Subject {
        dir: dir.path().to_owned(),
        guard: Some(builder.clone().open()?),
        builder,
        ids: vec![None; lanes],
    };
    let mut m = Model::new(lanes, u64::from(retention), chunk_records, on_disk);
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Check(lane, o, f) => {
                let f = f.map(Fp::get);
                let id = s.lane(*lane)?;
                let got = s.guard()?.check(id, *o, f)?;
                prop_assert_eq!(got, m.check(*lane, *o, f), "step {}: {:?}", step, op);
            }
            Op::Record(lane, o, f) => {
                let f = f.map(Fp::get);
                let id = s.lane(*lane)?;
                let got = s.guard()?.record(id, *o, f)?;
                prop_assert_eq!(got, m.record(*lane, *o, f), "step {}: {:?}", step, op);
            }
            Op::CheckMany(batch) | Op::RecordMany(batch) => {
                let record = matches!(op, Op::RecordMany(_));
                let mut probes = Vec::new();
                let mut want = Vec::new();
                for &(lane, o, f) in batch {
                    let f = f.map(Fp::get);
                    probes.push(Probe::new(s.lane(lane)?, o, f));
                    want.push(if record {
                        m.record(lane, o, f)
                    } else {
                        m.check(lane, o, f)
                    });
                }
                let mut got = Vec::new();
                if record {
                    s.guard()?.record_many(&probes, &mut got)?;
                } else {
                    s.guard()?.check_many(&probes, &mut got)?;
                }
                prop_assert_eq!(got, want, "step {}: {:?}", step, op);
            }
            Op::Flush => {
                s.guard()?.flush()?;
                m.flush();
            }
            Op::Checkpoint(ps) => {
                s.checkpoint(ps)?;
                m.checkpoint(ps);
            }
            Op::Crash(first) => {
                s.reopen()?;
                m.crash();
                compare(&mut s, &m)?;
                sweep(&mut s, &mut m, *first)?;
            }
            Op::CleanReopen(ps, first) => {
                s.checkpoint(ps)?;
                m.checkpoint(ps);
                s.reopen()?;
                m.crash();
                compare(&mut s, &m)?;
                sweep(&mut s, &mut m, *first)?;
            }
        }
        compare(&mut s, &m)?;
    }
    // The folder holds only the marker and the database.
    let mut names: Vec<String> = std::fs::read_dir(&s.dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()?;
    names.sort();
    prop_assert_eq!(names, vec!["REPLAYGUARD".to_owned(), "db".to_owned()]);
    s.reopen()?;
    m.crash();
    sweep(&mut s, &mut m, 0)
}

fn model_cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(model_cases()))]

    #[test]
    fn guard_matches_the_model(
        (lanes, ops) in (2usize..=3).prop_flat_map(|lanes| {
            (Just(lanes), prop::collection::vec(op_strategy(lanes), 1..120))
        }),
        retention in 0u32..=3,
        chunk_records in 1usize..50,
        on_disk in any::<bool>(),
    ) {
        run_model(lanes, retention, chunk_records, on_disk, ops)?;
    }
}

#[test]
fn sealed_epochs_on_disk_answer_like_memory_across_reopens() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let open = |budget: Option<u64>| {
        Guard::builder(dir.path())
            .retention_epochs(5)
            .max_memory_bytes(budget)
            .open()
    };
    let mut g = open(Some(0))?;
    let lane = g.lane("t", 0);
    for e in 0..4u64 {
        for i in e * 1_000..(e + 1) * 1_000 {
            assert!(g.record(lane, Some(i), Some(hash(i)))?.is_fresh());
        }
        g.checkpoint(&[(lane, (e + 1) * 1_000)], Vec::new())?;
    }
    let s = g.stats();
    assert_eq!((s.disk_fingerprints, s.memory_fingerprints), (4_000, 0));
    assert_eq!(s.memory_floor, 4);
    assert!(s.disk_filter_bytes > 0 && s.disk_index_bytes > 0, "{s:?}");
    let check = |g: &mut Guard| -> Result<()> {
        for i in (0..4_000u64).step_by(3) {
            assert_eq!(
                g.check(lane, None, Some(hash(i)))?,
                dup(Reason::SameContent, i / 1_000),
                "{i}"
            );
            assert!(g.check(lane, None, Some(hash(i + 10_000)))?.is_fresh());
        }
        Ok(())
    };
    check(&mut g)?;
    let s = g.stats();
    // Every hit read the disk; about 1 miss in 100 did too.
    assert!(
        s.disk_hits >= 1_334 && s.disk_reads < s.disk_hits + 100,
        "{s:?}"
    );
    // The same, after a reopen with the budget, without one, and with it again.
    for budget in [Some(0), None, Some(0)] {
        drop(g);
        g = open(budget)?;
        check(&mut g)?;
        let s = g.stats();
        let on_disk = if budget.is_some() { 4_000 } else { 0 };
        assert_eq!(s.disk_fingerprints, on_disk, "{budget:?}");
        assert_eq!(s.live_fingerprints, 4_000);
    }
    // Epochs leave the disk by retention like any other: 0 and 1 go.
    for e in 4..6u64 {
        g.checkpoint(&[(lane, (e + 1) * 1_000)], Vec::new())?;
    }
    for i in (0..4_000u64).step_by(7) {
        assert_eq!(
            g.check(lane, None, Some(hash(i)))?.is_fresh(),
            i < 1_000,
            "{i}"
        );
    }
    // A hash of a dropped epoch is fresh again, and recorded anew.
    assert!(g.record(lane, Some(9_999), Some(hash(5)))?.is_fresh());
    g.checkpoint(&[(lane, 10_000)], Vec::new())?;
    assert_eq!(
        g.check(lane, None, Some(hash(5)))?,
        dup(Reason::SameContent, 6)
    );
    Ok(())
}

/// Records `epochs` epochs of `per` fresh records each, record `i` at
/// offset `i` with content `hash(i)`, each epoch closed by a checkpoint.
fn fresh_epochs(g: &mut Guard, lane: LaneId, epochs: u64, per: u64) -> Result<()> {
    for e in 0..epochs {
        for i in e * per..(e + 1) * per {
            assert!(g.record(lane, Some(i), Some(hash(i)))?.is_fresh());
        }
        g.checkpoint(&[(lane, (e + 1) * per)], Vec::new())?;
    }
    Ok(())
}

/// A guard keeping 5 closed epochs, all of them on disk.
fn budget_0(path: &std::path::Path) -> Result<Guard> {
    Guard::builder(path)
        .retention_epochs(5)
        .max_memory_bytes(Some(0))
        .open()
}

#[test]
fn a_disk_index_of_an_earlier_layout_is_rebuilt_from_the_chunks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let open = || budget_0(dir.path());
    let mut g = open()?;
    let lane = g.lane("t", 0);
    fresh_epochs(&mut g, lane, 3, 1_000)?;
    assert_eq!(g.stats().disk_fingerprints, 3_000);
    drop(g);
    // As an earlier build left it: its `sealed` keyspace is dropped at the
    // next open, and what it held must come back from the chunks.
    Store::open(dir.path())?.0.forget_sealed_layout()?;
    for _ in 0..2 {
        let mut g = open()?;
        let s = g.stats();
        assert_eq!((s.disk_fingerprints, s.memory_fingerprints), (3_000, 0));
        assert!(s.disk_index_bytes > 0, "{s:?}");
        for i in (0..3_000u64).step_by(7) {
            assert_eq!(
                g.check(lane, None, Some(hash(i)))?,
                dup(Reason::SameContent, i / 1_000),
                "{i}"
            );
        }
        assert!(g.stats().disk_hits > 400);
    }
    Ok(())
}

#[test]
fn a_disk_index_rebuilt_from_chunks_keeps_a_hash_in_its_newest_epoch() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let open = || budget_0(dir.path());
    let mut g = open()?;
    let lane = g.lane("t", 0);
    fresh_epochs(&mut g, lane, 2, 100)?;
    drop(g);
    // Hash 7 of epoch 0 in epoch 1 too, in a chunk of its own; then a disk
    // index to rebuild from the chunks at the next open.
    let (mut store, _) = Store::open(dir.path())?;
    let Fingerprint::Hash(h) = hash(7) else {
        unreachable!("a content fingerprint is a hash")
    };
    let chunk = Chunk {
        hashes: vec![h],
        ..Chunk::default()
    };
    let write = ChunkWrite {
        epoch: 1,
        lane: 0,
        seq: 1_000,
        chunk: &chunk,
    };
    store.write(&[write], &[], None, Durability::Sync)?;
    store.forget_sealed_layout()?;
    drop(store);
    let mut g = open()?;
    assert_eq!(g.stats().memory_fingerprints, 0);
    assert_eq!(
        g.check(lane, None, Some(hash(7)))?,
        dup(Reason::SameContent, 1)
    );
    // Once epoch 0 is dropped, hash 7 is still live in epoch 1.
    while g.oldest == 0 {
        let next = g.epoch() * 100;
        g.checkpoint(&[(lane, next)], Vec::new())?;
    }
    assert_eq!(g.oldest, 1);
    assert!(g.check(lane, None, Some(hash(8)))?.is_fresh());
    assert_eq!(
        g.check(lane, None, Some(hash(7)))?,
        dup(Reason::SameContent, 1)
    );
    Ok(())
}

/// What the guard keeps in a folder, read without changing it.
fn kept(path: &std::path::Path) -> Result<Vec<crate::store::KeptEntry>> {
    match Store::open_read_only(path)? {
        Some((store, _)) => store.dump(),
        None => Ok(Vec::new()),
    }
}

#[test]
fn inspect_reads_a_folder_as_the_guard_sees_it_and_changes_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // No budget: every epoch in memory, so nothing is indexed on disk yet.
    let mut g = Guard::builder(dir.path()).retention_epochs(2).open()?;
    let (a, b) = (g.lane("t", 0), g.lane("t", 1));
    for e in 0..4u64 {
        for i in e * 100..(e + 1) * 100 {
            g.record(a, Some(i), Some(hash(i)))?;
            if i % 2 == 0 {
                g.record(b, Some(i), Some(Fingerprint::id(i)))?;
            }
        }
        g.checkpoint(&[(a, (e + 1) * 100), (b, (e + 1) * 100)], b"sink".to_vec())?;
    }
    // The open epoch holds flushed records too.
    for i in 400..450u64 {
        g.record(a, Some(i), Some(hash(i)))?;
    }
    g.flush()?;
    let mut expected: Vec<(u64, String, i32, u64)> = g
        .epoch_table()
        .into_iter()
        .map(|(lane, e, fps, offsets)| (e, lane.topic, lane.partition, fps * 1_000_000 + offsets))
        .collect();
    expected.sort();
    drop(g);

    let before = kept(dir.path())?;
    let view = Guard::inspect(dir.path())?;
    let again = Guard::inspect(dir.path())?;
    assert_eq!(view, again);
    assert_eq!(
        kept(dir.path())?,
        before,
        "inspect changed what the guard keeps"
    );
    assert!(!before.is_empty());

    let mut seen: Vec<(u64, String, i32, u64)> = view
        .content
        .iter()
        .map(|c| {
            let fps = c.hashes + c.ids;
            (
                c.epoch,
                c.lane.topic.clone(),
                c.lane.partition,
                fps * 1_000_000 + c.offsets,
            )
        })
        .collect();
    seen.sort();
    assert_eq!(seen, expected);
    assert_eq!(view.epoch, 4);
    assert_eq!((view.open_hashes(), view.sealed_hashes()), (50, 200));
    assert_eq!(
        view.manifest.as_ref().map(|m| m.sink.clone()),
        Some(b"sink".to_vec())
    );
    assert_eq!((view.disk_index_through, view.leftover_chunks), (None, 0));
    assert!(view.disk_filter_bytes > 0);
    assert!(view.memory_sealed_on_disk < view.memory_all_in, "{view:?}");

    // What the guard itself does with a budget of 0, which inspect used to
    // open with: it writes the on-disk index of the sealed hashes.
    drop(budget_0(dir.path())?);
    assert_ne!(kept(dir.path())?, before);
    let view = Guard::inspect(dir.path())?;
    assert_eq!(view.disk_index_through, Some(3));
    assert!(view.disk_index_bytes > 0);

    // Not a state folder, and a folder in use.
    let empty = tempfile::tempdir()?;
    assert!(matches!(
        Guard::inspect(empty.path()),
        Err(Error::StateFolder { .. })
    ));
    assert!(std::fs::read_dir(empty.path())?.next().is_none());
    let _running = Guard::builder(dir.path()).open()?;
    assert!(matches!(
        Guard::inspect(dir.path()),
        Err(Error::InUse { .. })
    ));
    Ok(())
}

#[test]
fn a_budget_of_0_keeps_no_sealed_epoch_in_memory_even_after_empty_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let open = || budget_0(dir.path());
    let mut g = open()?;
    let lane = g.lane("t", 0);
    for i in 0..1_000u64 {
        g.record(lane, Some(i), Some(hash(i)))?;
    }
    g.checkpoint(&[(lane, 1_000)], Vec::new())?;
    // Epoch 1 closes empty, and the open epoch 2 stays empty.
    g.checkpoint(&[(lane, 1_000)], Vec::new())?;
    let live = g.stats();
    assert_eq!((live.memory_floor, live.disk_fingerprints), (2, 1_000));
    drop(g);
    let g = open()?;
    let s = g.stats();
    assert_eq!(
        (s.memory_floor, s.disk_fingerprints, s.memory_fingerprints),
        (2, 1_000, 0)
    );
    Ok(())
}

#[test]
fn batched_calls_answer_like_single_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut g = Guard::builder(dir.path()).retention_epochs(2).open()?;
    let a = g.lane("t", 0);
    let b = g.lane("t", 1);
    let probes: Vec<Probe> = (0..300u64)
        .map(|i| {
            let lane = if i % 3 == 0 { b } else { a };
            // Repeats inside the batch: every fifth repeats content, every
            // seventh a position.
            let fp = Some(if i % 5 == 0 && i > 0 {
                hash(i - 1)
            } else {
                hash(i)
            });
            let offset = if i % 7 == 0 { i.saturating_sub(1) } else { i };
            Probe::new(lane, Some(offset), fp)
        })
        .collect();
    let mut verdicts = Vec::new();
    g.record_many(&probes[..200], &mut verdicts)?;
    assert_eq!(verdicts.len(), 200);
    g.checkpoint(&[(a, 200), (b, 200)], Vec::new())?;
    let dir2 = tempfile::tempdir()?;
    let mut single = Guard::builder(dir2.path()).retention_epochs(2).open()?;
    let (a2, b2) = (single.lane("t", 0), single.lane("t", 1));
    let map = |l: LaneId| if l == a { a2 } else { b2 };
    let mut want = Vec::new();
    for p in &probes[..200] {
        want.push(single.record(map(p.lane), p.offset, p.fp)?);
    }
    assert_eq!(verdicts, want);
    single.checkpoint(&[(a2, 200), (b2, 200)], Vec::new())?;
    g.check_many(&probes, &mut verdicts)?;
    let mut want = Vec::new();
    for p in &probes {
        want.push(single.check(map(p.lane), p.offset, p.fp)?);
    }
    assert_eq!(verdicts, want);
    assert!(verdicts.iter().filter(|v| v.is_fresh()).count() >= 90);
    assert_eq!(g.stats(), {
        let mut s = single.stats();
        s.disk_bytes = g.stats().disk_bytes;
        s.disk_index_bytes = g.stats().disk_index_bytes;
        s.last_checkpoint = g.stats().last_checkpoint;
        s.last_recovery = g.stats().last_recovery;
        s
    });
    // An unknown lane anywhere in the batch changes nothing.
    let mut bad = probes.clone();
    bad[150].lane = LaneId(9);
    let before = g.stats();
    assert!(matches!(
        g.record_many(&bad, &mut verdicts),
        Err(Error::UnknownLane(9))
    ));
    assert_eq!(g.stats(), before);
    assert!(verdicts.is_empty());
    // A batch of checks finds the unknown lane only when it reaches it:
    // what it counted before is taken back.
    assert!(matches!(
        g.check_many(&bad, &mut verdicts),
        Err(Error::UnknownLane(9))
    ));
    assert_eq!(g.stats(), before);
    assert!(verdicts.is_empty());
    Ok(())
}

/// Checks in batches answer as one check at a time, with epochs in memory
/// and on disk, content hashes and ids, with and without offsets, over two
/// lanes, and batches longer and shorter than the fetch distances.
#[test]
fn batched_checks_answer_like_single_ones_in_memory_and_on_disk() -> Result<()> {
    for budget in [None, Some(0)] {
        let dir = tempfile::tempdir()?;
        let mut g = Guard::builder(dir.path())
            .retention_epochs(5)
            .max_memory_bytes(budget)
            .open()?;
        let lanes = [g.lane("t", 0), g.lane("t", 1)];
        let fp = |i: u64| {
            if i % 4 == 3 {
                Fingerprint::id(i)
            } else {
                hash(i)
            }
        };
        // Three sealed epochs and an open one, each of 500 records a lane.
        for e in 0..4u64 {
            for i in e * 500..(e + 1) * 500 {
                for &l in &lanes {
                    assert!(g.record(l, Some(i), Some(fp(i)))?.is_fresh());
                }
            }
            if e < 3 {
                g.checkpoint(
                    &[(lanes[0], (e + 1) * 500), (lanes[1], (e + 1) * 500)],
                    Vec::new(),
                )?;
            }
        }
        assert_eq!(g.stats().disk_fingerprints > 0, budget.is_some());
        // Probes: held and fresh content, held and fresh offsets, none.
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let probes: Vec<Probe> = (0..3_000u64)
            .map(|k| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = x % 4_000;
                let offset = match k % 3 {
                    0 => None,
                    1 => Some(i),
                    _ => Some(10_000 + k),
                };
                let content = (k % 5 != 4).then(|| fp(i));
                Probe::new(lanes[(x >> 40) as usize % 2], offset, content)
            })
            .collect();
        let mut verdicts = Vec::new();
        for len in [0, 1, 11, 12, 13, 33, 64, 65, 3_000] {
            let batch = &probes[..len];
            g.check_many(batch, &mut verdicts)?;
            let mut want = Vec::new();
            for p in batch {
                want.push(g.check(p.lane, p.offset, p.fp)?);
            }
            assert_eq!(verdicts, want, "budget {budget:?}, {len} probes");
        }
        let fresh = verdicts.iter().filter(|v| v.is_fresh()).count();
        assert!((500..2_500).contains(&fresh), "{fresh} fresh of 3000");
        if budget.is_some() {
            assert!(g.stats().disk_hits > 100, "{:?}", g.stats());
        }
    }
    Ok(())
}

mod journal {
    use super::super::*;
    use crate::changelog::{Shipment, Shipped};

    fn open(dir: &Path) -> Guard {
        Guard::builder(dir)
            .retention_epochs(1)
            .journal(true)
            .open()
            .unwrap_or_else(|e| panic!("open: {e}"))
    }

    fn hash(n: u64) -> Option<Fingerprint> {
        Some(Fingerprint::content(None, Some(&n.to_be_bytes())))
    }

    fn content(shipped: &[Shipment]) -> Chunk {
        let mut all = Chunk::default();
        for s in shipped {
            if let Shipped::Parts(parts) = &s.what {
                for p in parts {
                    crate::changelog::merge(&mut all, p.clone());
                }
            }
        }
        all
    }

    #[test]
    fn the_open_epoch_ships_whole_and_dropped_epochs_leave_by_tombstones_across_a_restart()
    -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut g = open(dir.path());
        let lane = g.lane("t", 3);
        for n in 0..5 {
            g.record(lane, Some(n), hash(n))?;
        }
        g.flush()?;
        g.record(lane, Some(5), hash(5))?;
        let shipped = g.ship_open()?;
        assert_eq!(shipped.len(), 1);
        assert_eq!(
            (
                shipped[0].topic.as_str(),
                shipped[0].partition,
                shipped[0].epoch
            ),
            ("t", 3, 0)
        );
        let c = content(&shipped);
        assert_eq!(c.hashes.len(), 6, "the flushed chunk and the pending one");
        assert_eq!(c.offsets.len(), 6);
        g.checkpoint(&[(lane, 6)], Vec::new())?;
        assert_eq!(g.take_after_checkpoint(), Vec::new(), "epoch 0 is kept");
        // Epoch 1: two records, written, then a crash before its checkpoint.
        g.record(lane, Some(6), hash(6))?;
        g.record(lane, Some(7), hash(7))?;
        g.flush()?;
        drop(g);
        let mut g = open(dir.path());
        let lane = g.lane("t", 3);
        let again = g.ship_open()?;
        assert_eq!(content(&again).hashes.len(), 2, "the open epoch, reloaded");
        assert_eq!(again[0].epoch, 1);
        g.checkpoint(&[(lane, 8)], Vec::new())?;
        // Epoch 0, shipped before the restart, is dropped: its tombstone.
        let after = g.take_after_checkpoint();
        assert_eq!(
            after,
            vec![Shipment {
                topic: "t".into(),
                partition: 3,
                epoch: 0,
                what: Shipped::Tombstones(1),
            }]
        );
        Ok(())
    }

    #[test]
    fn imported_identities_are_duplicates_and_ship_as_this_guards() -> Result<()> {
        let (a, b) = (tempfile::tempdir()?, tempfile::tempdir()?);
        let mut g = open(a.path());
        let lane = g.lane("t", 0);
        for n in 10..20 {
            g.record(lane, Some(n), hash(n))?;
        }
        let c = content(&g.ship_open()?);
        let mut other = open(b.path());
        let lane_b = other.lane("t", 0);
        other.record(lane_b, Some(10), hash(10))?;
        assert_eq!(
            other.import(lane_b, &c)?,
            18,
            "9 hashes and 9 offsets are new"
        );
        assert_eq!(other.import(lane_b, &c)?, 0);
        for n in 10..20 {
            assert!(
                !other.check(lane_b, None, hash(n))?.is_fresh(),
                "{n} by content"
            );
            assert!(
                !other.check(lane_b, Some(n), None)?.is_fresh(),
                "{n} by position"
            );
        }
        assert!(other.check(lane_b, Some(20), hash(20))?.is_fresh());
        assert_eq!(content(&other.ship_open()?).hashes.len(), 10);
        Ok(())
    }
}
