//! Tansu, a Kafka-compatible broker, for interoperability.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::process::{run_bounded, send_signal, wait_bounded};
use crate::{COMMAND_LIMIT, START_LIMIT, TestResult, free_port};

/// Where `scripts/test` installs Tansu: `$HOME/.cache/replayguard/tansu/bin/tansu`.
pub fn tansu_cache_path() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/replayguard/tansu/bin/tansu"))
}

/// The Tansu binary: `$TANSU_BIN`, else the cache path.
///
/// # Errors
/// When neither exists; the message says how to get it.
pub fn tansu_bin() -> TestResult<PathBuf> {
    if let Some(bin) = std::env::var_os("TANSU_BIN") {
        let bin = PathBuf::from(bin);
        if bin.is_file() {
            return Ok(bin);
        }
        return Err(format!(
            "TANSU_BIN={} is not a file. Unset it, or run scripts/test, which builds Tansu into \
             $HOME/.cache/replayguard/tansu (about 15 to 35 minutes once)",
            bin.display()
        )
        .into());
    }
    match tansu_cache_path() {
        Some(bin) if bin.is_file() => Ok(bin),
        _ => Err(
            "the Tansu broker is not installed. Run scripts/test, which builds it once, or \
                  `cargo install tansu --locked --features dynostore,libsql --root \
                  $HOME/.cache/replayguard/tansu` (15 to 35 minutes), or set TANSU_BIN to a \
                  tansu binary built with those features"
                .into(),
        ),
    }
}

/// A Tansu broker on a free 127.0.0.1 port, storing in sqlite in its own
/// temporary folder. Killed when dropped, and its folder removed.
pub struct TansuBroker {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    starts: u32,
}

impl TansuBroker {
    /// Starts a fresh broker and creates these topics, `(name, partitions)`.
    ///
    /// # Errors
    /// When Tansu is not installed (the message says how to get it), or
    /// does not start or create a topic within a minute.
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        let mut broker = Self {
            bin: tansu_bin()?,
            dir: tempfile::Builder::new().prefix("tansu-").tempdir()?,
            port: free_port()?,
            child: None,
            starts: 0,
        };
        broker.launch()?;
        for (name, partitions) in topics {
            broker.create_topic(name, *partitions)?;
        }
        Ok(broker)
    }

    /// The bootstrap address, `127.0.0.1:PORT`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The folder holding `broker.db` and the broker's logs.
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The running broker's pid, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Creates a topic with `tansu topic create`.
    ///
    /// # Errors
    /// When the command fails or takes more than a minute.
    pub fn create_topic(&self, name: &str, partitions: i32) -> TestResult {
        let out = run_bounded(
            Command::new(&self.bin)
                .current_dir(self.dir.path())
                .args(["topic", "create", name, "--broker"])
                .arg(format!("tcp://127.0.0.1:{}", self.port))
                .arg("--partitions")
                .arg(partitions.to_string()),
            COMMAND_LIMIT,
        )?;
        if !out.status.success() {
            return Err(format!(
                "tansu topic create {name} failed ({}): {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        Ok(())
    }

    /// Stops the broker cleanly: SIGTERM, then waits up to 30 s.
    ///
    /// # Errors
    /// When it does not exit in time (it is then killed) or exits with a
    /// failure.
    pub fn stop(&mut self) -> TestResult {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        send_signal(child.id(), "TERM")?;
        match wait_bounded(&mut child, Duration::from_secs(30)) {
            Ok(status) if status.success() => Ok(()),
            Ok(status) => Err(format!(
                "tansu exited with {status} on SIGTERM; log:\n{}",
                self.log_tail()
            )
            .into()),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("tansu ignored SIGTERM: {e}").into())
            }
        }
    }

    /// Kills the broker with SIGKILL.
    ///
    /// # Errors
    /// When it cannot be killed.
    pub fn kill(&mut self) -> TestResult {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the broker again on the same port and data folder, after
    /// [`TansuBroker::stop`] or [`TansuBroker::kill`].
    ///
    /// # Errors
    /// When it is still running, or does not start within a minute.
    pub fn restart(&mut self) -> TestResult {
        if self.child.is_some() {
            return Err("restart: the broker is still running; stop or kill it first".into());
        }
        self.launch()
    }

    /// Freezes the broker with SIGSTOP (clients see it hang, not close).
    ///
    /// # Errors
    /// When it is not running.
    pub fn pause(&self) -> TestResult {
        send_signal(
            self.pid().ok_or("pause: the broker is not running")?,
            "STOP",
        )
    }

    /// Thaws a broker frozen by [`TansuBroker::pause`].
    ///
    /// # Errors
    /// When it is not running.
    pub fn resume(&self) -> TestResult {
        send_signal(
            self.pid().ok_or("resume: the broker is not running")?,
            "CONT",
        )
    }

    /// The last lines of the current run's log, for failure messages.
    pub fn log_tail(&self) -> String {
        crate::process::file_tail(
            &self.dir.path().join(format!("broker-{}.log", self.starts)),
            40,
        )
    }

    fn launch(&mut self) -> TestResult {
        self.starts += 1;
        let log =
            std::fs::File::create(self.dir.path().join(format!("broker-{}.log", self.starts)))?;
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut child = Command::new(&self.bin)
            .current_dir(self.dir.path())
            .arg("broker")
            .arg("--listener-url")
            .arg(&url)
            .arg("--advertised-listener-url")
            .arg(&url)
            // Relative on purpose: an absolute sqlite:///path was misread.
            .arg("--storage-engine")
            .arg("sqlite://./broker.db")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("could not start {}: {e}", self.bin.display()))?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(format!(
                    "tansu exited during start-up ({status}); log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                break;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "tansu did not listen on {addr} within {START_LIMIT:?}; log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for TansuBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
