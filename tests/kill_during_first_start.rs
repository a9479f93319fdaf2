//! A `kill -9` during the very first start of `replayguard pipe`, while it
//! creates its state folder, must leave a folder that the next start
//! accepts (G1: any number of kills and restarts; G5: only a foreign folder
//! is refused).
//!
//! The store writes its marker as `REPLAYGUARD.tmp`, fsyncs it, then renames
//! it to `REPLAYGUARD`. A kill between the create and the rename leaves a
//! folder that holds only an empty `REPLAYGUARD.tmp`; killing fresh starts
//! 40 to 75 ms in, 6 of 150 kills left exactly that.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

use rand::Rng;
use replayguard_testkit::{
    MockBroker, PyClient, TestResult, check_each_once, integers, produce_integers, read_topic,
    run_bounded, wait_bounded,
};

/// `pipe` from `in` to `output` in group `output`, plus `extra`.
fn pipe(brokers: &str, output: &str, state: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.env_remove("RUST_LOG")
        .arg("pipe")
        .args(["--brokers", brokers, "--group", output])
        .args(["--input", "in", "--output", output, "--state"])
        .arg(state)
        .args(["-X", "session.timeout.ms=6000"])
        .args(extra);
    c
}

/// The file names in `dir`, sorted; `None` when it does not exist.
fn leftovers(dir: &Path) -> TestResult<Option<Vec<String>>> {
    if !dir.exists() {
        return Ok(None);
    }
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        names.push(entry?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(Some(names))
}

#[test]
fn a_folder_left_by_a_kill_while_the_marker_was_written_starts_and_copies_once() -> TestResult {
    let broker = MockBroker::start(&[("in", 1), ("out", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=50)?;
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    // What the kill leaves: the folder, and the marker's temporary file,
    // created but not yet written.
    std::fs::create_dir(&state)?;
    std::fs::File::create(state.join("REPLAYGUARD.tmp"))?;
    let out = run_bounded(
        &mut pipe(broker.bootstrap(), "out", &state, &["--stop-at-end"]),
        Duration::from_secs(90),
    )?;
    if !out.status.success() {
        return Err(format!(
            "the restart after a kill during the first start failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    check_each_once(
        &integers(&read_topic(broker.bootstrap(), "out", PyClient::Confluent)?)?,
        1..=50,
    )
}

#[test]
fn every_folder_left_by_a_kill_during_the_first_start_restarts_and_copies_once() -> TestResult {
    const KILLS: usize = 150;
    let mut broker = MockBroker::start(&[("in", 1)])?;
    produce_integers(broker.bootstrap(), "in", 1..=20)?;
    let dir = tempfile::tempdir()?;
    let mut rng = rand::rng();
    // Each kind of leftover once, with the job that left it.
    let mut shapes: BTreeMap<Option<Vec<String>>, (PathBuf, String)> = BTreeMap::new();
    for i in 0..KILLS {
        let state = dir.path().join(format!("s{i}"));
        // A job of its own per start, group and output alike, so that the
        // restart below resumes that job into an output nothing else wrote.
        let output = format!("out-{i}");
        broker.create_topic(&output, 1)?;
        let mut child = pipe(broker.bootstrap(), &output, &state, &[])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        // The state folder is created after the first metadata answer, some
        // tens of milliseconds in.
        thread::sleep(Duration::from_millis(rng.random_range(30..90)));
        child.kill()?;
        wait_bounded(&mut child, Duration::from_secs(10))?;
        shapes.entry(leftovers(&state)?).or_insert((state, output));
    }
    println!("folders left by {KILLS} kills: {:?}", shapes.keys());
    // Each kind of leftover restarts its own job: the restart copies the
    // input once.
    for (shape, (state, output)) in &shapes {
        let out = run_bounded(
            &mut pipe(broker.bootstrap(), output, state, &["--stop-at-end"]),
            Duration::from_secs(90),
        )?;
        if !out.status.success() {
            return Err(format!(
                "the restart over a folder left by a kill during the first start \
                 ({shape:?}) failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        check_each_once(
            &integers(&read_topic(
                broker.bootstrap(),
                output,
                PyClient::Confluent,
            )?)?,
            1..=20,
        )
        .map_err(|e| format!("{shape:?}: {e}"))?;
    }
    Ok(())
}
