//! What the engine's benches share: the thread's CPU clock and the
//! content fingerprint of record `i`.

use std::time::Duration;

use replayguard::Fingerprint;

/// CPU time of the calling thread.
pub fn thread_cpu_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a
    // constant the kernel knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The content fingerprint of record `i`.
pub fn fp(i: u64) -> Fingerprint {
    Fingerprint::content(None, Some(&i.to_le_bytes()))
}
