//! Configuration checks and broker probes shared by the adapters.

use std::path::Path;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::error::{Error, Result};

/// Keys copied from a consumer configuration into a derived producer or
/// reader configuration: connection and security settings only.
fn is_connection_key(k: &str) -> bool {
    k == "bootstrap.servers"
        || k == "metadata.broker.list"
        || k == "client.id"
        || k == "broker.address.family"
        || k.starts_with("security.")
        || k.starts_with("sasl.")
        || k.starts_with("ssl.")
        || k.starts_with("socket.")
}

/// A configuration holding only the connection settings of `cfg`.
pub(crate) fn connection_config(cfg: &ClientConfig) -> ClientConfig {
    let mut out = ClientConfig::new();
    // `config_map` masks secrets (`sasl.password`, `ssl.key.password`, ...),
    // so it names the keys and `get` gives the values.
    for k in cfg.config_map().keys() {
        if is_connection_key(k)
            && let Some(v) = cfg.get(k)
        {
            out.set(*k, v);
        }
    }
    out.set_log_level(cfg.log_level);
    out
}

/// The brokers named by a configuration, for error messages.
pub(crate) fn brokers(cfg: &ClientConfig) -> String {
    cfg.get("bootstrap.servers")
        .or_else(|| cfg.get("metadata.broker.list"))
        .unwrap_or("(no bootstrap.servers)")
        .to_owned()
}

/// The consumer group of a configuration; a guard needs one.
pub(crate) fn group_id(cfg: &ClientConfig) -> Result<String> {
    match cfg.get("group.id") {
        // librdkafka makes no consumer for an empty one, and says only
        // that its queue is not available.
        Some(g) if g.trim().is_empty() => Err(Error::Config(
            "the consumer group's name (group.id) is empty; name the group".into(),
        )),
        Some(g) => Ok(g.to_owned()),
        None => Err(Error::Config(
            "the consumer configuration has no group.id; set one".into(),
        )),
    }
}

/// Refuses a configuration that names no broker: librdkafka would try to
/// reach none, and the broker probe would wait its whole patience.
pub(crate) fn check_brokers(cfg: &ClientConfig) -> Result<()> {
    let named = cfg
        .get("bootstrap.servers")
        .or_else(|| cfg.get("metadata.broker.list"))
        .is_some_and(|list| list.split(',').any(|b| !b.trim().is_empty()));
    if named {
        Ok(())
    } else {
        Err(Error::Config(
            "no broker is named (bootstrap.servers is empty); name at least one, as host:port"
                .into(),
        ))
    }
}

/// Applies the settings a guarded consumer needs. `instance` is the static
/// membership id derived from the state folder.
pub(crate) fn guarded_consumer_config(
    user: &ClientConfig,
    instance: &str,
    stop_at_end: bool,
) -> Result<ClientConfig> {
    group_id(user)?;
    let mut cfg = user.clone();
    cfg.set("enable.auto.commit", "false");
    cfg.set("enable.auto.offset.store", "false");
    // rdkafka sets librdkafka's log level from what the `log` facade lets
    // through for librdkafka, which may be errors only; the guard needs
    // its warnings (`GuardContext::log`).
    if matches!(
        cfg.log_level,
        RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
    ) {
        cfg.set_log_level(RDKafkaLogLevel::Warning);
    }
    // The end of the input is found from partition-end events.
    if stop_at_end {
        cfg.set("enable.partition.eof", "true");
    }
    // Static membership lets a restarted classic member take its
    // partitions back at once. Under KIP-848 a member killed without
    // leaving keeps its instance id until the broker's session timeout, and
    // librdkafka treats the restarted member's rejoin as fatal; a dynamic
    // member instead waits for that timeout and then gets the partitions.
    if cfg.get("group.instance.id").is_none() && !uses_consumer_protocol(&cfg) {
        cfg.set("group.instance.id", instance);
    }
    // The new group protocol (KIP-848) assigns on the broker, which also
    // owns the session timeout: librdkafka refuses both settings with it.
    if !uses_consumer_protocol(&cfg) {
        if cfg.get("partition.assignment.strategy").is_none() {
            cfg.set("partition.assignment.strategy", "cooperative-sticky");
        }
        if cfg.get("session.timeout.ms").is_none() {
            cfg.set("session.timeout.ms", "6000");
        }
        // A heartbeat every sixth of the session (librdkafka's 3 s at
        // most) keeps the lease, the session timeout less the heartbeat
        // interval less a margin, at 4 s of a 6 s session.
        if cfg.get("heartbeat.interval.ms").is_none() {
            let session = millis(&cfg, "session.timeout.ms", 45_000);
            let beat = (session / 6).min(Duration::from_secs(3));
            cfg.set("heartbeat.interval.ms", beat.as_millis().to_string());
        }
    }
    if cfg.get("auto.offset.reset").is_none() {
        cfg.set("auto.offset.reset", "earliest");
    }
    Ok(cfg)
}

/// Whether `auto.offset.reset` sends a partition with no position anywhere
/// to its end (`latest`, `largest`, `end`) rather than its start.
pub(crate) fn starts_at_end(cfg: &ClientConfig) -> bool {
    matches!(
        cfg.get("auto.offset.reset"),
        Some("latest" | "largest" | "end")
    )
}

/// A millisecond setting of `cfg`, or `default` when unset or unreadable.
fn millis(cfg: &ClientConfig, key: &str, default: u64) -> Duration {
    Duration::from_millis(
        cfg.get(key)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(default),
    )
}

/// The longest stall an instance survives as a member, its lease on its
/// partitions: the session timeout, less the heartbeat interval (the
/// coordinator may have had the last heartbeat that much before the stall
/// began), less a tenth or at least a second for delays. Under the new
/// group protocol the session timeout is the broker's and unknown here, so
/// the lease is 5 s, below any broker's minimum session timeout less its
/// heartbeat interval that this project's tests met.
pub(crate) fn lease_length(consumer: &ClientConfig) -> Duration {
    if uses_consumer_protocol(consumer) {
        return Duration::from_secs(5);
    }
    // librdkafka's defaults.
    let session = millis(consumer, "session.timeout.ms", 45_000);
    let heartbeat = millis(consumer, "heartbeat.interval.ms", 3_000);
    let margin = (session / 10).max(Duration::from_secs(1));
    session
        .saturating_sub(heartbeat)
        .saturating_sub(margin)
        .max(Duration::from_millis(500))
}

/// Bounds of the output producer's delivery timeout. librdkafka takes 0
/// as no bound at all, under which an instance that lost its partitions
/// could have outputs land at any later time, after its successor
/// reconciled; past an hour, that successor would wait that long.
const DELIVERY_BOUNDS: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(3600));

/// The output producer's delivery bound: `message.timeout.ms` (or its alias
/// `delivery.timeout.ms`) as the user set it, else `default`, which is then
/// set. `request.timeout.ms` defaults to at most 5 s. Returns how long an
/// output handed to librdkafka can still reach the broker: the delivery
/// bound, the request timeout, and a second of librdkafka's timeout-scan
/// granularity.
///
/// # Errors
/// [`Error::Config`] for a delivery bound outside 100 ms to 1 h, 0 (no
/// bound) among them.
pub(crate) fn bound_delivery(producer: &mut ClientConfig, default: Duration) -> Result<Duration> {
    let (lo, hi) = DELIVERY_BOUNDS;
    let delivery = match producer
        .get("message.timeout.ms")
        .or_else(|| producer.get("delivery.timeout.ms"))
    {
        Some(_) => {
            let set = millis(producer, "message.timeout.ms", 0).max(millis(
                producer,
                "delivery.timeout.ms",
                0,
            ));
            if !(lo..=hi).contains(&set) {
                return Err(Error::Config(format!(
                    "the producer's message.timeout.ms (or delivery.timeout.ms) must be between {} and {} ms, not {}: it bounds how long an output of an instance that lost its partitions can still land, and so how long its successor waits; librdkafka takes 0 as no bound at all",
                    lo.as_millis(),
                    hi.as_millis(),
                    set.as_millis()
                )));
            }
            set
        }
        None => {
            if !(lo..=hi).contains(&default) {
                return Err(Error::Config(
                    "delivery_timeout must be between 100ms and 1h: it bounds how long an output of an instance that lost its partitions can still land, and so how long its successor waits"
                        .into(),
                ));
            }
            producer.set("message.timeout.ms", default.as_millis().to_string());
            default
        }
    };
    let request = match producer.get("request.timeout.ms") {
        Some(_) => millis(producer, "request.timeout.ms", 30_000),
        None => {
            let r = delivery
                .min(Duration::from_secs(5))
                .max(Duration::from_millis(100));
            producer.set("request.timeout.ms", r.as_millis().to_string());
            r
        }
    };
    Ok(delivery + request + Duration::from_secs(1))
}

/// Checks a client's configuration as librdkafka does when it makes the
/// client, without connecting anywhere. Some of its rules span several
/// properties (under idempotence `max.in.flight` at most 5 and `retries`
/// at least 1; `fetch.max.bytes` at least `message.max.bytes`; no
/// `session.timeout.ms` with `group.protocol=consumer`), which setting a
/// property alone does not check; made later, the client would be refused
/// only after the state folder was opened. `role` names the client in the
/// error.
///
/// # Errors
/// [`Error::Config`] with librdkafka's reason.
pub(crate) fn check_client_config<C: rdkafka::config::FromClientConfig>(
    cfg: &ClientConfig,
    role: &str,
) -> Result<()> {
    let mut probe = cfg.clone();
    probe
        .remove("bootstrap.servers")
        .remove("metadata.broker.list")
        .set_log_level(RDKafkaLogLevel::Error);
    match probe.create::<C>() {
        Ok(_) => Ok(()),
        Err(e) => {
            let why = match e {
                KafkaError::ClientCreation(why) => why,
                e => e.to_string(),
            };
            Err(Error::Config(format!(
                "the {role}'s configuration is refused by librdkafka: {why}"
            )))
        }
    }
}

/// Checks the guarded consumer's configuration made from `user`
/// ([`check_client_config`]) and a `lease` the user set against it
/// ([`check_lease`]), and warns of a consumer told to read uncommitted
/// records: it reads the records of transactions the input's producers
/// aborted, and the guard handles them as any other (librdkafka's default,
/// `read_committed`, skips them).
///
/// # Errors
/// [`Error::Config`] for a configuration librdkafka refuses, or a lease
/// the group does not honour.
pub(crate) fn check_consumer_config(
    user: &ClientConfig,
    stop_at_end: bool,
    lease: Option<Duration>,
) -> Result<()> {
    check_brokers(user)?;
    let cfg = guarded_consumer_config(user, "probe", stop_at_end)?;
    check_client_config::<BaseConsumer>(&cfg, "consumer")?;
    if let Some(lease) = lease {
        check_lease(&cfg, lease)?;
    }
    if user
        .get("isolation.level")
        .is_some_and(|v| v.eq_ignore_ascii_case("read_uncommitted"))
    {
        tracing::warn!(
            "isolation.level=read_uncommitted: records of transactions the input's producers aborted are read and handled as any other, so they reach the output; remove the setting to skip them"
        );
    }
    Ok(())
}

/// Refuses a lease (`GuardOptions::lease`) longer than the classic group
/// waits for a silent member before it gives the member's partitions to
/// another: its session timeout less one heartbeat interval (the last
/// heartbeat may have come that long before a stall began). A stall
/// between the two would let the instance write after its successor
/// began, which is what the lease is for. Under `group.protocol=consumer`
/// the session timeout is the broker's, unknown here.
fn check_lease(cfg: &ClientConfig, lease: Duration) -> Result<()> {
    if uses_consumer_protocol(cfg) {
        return Ok(());
    }
    let session = millis(cfg, "session.timeout.ms", 45_000);
    let heartbeat = millis(cfg, "heartbeat.interval.ms", 3_000);
    let most = session.saturating_sub(heartbeat);
    if lease > most {
        return Err(Error::Config(format!(
            "the lease ({lease:?}) is longer than the group waits for a silent member, {most:?} (session.timeout.ms {} less heartbeat.interval.ms {}): an instance stalled between the two would still write after the group gave its partitions to another; shorten the lease or raise session.timeout.ms",
            session.as_millis(),
            heartbeat.as_millis()
        )));
    }
    Ok(())
}

/// Whether a consumer made from `cfg` is a static member of a classic
/// group.
pub(crate) fn is_static_member(cfg: &ClientConfig) -> bool {
    cfg.get("group.instance.id").is_some() && !uses_consumer_protocol(cfg)
}

/// Whether a configuration uses the broker-side group protocol of KIP-848
/// (`group.protocol=consumer`) rather than the classic one.
pub(crate) fn uses_consumer_protocol(cfg: &ClientConfig) -> bool {
    cfg.get("group.protocol")
        .is_some_and(|p| p.eq_ignore_ascii_case("consumer"))
}

/// Whether a consumer made from `cfg` rebalances cooperatively, so that
/// its rebalance callback must assign and revoke incrementally. The new
/// group protocol always does; the classic one does when its assignors
/// are cooperative, which in librdkafka means `cooperative-sticky`
/// (librdkafka refuses a list that mixes cooperative and eager ones, and
/// its default, `range,roundrobin`, is eager). Names are matched as
/// librdkafka matches them: by case, spaces before them skipped.
pub(crate) fn cooperative(cfg: &ClientConfig) -> bool {
    uses_consumer_protocol(cfg)
        || cfg
            .get("partition.assignment.strategy")
            .is_some_and(|list| list.split(',').any(|a| a.trim() == "cooperative-sticky"))
}

/// Refuses a producer configuration that cannot give exactly-once output.
pub(crate) fn idempotent_producer_config(cfg: &ClientConfig) -> Result<ClientConfig> {
    let mut cfg = cfg.clone();
    if let Some(v) = cfg.get("enable.idempotence")
        && v != "true"
    {
        return Err(Error::Config(format!(
            "enable.idempotence={v} is refused: without idempotence a producer retry can write an output twice, which no consumer-side guard can undo; remove the setting"
        )));
    }
    if let Some(v) = cfg.get("acks").or_else(|| cfg.get("request.required.acks"))
        && v != "all"
        && v != "-1"
    {
        return Err(Error::Config(format!(
            "acks={v} is refused: an output acked by one replica can be lost, and a lost output is a lost record; use acks=all"
        )));
    }
    cfg.set("enable.idempotence", "true");
    cfg.set("acks", "all");
    Ok(cfg)
}

/// The static membership id of a state folder: a token created with the
/// folder, stable across restarts. Two live instances cannot share it,
/// because the folder is locked by its guard.
///
/// It also names the subscribed topics (a hash of them): a static member
/// that rejoins with another subscription gets its old assignment back
/// without a rebalance (seen on Apache Kafka 4.4), so an added input would
/// never be assigned; with another id it joins as a new member.
pub(crate) fn instance_id(state: &Path, group: &str, topics: &[String]) -> Result<String> {
    let mut sorted: Vec<&str> = topics.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let subscription = xxhash_rust::xxh3::xxh3_64(sorted.join("\n").as_bytes()) as u32;
    Ok(format!(
        "replayguard-{group}-{}-{subscription:08x}",
        instance_token(state)?
    ))
}

/// The token of a state folder, created with it.
pub(crate) fn instance_token(state: &Path) -> Result<String> {
    let file = state.join("instance-id");
    let token = match std::fs::read_to_string(&file) {
        Ok(t) if !t.trim().is_empty() => t.trim().to_owned(),
        _ => {
            let seed = format!(
                "{}:{:?}:{}",
                std::process::id(),
                std::time::SystemTime::now(),
                state.display()
            );
            let t = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()));
            let tmp = state.join("instance-id.tmp");
            std::fs::write(&tmp, &t)?;
            std::fs::File::open(&tmp)?.sync_all()?;
            std::fs::rename(&tmp, &file)?;
            t
        }
    };
    Ok(token)
}

/// A client context that keeps the first client-wide error that means the
/// connection cannot work (refused credentials, TLS), which librdkafka
/// reports only through its error callback, not through the call that
/// failed.
#[derive(Default)]
pub(crate) struct ProbeContext {
    refused: std::sync::Mutex<Option<(KafkaError, String)>>,
}

impl rdkafka::ClientContext for ProbeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if super::trouble::global_is_fatal(&error)
            && let Ok(mut r) = self.refused.lock()
            && r.is_none()
        {
            *r = Some((error, reason.to_owned()));
        }
    }
}

impl rdkafka::consumer::ConsumerContext for ProbeContext {}

impl ProbeContext {
    /// The refusal seen, as the error to stop with.
    pub(crate) fn refusal(&self, brokers: String) -> Option<Error> {
        let (source, reason) = self.refused.lock().ok()?.take()?;
        Some(Error::Connect {
            brokers,
            hint: super::trouble::hint(&source),
            reason,
            source: Box::new(source),
        })
    }
}

/// Whether `name` is a legal Kafka topic name: 1 to 249 of a-z, A-Z, 0-9,
/// '.', '_' and '-', and neither "." nor "..".
pub(crate) fn is_topic_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Refuses a changelog topic that is also one the job reads or writes: its
/// records would be read as input, or written among the outputs.
pub(crate) fn check_changelog_apart(changelog: Option<&str>, topics: &[&str]) -> Result<()> {
    match changelog {
        Some(log) if topics.contains(&log) => Err(Error::Config(format!(
            "changelog {log:?} is also a topic this job reads or writes: its identity records would mix with the records; give the changelog a topic of its own"
        ))),
        _ => Ok(()),
    }
}

/// Refuses a topic named more than once among `topics` (the `what` of the
/// job: its inputs, its topics), which librdkafka refuses only when the
/// consumer subscribes, after the state folder is made, and then as an
/// "invalid argument" that names nothing.
pub(crate) fn check_named_once(topics: &[String], what: &str) -> Result<()> {
    for (i, topic) in topics.iter().enumerate() {
        if topics[..i].contains(topic) {
            return Err(Error::Config(format!(
                "topic {topic:?} is named twice among the {what}; name each once"
            )));
        }
    }
    Ok(())
}

/// How long a topic the brokers do not know is asked for again before it
/// is reported missing: a topic created a moment ago may not be in the
/// answering broker's metadata yet. Seen on Kafka 4.4, runs started just
/// after a 256-partition topic pair was created on a broker holding a few
/// thousand partitions: with no grace 20 of 20 were told a topic did not
/// exist, with 2 s 12 of 20, with 5 s none of 6.
const UNKNOWN_TOPIC_GRACE: Duration = Duration::from_secs(5);

/// Waits for the brokers to answer and checks that every topic exists, with
/// bounded retries (and `UNKNOWN_TOPIC_GRACE` for a topic not known); a
/// name that is not a topic name is refused first.
///
/// Returns the partition count of each topic.
pub(crate) fn probe_topics(
    cfg: &ClientConfig,
    topics: &[&str],
    attempts: u32,
) -> Result<Vec<usize>> {
    if let Some(bad) = topics.iter().find(|t| !is_topic_name(t)) {
        let pattern = if bad.starts_with('^') {
            "; topics are named one by one, not by a pattern (^...): a state folder's job records its topics by name"
        } else {
            ""
        };
        return Err(Error::Config(format!(
            "{bad:?} is not a Kafka topic name: 1 to 249 of a-z, A-Z, 0-9, '.', '_' and '-'{pattern}"
        )));
    }
    let probe: BaseConsumer<ProbeContext> = connection_config(cfg)
        .set("allow.auto.create.topics", "false")
        .create_with_context(ProbeContext::default())
        .map_err(|e| Error::Kafka {
            operation: "creating a metadata client".into(),
            source: e,
        })?;
    let mut last = String::new();
    let mut unknown_since: Option<Instant> = None;
    let mut attempt = 0;
    while attempt < attempts.max(1) {
        let mut counts = Vec::with_capacity(topics.len());
        let mut retry = false;
        let mut unknown = false;
        for topic in topics {
            match probe.fetch_metadata(Some(topic), Duration::from_secs(3)) {
                Ok(md) => {
                    let t = md.topics().iter().find(|t| t.name() == *topic);
                    match t {
                        Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                            counts.push(t.partitions().len())
                        }
                        Some(t)
                            if t.error().is_some_and(|e| {
                                super::trouble::is_transient(RDKafkaErrorCode::from(e))
                            }) =>
                        {
                            last = format!("topic {topic}: {:?}", t.error());
                            retry = true;
                            break;
                        }
                        Some(t)
                            if t.error().is_some_and(|e| {
                                RDKafkaErrorCode::from(e)
                                    != RDKafkaErrorCode::UnknownTopicOrPartition
                            }) =>
                        {
                            let source = KafkaError::MetadataFetch(
                                t.error().map_or(RDKafkaErrorCode::Unknown, Into::into),
                            );
                            return Err(Error::Consume {
                                location: format!("the metadata of topic {topic}"),
                                hint: super::trouble::hint(&source),
                                source: Box::new(source),
                            });
                        }
                        _ if unknown_since.get_or_insert_with(Instant::now).elapsed()
                            < UNKNOWN_TOPIC_GRACE =>
                        {
                            unknown = true;
                            break;
                        }
                        _ => {
                            return Err(Error::UnknownTopic {
                                topic: (*topic).to_owned(),
                                brokers: brokers(cfg),
                            });
                        }
                    }
                }
                Err(e) => {
                    // The client's error events, which carry a refusal's
                    // reason, reach the context only when served.
                    while probe.poll(Duration::ZERO).is_some() {}
                    if let Some(refused) = probe.context().refusal(brokers(cfg)) {
                        return Err(refused);
                    }
                    last = describe(&e);
                    retry = true;
                    break;
                }
            }
        }
        if unknown {
            // Not an attempt: the brokers answered.
            tracing::debug!("a topic not known yet; asking again");
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        if !retry {
            return Ok(counts);
        }
        attempt += 1;
        tracing::warn!(attempt, error = %last, "brokers not ready, retrying");
        if attempt < attempts {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    Err(Error::Unreachable {
        brokers: brokers(cfg),
        attempts,
        last,
    })
}

fn describe(e: &KafkaError) -> String {
    match e.rdkafka_error_code() {
        Some(code) => format!("{e} ({code:?})"),
        None => e.to_string(),
    }
}

/// Wraps an rdkafka error with the operation that failed.
pub(crate) fn kafka(operation: &str) -> impl FnOnce(KafkaError) -> Error + '_ {
    move |source| Error::Kafka {
        operation: operation.to_owned(),
        source,
    }
}

/// Test-only fault points, compiled in with the `fault-injection` feature:
/// true when the environment variable `REPLAYGUARD_FAIL_AT` names `name`
/// and, if `REPLAYGUARD_FAIL_ARMED` names a path, that path exists.
pub(crate) fn fault(name: &str) -> bool {
    cfg!(any(test, feature = "fault-injection"))
        && std::env::var("REPLAYGUARD_FAIL_AT").is_ok_and(|v| v == name)
        && std::env::var_os("REPLAYGUARD_FAIL_ARMED")
            .is_none_or(|armed| std::path::Path::new(&armed).exists())
}

/// Runs `f` (which blocks: broker probes, state recovery) on tokio's
/// blocking threads; `what` names it if the task is lost.
pub(crate) async fn on_blocking_thread<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Stopped {
            reason: format!("{what} did not finish: {e}"),
            after: None,
        })?
}

#[cfg(test)]
mod test {
    use std::time::Instant;

    use rdkafka::consumer::RebalanceProtocol;
    use rdkafka::mocking::MockCluster;

    use super::*;

    /// The protocol worked out from the configuration is the one librdkafka
    /// reports once the consumer holds partitions, for each kind of
    /// assignor list (asked here from the test, not from a callback).
    #[test]
    fn the_rebalance_protocol_follows_from_the_configuration() -> Result<()> {
        let cluster = MockCluster::new(1).map_err(kafka("starting a mock cluster"))?;
        cluster
            .create_topic("t", 2, 1)
            .map_err(kafka("creating a topic"))?;
        let cases = [
            (Some("group.protocol=consumer"), true),
            (None, true),
            (Some("cooperative-sticky"), true),
            (Some(" cooperative-sticky"), true),
            (Some("range"), false),
            (Some("roundrobin"), false),
            (Some("range, roundrobin"), false),
        ];
        // One consumer a case, each in its own group, side by side: each
        // waits a few seconds for its group to form.
        let servers = cluster.bootstrap_servers();
        let runs: Vec<_> = cases
            .into_iter()
            .enumerate()
            .map(|(n, (strategy, want))| {
                let servers = servers.clone();
                std::thread::spawn(move || -> Result<()> {
                    let mut user = ClientConfig::new();
                    user.set("bootstrap.servers", servers)
                        .set("group.id", format!("g{n}"));
                    match strategy {
                        Some("group.protocol=consumer") => user.set("group.protocol", "consumer"),
                        Some(s) => user.set("partition.assignment.strategy", s),
                        None => &mut user,
                    };
                    let cfg = guarded_consumer_config(&user, &format!("i{n}"), false)?;
                    assert_eq!(cooperative(&cfg), want, "{strategy:?}");
                    let consumer: BaseConsumer =
                        cfg.create().map_err(kafka("creating a consumer"))?;
                    consumer.subscribe(&["t"]).map_err(kafka("subscribing"))?;
                    let start = Instant::now();
                    while consumer.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
                        assert!(
                            start.elapsed() < Duration::from_secs(30),
                            "{strategy:?}: no assignment within 30 s"
                        );
                        let _ = consumer.poll(Duration::from_millis(100));
                    }
                    let reported = match consumer.rebalance_protocol() {
                        RebalanceProtocol::Cooperative => "cooperative",
                        RebalanceProtocol::Eager => "eager",
                        RebalanceProtocol::None => "none",
                    };
                    let expected = if want { "cooperative" } else { "eager" };
                    assert_eq!(reported, expected, "{strategy:?}");
                    Ok(())
                })
            })
            .collect();
        for run in runs {
            match run.join() {
                Ok(r) => r?,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        Ok(())
    }
}
