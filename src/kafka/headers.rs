//! The headers every guarded output record carries.

use crate::fingerprint::Fingerprint;

/// Header holding the input's content fingerprint (17 bytes, see
/// [`Fingerprint::to_bytes`]).
pub const FINGERPRINT_HEADER: &str = "replayguard-fp";

/// Header holding the input's source position: partition (i32 BE), offset
/// (i64 BE), then the topic name in UTF-8.
pub const SOURCE_HEADER: &str = "replayguard-src";

/// Header on the outputs of an input that has more than one: the output's
/// index and the input's output count (u32 BE each). Absent means "the only
/// output". Reconciliation counts an input as handled only when all of its
/// outputs are found.
pub const PART_HEADER: &str = "replayguard-part";

/// Encodes a [`PART_HEADER`] value.
#[must_use]
pub(crate) fn encode_part(index: u32, count: u32) -> [u8; 8] {
    let mut v = [0u8; 8];
    v[..4].copy_from_slice(&index.to_be_bytes());
    v[4..].copy_from_slice(&count.to_be_bytes());
    v
}

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
/// What an output record says of its input.
pub(crate) struct GuardHeaders {
    pub src: SourcePosition,
    pub fp: Option<Fingerprint>,
    /// (index, count) of this output among its input's outputs.
    pub part: (u32, u32),
}

pub(crate) fn read_guard_headers(
    headers: Option<&impl rdkafka::message::Headers>,
) -> Option<GuardHeaders> {
    let headers = headers?;
    let mut src = None;
    let mut fp = None;
    let mut part = (0, 1);
    for h in headers.iter() {
        match h.key {
            SOURCE_HEADER => src = h.value.and_then(SourcePosition::decode),
            FINGERPRINT_HEADER => fp = h.value.and_then(Fingerprint::from_bytes),
            PART_HEADER => {
                if let Some(v) = h.value.filter(|v| v.len() == 8) {
                    let i = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
                    let n = u32::from_be_bytes([v[4], v[5], v[6], v[7]]);
                    if i < n {
                        part = (i, n);
                    }
                }
            }
            _ => {}
        }
    }
    Some(GuardHeaders {
        src: src?,
        fp,
        part,
    })
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
