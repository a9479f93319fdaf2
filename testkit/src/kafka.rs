//! Apache Kafka 4 on loopback: one KRaft node (broker and controller in
//! one JVM) per handle, run by `scripts/kafka/broker` in a fresh folder.
//!
//! The jars come from `$KAFKA_LIBS`, else from `scripts/kafka/fetch`, which
//! fetches them from Maven Central once into the cache (`scripts/test`
//! does it before the tests run). The broker's pid is the JVM's, so SIGKILL
//! and SIGSTOP reach the broker itself, and a restart runs it again on the
//! same log folder and ports.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::process::{run_bounded, send_signal, wait_bounded};
use crate::proxy::Proxy;
use crate::{TestResult, free_ports, repo_root};

/// How long a broker may take to answer a metadata request after its
/// start. A cold JVM on a loaded 2-core machine took up to about 20 s.
const READY_LIMIT: Duration = Duration::from_secs(90);

/// How long the console consumer may run.
const CONSOLE_LIMIT: Duration = Duration::from_secs(120);

/// The folder holding Kafka's jars: `$KAFKA_LIBS`, else what
/// `scripts/kafka/fetch` prints (it fetches them the first time).
///
/// # Errors
/// When the jars cannot be had; the message is the fetch script's.
pub fn kafka_libs() -> TestResult<PathBuf> {
    static LIBS: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LIBS.get_or_init(|| {
        if let Some(libs) = std::env::var_os("KAFKA_LIBS") {
            return Ok(PathBuf::from(libs));
        }
        let out = run_bounded(
            &mut Command::new(repo_root().join("scripts/kafka/fetch")),
            Duration::from_secs(900),
        )
        .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "scripts/kafka/fetch failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    })
    .clone()
    .map_err(Into::into)
}

/// How a [`KafkaBroker`] is set up.
#[derive(Debug, Clone, Default)]
pub struct KafkaOptions {
    /// When not empty, the client listener speaks SASL_SSL (SCRAM-SHA-512
    /// and PLAIN) for these `(user, password)`s, over TLS with a
    /// certificate made for the run (see [`KafkaBroker::ca_file`]). The
    /// first user is the super user, the one [`KafkaBroker::client_config`]
    /// logs in as.
    pub sasl_users: Vec<(String, String)>,
    /// Authorization on: only the super user (the SASL user, or ANONYMOUS
    /// on plaintext) may do anything unless an ACL allows it.
    pub acl: bool,
    /// More server properties, `key=value`.
    pub properties: Vec<String>,
    /// A second plaintext listener behind a [`Proxy`] whose traffic the
    /// test can hold: a client bootstrapped at
    /// [`KafkaBroker::proxied_bootstrap`] reaches the broker only through
    /// it (the listener advertises the proxy's address).
    pub proxied: bool,
}

/// A single-node Apache Kafka on 127.0.0.1 in a temporary folder, killed
/// when dropped.
pub struct KafkaBroker {
    dir: tempfile::TempDir,
    port: u16,
    controller_port: u16,
    options: KafkaOptions,
    child: Option<Child>,
    starts: u32,
    /// The proxied listener's port and its proxy, with `proxied`.
    proxied: Option<(u16, Proxy)>,
    /// How long the last start took until a metadata request answered.
    pub last_start: Duration,
}

impl KafkaBroker {
    /// A fresh broker with these topics, `(name, partitions)`.
    ///
    /// # Errors
    /// When Java or the jars are missing, or the broker does not answer
    /// within 90 s (the error holds the tail of its log).
    pub fn start(topics: &[(&str, i32)]) -> TestResult<Self> {
        Self::start_with(KafkaOptions::default(), topics)
    }

    /// A fresh broker set up by `options`, with these topics.
    ///
    /// # Errors
    /// As [`KafkaBroker::start`].
    pub fn start_with(options: KafkaOptions, topics: &[(&str, i32)]) -> TestResult<Self> {
        kafka_libs()?;
        // Ports are free when picked, not when bound: on a clash, pick
        // again (the folder is new each time, so nothing is formatted yet).
        let mut last = String::new();
        for _ in 0..3 {
            let [port, controller_port, listener, proxy_port] = free_ports()?;
            let mut broker = Self {
                dir: tempfile::Builder::new().prefix("kafka-").tempdir()?,
                port,
                controller_port,
                options: options.clone(),
                child: None,
                starts: 0,
                proxied: None,
                last_start: Duration::ZERO,
            };
            if options.proxied {
                let upstream =
                    std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, listener));
                match Proxy::start(proxy_port, upstream) {
                    Ok(proxy) => broker.proxied = Some((listener, proxy)),
                    Err(e) if e.to_string().contains("Address already in use") => {
                        last = e.to_string();
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            if !options.sasl_users.is_empty() {
                broker.make_certificates()?;
            }
            match broker.launch() {
                Ok(()) => {
                    for (name, partitions) in topics {
                        broker.create_topic(name, *partitions)?;
                    }
                    return Ok(broker);
                }
                Err(e) if broker.log_tail().contains("Address already in use") => {
                    last = e.to_string();
                }
                Err(e) => return Err(e),
            }
        }
        Err(format!("Kafka could not bind its ports three times: {last}").into())
    }

    /// The bootstrap address, `127.0.0.1:PORT`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The proxy's bootstrap address, with `proxied`.
    pub fn proxied_bootstrap(&self) -> Option<String> {
        self.proxied.as_ref().map(|(_, p)| p.address())
    }

    /// The proxy in front of the proxied listener, with `proxied`.
    pub fn proxy(&self) -> Option<&Proxy> {
        self.proxied.as_ref().map(|(_, p)| p)
    }

    /// A client configuration that reaches this broker: the bootstrap
    /// address and, with SASL_SSL, the security settings.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = crate::client_config(&self.bootstrap());
        for (k, v) in self.security_properties() {
            c.set(k, v);
        }
        c
    }

    /// The librdkafka properties that a client of a SASL_SSL broker needs,
    /// logged in as the super user (empty on plaintext).
    pub fn security_properties(&self) -> Vec<(String, String)> {
        match self.options.sasl_users.first() {
            None => Vec::new(),
            Some((user, pass)) => self.security_properties_as(user, pass),
        }
    }

    /// The librdkafka properties of a SASL_SSL client logged in as `user`
    /// with `password` (right or wrong).
    pub fn security_properties_as(&self, user: &str, password: &str) -> Vec<(String, String)> {
        vec![
            ("security.protocol".into(), "SASL_SSL".into()),
            ("sasl.mechanism".into(), "SCRAM-SHA-512".into()),
            ("sasl.username".into(), user.to_owned()),
            ("sasl.password".into(), password.to_owned()),
            (
                "ssl.ca.location".into(),
                self.ca_file().display().to_string(),
            ),
        ]
    }

    /// Runs Kafka's ACL tool (`org.apache.kafka.tools.AclCommand`) as the
    /// super user with `args`, for example `--add --allow-principal
    /// User:bob --operation READ --topic t`.
    ///
    /// # Errors
    /// When the tool fails.
    pub fn acl(&self, args: &[&str]) -> TestResult {
        let libs = kafka_libs()?;
        let props = self.dir.path().join("admin-client.properties");
        std::fs::write(&props, self.java_client_properties())?;
        let out = run_bounded(
            Command::new("java")
                .arg("-Xmx256m")
                .arg("-cp")
                .arg(format!("{}/*", libs.display()))
                .arg(format!(
                    "-Dlog4j2.configurationFile={}",
                    repo_root()
                        .join("scripts/kafka/tools-log4j2.yaml")
                        .display()
                ))
                .arg("org.apache.kafka.tools.AclCommand")
                .args(["--bootstrap-server", &self.bootstrap()])
                .arg("--command-config")
                .arg(&props)
                .args(args),
            Duration::from_secs(60),
        )?;
        if !out.status.success() {
            return Err(format!(
                "AclCommand {args:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(())
    }

    /// The CA certificate (PEM) that signed the broker's TLS certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("tls/ca.pem")
    }

    /// The broker's folder: its configuration, data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The running broker's pid (the JVM's), if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn admin(&self) -> TestResult<AdminClient<DefaultClientContext>> {
        Ok(self.client_config().create()?)
    }

    /// Creates a topic with replication factor 1.
    ///
    /// # Errors
    /// When the broker refuses or does not answer within a minute.
    pub fn create_topic(&self, name: &str, partitions: i32) -> TestResult {
        self.create_topic_with(name, partitions, &[])
    }

    /// Creates a topic with these topic configurations.
    ///
    /// # Errors
    /// As [`KafkaBroker::create_topic`].
    pub fn create_topic_with(
        &self,
        name: &str,
        partitions: i32,
        config: &[(&str, &str)],
    ) -> TestResult {
        let admin = self.admin()?;
        let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
        for (k, v) in config {
            topic = topic.set(k, v);
        }
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(60)));
        let results = futures::executor::block_on(admin.create_topics([&topic], &options))?;
        for r in results {
            r.map_err(|(t, e)| format!("creating topic {t}: {e}"))?;
        }
        self.wait_for_topic(name, partitions)
    }

    /// Grows a topic to `partitions` partitions.
    ///
    /// # Errors
    /// When the broker refuses or does not answer within a minute.
    pub fn add_partitions(&self, name: &str, partitions: i32) -> TestResult {
        let admin = self.admin()?;
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(60)));
        let grow = rdkafka::admin::NewPartitions::new(name, partitions as usize);
        let results = futures::executor::block_on(admin.create_partitions([&grow], &options))?;
        for r in results {
            r.map_err(|(t, e)| format!("adding partitions to {t}: {e}"))?;
        }
        self.wait_for_topic(name, partitions)
    }

    /// Deletes a topic and waits until the broker no longer lists it.
    ///
    /// # Errors
    /// When the broker refuses or does not answer within a minute.
    pub fn delete_topic(&self, name: &str) -> TestResult {
        let admin = self.admin()?;
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(60)));
        let results = futures::executor::block_on(admin.delete_topics(&[name], &options))?;
        for r in results {
            r.map_err(|(t, e)| format!("deleting topic {t}: {e}"))?;
        }
        let client: BaseConsumer = self.client_config().create()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let md = client.fetch_metadata(Some(name), Duration::from_secs(5))?;
            let gone = md
                .topics()
                .iter()
                .all(|t| t.name() != name || t.error().is_some());
            if gone {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(
                    format!("topic {name} still listed a minute after its deletion").into(),
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Deletes the records of `topic`'s partition `partition` below
    /// `before` (the DeleteRecords request, as retention would): its log
    /// then starts there.
    ///
    /// # Errors
    /// When the broker refuses or does not answer within a minute.
    pub fn delete_records(&self, topic: &str, partition: i32, before: i64) -> TestResult {
        let admin = self.admin()?;
        let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(60)));
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset(topic, partition, rdkafka::Offset::Offset(before))?;
        let result = futures::executor::block_on(admin.delete_records(&tpl, &options))?;
        for e in result.elements() {
            e.error()
                .map_err(|err| format!("deleting records of {topic}[{partition}]: {err}"))?;
        }
        Ok(())
    }

    /// Waits until every partition of a new topic has a leader.
    fn wait_for_topic(&self, name: &str, partitions: i32) -> TestResult {
        let client: BaseConsumer = self.client_config().create()?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let md = client.fetch_metadata(Some(name), Duration::from_secs(5))?;
            let ready = md.topics().iter().any(|t| {
                t.name() == name
                    && t.error().is_none()
                    && t.partitions().len() == partitions as usize
                    && t.partitions().iter().all(|p| p.leader() >= 0)
            });
            if ready {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("topic {name} has no leader a minute after creation").into());
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the broker cleanly: SIGTERM, then waits up to 60 s.
    ///
    /// # Errors
    /// When it does not exit in time (it is then killed).
    pub fn stop(&mut self) -> TestResult {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        send_signal(child.id(), "TERM")?;
        match wait_bounded(&mut child, Duration::from_secs(60)) {
            Ok(_) => Ok(()),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!("Kafka ignored SIGTERM: {e}").into())
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

    /// Starts the broker again on the same ports and log folder, after
    /// [`KafkaBroker::stop`] or [`KafkaBroker::kill`].
    ///
    /// # Errors
    /// When it is still running, or does not answer within 90 s.
    pub fn restart(&mut self) -> TestResult {
        if self.child.is_some() {
            return Err("restart: the broker is still running; stop or kill it first".into());
        }
        self.launch()
    }

    /// Freezes the broker with SIGSTOP: clients see it hang, not close.
    ///
    /// # Errors
    /// When it is not running.
    pub fn pause(&self) -> TestResult {
        send_signal(
            self.pid().ok_or("pause: the broker is not running")?,
            "STOP",
        )
    }

    /// Thaws a broker frozen by [`KafkaBroker::pause`].
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

    /// Reads `topic` from its beginning with Kafka's own console consumer
    /// (`org.apache.kafka.tools.consumer.ConsoleConsumer`), until `count`
    /// records were read or none came for `idle`. Returns the values in
    /// read order, as text, with their partitions.
    ///
    /// # Errors
    /// When the tool fails or runs past two minutes.
    pub fn console_read(
        &self,
        topic: &str,
        read_committed: bool,
        count: Option<u64>,
        idle: Duration,
    ) -> TestResult<Vec<(i32, String)>> {
        let libs = kafka_libs()?;
        let mut command = Command::new("java");
        command
            .arg("-Xmx256m")
            .arg("-cp")
            .arg(format!("{}/*", libs.display()))
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                repo_root()
                    .join("scripts/kafka/tools-log4j2.yaml")
                    .display()
            ))
            .arg("org.apache.kafka.tools.consumer.ConsoleConsumer")
            .args(["--bootstrap-server", &self.bootstrap(), "--topic", topic])
            .args(["--from-beginning", "--isolation-level"])
            .arg(if read_committed {
                "read_committed"
            } else {
                "read_uncommitted"
            })
            .arg("--timeout-ms")
            .arg(idle.as_millis().to_string())
            .args(["--formatter-property", "print.partition=true"])
            .args(["--formatter-property", "print.key=false"]);
        if let Some(n) = count {
            command.arg("--max-messages").arg(n.to_string());
        }
        if !self.options.sasl_users.is_empty() {
            let props = self.dir.path().join("console-client.properties");
            std::fs::write(&props, self.java_client_properties())?;
            command.arg("--command-config").arg(props);
        }
        let out = run_bounded(&mut command, CONSOLE_LIMIT)?;
        // An idle timeout, which is how a read without a count ends, exits 0.
        if !out.status.success() {
            return Err(format!(
                "the console consumer failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        let mut records = Vec::new();
        for line in String::from_utf8(out.stdout)?.lines() {
            let (part, value) = line
                .strip_prefix("Partition:")
                .and_then(|l| l.split_once('\t'))
                .ok_or_else(|| format!("the console consumer printed {line:?}"))?;
            records.push((part.trim().parse()?, value.to_owned()));
        }
        Ok(records)
    }

    /// A Java client's properties for this broker's security settings.
    fn java_client_properties(&self) -> String {
        match self.options.sasl_users.first() {
            None => String::new(),
            Some((user, pass)) => format!(
                "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n\
                 sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule \
                 required username=\"{user}\" password=\"{pass}\";\n\
                 ssl.truststore.type=PEM\nssl.truststore.location={}\n",
                self.ca_file().display()
            ),
        }
    }

    /// A CA and a server certificate for 127.0.0.1, made with openssl.
    fn make_certificates(&self) -> TestResult {
        let out = run_bounded(
            Command::new(repo_root().join("scripts/kafka/tls-setup")).arg(self.dir.path()),
            Duration::from_secs(120),
        )?;
        if !out.status.success() {
            return Err(format!(
                "scripts/kafka/tls-setup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(())
    }

    fn launch(&mut self) -> TestResult {
        self.starts += 1;
        let log =
            std::fs::File::create(self.dir.path().join(format!("broker-{}.log", self.starts)))?;
        let mut command = Command::new(repo_root().join("scripts/kafka/broker"));
        command
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--controller-port")
            .arg(self.controller_port.to_string())
            .env("KAFKA_LIBS", kafka_libs()?);
        if !self.options.sasl_users.is_empty() {
            let users: Vec<String> = self
                .options
                .sasl_users
                .iter()
                .map(|(u, p)| format!("{u}:{p}"))
                .collect();
            command.arg("--sasl-ssl").arg(users.join(","));
        }
        if self.options.acl {
            command.arg("--acl");
        }
        if let Some((listener, proxy)) = &self.proxied {
            let advertised = proxy.address();
            let port = advertised.rsplit(':').next().unwrap_or_default();
            command.arg("--proxied").arg(format!("{listener}:{port}"));
        }
        for p in &self.options.properties {
            command.arg("--set").arg(p);
        }
        let started = Instant::now();
        let mut child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("could not start scripts/kafka/broker: {e}"))?;
        let client: BaseConsumer = self.client_config().create()?;
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(format!(
                    "Kafka exited during start-up ({status}); log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            if let Ok(md) = client.fetch_metadata(None, Duration::from_millis(500))
                && !md.brokers().is_empty()
            {
                break;
            }
            if started.elapsed() >= READY_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "Kafka did not answer a metadata request within {READY_LIMIT:?}; log:\n{}",
                    self.log_tail()
                )
                .into());
            }
            thread::sleep(Duration::from_millis(100));
        }
        self.last_start = started.elapsed();
        self.child = Some(child);
        Ok(())
    }
}

impl Drop for KafkaBroker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = send_signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
