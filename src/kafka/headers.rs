//! The headers every guarded output record carries.

use crate::fingerprint::Fingerprint;

/// Header holding the input's content fingerprint (17 bytes, see
/// [`Fingerprint::to_bytes`]).
pub const FINGERPRINT_HEADER: &str = "replayguard-fp";

/// Header holding the input's source position: partition (i32 BE), offset
/// (i64 BE), then the topic name in UTF-8.
pub const SOURCE_HEADER: &str = "replayguard-src";

/// Where an output record came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePosition {
    /// Input topic.
    pub topic: String,
    /// Input partition.
    pub partition: i32,
    /// Input offset.
    pub offset: i64,
}

impl SourcePosition {
    /// Encodes the position as the [`SOURCE_HEADER`] value.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(12 + self.topic.len());
        v.extend_from_slice(&self.partition.to_be_bytes());
        v.extend_from_slice(&self.offset.to_be_bytes());
        v.extend_from_slice(self.topic.as_bytes());
        v
    }

    /// Decodes a [`SOURCE_HEADER`] value.
    #[must_use]
    pub fn decode(v: &[u8]) -> Option<Self> {
        let partition = i32::from_be_bytes(v.get(..4)?.try_into().ok()?);
        let offset = i64::from_be_bytes(v.get(4..12)?.try_into().ok()?);
        let topic = std::str::from_utf8(v.get(12..)?).ok()?.to_owned();
        Some(SourcePosition {
            topic,
            partition,
            offset,
        })
    }
}

/// Reads both guard headers from a record's headers.
pub(crate) fn read_guard_headers(
    headers: Option<&impl rdkafka::message::Headers>,
) -> Option<(SourcePosition, Option<Fingerprint>)> {
    let headers = headers?;
    let mut src = None;
    let mut fp = None;
    for h in headers.iter() {
        match h.key {
            SOURCE_HEADER => src = h.value.and_then(SourcePosition::decode),
            FINGERPRINT_HEADER => fp = h.value.and_then(Fingerprint::from_bytes),
            _ => {}
        }
    }
    Some((src?, fp))
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn source_round_trips() {
        let s = SourcePosition {
            topic: "in.put".into(),
            partition: 7,
            offset: 1 << 40,
        };
        assert_eq!(SourcePosition::decode(&s.encode()), Some(s));
        assert_eq!(SourcePosition::decode(b"short"), None);
    }
}
