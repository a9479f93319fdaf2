//! The store paths, through the public API:
//!
//! - the record path with `Durability::Sync` and `chunk_records` 10,000:
//!   one fdatasync per 10,000 records;
//! - recovery: `Guard::builder(..).open()` of a folder holding N live
//!   fingerprints (`REPLAYGUARD_BENCH_N`, default 1,000,000; the issue's
//!   target is stated for 10,000,000), sealed and in the open epoch, and
//!   sealed on disk under a memory budget of 0 (the filter is rebuilt
//!   from the chunks; the on-disk index is already written);
//! - a checkpoint of an epoch holding 1,000,000 fingerprints, next to an
//!   empty checkpoint (the fsync alone).

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use replayguard::{Durability, Fingerprint, Guard};

fn n() -> u64 {
    std::env::var("REPLAYGUARD_BENCH_N")
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(1_000_000)
}

fn fp(i: u64) -> Fingerprint {
    Fingerprint::content(None, Some(&i.to_le_bytes()))
}

/// Precomputed fingerprints, so the benches time the guard, not xxh3.
fn fps(from: u64, count: u64) -> Vec<Fingerprint> {
    (from..from + count).map(fp).collect()
}

fn record_path(c: &mut Criterion) {
    const PER_ITER: u64 = 100_000;
    let mut group = c.benchmark_group("record");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Elements(PER_ITER));
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = Guard::builder(dir.path())
        .durability(Durability::Sync)
        .chunk_records(10_000)
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    // Enough fresh fingerprints for every iteration criterion may run; the
    // epoch grows as it would in production.
    let pool = fps(0, 6_000_000);
    let mut next = 0u64;
    group.bench_function("sync-every-10000", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                if next + PER_ITER > pool.len() as u64 {
                    // A checkpoint past every offset empties the epoch
                    // (retention 0), so the pool can be used again; untimed.
                    let end = g.epoch() * 10_000_000 + next;
                    g.checkpoint(&[(lane, end)], Vec::new())
                        .expect("checkpoint");
                    next = 0;
                }
                // Each epoch has its own offset range.
                let epoch = g.epoch();
                let started = Instant::now();
                for i in next..next + PER_ITER {
                    let offset = epoch * 10_000_000 + i;
                    let v = g
                        .record(lane, Some(offset), Some(pool[i as usize]))
                        .expect("record");
                    black_box(v);
                }
                spent += started.elapsed();
                next += PER_ITER;
            }
            spent
        })
    });
    group.finish();
}

/// A folder with `n` fingerprints in one lane: sealed in epoch 0 when
/// `sealed`, else flushed in the open epoch. Under `budget` the sealed
/// epoch moves to disk at its checkpoint.
fn prepare(dir: &Path, n: u64, sealed: bool, budget: Option<u64>) {
    let mut g = Guard::builder(dir)
        .retention_epochs(1)
        .max_memory_bytes(budget)
        .open()
        .expect("open");
    let lane = g.lane("bench", 0);
    for (i, f) in (0..n).map(|i| (i, fp(i))) {
        g.record(lane, Some(i), Some(f)).expect("record");
    }
    if sealed {
        g.checkpoint(&[(lane, n)], Vec::new()).expect("checkpoint");
    } else {
        g.flush().expect("flush");
    }
    let s = g.stats();
    assert_eq!(s.live_fingerprints, n);
}

fn recovery(c: &mut Criterion) {
    let n = n();
    let mut group = c.benchmark_group(format!("recover/{n}"));
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10))
        .throughput(Throughput::Elements(n));
    for (name, sealed, budget) in [
        ("sealed", true, None),
        ("open-epoch", false, None),
        ("on-disk", true, Some(0)),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        prepare(dir.path(), n, sealed, budget);
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let started = Instant::now();
                    let g = Guard::builder(dir.path())
                        .retention_epochs(1)
                        .max_memory_bytes(budget)
                        .open()
                        .expect("open");
                    spent += started.elapsed();
                    let s = g.stats();
                    assert_eq!(s.live_fingerprints, n);
                    assert_eq!(s.disk_fingerprints, if budget.is_some() { n } else { 0 });
                    drop(g);
                }
                spent
            })
        });
    }
    group.finish();
}

fn checkpoint(c: &mut Criterion) {
    const N: u64 = 1_000_000;
    let mut group = c.benchmark_group("checkpoint");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(5));
    let pools = [fps(0, N), fps(N, N)];
    // Retention 0 drops the epoch being closed; retention 1 seals it and
    // drops the one before (of the same size).
    for (name, n, retention) in [
        ("empty", 0, 0),
        ("epoch-of-1000000/retention-0", N, 0),
        ("epoch-of-1000000/retention-1", N, 1),
    ] {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let dir = tempfile::tempdir().expect("tempdir");
                    let mut g = Guard::builder(dir.path())
                        .retention_epochs(retention)
                        .open()
                        .expect("open");
                    let lane = g.lane("bench", 0);
                    for (e, pool) in pools.iter().enumerate() {
                        if e > 0 {
                            g.checkpoint(&[(lane, n)], Vec::new()).expect("checkpoint");
                        }
                        for (i, &f) in pool.iter().enumerate().take(n as usize) {
                            let offset = e as u64 * n + i as u64;
                            g.record(lane, Some(offset), Some(f)).expect("record");
                        }
                    }
                    let started = Instant::now();
                    let report = g
                        .checkpoint(&[(lane, 2 * n)], Vec::new())
                        .expect("checkpoint");
                    spent += started.elapsed();
                    assert!(report.dropped_epochs.len() <= 1);
                    black_box(report);
                }
                spent
            })
        });
    }
    group.finish();
}

criterion_group!(benches, record_path, recovery, checkpoint);
criterion_main!(benches);
