//! Processes: bounded runs, waits and drops, signals, and line readers.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::thread;
use std::time::{Duration, Instant};

use crate::TestResult;

/// Runs `command` to completion, killing it after `limit`.
///
/// Its stdin is `/dev/null`; its stdout and stderr are captured (drained on
/// threads, so a chatty child cannot block on a full pipe).
///
/// # Errors
/// When it cannot start, or runs past `limit` (then it is killed, and the
/// error holds what it printed).
pub fn run_bounded(command: &mut Command, limit: Duration) -> TestResult<Output> {
    let what = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("could not start {what}: {e}"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.join().map_err(|_| "stdout reader panicked")?;
    let stderr = stderr.join().map_err(|_| "stderr reader panicked")?;
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(format!(
            "{what} did not finish within {limit:?}; it was killed. stderr:\n{}",
            String::from_utf8_lossy(&stderr)
        )
        .into()),
    }
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        buf
    })
}

/// Forwards the lines of a pipe (a child's stdout, say) into a channel, so
/// they can be awaited with `recv_timeout`; the channel closes at EOF.
pub fn lines_of<R: Read + Send + 'static>(pipe: R) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Sends `signal` (a name such as `TERM`, `STOP` or `CONT`) to `pid`.
///
/// # Errors
/// When `kill` fails, for example because the process is gone.
pub fn send_signal(pid: u32, signal: &str) -> TestResult {
    let out = run_bounded(
        Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string()),
        Duration::from_secs(10),
    )?;
    if !out.status.success() {
        return Err(format!(
            "kill -{signal} {pid} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    Ok(())
}

/// Whether a process with this pid exists (and is not a zombie).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

/// Waits for `child` to exit, for at most `limit`.
///
/// # Errors
/// When it is still running after `limit` (it is left running).
pub fn wait_bounded(child: &mut Child, limit: Duration) -> TestResult<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            return Err(format!("process {} still running after {limit:?}", child.id()).into());
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Drops `value` on another thread and waits at most `limit` for it.
///
/// A librdkafka consumer's drop closes it (leaves its group), and that has
/// been seen to block for minutes; this bounds the wait. On time-out the
/// thread is left behind and an error returned.
///
/// # Errors
/// When the drop takes longer than `limit`.
pub fn drop_bounded<T: Send + 'static>(value: T, what: &str, limit: Duration) -> TestResult {
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    thread::spawn(move || {
        drop(value);
        let _ = tx.send(());
    });
    match rx.recv_timeout(limit) {
        Ok(()) => Ok(()),
        Err(_) => Err(format!(
            "dropping {what} did not finish in {limit:?} (started {:?} ago)",
            started.elapsed()
        )
        .into()),
    }
}

/// A process frozen with SIGSTOP, thawed with SIGCONT when dropped, so a
/// failing test does not leave it frozen.
pub struct Frozen(u32);

impl Frozen {
    /// Freezes `pid`.
    ///
    /// # Errors
    /// When the signal cannot be sent.
    pub fn freeze(pid: u32) -> TestResult<Self> {
        send_signal(pid, "STOP")?;
        Ok(Self(pid))
    }

    /// Thaws it now.
    ///
    /// # Errors
    /// When the signal cannot be sent.
    pub fn thaw(self) -> TestResult {
        let pid = self.0;
        std::mem::forget(self);
        send_signal(pid, "CONT")
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = send_signal(self.0, "CONT");
    }
}

/// The last `n` lines of the file at `path` (empty when it cannot be
/// read), for failure messages.
pub fn file_tail(path: &std::path::Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
