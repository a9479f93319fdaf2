//! One run of each measurement. Every run starts its own broker and its own
//! state folder, so runs share nothing but the machine.

use std::convert::Infallible;
use std::future::Ready;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::message::Message;
use rdkafka::message::OwnedMessage;
use replayguard::kafka::baseline::Baseline;
use replayguard::kafka::{
    GuardOptions, GuardedPipeline, GuardedPipelineBuilder, OutputRecord, StatsHandle,
};

/// How a pipeline copies: replayguard, or a baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Guarded,
    AtLeastOnce,
    Transactional,
}

impl Mode {
    fn apply(self, b: GuardedPipelineBuilder) -> GuardedPipelineBuilder {
        match self {
            Mode::Guarded => b,
            Mode::AtLeastOnce => b.baseline(Baseline::AtLeastOnce),
            Mode::Transactional => b.baseline(Baseline::Transactional),
        }
    }
}
use replayguard::{Fingerprint, Guard, LaneId};
use serde::Serialize;
use tokio::runtime::Runtime;

use crate::BenchResult;
use crate::broker::{Broker, BrokerKind};
use crate::load::{self, Paced, RECORD_BYTES, Reader};

/// Input and output topic names; both have the same partition count.
const INPUT: &str = "in";
const OUTPUT: &str = "out";

/// Synthetic fingerprints (recovery and retention runs) use sequence numbers
/// from here, so they never match a real input.
const SYNTHETIC_SEQ: u64 = 1 << 40;
/// And offsets from here, so they never match a real input's position.
const SYNTHETIC_OFFSET: u64 = 1 << 32;

/// How long the mock may hold a fetch that finds no data. The mock holds
/// such a fetch for the whole wait and does not answer early when data
/// arrives (a real broker does), so with librdkafka's default of 500 ms
/// every consumer at the tail would add up to 500 ms to every record, in
/// every mode.
pub const FETCH_WAIT_MS: &str = "10";

/// How long librdkafka postpones the next fetch of a partition whose local
/// queue is over its thresholds. The default, 1000 ms, kicks in after every
/// large fetch from the mock (one produce batch per partition, here about
/// 130k records in all), so with it every mode copied in bursts once a
/// second, at about 130k records/s alike.
pub const FETCH_QUEUE_BACKOFF_MS: &str = "10";

/// The consumer configuration every pipeline gets: what a user must set,
/// the session timeout the mock needs for a prompt rejoin,
/// [`FETCH_WAIT_MS`] and [`FETCH_QUEUE_BACKOFF_MS`].
fn consumer_config(bootstrap: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("fetch.wait.max.ms", FETCH_WAIT_MS)
        .set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS)
        .set("auto.offset.reset", "earliest");
    c
}

type CopyFn = Box<dyn FnMut(OwnedMessage) -> Ready<Result<Vec<OutputRecord>, Infallible>> + Send>;

/// The user function of every run: copy the input, noting the time of the
/// first call and counting calls.
fn copier(first: Arc<OnceLock<Instant>>, calls: Arc<AtomicU64>) -> CopyFn {
    Box::new(move |m: OwnedMessage| {
        first.get_or_init(Instant::now);
        calls.fetch_add(1, Ordering::Relaxed);
        std::future::ready(Ok(vec![OutputRecord::copy_of(&m)]))
    })
}

/// Closes a pipeline within 30 s: closing a librdkafka consumer of the
/// mock has been seen to block for minutes.
fn close(rt: &Runtime, p: GuardedPipeline) {
    if let Err(e) = rt.block_on(p.close(Duration::from_secs(30))) {
        eprintln!("  ({e}; left behind)");
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ---------------------------------------------------------------------------
// Throughput

/// One copy of the whole input by one mode.
#[derive(Clone, Debug, Serialize)]
pub struct ThroughputRun {
    /// Inputs received.
    pub records: u64,
    /// Outputs acked.
    pub outputs: u64,
    /// From the first input handed to the user function to the end of the
    /// final checkpoint.
    pub seconds: f64,
    /// `records / seconds`.
    pub records_per_s: f64,
    /// Checkpoints (transaction commits in transactional mode).
    pub checkpoints: u64,
    /// From `build()` to the first input (group join, recovery).
    pub to_first_input_s: f64,
    /// Largest number of live fingerprints seen during the run (guarded).
    pub live_fingerprints_max: u64,
    /// Largest number of live epochs seen during the run (guarded).
    pub live_epochs_max: u64,
    /// Live fingerprints after the final checkpoint (guarded).
    pub live_fingerprints_end: u64,
    /// State folder bytes after the final checkpoint (guarded).
    pub disk_bytes: u64,
}

/// What a throughput run copies, and how.
pub struct CopySpec {
    pub broker: BrokerKind,
    pub mode: Mode,
    pub records: u64,
    pub partitions: i32,
    pub interval: Duration,
    pub retention_epochs: u32,
}

/// Produces `records` inputs, then copies them with one pipeline to the end
/// of the input.
pub fn throughput(rt: &Runtime, spec: &CopySpec) -> BenchResult<ThroughputRun> {
    copy_run(rt, spec, 1, Duration::ZERO)
}

/// As [`throughput`], with a user function that waits `work` per record
/// (standing for a call to another service), `concurrency` records at a
/// time.
pub fn concurrent(
    rt: &Runtime,
    spec: &CopySpec,
    concurrency: usize,
    work: Duration,
) -> BenchResult<ThroughputRun> {
    copy_run(rt, spec, concurrency, work)
}

fn copy_run(
    rt: &Runtime,
    spec: &CopySpec,
    concurrency: usize,
    work: Duration,
) -> BenchResult<ThroughputRun> {
    let broker = Broker::start(
        spec.broker,
        &[(INPUT, spec.partitions), (OUTPUT, spec.partitions)],
    )?;
    load::produce_bulk(broker.bootstrap(), INPUT, spec.partitions, 0..spec.records)?;
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    // Not `stop_at_end`: its end check queries the watermarks of every
    // partition at each partition EOF, which costs seconds with 32
    // partitions. The run stops once every input has reached the user
    // function; the final checkpoint then waits for every output's ack.
    let builder =
        GuardedPipeline::builder(consumer_config(broker.bootstrap(), "bench"), dir.path())
            .input(INPUT)
            .output(OUTPUT)
            .options(
                GuardOptions::default()
                    .checkpoint_interval(spec.interval)
                    .retention_epochs(spec.retention_epochs),
            );
    let mut p = rt.block_on(spec.mode.apply(builder).build())?;
    let first = Arc::new(OnceLock::new());
    let calls = Arc::new(AtomicU64::new(0));
    let copy = copier(first.clone(), calls.clone());
    let handle = p.stats_handle();
    let mut live_max = 0u64;
    let mut epochs_max = 0u64;
    let stats = rt.block_on(async {
        let sample = async {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let st = handle.stats();
                let live = st.guard.as_ref().map_or(0, |g| g.live_fingerprints);
                live_max = live_max.max(live);
                epochs_max = epochs_max.max(st.guard.map_or(0, |g| g.live_epochs));
                tracing::debug!(
                    records = st.records_in,
                    outputs = st.outputs,
                    checkpoints = st.checkpoints,
                    live,
                    "progress"
                );
            }
        };
        let all_in = async {
            while calls.load(Ordering::Relaxed) < spec.records {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        if work.is_zero() {
            tokio::select! {
                r = p.run_concurrent_until(concurrency, copy, all_in) => r,
                () = sample => unreachable!("the sampler never ends"),
            }
        } else {
            let mut copy = copy;
            let waiting = move |m: OwnedMessage| {
                let out = copy(m);
                async move {
                    tokio::time::sleep(work).await;
                    out.await
                }
            };
            tokio::select! {
                r = p.run_concurrent_until(concurrency, waiting, all_in) => r,
                () = sample => unreachable!("the sampler never ends"),
            }
        }
    })?;
    let ended = Instant::now();
    drop(handle);
    let first = *first
        .get()
        .ok_or("the pipeline never called the user function")?;
    let seconds = secs(ended - first);
    let guard = stats.guard.clone().unwrap_or_default();
    close(rt, p);
    drop(broker);
    Ok(ThroughputRun {
        records: stats.records_in,
        outputs: stats.outputs,
        seconds,
        records_per_s: stats.records_in as f64 / seconds,
        checkpoints: stats.checkpoints,
        to_first_input_s: secs(first - started),
        live_fingerprints_max: live_max.max(guard.live_fingerprints),
        live_epochs_max: epochs_max.max(guard.live_epochs),
        live_fingerprints_end: guard.live_fingerprints,
        disk_bytes: guard.disk_bytes,
    })
}

// ---------------------------------------------------------------------------
// Latency to visibility

/// One steady-rate run of one mode.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyRun {
    /// Records in the measured window.
    pub samples: u64,
    /// How visibility was judged: `read` (when the reader first saw the
    /// record) or `commit` (transactional: when the transaction holding the
    /// record had committed, and the reader had seen it).
    pub visibility: &'static str,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Transactional mode: what the `read_committed` reader of the mock saw
    /// (the mock ignores the isolation level, so this is read latency).
    pub mock_read_p50_ms: f64,
    pub mock_read_p99_ms: f64,
    /// Checkpoints completed during the run, and their median duration
    /// from start to the first input after it (for the transactional mode,
    /// the commit).
    pub checkpoints: u64,
    pub checkpoint_ms: f64,
    /// Window records the reader never saw, or whose commit was not seen
    /// (should be 0).
    pub missing: u64,
    /// Records the reader saw twice (should be 0: no crash here).
    pub duplicates: u64,
    /// Times the input producer found its queue full and waited (the
    /// broker fell behind the steady rate; should be 0).
    pub input_queue_full: u64,
    /// Sorted latencies, for the CDF; not in the summary.
    #[serde(skip)]
    pub latency_us: Vec<u32>,
}

/// How a latency run loads the pipeline.
pub struct RateSpec {
    pub broker: BrokerKind,
    pub mode: Mode,
    pub partitions: i32,
    pub interval: Duration,
    pub rate: u64,
    /// Time after the first input before the window opens.
    pub warm: Duration,
    /// Length of the window whose records are measured.
    pub window: Duration,
}

/// The `q` quantile of sorted `v`, in milliseconds.
pub fn quantile_ms(v: &[u32], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    f64::from(v[i]) / 1000.0
}

/// The user function of latency runs: a copy that also notes when each
/// record (by sequence number) was handed to it.
fn noting_copier(first: Arc<OnceLock<Instant>>, handed: Arc<Mutex<Vec<u64>>>) -> CopyFn {
    Box::new(move |m: OwnedMessage| {
        first.get_or_init(Instant::now);
        if let Some((seq, _)) = m.payload().and_then(load::parse)
            && let Ok(mut h) = handed.lock()
        {
            let i = seq as usize;
            if h.len() <= i {
                h.resize(i + 1, 0);
            }
            h[i] = load::now_us();
        }
        std::future::ready(Ok(vec![OutputRecord::copy_of(&m)]))
    })
}

/// Watches a pipeline's counters every millisecond and notes each
/// checkpoint as (start, end) in microseconds. The run loop hands no input
/// to the user function from the start of a checkpoint (all outputs acked,
/// the manifest written or the transaction committed) to its end, so the
/// start is when the checkpoint counter moves and the end is when the next
/// input arrives.
struct CheckpointWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, u64)>>,
}

impl CheckpointWatch {
    fn start(handle: StatsHandle) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut done = Vec::new();
            let first = handle.stats();
            let mut checkpoints = first.checkpoints;
            let mut open: Option<(u64, u64)> = None;
            while !stop2.load(Ordering::Relaxed) {
                let st = handle.stats();
                let now = load::now_us();
                if st.checkpoints > checkpoints {
                    if let Some((start, _)) = open.take() {
                        done.push((start, now));
                    }
                    open = Some((now, st.records_in));
                    checkpoints = st.checkpoints;
                } else if let Some((start, records)) = open
                    && st.records_in > records
                {
                    done.push((start, now));
                    open = None;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            done
        });
        CheckpointWatch { stop, thread }
    }

    fn finish(self) -> Vec<(u64, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// Loads a pipeline at a steady rate and measures, for the records produced
/// in a window, the time from produce to visible in the output.
///
/// On Apache Kafka the transactional mode's reader is `read_committed` and
/// what it sees is the measure. librdkafka's mock cluster ignores
/// `isolation.level` (its fetch answers with the log end as the last stable
/// offset), so a `read_committed` reader sees transactional output before
/// the commit. On the mock a transactional record is therefore counted
/// visible once the reader has seen it *and* the checkpoint after its
/// hand-off has committed its transaction; a real broker adds the commit
/// markers and the reader's next fetch to that.
pub fn latency(rt: &Runtime, spec: &RateSpec) -> BenchResult<LatencyRun> {
    let transactional = spec.mode == Mode::Transactional;
    // Visibility derived from the commits, where the broker cannot show it.
    let derived = transactional && spec.broker != BrokerKind::Kafka;
    let broker = Broker::start(
        spec.broker,
        &[(INPUT, spec.partitions), (OUTPUT, spec.partitions)],
    )?;
    let reader = Reader::start(broker.bootstrap(), OUTPUT, spec.partitions, transactional)?;
    let dir = tempfile::tempdir()?;
    let builder =
        GuardedPipeline::builder(consumer_config(broker.bootstrap(), "bench"), dir.path())
            .input(INPUT)
            .output(OUTPUT)
            .options(GuardOptions::default().checkpoint_interval(spec.interval));
    let mut p = rt.block_on(spec.mode.apply(builder).build())?;
    let first = Arc::new(OnceLock::new());
    let handed = Arc::new(Mutex::new(Vec::new()));
    let f = noting_copier(first.clone(), handed.clone());
    let watch = CheckpointWatch::start(p.stats_handle());
    // A trickle until the pipeline has joined its group and handles input,
    // so that the measured load starts with no backlog.
    let paced = Paced::start(broker.bootstrap(), INPUT, spec.partitions, 100)?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let control = async {
        let deadline = Instant::now() + Duration::from_secs(60);
        while first.get().is_none() {
            if Instant::now() > deadline {
                let _ = stop_tx.send(());
                return Err::<(u64, u64), String>("no input reached the pipeline".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        paced.set_rate(spec.rate);
        tokio::time::sleep(spec.warm).await;
        let lo = paced.sent();
        tokio::time::sleep(spec.window).await;
        let hi = paced.sent();
        // Load goes on until the window is visible, and for the
        // transactional mode until a regular checkpoint after the window
        // has committed, so no window record is committed by the stop.
        let limit = Instant::now() + spec.interval * 3 + Duration::from_secs(30);
        while reader.count_in(lo, hi) < hi - lo && Instant::now() < limit {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if transactional {
            tokio::time::sleep(spec.interval + Duration::from_millis(500)).await;
        }
        let _ = stop_tx.send(());
        Ok((lo, hi))
    };
    let stop = async {
        let _ = stop_rx.await;
    };
    let (run, window) = rt.block_on(async { tokio::join!(p.run_until(f, stop), control) });
    let stopped = paced.stop();
    let checkpoints = watch.finish();
    close(rt, p);
    run?;
    let input_queue_full = stopped?;
    let (lo, hi) = window?;
    let seen = reader.finish(lo, hi)?;
    drop(broker);

    let read: Vec<u32> = sorted(seen.records.iter().map(|r| r.2.saturating_sub(r.1)));
    let handed = handed.lock().map_err(|_| "hand-off times poisoned")?;
    let mut unresolved = 0u64;
    let latency_us = if derived {
        sorted(seen.records.iter().filter_map(|&(seq, stamp, seen_at)| {
            let at = handed.get(seq as usize).copied().unwrap_or(0);
            let commit = checkpoints.iter().find(|c| c.0 > at).map(|c| c.1);
            if commit.is_none() || at == 0 {
                unresolved += 1;
            }
            commit.map(|c| c.max(seen_at).saturating_sub(stamp))
        }))
    } else {
        read.clone()
    };
    let mut durations: Vec<f64> = checkpoints
        .iter()
        .map(|c| (c.1 - c.0) as f64 / 1000.0)
        .collect();
    durations.sort_by(f64::total_cmp);
    let v = &latency_us;
    Ok(LatencyRun {
        samples: hi - lo,
        visibility: if derived {
            "commit"
        } else if transactional {
            "read_committed"
        } else {
            "read"
        },
        p50_ms: quantile_ms(v, 0.50),
        p99_ms: quantile_ms(v, 0.99),
        max_ms: quantile_ms(v, 1.0),
        mock_read_p50_ms: quantile_ms(&read, 0.50),
        mock_read_p99_ms: quantile_ms(&read, 0.99),
        checkpoints: checkpoints.len() as u64,
        checkpoint_ms: durations
            .get(durations.len() / 2)
            .copied()
            .unwrap_or(f64::NAN),
        missing: seen.missing + unresolved,
        duplicates: seen.duplicates,
        input_queue_full,
        latency_us,
    })
}

fn sorted(v: impl Iterator<Item = u64>) -> Vec<u32> {
    let mut v: Vec<u32> = v.map(|x| x.min(u64::from(u32::MAX)) as u32).collect();
    v.sort_unstable();
    v
}

// ---------------------------------------------------------------------------
// Recovery

/// Filling a state folder through the engine.
#[derive(Clone, Debug, Serialize)]
pub struct PopulateRun {
    pub fingerprints: u64,
    pub seconds: f64,
    pub records_per_s: f64,
    pub disk_bytes: u64,
}

/// Records `n` synthetic inputs (a fingerprint and an offset each, over
/// `lanes` lanes of the input topic) and stops with no checkpoint, as a
/// crashed pipeline would: all of them are in the open epoch.
pub fn populate(dir: &Path, n: u64, lanes: i32) -> BenchResult<PopulateRun> {
    let started = Instant::now();
    let mut g = Guard::builder(dir).open()?;
    let ids: Vec<LaneId> = (0..lanes).map(|p| g.lane(INPUT, p)).collect();
    let mut buf = [0u8; RECORD_BYTES];
    for i in 0..n {
        load::fill(&mut buf, SYNTHETIC_SEQ + i, 0);
        let fp = Fingerprint::content(None, Some(&buf));
        let lane = ids[(i % lanes as u64) as usize];
        g.record(lane, Some(SYNTHETIC_OFFSET + i / lanes as u64), Some(fp))?;
    }
    g.flush()?;
    let seconds = secs(started.elapsed());
    drop(g);
    Ok(PopulateRun {
        fingerprints: n,
        seconds,
        records_per_s: n as f64 / seconds,
        disk_bytes: dir_bytes(dir),
    })
}

/// Reopening a crashed state folder with the engine alone.
#[derive(Clone, Debug, Serialize)]
pub struct EngineRecoveryRun {
    /// Wall time of `Guard::builder(path).open()`.
    pub open_s: f64,
    /// The engine's own `stats().last_recovery`.
    pub last_recovery_s: f64,
    pub live_fingerprints: u64,
    /// The index's estimate of its heap bytes.
    pub index_bytes: u64,
    /// Peak resident-set growth during the open.
    pub rss_peak_growth_bytes: u64,
}

/// Opens a copy of the populated folder `src`.
pub fn engine_recovery(src: &Path) -> BenchResult<EngineRecoveryRun> {
    let dir = tempfile::tempdir()?;
    copy_dir(src, dir.path())?;
    let before = memory().rss;
    reset_peak();
    let started = Instant::now();
    let g = Guard::builder(dir.path()).open()?;
    let open_s = secs(started.elapsed());
    let peak = memory().peak;
    let st = g.stats();
    let run = EngineRecoveryRun {
        open_s,
        last_recovery_s: secs(st.last_recovery),
        live_fingerprints: st.live_fingerprints,
        index_bytes: g.memory_bytes() as u64,
        rss_peak_growth_bytes: peak.saturating_sub(before),
    };
    drop(g);
    Ok(run)
}

/// A guarded pipeline restarted after `abort()` over a state holding many
/// live fingerprints.
#[derive(Clone, Debug, Serialize)]
pub struct RestartRun {
    /// Live fingerprints when the restarted pipeline opened its state.
    pub live_fingerprints: u64,
    /// The engine's load time inside `build()`.
    pub engine_load_s: f64,
    /// `build()`: engine load, broker connection, subscription.
    pub build_s: f64,
    /// From the start of `build()` to the first input handed to the user
    /// function: group join, assignment, output reconciliation.
    pub first_input_s: f64,
    /// From the start of `build()` to the first new output acked.
    pub first_output_s: f64,
    /// Replayed inputs filtered before that output.
    pub replays_filtered: u64,
}

/// How a restart run is set up.
pub struct RestartSpec<'a> {
    pub broker: BrokerKind,
    pub populated: &'a Path,
    pub partitions: i32,
    /// Inputs the first incarnation copies before it is aborted.
    pub before_crash: u64,
    /// Inputs produced while it is down.
    pub after_crash: u64,
}

/// A guarded pipeline over a copy of `populated` copies `before_crash`
/// inputs and is aborted with no checkpoint (the open epoch then holds the
/// populated fingerprints and those inputs). More inputs arrive; a second
/// pipeline restarts over the same folder and is timed to its first output.
/// On the way it loads the state, rejoins the group, reconciles the output
/// and filters the replayed inputs.
pub fn restart(rt: &Runtime, spec: &RestartSpec<'_>) -> BenchResult<RestartRun> {
    let broker = Broker::start(
        spec.broker,
        &[(INPUT, spec.partitions), (OUTPUT, spec.partitions)],
    )?;
    load::produce_bulk(
        broker.bootstrap(),
        INPUT,
        spec.partitions,
        0..spec.before_crash,
    )?;
    let dir = tempfile::tempdir()?;
    copy_dir(spec.populated, dir.path())?;
    // A long interval: no checkpoint before the crash.
    let build = || {
        rt.block_on(
            GuardedPipeline::builder(consumer_config(broker.bootstrap(), "bench"), dir.path())
                .input(INPUT)
                .output(OUTPUT)
                .options(GuardOptions::default().checkpoint_interval(Duration::from_secs(3600)))
                .build(),
        )
    };
    let mut p = build()?;
    let calls = Arc::new(AtomicU64::new(0));
    let f = copier(Arc::new(OnceLock::new()), calls.clone());
    let handle = p.stats_handle();
    rt.block_on(async {
        let copied = async {
            while handle.stats().outputs < spec.before_crash {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::select! {
            r = p.run(f) => r.map(|_| ()),
            () = copied => Ok(()),
        }
    })?;
    drop(handle);
    p.abort();
    load::produce_bulk(
        broker.bootstrap(),
        INPUT,
        spec.partitions,
        spec.before_crash..spec.before_crash + spec.after_crash,
    )?;

    let started = Instant::now();
    let mut p = build()?;
    let build_s = secs(started.elapsed());
    let guard = p.stats().guard.unwrap_or_default();
    let first = Arc::new(OnceLock::new());
    let f = copier(first.clone(), Arc::new(AtomicU64::new(0)));
    let handle = p.stats_handle();
    rt.block_on(async {
        let first_output = async {
            while handle.stats().outputs == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::select! {
            r = p.run(f) => r.map(|_| ()),
            () = first_output => Ok(()),
        }
    })?;
    let first_output_s = secs(started.elapsed());
    let stats = handle.stats();
    drop(handle);
    let first_input_s = first.get().map_or(f64::NAN, |t| secs(*t - started));
    p.abort();
    drop(broker);
    Ok(RestartRun {
        live_fingerprints: guard.live_fingerprints,
        engine_load_s: secs(guard.last_recovery),
        build_s,
        first_input_s,
        first_output_s,
        replays_filtered: stats.duplicates,
    })
}

// ---------------------------------------------------------------------------
// Cost growth with retention, engine alone

/// The engine recording at full speed with a checkpoint every epoch.
#[derive(Clone, Debug, Serialize)]
pub struct RetentionRun {
    pub retention_epochs: u32,
    pub epoch_records: u64,
    /// Records per second over the last two epochs (retention full),
    /// checkpoints included.
    pub records_per_s: f64,
    /// Live fingerprints just before the last checkpoint.
    pub live_fingerprints: u64,
    /// The index's estimate of its heap bytes then.
    pub index_bytes: u64,
    /// Peak resident-set growth over the run.
    pub rss_peak_growth_bytes: u64,
    /// Median checkpoint time over the last two epochs.
    pub checkpoint_ms: f64,
    /// State folder bytes at the end.
    pub disk_bytes: u64,
}

/// Records `(retention + 3)` epochs of `epoch_records` synthetic inputs over
/// `lanes` lanes, with a checkpoint after each.
pub fn retention(retention: u32, epoch_records: u64, lanes: i32) -> BenchResult<RetentionRun> {
    let dir = tempfile::tempdir()?;
    let before = memory().rss;
    reset_peak();
    let mut g = Guard::builder(dir.path())
        .retention_epochs(retention)
        .open()?;
    let ids: Vec<LaneId> = (0..lanes).map(|p| g.lane(INPUT, p)).collect();
    let epochs = u64::from(retention) + 3;
    let mut buf = [0u8; RECORD_BYTES];
    let (mut measured, mut measured_records) = (Duration::ZERO, 0u64);
    let mut checkpoints = Vec::new();
    let (mut live, mut index_bytes) = (0, 0);
    for e in 0..epochs {
        let started = Instant::now();
        for i in e * epoch_records..(e + 1) * epoch_records {
            load::fill(&mut buf, SYNTHETIC_SEQ + i, 0);
            let fp = Fingerprint::content(None, Some(&buf));
            let lane = ids[(i % lanes as u64) as usize];
            g.record(lane, Some(i / lanes as u64), Some(fp))?;
        }
        if e + 1 == epochs {
            live = g.stats().live_fingerprints;
            index_bytes = g.memory_bytes() as u64;
        }
        let next = (e + 1) * epoch_records / lanes as u64;
        let positions: Vec<(LaneId, u64)> = ids.iter().map(|l| (*l, next)).collect();
        let report = g.checkpoint(&positions, Vec::new())?;
        if e + 2 >= epochs {
            measured += started.elapsed();
            measured_records += epoch_records;
            checkpoints.push(report.duration.as_secs_f64() * 1000.0);
        }
    }
    let peak = memory().peak;
    let disk_bytes = g.stats().disk_bytes;
    drop(g);
    checkpoints.sort_by(f64::total_cmp);
    Ok(RetentionRun {
        retention_epochs: retention,
        epoch_records,
        records_per_s: measured_records as f64 / measured.as_secs_f64(),
        live_fingerprints: live,
        index_bytes,
        rss_peak_growth_bytes: peak.saturating_sub(before),
        checkpoint_ms: checkpoints
            .get(checkpoints.len() / 2)
            .copied()
            .unwrap_or(0.0),
        disk_bytes,
    })
}

// ---------------------------------------------------------------------------
// Helpers

fn copy_dir(src: &Path, dst: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to)?;
        } else {
            std::fs::copy(entry.path(), to)?;
        }
    }
    Ok(())
}

/// Bytes allocated on disk under `dir` (fjall preallocates its journal, so
/// file lengths overstate it).
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// Resident set now and its peak, in bytes (0 where /proc is missing).
pub struct Memory {
    pub rss: u64,
    pub peak: u64,
}

pub fn memory() -> Memory {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    Memory {
        rss: field("VmRSS:"),
        peak: field("VmHWM:"),
    }
}

/// Resets the peak resident set (Linux `clear_refs` 5).
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
