//! G2 on the in-process mock cluster: the guarded consumer delivers each
//! record once across a crash, filters upstream resends at new offsets
//! within the retention, and lets them through after it.

use std::path::Path;
use std::time::Duration;

use replayguard::kafka::{GuardOptions, GuardedConsumer};
use replayguard_testkit::{InProcessBroker as Broker, TestResult};

fn value(r: &replayguard::kafka::GuardedRecord) -> TestResult<u64> {
    use rdkafka::Message;
    Ok(std::str::from_utf8(r.message().payload().unwrap_or_default())?.parse()?)
}

async fn consumer(
    broker: &Broker,
    state: &Path,
    retention_epochs: u32,
) -> replayguard::Result<GuardedConsumer> {
    GuardedConsumer::builder(broker.consumer_config("readers"), state)
        .topic("events")
        .options(
            GuardOptions::default()
                .retention_epochs(retention_epochs)
                .checkpoint_interval(Duration::from_secs(3600))
                .stop_at_end(true),
        )
        .build()
        .await
}

/// Reads to the end (or `limit` records), acking each.
async fn read(c: &GuardedConsumer, limit: usize) -> TestResult<Vec<u64>> {
    let mut out = Vec::new();
    while out.len() < limit {
        let Some(r) = c.recv().await? else { break };
        out.push(value(&r)?);
        c.ack(&r)?;
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acked_records_are_not_delivered_again_after_a_crash() -> TestResult {
    let broker = Broker::start(&[("events", 1)])?;
    broker
        .produce("events", &(1..=50).collect::<Vec<_>>(), 1)
        .await?;
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), 0).await?;
    // 20 acked, one delivered but never acked, then a crash with no checkpoint.
    let first = read(&c, 20).await?;
    let unacked = c.recv().await?.ok_or("expected a 21st record")?;
    assert_eq!(value(&unacked)?, 21);
    c.abort();
    let c = consumer(&broker, dir.path(), 0).await?;
    let rest = read(&c, usize::MAX).await?;
    assert_eq!(first, (1..=20).collect::<Vec<_>>());
    assert_eq!(
        rest,
        (21..=50).collect::<Vec<_>>(),
        "the unacked record comes again; acked ones do not"
    );
    assert!(
        c.stats().duplicates >= 20,
        "the replay of 1..=20 is filtered: {:?}",
        c.stats()
    );
    c.close(Duration::from_secs(30)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_resends_are_filtered_within_the_retention() -> TestResult {
    let broker = Broker::start(&[("events", 1)])?;
    let mut input: Vec<u64> = (1..=40).collect();
    input.extend([
        32, 34, 35, 36, 40, 41, 46, 31, 33, 37, 38, 39, 42, 43, 44, 45,
    ]);
    broker.produce("events", &input, 1).await?;
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), 0).await?;
    let got = read(&c, usize::MAX).await?;
    let mut expected: Vec<u64> = (1..=40).collect();
    expected.extend([41, 46, 42, 43, 44, 45]);
    assert_eq!(got, expected, "each value once, in first-seen order");
    assert_eq!(c.stats().duplicates, 10);
    c.close(Duration::from_secs(30)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resends_pass_once_their_epoch_left_the_retention() -> TestResult {
    for (retention, expect_resend) in [(0u32, true), (3, false)] {
        let broker = Broker::start(&[("events", 1)])?;
        broker
            .produce("events", &(1..=10).collect::<Vec<_>>(), 1)
            .await?;
        let dir = tempfile::tempdir()?;
        let c = consumer(&broker, dir.path(), retention).await?;
        assert_eq!(read(&c, usize::MAX).await?, (1..=10).collect::<Vec<_>>());
        // Two checkpoints: the epoch holding 1..=10 is now two epochs old.
        c.checkpoint().await?;
        c.checkpoint().await?;
        broker.produce("events", &[5], 1).await?;
        let again = read(&c, usize::MAX).await?;
        if expect_resend {
            assert_eq!(
                again,
                vec![5],
                "retention 0: the resend is outside the retention and passes"
            );
        } else {
            assert!(
                again.is_empty(),
                "retention {retention}: the resend is filtered, got {again:?}"
            );
        }
        c.close(Duration::from_secs(30)).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_identity_filters_by_business_id() -> TestResult {
    use replayguard::{Fingerprint, Identity, IdentityFn};
    let broker = Broker::start(&[("events", 1)])?;
    // The business id is the value modulo 1000: 1005 is a resend of 5.
    broker.produce("events", &[5, 6, 1005, 7, 2006], 1).await?;
    let dir = tempfile::tempdir()?;
    let id = IdentityFn::new(|_, value| {
        let v: u64 = std::str::from_utf8(value?).ok()?.parse().ok()?;
        Some(Fingerprint::id(v % 1000))
    });
    let c = GuardedConsumer::builder(broker.consumer_config("readers"), dir.path())
        .topic("events")
        .options(
            GuardOptions::default()
                .identity(Identity::Custom(id))
                .stop_at_end(true),
        )
        .build()
        .await?;
    assert_eq!(read(&c, usize::MAX).await?, vec![5, 6, 7]);
    // 1005 and 2006 are filtered: by the engine when 5 and 6 were acked
    // before they were polled, by the in-flight check when one poll held
    // them all.
    let stats = c.stats();
    assert_eq!((stats.records_in, stats.duplicates), (5, 2), "{stats:?}");
    c.close(Duration::from_secs(30)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_of_an_unacked_record_is_not_delivered_alongside_it() -> TestResult {
    let broker = Broker::start(&[("events", 1)])?;
    broker.produce("events", &[7, 7, 8], 1).await?;
    let dir = tempfile::tempdir()?;
    let c = consumer(&broker, dir.path(), 0).await?;
    let first = c.recv().await?.ok_or("expected 7")?;
    // 7 is not acked yet; its resend must not come out next.
    let second = c.recv().await?.ok_or("expected 8")?;
    assert_eq!((value(&first)?, value(&second)?), (7, 8));
    c.ack_many(&[first, second])?;
    assert!(c.recv().await?.is_none());
    c.close(Duration::from_secs(30)).await?;
    Ok(())
}
