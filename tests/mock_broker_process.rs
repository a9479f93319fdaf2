//! The mock broker as a separate process: it outlives a client killed with
//! SIGKILL and serves that client's acked data to an independent reader
//! (confluent-kafka), and it goes away with the test that started it.

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use replayguard_testkit::{
    MockBroker, PyClient, TestProducer, TestResult, check_each_once, check_increasing, integers,
    lines_of, process_alive, produce_integers, read_topic, wait_bounded,
};

const CHILD_BOOTSTRAP: &str = "REPLAYGUARD_TEST_CHILD_BOOTSTRAP";
const CHILD_TOPIC: &str = "REPLAYGUARD_TEST_CHILD_TOPIC";

/// Child-process entry of `broker_outlives_a_killed_producer`: produces
/// increasing integers to one partition in acked batches, printing
/// `acked N` after each, until it is killed (or a bound of 100k records or
/// 90 s, which the parent never lets it reach).
#[test]
#[ignore = "child-process entry; run by broker_outlives_a_killed_producer"]
fn child_producer() -> TestResult {
    let (Ok(bootstrap), Ok(topic)) = (std::env::var(CHILD_BOOTSTRAP), std::env::var(CHILD_TOPIC))
    else {
        return Err(
            "child_producer only runs as the child of broker_outlives_a_killed_producer".into(),
        );
    };
    let mut producer = TestProducer::new(&bootstrap, &topic)?;
    let started = Instant::now();
    let mut next = 0u64;
    while next < 100_000 && started.elapsed() < Duration::from_secs(90) {
        for _ in 0..100 {
            producer.send_integer(next)?;
            next += 1;
        }
        let acked = producer.flush(Duration::from_secs(30))?;
        println!("acked {acked}");
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

#[test]
fn broker_outlives_a_killed_producer() -> TestResult {
    let broker = MockBroker::start(&[("numbers", 1)])?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["child_producer", "--exact", "--ignored", "--nocapture"])
        .env(CHILD_BOOTSTRAP, broker.bootstrap())
        .env(CHILD_TOPIC, "numbers")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("child has no stdout")?;
    let lines = lines_of(stdout);

    // Kill it mid-stream, once it has had a few thousand records acked.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut acked = 0u64;
    while acked < 3_000 {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(n) = line.strip_prefix("acked ") {
                    acked = n.trim().parse()?;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                return Err(format!("child acked only {acked} records in 60 s").into());
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = wait_bounded(&mut child, Duration::from_secs(10))?;
                return Err(format!("child exited ({status}) after {acked} acks").into());
            }
        }
    }
    child.kill()?;
    let status = wait_bounded(&mut child, Duration::from_secs(10))?;
    assert_eq!(status.signal(), Some(9), "the child died of SIGKILL");
    assert!(
        process_alive(broker.pid()),
        "the broker process outlived the killed client"
    );

    let values = integers(&read_topic(
        broker.bootstrap(),
        "numbers",
        PyClient::Confluent,
    )?)?;
    // Everything acked is there; records in flight at the kill may be there
    // too. The idempotent producer wrote each once, in order.
    assert!(
        values.len() as u64 >= acked,
        "{} records read, {acked} were acked",
        values.len()
    );
    check_increasing(&values)?;
    check_each_once(&values, 0..values.len() as u64)?;
    Ok(())
}

#[test]
fn topics_from_the_command_line_serve_every_partition() -> TestResult {
    let broker = MockBroker::start_cluster(3, &[("spread", 3)])?;
    produce_integers(broker.bootstrap(), "spread", 0..1_000)?;
    let records = read_topic(broker.bootstrap(), "spread", PyClient::Confluent)?;
    check_each_once(&integers(&records)?, 0..1_000)?;
    let mut partitions: Vec<i32> = records.iter().map(|r| r.partition).collect();
    partitions.sort_unstable();
    partitions.dedup();
    assert_eq!(partitions, [0, 1, 2], "keyed records reach all partitions");
    Ok(())
}

#[test]
fn control_commands_answer_and_dropping_the_handle_ends_the_broker() -> TestResult {
    let mut broker = MockBroker::start(&[])?;
    broker.create_topic("later", 2)?;
    broker.broker_down(1)?;
    broker.broker_up(1)?;
    let refused = broker.broker_down(2);
    assert!(
        refused.is_err(),
        "a one-broker cluster has no broker 2: {refused:?}"
    );
    produce_integers(broker.bootstrap(), "later", 0..10)?;
    let records = read_topic(broker.bootstrap(), "later", PyClient::Confluent)?;
    check_each_once(&integers(&records)?, 0..10)?;

    let pid = broker.pid();
    drop(broker);
    let deadline = Instant::now() + Duration::from_secs(10);
    while process_alive(pid) {
        if Instant::now() >= deadline {
            return Err(
                format!("mock broker {pid} still runs after its handle was dropped").into(),
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[test]
fn broker_exits_cleanly_when_its_parent_closes_stdin() -> TestResult {
    let mut child = Command::new(env!("CARGO_BIN_EXE_replayguard-mock-broker"))
        .args(["--topic", "t:1", "--exit-on-stdin-eof"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let lines = lines_of(child.stdout.take().ok_or("no stdout")?);
    let address = lines.recv_timeout(Duration::from_secs(30))?;
    assert!(
        address.starts_with("127.0.0.1:"),
        "bootstrap address on loopback: {address}"
    );
    assert!(process_alive(child.id()), "it serves while stdin is open");
    drop(child.stdin.take());
    let status = wait_bounded(&mut child, Duration::from_secs(10))?;
    assert!(status.success(), "clean exit on stdin EOF: {status}");
    Ok(())
}

#[test]
fn reader_refuses_an_unknown_topic() -> TestResult {
    let broker = MockBroker::start(&[("known", 1)])?;
    let read = read_topic(broker.bootstrap(), "never-created", PyClient::Confluent);
    let message = read.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        message.contains("never-created"),
        "the reader must fail naming the topic, not read nothing: {message:?}"
    );
    Ok(())
}
