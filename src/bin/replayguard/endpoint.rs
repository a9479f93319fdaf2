//! `--metrics-addr`: one port that answers `/metrics` (the Prometheus
//! exporter's rendering of the library's metrics) and `/health`.
//!
//! The address is bound before any broker is contacted, so that a port in
//! use or a bad address is a usage error at start, never later. The
//! exporter is installed as the `metrics` recorder only then: without the
//! flag nothing is recorded.

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::task::JoinHandle;

use crate::common::Failure;

/// Histogram buckets of every `_seconds` histogram: a checkpoint takes
/// milliseconds, a recovery or a fence wait up to tens of seconds.
const SECONDS_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// How often the exporter's histograms are rolled up, and how often the
/// checkpoint count is looked at for `/health`.
const UPKEEP: Duration = Duration::from_secs(5);
const WATCH: Duration = Duration::from_millis(200);

/// Allowance on top of three checkpoint intervals before `/health` calls
/// the guard stalled: a checkpoint may wait for outputs in flight, or a
/// rebalance's recovery.
const STALL_ALLOWANCE: Duration = Duration::from_secs(10);

/// The address of `--metrics-addr`, bound.
pub struct Bound {
    listener: TcpListener,
    addr: SocketAddr,
}

/// Binds `addr` (`HOST:PORT`). A usage error naming the flag when it does
/// not parse, does not resolve, or cannot be listened on.
pub fn bind(addr: &str) -> Result<Bound, Failure> {
    let usage = |why: String| Failure::usage(format!("--metrics-addr {addr}: {why}"));
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| usage(format!("not a HOST:PORT address ({e})")))?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpListener::bind(a) {
            Ok(listener) => {
                let addr = listener.local_addr().unwrap_or(*a);
                listener
                    .set_nonblocking(true)
                    .map_err(|e| usage(format!("cannot listen there: {e}")))?;
                return Ok(Bound { listener, addr });
            }
            Err(e) => last = Some(e),
        }
    }
    Err(usage(match last {
        Some(e) => format!("cannot listen there: {e}"),
        None => "the name resolves to no address".to_owned(),
    }))
}

/// Where the guard is in its life, for `/health`.
#[derive(Clone, Debug)]
enum Phase {
    /// Connecting to the brokers and recovering the state.
    Starting,
    /// Running; healthy while it checkpoints.
    Running,
    /// A stop was asked for or the input ended: the final checkpoint.
    Stopping,
    /// The run is over: why.
    Ended(String),
}

struct State {
    phase: Phase,
    checkpoints: u64,
    last_checkpoint: Instant,
}

/// The guard's health as `/health` reports it. Cheap to clone.
#[derive(Clone)]
pub struct Health {
    state: Arc<Mutex<State>>,
    stall_after: Duration,
}

impl Health {
    /// A guard that checkpoints every `interval`, starting.
    pub fn new(interval: Duration) -> Health {
        Health {
            state: Arc::new(Mutex::new(State {
                phase: Phase::Starting,
                checkpoints: 0,
                last_checkpoint: Instant::now(),
            })),
            stall_after: interval.saturating_mul(3) + STALL_ALLOWANCE,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The guard runs; `checkpoints()` counts its checkpoints, looked at
    /// every 200 ms until the returned task is aborted.
    pub fn running<F>(&self, checkpoints: F) -> JoinHandle<()>
    where
        F: Fn() -> u64 + Send + 'static,
    {
        {
            let mut s = self.lock();
            s.phase = Phase::Running;
            s.checkpoints = checkpoints();
            s.last_checkpoint = Instant::now();
        }
        let health = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH);
            loop {
                tick.tick().await;
                let n = checkpoints();
                let mut s = health.lock();
                if n != s.checkpoints {
                    s.checkpoints = n;
                    s.last_checkpoint = Instant::now();
                }
            }
        })
    }

    /// The run is ending: its final checkpoint, or its failure's cleanup.
    pub fn stopping(&self) {
        self.lock().phase = Phase::Stopping;
    }

    /// The run is over, for `reason`.
    pub fn ended(&self, reason: impl Into<String>) {
        self.lock().phase = Phase::Ended(reason.into());
    }

    /// The status and body of `/health`.
    fn report(&self) -> (StatusCode, String) {
        let s = self.lock();
        match &s.phase {
            Phase::Starting => (
                StatusCode::SERVICE_UNAVAILABLE,
                "starting: connecting to the brokers and recovering the state\n".to_owned(),
            ),
            Phase::Running => {
                let since = s.last_checkpoint.elapsed();
                let what = if s.checkpoints == 0 {
                    "no checkpoint since the start"
                } else {
                    "last checkpoint"
                };
                if since > self.stall_after {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "stalled: {what} {:.1}s ago, more than {:.0}s\n",
                            since.as_secs_f64(),
                            self.stall_after.as_secs_f64()
                        ),
                    )
                } else {
                    (
                        StatusCode::OK,
                        format!("ok: {what} {:.1}s ago\n", since.as_secs_f64()),
                    )
                }
            }
            Phase::Stopping => (
                StatusCode::SERVICE_UNAVAILABLE,
                "stopping: taking the final checkpoint\n".to_owned(),
            ),
            Phase::Ended(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
        }
    }
}

/// The running endpoint; aborted when dropped.
pub struct Endpoint {
    server: JoinHandle<()>,
    upkeep: JoinHandle<()>,
    pub health: Health,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.abort();
        self.upkeep.abort();
    }
}

/// Installs the Prometheus exporter as the metrics recorder and serves
/// `bound`; must run on the tokio runtime.
pub fn start(bound: Bound, health: Health) -> Result<Endpoint, Failure> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &SECONDS_BUCKETS)
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| Failure::runtime(format!("cannot start the metrics exporter: {e}")))?;
    replayguard::kafka::describe_metrics();
    let listener = tokio::net::TcpListener::from_std(bound.listener).map_err(|e| {
        Failure::runtime(format!("--metrics-addr {}: cannot listen: {e}", bound.addr))
    })?;
    tracing::info!(addr = %bound.addr, "serving /metrics and /health");
    let upkeep = {
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(UPKEEP);
            loop {
                tick.tick().await;
                handle.run_upkeep();
            }
        })
    };
    let app = Arc::new(App {
        metrics: handle,
        health: health.clone(),
    });
    let server = tokio::spawn(serve(listener, app));
    Ok(Endpoint {
        server,
        upkeep,
        health,
    })
}

struct App {
    metrics: PrometheusHandle,
    health: Health,
}

async fn serve(listener: tokio::net::TcpListener, app: Arc<App>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, for one: try again shortly.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let app = app.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let app = app.clone();
                async move { Ok::<_, Infallible>(app.answer(&req)) }
            });
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "metrics endpoint: connection ended");
            }
        });
    }
}

impl App {
    fn answer(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".to_owned());
        }
        match req.uri().path() {
            "/metrics" => {
                let mut r = text(StatusCode::OK, self.metrics.render());
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            "/health" => {
                let (status, body) = self.health.report();
                text(status, body)
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /metrics or /health\n".to_owned(),
            ),
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// What `pipe` and `consume` do with `--metrics-addr`: nothing without it.
pub struct Ops {
    endpoint: Option<Endpoint>,
    watcher: Option<JoinHandle<()>>,
    linger: Duration,
}

impl Ops {
    /// Serves `bound`, if any; the guard is starting. `interval` is the
    /// checkpoint interval, `linger` how long to go on answering once the
    /// run is over.
    pub fn start(
        bound: Option<Bound>,
        interval: Duration,
        linger: Duration,
    ) -> Result<Ops, Failure> {
        let endpoint = bound.map(|b| start(b, Health::new(interval))).transpose()?;
        Ok(Ops {
            endpoint,
            watcher: None,
            linger,
        })
    }

    /// The guard runs; `checkpoints()` is its checkpoint count.
    pub fn running<F>(&mut self, checkpoints: F)
    where
        F: Fn() -> u64 + Send + 'static,
    {
        if let Some(e) = &self.endpoint {
            self.watcher = Some(e.health.running(checkpoints));
        }
    }

    /// The run is ending: its final checkpoint.
    pub fn stopping(&self) {
        if let Some(e) = &self.endpoint {
            e.health.stopping();
        }
    }

    /// A future that completes with `stop`, marking the guard stopping.
    pub fn stopping_on<S>(&self, stop: S) -> impl Future<Output = ()> + use<S>
    where
        S: Future<Output = ()>,
    {
        let health = self.endpoint.as_ref().map(|e| e.health.clone());
        async move {
            stop.await;
            if let Some(h) = health {
                h.stopping();
            }
        }
    }

    /// The run is over with `result`; the stats the watcher held are
    /// released.
    pub async fn finished(&mut self, result: &Result<(), Failure>) {
        if let Some(w) = self.watcher.take() {
            w.abort();
            let _ = w.await;
        }
        if let Some(e) = &self.endpoint {
            e.health.ended(match result {
                Ok(()) => "stopped: the run ended with a final checkpoint".to_owned(),
                Err(f) => format!("failed ({}): {}", f.kind, f.message),
            });
        }
    }

    /// Goes on answering for the linger, or until a signal; then stops.
    pub async fn linger(self, stop: &crate::common::Stop) {
        if self.endpoint.is_some() && !self.linger.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(self.linger) => {}
                () = stop.wait() => {}
            }
        }
    }

    /// A run that ended before its guard was built: [`Ops::finished`],
    /// then [`Ops::linger`]; returns `result`.
    pub async fn end(
        mut self,
        result: Result<(), Failure>,
        stop: &crate::common::Stop,
    ) -> Result<(), Failure> {
        self.finished(&result).await;
        self.linger(stop).await;
        result
    }
}
