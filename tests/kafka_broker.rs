//! The test kit's Apache Kafka: it starts, takes topics, keeps what it
//! acked across a SIGKILL and a restart on its log folder, and is read
//! back the same by three clients that are not ours (confluent-kafka,
//! kafka-python and Kafka's own console consumer).

use std::time::Duration;

use replayguard_testkit::{
    KafkaBroker, PyClient, TestResult, check_each_once, integers, produce_integers, read_topic,
};

#[test]
fn kafka_keeps_what_it_acked_across_a_kill_and_reads_the_same_to_three_clients() -> TestResult {
    let mut broker = KafkaBroker::start(&[("numbers", 3)])?;
    println!("Kafka answered {:?} after its start", broker.last_start);
    assert_eq!(
        produce_integers(&broker.bootstrap(), "numbers", 1..=300)?,
        300
    );
    broker.kill()?;
    broker.restart()?;
    println!("and {:?} after a restart on its log", broker.last_start);
    for client in PyClient::BOTH {
        let values = integers(&read_topic(&broker.bootstrap(), "numbers", client)?)?;
        check_each_once(&values, 1..=300).map_err(|e| format!("{client:?}: {e}"))?;
    }
    let console: Vec<u64> = broker
        .console_read("numbers", true, Some(300), Duration::from_secs(10))?
        .into_iter()
        .map(|(_, v)| v.parse::<u64>())
        .collect::<Result<_, _>>()?;
    check_each_once(&console, 1..=300)?;
    Ok(())
}

#[test]
fn a_frozen_kafka_answers_again_once_thawed() -> TestResult {
    let broker = KafkaBroker::start(&[("t", 1)])?;
    broker.pause()?;
    let frozen = std::thread::spawn({
        let bootstrap = broker.bootstrap();
        move || produce_integers(&bootstrap, "t", 1..=10)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        !frozen.is_finished(),
        "a produce to a frozen broker finished"
    );
    broker.resume()?;
    let acked = frozen.join().map_err(|_| "the producer panicked")??;
    assert_eq!(acked, 10);
    Ok(())
}
