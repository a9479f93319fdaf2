//! Partitions moving between two guarded pipelines in one consumer group,
//! with the output still exactly once (guarantee G1).
//!
//! Instance A starts alone on a 4-partition input and copies it to a
//! 4-partition output. Instance B, with a state folder of its own, joins
//! mid-stream: some partitions move from A to B (A checkpoints them on
//! revoke, B recovers them on assign). Then A is killed between checkpoints,
//! and after its session times out B takes over A's partitions with no local
//! state for them: it starts from the group's committed offsets and reads
//! the output back to find what A wrote after its last checkpoint, so that
//! work is not repeated.
//!
//! Every input integer must appear exactly once in the output; the example
//! exits non-zero otherwise. Runs on librdkafka's in-process mock cluster:
//! `cargo run --release --example rebalance` (add
//! `RUST_LOG=replayguard=info` to watch each revoke, assign and recovery).

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use replayguard::kafka::{GuardOptions, GuardedPipeline, OutputRecord};

type Result<T = (), E = Box<dyn Error + Send + Sync>> = std::result::Result<T, E>;

const INPUT: &str = "readings";
const OUTPUT: &str = "readings-copy";
const PARTITIONS: i32 = 4;
/// Integers are written round-robin over the partitions, one every `PERIOD`,
/// until B has taken over.
const PERIOD: Duration = Duration::from_millis(5);
const CHECKPOINT: Duration = Duration::from_secs(1);
/// When B joins, after A has started copying.
const B_JOINS_AFTER: Duration = Duration::from_secs(1);
/// How long the two share the work before A is killed.
const SHARED_FOR: Duration = Duration::from_secs(2);

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    // RUST_LOG=replayguard=info shows each revoke, assign and recovery.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rebalance: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Per partition, when an instance copied its first and last record, in
/// seconds since the start.
type Spans = Arc<Mutex<BTreeMap<i32, (f64, f64)>>>;

async fn run() -> Result {
    let t0 = Instant::now();
    let cluster = MockCluster::new(1)?;
    cluster.create_topic(INPUT, PARTITIONS, 1)?;
    cluster.create_topic(OUTPUT, PARTITIONS, 1)?;
    let bootstrap = cluster.bootstrap_servers();
    let stop_input = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(bootstrap.clone(), stop_input.clone()));

    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (spans_a, spans_b) = (Spans::default(), Spans::default());
    let mut a = pipeline(&bootstrap, dir_a.path()).await?;
    let watch_a = a.stats_handle();
    let copy_a = copier(t0, spans_a.clone());
    let b_copying = spans_b.clone();
    let task_a = tokio::spawn(async move {
        let run_start = Instant::now();
        // A is killed once B has copied for SHARED_FOR, half-way between two
        // of A's checkpoints (they fall every CHECKPOINT from its start).
        let crash = async move {
            while b_copying
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let since = (Instant::now() + SHARED_FOR).duration_since(run_start);
            let ticks = since.as_micros().div_ceil(CHECKPOINT.as_micros());
            let at =
                run_start + CHECKPOINT * u32::try_from(ticks).unwrap_or(u32::MAX) + CHECKPOINT / 2;
            tokio::time::sleep_until(at.into()).await;
        };
        tokio::select! {
            r = a.run(copy_a) => {
                r?;
                return Err::<_, Box<dyn Error + Send + Sync>>("A stopped before its crash".into());
            }
            () = crash => {}
        }
        let stats = a.stats();
        a.abort();
        Ok((Instant::now(), stats))
    });

    // B joins while A is mid-stream.
    while watch_a.stats().records_in == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(watch_a);
    tokio::time::sleep(B_JOINS_AFTER).await;
    let b_joined = t0.elapsed();
    let mut b = pipeline(&bootstrap, dir_b.path()).await?;
    let stats_b = b.stats_handle();
    // B stops once the output holds as many records as were written.
    let written = Arc::new(AtomicU64::new(0));
    let done = {
        let (bootstrap, written) = (bootstrap.clone(), written.clone());
        async move {
            loop {
                let target = written.load(Ordering::SeqCst);
                if target > 0 && output_len(&bootstrap).await.unwrap_or(0) >= target as i64 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Time for anything written twice to show up.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    };
    let copy_b = copier(t0, spans_b.clone());
    let task_b = tokio::spawn(async move {
        let r = tokio::time::timeout(Duration::from_secs(90), b.run_until(copy_b, done)).await;
        std::thread::spawn(move || drop(b));
        match r {
            Ok(r) => Ok(r?),
            Err(_) => Err::<_, Box<dyn Error + Send + Sync>>(
                "the output did not reach every input in 90 s".into(),
            ),
        }
    });

    let (a_killed, a_stats) = task_a.await??;
    // The input goes on until B has taken over every partition.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held = spans_b
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|(_, last)| *last > a_killed.duration_since(t0).as_secs_f64())
            .count();
        if held == PARTITIONS as usize {
            break;
        }
        if Instant::now() > deadline {
            return Err("B did not take over A's partitions within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_input.store(true, Ordering::SeqCst);
    let integers = producer.await??;
    written.store(integers, Ordering::SeqCst);
    let b_stats = task_b.await??;
    let b_filtered = stats_b.stats().duplicates;
    drop(stats_b);

    let out = read_output(&bootstrap).await?;
    let mut copies: BTreeMap<u64, u32> = BTreeMap::new();
    for v in &out {
        *copies.entry(*v).or_insert(0) += 1;
    }
    let twice = copies.values().filter(|c| **c > 1).count();
    let missing = (1..=integers).filter(|v| !copies.contains_key(v)).count();

    println!(
        "{integers} integers written to {INPUT:?} over {PARTITIONS} partitions, one every {} ms;\n\
         two guarded pipelines in one group copy them to {OUTPUT:?}.\n\
         B joined at {:.1} s; A was killed at {:.1} s, between two checkpoints.\n",
        PERIOD.as_millis(),
        b_joined.as_secs_f64(),
        a_killed.duration_since(t0).as_secs_f64()
    );
    println!("Which instance copied which partition, in seconds since the start:");
    for p in 0..PARTITIONS {
        let span = |s: &Spans| {
            s.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&p)
                .map_or("-".to_owned(), |(a, b)| format!("{a:.1} to {b:.1}"))
        };
        println!(
            "  partition {p}:   A {:<14} B {}",
            span(&spans_a),
            span(&spans_b)
        );
    }
    println!(
        "\nA read {} records before it was killed. B read {} and filtered {} of them as\n\
         already copied: work A did after its last checkpoint, found in the output.\n",
        a_stats.records_in, b_stats.records_in, b_filtered
    );
    println!(
        "Output: {} records; integers written twice: {twice}; missing: {missing}.",
        out.len()
    );
    drop(cluster);
    if twice > 0 || missing > 0 || out.len() as u64 != integers {
        return Err(format!(
            "not exactly once: {twice} integers twice, {missing} missing, {} records for {integers} inputs",
            out.len()
        )
        .into());
    }
    Ok(())
}

async fn pipeline(
    bootstrap: &str,
    state: &std::path::Path,
) -> replayguard::Result<GuardedPipeline> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "copiers")
        .set("session.timeout.ms", "6000")
        .set("auto.offset.reset", "earliest");
    GuardedPipeline::builder(config, state)
        .input(INPUT)
        .output(OUTPUT)
        .options(GuardOptions::default().checkpoint_interval(CHECKPOINT))
        .build()
        .await
}

type Copied = std::pin::Pin<
    Box<dyn Future<Output = Result<Vec<OutputRecord>, std::convert::Infallible>> + Send>,
>;

/// The user function: a copy, noting which partitions this instance handles.
fn copier(t0: Instant, spans: Spans) -> impl FnMut(OwnedMessage) -> Copied {
    move |m| {
        let now = t0.elapsed().as_secs_f64();
        spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(m.partition())
            .and_modify(|(_, last)| *last = now)
            .or_insert((now, now));
        let out = OutputRecord::copy_of(&m);
        Box::pin(async move { Ok(vec![out]) })
    }
}

/// Writes increasing integers round-robin over the partitions until told
/// to stop; returns how many.
async fn produce(bootstrap: String, stop: Arc<AtomicBool>) -> Result<u64> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .create()?;
    let mut tick = tokio::time::interval(PERIOD);
    let mut deliveries = Vec::new();
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        i += 1;
        let text = i.to_string();
        let partition = (i % PARTITIONS as u64) as i32;
        let record = FutureRecord::<(), _>::to(INPUT)
            .payload(&text)
            .partition(partition);
        deliveries.push(
            producer
                .send_result(record)
                .map_err(|(e, _)| format!("writing {i}: {e}"))?,
        );
    }
    for d in deliveries {
        d.await?.map_err(|(e, _)| e)?;
    }
    producer.flush(Duration::from_secs(10))?;
    Ok(i)
}

/// Records in the output, summed over its partitions.
async fn output_len(bootstrap: &str) -> Result<i64> {
    let bootstrap = bootstrap.to_owned();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .create()?;
        let mut n = 0;
        for p in 0..PARTITIONS {
            let (lo, hi) = c.fetch_watermarks(OUTPUT, p, Duration::from_secs(5))?;
            n += hi - lo;
        }
        Ok(n)
    })
    .await?
}

/// Every integer in the output, read with a plain consumer.
async fn read_output(bootstrap: &str) -> Result<Vec<u64>> {
    let bootstrap = bootstrap.to_owned();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", "rebalance-check")
            .set("enable.auto.commit", "false")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        let mut left = BTreeMap::new();
        for p in 0..PARTITIONS {
            let (lo, hi) = c.fetch_watermarks(OUTPUT, p, Duration::from_secs(5))?;
            if hi > lo {
                tpl.add_partition_offset(OUTPUT, p, Offset::Offset(lo))?;
                left.insert(p, hi);
            }
        }
        c.assign(&tpl)?;
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !left.is_empty() {
            if Instant::now() > deadline {
                return Err(format!("reading {OUTPUT} timed out; partitions left {left:?}").into());
            }
            let Some(m) = c.poll(Duration::from_millis(100)) else {
                continue;
            };
            let m = m?;
            out.push(std::str::from_utf8(m.payload().unwrap_or_default())?.parse()?);
            if left
                .get(&m.partition())
                .is_some_and(|hi| m.offset() + 1 >= *hi)
            {
                left.remove(&m.partition());
            }
        }
        Ok(out)
    })
    .await?
}
