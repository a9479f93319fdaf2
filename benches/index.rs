//! The in-memory index, through the public API: `Guard::check` against a
//! large set of live content fingerprints (in the open epoch's hash table
//! and in a sealed epoch), and the memory it takes per fingerprint and per
//! dense offset, checked against what the allocator really handed out.
//!
//! `REPLAYGUARD_BENCH_N` sets the number of live fingerprints (default
//! 1,000,000; the targets are stated for 10,000,000, and the
//! disk tier's for 100,000,000). `REPLAYGUARD_BENCH_ONLY` runs only the
//! named groups (comma-separated: `check`, `epochs`, `record`, `disk`,
//! `memory`, `machine`, `hash`).
//!
//! - `check`: `Guard::check` and `Guard::check_many` (batched) against N
//!   fingerprints, in the open table and sealed.
//! - `epochs`: 3,600,000 fingerprints as one sealed epoch and as 3,600
//!   epochs of 1,000 (one checkpoint each, `retention_time` 1 h), checked
//!   in the same run, so their ratio is the cost of many live epochs.
//! - `record`: `Guard::record` of fresh records with 1 and with 17 live
//!   epochs of 200,000 records, and with 2 live epochs of 1,700,000 (the
//!   table 17 make, in two epochs), in the same run; one call a record, then
//!   `record_many`, then one call a record with the checkpoint after every
//!   200,000 records timed too (in this thread: the store's background
//!   threads and the fsync's wait are not counted). The window rolls on
//!   as on an endless stream: no checkpoint empties it.
//! - `memory`: what the index takes per fingerprint, from the allocator
//!   beside its own estimate: the open table as it grows to N (at most
//!   9,999,999) and once sealed, dense offsets, and a rolling window of 17
//!   epochs of 200,000 once it has settled.
//! - `disk`: N fingerprints in 10 epochs with a memory budget of 0, so the
//!   9 sealed ones are on disk: memory per fingerprint (estimate,
//!   allocator and the process's resident set), and checks.
//! - `machine`: what this machine's memory gives one core, with no index
//!   in the way: reads of one random cache line each, out of 192 MiB (the
//!   size of a 10M sealed table's slots), fetched 16 ahead as the batched
//!   checks do, and one after another where each read gives the next
//!   address (the latency). A check's rate is bounded by the lines it
//!   reads times this rate; BENCHMARKS.md says which.
//! - `hash`: `Fingerprint::content` of a 16-byte key with values of 100
//!   and 1,000 bytes, beside the streaming xxh3 of the same bytes (the
//!   way it was hashed before, and still is past 64 KiB): the same
//!   value, so their ratio is what hashing in one call saves.
//!
//! Times are the benchmarking thread's CPU time, not wall time: the target
//! is per core, and on a shared 2-core machine wall time also counts the
//! moments the thread waits for a core. (Other processes still share the
//! caches; note the machine's load next to any figure.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

#[path = "shared/feed.rs"]
mod feed;
use feed::{fp, thread_cpu_now};

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use replayguard::{Fingerprint, Guard, LaneId, Probe, Verdict};

/// Counts the bytes live on the heap, to check `Guard::memory_bytes`.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counter is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// CPU time of the calling thread.
struct ThreadCpu(WallTime);

impl Measurement for ThreadCpu {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        thread_cpu_now()
    }
    fn end(&self, started: Duration) -> Duration {
        thread_cpu_now().saturating_sub(started)
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        self.0.formatter()
    }
}

/// Bytes live on the heap, and in the index's own mappings: a large
/// table's slots are mapped apart from the allocator, and only what of
/// them is resident counts.
fn live_bytes() -> isize {
    LIVE.load(Ordering::Relaxed) + slot_mappings_resident() as isize
}

/// Resident bytes of the mappings that large tables make for their slots,
/// from `/proc/self/smaps`: the anonymous mappings made with
/// `MAP_NORESERVE` (flag `nr`) and marked for huge pages (`hg`). Zero
/// elsewhere than on Linux.
fn slot_mappings_resident() -> u64 {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return 0;
    };
    let (mut total, mut rss) = (0, 0);
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("Rss:") => {
                rss = words
                    .next()
                    .and_then(|w| w.parse::<u64>().ok())
                    .unwrap_or(0)
            }
            Some("VmFlags:") => {
                let flags: Vec<&str> = words.collect();
                if flags.contains(&"nr") && flags.contains(&"hg") {
                    total += rss * 1024;
                }
            }
            _ => {}
        }
    }
    total
}

/// Number of live fingerprints.
fn n() -> u64 {
    std::env::var("REPLAYGUARD_BENCH_N")
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(1_000_000)
}

/// A guard holding `n` records in one lane: offsets `0..n`, content
/// fingerprints `fp(0..n)`.
fn filled(dir: &std::path::Path, n: u64, retention: u32) -> (Guard, LaneId) {
    let mut g = Guard::builder(dir)
        .retention_epochs(retention)
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    for i in 0..n {
        g.record(lane, Some(i), Some(fp(i))).expect("record");
    }
    g.flush().expect("flush");
    (g, lane)
}

/// Probes in a scattered order, many more than fit in any cache.
fn probes(n: u64, hit: bool) -> Vec<Fingerprint> {
    let count = n.min(2_000_000);
    // An odd multiplier modulo n visits the members in a scattered order.
    let step = 0x9e37_79b9_7f4a_7c15_u64 | 1;
    (0..count)
        .map(|i| {
            let j = i.wrapping_mul(step) % n;
            if hit { fp(j) } else { fp(n + j) }
        })
        .collect()
}

const BATCH: usize = 10_000;

/// Whether the group `name` is to run.
fn wanted(name: &str) -> bool {
    std::env::var("REPLAYGUARD_BENCH_ONLY").map_or(true, |v| v.split(',').any(|g| g == name))
}

/// Benches `check` over the probes, `BATCH` at a time, moving through them.
/// With `with_offset`, each probe also carries a new offset, as a record
/// does: "hit" is then an upstream resend (same content, new offset) and
/// "miss" a fresh record.
fn bench_checks(
    c: &mut Criterion<ThreadCpu>,
    group: &str,
    g: &mut Guard,
    lane: LaneId,
    with_offset: bool,
    n: u64,
) {
    let mut group = c.benchmark_group(group);
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(BATCH as u64));
    for (name, hit) in [("hit", true), ("miss", false)] {
        let probes = probes(n, hit);
        let mut at = 0;
        group.bench_function(name, |b| {
            b.iter(|| {
                if at + BATCH > probes.len() {
                    at = 0;
                }
                let mut fresh = 0u32;
                for (k, &p) in probes[at..at + BATCH].iter().enumerate() {
                    let offset = with_offset.then_some((n + at as u64 + k as u64) * 2);
                    fresh += u32::from(g.check(lane, offset, Some(p)).expect("check").is_fresh());
                }
                at += BATCH;
                assert_eq!(fresh == 0, hit);
                black_box(fresh)
            })
        });
        let batches: Vec<Vec<Probe>> = probes
            .chunks(BATCH)
            .enumerate()
            .map(|(c, chunk)| {
                let at = (c * BATCH) as u64;
                chunk
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| {
                        let offset = with_offset.then_some((n + at + k as u64) * 2);
                        Probe::new(lane, offset, Some(p))
                    })
                    .collect()
            })
            .collect();
        let mut verdicts: Vec<Verdict> = Vec::with_capacity(BATCH);
        let mut next = 0;
        group.bench_function(format!("{name}/batched"), |b| {
            b.iter(|| {
                let batch = &batches[next % batches.len()];
                next += 1;
                g.check_many(batch, &mut verdicts).expect("check_many");
                let fresh = verdicts.iter().filter(|v| v.is_fresh()).count();
                assert_eq!(fresh == 0, hit);
                black_box(fresh)
            })
        });
    }
    group.finish();
}

fn check(c: &mut Criterion<ThreadCpu>) {
    if !wanted("check") {
        return;
    }
    let n = n();
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut g, lane) = filled(dir.path(), n, 1);
    let open_bytes = g.memory_bytes();
    bench_checks(c, &format!("check/{n}/open-table"), &mut g, lane, false, n);
    bench_checks(
        c,
        &format!("check/{n}/open-table/record"),
        &mut g,
        lane,
        true,
        n,
    );
    // The checkpoint seals the epoch.
    g.checkpoint(&[(lane, n)], Vec::new()).expect("checkpoint");
    let sealed_bytes = g.memory_bytes();
    bench_checks(c, &format!("check/{n}/sealed"), &mut g, lane, false, n);
    bench_checks(
        c,
        &format!("check/{n}/sealed/record"),
        &mut g,
        lane,
        true,
        n,
    );
    eprintln!(
        "memory, estimate: {:.2} B per fingerprint in the open table, {:.2} B sealed ({n} fingerprints)",
        open_bytes as f64 / n as f64,
        sealed_bytes as f64 / n as f64,
    );
}

/// Heap bytes allocated (net) while `f` runs.
fn allocated_by(f: impl FnOnce()) -> isize {
    let before = live_bytes();
    f();
    live_bytes() - before
}

/// Waits for the store's background work (memtable flushes) to settle, so
/// that it does not free memory inside a measurement.
fn settle() {
    std::thread::sleep(Duration::from_secs(2));
}

/// What the index really takes, from the allocator, next to the estimate.
///
/// Records go in with `chunk_records` at its maximum, so nothing is written
/// to the store while they are counted: the net allocation is the index
/// plus the pending chunk, whose size is known (a `Vec<u128>` grown by
/// doubling, or a bitmap built exactly like the index's). Sealing is then
/// measured as the net change over a checkpoint that writes nothing but
/// the manifest.
fn memory(_c: &mut Criterion<ThreadCpu>) {
    if !wanted("memory") {
        return;
    }
    let m = n().min(9_999_999);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = Guard::builder(dir.path())
        .retention_epochs(1)
        .chunk_records(10_000_000)
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    let fps: Vec<Fingerprint> = (0..m).map(fp).collect();
    // The growing table's memory per fingerprint depends on where its last
    // growth left it, so it is sampled as the table fills, every 10,000
    // records past the first 10%.
    let mut per: Vec<f64> = Vec::new();
    let net = allocated_by(|| {
        for (i, &f) in fps.iter().enumerate() {
            g.record(lane, None, Some(f)).expect("record");
            let done = i as u64 + 1;
            if done * 10 >= m && done.is_multiple_of(10_000) {
                per.push(g.memory_bytes() as f64 / done as f64);
            }
        }
    });
    let samples = per.len();
    if let Some(Spread {
        lo,
        median,
        hi,
        mean,
    }) = spread(per)
    {
        eprintln!(
            "memory, fingerprint, open table as it grows from {} to {m}: estimate {lo:.2} to {hi:.2} B each, \
             median {median:.2}, mean {mean:.2} ({samples} samples)",
            m / 10,
        );
    }
    let pending = 16 * m.next_power_of_two().max(4) as isize;
    let open_actual = net - pending;
    report("fingerprint, open table", m, g.memory_bytes(), open_actual);
    g.flush().expect("flush");
    settle();
    let change = allocated_by(|| {
        g.checkpoint(&[], Vec::new()).expect("checkpoint");
    });
    report(
        "fingerprint, sealed",
        m,
        g.memory_bytes(),
        open_actual + change,
    );
    drop(g);
    drop(fps);

    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = Guard::builder(dir.path())
        .retention_epochs(1)
        .chunk_records(10_000_000)
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    let net = allocated_by(|| {
        for o in 0..m {
            g.record(lane, Some(o), None).expect("record");
        }
    });
    // The pending chunk's bitmap got the same inserts as the index's.
    let open_actual = net / 2;
    report("dense offset, open", m, g.memory_bytes(), open_actual);
    g.flush().expect("flush");
    settle();
    let change = allocated_by(|| {
        g.checkpoint(&[(lane, m)], Vec::new()).expect("checkpoint");
    });
    report(
        "dense offset, sealed",
        m,
        g.memory_bytes(),
        open_actual + change,
    );
    rolling_memory();
}

/// The memory of a rolling window once it has settled: 17 live epochs of
/// 200,000 records, each checkpoint dropping the oldest. The table keeps
/// the entries of dropped epochs until a purge (or an insert's shift
/// takes their slots), so a window that has rolled for a while holds more
/// than one that has just filled.
fn rolling_memory() {
    const CHECKPOINTS: u64 = 60;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut feed = Feed::new(dir.path(), 16, RECORD_EPOCH, CHECKPOINTS * RECORD_EPOCH);
    let (mut probes, mut verdicts) = (Vec::with_capacity(BATCH), Vec::new());
    for _ in 0..CHECKPOINTS * RECORD_EPOCH / BATCH as u64 {
        feed.batched(&mut probes, &mut verdicts);
    }
    let settled = feed.per_live.split_off(CHECKPOINTS as usize / 2);
    let samples = settled.len();
    if let Some(Spread { lo, median, hi, .. }) = spread(settled) {
        eprintln!(
            "memory, rolling window of 17 epochs of {RECORD_EPOCH}, after its 30th checkpoint: \
             {lo:.2} to {hi:.2} B per live fingerprint, median {median:.2} ({samples} checkpoints)",
        );
    }
}

/// The lowest, median, highest and mean of some samples.
struct Spread {
    lo: f64,
    median: f64,
    hi: f64,
    mean: f64,
}

/// `None` without samples.
fn spread(mut v: Vec<f64>) -> Option<Spread> {
    v.sort_by(f64::total_cmp);
    let (&lo, &hi) = (v.first()?, v.last()?);
    Some(Spread {
        lo,
        median: v[v.len() / 2],
        hi,
        mean: v.iter().sum::<f64>() / v.len() as f64,
    })
}

fn report(what: &str, n: u64, estimate: usize, actual: isize) {
    eprintln!(
        "memory, {what}: estimate {:.4} B each, allocator {:.4} B each ({n} entries; \
         estimate/allocator {:.3})",
        estimate as f64 / n as f64,
        actual as f64 / n as f64,
        estimate as f64 / actual as f64,
    );
}

/// Fresh and known probes over `0..n` and `n..2n`, as batches of probes.
fn probe_batches(lane: LaneId, n: u64, hit: bool, count: usize) -> Vec<Vec<Probe>> {
    let step = 0x9e37_79b9_7f4a_7c15_u64 | 1;
    (0..count as u64)
        .map(|i| {
            let j = i.wrapping_mul(step) % n;
            Probe::new(lane, None, Some(if hit { fp(j) } else { fp(n + j) }))
        })
        .collect::<Vec<_>>()
        .chunks(BATCH)
        .map(<[Probe]>::to_vec)
        .collect()
}

/// Benches checks of `batches` one batch per iteration, batched and one
/// by one.
fn bench_batches(
    group: &mut criterion::BenchmarkGroup<'_, ThreadCpu>,
    name: &str,
    g: &mut Guard,
    batches: &[Vec<Probe>],
    hit: bool,
) {
    let mut verdicts = Vec::with_capacity(BATCH);
    let mut next = 0;
    group.bench_function(format!("{name}/batched"), |b| {
        b.iter(|| {
            let batch = &batches[next % batches.len()];
            next += 1;
            g.check_many(batch, &mut verdicts).expect("check_many");
            let fresh = verdicts.iter().filter(|v| v.is_fresh()).count();
            assert_eq!(fresh == 0, hit, "{name}");
            black_box(fresh)
        })
    });
    let mut next = 0;
    group.bench_function(name, |b| {
        b.iter(|| {
            let batch = &batches[next % batches.len()];
            next += 1;
            let mut fresh = 0u32;
            for p in batch {
                fresh += u32::from(g.check(p.lane, p.offset, p.fp).expect("check").is_fresh());
            }
            assert_eq!(fresh == 0, hit, "{name}");
            black_box(fresh)
        })
    });
}

fn quick_group<'a>(
    c: &'a mut Criterion<ThreadCpu>,
    name: &str,
) -> criterion::BenchmarkGroup<'a, ThreadCpu> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(BATCH as u64));
    group
}

/// The cliff of many live epochs: 3,600,000 fingerprints as 1 epoch and as
/// 3,600 epochs of 1,000, like an hour of 1 s checkpoints at 1k records/s.
fn epochs(c: &mut Criterion<ThreadCpu>) {
    if !wanted("epochs") {
        return;
    }
    const PER: u64 = 1_000;
    const EPOCHS: u64 = 3_600;
    let n = PER * EPOCHS;
    let hour = Some(Duration::from_secs(3_600));
    let one = tempfile::tempdir().expect("tempdir");
    let mut g1 = Guard::builder(one.path())
        .retention_time(hour)
        .open()
        .expect("open");
    let lane1 = g1.lane("bench", 0);
    for i in 0..n {
        g1.record(lane1, Some(i), Some(fp(i))).expect("record");
    }
    g1.checkpoint(&[(lane1, n)], Vec::new())
        .expect("checkpoint");
    let many = tempfile::tempdir().expect("tempdir");
    let mut gm = Guard::builder(many.path())
        .retention_time(hour)
        .open()
        .expect("open");
    let lanem = gm.lane("bench", 0);
    let mut checkpoint_time = Duration::ZERO;
    for e in 0..EPOCHS {
        for i in e * PER..(e + 1) * PER {
            gm.record(lanem, Some(i), Some(fp(i))).expect("record");
        }
        let started = std::time::Instant::now();
        gm.checkpoint(&[(lanem, (e + 1) * PER)], Vec::new())
            .expect("checkpoint");
        if e >= EPOCHS - 100 {
            checkpoint_time += started.elapsed();
        }
    }
    assert_eq!(gm.stats().live_epochs, EPOCHS + 1);
    eprintln!(
        "epochs: the last 100 of {EPOCHS} checkpoints took {:.3} ms each (wall, fsync included)",
        checkpoint_time.as_secs_f64() * 10.0
    );
    let mut group = quick_group(c, &format!("epochs/{n}"));
    for (name, hit) in [("miss", false), ("hit", true)] {
        let b1 = probe_batches(lane1, n, hit, 200_000);
        let bm = probe_batches(lanem, n, hit, 200_000);
        bench_batches(&mut group, &format!("1-epoch/{name}"), &mut g1, &b1, hit);
        bench_batches(
            &mut group,
            &format!("{EPOCHS}-epochs/{name}"),
            &mut gm,
            &bm,
            hit,
        );
    }
    group.finish();
}

/// Records taken from a pool of precomputed fingerprints into one lane,
/// with a checkpoint after every `epoch` records, so that the number of
/// live epochs stays as it is.
///
/// The pool is used again and again, each round under a new salt, so that
/// its fingerprints are new in every round and the window goes on rolling
/// as it would on an endless stream. (Before, a round started by dropping
/// every live epoch, and the next `retention` epochs regrew the table from
/// empty, BENCHMARKS.md.)
struct Feed {
    g: Guard,
    lane: LaneId,
    /// The pool's hashes, before the salt.
    pool: Vec<u128>,
    /// Mixed into each of the pool's hashes (xor), new each round.
    salt: u128,
    round: u64,
    at: usize,
    next: u64,
    /// Records an epoch.
    epoch: u64,
    /// Index memory per live fingerprint after each checkpoint: the table
    /// also holds entries below the floor until a purge.
    per_live: Vec<f64>,
}

const RECORD_EPOCH: u64 = 200_000;

/// The hash of a content fingerprint.
fn hash_of(f: Fingerprint) -> u128 {
    match f {
        Fingerprint::Hash(h) => h,
        Fingerprint::Id(_) => unreachable!("a content fingerprint is a hash"),
    }
}

impl Feed {
    /// A guard keeping `retention` sealed epochs of `epoch` records, fed
    /// from a pool of `pool` precomputed fingerprints (`fp(0..pool)`, so
    /// that xxh3 is not timed).
    fn new(dir: &std::path::Path, retention: u32, epoch: u64, pool: u64) -> Self {
        let mut g = Guard::builder(dir)
            .retention_epochs(retention)
            .open()
            .expect("open");
        let lane = g.lane("bench", 0);
        Feed {
            g,
            lane,
            pool: (0..pool).map(|i| hash_of(fp(i))).collect(),
            salt: 0,
            round: 0,
            at: 0,
            next: 0,
            epoch,
            per_live: Vec::new(),
        }
    }

    /// Past the pool, starts it again under a new salt.
    fn wrap(&mut self) {
        if self.at + BATCH > self.pool.len() {
            self.at = 0;
            self.round += 1;
            self.salt = xxhash_rust::xxh3::xxh3_128(&self.round.to_le_bytes());
        }
    }

    /// The fingerprint of the pool's `i`th hash in this round.
    fn fp_at(&self, i: usize) -> Fingerprint {
        Fingerprint::Hash(self.pool[i] ^ self.salt)
    }

    fn checkpoint(&mut self) {
        self.g
            .checkpoint(&[(self.lane, self.next)], Vec::new())
            .expect("checkpoint");
    }

    /// After a batch: the checkpoint if an epoch is full, and the memory
    /// it leaves. Returns the thread's CPU time the checkpoint took.
    fn end_batch(&mut self) -> Duration {
        if !self.next.is_multiple_of(self.epoch) {
            return Duration::ZERO;
        }
        let started = thread_cpu_now();
        self.checkpoint();
        let spent = thread_cpu_now().saturating_sub(started);
        let s = self.g.stats();
        // A window of one epoch has none live after its checkpoint, only
        // the room the table keeps for the next epoch.
        if s.live_fingerprints > 0 {
            self.per_live
                .push(s.memory_bytes as f64 / s.live_fingerprints as f64);
        }
        spent
    }

    /// `BATCH` records, one call each: the time spent, with the checkpoint
    /// that may follow when `with_checkpoint`.
    fn one_by_one(&mut self, with_checkpoint: bool) -> Duration {
        self.wrap();
        let started = thread_cpu_now();
        for i in self.at..self.at + BATCH {
            let f = self.fp_at(i);
            let v = self
                .g
                .record(self.lane, Some(self.next), Some(f))
                .expect("record");
            black_box(v);
            self.next += 1;
        }
        self.at += BATCH;
        let spent = thread_cpu_now().saturating_sub(started);
        let checkpoint = self.end_batch();
        if with_checkpoint {
            spent + checkpoint
        } else {
            spent
        }
    }

    /// `BATCH` records in one `record_many`: the time spent in it.
    fn batched(&mut self, probes: &mut Vec<Probe>, verdicts: &mut Vec<Verdict>) -> Duration {
        self.wrap();
        let (lane, next) = (self.lane, self.next);
        probes.clear();
        probes.extend(
            (self.at..self.at + BATCH)
                .enumerate()
                .map(|(k, i)| Probe::new(lane, Some(next + k as u64), Some(self.fp_at(i)))),
        );
        let started = thread_cpu_now();
        self.g.record_many(probes, verdicts).expect("record_many");
        let spent = thread_cpu_now().saturating_sub(started);
        assert!(verdicts.iter().all(|v| v.is_fresh()));
        self.next += BATCH as u64;
        self.at += BATCH;
        self.end_batch();
        spent
    }
}

/// The record path with 1 and with 17 live epochs of 200,000 records, and
/// with 2 live epochs of 1,700,000 (a table of the size 17 make, in fewer
/// epochs): fresh records with offsets and content, and a checkpoint
/// after every epoch (untimed, except in `checkpoints-included`).
fn record(c: &mut Criterion<ThreadCpu>) {
    if !wanted("record") {
        return;
    }
    let mut group = c.benchmark_group("record");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements(BATCH as u64));
    let mut keep = Vec::new();
    for (retention, epoch) in [
        (0u32, RECORD_EPOCH),
        (16, RECORD_EPOCH),
        (1, 17 * RECORD_EPOCH / 2),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut feed = Feed::new(dir.path(), retention, epoch, 8_000_000);
        let lane = feed.lane;
        for _ in 0..=retention {
            for _ in 0..epoch {
                let f = feed.fp_at(feed.at);
                feed.g
                    .record(lane, Some(feed.next), Some(f))
                    .expect("record");
                feed.next += 1;
                feed.at += 1;
            }
            feed.checkpoint();
        }
        let live = feed.g.stats().live_epochs;
        let name = if epoch == RECORD_EPOCH {
            format!("{live}-live-epochs")
        } else {
            format!("{live}-live-epochs-of-{epoch}")
        };
        group.bench_function(&name, |b| {
            b.iter_custom(|iters| (0..iters).map(|_| feed.one_by_one(false)).sum());
        });
        let mut verdicts = Vec::with_capacity(BATCH);
        let mut probes: Vec<Probe> = Vec::with_capacity(BATCH);
        group.bench_function(format!("{name}/batched"), |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| feed.batched(&mut probes, &mut verdicts))
                    .sum()
            });
        });
        feed.per_live.clear();
        group.bench_function(format!("{name}/checkpoints-included"), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| feed.one_by_one(true)).sum());
        });
        let per_live = std::mem::take(&mut feed.per_live);
        let checkpoints = per_live.len();
        if let Some(Spread { lo, median, hi, .. }) = spread(per_live) {
            eprintln!(
                "record: {name}: index memory {lo:.2} to {hi:.2} B per live fingerprint, median {median:.2}, over {checkpoints} checkpoints",
            );
        }
        assert_eq!(feed.g.stats().live_epochs, live);
        keep.push(dir);
    }
    group.finish();
}

/// Resident set of the process, from /proc.
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Sealed epochs on disk: N fingerprints in 10 epochs, a budget of 0.
fn disk(c: &mut Criterion<ThreadCpu>) {
    if !wanted("disk") {
        return;
    }
    let n = n();
    let per = n / 10;
    let dir = tempfile::tempdir().expect("tempdir");
    let rss_before = rss_bytes().unwrap_or(0);
    let heap_before = live_bytes();
    let mut g = Guard::builder(dir.path())
        .retention_epochs(10)
        .max_memory_bytes(Some(0))
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    for e in 0..10 {
        for i in e * per..(e + 1) * per {
            g.record(lane, Some(i), Some(fp(i))).expect("record");
        }
        g.checkpoint(&[(lane, (e + 1) * per)], Vec::new())
            .expect("checkpoint");
    }
    settle();
    let s = g.stats();
    assert_eq!(s.disk_fingerprints, per * 10);
    let heap = live_bytes() - heap_before;
    eprintln!(
        "disk: {} fingerprints on disk; index memory estimate {:.3} B each ({} B, of which          disk filters {} B); heap allocated since open {:.3} B each; resident set {:.1} MiB          (grew {:.1} MiB); on-disk index {:.1} B each, state folder {:.1} B each",
        s.disk_fingerprints,
        s.memory_bytes as f64 / n as f64,
        s.memory_bytes,
        s.disk_filter_bytes,
        heap as f64 / n as f64,
        rss_bytes().unwrap_or(0) as f64 / (1 << 20) as f64,
        (rss_bytes().unwrap_or(0).saturating_sub(rss_before)) as f64 / (1 << 20) as f64,
        s.disk_index_bytes as f64 / n as f64,
        s.disk_bytes as f64 / n as f64,
    );
    let mut group = quick_group(c, &format!("disk/{n}"));
    let miss = probe_batches(lane, n, false, 200_000);
    bench_batches(&mut group, "miss", &mut g, &miss, false);
    group.throughput(Throughput::Elements(1_000));
    let hit: Vec<Vec<Probe>> = probe_batches(lane, n, true, 20_000)
        .iter()
        .flat_map(|b| b.chunks(1_000).map(<[Probe]>::to_vec).collect::<Vec<_>>())
        .collect();
    bench_batches(&mut group, "hit", &mut g, &hit, true);
    group.finish();
    let s = g.stats();
    eprintln!(
        "disk: {} disk reads, {} of them hits",
        s.disk_reads, s.disk_hits
    );
}

/// A 192 MiB array of cache lines (backed by 2 MiB pages where the kernel
/// allows, as the sealed table is), and 2,000,000 random line numbers.
struct Lines {
    lines: Vec<[u64; 8]>,
    order: Vec<u32>,
}

impl Lines {
    fn new() -> Self {
        const BYTES: usize = 192 << 20;
        let count = BYTES / 64;
        let mut lines: Vec<[u64; 8]> = Vec::with_capacity(count);
        #[cfg(target_os = "linux")]
        {
            // The 2 MiB pages wholly inside the allocation just made.
            const HUGE: usize = 2 << 20;
            let start = lines.as_mut_ptr() as usize;
            let (from, to) = (start.div_ceil(HUGE) * HUGE, (start + BYTES) / HUGE * HUGE);
            // SAFETY: advice on pages inside the allocation, before any is
            // touched; it changes how they are backed, never their contents.
            unsafe {
                libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
            }
        }
        // A random cycle through every line: line `i` holds the next.
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |bound: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % bound as u64) as usize
        };
        let mut perm: Vec<u32> = (0..count as u32).collect();
        for i in (1..count).rev() {
            perm.swap(i, next(i + 1));
        }
        lines.resize(count, [0; 8]);
        for w in 0..count {
            lines[perm[w] as usize][0] = u64::from(perm[(w + 1) % count]);
        }
        let order = (0..2_000_000).map(|_| next(count) as u32).collect();
        Lines { lines, order }
    }
}

fn machine(c: &mut Criterion<ThreadCpu>) {
    if !wanted("machine") {
        return;
    }
    let m = Lines::new();
    let mut group = quick_group(c, "machine/192MiB");
    let ahead = 16;
    let mut at = 0;
    group.bench_function("random-line/prefetched", |b| {
        b.iter(|| {
            if at + BATCH + ahead > m.order.len() {
                at = 0;
            }
            let mut sum = 0u64;
            for i in at..at + BATCH {
                let far = &m.lines[m.order[i + ahead] as usize];
                // SAFETY: a hint; SSE is part of x86_64.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                        far.as_ptr().cast(),
                    );
                }
                sum = sum.wrapping_add(m.lines[m.order[i] as usize][0]);
            }
            at += BATCH;
            black_box(sum)
        })
    });
    let mut line = 0usize;
    group.bench_function("chase", |b| {
        b.iter(|| {
            for _ in 0..BATCH {
                line = m.lines[line][0] as usize;
            }
            black_box(line)
        })
    });
    group.finish();
}

/// The streaming xxh3 of `Fingerprint::content`'s bytes: the tag `C`, then
/// for key and value a presence byte, the length (u64 LE) and the bytes.
fn streamed_content(key: &[u8], value: &[u8]) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(replayguard::fingerprint::SEED);
    h.update(b"C");
    for part in [key, value] {
        h.update(&[1]);
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.digest128()
}

fn hash(c: &mut Criterion<ThreadCpu>) {
    if !wanted("hash") {
        return;
    }
    let key = [7u8; 16];
    let values: Vec<Vec<u8>> = (0..BATCH as u64)
        .map(|i| {
            let mut v = vec![b'.'; 1000];
            v[..8].copy_from_slice(&i.to_le_bytes());
            v
        })
        .collect();
    for len in [100, 1000] {
        let one = &values[0][..len];
        assert_eq!(
            Fingerprint::content(Some(&key), Some(one)),
            Fingerprint::Hash(streamed_content(&key, one)),
            "the two ways give one value"
        );
        let mut group = quick_group(c, &format!("hash/{len}B"));
        group.bench_function("content", |b| {
            b.iter(|| {
                for v in &values {
                    black_box(Fingerprint::content(Some(&key), Some(&v[..len])));
                }
            })
        });
        group.bench_function("streamed", |b| {
            b.iter(|| {
                for v in &values {
                    black_box(streamed_content(&key, &v[..len]));
                }
            })
        });
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(ThreadCpu(WallTime));
    targets = check, epochs, record, disk, memory, machine, hash
}
criterion_main!(benches);
