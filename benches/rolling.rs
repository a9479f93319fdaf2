//! What a rolling window costs the thread that records, call by call: 17
//! live epochs of 200,000 fresh records (`retention_epochs(16)`), fed by
//! `record_many` in calls of 10,000 with a checkpoint after every
//! 200,000, for 60 checkpoints. Over the last 40 it reports the thread's
//! CPU time in `record_many` and in `checkpoint`, and the median, 99th
//! percentile and longest wall time of each kind of call: the table's
//! purges fall in one or the other, and show as the long calls.
//!
//! `cargo bench --bench rolling`. Under `cargo test` it does nothing (a
//! debug build would take minutes).

use std::time::{Duration, Instant};

use replayguard::{Guard, Probe, Verdict};

#[path = "shared/feed.rs"]
mod feed;
use feed::{fp, thread_cpu_now};

const EPOCH: u64 = 200_000;
const CALL: u64 = 10_000;
const CHECKPOINTS: u64 = 60;
const SETTLED: u64 = 20;

/// Wall times and the thread's CPU time of one kind of call.
#[derive(Default)]
struct Calls {
    wall_ms: Vec<f64>,
    cpu: Duration,
}

impl Calls {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let (wall, cpu) = (Instant::now(), thread_cpu_now());
        let out = f();
        self.cpu += thread_cpu_now() - cpu;
        self.wall_ms.push(wall.elapsed().as_secs_f64() * 1e3);
        out
    }

    fn report(mut self, what: &str) {
        self.wall_ms.sort_by(f64::total_cmp);
        let n = self.wall_ms.len();
        let at = |q: usize| self.wall_ms[(n * q / 100).min(n - 1)];
        println!(
            "rolling: {what}: {n} calls, thread CPU {:.0} ms in all; wall median {:.2} ms, p99 {:.2} ms, longest {:.2} ms",
            self.cpu.as_secs_f64() * 1e3,
            at(50),
            at(99),
            self.wall_ms[n - 1],
        );
    }
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = Guard::builder(dir.path())
        .retention_epochs(16)
        .open()
        .expect("open");
    let lane = g.lane("rolling", 0);
    let (mut records, mut checkpoints) = (Calls::default(), Calls::default());
    let mut verdicts: Vec<Verdict> = Vec::new();
    let mut next = 0u64;
    for checkpoint in 0..CHECKPOINTS {
        let settled = checkpoint >= SETTLED;
        for _ in 0..EPOCH / CALL {
            let batch: Vec<Probe> = (next..next + CALL)
                .map(|i| Probe::new(lane, Some(i), Some(fp(i))))
                .collect();
            next += CALL;
            let record = |g: &mut Guard, v: &mut Vec<Verdict>| g.record_many(&batch, v);
            if settled {
                records.time(|| record(&mut g, &mut verdicts))
            } else {
                record(&mut g, &mut verdicts)
            }
            .expect("record_many");
            assert!(
                verdicts.iter().all(|v| v.is_fresh()),
                "a fresh record was refused"
            );
        }
        let cp = |g: &mut Guard| g.checkpoint(&[(lane, next)], Vec::new());
        if settled {
            checkpoints.time(|| cp(&mut g))
        } else {
            cp(&mut g)
        }
        .expect("checkpoint");
    }
    println!(
        "rolling: 17 live epochs of {EPOCH}, memory {:.2} B per live fingerprint",
        g.memory_bytes() as f64 / g.stats().live_fingerprints as f64
    );
    records.report("record_many of 10,000");
    checkpoints.report("checkpoint");
}
