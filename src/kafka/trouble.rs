//! Which consumer errors heal by themselves, and how both kinds are told.
//!
//! librdkafka retries a transient error (a broker restarting, a leader
//! moving, a coordinator loading) on its own, so the guard keeps going and
//! says so once per cause. Any other error does not heal: a record this
//! build cannot decode, a principal without the right ACL, a topic that is
//! gone. Retrying those loops forever without a word of why, so they stop
//! the guard with [`Error::Consume`] (G3: nothing is skipped).
//!
//! The list of transient codes is an allow-list: an error librdkafka adds
//! later stops the guard until it is known to heal.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};

/// A transient error is logged at its first sighting, then at most once per
/// this interval with the number of times it was seen meanwhile.
const REPEAT_LOG: Duration = Duration::from_secs(30);

/// Whether librdkafka recovers from `code` by itself.
pub(crate) fn is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::BrokerTransportFailure
            | Code::AllBrokersDown
            | Code::Resolve
            | Code::OperationTimedOut
            | Code::TimedOutQueue
            | Code::RequestTimedOut
            | Code::NetworkException
            | Code::BrokerNotAvailable
            | Code::ReplicaNotAvailable
            | Code::LeaderNotAvailable
            | Code::NotLeaderForPartition
            | Code::PreferredLeaderNotAvailable
            | Code::FencedLeaderEpoch
            | Code::UnknownLeaderEpoch
            | Code::OffsetNotAvailable
            | Code::NotCoordinator
            | Code::CoordinatorNotAvailable
            | Code::CoordinatorLoadInProgress
            | Code::WaitingForCoordinator
            | Code::RebalanceInProgress
            | Code::NotEnoughReplicas
            | Code::NotEnoughReplicasAfterAppend
            | Code::KafkaStorageError
            | Code::ThrottlingQuotaExceeded
            | Code::QueueFull
            | Code::Retry
            | Code::InProgress
            | Code::PreviousInProgress
            | Code::Interrupted
            | Code::PollExceeded
            | Code::RebootstrapRequired
    )
}

/// Whether a consumer error heals by itself. Fatal errors (librdkafka's
/// own judgement) never do; an error without a code is not a consumer
/// error and is taken as one that does not heal.
pub(crate) fn heals(e: &KafkaError) -> bool {
    match e {
        KafkaError::MessageConsumptionFatal(_) => false,
        other => other.rdkafka_error_code().is_some_and(is_transient),
    }
}

/// Asks `ask` again while it fails with an error that heals (a topic made
/// a moment ago whose leaders are not yet elected: `NotLeaderForPartition`;
/// a coordinator loading or moving), pausing 50 ms, doubling up to 1 s,
/// for as long as `patience` allows another pause; then returns its last
/// answer. For the reads the guard makes outside the consumer's own
/// fetching (watermarks, log offsets, committed offsets), which librdkafka
/// does not retry itself.
pub(crate) fn patiently<T>(
    patience: Duration,
    mut ask: impl FnMut() -> rdkafka::error::KafkaResult<T>,
) -> rdkafka::error::KafkaResult<T> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        match ask() {
            Err(e) if heals(&e) && started.elapsed() + pause < patience => {
                tracing::debug!(error = %e, ?pause, "a transient refusal; asking again");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            answer => return answer,
        }
    }
}

/// A partition's low and high watermarks, asked [`patiently`].
pub(crate) fn watermarks<C: rdkafka::consumer::ConsumerContext>(
    consumer: &impl rdkafka::consumer::Consumer<C>,
    topic: &str,
    partition: i32,
    timeout: Duration,
) -> rdkafka::error::KafkaResult<(i64, i64)> {
    patiently(timeout, || {
        consumer.fetch_watermarks(topic, partition, timeout)
    })
}

/// Whether a client-wide error (librdkafka's error callback) means the
/// connection cannot work: refused credentials, a TLS failure, or an error
/// librdkafka itself calls fatal. Every other client-wide error is a
/// connection trouble that librdkafka retries.
pub(crate) fn global_is_fatal(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            Code::Authentication
                | Code::SaslAuthenticationFailed
                | Code::UnsupportedSASLMechanism
                | Code::SSL
                | Code::Fatal
        )
    )
}

/// What to do about an error that does not heal, for its message.
pub(crate) fn hint(e: &KafkaError) -> &'static str {
    match e.rdkafka_error_code() {
        Some(Code::NotImplemented | Code::UnsupportedFeature) => {
            "this build of librdkafka cannot read it (a codec or feature it lacks); \
             the record is not skipped"
        }
        Some(
            Code::BadMessage
            | Code::BadCompression
            | Code::InvalidMessage
            | Code::InvalidRecord
            | Code::UnsupportedCompressionType
            | Code::InvalidMessageSize,
        ) => "the record cannot be decoded; it is not skipped: repair or remove it upstream",
        Some(Code::TopicAuthorizationFailed) => {
            "the client's principal may not read the topic: grant it READ and DESCRIBE on it"
        }
        Some(Code::GroupAuthorizationFailed) => {
            "the client's principal may not use the consumer group: grant it READ on the group"
        }
        Some(Code::ClusterAuthorizationFailed) => {
            "the client's principal lacks a cluster permission the consumer needs"
        }
        Some(
            Code::Authentication | Code::SaslAuthenticationFailed | Code::UnsupportedSASLMechanism,
        ) => {
            "the brokers refuse the credentials: check security.protocol, sasl.mechanism, \
             sasl.username and sasl.password"
        }
        Some(Code::SSL) => "TLS failed: check ssl.ca.location and the broker's certificate",
        Some(
            Code::UnknownTopicOrPartition
            | Code::UnknownTopic
            | Code::UnknownPartition
            | Code::UnknownTopicId,
        ) => {
            "the topic or partition is gone (deleted?); a recreated topic starts its offsets \
             again, so check the state folder's job before restarting"
        }
        Some(Code::UnreleasedInstanceId) => {
            "another member still holds this group.instance.id: under group.protocol=consumer \
             a killed static member keeps it until the broker's group.consumer.session.timeout.ms \
             (45 s by default); wait that long, or leave group.instance.id unset"
        }
        Some(Code::FencedInstanceId) => {
            "this group.instance.id now belongs to another membership: either another \
             instance runs with the same one (give each its own), or this instance lost its \
             group session (frozen or cut off past its session timeout) and rejoined, and \
             the old membership's requests were fenced (start it again)"
        }
        Some(Code::AutoOffsetReset) => {
            "under auto.offset.reset=error a partition with no position (nothing committed \
             by the group, nothing in the state folder) or a position outside its log \
             (records expired or truncated before they were read) has nowhere to start; \
             set auto.offset.reset to earliest or latest, or commit a position for the group"
        }
        Some(Code::OffsetOutOfRange | Code::LogTruncation) => {
            "the position is outside the partition's log (records expired or truncated \
             before they were read); they cannot be read, so the guard stops rather than skip"
        }
        _ => "librdkafka does not retry it; the guard stops rather than skip records",
    }
}

/// Logs transient consumer errors once per cause, then a count at most
/// every 30 s.
#[derive(Debug, Default)]
pub(crate) struct TransientLog {
    seen: HashMap<Option<i32>, (u64, Instant)>,
}

impl TransientLog {
    /// Notes a transient error, logging it when due.
    pub fn note(&mut self, e: &KafkaError) {
        let now = Instant::now();
        let entry = self.seen.entry(e.rdkafka_error_code().map(|c| c as i32));
        match entry {
            std::collections::hash_map::Entry::Vacant(v) => {
                tracing::warn!(error = %e, "consumer error; librdkafka retries it");
                v.insert((0, now));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (count, since) = o.get_mut();
                *count += 1;
                if now.duration_since(*since) >= REPEAT_LOG {
                    tracing::warn!(
                        error = %e,
                        times = *count,
                        seconds = now.duration_since(*since).as_secs(),
                        "consumer error seen again; librdkafka keeps retrying it"
                    );
                    *count = 0;
                    *since = now;
                }
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_read_refused_for_a_passing_reason_is_asked_again_within_its_patience() {
        let not_leader = || KafkaError::MetadataFetch(Code::NotLeaderForPartition);
        // Refused twice while leaders are elected, then answered.
        let mut asked = 0;
        let answer = patiently(Duration::from_secs(5), || {
            asked += 1;
            if asked < 3 {
                Err(not_leader())
            } else {
                Ok(asked)
            }
        });
        assert_eq!(answer.ok(), Some(3));
        // A refusal that does not pass is returned at once.
        let mut asked = 0;
        let answer: rdkafka::error::KafkaResult<()> = patiently(Duration::from_secs(5), || {
            asked += 1;
            Err(KafkaError::MetadataFetch(Code::TopicAuthorizationFailed))
        });
        assert!(answer.is_err());
        assert_eq!(asked, 1);
        // One that never passes is returned once the patience is spent.
        let started = Instant::now();
        let mut asked = 0;
        let answer: rdkafka::error::KafkaResult<()> = patiently(Duration::from_millis(400), || {
            asked += 1;
            Err(not_leader())
        });
        assert!(answer.is_err());
        assert!(asked >= 3, "asked {asked} times");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn transport_trouble_heals_and_decoding_or_access_trouble_does_not() {
        assert!(heals(&KafkaError::MessageConsumption(
            Code::BrokerTransportFailure
        )));
        assert!(heals(&KafkaError::MessageConsumption(
            Code::NotLeaderForPartition
        )));
        for code in [
            Code::NotImplemented,
            Code::TopicAuthorizationFailed,
            Code::GroupAuthorizationFailed,
            Code::UnknownTopicOrPartition,
            Code::BadMessage,
            Code::Authentication,
            Code::UnreleasedInstanceId,
        ] {
            assert!(!heals(&KafkaError::MessageConsumption(code)), "{code:?}");
        }
        // librdkafka's own verdict wins, even for a code that usually heals.
        assert!(!heals(&KafkaError::MessageConsumptionFatal(
            Code::BrokerTransportFailure
        )));
        assert!(
            hint(&KafkaError::MessageConsumption(Code::NotImplemented)).contains("cannot read")
        );
    }
}
