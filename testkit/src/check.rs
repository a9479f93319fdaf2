//! Checking an exactly-once result.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::TestResult;
use crate::read::Record;

/// The values of `records` parsed as decimal integers, in read order.
///
/// # Errors
/// When a value is null or not a decimal integer.
pub fn integers(records: &[Record]) -> TestResult<Vec<u64>> {
    records
        .iter()
        .map(|r| {
            r.value_str().and_then(|v| v.parse().ok()).ok_or_else(|| {
                format!(
                    "record at partition {} offset {} has value {:?}, not an integer",
                    r.partition, r.offset, r.value
                )
                .into()
            })
        })
        .collect()
}

/// Checks that `got` holds every value of `expected` exactly once and
/// nothing else, and lists what is missing, duplicated or unexpected.
///
/// # Errors
/// When it does not.
pub fn check_each_once(got: &[u64], expected: impl IntoIterator<Item = u64>) -> TestResult {
    let expected: BTreeSet<u64> = expected.into_iter().collect();
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for &v in got {
        *counts.entry(v).or_default() += 1;
    }
    let missing: Vec<u64> = expected
        .iter()
        .filter(|v| !counts.contains_key(v))
        .copied()
        .collect();
    let duplicated: Vec<(u64, usize)> = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, c)| (*v, *c))
        .collect();
    let unexpected: Vec<u64> = counts
        .keys()
        .filter(|v| !expected.contains(v))
        .copied()
        .collect();
    if missing.is_empty() && duplicated.is_empty() && unexpected.is_empty() {
        return Ok(());
    }
    let mut message = format!(
        "not exactly once: {} values read, {} expected",
        got.len(),
        expected.len()
    );
    let _ = write!(
        message,
        "; missing {}: {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    let _ = write!(
        message,
        "; duplicated {} (value, count): {:?}",
        duplicated.len(),
        &duplicated[..duplicated.len().min(20)]
    );
    let _ = write!(
        message,
        "; unexpected {}: {:?}",
        unexpected.len(),
        &unexpected[..unexpected.len().min(20)]
    );
    Err(message.into())
}

/// Checks that `values` strictly increase.
///
/// # Errors
/// At the first place where they do not.
pub fn check_increasing(values: &[u64]) -> TestResult {
    match values.windows(2).position(|w| w[0] >= w[1]) {
        None => Ok(()),
        Some(i) => Err(format!(
            "not increasing at index {i}: {} then {} (around: {:?})",
            values[i],
            values[i + 1],
            &values[i.saturating_sub(5)..(i + 6).min(values.len())]
        )
        .into()),
    }
}

/// Decodes standard base64 (with or without padding).
///
/// # Errors
/// On a character outside the alphabet.
pub fn base64_decode(text: &str) -> TestResult<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0u32;
    for c in text.bytes().filter(|&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(format!("not base64: {text:?}").into()),
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

/// Values that appear more than once, and values of `expected` missing.
pub fn dups_and_missing(
    got: &[u64],
    expected: impl IntoIterator<Item = u64>,
) -> (Vec<u64>, Vec<u64>) {
    let mut counts = BTreeMap::new();
    for v in got {
        *counts.entry(*v).or_insert(0u32) += 1;
    }
    let dups = counts
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, _)| *v)
        .collect();
    let missing = expected
        .into_iter()
        .filter(|v| !counts.contains_key(v))
        .collect();
    (dups, missing)
}
