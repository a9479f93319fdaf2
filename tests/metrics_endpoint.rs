//! `--metrics-addr`: `replayguard pipe` against the mock broker process,
//! scraped over HTTP while records flow. Its counters move and agree with
//! the output read back by an independent client; partitions whose claim
//! the broker refuses show as held; `/health` answers 200
//! while it checkpoints and 503, with the reason, once its state disk
//! fails; a busy or bad address is a usage error before any broker is
//! contacted.
//!
//! The disk failure is the store's `store-write` fault point (feature
//! `fault-injection`), armed by a file the test creates once the run is
//! healthy.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use replayguard_testkit::{
    MockBroker, Proc, PyClient, TestResult, check_each_once, free_port, integers, produce_integers,
    read_topic, run_bounded, send_signal,
};

/// How long a condition may take to come true (the mock's first group
/// join takes about 3 s).
const LIMIT: Duration = Duration::from_secs(90);

fn replayguard() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.env_remove("RUST_LOG").env_remove("RUST_BACKTRACE");
    c.env_remove("REPLAYGUARD_FAIL_AT");
    c
}

/// `pipe` from `in` to `out`, serving on `port`, plus `extra`.
fn pipe(broker: &MockBroker, state: &Path, port: u16, extra: &[&str]) -> Command {
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", broker.bootstrap(), "--group", "metrics"])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(state)
        .args(["-X", "session.timeout.ms=6000"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .args(extra)
        .stdout(Stdio::null());
    c
}

/// `pipe` started with its state in `dir/name` and its log in
/// `dir/name.log`.
fn spawn_pipe(
    broker: &MockBroker,
    dir: &Path,
    name: &str,
    port: u16,
    extra: &[&str],
) -> TestResult<Proc> {
    Proc::spawn(
        name.into(),
        &mut pipe(broker, &dir.join(name), port, extra),
        dir.join(format!("{name}.log")),
    )
}

/// SIGTERM, then a clean exit within [`LIMIT`].
fn stop_cleanly(proc: &mut Proc) -> TestResult {
    send_signal(proc.child.id(), "TERM")?;
    let status = proc.wait(LIMIT)?;
    assert!(status.success(), "{status}; stderr:\n{}", proc.log_tail());
    Ok(())
}

/// An HTTP client that hands back 4xx and 5xx answers as answers.
fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// GET `path` on `port`: status and body.
fn get(agent: &ureq::Agent, port: u16, path: &str) -> TestResult<(u16, String)> {
    let mut answer = agent
        .get(&format!("http://127.0.0.1:{port}{path}"))
        .call()?;
    let status = answer.status().as_u16();
    Ok((status, answer.body_mut().read_to_string()?))
}

/// The samples of a Prometheus text exposition: series (name and labels,
/// as written) to value.
fn samples(text: &str) -> TestResult<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .ok_or_else(|| format!("not a sample line: {line:?}"))?;
        let value: f64 = value
            .parse()
            .map_err(|e| format!("bad value in {line:?}: {e}"))?;
        out.insert(series.to_owned(), value);
    }
    Ok(out)
}

/// Scrapes `/metrics` until `done` holds for its samples; returns them.
fn scrape_until(
    agent: &ureq::Agent,
    proc: &mut Proc,
    port: u16,
    what: &str,
    done: impl Fn(&BTreeMap<String, f64>) -> bool,
) -> TestResult<BTreeMap<String, f64>> {
    let deadline = Instant::now() + LIMIT;
    let mut last = BTreeMap::new();
    while Instant::now() < deadline {
        proc.check_running()?;
        // Refused until the endpoint is up; it is up before the brokers
        // are contacted, so not for long.
        if let Ok((200, body)) = get(agent, port, "/metrics") {
            last = samples(&body)?;
            if done(&last) {
                return Ok(last);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!(
        "{what}: not seen within {LIMIT:?}; last scrape {last:?}; stderr:\n{}",
        proc.log_tail()
    )
    .into())
}

/// Asks `/health` until `done` holds for its answer; returns it.
fn health_until(
    agent: &ureq::Agent,
    proc: &mut Proc,
    port: u16,
    what: &str,
    done: impl Fn(u16, &str) -> bool,
) -> TestResult<(u16, String)> {
    let deadline = Instant::now() + LIMIT;
    let mut last = None;
    while Instant::now() < deadline {
        proc.check_running()?;
        if let Ok((status, body)) = get(agent, port, "/health") {
            if done(status, &body) {
                return Ok((status, body));
            }
            last = Some((status, body));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(format!(
        "{what}: not seen within {LIMIT:?}; last /health {last:?}; stderr:\n{}",
        proc.log_tail()
    )
    .into())
}

fn value(s: &BTreeMap<String, f64>, series: &str) -> f64 {
    s.get(series).copied().unwrap_or(-1.0)
}

/// The sum over the series of `name` (any labels).
fn total(s: &BTreeMap<String, f64>, name: &str) -> f64 {
    s.iter()
        .filter(|(k, _)| k.as_str() == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn counters_move_and_agree_with_the_output_read_back() -> TestResult {
    let broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    produce_integers(broker.bootstrap(), "in", 1..=500)?;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    // Every sealed epoch's hashes on disk, and all of them live.
    let mut proc = spawn_pipe(
        &broker,
        dir.path(),
        "pipe",
        port,
        &["--max-memory", "0", "--retention-time", "1h"],
    )?;
    let agent = client();

    let first = scrape_until(&agent, &mut proc, port, "the first 500", |s| {
        value(s, "replayguard_outputs_total") >= 500.0
    })?;
    assert_eq!(value(&first, "replayguard_records_in_total"), 500.0);
    assert_eq!(value(&first, "replayguard_outputs_total"), 500.0);

    // More input while it runs: the counters move on from where they were.
    produce_integers(broker.bootstrap(), "in", 501..=1000)?;
    let s = scrape_until(&agent, &mut proc, port, "all 1000, lag 0", |s| {
        value(s, "replayguard_outputs_total") >= 1000.0
            && total(s, "replayguard_consumer_lag") == 0.0
            && value(s, "replayguard_checkpoints_total")
                > value(&first, "replayguard_checkpoints_total")
            // The state gauges are as of the last checkpoint: one that
            // came after the second 500.
            && value(s, "replayguard_live_fingerprints") == 1000.0
    })?;
    // The split between memory and disk: the first 500 were sealed by a
    // checkpoint since, so their hashes are on disk behind a filter.
    let on_disk = value(&s, "replayguard_disk_fingerprints");
    assert!((500.0..=1000.0).contains(&on_disk), "{s:?}");
    assert!(
        value(&s, "replayguard_state_disk_filter_bytes") > 0.0,
        "{s:?}"
    );
    assert!(
        value(&s, "replayguard_state_disk_index_bytes") > 0.0,
        "{s:?}"
    );
    assert!(value(&s, "replayguard_disk_reads_total") >= 0.0, "{s:?}");
    assert_eq!(value(&s, "replayguard_records_in_total"), 1000.0);
    assert_eq!(value(&s, "replayguard_outputs_total"), 1000.0);
    assert_eq!(total(&s, "replayguard_duplicates_total"), 0.0);
    // Both input partitions have a lag series, and it is 0 at the end.
    for p in 0..2 {
        let series = format!("replayguard_consumer_lag{{topic=\"in\",partition=\"{p}\"}}");
        assert_eq!(value(&s, &series), 0.0, "{series} in {s:?}");
    }
    assert!(value(&s, "replayguard_state_disk_bytes") > 0.0, "{s:?}");
    assert!(value(&s, "replayguard_live_epochs") >= 1.0, "{s:?}");
    // Both input partitions assigned to the one member, neither held.
    assert_eq!(value(&s, "replayguard_assigned_partitions"), 2.0, "{s:?}");
    assert_eq!(value(&s, "replayguard_held_partitions"), 0.0, "{s:?}");
    assert!(
        value(&s, "replayguard_checkpoint_seconds_count") >= 1.0,
        "{s:?}"
    );
    assert!(
        value(&s, "replayguard_recovery_seconds_count") >= 1.0,
        "{s:?}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    let at = value(&s, "replayguard_last_checkpoint_timestamp_seconds");
    assert!(
        at > 0.0 && at <= now + 1.0,
        "last checkpoint at {at}, now {now}"
    );

    let (status, body) = get(&agent, port, "/health")?;
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ok"), "{body}");
    let (status, _) = get(&agent, port, "/nothing-here")?;
    assert_eq!(status, 404);

    // What the counters say is what an independent reader finds.
    let got = integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?;
    check_each_once(&got, 1..=1000)?;
    assert_eq!(got.len() as f64, value(&s, "replayguard_outputs_total"));

    // A second member joins: one partition moves to it and the first
    // member's gauge follows the revoke; when it leaves, the partition
    // comes back.
    let second_port = free_port()?;
    let mut second = spawn_pipe(&broker, dir.path(), "second", second_port, &[])?;
    scrape_until(
        &agent,
        &mut second,
        second_port,
        "one partition for the second member",
        |s| value(s, "replayguard_assigned_partitions") == 1.0,
    )?;
    scrape_until(
        &agent,
        &mut proc,
        port,
        "one partition left to the first member",
        |s| value(s, "replayguard_assigned_partitions") == 1.0,
    )?;
    stop_cleanly(&mut second)?;
    scrape_until(
        &agent,
        &mut proc,
        port,
        "both partitions back with the first member",
        |s| {
            value(s, "replayguard_assigned_partitions") == 2.0
                && value(s, "replayguard_held_partitions") == 0.0
        },
    )?;
    let got = integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?;
    check_each_once(&got, 1..=1000)?;

    stop_cleanly(&mut proc)?;
    Ok(())
}

/// Partitions whose claim the broker refuses are assigned but held, with
/// nothing written: the two partition gauges tell them from partitions
/// being copied and from a member given none, and turn back once a claim
/// is taken.
#[test]
fn held_partitions_show_while_the_broker_refuses_their_claim() -> TestResult {
    let mut broker = MockBroker::start(&[("in", 2), ("out", 2)])?;
    produce_integers(broker.bootstrap(), "in", 1..=100)?;
    // Tried again after 0.1, 0.2, 0.4, 0.8, 1.6 and then every 2 s: the
    // partitions stay held for about 9 s.
    broker.refuse_commits(8)?;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let mut proc = spawn_pipe(&broker, dir.path(), "pipe", port, &[])?;
    let agent = client();

    let before = scrape_until(&agent, &mut proc, port, "the endpoint", |_| true)?;
    for gauge in [
        "replayguard_assigned_partitions",
        "replayguard_held_partitions",
    ] {
        assert!(
            [0.0, 2.0].contains(&value(&before, gauge)),
            "{gauge} registered from the start: {before:?}"
        );
    }
    let held = scrape_until(&agent, &mut proc, port, "both partitions held", |s| {
        value(s, "replayguard_held_partitions") == 2.0
    })?;
    assert_eq!(
        value(&held, "replayguard_assigned_partitions"),
        2.0,
        "{held:?}"
    );
    assert!(
        value(&held, "replayguard_claims_refused_total") >= 1.0,
        "{held:?}"
    );
    assert_eq!(value(&held, "replayguard_outputs_total"), 0.0, "{held:?}");

    let s = scrape_until(&agent, &mut proc, port, "claimed and copied", |s| {
        value(s, "replayguard_held_partitions") == 0.0
            && value(s, "replayguard_outputs_total") >= 100.0
    })?;
    assert_eq!(value(&s, "replayguard_assigned_partitions"), 2.0, "{s:?}");
    assert_eq!(value(&s, "replayguard_claims_refused_total"), 8.0, "{s:?}");
    let got = integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?;
    check_each_once(&got, 1..=100)?;

    stop_cleanly(&mut proc)?;
    Ok(())
}

#[test]
fn health_turns_503_with_the_reason_when_the_state_disk_fails() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=100)?;
    let dir = tempfile::tempdir()?;
    let armed = dir.path().join("fail-now");
    let port = free_port()?;
    let mut command = pipe(
        &broker,
        &dir.path().join("state"),
        port,
        &["--metrics-linger", "5m"],
    );
    command
        .env("REPLAYGUARD_FAIL_AT", "store-write")
        .env("REPLAYGUARD_FAIL_ARMED", &armed);
    let mut proc = Proc::spawn("pipe".into(), &mut command, dir.path().join("pipe.log"))?;
    let agent = client();

    scrape_until(&agent, &mut proc, port, "the 100 inputs", |s| {
        value(s, "replayguard_outputs_total") >= 100.0
            && value(s, "replayguard_checkpoints_total") >= 1.0
    })?;
    let (status, body) = get(&agent, port, "/health")?;
    assert_eq!(status, 200, "healthy before the failure: {body}");

    // The disk fails: the next write (a checkpoint, at the latest) poisons
    // the guard and the run stops; the endpoint stays for the linger.
    std::fs::write(&armed, b"")?;
    produce_integers(broker.bootstrap(), "in", 101..=110)?;
    let (status, body) = health_until(&agent, &mut proc, port, "503", |status, _| status != 200)?;
    assert_eq!(status, 503, "{body}");
    assert!(body.starts_with("failed"), "{body}");
    assert!(body.contains("injected failure"), "the reason: {body}");
    // The metrics are still served meanwhile.
    let (status, metrics) = get(&agent, port, "/metrics")?;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("replayguard_records_in_total"),
        "{metrics}"
    );

    // A signal ends the linger; the run failed, so the status is 1.
    send_signal(proc.child.id(), "TERM")?;
    let status = proc.wait(LIMIT)?;
    assert_eq!(status.code(), Some(1), "stderr:\n{}", proc.log_tail());
    let log = std::fs::read_to_string(&proc.log)?;
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("replayguard: error: ") && last.contains("injected failure"),
        "{log}"
    );
    Ok(())
}

/// A bad or busy --metrics-addr stops the command at once with status 2 and
/// one error line naming the flag, before any broker is contacted: the
/// brokers given do not exist, and the error is not about them.
#[test]
fn a_busy_or_bad_metrics_address_is_a_usage_error() -> TestResult {
    let busy = TcpListener::bind("127.0.0.1:0")?;
    let busy = busy.local_addr()?.to_string();
    let dir = tempfile::tempdir()?;
    for (addr, why) in [
        (busy.as_str(), "cannot listen there"),
        ("no-port-here", "not a HOST:PORT address"),
        ("127.0.0.1:99999", "not a HOST:PORT address"),
    ] {
        let mut c = replayguard();
        c.arg("pipe")
            .args(["--brokers", "127.0.0.1:1", "--group", "g"])
            .args(["--input", "in", "--output", "out", "--state"])
            .arg(dir.path().join("state"))
            .args(["--metrics-addr", addr]);
        let out = run_bounded(&mut c, Duration::from_secs(60))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{addr}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{addr}: one line: {stderr}");
        assert!(
            lines[0].starts_with(&format!("replayguard: error: --metrics-addr {addr}: {why}")),
            "{addr}: {stderr}"
        );
    }
    Ok(())
}

/// `--log-format json`: every stderr line is one JSON object, the final
/// error line too, with its error kind.
#[test]
fn json_logs_are_one_object_a_line() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut c = replayguard();
    c.arg("pipe")
        .args(["--brokers", "127.0.0.1:1", "--group", "g"])
        .args(["--input", "in", "--output", "out", "--state"])
        .arg(dir.path().join("state"))
        .args(["--connect-attempts", "1", "--log-format", "json"]);
    let out = run_bounded(&mut c, Duration::from_secs(60))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let mut last = None;
    for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("not JSON ({e}): {line:?}"))?;
        assert!(v.get("level").is_some(), "{line}");
        last = Some(v);
    }
    let last = last.ok_or("no stderr at all")?;
    assert_eq!(last["level"], "ERROR", "{last}");
    assert_eq!(last["error_kind"], "unreachable", "{last}");
    assert_eq!(last["exit_status"], 1, "{last}");
    assert!(
        last["message"]
            .as_str()
            .is_some_and(|m| m.contains("no broker reachable")),
        "{last}"
    );
    Ok(())
}

/// `consume` serves the same endpoint: its counters and lag, and health.
#[test]
fn consume_serves_metrics_and_health_too() -> TestResult {
    let broker = MockBroker::start(&[("events", 1)])?;
    produce_integers(broker.bootstrap(), "events", 1..=300)?;
    // The same 50 values again, at new offsets: resends it filters.
    produce_integers(broker.bootstrap(), "events", 1..=50)?;
    let dir = tempfile::tempdir()?;
    let port = free_port()?;
    let mut c = replayguard();
    c.arg("consume")
        .args(["--brokers", broker.bootstrap(), "--group", "reader"])
        .args(["--topic", "events", "--state"])
        .arg(dir.path().join("state"))
        .args(["-X", "session.timeout.ms=6000"])
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null());
    let mut proc = Proc::spawn("consume".into(), &mut c, dir.path().join("consume.log"))?;
    let agent = client();
    let s = scrape_until(&agent, &mut proc, port, "all 350, lag 0", |s| {
        value(s, "replayguard_records_in_total") >= 350.0
            && value(
                s,
                "replayguard_consumer_lag{topic=\"events\",partition=\"0\"}",
            ) == 0.0
    })?;
    assert_eq!(value(&s, "replayguard_records_in_total"), 350.0);
    assert_eq!(
        value(&s, "replayguard_duplicates_total{reason=\"content\"}"),
        50.0,
        "{s:?}"
    );
    assert_eq!(
        value(&s, "replayguard_duplicates_total{reason=\"position\"}"),
        0.0,
        "{s:?}"
    );
    health_until(&agent, &mut proc, port, "200", |status, body| {
        status == 200 && body.starts_with("ok")
    })?;
    stop_cleanly(&mut proc)?;
    Ok(())
}
