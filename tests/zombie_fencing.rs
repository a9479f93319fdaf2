//! Fencing without transactions (G1 under pauses and partitions): an
//! instance frozen with SIGSTOP, or cut off behind a TCP proxy that holds
//! its traffic, past its session timeout, while its producer holds a
//! backlog (`linger.ms=2000`), writes nothing its successor also writes.
//!
//! - A frozen `pipe`, on Apache Kafka and on the mock broker process: 0
//!   duplicates, 0 lost. The control, with fencing off, writes duplicates.
//! - A `pipe` cut off from Kafka by a proxy that holds its traffic 20 s: 0
//!   duplicates, 0 lost.
//! - A frozen `consume`: after the thaw it delivers nothing (its lease
//!   lapsed); the other instance delivers its partition.
//! - The new owner killed with SIGKILL during its wait, and restarted: 0
//!   duplicates, 0 lost.
//! - The partition the new owner holds through its wait given back in a
//!   rebalance (a third instance joins, eager assignment) before it was
//!   reconciled: 0 duplicates, 0 lost.
//! - A new owner whose checkpoint interval is an hour still releases what
//!   it holds once its wait is over, and finishes.
//! - An owner killed, or cut off for 12 s, before its first checkpoint (an
//!   hour's interval) of a partition it took in a clean handover or with no
//!   commit at all: its claim makes its successor wait and reconcile, so 0
//!   duplicates, 0 lost. Without the claim, 985 and 1,451 duplicates.
//!
//! The output is read back with confluent-kafka.

use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::thread;
use std::time::{Duration, Instant};

use replayguard_testkit::{
    Broker, Ends, FIRST_OUTPUT_LIMIT, Feeder, Frozen, KafkaBroker, KafkaOptions, MockBroker, Proc,
    PyClient, Record, TestResult, check_each_once, clone_command, integers, lines_of, outcome,
    produce_integers, read_topic, replayguard_bin, run_restarted, seeded, sleep_watching,
};

/// How long the old owner is frozen or cut off: past its 6 s session
/// timeout, shorter than the session timeout plus the new owner's wait
/// (10 s delivery timeout + 5 s request timeout + 1 s).
const AWAY: Duration = Duration::from_secs(20);

/// Input records per second.
const RATE: f64 = 300.0;

fn pipe(bootstrap: &str, name: &str, state: &std::path::Path, extra: &[&str]) -> Command {
    let mut c = Command::new(replayguard_bin().unwrap_or_else(|_| "replayguard".into()));
    c.env("RUST_LOG", "info")
        .arg("pipe")
        .args(["--brokers", bootstrap, "--group", "fenced"])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(state)
        .args(["-X", "session.timeout.ms=6000"])
        .args(if extra.contains(&"--checkpoint-interval") {
            &[][..]
        } else {
            &["--checkpoint-interval", "500ms"][..]
        })
        .args(extra)
        .stdout(Stdio::null());
    let _ = name;
    c
}

/// How the old owner is taken away.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Away {
    /// SIGSTOP, then SIGCONT.
    Frozen,
    /// Its proxy holds all its traffic, then lets it through.
    CutOff,
    /// SIGKILL; only its final run comes back.
    Killed,
}

/// How the old owner leaves and what it runs with.
#[derive(Clone, Copy)]
struct Leaving {
    away: Away,
    /// How long it is away.
    for_: Duration,
    /// Its arguments beyond `pipe`'s.
    extra: &'static [&'static str],
}

impl Leaving {
    /// Taken away for `AWAY`, with a producer backlog.
    fn backlogged(away: Away) -> Self {
        Leaving {
            away,
            for_: AWAY,
            extra: &["-X", "linger.ms=2000"],
        }
    }
}

/// A and B share a 2-partition input; A is taken away as `leaving` says,
/// B takes its partition over; A comes back. Returns the number of
/// duplicated values in the output (nothing may be missing).
fn old_owner_comes_back(
    broker: &dyn Broker,
    a_bootstrap: &str,
    proxy: Option<&replayguard_testkit::Proxy>,
    leaving: Leaving,
    fencing: bool,
    kill_successor_while_waiting: bool,
) -> TestResult<usize> {
    let away = leaving.away;
    let bootstrap = broker.servers();
    let name = format!(
        "{away:?} old owner, {}, fencing {}",
        broker.kind(),
        if fencing { "on" } else { "off" }
    );
    let (seed, _rng) = seeded(&name);
    let logs = tempfile::Builder::new().prefix("fencing-logs-").tempdir()?;
    let result = (|| -> TestResult<usize> {
        let ends = Ends::new(&bootstrap, &[("in", 2), ("out", 2)])?;
        let (state_a, state_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
        let fence = |c: &mut Command| {
            if !fencing {
                c.env("REPLAYGUARD_FAIL_AT", "no-fencing");
            }
        };
        let mut cmd_a = pipe(a_bootstrap, "A", state_a.path(), leaving.extra);
        fence(&mut cmd_a);
        let mut cmd_b = pipe(&bootstrap, "B", state_b.path(), &[]);
        fence(&mut cmd_b);
        let feeder = Feeder::start(&bootstrap, "in", RATE)?;
        let (mut a, mut b) = start_both(&ends, &mut cmd_a, &mut cmd_b, &logs)?;
        sleep_watching(Duration::from_secs(2), &mut [&mut a, &mut b])?;
        let taken = Instant::now();
        let frozen = match away {
            Away::Frozen => Some(Frozen::freeze(a.child.id())?),
            Away::CutOff => {
                proxy.ok_or("no proxy")?.hold();
                None
            }
            Away::Killed => {
                a.child.kill()?;
                None
            }
        };
        if kill_successor_while_waiting {
            wait_for_the_wait(&mut b)?;
            thread::sleep(Duration::from_secs(3));
            b.kill9()?;
            println!(
                "{name}: B killed during its wait, {:?} after A left",
                taken.elapsed()
            );
            b = Proc::spawn(
                "pipe B again".into(),
                &mut cmd_b,
                logs.path().join("b2.log"),
            )?;
        }
        let left = leaving.for_.saturating_sub(taken.elapsed());
        sleep_watching(left, &mut [&mut b])?;
        match (frozen, away) {
            (Some(f), _) => f.thaw()?,
            (None, Away::CutOff) => proxy.ok_or("no proxy")?.release(),
            (None, _) => {}
        }
        if away != Away::Killed {
            println!("{name}: A back after {:?}", taken.elapsed());
        }
        // A finds out that it may not write any more, or, unfenced, carries
        // on; either way it is stopped a while later.
        sleep_watching(Duration::from_secs(8), &mut [&mut b])?;
        let a_status = a.exited()?;
        if fencing
            && away != Away::Killed
            && let Some(status) = a_status
        {
            let line = replayguard_testkit::error_line(&a.log);
            println!("{name}: A exited by itself ({status}): {line}");
        }
        if a_status.is_none() {
            a.kill9()?;
        }
        b.kill9()?;
        finish_and_count(
            broker,
            &name,
            feeder,
            [("A", cmd_a), ("B", cmd_b)],
            &logs,
            fencing,
        )
    })();
    let duplicates = result.as_ref().map_or(0, |d| *d);
    outcome(result.map(drop), seed, logs).map(|()| duplicates)
}

/// Returns once B's log says it waits for a previous owner before it
/// reconciles the partition it took over.
fn wait_for_the_wait(b: &mut Proc) -> TestResult {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&b.log)?.contains("without a clean handover") {
        b.check_running()?;
        if Instant::now() > deadline {
            return Err("B never waited for a previous owner".into());
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Starts A, then, once A writes, B; returns when both own a partition and
/// write (B's first outputs are out).
fn start_both(
    ends: &Ends,
    cmd_a: &mut Command,
    cmd_b: &mut Command,
    logs: &tempfile::TempDir,
) -> TestResult<(Proc, Proc)> {
    let mut a = Proc::spawn("pipe A".into(), cmd_a, logs.path().join("a.log"))?;
    ends.wait_out(1, Duration::from_millis(50), &mut a)?;
    let mut b = Proc::spawn("pipe B".into(), cmd_b, logs.path().join("b.log"))?;
    let before = ends.total("out")?;
    ends.wait_for(
        "both writing",
        FIRST_OUTPUT_LIMIT,
        &mut [&mut a, &mut b],
        |i, o| o > before + 200 && i - o < 1_500,
    )?;
    Ok((a, b))
}

/// Stops the feeder, runs each instance's pipe to the end of the input in
/// turn, and reads the output back: nothing may be missing; with fencing,
/// nothing may be written twice either (a batch the broker appended twice
/// aside, where the broker does that). Returns the number of duplicated
/// values.
fn finish_and_count<const N: usize>(
    broker: &dyn Broker,
    name: &str,
    feeder: Feeder,
    commands: [(&str, Command); N],
    logs: &tempfile::TempDir,
    fencing: bool,
) -> TestResult<usize> {
    let n = feeder.finish()?;
    for (who, mut cmd) in commands {
        cmd.arg("--stop-at-end");
        run_restarted(
            &format!("final {who}"),
            &logs.path().join(format!("final-{who}.log")),
            Duration::from_secs(120),
            || clone_command(&cmd),
        )?;
    }
    let records = read_topic(&broker.servers(), "out", PyClient::Confluent)?;
    let values = integers(&records)?;
    let (written, reappended) = appended_twice(&records, &values);
    let mut sorted = values.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let missing: Vec<u64> = (1..=n)
        .filter(|v| sorted.binary_search(v).is_err())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} of {n} inputs missing from the output: {:?}",
            missing.len(),
            &missing[..missing.len().min(20)]
        )
        .into());
    }
    let duplicates = values.len() - sorted.len();
    println!(
        "{name}: {n} inputs, {duplicates} duplicates, {reappended} of them a record the broker appended twice"
    );
    if duplicates > 0 {
        // What a failure needs to tell a second write from a re-append.
        let mut times: BTreeMap<u64, Vec<Option<i64>>> = BTreeMap::new();
        for (r, v) in records.iter().zip(&values) {
            times.entry(*v).or_default().push(r.timestamp);
        }
        let twice: Vec<_> = times
            .into_iter()
            .filter(|(_, t)| t.len() > 1)
            .take(5)
            .collect();
        println!("{name}: first duplicated values with their create times: {twice:?}");
    }
    if fencing {
        if broker.drops_resent_batches() {
            check_each_once(&values, 1..=n)?;
        } else {
            // A batch the producer sent again (its request timed out
            // over the freeze, after the append) is appended twice.
            // Such a copy has its original's create time; a write by
            // the new owner never does.
            check_each_once(&written, 1..=n)?;
        }
    }
    Ok(duplicates)
}

/// The values of `records` (parsed in `values`) without the copies that
/// repeat an earlier record's value and create time (one produced record
/// appended twice), and how many such copies there were.
fn appended_twice(records: &[Record], values: &[u64]) -> (Vec<u64>, usize) {
    let mut seen = HashSet::new();
    let mut written = Vec::with_capacity(values.len());
    for (r, v) in records.iter().zip(values) {
        let again = r.timestamp.is_some_and(|t| !seen.insert((*v, t)));
        if !again {
            written.push(*v);
        }
    }
    let reappended = values.len() - written.len();
    (written, reappended)
}

#[test]
fn on_kafka_a_pipe_frozen_past_its_session_writes_nothing_its_successor_wrote() -> TestResult {
    on_kafka(Leaving::backlogged(Away::Frozen), false)
}

#[test]
fn on_the_mock_a_pipe_frozen_past_its_session_writes_nothing_its_successor_wrote() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    old_owner_comes_back(
        &broker,
        broker.bootstrap(),
        None,
        Leaving::backlogged(Away::Frozen),
        true,
        false,
    )
    .map(drop)
}

/// How A leaves in the tests of an owner taken away before its first
/// checkpoint (an hour's interval): away past its session timeout, for
/// less than its outputs can stay in flight (30 s).
fn before_its_first_commit(away: Away) -> Leaving {
    Leaving {
        away,
        for_: Duration::from_secs(12),
        extra: &[
            "--checkpoint-interval",
            "1h",
            "-X",
            "linger.ms=2000",
            "-X",
            "message.timeout.ms=30000",
        ],
    }
}

#[test]
fn on_kafka_a_pipe_killed_before_its_first_commit_leaves_nothing_its_successor_writes_again()
-> TestResult {
    on_kafka(before_its_first_commit(Away::Killed), false)
}

#[test]
fn on_kafka_a_pipe_cut_off_before_its_first_commit_writes_nothing_its_successor_wrote() -> TestResult
{
    cut_off_on_kafka(before_its_first_commit(Away::CutOff))
}

/// A dies after its outputs reached the broker and before its inputs were
/// checkpointed (an injected failure at an ack); B takes its partition
/// without a clean handover and waits. A third instance, C, joins during
/// that wait, so that B gives back (eager `range` assignment) the partition
/// it holds but has not reconciled. Whoever gets it next must still wait
/// for A and read A's outputs back: B's revoke may not hand it on as its
/// own.
fn a_rebalance_during_the_wait(broker: &dyn Broker) -> TestResult {
    let bootstrap = broker.servers();
    let name = format!("A rebalance during the wait, {}", broker.kind());
    let (seed, _rng) = seeded(&name);
    let logs = tempfile::Builder::new().prefix("fencing-logs-").tempdir()?;
    let result = (|| -> TestResult {
        // One output partition: every instance's outputs go to it, so the
        // end B has acked there passes the outputs A left unrecorded.
        let ends = Ends::new(&bootstrap, &[("in", 2), ("out", 1)])?;
        let states = [
            tempfile::tempdir()?,
            tempfile::tempdir()?,
            tempfile::tempdir()?,
        ];
        let eager = ["-X", "partition.assignment.strategy=range"];
        let armed = logs.path().join("fail-at-the-next-ack");
        let mut cmd_a = pipe(&bootstrap, "A", states[0].path(), &eager);
        cmd_a
            .env("REPLAYGUARD_FAIL_AT", "after-ack")
            .env("REPLAYGUARD_FAIL_ARMED", &armed);
        let mut cmd_b = pipe(&bootstrap, "B", states[1].path(), &eager);
        let mut cmd_c = pipe(&bootstrap, "C", states[2].path(), &eager);
        let feeder = Feeder::start(&bootstrap, "in", RATE)?;
        let (mut a, mut b) = start_both(&ends, &mut cmd_a, &mut cmd_b, &logs)?;
        // The group settled: each has committed its own partition (its
        // instance in the metadata), so that A's crash leaves a commit of
        // A's behind for B to wait on.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            sleep_watching(Duration::from_millis(500), &mut [&mut a, &mut b])?;
            let writers: HashSet<String> = ends
                .committed("fenced", "in")?
                .into_iter()
                .flatten()
                .filter_map(|(_, meta)| {
                    let v: serde_json::Value = serde_json::from_str(&meta).ok()?;
                    Some(v.get("i")?.as_str()?.to_owned())
                })
                .collect();
            if writers.len() == 2 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("the group never settled: commits by {writers:?}").into());
            }
        }
        std::fs::write(&armed, b"")?;
        a.wait(Duration::from_secs(30))?;
        std::fs::remove_file(&armed)?;
        println!(
            "{name}: A stopped: {}",
            replayguard_testkit::error_line(&a.log)
        );
        wait_for_the_wait(&mut b)?;
        // A few of B's checkpoints first (the group's commits refused
        // while a rebalance is on would hide what B wrote of the held
        // partition).
        sleep_watching(Duration::from_secs(3), &mut [&mut b])?;
        let mut c = Proc::spawn("pipe C".into(), &mut cmd_c, logs.path().join("c.log"))?;
        // Past the wait (16 s), and some more work by both.
        sleep_watching(Duration::from_secs(30), &mut [&mut b, &mut c])?;
        b.kill9()?;
        c.kill9()?;
        finish_and_count(
            broker,
            &name,
            feeder,
            [("A", cmd_a), ("B", cmd_b), ("C", cmd_c)],
            &logs,
            true,
        )
        .map(drop)
    })();
    outcome(result, seed, logs)
}

#[test]
fn on_the_mock_a_partition_given_back_during_its_wait_is_still_reconciled() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("out", 1)])?;
    a_rebalance_during_the_wait(&broker)
}

/// A new owner that holds the partitions it took without a clean
/// handover releases them when the wait is over, however long its
/// checkpoint interval: all it holds sends no records, and nothing else
/// would wake it before its next checkpoint.
#[test]
fn on_the_mock_a_new_owner_with_a_long_checkpoint_interval_resumes_after_its_wait() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    let bootstrap = broker.servers();
    let logs = tempfile::Builder::new().prefix("fencing-logs-").tempdir()?;
    let (seed, _rng) = seeded("long checkpoint interval");
    let result = (|| -> TestResult {
        let ends = Ends::new(&bootstrap, &[("in", 2), ("out", 2)])?;
        produce_integers(&bootstrap, "in", 1..=2_000)?;
        let (state_a, state_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
        // B copies everything, commits without a clean handover, and dies.
        let mut b = Proc::spawn(
            "pipe B".into(),
            &mut pipe(&bootstrap, "B", state_b.path(), &[]),
            logs.path().join("b.log"),
        )?;
        ends.wait_out(2_000, Duration::from_millis(50), &mut b)?;
        sleep_watching(Duration::from_secs(2), &mut [&mut b])?;
        b.kill9()?;
        // A waits for B's outputs in flight, then reconciles and finds
        // nothing left to write; its first checkpoint is an hour away.
        let mut a = Proc::spawn(
            "pipe A".into(),
            &mut pipe(
                &bootstrap,
                "A",
                state_a.path(),
                &["--checkpoint-interval", "1h", "--stop-at-end"],
            ),
            logs.path().join("a.log"),
        )?;
        let status = a.wait(Duration::from_secs(90))?;
        let log = std::fs::read_to_string(&a.log)?;
        if !status.success() || !log.contains("held partitions reconciled and resumed") {
            return Err(format!(
                "A did not finish after its wait ({status}); stderr:\n{}",
                a.log_tail()
            )
            .into());
        }
        let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
        check_each_once(&values, 1..=2_000)
    })();
    outcome(result, seed, logs)
}

#[test]
fn on_kafka_control_with_fencing_off_a_thawed_pipe_writes_duplicates() -> TestResult {
    // Whether the zombie's writes land before its successor reconciles
    // depends on where in its producer's linger the freeze falls, so a
    // scenario that shows none is run once more, on a fresh broker.
    for attempt in 1..=2 {
        let broker = KafkaBroker::start(&[("in", 2), ("out", 2)])?;
        let duplicates = old_owner_comes_back(
            &broker,
            &broker.bootstrap(),
            None,
            Leaving::backlogged(Away::Frozen),
            false,
            false,
        )?;
        if duplicates > 0 {
            return Ok(());
        }
        println!("control, attempt {attempt}: no duplicates");
    }
    Err("without fencing the thawed pipe's backlog should duplicate outputs, and in two runs it did not; the scenario does not test what it claims".into())
}

#[test]
fn on_kafka_a_pipe_cut_off_past_its_session_writes_nothing_its_successor_wrote() -> TestResult {
    cut_off_on_kafka(Leaving::backlogged(Away::CutOff))
}

/// A on Kafka, taken away as `leaving` says; fencing on.
fn on_kafka(leaving: Leaving, kill_successor_while_waiting: bool) -> TestResult {
    let broker = KafkaBroker::start(&[("in", 2), ("out", 2)])?;
    old_owner_comes_back(
        &broker,
        &broker.bootstrap(),
        None,
        leaving,
        true,
        kill_successor_while_waiting,
    )
    .map(drop)
}

/// A on Kafka through a proxy that cuts it off as `leaving` says; fencing
/// on.
fn cut_off_on_kafka(leaving: Leaving) -> TestResult {
    let broker = KafkaBroker::start_with(
        KafkaOptions {
            proxied: true,
            ..KafkaOptions::default()
        },
        &[("in", 2), ("out", 2)],
    )?;
    let through_proxy = broker.proxied_bootstrap().ok_or("no proxied listener")?;
    old_owner_comes_back(
        &broker,
        &through_proxy,
        broker.proxy(),
        leaving,
        true,
        false,
    )
    .map(drop)
}

#[test]
fn on_kafka_the_new_owner_killed_during_its_wait_still_copies_each_once() -> TestResult {
    on_kafka(Leaving::backlogged(Away::Frozen), true)
}

#[test]
fn on_kafka_a_frozen_guarded_consumer_delivers_nothing_after_its_thaw() -> TestResult {
    let broker = KafkaBroker::start(&[("events", 2)])?;
    let bootstrap = broker.bootstrap();
    let logs = tempfile::Builder::new().prefix("fencing-logs-").tempdir()?;
    let consume = |state: &std::path::Path| -> TestResult<Command> {
        let mut c = Command::new(replayguard_bin()?);
        c.env("RUST_LOG", "info")
            .arg("consume")
            .args([
                "--brokers",
                &bootstrap,
                "--group",
                "readers",
                "--topic",
                "events",
            ])
            .arg("--state")
            .arg(state)
            .args(["-X", "session.timeout.ms=6000"])
            .stdout(Stdio::piped());
        Ok(c)
    };
    let (state_a, state_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let feeder = Feeder::start(&bootstrap, "events", RATE)?;
    let mut a = Proc::spawn(
        "consume A".into(),
        &mut consume(state_a.path())?,
        logs.path().join("a.log"),
    )?;
    let a_lines = lines_of(a.take_stdout()?);
    a_lines
        .recv_timeout(FIRST_OUTPUT_LIMIT)
        .map_err(|_| "A printed nothing")?;
    let mut b = Proc::spawn(
        "consume B".into(),
        &mut consume(state_b.path())?,
        logs.path().join("b.log"),
    )?;
    let b_lines = lines_of(b.take_stdout()?);
    b_lines
        .recv_timeout(FIRST_OUTPUT_LIMIT)
        .map_err(|_| "B printed nothing")?;
    sleep_watching(Duration::from_secs(2), &mut [&mut a, &mut b])?;
    // Everything A printed before the freeze is read now; what arrives
    // after the thaw was printed after it.
    let frozen = Frozen::freeze(a.child.id())?;
    thread::sleep(Duration::from_millis(300));
    while a_lines.try_recv().is_ok() {}
    sleep_watching(AWAY, &mut [&mut b])?;
    frozen.thaw()?;
    let mut after_thaw = Vec::new();
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        match a_lines.recv_timeout(Duration::from_millis(100)) {
            Ok(line) => after_thaw.push(line),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = a.exited()?;
    println!(
        "consume A after its thaw: {} lines, exit {status:?}: {}",
        after_thaw.len(),
        replayguard_testkit::error_line(&a.log)
    );
    // Stopped for its lapsed lease, it asks to be started again.
    if let Some(status) = status {
        assert_eq!(
            status.code(),
            Some(75),
            "a consumer stopped by its lapsed lease should exit 75"
        );
    }
    // B kept delivering, A's partition included.
    let b_before = std::iter::from_fn(|| b_lines.try_recv().ok()).count();
    b_lines
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "B stopped printing")?;
    drop(feeder);
    assert!(
        after_thaw.is_empty(),
        "the thawed consumer delivered {} records its lease no longer covered: {:?}",
        after_thaw.len(),
        &after_thaw[..after_thaw.len().min(10)]
    );
    assert!(b_before > 0, "B printed nothing while A was frozen");
    Ok(())
}
