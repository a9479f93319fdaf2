//! Choosing what makes two records "the same event", and how long to
//! remember it (guarantee G2 with a chosen identity and retention).
//!
//! A payment service resends payments it is unsure about, with a new
//! `sent_at` in the body, so the resend's bytes differ from the original
//! and the default identity (a hash of key and value) cannot match them.
//! Two stable identities can:
//!
//! - [`Identity::Header`]: a hash of the `event-id` header the source sets;
//! - [`Identity::Custom`]: a user function, here the payment's sequence
//!   number parsed from the body and returned as [`Fingerprint::id`]. Dense
//!   ids like these are stored in a roaring bitmap, a few bits each.
//!
//! The resends arrive after several checkpoints. With the default retention
//! (everything since the previous checkpoint) the guard has forgotten the
//! originals by then; `retention_time(10 min)` keeps them. Two more
//! consumers show what happens with the default retention, and with the
//! default identity. The example exits non-zero if either consumer with a
//! stable identity and the retention window handles a payment twice or
//! misses one.
//!
//! Runs on librdkafka's in-process mock cluster:
//! `cargo run --release --example custom_identity`.

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use replayguard::kafka::{GuardOptions, GuardedConsumer};
use replayguard::{Fingerprint, Identity, IdentityFn};
use tokio::sync::Barrier;

type Result<T = (), E = Box<dyn Error + Send + Sync>> = std::result::Result<T, E>;

const TOPIC: &str = "payments";
const PAYMENTS: u64 = 1000;
/// Payments resent, with a new `sent_at`, after `CHECKPOINTS` checkpoints.
const RESENT: std::ops::RangeInclusive<u64> = 401..=600;
const CHECKPOINTS: u32 = 5;
const RETENTION: Duration = Duration::from_secs(600);

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("custom_identity: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The payment's sequence number, from a body like
/// `{"seq":17,"cents":250,"sent_at":1}`.
fn sequence_number(_key: Option<&[u8]>, value: Option<&[u8]>) -> Option<Fingerprint> {
    let body = std::str::from_utf8(value?).ok()?;
    let rest = body.split("\"seq\":").nth(1)?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().map(Fingerprint::id)
}

struct Consumer {
    name: &'static str,
    identity: Identity,
    retention: Option<Duration>,
    /// Must handle every payment exactly once.
    checked: bool,
}

async fn run() -> Result {
    let cluster = MockCluster::new(1)?;
    cluster.create_topic(TOPIC, 2, 1)?;
    let bootstrap = cluster.bootstrap_servers();
    let consumers = [
        Consumer {
            name: "header event-id, 10 min retention",
            identity: Identity::Header("event-id".into()),
            retention: Some(RETENTION),
            checked: true,
        },
        Consumer {
            name: "business id (seq), 10 min retention",
            identity: Identity::Custom(IdentityFn::new(sequence_number)),
            retention: Some(RETENTION),
            checked: true,
        },
        Consumer {
            name: "header event-id, default retention",
            identity: Identity::Header("event-id".into()),
            retention: None,
            checked: false,
        },
        Consumer {
            name: "key and value (default), 10 min",
            identity: Identity::Content,
            retention: Some(RETENTION),
            checked: false,
        },
    ];
    // The producer and every consumer meet here twice: once the originals
    // are handled, and once the resends are written.
    let barrier = Arc::new(Barrier::new(consumers.len() + 1));
    let mut tasks = Vec::new();
    for (i, c) in consumers.into_iter().enumerate() {
        let (bootstrap, barrier) = (bootstrap.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let r = consume(&bootstrap, &format!("ledger-{i}"), &c, &barrier).await;
            (c, r)
        }));
    }
    write_payments(&bootstrap, 1..=PAYMENTS, 1).await?;
    barrier.wait().await;
    write_payments(&bootstrap, RESENT, 2).await?;
    barrier.wait().await;

    println!(
        "{PAYMENTS} payments written to {TOPIC:?}; after {CHECKPOINTS} checkpoints, {} were resent\n\
         with a new sent_at (same event-id header, same seq, different bytes).\n",
        RESENT.count()
    );
    println!(
        "{:<38}{:>9}{:>9}{:>9}{:>9}{:>12}",
        "consumer identity", "read", "handled", "twice", "missing", "filtered"
    );
    let mut failures = Vec::new();
    for t in tasks {
        let (c, r) = t.await?;
        let out = r?;
        let twice = out.handled.values().filter(|n| **n > 1).count();
        let missing = (1..=PAYMENTS)
            .filter(|s| !out.handled.contains_key(s))
            .count();
        println!(
            "{:<38}{:>9}{:>9}{:>9}{:>9}{:>12}",
            c.name,
            out.read,
            out.handled.values().sum::<u32>(),
            twice,
            missing,
            out.filtered
        );
        if c.checked && (twice > 0 || missing > 0) {
            failures.push(format!(
                "{}: {twice} payments handled twice, {missing} missing",
                c.name
            ));
        }
    }
    println!(
        "\nThe header and the business id name the event, so with a 10 min window every\n\
         resend was caught. The default retention keeps identities only until the next\n\
         checkpoint, and the default identity hashes the bytes, which the new sent_at\n\
         changed: either way the late resends got through."
    );
    drop(cluster);
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("not exactly once: {}", failures.join("; ")).into())
    }
}

/// What one consumer did: payments handled (by seq, with counts), records
/// read and records filtered.
struct Outcome {
    handled: BTreeMap<u64, u32>,
    read: u64,
    filtered: u64,
}

async fn consume(bootstrap: &str, group: &str, c: &Consumer, barrier: &Barrier) -> Result<Outcome> {
    let state = tempfile::tempdir()?;
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("session.timeout.ms", "6000")
        .set("auto.offset.reset", "earliest");
    let mut options = GuardOptions::default()
        .identity(c.identity.clone())
        .stop_at_end(true);
    if let Some(keep) = c.retention {
        options = options.retention_time(Some(keep));
    }
    let consumer = GuardedConsumer::builder(config, state.path())
        .topic(TOPIC)
        .options(options)
        .build()
        .await?;
    let mut handled = BTreeMap::new();
    let record_payments = async |handled: &mut BTreeMap<u64, u32>| -> Result {
        while let Some(r) = consumer.recv().await? {
            let seq = match sequence_number(None, r.message().payload()) {
                Some(Fingerprint::Id(seq)) => seq,
                _ => return Err("a payment without a seq".into()),
            };
            *handled.entry(seq).or_insert(0) += 1;
            consumer.ack(&r)?;
        }
        Ok(())
    };
    record_payments(&mut handled).await?;
    // The application runs on; here the checkpoints are taken at once
    // instead of waiting for the interval.
    for _ in 0..CHECKPOINTS {
        consumer.checkpoint().await?;
    }
    barrier.wait().await;
    barrier.wait().await;
    record_payments(&mut handled).await?;
    let stats = consumer.stats();
    std::thread::spawn(move || drop(consumer));
    Ok(Outcome {
        handled,
        read: stats.records_in,
        filtered: stats.duplicates,
    })
}

/// Writes payments with the given seqs; `sent_at` tells a resend apart.
async fn write_payments(
    bootstrap: &str,
    seqs: impl IntoIterator<Item = u64>,
    sent_at: u64,
) -> Result {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    for seq in seqs {
        let key = format!("acct-{}", seq % 37);
        let body = format!(
            "{{\"seq\":{seq},\"cents\":{},\"sent_at\":{sent_at}}}",
            100 + seq % 900
        );
        let event_id = format!("pay-{seq:06}");
        let headers = OwnedHeaders::new().insert(Header {
            key: "event-id",
            value: Some(&event_id),
        });
        producer
            .send(
                FutureRecord::to(TOPIC)
                    .key(&key)
                    .payload(&body)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)?;
    }
    Ok(())
}
