//! After a failed store write the guard refuses all work with
//! `Error::Poisoned` until it is reopened, and the reopen recovers the last
//! durable state (STYLE.md: poison after a failed write or fsync).
//!
//! The failure is injected through the `REPLAYGUARD_FAIL_AT` environment
//! variable (feature `fault-injection`). The environment is process-wide, so
//! these tests live in their own binary and take `ENV` one at a time.

use std::path::Path;
use std::sync::Mutex;

use replayguard::{Error, Fingerprint, Guard, LaneId, Result, Verdict};

static ENV: Mutex<()> = Mutex::new(());

/// Sets `REPLAYGUARD_FAIL_AT=store-write` while alive.
struct FailWrites;

impl FailWrites {
    fn on() -> Self {
        // SAFETY: every test in this binary holds `ENV` while it touches the
        // environment or the guard, so nothing reads it concurrently.
        unsafe { std::env::set_var("REPLAYGUARD_FAIL_AT", "store-write") };
        FailWrites
    }
}

impl Drop for FailWrites {
    fn drop(&mut self) {
        // SAFETY: as in `FailWrites::on`.
        unsafe { std::env::remove_var("REPLAYGUARD_FAIL_AT") };
    }
}

fn fp(offset: u64) -> Fingerprint {
    Fingerprint::content(None, Some(&offset.to_be_bytes()))
}

fn open(dir: &Path, chunk_records: usize) -> Result<(Guard, LaneId)> {
    let mut g = Guard::builder(dir)
        .retention_epochs(1)
        .chunk_records(chunk_records)
        .open()?;
    let lane = g.lane("t", 0);
    Ok((g, lane))
}

fn record_range(g: &mut Guard, lane: LaneId, range: std::ops::Range<u64>) -> Result<()> {
    for o in range {
        assert_eq!(g.record(lane, Some(o), Some(fp(o)))?, Verdict::Fresh);
    }
    Ok(())
}

/// Epoch 0 checkpointed at 50, 50..80 flushed in epoch 1, 80..90 pending.
fn prepare(dir: &Path) -> Result<(Guard, LaneId)> {
    let (mut g, lane) = open(dir, 10_000)?;
    record_range(&mut g, lane, 0..50)?;
    g.checkpoint(&[(lane, 50)], b"sink-1".to_vec())?;
    record_range(&mut g, lane, 50..80)?;
    g.flush()?;
    record_range(&mut g, lane, 80..90)?;
    Ok((g, lane))
}

fn assert_poisoned<T: std::fmt::Debug>(r: Result<T>) {
    match r {
        Err(Error::Poisoned { cause }) => {
            assert!(cause.contains("injected failure"), "{cause}");
        }
        other => panic!("expected Error::Poisoned, got {other:?}"),
    }
}

/// Every call that does work is refused.
fn assert_refuses_everything(g: &mut Guard, lane: LaneId) {
    assert_poisoned(g.check(lane, Some(1), None));
    assert_poisoned(g.check(lane, Some(1_000), Some(fp(1_000))));
    assert_poisoned(g.record(lane, Some(1_000), Some(fp(1_000))));
    assert_poisoned(g.flush());
    assert_poisoned(g.checkpoint(&[(lane, 1_000)], Vec::new()));
}

/// What is durable: the checkpoint at 50 and the flushed 50..80.
fn assert_recovered(dir: &Path, epoch: u64, position: u64, known: u64) -> Result<()> {
    let (mut g, lane) = open(dir, 10_000)?;
    assert_eq!(g.epoch(), epoch);
    assert_eq!(g.position(lane), Some(position));
    let offsets: Vec<u64> = g.live_offsets(lane).iter().collect();
    assert_eq!(offsets, (0..known).collect::<Vec<_>>());
    for o in 0..known {
        assert!(!g.check(lane, None, Some(fp(o)))?.is_fresh(), "{o}");
    }
    for o in known..known + 20 {
        assert!(g.check(lane, Some(o), Some(fp(o)))?.is_fresh(), "{o}");
    }
    // The reopened guard works, and the refused record can be made again.
    assert!(g.record(lane, Some(known), Some(fp(known)))?.is_fresh());
    g.checkpoint(&[(lane, known + 1)], Vec::new())?;
    Ok(())
}

#[test]
fn a_failed_flush_poisons_until_reopen() -> Result<()> {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let (mut g, lane) = prepare(dir.path())?;
    {
        let _fail = FailWrites::on();
        let e = g.flush().err();
        assert!(
            matches!(&e, Some(Error::Io(io)) if io.to_string().contains("injected")),
            "{e:?}"
        );
        assert!(e.is_some_and(|e| e.is_poisoning()));
        assert_refuses_everything(&mut g, lane);
    }
    // The disk is fine again, yet the guard stays stopped: it cannot know
    // what reached the disk.
    assert_refuses_everything(&mut g, lane);
    drop(g);
    assert_recovered(dir.path(), 1, 50, 80)
}

#[test]
fn a_failed_checkpoint_poisons_and_leaves_the_previous_manifest() -> Result<()> {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let (mut g, lane) = prepare(dir.path())?;
    let before = g.manifest().cloned();
    {
        let _fail = FailWrites::on();
        let e = g.checkpoint(&[(lane, 90)], b"sink-2".to_vec()).err();
        assert!(matches!(e, Some(Error::Io(_))), "{e:?}");
    }
    // Nothing of the failed checkpoint took effect in memory either.
    assert_eq!(g.epoch(), 1);
    assert_eq!(g.position(lane), Some(50));
    assert_eq!(g.manifest().cloned(), before);
    assert_refuses_everything(&mut g, lane);
    drop(g);
    assert_recovered(dir.path(), 1, 50, 80)?;
    Ok(())
}

#[test]
fn a_failed_chunk_write_inside_record_poisons() -> Result<()> {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let (mut g, lane) = open(dir.path(), 10)?;
    record_range(&mut g, lane, 0..25)?;
    g.checkpoint(&[(lane, 25)], Vec::new())?;
    record_range(&mut g, lane, 25..35)?;
    // 25..35 filled a chunk and went to the store; the 10th record from
    // here fills the next one, and that write fails.
    {
        let _fail = FailWrites::on();
        record_range(&mut g, lane, 35..44)?;
        let e = g.record(lane, Some(44), Some(fp(44))).err();
        assert!(matches!(e, Some(Error::Io(_))), "{e:?}");
        assert_refuses_everything(&mut g, lane);
    }
    assert_refuses_everything(&mut g, lane);
    drop(g);
    assert_recovered(dir.path(), 1, 25, 35)
}

#[test]
fn without_the_fault_nothing_is_poisoned() -> Result<()> {
    // The control: the same steps without the fault point succeed, so the
    // tests above fail for the injected reason only.
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir()?;
    let (mut g, lane) = prepare(dir.path())?;
    g.flush()?;
    assert!(!g.check(lane, Some(85), None)?.is_fresh());
    drop(g);
    assert_recovered(dir.path(), 1, 50, 90)
}
