//! The engine survives `kill -9` at any moment: a child process records
//! fingerprints, flushes and checkpoints in a loop and is killed with
//! SIGKILL at random moments, many times. After each kill the state folder
//! is reopened and must hold exactly what the child made durable: every
//! record it flushed or checkpointed before the kill, the positions of the
//! last completed manifest, and nothing that was never recorded.
//!
//! The child is this test binary, started again with `CHILD_STATE` set. It
//! logs each step to a file *around* the call that makes it durable (`P`
//! before a flush, `F` after it; `B` before a checkpoint, `C` after it).
//! The kill kills the process, not the machine, so a line written before
//! the kill is in the file: the log needs no fsync.
//!
//! A third run gives the guard a memory budget of 0, so every checkpoint
//! moves the sealed epochs' content hashes to disk: kills land in those
//! writes too, and each reopen answers the sealed content from disk.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use replayguard::{Durability, Error, Fingerprint, Guard, LaneId, Reason, Result, Verdict};

const CHILD_STATE: &str = "REPLAYGUARD_CRASH_STATE";
const CHILD_LOG: &str = "REPLAYGUARD_CRASH_LOG";
const CHILD_SEED: &str = "REPLAYGUARD_CRASH_SEED";
const CHILD_RETENTION: &str = "REPLAYGUARD_CRASH_RETENTION";
const CHILD_ON_DISK: &str = "REPLAYGUARD_CRASH_ON_DISK";

/// Larger than any flush interval below, so that only the explicit,
/// logged flushes and checkpoints write chunks.
const CHUNK_RECORDS: usize = 100_000;
const LANES: usize = 2;

fn fp(lane: usize, offset: u64) -> Fingerprint {
    Fingerprint::content(Some(&[lane as u8]), Some(&offset.to_be_bytes()))
}

/// `retention`: closed epochs kept besides the open one; `on_disk`: a
/// memory budget of 0, so sealed epochs keep their hashes on disk.
fn open(state: &Path, retention: u32, on_disk: bool) -> Result<(Guard, [LaneId; LANES])> {
    let mut g = Guard::builder(state)
        .retention_epochs(retention)
        .chunk_records(CHUNK_RECORDS)
        .durability(Durability::Process)
        .max_memory_bytes(on_disk.then_some(0))
        .open()?;
    let lanes = [g.lane("crash", 0), g.lane("crash", 1)];
    Ok((g, lanes))
}

// --- The child ----------------------------------------------------------

struct Log(std::fs::File);

impl Log {
    /// One `write` per line, so a kill never leaves half a line... and if it
    /// did, the parent ignores a line it cannot parse at the end.
    fn line(&mut self, tag: &str, nums: &[u64]) -> Result<()> {
        let mut s = tag.to_owned();
        for n in nums {
            s.push(' ');
            s.push_str(&n.to_string());
        }
        s.push('\n');
        self.0.write_all(s.as_bytes())?;
        Ok(())
    }
}

#[test]
fn crash_child() -> Result<()> {
    let (Ok(state), Ok(log), Ok(seed), Ok(retention)) = (
        std::env::var(CHILD_STATE),
        std::env::var(CHILD_LOG),
        std::env::var(CHILD_SEED),
        std::env::var(CHILD_RETENTION),
    ) else {
        return Ok(());
    };
    let seed: u64 = seed.parse().map_err(|_| Error::Config("bad seed".into()))?;
    let retention = retention
        .parse()
        .map_err(|_| Error::Config("bad retention".into()))?;
    let on_disk = std::env::var_os(CHILD_ON_DISK).is_some();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut log = Log(OpenOptions::new().create(true).append(true).open(log)?);
    let (mut g, lanes) = open(Path::new(&state), retention, on_disk)?;
    let mut next: [u64; LANES] = [0; LANES];
    for (l, &lane) in lanes.iter().enumerate() {
        next[l] = g.position(lane).unwrap_or(0);
    }
    log.line("O", &[g.epoch(), next[0], next[1]])?;
    let mut until_flush = rng.random_range(20..400);
    // Sometimes early, so that checkpoints often land during the replay
    // of what the previous run had handled.
    let mut until_checkpoint = rng.random_range(1..3_000);
    loop {
        let l = rng.random_range(0..LANES);
        let o = next[l];
        match g.record(lanes[l], Some(o), Some(fp(l, o)))? {
            Verdict::Fresh => {}
            // Replayed after a restart: it was durable before the kill.
            Verdict::Duplicate {
                reason: Reason::SamePosition,
                ..
            } => {}
            other => {
                return Err(Error::Config(format!("lane {l} offset {o}: {other:?}")));
            }
        }
        next[l] += 1;
        until_flush -= 1;
        until_checkpoint -= 1;
        if until_checkpoint == 0 {
            let e = g.epoch() + 1;
            log.line("B", &[e, next[0], next[1]])?;
            let positions = [(lanes[0], next[0]), (lanes[1], next[1])];
            let report = g.checkpoint(&positions, e.to_string().into_bytes())?;
            assert_eq!(report.epoch, e);
            log.line("C", &[e, next[0], next[1]])?;
            until_checkpoint = rng.random_range(300..3_000);
        } else if until_flush == 0 {
            log.line("P", &[next[0], next[1]])?;
            g.flush()?;
            log.line("F", &[next[0], next[1]])?;
            until_flush = rng.random_range(20..400);
        }
    }
}

// --- The parent ---------------------------------------------------------

/// How an epoch was opened: the positions of its checkpoint, and the
/// frontier (everything below it had been handled, in this or an earlier
/// epoch). The two differ when the checkpoint landed during a replay.
#[derive(Clone, Copy, Debug, Default)]
struct Opened {
    positions: [u64; LANES],
    frontier: [u64; LANES],
}

/// What the parent knows from all rounds so far.
#[derive(Debug, Default)]
struct Known {
    /// Per lane: every offset below this was made durable.
    hi: [u64; LANES],
    /// Per epoch, from the latest `B` line for it.
    opened: BTreeMap<u64, Opened>,
    /// The epoch of the last manifest seen on reopen.
    epoch: u64,
}

impl Known {
    fn opened(&self, epoch: u64, n: usize) -> Result<Opened> {
        if epoch == 0 {
            return Ok(Opened::default());
        }
        self.opened
            .get(&epoch)
            .copied()
            .ok_or_else(|| Error::Config(format!("round {n}: nothing logged for epoch {epoch}")))
    }
}

/// One round's log, reduced to what the check needs.
#[derive(Debug, Default)]
struct Round {
    opened: bool,
    /// Highest offsets per lane confirmed durable (`F` or `C`).
    done: [u64; LANES],
    /// Offsets of a write that began and was not confirmed (`P` or `B`).
    begun: Option<[u64; LANES]>,
    /// The epoch of a checkpoint that began and was not confirmed.
    begun_epoch: Option<u64>,
    /// The last confirmed checkpoint epoch.
    checkpointed: Option<u64>,
    /// Checkpoints begun behind the frontier, while replaying.
    during_replay: usize,
}

fn parse(log: &str, known: &mut Known) -> Round {
    let mut r = Round::default();
    for line in log.lines() {
        let mut parts = line.split(' ');
        let tag = parts.next().unwrap_or("");
        let nums: Vec<u64> = parts.filter_map(|p| p.parse().ok()).collect();
        match (tag, nums.as_slice()) {
            ("O", [_, _, _]) => r.opened = true,
            ("P", [a, b]) => r.begun = Some([*a, *b]),
            ("F", [a, b]) => {
                r.done = [r.done[0].max(*a), r.done[1].max(*b)];
                r.begun = None;
            }
            ("B", [e, a, b]) => {
                r.begun = Some([*a, *b]);
                r.begun_epoch = Some(*e);
                // The child resumed at its manifest's positions, so what was
                // durable before this round counts as handled too.
                let frontier = [(*a).max(known.hi[0]), (*b).max(known.hi[1])];
                if frontier != [*a, *b] {
                    r.during_replay += 1;
                }
                let positions = [*a, *b];
                known.opened.insert(
                    *e,
                    Opened {
                        positions,
                        frontier,
                    },
                );
            }
            ("C", [e, a, b]) => {
                r.done = [r.done[0].max(*a), r.done[1].max(*b)];
                r.begun = None;
                r.begun_epoch = None;
                r.checkpointed = Some(*e);
            }
            // A torn last line, or libtest's own output: ignored.
            _ => {}
        }
    }
    r
}

/// Reopens the folder after a kill and checks it against what the round's
/// log says was made durable. Returns the content hashes found on disk.
fn verify(
    state: &Path,
    (retention, on_disk): (u32, bool),
    round: &Round,
    known: &mut Known,
    n: usize,
) -> Result<u64> {
    let (mut g, lanes) = open(state, retention, on_disk)?;
    let e = g.epoch();
    // The manifest is the last completed checkpoint, or the one in flight.
    let confirmed = round.checkpointed.unwrap_or(known.epoch);
    let allowed: Vec<u64> = std::iter::once(confirmed)
        .chain(round.begun_epoch)
        .collect();
    assert!(
        allowed.contains(&e),
        "round {n}: epoch {e}, expected one of {allowed:?}"
    );
    known.epoch = e;
    // Checkpoints begun for later epochs never completed: forget them.
    known.opened.retain(|&k, _| k <= e);
    let now = known.opened(e, n)?;
    assert_eq!(
        g.manifest().map(|m| m.sink.clone()),
        (e > 0).then(|| e.to_string().into_bytes()),
        "round {n}: sink"
    );
    // The oldest live epoch, and how it was opened.
    let oldest = e.saturating_sub(u64::from(retention));
    let base = known.opened(oldest, n)?;
    let mut live_fps = 0;
    for (l, &lane) in lanes.iter().enumerate() {
        assert_eq!(
            g.position(lane),
            (e > 0).then_some(now.positions[l]),
            "round {n} lane {l}: position"
        );
        let done = known.hi[l].max(round.done[l]);
        let in_flight = round.begun.map_or(done, |b| done.max(b[l]));
        let offsets = g.live_offsets(lane);
        let first_kept = base.frontier[l];
        let (lo, hi) = match (offsets.min(), offsets.max()) {
            (Some(lo), Some(hi)) => (lo, hi + 1),
            _ => (first_kept, first_kept),
        };
        // Everything made durable before the kill is known...
        assert!(
            hi == done || hi == in_flight,
            "round {n} lane {l}: known up to {hi}, durable up to {done}, in flight {in_flight}"
        );
        // ...as one unbroken run, with nothing else...
        assert_eq!(
            offsets.len(),
            hi - lo,
            "round {n} lane {l}: holes in {lo}..{hi}"
        );
        // ...that covers every position a restart replays, and no more than
        // the retention (plus positions carried out of dropped epochs,
        // which are at or past the position of some live checkpoint).
        assert!(
            base.positions[l] <= lo && lo <= now.positions[l].min(first_kept),
            "round {n} lane {l}: known from {lo}; epoch {oldest} opened at {base:?}, \
             epoch {e} at {now:?}"
        );
        // Content is kept with the epoch that handled it.
        let step = ((hi.saturating_sub(first_kept)) / 50).max(1) as usize;
        let last = hi.checked_sub(1).filter(|&x| x >= first_kept);
        for o in (first_kept..hi).step_by(step).chain(last) {
            let v = g.check(lane, None, Some(fp(l, o)))?;
            assert!(
                matches!(v, Verdict::Duplicate { reason: Reason::SameContent, epoch } if epoch >= oldest),
                "round {n} lane {l}: content of {o} unknown: {v:?}"
            );
        }
        for o in hi..hi + 50 {
            assert!(
                g.check(lane, Some(o), Some(fp(l, o)))?.is_fresh(),
                "round {n}: {o}"
            );
        }
        // Never recorded anywhere: content of a lane the child does not use.
        assert!(g.check(lane, None, Some(fp(l + 7, lo)))?.is_fresh());
        known.hi[l] = hi;
        live_fps += hi - first_kept;
    }
    let stats = g.stats();
    assert_eq!(
        stats.live_fingerprints, live_fps,
        "round {n}: live fingerprints"
    );
    if on_disk {
        // Everything below the open epoch is on disk, nothing above it.
        assert_eq!(stats.memory_floor, e, "round {n}: memory floor");
        assert_eq!(
            stats.disk_fingerprints + stats.memory_fingerprints,
            live_fps,
            "round {n}: split"
        );
    } else {
        assert_eq!(stats.disk_fingerprints, 0, "round {n}: nothing on disk");
    }
    Ok(stats.disk_fingerprints)
}

#[test]
fn engine_state_survives_sigkill_with_the_default_retention() -> Result<()> {
    kill_loop(0, false)
}

#[test]
fn engine_state_survives_sigkill_with_two_closed_epochs_kept() -> Result<()> {
    kill_loop(2, false)
}

#[test]
fn engine_state_survives_sigkill_with_sealed_epochs_on_disk() -> Result<()> {
    kill_loop(2, true)
}

/// Kills a child at random moments, at least 30 times and for about 20 s,
/// and checks the state after each kill.
fn kill_loop(retention: u32, on_disk: bool) -> Result<()> {
    // CRASH_KEEP=1 keeps the folder (state and round logs) for a post-mortem.
    let dir = tempfile::Builder::new()
        .prefix("crash-engine")
        .disable_cleanup(std::env::var_os("CRASH_KEEP").is_some())
        .tempdir()?;
    eprintln!("state and logs in {}", dir.path().display());
    let state = dir.path().join("state");
    let exe = std::env::current_exe()?;
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("CRASH_SEED={seed} reproduces the kill schedule");
    let mut rng = StdRng::seed_from_u64(seed);
    let started = Instant::now();
    let (mut kills, mut kills_in_open, mut rounds_with_checkpoint) = (0, 0, 0);
    let mut during_replay = 0;
    let mut known = Known::default();
    let (mut kills_in_write, mut writes_that_landed) = (0, 0);
    let mut rounds_from_disk = 0;
    // About 30 s, at least 30 kills, at most 150.
    while kills < 150 && (kills < 30 || started.elapsed() < Duration::from_secs(20)) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "only {kills} kills in 120 s"
        );
        let n = kills;
        let log_path = dir.path().join(format!("round-{n}.log"));
        let err_path = dir.path().join(format!("round-{n}.err"));
        let mut command = Command::new(&exe);
        if on_disk {
            command.env(CHILD_ON_DISK, "1");
        }
        let mut child = command
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_STATE, &state)
            .env(CHILD_LOG, &log_path)
            .env(CHILD_SEED, rng.random::<u64>().to_string())
            .env(CHILD_RETENTION, retention.to_string())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err_path)?)
            .spawn()?;
        // Mostly kill while it works; sometimes while it recovers.
        let during_open = rng.random_ratio(1, 6);
        if !during_open {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !std::fs::read_to_string(&log_path).is_ok_and(|s| s.starts_with('O')) {
                if let Some(status) = child.try_wait()? {
                    panic!(
                        "round {n}: child exited before opening ({status}): {}",
                        std::fs::read_to_string(&err_path)?
                    );
                }
                assert!(Instant::now() < deadline, "round {n}: child never opened");
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let pause = if during_open {
            rng.random_range(0..60)
        } else {
            rng.random_range(1..400)
        };
        std::thread::sleep(Duration::from_millis(pause));
        if let Some(status) = child.try_wait()? {
            panic!(
                "round {n}: child exited by itself ({status}): {}",
                std::fs::read_to_string(&err_path)?
            );
        }
        child.kill()?;
        let status = child.wait()?;
        assert_eq!(status.signal(), Some(libc::SIGKILL), "round {n}: {status}");
        kills += 1;
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let round = parse(&log, &mut known);
        if !round.opened {
            kills_in_open += 1;
        }
        if round.checkpointed.is_some() {
            rounds_with_checkpoint += 1;
        }
        during_replay += round.during_replay;
        let before = known.hi;
        let disk = verify(&state, (retention, on_disk), &round, &mut known, n)?;
        if disk > 0 {
            rounds_from_disk += 1;
        }
        if let Some(begun) = round.begun {
            kills_in_write += 1;
            let done = [0, 1].map(|l| before[l].max(round.done[l]));
            if known.hi != done && known.hi == [0, 1].map(|l| done[l].max(begun[l])) {
                writes_that_landed += 1;
            }
        }
    }
    eprintln!(
        "retention {retention}: {kills} kills in {:.1} s ({kills_in_open} before the child had opened, \
         {kills_in_write} inside a flush or checkpoint, {writes_that_landed} of which \
         reached the disk; {rounds_with_checkpoint} rounds with a completed \
         checkpoint, {during_replay} checkpoints during a replay); final epoch {}, \
         durable offsets per lane {:?}",
        started.elapsed().as_secs_f64(),
        known.epoch,
        known.hi
    );
    assert!(kills >= 30);
    assert!(
        rounds_with_checkpoint >= 5,
        "too few checkpoints to mean much"
    );
    assert!(known.epoch >= 5, "too few checkpoints survived");
    if on_disk {
        assert!(
            rounds_from_disk * 2 >= kills,
            "only {rounds_from_disk} of {kills} reopens had hashes on disk"
        );
    }
    Ok(())
}
