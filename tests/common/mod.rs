//! Helpers shared by test files that drive the library's adapters (the
//! test kit itself does not depend on the library).

use replayguard::kafka::GuardedConsumer;
use replayguard_testkit::TestResult;

/// Reads `c` to the end of its input, acking each record; returns how many.
pub async fn drain(c: &GuardedConsumer) -> TestResult<u64> {
    let mut n = 0;
    while let Some(r) = c.recv().await? {
        c.ack(&r)?;
        n += 1;
    }
    Ok(n)
}
