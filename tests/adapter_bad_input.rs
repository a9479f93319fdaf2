//! Bad input to the adapters gives a typed error with a clear message.

use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use replayguard::kafka::{GuardOptions, GuardedConsumer, GuardedPipeline};
use replayguard::{Error, Guard};
use replayguard_testkit::{InProcessBroker as Broker, TestResult};

#[tokio::test(flavor = "multi_thread")]
async fn unknown_topic_is_named() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    let r = GuardedPipeline::builder(broker.consumer_config("g"), dir.path())
        .input("nope")
        .output("out")
        .build()
        .await;
    match r {
        Err(e @ Error::UnknownTopic { .. }) => assert!(e.to_string().contains("\"nope\""), "{e}"),
        Err(e) => return Err(format!("expected UnknownTopic, got {e}").into()),
        Ok(_) => return Err("an unknown topic was accepted".into()),
    }
    let r = GuardedConsumer::builder(broker.consumer_config("g"), dir.path())
        .topic("nope")
        .build()
        .await;
    assert!(
        matches!(r, Err(Error::UnknownTopic { .. })),
        "consumer accepted an unknown topic"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_broker_fails_after_bounded_retries() -> TestResult {
    // Bind then drop a listener: the port is closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", format!("127.0.0.1:{port}"))
        .set("group.id", "g");
    let dir = tempfile::tempdir()?;
    let started = Instant::now();
    let r = GuardedPipeline::builder(cfg, dir.path())
        .input("in")
        .output("out")
        .options(GuardOptions::default().connect_attempts(2))
        .build()
        .await;
    match r {
        Err(e @ Error::Unreachable { attempts: 2, .. }) => {
            assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
        }
        Err(e) => return Err(format!("expected Unreachable, got {e}").into()),
        Ok(_) => return Err("an unreachable broker was accepted".into()),
    }
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn state_folder_in_use_is_refused() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    let holder = Guard::builder(dir.path()).open()?;
    let r = GuardedPipeline::builder(broker.consumer_config("g"), dir.path())
        .input("in")
        .output("out")
        .build()
        .await;
    assert!(
        matches!(r, Err(Error::InUse { .. })),
        "a second user of the state folder was accepted"
    );
    drop(holder);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn producer_without_idempotence_or_full_acks_is_refused() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    for (key, value, word) in [
        ("enable.idempotence", "false", "idempotence"),
        ("acks", "1", "acks=all"),
    ] {
        let dir = tempfile::tempdir()?;
        let mut producer = ClientConfig::new();
        producer
            .set("bootstrap.servers", broker.bootstrap())
            .set(key, value);
        let r = GuardedPipeline::builder(broker.consumer_config("g"), dir.path())
            .input("in")
            .output("out")
            .producer_config(producer)
            .build()
            .await;
        match r {
            Err(e @ Error::Config(_)) => assert!(e.to_string().contains(word), "{e}"),
            Err(e) => return Err(format!("expected Config, got {e}").into()),
            Ok(_) => return Err(format!("{key}={value} was accepted").into()),
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_group_or_topics_is_refused() -> TestResult {
    let broker = Broker::start(&[("in", 1), ("out", 1)])?;
    let dir = tempfile::tempdir()?;
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", broker.bootstrap());
    let r = GuardedPipeline::builder(cfg, dir.path())
        .input("in")
        .output("out")
        .build()
        .await;
    assert!(
        matches!(&r, Err(Error::Config(m)) if m.contains("group.id")),
        "no group.id accepted"
    );
    let r = GuardedPipeline::builder(broker.consumer_config("g"), dir.path())
        .output("out")
        .build()
        .await;
    assert!(
        matches!(&r, Err(Error::Config(m)) if m.contains("input")),
        "no input accepted"
    );
    Ok(())
}
