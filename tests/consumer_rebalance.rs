//! G2 across clean rebalances, on Apache Kafka: two guarded consumers in
//! one group, each with its own state folder, the second joining while the
//! first is mid-way through the topic and leaving before the end. Each
//! takes records in batches and acks a batch once handled, so records are
//! out, unacked, when a rebalance moves their partition. Every record is
//! handled exactly once over both, where an ack refused with
//! `Error::Revoked` undoes the handling (as a transaction that commits
//! after the ack would). Before the refusal, such an ack returned `Ok`
//! without recording anything, and the partition's new owner delivered the
//! record again: 6 records of 6,000 were handled twice in the run that
//! found it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::Message;
use replayguard::kafka::{GuardOptions, GuardedConsumer};
use replayguard_testkit::{KafkaBroker, TestResult, produce_integers};

const N: u64 = 6_000;

/// What the consumers did, together.
#[derive(Default)]
struct Log {
    /// Values whose handling took effect (their ack was taken).
    handled: Vec<u64>,
    /// Records whose ack was refused: their partition had moved.
    refused: usize,
}

async fn consumer(broker: &KafkaBroker, state: &std::path::Path) -> TestResult<GuardedConsumer> {
    let mut config = broker.client_config();
    config
        .set("group.id", "handlers")
        .set("session.timeout.ms", "6000");
    Ok(GuardedConsumer::builder(config, state)
        .topic("events")
        .options(GuardOptions::default().checkpoint_interval(Duration::from_millis(300)))
        .build()
        .await?)
}

/// Until `stop`: takes up to 50 records, handles them (1 ms each), then
/// acks them together; the handling of a record whose ack is refused is
/// undone.
async fn handle(c: GuardedConsumer, log: Arc<Mutex<Log>>, stop: Arc<AtomicBool>) -> TestResult {
    while !stop.load(Ordering::SeqCst) {
        let mut batch = Vec::new();
        while batch.len() < 50 {
            let Some(r) = take(&c, Duration::from_millis(200)).await? else {
                break;
            };
            batch.push(r);
        }
        let mut values = BTreeMap::new();
        for r in &batch {
            let v: u64 = std::str::from_utf8(r.message().payload().unwrap_or_default())?.parse()?;
            values.insert((r.message().partition(), r.message().offset()), v);
        }
        tokio::time::sleep(Duration::from_millis(batch.len() as u64)).await;
        let mut refused = 0;
        match c.ack_many(&batch) {
            Ok(()) => {}
            Err(replayguard::Error::Revoked { records }) => {
                for (_, p, o) in records {
                    values.remove(&(p, o));
                    refused += 1;
                }
            }
            Err(e) => return Err(e.into()),
        }
        let mut log = log.lock().map_err(|_| "poisoned")?;
        log.refused += refused;
        log.handled.extend(values.into_values());
    }
    c.close(Duration::from_secs(30)).await?;
    Ok(())
}

/// The next record of `c`, if one comes within `wait`.
async fn take(
    c: &GuardedConsumer,
    wait: Duration,
) -> TestResult<Option<replayguard::kafka::GuardedRecord>> {
    Ok(match tokio::time::timeout(wait, c.recv()).await {
        Ok(r) => r?,
        Err(_) => None,
    })
}

/// Takes the next record of `b` within `wait`, if any, acks it and notes
/// where it was.
async fn take_and_ack(
    b: &GuardedConsumer,
    wait: Duration,
    noted: &mut Vec<(String, i32, i64)>,
) -> TestResult {
    if let Some(r) = take(b, wait).await? {
        noted.push((
            "events".to_owned(),
            r.message().partition(),
            r.message().offset(),
        ));
        b.ack(&r)?;
    }
    Ok(())
}

fn handled(log: &Mutex<Log>) -> usize {
    log.lock().map(|l| l.handled.len()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_records_are_handled_once_while_partitions_move_between_two_consumers()
-> TestResult {
    let broker = KafkaBroker::start(&[("events", 6)])?;
    // In rounds, so that each partition's log is many small batches and a
    // consumer's fetches mix partitions.
    for round in 0..N / 60 {
        produce_integers(
            &broker.bootstrap(),
            "events",
            round * 60 + 1..=round * 60 + 60,
        )?;
    }
    let dir = tempfile::tempdir()?;
    let log = Arc::new(Mutex::new(Log::default()));
    let (stop_a, stop_b) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let a = tokio::spawn(handle(
        consumer(&broker, &dir.path().join("a")).await?,
        log.clone(),
        stop_a.clone(),
    ));
    let deadline = Instant::now() + Duration::from_secs(120);
    let wait_for = |n: usize| {
        let log = log.clone();
        async move {
            while handled(&log) < n {
                if Instant::now() >= deadline {
                    return Err(format!("only {} records handled", handled(&log)));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(())
        }
    };
    // B joins a third of the way through, and leaves (closing cleanly)
    // two thirds of the way: partitions move to it and back.
    wait_for(N as usize / 3).await?;
    let b = tokio::spawn(handle(
        consumer(&broker, &dir.path().join("b")).await?,
        log.clone(),
        stop_b.clone(),
    ));
    wait_for(2 * N as usize / 3).await?;
    stop_b.store(true, Ordering::SeqCst);
    b.await.map_err(|e| e.to_string())??;
    wait_for(N as usize).await?;
    // Anything delivered twice would arrive within this.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_a.store(true, Ordering::SeqCst);
    a.await.map_err(|e| e.to_string())??;

    let log = log.lock().map_err(|_| "poisoned")?;
    let mut times: BTreeMap<u64, usize> = BTreeMap::new();
    for v in &log.handled {
        *times.entry(*v).or_default() += 1;
    }
    let twice: Vec<u64> = times
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(v, _)| *v)
        .collect();
    let missing: Vec<u64> = (1..=N).filter(|v| !times.contains_key(v)).collect();
    println!("acks refused: {}", log.refused);
    assert!(
        twice.is_empty() && missing.is_empty(),
        "handled more than once: {} ({:?}...); never: {} ({:?}...)",
        twice.len(),
        &twice[..twice.len().min(10)],
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    Ok(())
}

/// The ack path alone, step by step: A holds records of both partitions,
/// unacked, when B joins and takes one partition; A's ack of them is
/// refused for exactly the records of the partition that moved, the rest
/// are taken, and B delivers the refused ones again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_kafka_an_ack_after_the_partition_moved_is_refused_and_its_owner_delivers_the_record()
-> TestResult {
    use rdkafka::Message;
    let broker = KafkaBroker::start(&[("events", 2)])?;
    produce_integers(&broker.bootstrap(), "events", 1..=200)?;
    let dir = tempfile::tempdir()?;
    let a = consumer(&broker, &dir.path().join("a")).await?;
    let deadline = Instant::now() + Duration::from_secs(100);
    let mut held = Vec::new();
    let seen = |held: &Vec<replayguard::kafka::GuardedRecord>, p: i32| {
        held.iter().any(|r| r.message().partition() == p)
    };
    while !(seen(&held, 0) && seen(&held, 1)) {
        if Instant::now() >= deadline {
            return Err("A did not get records of both partitions".into());
        }
        held.extend(take(&a, Duration::from_millis(200)).await?);
    }
    let b = consumer(&broker, &dir.path().join("b")).await?;
    let mut from_b = Vec::new();
    // Both poll until the group settles with one partition each; A takes
    // in more records meanwhile, unacked too.
    while a.assignment().len() != 1 || b.assignment().len() != 1 {
        if Instant::now() >= deadline {
            return Err(format!(
                "the group did not settle: A {:?}, B {:?}",
                a.assignment(),
                b.assignment()
            )
            .into());
        }
        held.extend(take(&a, Duration::from_millis(100)).await?);
        take_and_ack(&b, Duration::from_millis(100), &mut from_b).await?;
    }
    let moved = b.assignment()[0].1;
    let expected: Vec<(String, i32, i64)> = held
        .iter()
        .filter(|r| r.message().partition() == moved)
        .map(|r| ("events".to_owned(), moved, r.message().offset()))
        .collect();
    match a.ack_many(&held) {
        Err(replayguard::Error::Revoked { records }) => {
            assert_eq!(
                records, expected,
                "the refused records are those that moved"
            )
        }
        other => return Err(format!("expected the acks to be refused, got {other:?}").into()),
    }
    let kept = held.len() - expected.len();
    assert_eq!(a.stats().acked, kept as u64, "the other records are acked");
    assert_eq!(a.stats().acks_refused, expected.len() as u64);
    // B delivers the refused records: all of its partition from A's first.
    while from_b.len() < expected.len() {
        if Instant::now() >= deadline {
            return Err(format!("B delivered {} of {}", from_b.len(), expected.len()).into());
        }
        take_and_ack(&b, Duration::from_millis(200), &mut from_b).await?;
    }
    assert_eq!(
        &from_b[..expected.len()],
        &expected[..],
        "B delivers what A could not ack, in order"
    );
    b.close(Duration::from_secs(30)).await?;
    // A takes part in the rebalance B's leaving starts, and gets B's
    // partition back: the records B acked are not delivered again.
    let mut again = Vec::new();
    let settle = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settle {
        take_and_ack(&a, Duration::from_millis(200), &mut again).await?;
    }
    assert!(
        again.iter().all(|r| !from_b.contains(r)),
        "A delivered records B had acked"
    );
    a.close(Duration::from_secs(30)).await?;
    Ok(())
}
