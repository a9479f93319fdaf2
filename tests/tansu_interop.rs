//! Interoperability on a real broker, Tansu with sqlite storage: what our
//! rdkafka build writes, two independent clients (confluent-kafka and the
//! pure-Python kafka-python) read back byte for byte; consumer-group commits
//! are seen by all three; a clean broker restart keeps the data.
//!
//! Each test starts its own broker on a free 127.0.0.1 port. Without Tansu
//! installed these tests fail and say how to get it (`scripts/test` builds it).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use replayguard_testkit::{
    NewRecord, PyClient, ReadOptions, Record, TansuBroker, TestResult, check_each_once,
    drop_bounded, integers, produce, produce_integers, read_topic, read_topic_with,
};

fn interop_record(i: u32) -> NewRecord {
    NewRecord {
        key: Some(format!("key-{i}").into_bytes()),
        value: Some(format!("value {i} é").into_bytes()),
        headers: vec![
            ("seq".to_owned(), Some(i.to_string().into_bytes())),
            // Not UTF-8, as a fingerprint header is not.
            (
                "bin".to_owned(),
                Some(vec![0xff, 0x00, (i % 251) as u8, 0x80]),
            ),
            ("empty".to_owned(), Some(Vec::new())),
            ("null".to_owned(), None),
        ],
        partition: None,
        timestamp: None,
    }
}

/// Each partition's offsets, in read order, are 0, 1, 2, ... with no gap.
fn check_offsets_dense(records: &[Record]) -> TestResult {
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    for r in records {
        let expected = next.entry(r.partition).or_insert(0);
        if r.offset != *expected {
            return Err(format!(
                "partition {}: offset {} read where {} was expected",
                r.partition, r.offset, expected
            )
            .into());
        }
        *expected += 1;
    }
    Ok(())
}

#[test]
fn idempotent_produce_with_headers_reads_back_in_both_clients() -> TestResult {
    let broker = TansuBroker::start(&[("interop", 3)])?;
    let sent: Vec<NewRecord> = (0..300).map(interop_record).collect();
    assert_eq!(produce(&broker.bootstrap(), "interop", sent.clone())?, 300);

    let mut reads = Vec::new();
    for client in PyClient::BOTH {
        let options = ReadOptions {
            client,
            // Nothing here is transactional, so both levels see everything.
            read_committed: client == PyClient::KafkaPython,
            ..ReadOptions::default()
        };
        let mut records = read_topic_with(&broker.bootstrap(), "interop", &options)?;
        assert_eq!(records.len(), sent.len(), "{client:?} read every record");
        check_offsets_dense(&records)?;
        for record in &records {
            let key = record.key.as_deref().ok_or("a record lost its key")?;
            let i: u32 = std::str::from_utf8(key)?
                .strip_prefix("key-")
                .ok_or("unexpected key")?
                .parse()?;
            let expected = &sent[i as usize];
            assert_eq!(record.value, expected.value, "{client:?}: value of {i}");
            assert_eq!(
                record.headers, expected.headers,
                "{client:?}: headers of {i}"
            );
        }
        records.sort_by_key(|r| (r.partition, r.offset));
        reads.push(records);
    }
    assert_eq!(reads[0], reads[1], "both clients read the same records");
    let partitions: std::collections::BTreeSet<i32> =
        reads[0].iter().map(|r| r.partition).collect();
    assert_eq!(partitions.len(), 3, "keys spread over all 3 partitions");
    Ok(())
}

fn group_consumer(bootstrap: &str, group: &str) -> TestResult<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()?)
}

/// Polls `consumer` until it has `count` records or 60 s pass; returns the
/// integer values and the next offset of each partition.
fn consume_integers(
    consumer: &BaseConsumer,
    count: usize,
) -> TestResult<(Vec<u64>, BTreeMap<i32, i64>)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut values = Vec::new();
    let mut next = BTreeMap::new();
    while values.len() < count {
        if Instant::now() >= deadline {
            return Err(format!("consumed {} of {count} records in 60 s", values.len()).into());
        }
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = message?;
        let value = message.payload().ok_or("record without a value")?;
        values.push(std::str::from_utf8(value)?.parse()?);
        next.insert(message.partition(), message.offset() + 1);
    }
    Ok((values, next))
}

#[test]
fn group_commits_are_seen_by_every_client() -> TestResult {
    let broker = TansuBroker::start(&[("grouped", 2)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "grouped", 0..200)?;

    let consumer = group_consumer(&bootstrap, "interop-group")?;
    consumer.subscribe(&["grouped"])?;
    let (values, next) = consume_integers(&consumer, 200)?;
    check_each_once(&values, 0..200)?;
    let mut tpl = TopicPartitionList::new();
    for (&partition, &offset) in &next {
        tpl.add_partition_offset("grouped", partition, Offset::Offset(offset))?;
    }
    consumer.commit(&tpl, CommitMode::Sync)?;

    // committed_offsets, not committed(): after an explicit commit,
    // rdkafka 0.39's committed() made the consumer's drop hang for good (on
    // the mock and on Tansu alike).
    let committed = consumer.committed_offsets(tpl.clone(), Duration::from_secs(15))?;
    for (&partition, &offset) in &next {
        let seen = committed
            .find_partition("grouped", partition)
            .ok_or("committed list lacks a partition")?
            .offset();
        assert_eq!(
            seen,
            Offset::Offset(offset),
            "rdkafka sees partition {partition}'s commit"
        );
    }
    drop_bounded(
        consumer,
        "the first group consumer",
        Duration::from_secs(30),
    )?;

    let expected: BTreeMap<i32, Option<i64>> = (0..2).map(|p| (p, next.get(&p).copied())).collect();
    for client in PyClient::BOTH {
        let seen =
            replayguard_testkit::committed_offsets(&bootstrap, "grouped", "interop-group", client)?;
        assert_eq!(seen, expected, "{client:?} sees the group's commits");
    }

    // A new member of the group resumes after the commits.
    produce_integers(&bootstrap, "grouped", 200..250)?;
    let consumer = group_consumer(&bootstrap, "interop-group")?;
    consumer.subscribe(&["grouped"])?;
    let (values, _) = consume_integers(&consumer, 50)?;
    check_each_once(&values, 200..250)?;
    // Nothing older arrives late.
    let late = consumer.poll(Duration::from_secs(1));
    assert!(late.is_none(), "no record after the last 50: {late:?}");
    drop(late);
    drop_bounded(
        consumer,
        "the second group consumer",
        Duration::from_secs(30),
    )?;
    Ok(())
}

#[test]
fn clean_restart_keeps_the_data() -> TestResult {
    let mut broker = TansuBroker::start(&[("durable", 2)])?;
    produce_integers(&broker.bootstrap(), "durable", 0..500)?;
    broker.stop()?;
    broker.restart()?;
    // Still writable after the restart, at the same offsets' continuation.
    produce_integers(&broker.bootstrap(), "durable", 500..600)?;
    for client in PyClient::BOTH {
        let records = read_topic(&broker.bootstrap(), "durable", client)?;
        check_offsets_dense(&records)?;
        check_each_once(&integers(&records)?, 0..600)?;
    }
    Ok(())
}

#[test]
fn readers_refuse_an_unknown_topic() -> TestResult {
    let broker = TansuBroker::start(&[("known", 1)])?;
    for client in PyClient::BOTH {
        let options = ReadOptions {
            client,
            timeout: Duration::from_secs(10),
            ..ReadOptions::default()
        };
        let read = read_topic_with(&broker.bootstrap(), "never-created", &options);
        let message = read.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            message.contains("never-created"),
            "{client:?} must fail naming the topic, not read nothing: {message:?}"
        );
    }
    Ok(())
}
