//! Outputs: what the user function returns, how each is produced with its
//! guard headers, and the delivery reports that record inputs as handled.

use std::sync::{Arc, Mutex};

use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::ProducerContext;
use rdkafka::types::RDKafkaErrorCode;

use crate::error::Error;
use crate::kafka::headers::{FINGERPRINT_HEADER, PART_HEADER, SOURCE_HEADER};
use crate::kafka::shared::Shared;

/// One record the user function wants written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutputRecord {
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Value.
    pub value: Option<Vec<u8>>,
    /// Headers in order; a `None` value is a null header value (the guard
    /// adds its own after them).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    /// Output partition; `None` picks the input's partition when the output
    /// has enough partitions, else the key's.
    pub partition: Option<i32>,
    /// Timestamp, in milliseconds since the Unix epoch (the record's
    /// create time); `None` lets the producer stamp the time it sends. An
    /// output topic with `message.timestamp.type=LogAppendTime` replaces
    /// it with the broker's, and one whose
    /// `message.timestamp.before.max.ms` or `after.max.ms` it falls outside
    /// refuses it (`InvalidTimestamp`).
    pub timestamp: Option<i64>,
}

impl OutputRecord {
    /// An output with a value only.
    #[must_use]
    pub fn value(value: impl Into<Vec<u8>>) -> Self {
        OutputRecord {
            value: Some(value.into()),
            ..Self::default()
        }
    }

    /// A faithful copy of an input record: key, value, headers (a null
    /// header value stays null) and timestamp, without the guard's own
    /// headers.
    #[must_use]
    pub fn copy_of(m: &impl Message) -> Self {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .filter(|h| ![FINGERPRINT_HEADER, SOURCE_HEADER, PART_HEADER].contains(&h.key))
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default();
        OutputRecord {
            key: m.key().map(<[u8]>::to_vec),
            value: m.payload().map(<[u8]>::to_vec),
            headers,
            partition: None,
            timestamp: m.timestamp().to_millis(),
        }
    }

    /// Its headers followed by the guard's: the part (index of `count`,
    /// when there is more than one output), the source and the fingerprint.
    pub(crate) fn headers_with(
        &self,
        part: Option<&[u8]>,
        src: &[u8],
        fp: Option<&[u8]>,
    ) -> OwnedHeaders {
        let mut headers = OwnedHeaders::new_with_capacity(self.headers.len() + 3);
        if let Some(part) = part {
            headers = headers.insert(Header {
                key: PART_HEADER,
                value: Some(part),
            });
        }
        for (k, v) in &self.headers {
            headers = headers.insert(Header {
                key: k,
                value: v.as_deref(),
            });
        }
        headers = headers.insert(Header {
            key: SOURCE_HEADER,
            value: Some(src),
        });
        if let Some(fp) = fp {
            headers = headers.insert(Header {
                key: FINGERPRINT_HEADER,
                value: Some(fp),
            });
        }
        headers
    }
}

/// Which input an output belongs to, carried through the producer.
pub struct Ticket {
    pub(crate) topic: Arc<str>,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

impl Ticket {
    fn input(&self) -> String {
        format!("{}[{}]@{}", self.topic, self.partition, self.offset)
    }
}

/// The producer context: delivery reports record inputs as handled.
pub struct DeliveryContext {
    pub(crate) shared: Arc<Mutex<Shared>>,
    pub(crate) brokers: String,
    /// The producer's last client-wide error and librdkafka's text for it.
    /// A fatal error reaches the error callback with its own code, the
    /// fatal mark left out; the outputs it then purges fail with a code
    /// that says only that they were purged ([`DeliveryContext::failed`]).
    pub(crate) trouble: Mutex<Option<(KafkaError, String)>>,
}

impl DeliveryContext {
    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The error for an output of `input` the producer failed with `e`:
    /// one purged or failed by a fatal error of the producer's names that
    /// error (the last the error callback saw), with what to do about it.
    fn failed(&self, input: String, e: &KafkaError) -> Error {
        if matches!(
            e.rdkafka_error_code(),
            Some(RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::Fatal)
        ) && let Some((cause, reason)) = self
            .trouble
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
        {
            return Error::producer_failed(input, cause, reason);
        }
        Error::delivery(input, e.clone())
    }
}

impl ClientContext for DeliveryContext {
    /// As the consumer's: a connection that cannot work stops the guard.
    fn error(&self, error: KafkaError, reason: &str) {
        if crate::kafka::trouble::global_is_fatal(&error) {
            let hint = crate::kafka::trouble::hint(&error);
            self.lock().fail(Error::Connect {
                brokers: self.brokers.clone(),
                reason: format!("the producer's connection failed: {reason}"),
                hint,
                source: Box::new(error.clone()),
            });
        } else {
            tracing::debug!(error = %error, reason, "kafka client error; librdkafka retries it");
        }
        *self
            .trouble
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((error, reason.to_owned()));
    }
}

impl ProducerContext for DeliveryContext {
    type DeliveryOpaque = Box<Ticket>;

    fn delivery(&self, result: &DeliveryResult<'_>, t: Box<Ticket>) {
        let mut s = self.lock();
        match result {
            Ok(_) if crate::kafka::setup::fault("after-ack") => {
                // As if the process died after the broker acked the output
                // and before the input's identity was recorded.
                s.fail(Error::Stopped {
                    reason: format!("injected crash after the ack of {}", t.input()),
                    after: None,
                });
            }
            Ok(m) => {
                s.counters.outputs += 1;
                s.meters.outputs.increment(1);
                if let Some(sink) = s.sink.as_mut() {
                    let end = sink.ends.entry(m.partition()).or_insert(0);
                    *end = (*end).max(m.offset() + 1);
                }
                // A store failure keeps its type: it poisons the guard.
                if let Err(e) = s.complete(&t.topic, t.partition, t.offset) {
                    s.fail(e);
                }
            }
            Err((e, _)) => {
                s.fail(self.failed(t.input(), e));
            }
        }
    }
}
