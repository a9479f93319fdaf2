//! The `replayguard` command run as a separate process against the mock
//! broker process: `pipe`, `consume` and `inspect`, `--stop-at-end`,
//! SIGTERM, SIGKILL and restart, and one test per error a user can meet,
//! each of which must be one line with the right exit status.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use rand::Rng;
use replayguard::kafka::{FINGERPRINT_HEADER, SOURCE_HEADER, SourcePosition};
use replayguard_testkit::{
    Ends, MockBroker, NewRecord, PyClient, TestProducer, TestResult, check_each_once,
    committed_offsets, end_offsets, free_port, integers, produce, produce_integers, read_topic,
    run_bounded, send_signal, wait_bounded,
};

/// The mock's first group join takes about 3 s; a run to the end of a small
/// topic takes a few more.
const RUN_LIMIT: Duration = Duration::from_secs(90);

/// The command, with the default log filter whatever the caller's
/// environment says.
fn replayguard() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.env_remove("RUST_LOG").env_remove("RUST_BACKTRACE");
    c
}

/// `pipe` from `input` to `output` in `group`, with the mock-friendly
/// session timeout, plus `extra`.
fn pipe(broker: &MockBroker, group: &str, state: &Path, extra: &[&str]) -> Command {
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", broker.bootstrap(), "--group", group])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(state)
        .args(["-X", "session.timeout.ms=6000"])
        .args(extra);
    c
}

/// `pipe` from `in` to `out` on a broker at `bootstrap` (Apache Kafka),
/// in `group`, plus `extra`.
fn kafka_pipe(bootstrap: &str, group: &str, state: &Path, extra: &[&str]) -> Command {
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", bootstrap, "--group", group])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(state)
        .args(extra);
    c
}

fn consume(broker: &MockBroker, topic: &str, state: &Path, extra: &[&str]) -> Command {
    let mut c = replayguard();
    c.arg("consume")
        .args(["--brokers", broker.bootstrap(), "--group", "reader"])
        .args(["--topic", topic, "--state"])
        .arg(state)
        .args(["-X", "session.timeout.ms=6000"])
        .args(extra);
    c
}

fn inspect(state: &Path, json: bool) -> TestResult<Output> {
    let mut c = replayguard();
    c.arg("inspect").arg("--state").arg(state);
    if json {
        c.arg("--json");
    }
    run_bounded(&mut c, Duration::from_secs(30))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Checks a run that must succeed.
fn success(out: &Output, what: &str) -> TestResult {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({}): {}", out.status, text(&out.stderr)).into())
    }
}

/// Checks a failed run: exit status `code`, and stderr holding exactly one
/// error line, the last, with everything else a log line and no panic.
/// Returns the error line's text after `replayguard: error: `.
fn one_error_line(out: &Output, code: i32) -> TestResult<String> {
    let stderr = text(&out.stderr);
    if out.status.code() != Some(code) {
        return Err(format!("expected exit {code}, got {}: {stderr}", out.status).into());
    }
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("replayguard: error: "))
        .collect();
    if errors.len() != 1
        || !lines
            .last()
            .is_some_and(|l| l.starts_with("replayguard: error: "))
    {
        return Err(format!("expected one error line, last; stderr:\n{stderr}").into());
    }
    for l in &lines[..lines.len() - 1] {
        if !l.contains(" WARN ") {
            return Err(format!("stray stderr line {l:?}; stderr:\n{stderr}").into());
        }
    }
    if stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE") {
        return Err(format!("a panic: {stderr}").into());
    }
    Ok(lines[lines.len() - 1]["replayguard: error: ".len()..].to_owned())
}

/// Checks a clap usage error: exit 2, clap's `error:` line naming `flag`.
fn usage_error(out: &Output, flag: &str) -> TestResult {
    let stderr = text(&out.stderr);
    if out.status.code() != Some(2) {
        return Err(format!("expected exit 2, got {}: {stderr}", out.status).into());
    }
    let first = stderr.lines().next().unwrap_or_default();
    if !first.starts_with("error: ") || !first.contains(flag) || stderr.contains("panicked") {
        return Err(format!("expected a usage error naming {flag}; stderr:\n{stderr}").into());
    }
    Ok(())
}

fn expect_contains(haystack: &str, needle: &str) -> TestResult {
    if haystack.contains(needle) {
        Ok(())
    } else {
        Err(format!("expected {needle:?} in {haystack:?}").into())
    }
}

/// Sum of the end offsets of `topic`.
fn total(broker: &MockBroker, topic: &str) -> TestResult<i64> {
    Ok(end_offsets(broker.bootstrap(), topic)?.values().sum())
}

/// Waits until `topic` holds at least `n` records.
fn wait_for_records(broker: &MockBroker, topic: &str, n: i64, limit: Duration) -> TestResult {
    let deadline = Instant::now() + limit;
    loop {
        let now = total(broker, topic)?;
        if now >= n {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{topic} has {now} records, not {n}, after {limit:?}").into());
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The files of a folder with their bytes, to see that nothing changed.
fn snapshot(dir: &Path) -> TestResult<BTreeMap<String, Vec<u8>>> {
    let mut files = BTreeMap::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let name = path.strip_prefix(dir)?.display().to_string();
                files.insert(name, std::fs::read(&path)?);
            }
        }
    }
    Ok(files)
}

// ---------------------------------------------------------------------------
// pipe

#[test]
fn pipe_stop_at_end_copies_each_record_once_with_its_headers() -> TestResult {
    // A create time of its own for each record, in 2020.
    let created = |n: u64| 1_600_000_000_000 + 1_000 * n as i64;
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    let records = (1..=300u64).map(|n| NewRecord {
        key: Some(n.to_string().into_bytes()),
        value: Some(n.to_string().into_bytes()),
        headers: vec![
            ("origin".into(), Some(format!("h{n}").into_bytes())),
            ("empty".into(), None),
        ],
        partition: None,
        timestamp: Some(created(n)),
    });
    produce(broker.bootstrap(), "in", records)?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut pipe(&broker, "copy", state.path(), &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    success(&out, "pipe --stop-at-end")?;
    // stderr is not a terminal: no progress line.
    let stderr = text(&out.stderr);
    if stderr.contains("duplicates dropped") {
        return Err(format!("progress on a non-terminal stderr: {stderr}").into());
    }

    let copied = read_topic(broker.bootstrap(), "out", PyClient::Confluent)?;
    check_each_once(&integers(&copied)?, 1..=300)?;
    for r in &copied {
        let n = r.value_str().unwrap_or_default();
        let expected_key = n.as_bytes();
        let origin = format!("h{n}").into_bytes();
        let src = r
            .header(SOURCE_HEADER)
            .flatten()
            .and_then(SourcePosition::decode)
            .ok_or_else(|| format!("{n}: no readable {SOURCE_HEADER} header"))?;
        let fp = r
            .header(FINGERPRINT_HEADER)
            .flatten()
            .ok_or_else(|| format!("{n}: no {FINGERPRINT_HEADER} header"))?;
        let ok = r.key.as_deref() == Some(expected_key)
            && r.header("origin") == Some(Some(&origin[..]))
            && r.header("empty").is_some()
            && fp.len() == 17
            // The input's create time, not the time of the copy.
            && n.parse().ok().map(created) == r.timestamp
            && src.topic == "in"
            // Two output partitions for two input partitions: kept.
            && src.partition == r.partition;
        if !ok {
            return Err(format!("record {n} was not copied faithfully: {r:?}").into());
        }
    }
    Ok(())
}

#[test]
fn pipe_killed_with_sigkill_and_restarted_writes_each_value_once() -> TestResult {
    const N: u64 = 30_000;
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    let bootstrap = broker.bootstrap().to_owned();
    // Input keeps arriving while the pipe is killed and restarted.
    let feeder = thread::spawn(move || -> TestResult {
        let mut producer = TestProducer::new(&bootstrap, "in")?;
        for n in 1..=N {
            producer.send_integer(n)?;
            if n % 100 == 0 {
                producer.flush(Duration::from_secs(30))?;
                thread::sleep(Duration::from_millis(30));
            }
        }
        producer.flush(Duration::from_secs(60))?;
        Ok(())
    });
    let state = tempfile::tempdir()?;
    let mut rng = rand::rng();
    let mut kills = 0;
    for _ in 0..3 {
        let before = total(&broker, "out")?;
        if before >= N as i64 {
            break;
        }
        let mut child = pipe(
            &broker,
            "crashy",
            state.path(),
            &["--checkpoint-interval", "300ms"],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
        // Kill it while it copies: after some new output, at a random moment.
        let target = (before + 500).min(N as i64);
        let progress = wait_for_records(&broker, "out", target, Duration::from_secs(60));
        thread::sleep(Duration::from_millis(rng.random_range(0..400)));
        child.kill()?;
        child.wait()?;
        progress?;
        kills += 1;
    }
    feeder.join().map_err(|_| "the feeder panicked")??;
    let out = run_bounded(
        &mut pipe(&broker, "crashy", state.path(), &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    success(&out, "pipe --stop-at-end after the kills")?;
    if kills == 0 {
        return Err("no kill landed mid-run".into());
    }
    let copied = read_topic(broker.bootstrap(), "out", PyClient::Confluent)?;
    check_each_once(&integers(&copied)?, 1..=N)
}

#[test]
fn pipe_baseline_modes_copy_each_record_once_without_crashes() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("alo", 2), ("tx", 2)])?;
    produce_integers(broker.bootstrap(), "in", 1..=100)?;
    for (mode, output) in [("at-least-once", "alo"), ("transactional", "tx")] {
        let state = tempfile::tempdir()?;
        let mut c = replayguard();
        c.arg("pipe")
            .args(["--brokers", broker.bootstrap(), "--group", mode])
            .args(["--input", "in", "--output", output, "--mode", mode])
            .arg("--state")
            .arg(state.path())
            .args(["-X", "session.timeout.ms=6000", "--stop-at-end"]);
        success(&run_bounded(&mut c, RUN_LIMIT)?, mode)?;
        let copied = replayguard_testkit::read_topic_with(
            broker.bootstrap(),
            output,
            &replayguard_testkit::ReadOptions {
                read_committed: true,
                ..replayguard_testkit::ReadOptions::default()
            },
        )?;
        check_each_once(&integers(&copied)?, 1..=100).map_err(|e| format!("{mode}: {e}"))?;
    }
    Ok(())
}

/// Two jobs write to one topic. A new job's reconciliation reads the whole
/// output (no position of its own names where to start) and takes only its
/// own inputs' outputs as handled: the other job's are passed over, not
/// kept in its folder as positions of a topic it does not read.
#[test]
fn pipe_passes_over_the_outputs_of_another_job_sharing_its_output() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("other", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=200)?;
    produce_integers(broker.bootstrap(), "other", 1001..=1050)?;
    let dir = tempfile::tempdir()?;
    let first = run_bounded(
        &mut pipe(
            &broker,
            "first",
            &dir.path().join("first"),
            &["--stop-at-end"],
        ),
        RUN_LIMIT,
    )?;
    success(&first, "the first job")?;
    let second = dir.path().join("second");
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", broker.bootstrap(), "--group", "second"])
        .args(["--input", "other", "--output", "out", "--stop-at-end"])
        // Every epoch kept, so that whatever it recorded shows.
        .args(["--retention-epochs", "1000"])
        .args(["-X", "session.timeout.ms=6000", "--state"])
        .arg(&second);
    success(&run_bounded(&mut c, RUN_LIMIT)?, "the second job")?;
    let values = integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?;
    check_each_once(&values, (1..=200).chain(1001..=1050))?;
    let report = inspect(&second, true)?;
    success(&report, "inspect --json")?;
    let json: serde_json::Value = serde_json::from_slice(&report.stdout)?;
    let lanes: Vec<&serde_json::Value> = json["epochs"]
        .as_array()
        .ok_or("no epochs in inspect --json")?
        .iter()
        .flat_map(|e| e["lanes"].as_array().into_iter().flatten())
        .chain(json["positions"].as_array().into_iter().flatten())
        .collect();
    if lanes.is_empty() || lanes.iter().any(|l| l["topic"] != "other") {
        return Err(format!("the second job's folder holds {lanes:?}").into());
    }
    Ok(())
}

#[test]
fn sigterm_takes_a_final_checkpoint_and_exits_zero() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=100)?;
    let state = tempfile::tempdir()?;
    // A long interval: the positions inspect sees come from the final
    // checkpoint, not a periodic one.
    let (mut child, stderr) = spawn_logged(&mut pipe(
        &broker,
        "term",
        state.path(),
        &["--checkpoint-interval", "1h"],
    ))?;
    let copied = wait_for_records(&broker, "out", 100, Duration::from_secs(60));
    let (status, stderr) = terminate(&mut child, stderr)?;
    let status = status?;
    copied?;
    if !status.success() || stderr.contains("replayguard: error") {
        return Err(format!("SIGTERM: {status}, stderr: {stderr}").into());
    }
    let report = inspect(state.path(), true)?;
    success(&report, "inspect")?;
    let json: serde_json::Value = serde_json::from_slice(&report.stdout)?;
    let positions = &json["positions"];
    let expected = serde_json::json!([{"topic": "in", "partition": 0, "next_offset": 100}]);
    if *positions != expected || json["epoch"].as_u64().is_none_or(|e| e < 1) {
        return Err(format!("after SIGTERM inspect shows {json}").into());
    }
    check_each_once(
        &integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?,
        1..=100,
    )
}

#[test]
fn a_second_instance_on_the_same_state_folder_is_refused() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=10)?;
    let state = tempfile::tempdir()?;
    let mut first = pipe(&broker, "busy", state.path(), &[])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let result = (|| -> TestResult {
        // Output means the first one holds the state.
        wait_for_records(&broker, "out", 10, Duration::from_secs(60))?;
        let second = run_bounded(&mut pipe(&broker, "busy", state.path(), &[]), RUN_LIMIT)?;
        let line = one_error_line(&second, 1)?;
        expect_contains(&line, "is in use by another replayguard instance")?;
        let viewed = inspect(state.path(), false)?;
        let line = one_error_line(&viewed, 1)?;
        expect_contains(&line, "in use")
    })();
    // SIGINT (Ctrl-C) stops it like SIGTERM.
    send_signal(first.id(), "INT")?;
    let status = wait_bounded(&mut first, Duration::from_secs(30));
    if status.is_err() {
        let _ = first.kill();
    }
    result?;
    if !status?.success() {
        return Err("the first instance did not exit 0 on SIGINT".into());
    }
    Ok(())
}

#[test]
fn progress_line_shows_on_a_terminal() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=20)?;
    let state = tempfile::tempdir()?;
    let state = state.path().to_str().ok_or("temp path is not UTF-8")?;
    // script(1) from util-linux gives the command a terminal.
    let line = format!(
        "'{}' pipe --brokers {} --group tty --input in --output out --state '{state}' \
         -X session.timeout.ms=6000 --stop-at-end",
        env!("CARGO_BIN_EXE_replayguard"),
        broker.bootstrap()
    );
    let out = run_bounded(
        Command::new("script")
            .args(["-q", "-e", "-c", &line, "/dev/null"])
            .env_remove("RUST_LOG"),
        RUN_LIMIT,
    )
    .map_err(|e| format!("script(1) from util-linux is needed for this test: {e}"))?;
    success(&out, "pipe on a terminal")?;
    let screen = text(&out.stdout);
    // The last summary, after the final checkpoint.
    let last = screen
        .rsplit('\r')
        .find(|l| l.contains("duplicates dropped"))
        .unwrap_or_default();
    // `in 20 (N/s)  out 20  [lag L  ]duplicates dropped 0`: the rate is
    // the whole run's, the lag there once librdkafka's statistics came.
    let summary = last
        .split_once("in 20 (")
        .and_then(|(_, rest)| rest.split_once("/s)  out 20  "))
        .map(|(rate, rest)| (rate, rest.strip_prefix("lag 0  ").unwrap_or(rest)));
    if !summary.is_some_and(|(rate, rest)| {
        rate.parse::<f64>().is_ok() && rest.starts_with("duplicates dropped 0")
    }) {
        return Err(format!("no progress summary on the terminal: {screen:?}").into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// consume

#[test]
fn consume_prints_each_value_once_despite_upstream_resends() -> TestResult {
    let broker = MockBroker::start(&[("events", 1)])?;
    let resent = [
        32, 34, 35, 36, 40, 41, 46, 31, 33, 37, 38, 39, 42, 43, 44, 45,
    ];
    produce_integers(broker.bootstrap(), "events", (1..=40).chain(resent))?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut consume(
            &broker,
            "events",
            state.path(),
            &["--stop-at-end", "--retention-time", "1h"],
        ),
        RUN_LIMIT,
    )?;
    success(&out, "consume --stop-at-end")?;
    let printed: Vec<u64> = text(&out.stdout)
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    // 41..46 are new values: once each; the rest were resends.
    check_each_once(&printed, 1..=46)?;
    // Everything is handled, so a second run prints nothing.
    let again = run_bounded(
        &mut consume(&broker, "events", state.path(), &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    success(&again, "second consume")?;
    if !again.stdout.is_empty() {
        return Err(format!("second run printed {:?}", text(&again.stdout)).into());
    }
    Ok(())
}

/// Under the key identity a record without a key has no identity: it is
/// told apart by its position, like a record without the chosen header,
/// not taken for a resend of every other record without a key.
#[test]
fn consume_by_key_prints_each_record_without_a_key_and_drops_a_resent_key() -> TestResult {
    let broker = MockBroker::start(&[("keyed", 1)])?;
    let record = |key: Option<&str>, value: &str| NewRecord {
        key: key.map(|k| k.as_bytes().to_vec()),
        value: Some(value.as_bytes().to_vec()),
        ..NewRecord::default()
    };
    produce(
        broker.bootstrap(),
        "keyed",
        [
            record(Some("a"), "1"),
            record(None, "2"),
            record(None, "3"),
            // A resend of key "a", with a new value: the same identity.
            record(Some("a"), "4"),
            record(None, "5"),
            record(Some("b"), "6"),
        ],
    )?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut consume(
            &broker,
            "keyed",
            state.path(),
            &["--stop-at-end", "--identity", "key"],
        ),
        RUN_LIMIT,
    )?;
    success(&out, "consume --identity key")?;
    let printed: Vec<u64> = text(&out.stdout)
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    check_each_once(&printed, [1, 2, 3, 5, 6])
}

#[test]
fn consume_format_prints_key_partition_offset_topic_and_headers() -> TestResult {
    let broker = MockBroker::start(&[("fmt", 2)])?;
    produce(
        broker.bootstrap(),
        "fmt",
        [
            NewRecord {
                key: Some(b"k1".to_vec()),
                value: Some(b"v1".to_vec()),
                headers: vec![("a".into(), Some(b"1".to_vec())), ("b".into(), None)],
                partition: Some(1),
                timestamp: None,
            },
            NewRecord {
                key: None,
                value: Some(b"v2".to_vec()),
                headers: Vec::new(),
                partition: Some(0),
                timestamp: None,
            },
        ],
    )?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut consume(
            &broker,
            "fmt",
            state.path(),
            &[
                "--stop-at-end",
                "--format",
                "%t|%p|%o|%k|%s|%h|100%%\\t.\\n",
            ],
        ),
        RUN_LIMIT,
    )?;
    success(&out, "consume --format")?;
    let lines: BTreeSet<String> = text(&out.stdout).lines().map(str::to_owned).collect();
    let expected: BTreeSet<String> = ["fmt|1|0|k1|v1|a=1,b=|100%\t.", "fmt|0|0||v2||100%\t."]
        .into_iter()
        .map(str::to_owned)
        .collect();
    if lines != expected || text(&out.stdout).lines().count() != 2 {
        return Err(format!("printed {:?}", text(&out.stdout)).into());
    }
    Ok(())
}

#[test]
fn consume_stops_cleanly_when_stdout_closes() -> TestResult {
    const N: u64 = 20_000;
    let broker = MockBroker::start(&[("many", 1)])?;
    produce_integers(broker.bootstrap(), "many", 1..=N)?;
    let state = tempfile::tempdir()?;
    let mut child = consume(&broker, "many", state.path(), &[])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut first = Vec::new();
    for line in BufReader::new(stdout).lines().take(5) {
        first.push(line?.parse::<u64>()?);
    }
    // The reader is gone: the next write fails with EPIPE.
    let status = wait_bounded(&mut child, Duration::from_secs(30));
    if status.is_err() {
        let _ = child.kill();
    }
    let status = status?;
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().ok_or("no stderr")?, &mut stderr)?;
    if !status.success() || stderr.contains("replayguard: error") {
        return Err(format!("closed stdout: {status}, stderr: {stderr}").into());
    }
    if first != [1, 2, 3, 4, 5] {
        return Err(format!("first run printed {first:?}").into());
    }
    // The next run carries on where the written records end: a contiguous
    // tail, none of what was already read.
    let rest = run_bounded(
        &mut consume(&broker, "many", state.path(), &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    success(&rest, "consume after a closed stdout")?;
    let rest: Vec<u64> = text(&rest.stdout)
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let start = rest.first().copied().unwrap_or(N + 1);
    if start <= 5 || start > N || rest != (start..=N).collect::<Vec<_>>() {
        return Err(format!(
            "second run printed {} values from {start:?}, not a contiguous tail after 5",
            rest.len()
        )
        .into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// inspect

/// On Apache Kafka: librdkafka's mock cluster does not create topics
/// through the admin API.
#[test]
fn pipe_with_a_changelog_ships_its_identities_and_inspect_shows_where() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 2), ("out", 2)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=50)?;
    let state = tempfile::tempdir()?;
    let pipe = |extra: &[&str]| kafka_pipe(&bootstrap, "logged", state.path(), extra);
    let run = run_bounded(
        &mut pipe(&[
            "--stop-at-end",
            "--retention-epochs",
            "3",
            "--changelog",
            "in-log",
        ]),
        RUN_LIMIT,
    )?;
    success(&run, "pipe --changelog")?;
    // The changelog holds the identities: records in both partitions.
    let logged = end_offsets(&bootstrap, "in-log")?;
    if logged.len() != 2 || logged.values().any(|e| *e == 0) {
        return Err(format!("changelog ends {logged:?}").into());
    }
    let table = inspect(state.path(), false)?;
    success(&table, "inspect")?;
    let table = text(&table.stdout);
    expect_contains(&table, "changelog\n  topic in-log\n")?;
    expect_contains(
        &table,
        "  partition 0: this folder's records end at offset ",
    )?;
    // A bad topic name is refused in flag terms.
    let bad = run_bounded(&mut pipe(&["--changelog", "no spaces"]), RUN_LIMIT)?;
    expect_contains(
        &text(&bad.stderr),
        "--changelog: the changelog must be a topic name",
    )?;
    // Nor can it be a topic the job reads or writes.
    for topic in ["in", "out"] {
        let mixed = run_bounded(&mut pipe(&["--changelog", topic]), RUN_LIMIT)?;
        expect_contains(
            &one_error_line(&mixed, 2)?,
            "is also a topic this job reads or writes",
        )?;
    }
    Ok(())
}

/// On Apache Kafka, whose `offset.metadata.max.bytes` can be set low: a
/// broker that refuses the offset commit's metadata (the output positions a
/// new owner reconciles from) stops `pipe` with an error naming the
/// setting, from a periodic checkpoint's commit and from the last one
/// alike. The folder's checkpoint comes before the commit, so the restart
/// writes nothing twice.
#[test]
fn pipe_stops_when_the_broker_refuses_its_commit_metadata_as_too_large() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start_with(
        replayguard_testkit::KafkaOptions {
            properties: vec!["offset.metadata.max.bytes=64".into()],
            ..Default::default()
        },
        &[("in", 1), ("out", 8)],
    )?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=100)?;
    let state = tempfile::tempdir()?;
    let pipe = |extra: &[&str]| kafka_pipe(&bootstrap, "refused", state.path(), extra);
    let refused = |out: &Output, run: &str| {
        expect_metadata_refused(out, run, "output and changelog partitions")
    };
    // The first commit with this metadata is the claim of the arriving
    // partition, before its first output: the run stops there, with or
    // without an end to stop at or a periodic checkpoint due, and writes
    // nothing a successor could not account for.
    let unbounded = run_bounded(&mut pipe(&["--checkpoint-interval", "200ms"]), RUN_LIMIT)?;
    refused(&unbounded, "a run with no end")?;
    let to_the_end = run_bounded(
        &mut pipe(&["--stop-at-end", "--checkpoint-interval", "1h"]),
        RUN_LIMIT,
    )?;
    refused(&to_the_end, "a run to the end, with no periodic checkpoint")?;
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    if !values.is_empty() {
        return Err(format!("{} outputs written before the refusal", values.len()).into());
    }
    Ok(())
}

/// The refusal again, but of a periodic checkpoint's commit, which is
/// asynchronous and whose outcome librdkafka does not report. The broker
/// takes the claim's metadata, and a checkpoint's while the output offset
/// has two digits at most, and refuses it from the third on. A commit whose
/// metadata is longer than any the broker has taken is made
/// synchronously, so the run stops on it; without that rule it ran on
/// until killed, its group never learning where its outputs end.
#[test]
fn pipe_stops_when_a_periodic_commit_outgrows_what_the_broker_took() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start_with(
        replayguard_testkit::KafkaOptions {
            properties: vec![format!("offset.metadata.max.bytes={GROWN_METADATA_LIMIT}")],
            ..Default::default()
        },
        &[("in", 1), ("out", 8)],
    )?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=400)?;
    let state = tempfile::tempdir()?;
    // No end to stop at, so only an error ends the run, and nothing but
    // the periodic checkpoints commit after the claim.
    let run = run_bounded(
        &mut kafka_pipe(
            &bootstrap,
            "grown",
            state.path(),
            &["--checkpoint-interval", "300ms"],
        ),
        RUN_LIMIT,
    )?;
    let one_byte_over = format!("its metadata of {} bytes", GROWN_METADATA_LIMIT + 1);
    expect_metadata_refused(&run, "the checkpoint", &one_byte_over)?;
    // The claim was taken: the refusal came later, at a checkpoint, after
    // outputs were written.
    let written = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    if written.is_empty() {
        return Err(format!("no output before the refusal: {}", text(&run.stderr)).into());
    }
    Ok(())
}

/// What the broker takes in the test above. The metadata is JSON: the
/// output topic, its eight partitions' ends (`"0":400,"1":0,...`: outputs
/// go to the input's partition, 0), the folder's 16-digit token, the clean
/// flag and the in-flight bound (16000 ms by default). The claim's, all
/// ends 0, is 108 bytes; with 10 to 99 outputs 109; with 100 or more 110,
/// refused.
const GROWN_METADATA_LIMIT: usize = 109;

/// That `out` is `pipe` stopped by a broker that refused its commit
/// metadata as too large: exit 1, and a last line that names the setting
/// and says `detail`.
fn expect_metadata_refused(out: &Output, run: &str, detail: &str) -> TestResult {
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    if out.status.code() != Some(1)
        || !last.starts_with("replayguard: error: ")
        || !last.contains("offset.metadata.max.bytes")
        || !last.contains(detail)
    {
        return Err(format!("{run}: expected the refusal, got {}: {stderr}", out.status).into());
    }
    Ok(())
}

/// A broker that refuses the claim of arriving partitions (the commit
/// before their first output that makes a successor wait for this
/// instance's outputs in flight): `pipe` holds them, writing nothing for
/// them, and claims them again until the broker takes it. Without the
/// hold it wrote at once, and with no periodic checkpoint due the group
/// held no claim at all while its outputs went out.
#[test]
fn pipe_writes_nothing_for_partitions_until_the_broker_takes_their_claim() -> TestResult {
    const REFUSALS: usize = 4;
    let mut broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    produce_integers(broker.bootstrap(), "in", 1..=200)?;
    broker.refuse_commits(REFUSALS)?;
    let state = tempfile::tempdir()?;
    // No periodic checkpoint: its commit would stand in for a claim.
    let (mut child, stderr) = spawn_logged(&mut pipe(
        &broker,
        "claims",
        state.path(),
        &["--checkpoint-interval", "1h"],
    ))?;
    let ends = Ends::new(broker.bootstrap(), &[("in", 2), ("out", 2)])?;
    let first = committed_at_output(&ends, 0, &mut child, "claims");
    let copied = first.is_ok() && wait_for_records(&broker, "out", 200, RUN_LIMIT).is_ok();
    let (status, stderr) = terminate(&mut child, stderr)?;
    let claims = first.map_err(|e| format!("{e}; stderr:\n{stderr}"))?;
    // At the first output the group already held this instance's claim
    // of both partitions: a commit that names it and no clean handover.
    for (p, claim) in claims.iter().enumerate() {
        if claimant(claim).is_none() {
            return Err(format!(
                "in/{p}: when the first output was written the group held {claim:?}, not a claim; stderr:\n{stderr}"
            )
            .into());
        }
    }
    expect_claimed_copy(&broker, &stderr, status, copied, REFUSALS, 200)
}

/// The same after an unclean handover: a new owner that waited for a
/// killed one's outputs in flight and reconciled them claims the
/// partition before its first output, and while the broker refuses, it
/// claims again rather than write under the killed owner's claim.
#[test]
fn a_new_owner_that_waited_for_a_killed_one_writes_nothing_until_its_claim_is_taken() -> TestResult
{
    const REFUSALS: usize = 3;
    let mut broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=200)?;
    let (killed_state, new_state) = (tempfile::tempdir()?, tempfile::tempdir()?);
    // No periodic checkpoint: the killed owner leaves its claim only, and
    // a short delivery timeout shortens the new owner's wait.
    let extra = ["--checkpoint-interval", "1h", "--delivery-timeout", "2s"];
    let (mut killed, killed_log) =
        spawn_logged(&mut pipe(&broker, "handover", killed_state.path(), &extra))?;
    let copied = wait_for_records(&broker, "out", 200, RUN_LIMIT);
    killed.kill()?;
    killed.wait()?;
    let killed_log = killed_log.join().map_err(|_| "stderr reader panicked")?;
    copied.map_err(|e| format!("{e}; stderr:\n{killed_log}"))?;
    let ends = Ends::new(broker.bootstrap(), &[("in", 1), ("out", 1)])?;
    let killed_claim = ends.committed("handover", "in")?;
    let killed_claimant = claimant(&killed_claim[0])
        .ok_or_else(|| format!("the killed owner left {killed_claim:?}, not its claim"))?;
    produce_integers(broker.bootstrap(), "in", 201..=400)?;
    broker.refuse_commits(REFUSALS)?;
    let (mut new, new_log) =
        spawn_logged(&mut pipe(&broker, "handover", new_state.path(), &extra))?;
    let first = committed_at_output(&ends, 200, &mut new, "handover");
    let copied = first.is_ok() && wait_for_records(&broker, "out", 400, RUN_LIMIT).is_ok();
    let (status, new_log) = terminate(&mut new, new_log)?;
    let claim = first.map_err(|e| format!("{e}; stderr:\n{new_log}"))?;
    match claimant(&claim[0]) {
        Some(c) if c != killed_claimant => {}
        _ => {
            return Err(format!(
                "when the new owner's first output was written the group held {claim:?}, not its claim; stderr:\n{new_log}"
            )
            .into());
        }
    }
    // It waited for the killed owner first: the refusals met the claim
    // made after that wait.
    let waited = new_log.find("partitions arrive without a clean handover");
    let refused = new_log.find(CLAIM_REFUSED);
    if !matches!((waited, refused), (Some(w), Some(r)) if w < r) {
        return Err(format!(
            "no wait for the killed owner before the refusals; stderr:\n{new_log}"
        )
        .into());
    }
    expect_claimed_copy(&broker, &new_log, status, copied, REFUSALS, 400)
}

/// The warning `pipe` logs at each refused claim.
const CLAIM_REFUSED: &str = "the broker refused to claim arriving partitions";

/// That a run with refused claims logged `refusals` of them, copied 1 to
/// `n` (`copied`: it saw them all), exited cleanly, and wrote each once.
fn expect_claimed_copy(
    broker: &MockBroker,
    stderr: &str,
    status: TestResult<std::process::ExitStatus>,
    copied: bool,
    refusals: usize,
    n: u64,
) -> TestResult {
    let logged = stderr.matches(CLAIM_REFUSED).count();
    if logged != refusals || !copied || !status?.success() || stderr.contains("replayguard: error")
    {
        return Err(format!(
            "expected {refusals} refusals logged, all {n} copied and a clean exit; {logged} refusals, copied: {copied}; stderr:\n{stderr}"
        )
        .into());
    }
    check_each_once(
        &integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?,
        1..=n,
    )
}

/// Waits until `out` holds more than `n` records while `child` runs, and
/// returns what `group` had committed on each partition of `in` then.
fn committed_at_output(
    ends: &Ends,
    n: i64,
    child: &mut std::process::Child,
    group: &str,
) -> TestResult<Vec<Option<(i64, String)>>> {
    let deadline = Instant::now() + RUN_LIMIT;
    while ends.total("out")? <= n {
        if let Some(status) = child.try_wait()? {
            return Err(format!("pipe exited ({status}) with {n} outputs or fewer").into());
        }
        if Instant::now() >= deadline {
            return Err(format!("no more than {n} outputs within {RUN_LIMIT:?}").into());
        }
        thread::sleep(Duration::from_millis(10));
    }
    ends.committed(group, "in")
}

/// The instance a committed offset's metadata names, if it is a claim (no
/// clean handover).
fn claimant(commit: &Option<(i64, String)>) -> Option<String> {
    let meta: serde_json::Value = serde_json::from_str(&commit.as_ref()?.1).ok()?;
    if meta["c"] != serde_json::json!(false) {
        return None;
    }
    meta["i"]
        .as_str()
        .filter(|i| !i.is_empty())
        .map(str::to_owned)
}

/// A broker that never takes the claim: `pipe` stops with an error that
/// says so once it has refused for the timeout (30 s), having written
/// nothing, instead of waiting for good or writing unclaimed.
#[test]
fn pipe_stops_when_the_broker_keeps_refusing_its_claim() -> TestResult {
    let mut broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=50)?;
    broker.refuse_commits(1_000)?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut pipe(
            &broker,
            "never",
            state.path(),
            &["--checkpoint-interval", "1h"],
        ),
        RUN_LIMIT,
    )?;
    let stderr = text(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    if out.status.code() != Some(1)
        || !last.starts_with("replayguard: error: the broker refused ")
        || !last.contains("claim of in[0]")
        || !last.contains("RebalanceInProgress")
    {
        return Err(format!("expected the refused claim, got {}: {stderr}", out.status).into());
    }
    let written = total(&broker, "out")?;
    if written != 0 {
        return Err(format!("{written} outputs written for an unclaimed partition").into());
    }
    Ok(())
}

/// `command` started with no stdin or stdout, and its stderr gathered on
/// a thread until it closes.
fn spawn_logged(
    command: &mut Command,
) -> TestResult<(std::process::Child, thread::JoinHandle<String>)> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let stream = child.stderr.take().ok_or("no stderr")?;
    let stderr = thread::spawn(move || {
        let mut s = String::new();
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            s += &line;
            s.push('\n');
        }
        s
    });
    Ok((child, stderr))
}

/// Sends SIGTERM to a child of [`spawn_logged`] and waits 30 s at most
/// for it to exit (killing it then): how it exited, and its stderr.
fn terminate(
    child: &mut std::process::Child,
    stderr: thread::JoinHandle<String>,
) -> TestResult<(TestResult<std::process::ExitStatus>, String)> {
    send_signal(child.id(), "TERM")?;
    let status = wait_bounded(child, Duration::from_secs(30));
    if status.is_err() {
        let _ = child.kill();
    }
    let stderr = stderr.join().map_err(|_| "stderr reader panicked")?;
    Ok((status, stderr))
}

#[test]
fn inspect_shows_a_state_folder_and_leaves_it_as_it_was() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    produce_integers(broker.bootstrap(), "in", 1..=50)?;
    let state = tempfile::tempdir()?;
    let run = run_bounded(
        &mut pipe(
            &broker,
            "viewed",
            state.path(),
            &["--stop-at-end", "--retention-epochs", "3"],
        ),
        RUN_LIMIT,
    )?;
    success(&run, "pipe")?;
    let ends = end_offsets(broker.bootstrap(), "in")?;

    // Opening the store lets fjall tidy its own files under db/ (it trims
    // the preallocated journal and drops superseded version files), so what
    // must not change is everything else, and what the state says.
    let outside_db = |files: BTreeMap<String, Vec<u8>>| {
        files
            .into_iter()
            .filter(|(name, _)| !name.starts_with("db/"))
            .collect::<BTreeMap<_, _>>()
    };
    let before = outside_db(snapshot(state.path())?);
    let table = inspect(state.path(), false)?;
    success(&table, "inspect")?;
    let json = inspect(state.path(), true)?;
    success(&json, "inspect --json")?;
    let again = inspect(state.path(), true)?;
    success(&again, "inspect --json again")?;
    // REPLAYGUARD, JOB and instance-id.
    if outside_db(snapshot(state.path())?) != before || before.len() != 3 {
        return Err(format!("inspect changed the state folder: {:?}", before.keys()).into());
    }
    if json.stdout != again.stdout {
        return Err("two inspections disagree".into());
    }

    let table = text(&table.stdout);
    expect_contains(
        &table,
        &format!("format        {}\n", replayguard::FORMAT_VERSION),
    )?;
    for (p, end) in &ends {
        expect_contains(&table, &format!("  in[{p}]  {end}\n"))?;
    }
    expect_contains(&table, "live epochs")?;
    expect_contains(&table, r#""t":"out""#)?;

    let json: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    let positions: BTreeMap<i64, i64> = json["positions"]
        .as_array()
        .ok_or("no positions")?
        .iter()
        .map(|p| {
            (
                p["partition"].as_i64().unwrap_or(-1),
                p["next_offset"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    let expected: BTreeMap<i64, i64> = ends.iter().map(|(p, e)| (i64::from(*p), *e)).collect();
    let epochs = json["epochs"].as_array().ok_or("no epochs")?;
    let handled: u64 = epochs
        .iter()
        .map(|e| e["offsets"].as_u64().unwrap_or(0))
        .sum();
    let sink_ends: i64 = json["sink"]["e"]
        .as_object()
        .ok_or("no sink ends")?
        .values()
        .map(|v| v.as_i64().unwrap_or(0))
        .sum();
    let ok = json["format"] == replayguard::FORMAT_VERSION
        && positions == expected
        // Three completed epochs kept: the 50 offsets are still remembered.
        && handled == 50
        && json["sink"]["t"] == "out"
        && sink_ends == 50
        && json["disk_bytes"].as_u64().is_some_and(|b| b > 0)
        && json["memory_all_in_bytes"].as_u64().is_some_and(|b| b > 0)
        // No budget ran here, so no index of sealed hashes is on disk: an
        // inspect that built one (as opening with a budget of 0 does)
        // would have changed the folder.
        && json["disk_index_through"].is_null()
        && json["disk_index_bytes"] == 0;
    if !ok {
        return Err(format!("inspect --json shows {json}").into());
    }
    Ok(())
}

#[test]
fn inspect_refuses_a_missing_or_foreign_folder_and_creates_nothing() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("nope");
    let line = one_error_line(&inspect(&missing, false)?, 1)?;
    expect_contains(&line, "does not exist")?;
    if missing.exists() {
        return Err("inspect created the missing folder".into());
    }

    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign)?;
    std::fs::write(foreign.join("notes.txt"), "mine")?;
    let line = one_error_line(&inspect(&foreign, true)?, 1)?;
    expect_contains(&line, "is not a replayguard state folder")?;

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty)?;
    let line = one_error_line(&inspect(&empty, false)?, 1)?;
    expect_contains(&line, "is not a replayguard state folder")?;
    if std::fs::read_dir(&empty)?.next().is_some() {
        return Err("inspect wrote into an empty folder".into());
    }
    if snapshot(&foreign)?.len() != 1 {
        return Err("inspect wrote into a foreign folder".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Errors of pipe and consume

#[test]
fn pipe_refuses_a_missing_or_foreign_state_folder() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    let typo = dir.path().join("no-such-parent/state");
    let out = run_bounded(&mut pipe(&broker, "g", &typo, &[]), RUN_LIMIT)?;
    expect_contains(&one_error_line(&out, 1)?, "parent folder")?;

    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign)?;
    std::fs::write(foreign.join("data.csv"), "1,2,3")?;
    let out = run_bounded(&mut pipe(&broker, "g", &foreign, &[]), RUN_LIMIT)?;
    expect_contains(
        &one_error_line(&out, 1)?,
        "is not a replayguard state folder",
    )?;
    let out = run_bounded(
        &mut consume(&broker, "in", &foreign, &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    expect_contains(
        &one_error_line(&out, 1)?,
        "is not a replayguard state folder",
    )?;
    if snapshot(&foreign)?.len() != 1 || typo.exists() {
        return Err("a refused state folder was written to".into());
    }

    // A damaged journal: the storage engine's own log line stays out of
    // the way of the one error line.
    let damaged = dir.path().join("damaged");
    success(
        &run_bounded(
            &mut consume(&broker, "in", &damaged, &["--stop-at-end"]),
            RUN_LIMIT,
        )?,
        "a first run",
    )?;
    let journal = damaged.join("db/0.jnl");
    let mut bytes = std::fs::read(&journal)?;
    // The journal may be laid out ahead in zeros: damage its last write.
    let written = bytes
        .iter()
        .rposition(|b| *b != 0)
        .ok_or("an empty journal")?;
    let at = written.checked_sub(10).ok_or("a short journal")?;
    bytes[at] ^= 0xff;
    std::fs::write(&journal, &bytes)?;
    let out = run_bounded(
        &mut consume(&broker, "in", &damaged, &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    expect_contains(&one_error_line(&out, 1)?, "is corrupt")?;
    Ok(())
}

#[test]
fn pipe_and_consume_refuse_an_unknown_topic_or_a_pattern() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", broker.bootstrap(), "--group", "g"])
        .args(["--input", "in", "--output", "missing-out", "--state"])
        .arg(dir.path().join("a"));
    let line = one_error_line(&run_bounded(&mut c, RUN_LIMIT)?, 1)?;
    expect_contains(&line, "topic \"missing-out\" does not exist")?;
    let out = run_bounded(
        &mut consume(&broker, "missing-in", &dir.path().join("b"), &[]),
        RUN_LIMIT,
    )?;
    expect_contains(
        &one_error_line(&out, 1)?,
        "topic \"missing-in\" does not exist",
    )?;
    // A pattern is not a name: a usage error, and no folder is made.
    let folder = dir.path().join("c");
    let out = run_bounded(&mut consume(&broker, "^in$", &folder, &[]), RUN_LIMIT)?;
    let line = one_error_line(&out, 2)?;
    expect_contains(&line, "\"^in$\" is not a Kafka topic name")?;
    expect_contains(&line, "not by a pattern")?;
    if folder.exists() {
        return Err("a refused pattern made a state folder".into());
    }
    Ok(())
}

#[test]
fn an_unreachable_broker_fails_within_bounded_time() -> TestResult {
    // A port nobody listens on.
    let port = free_port()?;
    let brokers = format!("127.0.0.1:{port}");
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", &brokers, "--group", "g"])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(dir.path().join("a"));
    // Default: 10 probes of about 3.5 s.
    let out = run_bounded(&mut c, Duration::from_secs(60))?;
    let line = one_error_line(&out, 1)?;
    expect_contains(&line, &format!("no broker reachable at {brokers}"))?;
    expect_contains(&line, "check --brokers")?;
    let default_took = started.elapsed();

    let started = Instant::now();
    let mut c = replayguard();
    c.arg("consume")
        .args(["--brokers", &brokers, "--group", "g", "--topic", "t"])
        .args(["--connect-attempts", "2", "--state"])
        .arg(dir.path().join("b"));
    let out = run_bounded(&mut c, Duration::from_secs(30))?;
    let line = one_error_line(&out, 1)?;
    expect_contains(&line, "after 2 attempts")?;
    if started.elapsed() > Duration::from_secs(15) || default_took > Duration::from_secs(50) {
        return Err(format!(
            "gave up too slowly: {default_took:?} by default, {:?} with 2 attempts",
            started.elapsed()
        )
        .into());
    }
    Ok(())
}

#[test]
fn pipe_refuses_idempotence_off_before_touching_anything() -> TestResult {
    let port = free_port()?;
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", &format!("127.0.0.1:{port}"), "--group", "g"])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(&state)
        .args(["-X", "enable.idempotence=false"]);
    let out = run_bounded(&mut c, Duration::from_secs(10))?;
    let line = one_error_line(&out, 2)?;
    expect_contains(&line, "enable.idempotence=false is refused")?;
    if state.exists() {
        return Err("the state folder was created for a refused configuration".into());
    }
    Ok(())
}

#[test]
fn bad_arguments_are_usage_errors() -> TestResult {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let state = state.to_str().ok_or("temp path is not UTF-8")?;
    let base = [
        "pipe",
        "--brokers",
        "127.0.0.1:1",
        "--group",
        "g",
        "--input",
        "in",
        "--output",
        "out",
        "--state",
        state,
    ];
    for (extra, flag) in [
        (
            &["--checkpoint-interval", "soon"][..],
            "--checkpoint-interval",
        ),
        (&["--retention-time", "3 fortnights"], "--retention-time"),
        (&["--identity", "colour"], "--identity"),
        (&["--identity", "header:"], "--identity"),
        (&["--mode", "exactly-twice"], "--mode"),
        (&["-X", "linger.ms"], "-X"),
        (&["-X", "group.id=another"], "-X"),
        (&["-X", "bootstrap.servers=127.0.0.1:2"], "-X"),
        (&["-X", "enable.auto.commit=true"], "-X"),
        (&["--retention-epochs=-1"], "--retention-epochs"),
    ] {
        let out = run_bounded(
            replayguard().args(base).args(extra),
            Duration::from_secs(10),
        )?;
        usage_error(&out, flag).map_err(|e| format!("{extra:?}: {e}"))?;
    }
    // Refused by librdkafka or the library, before anything is touched.
    for (extra, says) in [
        (&["-X", "no.such.property=1"][..], "no.such.property"),
        (&["--checkpoint-interval", "2h"], "checkpoint interval"),
        // librdkafka takes 0 as no delivery bound, under which an instance
        // that lost its partitions could have outputs land at any time.
        (
            &["--delivery-timeout", "0s"],
            "--delivery-timeout: the delivery timeout must be between 100ms and 1h",
        ),
        (
            &["--delivery-timeout", "2h"],
            "must be between 100ms and 1h",
        ),
        (
            &["-X", "message.timeout.ms=0"],
            "message.timeout.ms (or delivery.timeout.ms) must be between 100 and 3600000 ms, not 0",
        ),
        // Rules between two properties, which librdkafka checks only when
        // it makes the client.
        (
            &["-X", "max.in.flight=10"],
            "the output producer's configuration is refused by librdkafka: `max.in.flight` must be set <= 5",
        ),
        (
            &["-X", "fetch.max.bytes=100"],
            "the consumer's configuration is refused by librdkafka: `fetch.max.bytes` must be >= `message.max.bytes`",
        ),
        (
            &["--input", "in"],
            "topic \"in\" is named twice among the inputs",
        ),
        // A baseline keeps no identities: a retention would do nothing.
        (
            &["--mode", "at-least-once", "--retention-time", "1h"],
            "retention_time is for the guarded mode only",
        ),
        (
            &[
                "--mode",
                "transactional",
                "--max-memory",
                "1GiB",
                "--changelog",
                "c",
            ],
            "max_memory_bytes, changelog are for the guarded mode only",
        ),
        // A lease the group does not honour: 6 s sessions, 1 s heartbeats.
        (
            &["--lease", "6s"],
            "the lease (6s) is longer than the group waits for a silent member, 5s",
        ),
        (
            &["--lease", "20s", "-X", "session.timeout.ms=20000"],
            "the lease (20s) is longer than the group waits for a silent member",
        ),
    ] {
        let out = run_bounded(
            replayguard().args(base).args(extra),
            Duration::from_secs(10),
        )?;
        expect_contains(&one_error_line(&out, 2)?, says)?;
    }
    let consume = |extra: &[&str]| {
        run_bounded(
            replayguard()
                .args(["consume", "--brokers", "127.0.0.1:1", "--group", "g"])
                .args(["--topic", "t", "--state", state])
                .args(extra),
            Duration::from_secs(10),
        )
    };
    usage_error(&consume(&["--format", "%z"])?, "--format")?;
    expect_contains(
        &one_error_line(&consume(&["-X", "fetch.max.bytes=100"])?, 2)?,
        "the consumer's configuration is refused by librdkafka",
    )?;
    expect_contains(
        &one_error_line(&consume(&["--topic", "t"])?, 2)?,
        "topic \"t\" is named twice among the topics",
    )?;
    // No group, no broker: said so, not librdkafka's words for them.
    let named = |brokers: &str, group: &str| {
        run_bounded(
            replayguard()
                .args(["consume", "--brokers", brokers, "--group", group])
                .args(["--topic", "t", "--state", state]),
            Duration::from_secs(10),
        )
    };
    expect_contains(
        &one_error_line(&named("127.0.0.1:1", "")?, 2)?,
        "the consumer group's name (group.id) is empty",
    )?;
    expect_contains(
        &one_error_line(&named(" , ", "g")?, 2)?,
        "no broker is named",
    )?;
    if Path::new(state).exists() {
        return Err("a usage error created the state folder".into());
    }
    Ok(())
}

/// A reader of uncommitted records takes in the records of aborted
/// transactions: allowed, with a warning before anything else.
#[test]
fn reading_uncommitted_records_is_warned_of() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = run_bounded(
        replayguard()
            .args(["pipe", "--brokers", "127.0.0.1:1", "--group", "g"])
            .args([
                "--input",
                "in",
                "--output",
                "out",
                "--connect-attempts",
                "1",
            ])
            .args(["-X", "isolation.level=read_uncommitted", "--state"])
            .arg(dir.path().join("state")),
        Duration::from_secs(30),
    )?;
    one_error_line(&out, 1)?;
    expect_contains(
        &text(&out.stderr),
        "WARN replayguard::kafka::setup: isolation.level=read_uncommitted: records of transactions the input's producers aborted are read",
    )
}

#[test]
fn every_subcommand_explains_itself_with_an_example() -> TestResult {
    for sub in ["pipe", "consume", "inspect"] {
        let out = run_bounded(replayguard().args([sub, "--help"]), Duration::from_secs(10))?;
        success(&out, &format!("{sub} --help"))?;
        let help = text(&out.stdout);
        expect_contains(&help, "Example:")?;
        expect_contains(&help, &format!("replayguard {sub} --"))?;
    }
    Ok(())
}

/// A tmpfs of a given size mounted over a temporary folder, unmounted on
/// drop: a disk that fills up.
struct SmallDisk {
    dir: tempfile::TempDir,
    /// The mount point, as the system calls take it.
    target: std::ffi::CString,
}

impl SmallDisk {
    /// `Err` with the reason where this process may not mount (it needs
    /// root, or `CAP_SYS_ADMIN`).
    fn mount(bytes: u64) -> TestResult<Result<Self, String>> {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir()?;
        let target = std::ffi::CString::new(dir.path().as_os_str().as_bytes())?;
        Ok(match tmpfs(&target, bytes, 0) {
            Ok(()) => Ok(SmallDisk { dir, target }),
            Err(e) => Err(format!("mounting a tmpfs failed ({e})")),
        })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Gives the disk `bytes` in all, keeping what it holds.
    fn resize(&self, bytes: u64) -> TestResult {
        Ok(tmpfs(&self.target, bytes, libc::MS_REMOUNT)?)
    }
}

fn tmpfs(target: &std::ffi::CStr, bytes: u64, flags: libc::c_ulong) -> std::io::Result<()> {
    let data = std::ffi::CString::new(format!("size={bytes}")).map_err(std::io::Error::other)?;
    let tmpfs = c"tmpfs";
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call.
    let rc = unsafe {
        libc::mount(
            tmpfs.as_ptr(),
            target.as_ptr(),
            tmpfs.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path that outlives the call.
        unsafe { libc::umount2(self.target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// On Apache Kafka, with the state folder on a disk that fills up mid-run:
/// `pipe` stops with one error line naming the full disk (status 1), after
/// writing part of the output. Once the disk has room again, the same
/// command writes the rest, and an independent reader finds each input
/// exactly once: what the failed run wrote but had not checkpointed is
/// recognised, and nothing it had read is lost.
#[test]
fn pipe_stops_on_a_full_disk_and_its_restart_writes_each_input_once() -> TestResult {
    const N: u64 = 60_000;
    let disk = match SmallDisk::mount(400 << 10)? {
        Ok(disk) => disk,
        Err(why) => {
            eprintln!(
                "SKIPPED pipe_stops_on_a_full_disk_and_its_restart_writes_each_input_once: \
                 {why}; it needs root or CAP_SYS_ADMIN"
            );
            return Ok(());
        }
    };
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 4), ("out", 4)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=N)?;
    let state = disk.path().join("state");
    let run = || {
        kafka_pipe(
            &bootstrap,
            "full",
            &state,
            &["--stop-at-end", "--checkpoint-interval", "200ms"],
        )
    };
    let full = run_bounded(&mut run(), RUN_LIMIT)?;
    let line = one_error_line(&full, 1)?;
    expect_contains(&line, "No space left on device")?;
    expect_contains(&line, "reopen it after fixing the disk")?;
    let before = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    eprintln!("{} outputs before the disk filled", before.len());
    if before.is_empty() || before.len() as u64 >= N {
        return Err(format!(
            "the disk filled after {} of {N} outputs: not mid-run",
            before.len()
        )
        .into());
    }
    disk.resize(64 << 20)?;
    let again = run_bounded(&mut run(), RUN_LIMIT)?;
    success(&again, "the run with room on the disk again")?;
    // The journal's torn end, which the store drops, is no error of the run.
    if let Some(l) = text(&again.stderr).lines().find(|l| l.contains(" ERROR ")) {
        return Err(format!("the restart logged an error: {l}").into());
    }
    let values = integers(&read_topic(&bootstrap, "out", PyClient::KafkaPython)?)?;
    check_each_once(&values, 1..=N)
}

/// `--stop-at-end` on a topic of 256 partitions ends with the input read.
/// Its end check once asked each partition's end offset in a request of
/// its own, each waiting behind the consumer's fetch on the connection (up
/// to `fetch.wait.max.ms` at the tail): about 129 s for 256 partitions,
/// past this test's bound on each run.
#[test]
fn pipe_and_consume_end_on_a_topic_of_256_partitions() -> TestResult {
    const N: u64 = 2_560;
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 256), ("out", 256)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=N)?;
    let state = tempfile::tempdir()?;
    let copy = run_bounded(
        &mut kafka_pipe(
            &bootstrap,
            "wide",
            &state.path().join("pipe"),
            &["--stop-at-end"],
        ),
        RUN_LIMIT,
    )?;
    success(&copy, "pipe --stop-at-end")?;
    let copied = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&copied, 1..=N)?;
    let mut c = replayguard();
    c.arg("consume")
        .args([
            "--brokers",
            &bootstrap,
            "--group",
            "wide-reader",
            "--topic",
            "in",
        ])
        .args(["--stop-at-end", "--state"])
        .arg(state.path().join("consume"));
    let read = run_bounded(&mut c, RUN_LIMIT)?;
    success(&read, "consume --stop-at-end")?;
    let printed: Vec<u64> = text(&read.stdout)
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    check_each_once(&printed, 1..=N)
}

/// Records deleted from an input before the guard read them (retention or
/// DeleteRecords moved the log's start past its position) cannot reach the
/// output: librdkafka resumes at the log's new start, and the run says so
/// in a warning naming the partition, then copies the rest once.
#[test]
fn pipe_warns_when_input_records_were_deleted_before_it_read_them() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    let bootstrap = broker.bootstrap();
    let state = tempfile::tempdir()?;
    let run = || kafka_pipe(&bootstrap, "deleted", state.path(), &["--stop-at-end"]);
    produce_integers(&bootstrap, "in", 1..=500)?;
    let first = run_bounded(&mut run(), RUN_LIMIT)?;
    success(&first, "the first run")?;
    produce_integers(&bootstrap, "in", 501..=1000)?;
    // Offsets 500 to 799 (values 501 to 800) go before they are read.
    broker.delete_records("in", 0, 800)?;
    let second = run_bounded(&mut run(), RUN_LIMIT)?;
    success(&second, "the run after the deletion")?;
    let stderr = text(&second.stderr);
    expect_contains(&stderr, " WARN ")?;
    expect_contains(&stderr, "in [0]: offset reset (at offset 500")?;
    expect_contains(&stderr, "cannot reach the output")?;
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&values, (1..=500).chain(801..=1000))
}

/// An input that fits its topic but whose output, with the guard's headers
/// (64 bytes here), passes the producer's `message.max.bytes`: the run
/// stops on it with a hint, and a restart with a larger limit writes it and
/// the rest, each once. Then an output without a key, which a compacted
/// output topic refuses: a hint that says so.
#[test]
fn pipe_stops_on_an_output_the_broker_refuses_with_a_hint_and_its_restart_writes_it_once()
-> TestResult {
    // librdkafka's limit is on a record's largest wire size: 36 bytes of
    // framing, the key, the value and the headers. With a 1-byte key the
    // input (no headers) takes 999,967 of the default 1,000,000 and its
    // output 1,000,031.
    const LARGE: usize = 999_930;
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    let bootstrap = broker.bootstrap();
    let records = (1..=10u64).map(|n| {
        // Leading zeros: the value still reads as the integer.
        let value = if n == 5 {
            format!("{}{n}", "0".repeat(LARGE - 1))
        } else {
            n.to_string()
        };
        NewRecord {
            key: Some(n.to_string().into_bytes()),
            value: Some(value.into_bytes()),
            ..NewRecord::default()
        }
    });
    produce(&bootstrap, "in", records)?;
    let state = tempfile::tempdir()?;
    let out = run_bounded(
        &mut kafka_pipe(&bootstrap, "large", state.path(), &["--stop-at-end"]),
        RUN_LIMIT,
    )?;
    let line = one_error_line(&out, 1)?;
    expect_contains(&line, "the output of in[0]@4 was not delivered")?;
    expect_contains(&line, "Message size too large")?;
    expect_contains(&line, "raise the output topic's max.message.bytes")?;
    let again = run_bounded(
        &mut kafka_pipe(
            &bootstrap,
            "large",
            state.path(),
            &["--stop-at-end", "-X", "message.max.bytes=1100000"],
        ),
        RUN_LIMIT,
    )?;
    success(&again, "the run with a larger limit")?;
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&values, 1..=10)?;

    // A record without a key, refused by a compacted output.
    broker.create_topic("keyless", 1)?;
    broker.create_topic_with("compacted", 1, &[("cleanup.policy", "compact")])?;
    let keyless = (1..=3u64).map(|n| NewRecord {
        value: Some(n.to_string().into_bytes()),
        ..NewRecord::default()
    });
    produce(&bootstrap, "keyless", keyless)?;
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", &bootstrap, "--group", "compacted"])
        .args([
            "--input",
            "keyless",
            "--output",
            "compacted",
            "--stop-at-end",
        ])
        .arg("--state")
        .arg(state.path().join("compacted"));
    let line = one_error_line(&run_bounded(&mut c, RUN_LIMIT)?, 1)?;
    expect_contains(&line, "the output of keyless[0]@0 was not delivered")?;
    expect_contains(
        &line,
        "a compacted topic (cleanup.policy=compact) takes only records with a key",
    )
}

/// An output that no broker acknowledges in time (its topic deleted under
/// a running pipe, here) stops the run with the delivery timeout named and
/// what to check; before, the error said "Message timed out" and no more.
#[test]
fn pipe_stops_on_an_output_never_acknowledged_with_what_to_check() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 1), ("out", 1)])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=100)?;
    let state = tempfile::tempdir()?;
    let (mut child, stderr) = spawn_logged(&mut kafka_pipe(&bootstrap, "gone", state.path(), &[]))?;
    let deadline = Instant::now() + RUN_LIMIT;
    while end_offsets(&bootstrap, "out")?.values().sum::<i64>() < 100 {
        if Instant::now() >= deadline {
            let _ = child.kill();
            return Err("the first 100 records were not copied in time".into());
        }
        thread::sleep(Duration::from_millis(200));
    }
    broker.delete_topic("out")?;
    produce_integers(&bootstrap, "in", 101..=110)?;
    let status = wait_bounded(&mut child, RUN_LIMIT);
    if status.is_err() {
        let _ = child.kill();
    }
    let stderr = stderr.join().map_err(|_| "stderr reader panicked")?;
    assert_eq!(status?.code(), Some(1), "{stderr}");
    let line = stderr.lines().last().ok_or("nothing on stderr")?.to_owned();
    expect_contains(
        &line,
        "replayguard: error: the output of in[0]@100 was not delivered",
    )?;
    expect_contains(&line, "Message timed out")?;
    expect_contains(&line, "check that the output topic exists")
}

/// Waits until `check` holds, asking every half second, `limit` at most.
fn wait_until(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> TestResult<bool>,
) -> TestResult {
    let start = Instant::now();
    while !check()? {
        if start.elapsed() > limit {
            return Err(format!("not within {limit:?}: {what}").into());
        }
        thread::sleep(Duration::from_millis(500));
    }
    Ok(())
}

/// An instance with `--stop-at-end` to which its group gives no partition
/// (more members than partitions), once the group has read the input to
/// its end, has nothing to read: it ends, saying why, while the member
/// that owns the partition runs on. Before, no end event came for it, and
/// it ran until it was killed. An empty assignment alone does not end it:
/// a cooperative rebalance gives a joining member nothing in its first
/// round, and partitions in its second.
#[test]
fn stop_at_end_ends_an_instance_its_group_gives_no_partition() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[
        ("in", 1),
        ("out", 1),
        ("wide", 4),
        ("wide-out", 4),
    ])?;
    let bootstrap = broker.bootstrap();
    produce_integers(&bootstrap, "in", 1..=100)?;
    let dir = tempfile::tempdir()?;
    let reading = |group: &str, state: &str, extra: &[&str]| {
        let mut c = replayguard();
        c.arg("consume")
            .args(["--brokers", &bootstrap, "--group", group, "--topic", "in"])
            .arg("--state")
            .arg(dir.path().join(state))
            .args(extra);
        c
    };
    let committed = |group: &str| -> TestResult<i64> {
        let offsets = committed_offsets(&bootstrap, "in", group, PyClient::Confluent)?;
        Ok(offsets.values().flatten().sum())
    };
    let copied = |n: i64| -> TestResult {
        wait_until("the copier copied the input", RUN_LIMIT, || {
            Ok(end_offsets(&bootstrap, "out")?.values().sum::<i64>() >= n)
        })
    };
    let pipe_state = dir.path().join("copier");
    let (mut copier, copier_log) =
        spawn_logged(&mut kafka_pipe(&bootstrap, "copy", &pipe_state, &[]))?;
    let (mut reader, reader_log) = spawn_logged(&mut reading(
        "readers",
        "reader",
        &["--checkpoint-interval", "1s"],
    ))?;
    // Each owns the partition once it has handled the records.
    let idle = copied(100)
        .and_then(|()| {
            wait_until("the reader committed its position", RUN_LIMIT, || {
                // The group's coordinator may not answer yet (NOT_COORDINATOR).
                Ok(committed("readers").is_ok_and(|n| n >= 100))
            })
        })
        .and_then(|()| {
            let idle_state = dir.path().join("idle-pipe");
            let pipe = run_bounded(
                &mut kafka_pipe(&bootstrap, "copy", &idle_state, &["--stop-at-end"]),
                RUN_LIMIT,
            )?;
            let reader = run_bounded(
                &mut reading("readers", "idle-reader", &["--stop-at-end"]),
                RUN_LIMIT,
            )?;
            Ok((pipe, reader))
        });
    produce_integers(&bootstrap, "in", 101..=150)?;
    let later = copied(150);
    let (copier_status, copier_stderr) = terminate(&mut copier, copier_log)?;
    let (reader_status, reader_stderr) = terminate(&mut reader, reader_log)?;
    let (idle_pipe, idle_reader) = idle?;
    later?;
    success(&idle_pipe, "a pipe given no partition")?;
    expect_contains(
        &text(&idle_pipe.stderr),
        "no input partition is assigned to this instance",
    )?;
    success(&idle_reader, "a consume given no partition")?;
    expect_contains(
        &text(&idle_reader.stderr),
        "no input partition is assigned to this consumer",
    )?;
    if !idle_reader.stdout.is_empty() {
        return Err(format!("the idle reader printed {:?}", text(&idle_reader.stdout)).into());
    }
    for (status, stderr, who) in [
        (copier_status, copier_stderr, "copier"),
        (reader_status, reader_stderr, "reader"),
    ] {
        if !status?.success() {
            return Err(format!("the {who} did not exit 0 on SIGTERM: {stderr}").into());
        }
    }
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&values, 1..=150)?;

    // Under the broker-side group protocol librdkafka reports no empty
    // assignment; the group's progress is asked all the same.
    let kip848 = ["-X", "group.protocol=consumer"];
    let (mut owner, owner_log) =
        spawn_logged(reading("kip848", "owner", &kip848).args(["--checkpoint-interval", "1s"]))?;
    let idle = wait_until("the owner committed its position", RUN_LIMIT, || {
        Ok(committed("kip848")? >= 150)
    })
    .and_then(|()| {
        run_bounded(
            reading("kip848", "idle", &kip848).arg("--stop-at-end"),
            RUN_LIMIT,
        )
    });
    let (owner_status, owner_stderr) = terminate(&mut owner, owner_log)?;
    let idle = idle?;
    success(
        &idle,
        "a consume given no partition under group.protocol=consumer",
    )?;
    expect_contains(
        &text(&idle.stderr),
        "no input partition is assigned to this consumer",
    )?;
    if !owner_status?.success() {
        return Err(format!("the owner did not exit 0 on SIGTERM: {owner_stderr}").into());
    }

    // A member that has copied the input but committed nothing (its
    // checkpoints an hour apart): a second one joining is given nothing in
    // the first round, and two partitions in the second, which it reads.
    produce_integers(&bootstrap, "wide", 1..=400)?;
    let wide = |state: &str, extra: &[&str]| {
        let mut c = replayguard();
        c.arg("pipe")
            .args(["--brokers", &bootstrap, "--group", "wide"])
            .args(["--input", "wide", "--output", "wide-out", "--state"])
            .arg(dir.path().join(state))
            .args(extra);
        c
    };
    let (mut first, first_log) =
        spawn_logged(&mut wide("first", &["--checkpoint-interval", "1h"]))?;
    let all_copied = wait_until("the first member copied the input", RUN_LIMIT, || {
        Ok(end_offsets(&bootstrap, "wide-out")?.values().sum::<i64>() >= 400)
    });
    let second =
        all_copied.and_then(|()| run_bounded(&mut wide("second", &["--stop-at-end"]), RUN_LIMIT));
    let (first_status, first_stderr) = terminate(&mut first, first_log)?;
    let second = second?;
    success(
        &second,
        "a member joining a group whose input is not committed",
    )?;
    if text(&second.stderr).contains("no input partition is assigned") {
        return Err(format!(
            "the joining member ended with nothing assigned: {}",
            text(&second.stderr)
        )
        .into());
    }
    if !first_status?.success() {
        return Err(format!("the first member did not exit 0 on SIGTERM: {first_stderr}").into());
    }
    let values = integers(&read_topic(&bootstrap, "wide-out", PyClient::Confluent)?)?;
    check_each_once(&values, 1..=400)
}

/// `--stop-at-end` ends on partitions that hold nothing it can read, where
/// librdkafka has no position because it handed on no record: a log whose
/// records retention deleted (a fresh group, and a restart whose position
/// the deletion passed) and a reading reset to the end
/// (`auto.offset.reset=latest`). Before, each of these runs waited for an
/// end it compared with offset 0, until it was killed. A run reset to the
/// end keeps that end as its position, so the next run reads what came
/// after it.
#[test]
fn stop_at_end_ends_on_an_input_with_nothing_left_to_read() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 2), ("out", 2)])?;
    let bootstrap = broker.bootstrap();
    let delete_all = |topic: &str| -> TestResult {
        for (p, end) in end_offsets(&bootstrap, topic)? {
            broker.delete_records(topic, p, end)?;
        }
        Ok(())
    };
    let consume = |group: &str, state: &Path, extra: &[&str]| -> TestResult<Output> {
        let mut c = replayguard();
        c.arg("consume")
            .args(["--brokers", &bootstrap, "--group", group, "--topic", "in"])
            .args(["--stop-at-end", "--state"])
            .arg(state)
            .args(extra);
        run_bounded(&mut c, RUN_LIMIT)
    };
    let dir = tempfile::tempdir()?;
    let copy = || {
        run_bounded(
            &mut kafka_pipe(
                &bootstrap,
                "copy",
                &dir.path().join("pipe"),
                &["--stop-at-end"],
            ),
            RUN_LIMIT,
        )
    };
    produce_integers(&bootstrap, "in", 1..=100)?;
    let first = copy()?;
    success(&first, "the first copy")?;
    produce_integers(&bootstrap, "in", 101..=200)?;
    delete_all("in")?;

    let fresh = consume("fresh", &dir.path().join("fresh"), &[])?;
    success(&fresh, "consume of an input deleted to its end")?;
    if !fresh.stdout.is_empty() {
        return Err(format!("printed {:?}", text(&fresh.stdout)).into());
    }
    let again = copy()?;
    success(&again, "the copy after the deletion")?;
    expect_contains(&text(&again.stderr), "offset reset")?;

    produce_integers(&bootstrap, "in", 201..=250)?;
    let latest = consume(
        "latest",
        &dir.path().join("latest"),
        &["-X", "auto.offset.reset=latest"],
    )?;
    success(&latest, "consume from the end")?;
    // Told to start nowhere on its own, a fresh group stops and says so.
    let nowhere = consume(
        "nowhere",
        &dir.path().join("nowhere"),
        &["-X", "auto.offset.reset=error"],
    )?;
    expect_contains(&one_error_line(&nowhere, 1)?, "set auto.offset.reset to")?;
    if !latest.stdout.is_empty() {
        return Err(format!("printed {:?}", text(&latest.stdout)).into());
    }
    // The end it started at is its position: the next run, reset to the
    // end again, reads what was written since (it read nothing, and the
    // group had no offset to keep, so it once skipped them).
    produce_integers(&bootstrap, "in", 251..=260)?;
    let next = consume(
        "latest",
        &dir.path().join("latest"),
        &["-X", "auto.offset.reset=latest", "--format", "%s\n"],
    )?;
    success(&next, "consume from where the last run began")?;
    let printed: Vec<u64> = text(&next.stdout)
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    check_each_once(&printed, 251..=260)?;
    let last = copy()?;
    success(&last, "the copy of the records written after the deletion")?;
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&values, (1..=100).chain(201..=260))
}

/// Partitions added to the output while a pipeline runs hold outputs too:
/// an instance built before they were added, taking over the partitions of
/// one killed before its first checkpoint, reconciles them as well. Before,
/// its reconciliation read the partitions the output had when it was
/// built, missed what the killed instance wrote to the new ones, and wrote
/// those again.
#[test]
fn a_pipe_taking_over_reconciles_output_partitions_added_since_it_began() -> TestResult {
    // Of eight input partitions the second instance takes four, so at
    // least two it copies either to an added partition of the same number
    // or by key over all four.
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 8), ("out", 2)])?;
    let bootstrap = broker.bootstrap();
    let dir = tempfile::tempdir()?;
    let long = ["--checkpoint-interval", "1h"];
    let copied = |n: usize| {
        wait_until("the copies", RUN_LIMIT, || {
            let mut seen = BTreeSet::new();
            seen.extend(integers(&read_topic(
                &bootstrap,
                "out",
                PyClient::Confluent,
            )?)?);
            Ok(seen.len() >= n)
        })
    };
    let (mut first, first_log) = spawn_logged(&mut kafka_pipe(
        &bootstrap,
        "grow",
        &dir.path().join("first"),
        &long,
    ))?;
    let run = (|| -> TestResult<u64> {
        produce_integers(&bootstrap, "in", 1..=20)?;
        copied(20)?;
        broker.add_partitions("out", 4)?;
        // Built now, the second knows all four output partitions; the
        // first's producer keeps to two until it refreshes its metadata.
        let (mut second, _second_log) = spawn_logged(&mut kafka_pipe(
            &bootstrap,
            "grow",
            &dir.path().join("second"),
            &long,
        ))?;
        let mut written = 20;
        let started = Instant::now();
        while end_offsets(&bootstrap, "out")?
            .range(2..)
            .map(|(_, n)| n)
            .sum::<i64>()
            == 0
        {
            if started.elapsed() > RUN_LIMIT {
                let _ = second.kill();
                return Err("the second instance wrote to no added partition".into());
            }
            produce_integers(&bootstrap, "in", written + 1..=written + 20)?;
            written += 20;
            copied(written as usize)?;
        }
        // Killed before its first checkpoint: the first takes its input
        // partitions over, waits for its outputs in flight and reconciles.
        second.kill()?;
        second.wait()?;
        produce_integers(&bootstrap, "in", written + 1..=written + 40)?;
        written += 40;
        copied(written as usize)?;
        Ok(written)
    })();
    let (status, stderr) = terminate(&mut first, first_log)?;
    let written = run?;
    if !status?.success() {
        return Err(format!("the first instance did not exit 0 on SIGTERM: {stderr}").into());
    }
    let values = integers(&read_topic(&bootstrap, "out", PyClient::Confluent)?)?;
    check_each_once(&values, 1..=written)
}

/// An input that gains partitions while `consume --changelog` runs, and
/// then twice while it is stopped for a moment.
///
/// - The changelog keeps input partition p in its partition p, so the
///   guard grows it each time: at the new partition's arrival, and at the
///   next start. (It stopped, saying "cannot read its watermarks (was it
///   deleted?)", at the first growth, and refused to start at the
///   others.)
/// - A static member restarted within its session timeout gets its old
///   assignment back, without the partition added meanwhile; the guard
///   sees the partition assigned to no member and rejoins. (Before, the
///   run read on without it, and `--stop-at-end` ended without it.)
#[test]
fn an_input_growing_past_its_changelog_grows_it_and_reads_on() -> TestResult {
    let broker = replayguard_testkit::KafkaBroker::start(&[("in", 2)])?;
    let bootstrap = broker.bootstrap();
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let reading = |extra: &[&str]| {
        let mut c = replayguard();
        c.arg("consume")
            .args(["--brokers", &bootstrap, "--group", "g", "--topic", "in"])
            .args(["--changelog", "identities", "--format", "%s\n"])
            .args(["--checkpoint-interval", "200ms"])
            .args(["-X", "topic.metadata.refresh.interval.ms=1000"])
            .arg("--state")
            .arg(&state)
            .args(extra);
        c
    };
    let committed = || {
        // The group's coordinator may not answer yet (NOT_COORDINATOR).
        committed_offsets(&bootstrap, "in", "g", PyClient::Confluent)
            .map(|offsets| offsets.values().flatten().sum::<i64>())
            .unwrap_or(0)
    };
    // A run in the background, printing into `printed`, until it has
    // read `n` records (and `then` was done meanwhile); then SIGTERM.
    let run_until = |printed: &Path, n: i64, then: &dyn Fn() -> TestResult| -> TestResult {
        let mut child = reading(&[])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(printed)?)
            .stderr(Stdio::piped())
            .spawn()?;
        let stream = child.stderr.take().ok_or("no stderr")?;
        let log = thread::spawn(move || std::io::read_to_string(stream).unwrap_or_default());
        let read = then().and_then(|()| {
            wait_until("the run read its input", RUN_LIMIT, || Ok(committed() >= n))
        });
        let (status, stderr) = terminate(&mut child, log)?;
        read.map_err(|e| format!("{e}; its stderr:\n{stderr}"))?;
        if !status?.success() || stderr.contains("ERROR") {
            return Err(format!("the run did not end cleanly: {stderr}").into());
        }
        Ok(())
    };
    produce_integers(&bootstrap, "in", 1..=20)?;
    let first = dir.path().join("first.txt");
    run_until(&first, 60, &|| {
        wait_until("the first run committed its reading", RUN_LIMIT, || {
            Ok(committed() >= 20)
        })?;
        broker.add_partitions("in", 3)?;
        produce_integers(&bootstrap, "in", 21..=60).map(drop)
    })?;
    broker.add_partitions("in", 4)?;
    produce_integers(&bootstrap, "in", 61..=80)?;
    let second = dir.path().join("second.txt");
    run_until(&second, 80, &|| Ok(()))?;
    broker.add_partitions("in", 5)?;
    produce_integers(&bootstrap, "in", 81..=100)?;
    let third = run_bounded(&mut reading(&["--stop-at-end"]), RUN_LIMIT)?;
    success(&third, "the run after the input grew while it was stopped")?;
    let changelog = end_offsets(&bootstrap, "identities")?;
    if changelog.len() != 5 {
        return Err(format!("the changelog has partitions {changelog:?}, not 5").into());
    }
    let mut values = Vec::new();
    for out in [
        std::fs::read_to_string(&first)?,
        std::fs::read_to_string(&second)?,
        text(&third.stdout),
    ] {
        for line in out.lines() {
            values.push(line.parse::<u64>()?);
        }
    }
    check_each_once(&values, 1..=100)
}
