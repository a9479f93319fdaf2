//! Record identity: positions and content fingerprints.
//!
//! Every function here is a stable function of its input: the seed is fixed
//! and no per-process randomness is involved, so the same record gives the
//! same fingerprint in every process and every release of format version 1.

use std::cell::RefCell;

use xxhash_rust::xxh3::{Xxh3, xxh3_128_with_seed};

/// The fixed seed of every content hash. Changing it changes the on-disk
/// format: it is part of format version 1.
pub const SEED: u64 = 0x7270_6775_6172_6401; // "rpguard" + 1

/// Domain tags keep the identity kinds apart: a key hash never equals a
/// content hash of the same bytes.
const TAG_CONTENT: u8 = b'C';
const TAG_KEY: u8 = b'K';
const TAG_HEADER: u8 = b'H';

/// The content identity of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fingerprint {
    /// A 128-bit xxh3 hash (of key and value, of the key, or of a header).
    Hash(u128),
    /// A user-supplied id. Dense ids are stored in a roaring bitmap.
    Id(u64),
}

impl Fingerprint {
    /// The default identity: xxh3-128 of key and value.
    ///
    /// Lengths and presence are encoded, so key `"ab"` with value `"c"`
    /// differs from key `"a"` with value `"bc"`, and a missing key differs
    /// from an empty one.
    #[must_use]
    pub fn content(key: Option<&[u8]>, value: Option<&[u8]>) -> Self {
        Fingerprint::Hash(hash_parts(TAG_CONTENT, &[key, value]))
    }

    /// Identity from the key alone (a keyed, upsert-like stream).
    #[must_use]
    pub fn key(key: Option<&[u8]>) -> Self {
        Fingerprint::Hash(hash_parts(TAG_KEY, &[key]))
    }

    /// Identity from one header's value; the header name is hashed in too.
    #[must_use]
    pub fn header(name: &str, value: Option<&[u8]>) -> Self {
        Fingerprint::Hash(hash_parts(TAG_HEADER, &[Some(name.as_bytes()), value]))
    }

    /// A user-supplied id (for example a parsed business sequence number).
    #[must_use]
    pub fn id(id: u64) -> Self {
        Fingerprint::Id(id)
    }

    /// The fingerprint as 17 bytes: a kind byte and 16 bytes big-endian.
    /// This is the form carried in output headers.
    #[must_use]
    pub fn to_bytes(self) -> [u8; 17] {
        let mut out = [0u8; 17];
        match self {
            Fingerprint::Hash(h) => {
                out[0] = b'h';
                out[1..].copy_from_slice(&h.to_be_bytes());
            }
            Fingerprint::Id(id) => {
                out[0] = b'i';
                out[9..].copy_from_slice(&id.to_be_bytes());
            }
        }
        out
    }

    /// Parses the form written by [`Fingerprint::to_bytes`].
    #[must_use]
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let body: [u8; 16] = bytes.get(1..17)?.try_into().ok()?;
        if bytes.len() != 17 {
            return None;
        }
        match bytes[0] {
            b'h' => Some(Fingerprint::Hash(u128::from_be_bytes(body))),
            b'i' => {
                let id: [u8; 8] = body[8..].try_into().ok()?;
                Some(Fingerprint::Id(u64::from_be_bytes(id)))
            }
            _ => None,
        }
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fingerprint::Hash(h) => write!(f, "h:{h:032x}"),
            Fingerprint::Id(id) => write!(f, "id:{id}"),
        }
    }
}

/// Records whose hashed bytes are longer than this are streamed, so that
/// no thread keeps a large buffer ([`hash_parts`]).
const ONE_SHOT_BYTES: usize = 64 * 1024;

thread_local! {
    /// The bytes of the record being hashed, kept between records.
    static LAID_OUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Records this short are laid out on the stack instead of the thread's
/// buffer (most are): no thread-local lookup, and a buffer small enough
/// to clear.
const ON_STACK_BYTES: usize = 256;

/// xxh3-128 of `tag` and then each part as [`lay_out`] encodes it: the
/// bytes laid out in one buffer and hashed in one call, up to
/// [`ONE_SHOT_BYTES`]. The one-shot hash and the streaming one give the
/// same value for the same bytes, and the one-shot skips the streaming
/// state's setup and its buffering: 1.6 times as fast for a 100-byte
/// value, 1.03 for 1,000 bytes (BENCHMARKS.md, "Fingerprints hashed in
/// one call").
fn hash_parts(tag: u8, parts: &[Option<&[u8]>]) -> u128 {
    let len = 1 + parts
        .iter()
        .map(|p| p.map_or(1, |b| 9 + b.len()))
        .sum::<usize>();
    if len <= ON_STACK_BYTES {
        let mut buf = [0u8; ON_STACK_BYTES];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            buf[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        lay_out(tag, parts, &mut put);
        return xxh3_128_with_seed(&buf[..at], SEED);
    }
    if len <= ONE_SHOT_BYTES {
        let one_shot = LAID_OUT.try_with(|buf| {
            let mut buf = buf.try_borrow_mut().ok()?;
            buf.clear();
            lay_out(tag, parts, &mut |bytes| buf.extend_from_slice(bytes));
            Some(xxh3_128_with_seed(&buf, SEED))
        });
        if let Ok(Some(h)) = one_shot {
            return h;
        }
    }
    let mut h = Xxh3::with_seed(SEED);
    lay_out(tag, parts, &mut |bytes| h.update(bytes));
    h.digest128()
}

/// Hands the hashed bytes to `put` in order: the tag, then for each part a
/// byte for its presence, and its length (u64 LE) and bytes if present.
#[inline]
fn lay_out(tag: u8, parts: &[Option<&[u8]>], put: &mut impl FnMut(&[u8])) {
    put(&[tag]);
    for part in parts {
        match part {
            None => put(&[0]),
            Some(bytes) => {
                put(&[1]);
                put(&(bytes.len() as u64).to_le_bytes());
                put(bytes);
            }
        }
    }
}

/// Which part of a record is its identity.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum Identity {
    /// xxh3-128 of key and value (the default).
    #[default]
    Content,
    /// xxh3-128 of the key. A record without a key has no identity: it
    /// falls back to its position alone (records without a key are not
    /// resends of each other).
    Key,
    /// xxh3-128 of the named header's value. A record without the header,
    /// or whose header has no value, falls back to its position alone.
    Header(String),
    /// Position only: `(partition, offset)`. Catches the application's own
    /// replays, not upstream resends.
    Offset,
    /// A user function of key and value, for example a parsed business id
    /// given as [`Fingerprint::id`] (dense ids are stored in roaring). It
    /// returns `None` for a record without an id, which is then identified
    /// by its position alone.
    Custom(IdentityFn),
}

/// A user identity function, see [`Identity::Custom`].
#[derive(Clone)]
pub struct IdentityFn(std::sync::Arc<KeyValueFn>, std::sync::Arc<str>);

/// The signature of a user identity function: (key, value) to identity.
type KeyValueFn = dyn Fn(Option<&[u8]>, Option<&[u8]>) -> Option<Fingerprint> + Send + Sync;

impl IdentityFn {
    /// Wraps a function of (key, value). Its name is `custom`; a state
    /// folder cannot tell two unnamed functions apart, see
    /// [`IdentityFn::named`].
    pub fn new(
        f: impl Fn(Option<&[u8]>, Option<&[u8]>) -> Option<Fingerprint> + Send + Sync + 'static,
    ) -> Self {
        Self::named("custom", f)
    }

    /// Wraps a function of (key, value) under a name. The state folder
    /// records the name with its job, and refuses a run whose identity has
    /// another name: give a changed function a new name.
    pub fn named(
        name: impl AsRef<str>,
        f: impl Fn(Option<&[u8]>, Option<&[u8]>) -> Option<Fingerprint> + Send + Sync + 'static,
    ) -> Self {
        IdentityFn(std::sync::Arc::new(f), std::sync::Arc::from(name.as_ref()))
    }

    /// The function's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.1
    }
}

impl std::fmt::Debug for IdentityFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdentityFn({})", self.1)
    }
}

impl PartialEq for IdentityFn {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for IdentityFn {}

impl Identity {
    /// The identity's name, as a state folder records it: `content`,
    /// `key`, `header:NAME`, `offset` or `custom:NAME`.
    #[must_use]
    pub fn label(&self) -> String {
        match self {
            Identity::Content => "content".into(),
            Identity::Key => "key".into(),
            Identity::Header(name) => format!("header:{name}"),
            Identity::Offset => "offset".into(),
            Identity::Custom(f) => format!("custom:{}", f.name()),
        }
    }

    /// Computes the fingerprint of a record under this identity.
    ///
    /// `header` looks up a header value by name (`None` when absent).
    /// Returns `None` when the identity is position-only, or when the
    /// chosen key or header value is missing.
    pub fn fingerprint<'a>(
        &self,
        key: Option<&[u8]>,
        value: Option<&[u8]>,
        header: impl FnOnce(&str) -> Option<Option<&'a [u8]>>,
    ) -> Option<Fingerprint> {
        match self {
            Identity::Content => Some(Fingerprint::content(key, value)),
            Identity::Key => key.map(|k| Fingerprint::key(Some(k))),
            Identity::Header(name) => header(name)
                .flatten()
                .map(|v| Fingerprint::header(name, Some(v))),
            Identity::Offset => None,
            Identity::Custom(f) => (f.0)(key, value),
        }
    }
}

impl std::str::FromStr for Identity {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "content" => Ok(Identity::Content),
            "key" => Ok(Identity::Key),
            "offset" => Ok(Identity::Offset),
            other => match other.strip_prefix("header:") {
                Some(name) if !name.is_empty() => Ok(Identity::Header(name.to_owned())),
                _ => Err(crate::Error::Config(format!(
                    "unknown identity {other:?}: use content, key, header:NAME or offset"
                ))),
            },
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn lengths_are_encoded() {
        assert_ne!(
            Fingerprint::content(Some(b"ab"), Some(b"c")),
            Fingerprint::content(Some(b"a"), Some(b"bc"))
        );
        assert_ne!(
            Fingerprint::content(None, Some(b"x")),
            Fingerprint::content(Some(b""), Some(b"x"))
        );
        assert_ne!(
            Fingerprint::content(Some(b"k"), None),
            Fingerprint::key(Some(b"k"))
        );
    }

    #[test]
    fn stable_across_processes() {
        // A fixed value: if this changes, format version 1 changed.
        assert_eq!(
            Fingerprint::content(Some(b"key"), Some(b"value")),
            Fingerprint::Hash(182_087_107_062_433_800_866_833_155_480_943_461_799)
        );
    }

    /// Feeds one part: a byte for its presence, then its length and bytes.
    fn feed(h: &mut Xxh3, part: Option<&[u8]>) {
        match part {
            None => h.update(&[0]),
            Some(bytes) => {
                h.update(&[1]);
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(bytes);
            }
        }
    }

    /// The streaming hash of `feed`'s encoding, which the one-shot paths
    /// must match.
    fn streamed(tag: u8, parts: &[Option<&[u8]>]) -> u128 {
        let mut h = Xxh3::with_seed(SEED);
        h.update(&[tag]);
        for &part in parts {
            feed(&mut h, part);
        }
        h.digest128()
    }

    #[test]
    fn the_one_shot_hash_is_the_streamed_hash_at_every_length() {
        let bytes: Vec<u8> = (0..ONE_SHOT_BYTES as u32 + 700)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mut one_shot = 0;
        // Every short length, either side of the stack's limit, and
        // either side of the one-shot limit (tag, two presence bytes and
        // two lengths: 19 bytes more than key and value).
        let near = ONE_SHOT_BYTES - 19 - 200;
        let values = (0..=400).chain((near..near + 400).step_by(9));
        let (mut on_stack, mut streamed_ones) = (0, 0);
        for vlen in values {
            for klen in [0, 1, 5, 16, 100, 240] {
                let (key, value) = (&bytes[..klen], &bytes[klen..klen + vlen]);
                let parts = [Some(key), Some(value)];
                let len = 19 + klen + vlen;
                on_stack += usize::from(len <= ON_STACK_BYTES);
                one_shot += usize::from(len > ON_STACK_BYTES && len <= ONE_SHOT_BYTES);
                streamed_ones += usize::from(len > ONE_SHOT_BYTES);
                assert_eq!(
                    Fingerprint::content(Some(key), Some(value)),
                    Fingerprint::Hash(streamed(TAG_CONTENT, &parts)),
                    "key {klen} B, value {vlen} B"
                );
                assert_eq!(
                    Fingerprint::content(None, Some(value)),
                    Fingerprint::Hash(streamed(TAG_CONTENT, &[None, Some(value)]))
                );
                assert_eq!(
                    Fingerprint::header("h", Some(value)),
                    Fingerprint::Hash(streamed(TAG_HEADER, &[Some(b"h"), Some(value)]))
                );
                assert_eq!(
                    Fingerprint::key(Some(value)),
                    Fingerprint::Hash(streamed(TAG_KEY, &[Some(value)]))
                );
            }
        }
        assert_eq!(
            Fingerprint::key(None),
            Fingerprint::Hash(streamed(TAG_KEY, &[None]))
        );
        // Each of the three ways was taken.
        assert!(
            on_stack > 1000 && one_shot > 1000 && streamed_ones > 20,
            "{on_stack} {one_shot} {streamed_ones}"
        );
    }

    #[test]
    fn bytes_round_trip() {
        for fp in [
            Fingerprint::content(Some(b"a"), None),
            Fingerprint::id(u64::MAX),
            Fingerprint::id(7),
        ] {
            assert_eq!(Fingerprint::from_bytes(&fp.to_bytes()), Some(fp));
        }
        assert_eq!(Fingerprint::from_bytes(b"x"), None);
        assert_eq!(Fingerprint::from_bytes(&[b'z'; 17]), None);
    }

    #[test]
    fn a_missing_key_or_header_value_is_no_identity() {
        let none = |_: &str| None;
        let null = |_: &str| Some(None);
        let empty = |_: &str| Some(Some(&b""[..]));
        let by_key = Identity::Key;
        assert_eq!(by_key.fingerprint(None, Some(b"v"), none), None);
        assert_eq!(
            by_key.fingerprint(Some(b""), Some(b"v"), none),
            Some(Fingerprint::key(Some(b"")))
        );
        let by_header = Identity::Header("id".into());
        assert_eq!(by_header.fingerprint(Some(b"k"), None, none), None);
        assert_eq!(by_header.fingerprint(Some(b"k"), None, null), None);
        assert_eq!(
            by_header.fingerprint(None, None, empty),
            Some(Fingerprint::header("id", Some(b"")))
        );
    }

    #[test]
    fn identity_parses() -> crate::Result<()> {
        assert_eq!(
            "header:id".parse::<Identity>()?,
            Identity::Header("id".into())
        );
        assert!("header:".parse::<Identity>().is_err());
        assert!("bogus".parse::<Identity>().is_err());
        Ok(())
    }
}
