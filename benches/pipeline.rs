//! End-to-end benchmarks of the pipeline's three modes, side by side in one
//! run: guarded (replayguard), at-least-once (the same pipeline with no
//! guard) and transactional (Kafka transactions committed at every
//! checkpoint).
//!
//! ```text
//! cargo bench --bench pipeline               # full run: 857 s on 2 loaded cores
//! cargo bench --bench pipeline -- --quick    # smoke run, under 2 minutes
//! ```
//!
//! `REPLAYGUARD_BENCH_QUICK=1` also selects the smoke run,
//! `REPLAYGUARD_BENCH_RATE=N` the latency section's input rate (records/s),
//! `REPLAYGUARD_BENCH_BROKERS=kafka,in-process,process` the brokers of the
//! throughput and latency sections (a full run: all three for throughput,
//! Kafka and the in-process mock for latency),
//! `REPLAYGUARD_BENCH_ONLY=throughput,latency,recovery,retention,concurrency` runs only
//! the sections named, and `REPLAYGUARD_BENCH_REPS=N` repeats each
//! measurement N times (default 3, quick 1). The retention section's sizes
//! can be changed too: `REPLAYGUARD_BENCH_RETENTION=0,1000` (the epochs
//! kept), `REPLAYGUARD_BENCH_RETENTION_INTERVAL=0.01` (the pipeline's
//! checkpoint interval, seconds), `REPLAYGUARD_BENCH_ENGINE_EPOCH=N` (the
//! engine's records per epoch) and `REPLAYGUARD_BENCH_RECORDS=N` (inputs
//! copied per pipeline run, in this section and the throughput one). A run
//! with any of these, or with the rate or brokers changed, writes only
//! under `target/bench/`.
//!
//! What it measures, each run repeated and reported as min/median/max:
//!
//! - **throughput**: the same input (1M records of 100 B over 32
//!   partitions) copied by each mode with a 1 s checkpoint interval, on
//!   Apache Kafka and on the mock cluster in this process and in a process
//!   of its own;
//! - **latency** to visibility: inputs produced at a steady rate (20k/s
//!   over 4 partitions) with their produce time in the value; a reader of
//!   the output (`read_committed` for the transactional mode) notes when
//!   each becomes visible; checkpoint intervals of 100 ms, 1 s and 10 s.
//!   On Kafka that reader's view is the measure; the mock cluster ignores
//!   the isolation level, so there transactional visibility is derived from
//!   the pipeline's observed commits;
//! - **recovery** after `abort()` (which stands for `kill -9`) with 1M and
//!   10M live fingerprints: the engine's reopen, and the restarted
//!   pipeline's time to its first output;
//! - **retention** cost: throughput and memory with 0, 1, 4 and 16
//!   retained epochs, for the engine alone and for the guarded pipeline;
//! - **concurrency**: the guarded pipeline copying through an async
//!   function that waits 1 ms per record (a call to another service), one
//!   record at a time (`run`) and 8 or 64 at a time (`run_concurrent`).
//!
//! It writes `$CARGO_TARGET_DIR/bench/pipeline.json` (default
//! `target/bench/`) and two SVG pictures beside it; a full run of every
//! section with at least 3 repetitions also writes them to `docs/bench/`
//! for BENCHMARKS.md, which explains the method and the mock's limits.
//!
//! The Flink peer (`peers/flink`) is a JVM of its own, so three scripts set
//! it beside the same modes on Apache Kafka, out of this bench's build:
//! `scripts/bench-latency` (latency to visibility at a steady rate,
//! replayguard at 100 ms, 1 s and 10 s checkpoints, Flink at 1 s and 20 s),
//! `scripts/bench-cost` (CPU per million records, and with `--preload` the
//! copy rate of a topic written beforehand) and `scripts/seed-experiment`
//! (SIGKILLs: duplicates, missing records and the time back).
//!
//! It runs only under `cargo bench` (which passes `--bench`); run by `cargo
//! test` it does nothing.

#[path = "pipeline/broker.rs"]
mod broker;
#[path = "pipeline/load.rs"]
mod load;
#[path = "pipeline/report.rs"]
mod report;
#[path = "pipeline/scenarios.rs"]
mod scenarios;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde::Serialize;

use broker::BrokerKind;
use report::{BarGroup, CdfPanel, Spread};
use scenarios::{
    CopySpec, EngineRecoveryRun, LatencyRun, Mode, PopulateRun, RateSpec, RestartRun, RestartSpec,
    RetentionRun, ThroughputRun,
};

type BenchResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What a run measures and how much of it.
#[derive(Clone, Debug, Serialize)]
struct Plan {
    quick: bool,
    reps: usize,
    partitions: i32,
    /// Throughput: inputs copied per run.
    records: u64,
    throughput_brokers: Vec<BrokerKind>,
    latency_brokers: Vec<BrokerKind>,
    /// Latency: steady input rate, records/s, and partitions. Fewer than
    /// for throughput: the mock scans a partition's produce batches from
    /// the oldest at every fetch, and at a steady rate every partition gets
    /// a small batch every `linger.ms`, so the scans grow with partitions x
    /// time. With 32 partitions its broker thread fell behind 20k/s within
    /// 30 s here (p99 up to 1.4 s in every mode, then a full producer
    /// queue).
    rate: u64,
    latency_partitions: i32,
    warm_s: f64,
    /// (checkpoint interval, measured window), seconds.
    latency_runs: Vec<(f64, f64)>,
    /// Recovery: live fingerprints.
    recovery_sizes: Vec<u64>,
    /// Inputs copied before the crash, and produced while down.
    restart_before_crash: u64,
    restart_after_crash: u64,
    /// Retention: epochs kept, records per epoch for the engine, and the
    /// pipeline's checkpoint interval (short, so that 16 epochs fill up
    /// within one copy of the input).
    retention_epochs: Vec<u32>,
    engine_epoch_records: u64,
    retention_interval_s: f64,
    /// Concurrency: inputs copied per run, and records at a time.
    concurrency_records: u64,
    concurrency_levels: Vec<usize>,
    sections: Vec<String>,
    /// Set when the environment changed the plan beyond its repetitions:
    /// such a run never replaces the published figures.
    custom: bool,
}

impl Plan {
    fn new(quick: bool, sections: Vec<String>) -> Plan {
        if quick {
            Plan {
                quick,
                reps: 1,
                partitions: 32,
                records: 100_000,
                throughput_brokers: vec![BrokerKind::InProcess, BrokerKind::Process],
                latency_brokers: vec![BrokerKind::InProcess],
                rate: 20_000,
                latency_partitions: 4,
                warm_s: 1.0,
                latency_runs: vec![(1.0, 3.0)],
                recovery_sizes: vec![100_000],
                restart_before_crash: 6_400,
                restart_after_crash: 320,
                retention_epochs: vec![0, 4],
                engine_epoch_records: 100_000,
                retention_interval_s: 0.1,
                concurrency_records: 2_000,
                concurrency_levels: vec![1, 8, 64],
                sections,
                custom: false,
            }
        } else {
            Plan {
                quick,
                reps: 3,
                partitions: 32,
                records: 1_000_000,
                throughput_brokers: vec![
                    BrokerKind::Kafka,
                    BrokerKind::InProcess,
                    BrokerKind::Process,
                ],
                latency_brokers: vec![BrokerKind::Kafka, BrokerKind::InProcess],
                rate: 20_000,
                latency_partitions: 4,
                warm_s: 2.0,
                latency_runs: vec![(0.1, 8.0), (1.0, 8.0), (10.0, 20.0)],
                recovery_sizes: vec![1_000_000, 10_000_000],
                restart_before_crash: 64_000,
                restart_after_crash: 3_200,
                retention_epochs: vec![0, 1, 4, 16],
                engine_epoch_records: 1_000_000,
                retention_interval_s: 0.1,
                concurrency_records: 20_000,
                concurrency_levels: vec![1, 8, 64],
                sections,
                custom: false,
            }
        }
    }

    fn runs(&self, section: &str) -> bool {
        self.sections.iter().any(|s| s == section)
    }
}

const SECTIONS: [&str; 5] = [
    "throughput",
    "latency",
    "recovery",
    "retention",
    "concurrency",
];
const MODES: [Mode; 3] = [Mode::Guarded, Mode::AtLeastOnce, Mode::Transactional];

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Guarded => "guarded",
        Mode::AtLeastOnce => "at-least-once",
        Mode::Transactional => "transactional",
    }
}

/// The modes in a different order each repetition, so that a slow drift of
/// the machine's load does not always fall on the same mode.
fn rotated(rep: usize) -> Vec<Mode> {
    let mut m = MODES.to_vec();
    m.rotate_left(rep % MODES.len());
    m
}

/// The revision measured: `git describe --always --dirty`, and the paths
/// with uncommitted changes (the library's working tree may be ahead of its
/// last commit).
#[derive(Debug, Serialize)]
struct Revision {
    describe: String,
    uncommitted: Vec<String>,
}

impl Revision {
    fn probe() -> Revision {
        let git = |args: &[&str]| {
            std::process::Command::new("git")
                .args(args)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        Revision {
            describe: git(&["describe", "--always", "--dirty"]).trim().to_owned(),
            uncommitted: git(&["status", "--porcelain", "--untracked-files=no"])
                .lines()
                .map(|l| l.trim().to_owned())
                .collect(),
        }
    }
}

#[derive(Debug, Serialize)]
struct Machine {
    cpu: String,
    cores: usize,
    memory_gib: f64,
    kernel: String,
    librdkafka: String,
    /// 1-minute load average at the start of each section, and at the end.
    load: Vec<(String, f64)>,
}

impl Machine {
    fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, usize::from),
            memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_owned(),
            librdkafka: rdkafka::util::get_rdkafka_version().1,
            load: Vec::new(),
        }
    }

    fn note_load(&mut self, when: &str) {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
            .unwrap_or(f64::NAN);
        println!("[{when}] load average {load:.2}");
        self.load.push((when.to_owned(), load));
    }
}

#[derive(Debug, Serialize)]
struct ThroughputRow {
    broker: BrokerKind,
    mode: &'static str,
    records_per_s: Spread,
    runs: Vec<ThroughputRun>,
}

#[derive(Debug, Serialize)]
struct ConcurrencyRow {
    concurrency: usize,
    records_per_s: Spread,
    /// Records/s over the one-at-a-time run of the same repetition.
    over_one_at_a_time: Spread,
    runs: Vec<ThroughputRun>,
}

#[derive(Debug, Serialize)]
struct RatioRow {
    broker: BrokerKind,
    /// Guarded / at-least-once records/s, paired by repetition.
    guarded_over_at_least_once: Spread,
    /// Guarded / transactional records/s, paired by repetition.
    guarded_over_transactional: Spread,
}

#[derive(Debug, Serialize)]
struct LatencyRow {
    broker: BrokerKind,
    mode: &'static str,
    interval_s: f64,
    rate: u64,
    p50_ms: Spread,
    p99_ms: Spread,
    max_ms: Spread,
    runs: Vec<LatencyRun>,
    /// CDF of every repetition's samples pooled: (ms, fraction).
    cdf: Vec<(f64, f64)>,
}

#[derive(Debug, Serialize)]
struct RecoveryRow {
    fingerprints: u64,
    populate: PopulateRun,
    engine_open_s: Spread,
    engine: Vec<EngineRecoveryRun>,
    broker: BrokerKind,
    restart_first_output_s: Spread,
    restart_first_input_s: Spread,
    restart_engine_load_s: Spread,
    restart: Vec<RestartRun>,
}

#[derive(Debug, Serialize)]
struct RetentionRow {
    retention_epochs: u32,
    engine_records_per_s: Spread,
    engine: Vec<RetentionRun>,
    broker: BrokerKind,
    pipeline_records_per_s: Spread,
    pipeline: Vec<ThroughputRun>,
}

#[derive(Debug, Serialize)]
struct Target {
    what: String,
    value: f64,
    bound: String,
    met: bool,
}

#[derive(Debug, Serialize)]
struct Summary {
    benchmark: &'static str,
    started_unix_s: u64,
    wall_s: f64,
    revision: Revision,
    plan: Plan,
    machine: Machine,
    throughput: Vec<ThroughputRow>,
    ratios: Vec<RatioRow>,
    latency: Vec<LatencyRow>,
    recovery: Vec<RecoveryRow>,
    retention: Vec<RetentionRow>,
    concurrency: Vec<ConcurrencyRow>,
    targets: Vec<Target>,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("pipeline: end-to-end benchmarks run under `cargo bench --bench pipeline`");
        return ExitCode::SUCCESS;
    }
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("REPLAYGUARD_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let sections: Vec<String> = match std::env::var("REPLAYGUARD_BENCH_ONLY") {
        Ok(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_owned()).collect(),
        _ => SECTIONS.iter().map(|s| (*s).to_owned()).collect(),
    };
    if let Some(bad) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
        eprintln!("REPLAYGUARD_BENCH_ONLY: unknown section {bad:?}; use {SECTIONS:?}");
        return ExitCode::FAILURE;
    }
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let mut plan = Plan::new(quick, sections);
    if let Err(e) = override_sizes(&mut plan) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    if let Ok(v) = std::env::var("REPLAYGUARD_BENCH_BROKERS")
        && !v.trim().is_empty()
    {
        plan.custom = true;
        let mut kinds = Vec::new();
        for name in v.split(',').map(str::trim) {
            match BrokerKind::named(name) {
                Some(k) => kinds.push(k),
                None => {
                    eprintln!(
                        "REPLAYGUARD_BENCH_BROKERS: unknown broker {name:?}; use in-process, process or kafka"
                    );
                    return ExitCode::FAILURE;
                }
            }
        }
        plan.throughput_brokers = kinds.clone();
        plan.latency_brokers = kinds;
    }
    if let Some(reps) = std::env::var("REPLAYGUARD_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|r| *r > 0)
    {
        plan.reps = reps;
    }
    match run(plan) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A positive number from the environment variable `name`, if it is set:
/// a value that does not parse is an error, not a silent default.
fn positive<T: std::str::FromStr + PartialOrd + Default>(name: &str) -> Result<Option<T>, String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => match v.trim().parse::<T>() {
            Ok(n) if n > T::default() => Ok(Some(n)),
            _ => Err(format!("{name}: {v:?} is not a positive number")),
        },
        _ => Ok(None),
    }
}

/// Sets `field` from the environment variable `name` when it is set
/// ([`positive`]), and says whether it was.
fn set_from<T: std::str::FromStr + PartialOrd + Default>(
    field: &mut T,
    name: &str,
) -> Result<bool, String> {
    let found = positive::<T>(name)?;
    let set = found.is_some();
    if let Some(v) = found {
        *field = v;
    }
    Ok(set)
}

/// The plan's sizes that the environment overrides (the module's doc names
/// them). Any of them makes the run `custom`.
fn override_sizes(plan: &mut Plan) -> Result<(), String> {
    let mut custom = false;
    custom |= set_from(&mut plan.rate, "REPLAYGUARD_BENCH_RATE")?;
    custom |= set_from(&mut plan.records, "REPLAYGUARD_BENCH_RECORDS")?;
    custom |= set_from(
        &mut plan.engine_epoch_records,
        "REPLAYGUARD_BENCH_ENGINE_EPOCH",
    )?;
    custom |= set_from(
        &mut plan.retention_interval_s,
        "REPLAYGUARD_BENCH_RETENTION_INTERVAL",
    )?;
    if let Ok(v) = std::env::var("REPLAYGUARD_BENCH_RETENTION")
        && !v.trim().is_empty()
    {
        plan.retention_epochs = v
            .split(',')
            .map(|e| e.trim().parse::<u32>())
            .collect::<Result<_, _>>()
            .map_err(|_| {
                format!("REPLAYGUARD_BENCH_RETENTION: {v:?} is not a list of epoch counts")
            })?;
        custom = true;
    }
    plan.custom |= custom;
    Ok(())
}

fn run(plan: Plan) -> BenchResult {
    let started = Instant::now();
    load::now_us();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // StreamConsumer spawns onto the runtime it is created in.
    let _entered = rt.enter();
    let machine = Machine::probe();
    println!(
        "pipeline bench ({}): {} x {}, {} GiB, librdkafka {}",
        if plan.quick { "quick" } else { "full" },
        machine.cores,
        machine.cpu,
        machine.memory_gib,
        machine.librdkafka
    );
    let mut summary = Summary {
        benchmark: "pipeline",
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        wall_s: 0.0,
        revision: Revision::probe(),
        plan: plan.clone(),
        machine,
        throughput: Vec::new(),
        ratios: Vec::new(),
        latency: Vec::new(),
        recovery: Vec::new(),
        retention: Vec::new(),
        concurrency: Vec::new(),
        targets: Vec::new(),
    };
    if plan.runs("throughput") {
        summary.machine.note_load("throughput");
        throughput(&rt, &plan, &mut summary)?;
    }
    if plan.runs("latency") {
        summary.machine.note_load("latency");
        latency(&rt, &plan, &mut summary)?;
    }
    if plan.runs("recovery") {
        summary.machine.note_load("recovery");
        recovery(&rt, &plan, &mut summary)?;
    }
    if plan.runs("retention") {
        summary.machine.note_load("retention");
        retention(&rt, &plan, &mut summary)?;
    }
    if plan.runs("concurrency") {
        summary.machine.note_load("concurrency");
        concurrency(&rt, &plan, &mut summary)?;
    }
    summary.machine.note_load("end");
    summary.targets = targets(&summary);
    summary.wall_s = started.elapsed().as_secs_f64();
    for t in &summary.targets {
        println!(
            "target {}: {:.3} (want {}) {}",
            t.what,
            t.value,
            t.bound,
            if t.met { "met" } else { "NOT met" }
        );
    }
    write_outputs(&plan, &summary)?;
    println!("done in {:.0} s", summary.wall_s);
    Ok(())
}

fn throughput(rt: &tokio::runtime::Runtime, plan: &Plan, summary: &mut Summary) -> BenchResult {
    for &broker in &plan.throughput_brokers {
        let mut runs: Vec<(Mode, ThroughputRun)> = Vec::new();
        for rep in 0..plan.reps {
            for mode in rotated(rep) {
                let r = scenarios::throughput(
                    rt,
                    &CopySpec {
                        broker,
                        mode,
                        records: plan.records,
                        partitions: plan.partitions,
                        interval: Duration::from_secs(1),
                        retention_epochs: 0,
                    },
                )?;
                println!(
                    "throughput  {:<17} {:<14} rep {rep}: {:>9.0} records/s ({} in, {} out, {:.2} s, {} checkpoints)",
                    broker.label(),
                    mode_name(mode),
                    r.records_per_s,
                    r.records,
                    r.outputs,
                    r.seconds,
                    r.checkpoints
                );
                runs.push((mode, r));
            }
        }
        let of = |m: Mode| -> Vec<f64> {
            runs.iter()
                .filter(|(mode, _)| *mode == m)
                .map(|(_, r)| r.records_per_s)
                .collect()
        };
        let (g, a, t) = (
            of(Mode::Guarded),
            of(Mode::AtLeastOnce),
            of(Mode::Transactional),
        );
        summary.ratios.push(RatioRow {
            broker,
            guarded_over_at_least_once: Spread::of(
                &g.iter().zip(&a).map(|(g, a)| g / a).collect::<Vec<_>>(),
            ),
            guarded_over_transactional: Spread::of(
                &g.iter().zip(&t).map(|(g, t)| g / t).collect::<Vec<_>>(),
            ),
        });
        for mode in MODES {
            let these: Vec<ThroughputRun> = runs
                .iter()
                .filter(|(m, _)| *m == mode)
                .map(|(_, r)| r.clone())
                .collect();
            summary.throughput.push(ThroughputRow {
                broker,
                mode: mode_name(mode),
                records_per_s: Spread::of(&of(mode)),
                runs: these,
            });
        }
    }
    Ok(())
}

/// The guarded pipeline through a function that waits 1 ms per record, at
/// each concurrency level, levels rotated between repetitions.
fn concurrency(rt: &tokio::runtime::Runtime, plan: &Plan, summary: &mut Summary) -> BenchResult {
    let levels = &plan.concurrency_levels;
    let mut runs: Vec<Vec<ThroughputRun>> = vec![Vec::new(); levels.len()];
    for rep in 0..plan.reps {
        for k in 0..levels.len() {
            let i = (k + rep) % levels.len();
            let r = scenarios::concurrent(
                rt,
                &CopySpec {
                    broker: BrokerKind::InProcess,
                    mode: Mode::Guarded,
                    records: plan.concurrency_records,
                    partitions: 4,
                    interval: Duration::from_secs(1),
                    retention_epochs: 0,
                },
                levels[i],
                Duration::from_millis(1),
            )?;
            println!(
                "concurrency {:>3} at a time, 1 ms each, rep {rep}: {:>8.0} records/s ({} in, {} out, {:.2} s)",
                levels[i], r.records_per_s, r.records, r.outputs, r.seconds
            );
            runs[i].push(r);
        }
    }
    let rate = |i: usize| -> Vec<f64> { runs[i].iter().map(|r| r.records_per_s).collect() };
    let one = levels.iter().position(|&n| n == 1);
    for (i, &n) in levels.iter().enumerate() {
        let over: Vec<f64> = match one {
            Some(o) => rate(i).iter().zip(rate(o)).map(|(r, b)| r / b).collect(),
            None => Vec::new(),
        };
        summary.concurrency.push(ConcurrencyRow {
            concurrency: n,
            records_per_s: Spread::of(&rate(i)),
            over_one_at_a_time: Spread::of(&over),
            runs: runs[i].clone(),
        });
    }
    Ok(())
}

fn latency(rt: &tokio::runtime::Runtime, plan: &Plan, summary: &mut Summary) -> BenchResult {
    for &broker in &plan.latency_brokers {
        latency_on(rt, plan, summary, broker)?;
    }
    Ok(())
}

fn latency_on(
    rt: &tokio::runtime::Runtime,
    plan: &Plan,
    summary: &mut Summary,
    broker: BrokerKind,
) -> BenchResult {
    for &(interval, window) in &plan.latency_runs {
        let mut runs: Vec<(Mode, LatencyRun)> = Vec::new();
        for rep in 0..plan.reps {
            for mode in rotated(rep) {
                let r = scenarios::latency(
                    rt,
                    &RateSpec {
                        broker,
                        mode,
                        partitions: plan.latency_partitions,
                        interval: Duration::from_secs_f64(interval),
                        rate: plan.rate,
                        warm: Duration::from_secs_f64(plan.warm_s),
                        window: Duration::from_secs_f64(window),
                    },
                )?;
                println!(
                    "latency     {:<17} interval {interval:>4} s {:<14} rep {rep}: p50 {:>8.1} ms  p99 {:>8.1} ms  max {:>8.1} ms by {} (read p50 {:.1} p99 {:.1}; {} samples, {} missing, {} duplicates, input queue full {}; {} checkpoints of {:.1} ms)",
                    broker.label(),
                    mode_name(mode),
                    r.p50_ms,
                    r.p99_ms,
                    r.max_ms,
                    r.visibility,
                    r.mock_read_p50_ms,
                    r.mock_read_p99_ms,
                    r.samples,
                    r.missing,
                    r.duplicates,
                    r.input_queue_full,
                    r.checkpoints,
                    r.checkpoint_ms
                );
                runs.push((mode, r));
            }
        }
        for mode in MODES {
            let these: Vec<LatencyRun> = runs
                .iter()
                .filter(|(m, _)| *m == mode)
                .map(|(_, r)| r.clone())
                .collect();
            let mut pooled: Vec<u32> = these
                .iter()
                .flat_map(|r| r.latency_us.iter().copied())
                .collect();
            pooled.sort_unstable();
            let pick = |f: fn(&LatencyRun) -> f64| these.iter().map(f).collect::<Vec<_>>();
            summary.latency.push(LatencyRow {
                broker,
                mode: mode_name(mode),
                interval_s: interval,
                rate: plan.rate,
                p50_ms: Spread::of(&pick(|r| r.p50_ms)),
                p99_ms: Spread::of(&pick(|r| r.p99_ms)),
                max_ms: Spread::of(&pick(|r| r.max_ms)),
                cdf: report::cdf_points(&pooled),
                runs: these,
            });
        }
    }
    Ok(())
}

fn recovery(rt: &tokio::runtime::Runtime, plan: &Plan, summary: &mut Summary) -> BenchResult {
    let broker = BrokerKind::InProcess;
    for &n in &plan.recovery_sizes {
        let populated = tempfile::tempdir()?;
        let populate = scenarios::populate(populated.path(), n, plan.partitions)?;
        println!(
            "recovery    {n:>10} fingerprints: populated in {:.1} s ({:.0} records/s, {} MB on disk)",
            populate.seconds,
            populate.records_per_s,
            populate.disk_bytes / 1_000_000
        );
        let mut engine = Vec::new();
        for rep in 0..plan.reps {
            let r = scenarios::engine_recovery(populated.path())?;
            println!(
                "recovery    {n:>10} fingerprints rep {rep}: engine open {:.2} s (index {} MB, peak RSS +{} MB)",
                r.open_s,
                r.index_bytes / 1_000_000,
                r.rss_peak_growth_bytes / 1_000_000
            );
            engine.push(r);
        }
        let mut restart = Vec::new();
        for rep in 0..plan.reps {
            let r = scenarios::restart(
                rt,
                &RestartSpec {
                    broker,
                    populated: populated.path(),
                    partitions: plan.partitions,
                    before_crash: plan.restart_before_crash,
                    after_crash: plan.restart_after_crash,
                },
            )?;
            println!(
                "recovery    {n:>10} fingerprints rep {rep}: pipeline restart: engine load {:.2} s, build {:.2} s, first input {:.2} s, first output {:.2} s ({} live, {} replays filtered)",
                r.engine_load_s,
                r.build_s,
                r.first_input_s,
                r.first_output_s,
                r.live_fingerprints,
                r.replays_filtered
            );
            restart.push(r);
        }
        summary.recovery.push(RecoveryRow {
            fingerprints: n,
            populate,
            engine_open_s: Spread::of(&engine.iter().map(|r| r.open_s).collect::<Vec<_>>()),
            engine,
            broker,
            restart_first_output_s: Spread::of(
                &restart.iter().map(|r| r.first_output_s).collect::<Vec<_>>(),
            ),
            restart_first_input_s: Spread::of(
                &restart.iter().map(|r| r.first_input_s).collect::<Vec<_>>(),
            ),
            restart_engine_load_s: Spread::of(
                &restart.iter().map(|r| r.engine_load_s).collect::<Vec<_>>(),
            ),
            restart,
        });
    }
    Ok(())
}

fn retention(rt: &tokio::runtime::Runtime, plan: &Plan, summary: &mut Summary) -> BenchResult {
    let broker = BrokerKind::InProcess;
    for &epochs in &plan.retention_epochs {
        let mut engine = Vec::new();
        for rep in 0..plan.reps {
            let r = scenarios::retention(epochs, plan.engine_epoch_records, plan.partitions)?;
            println!(
                "retention   {epochs:>2} epochs rep {rep}: engine {:>9.0} records/s, {} live, index {} MB, peak RSS +{} MB, checkpoint {:.0} ms",
                r.records_per_s,
                r.live_fingerprints,
                r.index_bytes / 1_000_000,
                r.rss_peak_growth_bytes / 1_000_000,
                r.checkpoint_ms
            );
            engine.push(r);
        }
        let mut pipeline = Vec::new();
        for rep in 0..plan.reps {
            let r = scenarios::throughput(
                rt,
                &CopySpec {
                    broker,
                    mode: Mode::Guarded,
                    records: plan.records,
                    partitions: plan.partitions,
                    interval: Duration::from_secs_f64(plan.retention_interval_s),
                    retention_epochs: epochs,
                },
            )?;
            println!(
                "retention   {epochs:>2} epochs rep {rep}: pipeline {:>9.0} records/s, {} checkpoints, up to {} live fingerprints in {} live epochs",
                r.records_per_s, r.checkpoints, r.live_fingerprints_max, r.live_epochs_max
            );
            pipeline.push(r);
        }
        summary.retention.push(RetentionRow {
            retention_epochs: epochs,
            engine_records_per_s: Spread::of(
                &engine.iter().map(|r| r.records_per_s).collect::<Vec<_>>(),
            ),
            engine,
            broker,
            pipeline_records_per_s: Spread::of(
                &pipeline.iter().map(|r| r.records_per_s).collect::<Vec<_>>(),
            ),
            pipeline,
        });
    }
    Ok(())
}

/// The project's targets, judged on medians of this run.
fn targets(s: &Summary) -> Vec<Target> {
    let mut out = Vec::new();
    for r in &s.ratios {
        let v = r.guarded_over_at_least_once.median;
        out.push(Target {
            what: format!("throughput guarded / at-least-once ({})", r.broker.label()),
            value: v,
            bound: ">= 0.9".into(),
            met: v >= 0.9,
        });
        let v = r.guarded_over_transactional.median;
        out.push(Target {
            what: format!("throughput guarded / transactional ({})", r.broker.label()),
            value: v,
            bound: ">= 1".into(),
            met: v >= 1.0,
        });
    }
    let p99 = |broker: BrokerKind, mode: &str, interval: f64| {
        s.latency
            .iter()
            .find(|r| r.broker == broker && r.mode == mode && r.interval_s == interval)
            .map(|r| r.p99_ms.median)
    };
    for &broker in &s.plan.latency_brokers {
        for &(interval, _) in &s.plan.latency_runs {
            let (Some(g), Some(a), Some(t)) = (
                p99(broker, "guarded", interval),
                p99(broker, "at-least-once", interval),
                p99(broker, "transactional", interval),
            ) else {
                continue;
            };
            let on = broker.label();
            out.push(Target {
                what: format!("p99 guarded / at-least-once ({on}, interval {interval} s)"),
                value: g / a,
                bound: "<= 1.5".into(),
                met: g / a <= 1.5,
            });
            out.push(Target {
                what: format!("p99 guarded / transactional ({on}, interval {interval} s)"),
                value: g / t,
                bound: "<= 0.05".into(),
                met: g / t <= 0.05,
            });
        }
    }
    out
}

fn write_outputs(plan: &Plan, summary: &Summary) -> BenchResult {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("target"));
    let mut dirs = vec![target.join("bench")];
    // Only a full run of every section replaces the published figures.
    if !plan.quick && !plan.custom && plan.reps >= 3 && SECTIONS.iter().all(|s| plan.runs(s)) {
        dirs.push(manifest.join("docs").join("bench"));
    }
    for dir in dirs {
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("pipeline.json"),
            serde_json::to_vec_pretty(summary)?,
        )?;
        if !summary.throughput.is_empty() {
            let groups: Vec<BarGroup> = plan
                .throughput_brokers
                .iter()
                .map(|b| BarGroup {
                    label: b.label().to_owned(),
                    bars: summary
                        .throughput
                        .iter()
                        .filter(|r| r.broker == *b)
                        .map(|r| (r.mode.to_owned(), r.records_per_s))
                        .collect(),
                })
                .collect();
            let title = format!(
                "Pipeline throughput: {}k records of 100 B, 1 s checkpoints",
                plan.records / 1000
            );
            report::throughput_chart(&dir.join("throughput.svg"), &title, &groups)?;
        }
        if !summary.latency.is_empty() {
            let panels: Vec<CdfPanel> = plan
                .latency_brokers
                .iter()
                .flat_map(|&b| plan.latency_runs.iter().map(move |&(i, _)| (b, i)))
                .map(|(broker, interval)| CdfPanel {
                    title: format!(
                        "Latency to visibility, {}, {}k/s, checkpoint every {interval} s",
                        broker.label(),
                        plan.rate / 1000
                    ),
                    lines: summary
                        .latency
                        .iter()
                        .filter(|r| r.broker == broker && r.interval_s == interval)
                        .map(|r| (r.mode.to_owned(), r.cdf.clone()))
                        .collect(),
                })
                .collect();
            report::latency_chart(&dir.join("latency-cdf.svg"), &panels)?;
        }
        println!("wrote {}", dir.display());
    }
    Ok(())
}
