//! Apache Kafka with SASL/SCRAM over TLS on loopback, certificates made at
//! test time: `replayguard pipe` and `consume` with the matching `-X`
//! settings copy and read a topic; wrong credentials, and a principal
//! without READ on the input, each end the run with one clear error line
//! and status 1, within a bounded time and without a retry loop. The copy
//! is read back by Kafka's own console consumer.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use replayguard_testkit::{
    KafkaBroker, KafkaOptions, TestResult, WriteOptions, check_each_once, run_bounded, write_with,
};

const RECORDS: u64 = 200;

fn broker() -> TestResult<KafkaBroker> {
    let broker = KafkaBroker::start_with(
        KafkaOptions {
            sasl_users: vec![
                ("admin".into(), "admin-secret".into()),
                ("intruder".into(), "intruder-secret".into()),
            ],
            acl: true,
            ..KafkaOptions::default()
        },
        &[("in", 2), ("out", 2)],
    )?;
    write_with(
        &broker.bootstrap(),
        "in",
        1,
        RECORDS,
        &WriteOptions {
            properties: broker.security_properties(),
            ..WriteOptions::default()
        },
    )?;
    Ok(broker)
}

/// Runs `replayguard ARGS` with the security settings of `user`.
fn run(broker: &KafkaBroker, args: &[&str], user: &str, password: &str) -> TestResult<Output> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_replayguard"));
    c.args(args)
        .args(["--brokers", &broker.bootstrap()])
        .stdin(Stdio::null());
    for (k, v) in broker.security_properties_as(user, password) {
        c.arg("-X").arg(format!("{k}={v}"));
    }
    run_bounded(&mut c, Duration::from_secs(120))
}

/// Lets `User:intruder` do each of `acls` (AclCommand's arguments after
/// the principal: an operation and a resource).
fn grant(broker: &KafkaBroker, acls: &[&[&str]]) -> TestResult {
    for acl in acls {
        let mut args = vec!["--add", "--allow-principal", "User:intruder"];
        args.extend_from_slice(acl);
        broker.acl(&args)?;
    }
    Ok(())
}

/// Checks that a run ended with status 1 and one error line holding each
/// of `needles`.
fn refused_with(out: &Output, needles: &[&str]) {
    let line = error_line(out);
    println!("refused: {line}");
    assert_eq!(out.status.code(), Some(1), "{line}");
    assert_eq!(line.lines().count(), 1, "more than one error line");
    for needle in needles {
        assert!(line.contains(needle), "no {needle:?} in: {line}");
    }
}

fn error_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with("replayguard: error: "))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn over_sasl_scram_and_tls_pipe_copies_and_consume_reads_each_record_once() -> TestResult {
    let broker = broker()?;
    let state = tempfile::tempdir()?;
    let pipe_state = state.path().join("pipe").display().to_string();
    let out = run(
        &broker,
        &[
            "pipe",
            "--group",
            "copy",
            "--input",
            "in",
            "--output",
            "out",
            "--stop-at-end",
            "--state",
            &pipe_state,
        ],
        "admin",
        "admin-secret",
    )?;
    assert!(out.status.success(), "pipe failed: {}", error_line(&out));
    let copied: Vec<u64> = broker
        .console_read("out", false, Some(RECORDS), Duration::from_secs(15))?
        .into_iter()
        .map(|(_, v)| v.parse::<u64>())
        .collect::<Result<_, _>>()?;
    check_each_once(&copied, 1..=RECORDS)?;
    let consume_state = state.path().join("consume").display().to_string();
    let out = run(
        &broker,
        &[
            "consume",
            "--group",
            "read",
            "--topic",
            "in",
            "--stop-at-end",
            "--state",
            &consume_state,
        ],
        "admin",
        "admin-secret",
    )?;
    assert!(out.status.success(), "consume failed: {}", error_line(&out));
    let printed: Vec<u64> = String::from_utf8(out.stdout)?
        .lines()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    check_each_once(&printed, 1..=RECORDS)?;
    Ok(())
}

#[test]
fn wrong_credentials_end_the_run_with_a_clear_error_and_status_1() -> TestResult {
    let broker = broker()?;
    let state = tempfile::tempdir()?;
    for command in ["pipe", "consume"] {
        let started = Instant::now();
        let mut args = vec![command, "--group", "copy", "--stop-at-end", "--state"];
        let path = state.path().join(command).display().to_string();
        args.push(&path);
        if command == "pipe" {
            args.extend(["--input", "in", "--output", "out"]);
        } else {
            args.extend(["--topic", "in"]);
        }
        let out = run(&broker, &args, "admin", "not-the-password")?;
        let line = error_line(&out);
        println!("{command}: {line} (after {:?})", started.elapsed());
        assert_eq!(out.status.code(), Some(1), "{command}: {line}");
        assert!(
            line.contains("refuse the credentials") && line.contains("SASL authentication"),
            "{command}: the error does not say that the credentials were refused: {line}"
        );
        // Not the ten metadata probes (about 35 s) of an unreachable broker.
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{command} took {:?}",
            started.elapsed()
        );
    }
    Ok(())
}

#[test]
fn a_principal_without_read_on_the_input_stops_at_once_with_status_1() -> TestResult {
    let broker = broker()?;
    // It may see the input and use its group and the output, but not read
    // the input: the metadata probe passes; the first fetch is refused, or
    // for `pipe` first the claim of the input's partitions, a commit.
    grant(
        &broker,
        &[
            &["--operation", "DESCRIBE", "--topic", "in"][..],
            &["--operation", "READ", "--group", "intruders"],
            &["--operation", "ALL", "--topic", "out"],
        ],
    )?;
    let state = tempfile::tempdir()?;
    for command in ["pipe", "consume"] {
        let started = Instant::now();
        let path = state.path().join(command).display().to_string();
        let mut args = vec![command, "--group", "intruders", "--state", &path];
        if command == "pipe" {
            args.extend(["--input", "in", "--output", "out"]);
        } else {
            args.extend(["--topic", "in"]);
        }
        // No --stop-at-end: only the error may end the run.
        let out = run(&broker, &args, "intruder", "intruder-secret")?;
        let line = error_line(&out);
        println!("{command}: {line} (after {:?})", started.elapsed());
        assert_eq!(out.status.code(), Some(1), "{command}: {line}");
        assert!(
            line.contains("TopicAuthorizationFailed")
                && line.contains("in[")
                && line.contains("grant"),
            "{command}: the error does not name the refusal and the partitions: {line}"
        );
        assert_eq!(
            line.lines().count(),
            1,
            "{command}: more than one error line"
        );
        assert!(
            out.stdout.is_empty(),
            "{command} printed records it may not read"
        );
    }
    Ok(())
}

/// Before, the run ended on "Purged in queue" or "Fatal error" with
/// nothing about the refusal behind it: an idempotent producer's id is
/// refused to a principal that may write no topic, a fatal error of
/// librdkafka's, and the outputs it purges say only that they were purged.
#[test]
fn a_principal_without_write_on_the_output_is_told_to_grant_it_and_then_copies_each_record_once()
-> TestResult {
    let broker = broker()?;
    // Everything a copy needs but the right to write the output.
    grant(
        &broker,
        &[
            &["--operation", "READ", "--topic", "in"][..],
            &["--operation", "READ", "--group", "intruders"],
            &["--operation", "READ", "--topic", "out"],
        ],
    )?;
    let state = tempfile::tempdir()?;
    let path = state.path().display().to_string();
    let args = [
        "pipe",
        "--group",
        "intruders",
        "--state",
        &path,
        "--input",
        "in",
        "--output",
        "out",
        "--stop-at-end",
    ];
    let out = run(&broker, &args, "intruder", "intruder-secret")?;
    refused_with(
        &out,
        &[
            "the output producer failed for good",
            "Cluster authorization failed",
            "grant its principal WRITE on the output topic",
        ],
    );

    broker.acl(&[
        "--add",
        "--allow-principal",
        "User:intruder",
        "--operation",
        "WRITE",
        "--topic",
        "out",
    ])?;
    let out = run(&broker, &args, "intruder", "intruder-secret")?;
    assert!(out.status.success(), "with WRITE: {}", error_line(&out));
    let copied: Vec<u64> = broker
        .console_read("out", false, Some(RECORDS), Duration::from_secs(15))?
        .into_iter()
        .map(|(_, v)| v.parse::<u64>())
        .collect::<Result<_, _>>()?;
    check_each_once(&copied, 1..=RECORDS)
}

/// As above for `consume` with a changelog, whose producer is the only
/// one: the error names the refusal and the changelog, and once WRITE is
/// granted the next run ships the identities; each record is printed
/// once over both runs.
#[test]
fn consume_without_write_on_its_changelog_is_told_to_grant_it() -> TestResult {
    let broker = broker()?;
    grant(
        &broker,
        &[
            &["--operation", "READ", "--topic", "in"][..],
            &["--operation", "READ", "--group", "intruders"],
            &["--operation", "CREATE", "--topic", "audit-changelog"],
            &["--operation", "READ", "--topic", "audit-changelog"],
            &[
                "--operation",
                "DescribeConfigs",
                "--topic",
                "audit-changelog",
            ],
        ],
    )?;
    let state = tempfile::tempdir()?;
    let path = state.path().display().to_string();
    let args = [
        "consume",
        "--group",
        "intruders",
        "--state",
        &path,
        "--topic",
        "in",
        "--changelog",
        "audit-changelog",
        "--stop-at-end",
    ];
    let first = run(&broker, &args, "intruder", "intruder-secret")?;
    refused_with(
        &first,
        &[
            "changelog topic audit-changelog",
            "its producer failed for good",
            "Cluster authorization failed",
            "grant this client's principal WRITE on the changelog topic",
        ],
    );

    broker.acl(&[
        "--add",
        "--allow-principal",
        "User:intruder",
        "--operation",
        "WRITE",
        "--topic",
        "audit-changelog",
    ])?;
    let second = run(&broker, &args, "intruder", "intruder-secret")?;
    assert!(
        second.status.success(),
        "with WRITE: {}",
        error_line(&second)
    );
    let printed: Vec<u64> = String::from_utf8(first.stdout)?
        .lines()
        .chain(String::from_utf8(second.stdout)?.lines())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    check_each_once(&printed, 1..=RECORDS)
}
