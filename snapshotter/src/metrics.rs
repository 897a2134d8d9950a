//! The Prometheus endpoint: `GET /metrics` over plain HTTP (loopback by default,
//! `[metrics] address`), in the OpenMetrics text format
//! (`application/openmetrics-text; version=1.0.0`), which Prometheus reads.
//!
//! Two kinds of metric:
//!
//! * **Event metrics**, kept in memory since the daemon started: outcomes by kind
//!   and the durations of each publish (from the engine's outcome events and the
//!   timings recorded on the outcome), and errors answered on the two gRPC
//!   sockets by kind (containerd's errdefs names).
//! * **State metrics**, read at each scrape: live sessions by owner kind, the
//!   depth of every branch head, squash and GC runs since the engine started, and
//!   the store's real allocated bytes per accounting class (a full walk, so taken
//!   at most once a minute).
//!
//! Names, types and units are listed in `docs/operations.md`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use layerstack_engine::store::{OutcomeKind, PublishTimings};
use layerstack_engine::Engine;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use tracing::{debug, warn};

/// The content type of a scrape's answer.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    api: &'static str,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OwnerLabels {
    owner_kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: &'static str,
}

/// How old the accounting gauges may be: each computation walks every layer and
/// upper (`layerstack df`), too much for every scrape.
const USAGE_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BranchLabels {
    namespace: String,
    stack: String,
    branch: String,
}

/// Every outcome kind, so that each series exists (at 0) from the start: a
/// counter that appears only at its first increment hides that increment from
/// `rate()`.
const OUTCOMES: [OutcomeKind; 11] = [
    OutcomeKind::Committed,
    OutcomeKind::Checkpointed,
    OutcomeKind::Merged,
    OutcomeKind::NoChange,
    OutcomeKind::Conflict,
    OutcomeKind::Discarded,
    OutcomeKind::Failed,
    OutcomeKind::Busy,
    OutcomeKind::Unsupported,
    OutcomeKind::Unknown,
    OutcomeKind::Interrupted,
];

/// Duration buckets, in seconds: 0.25 ms to about 4.4 min, ×4 each (11 buckets).
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.00025, 4.0, 11))
}

/// Byte buckets: 4 KiB to 4 TiB, ×4 each (16 buckets).
fn bytes_histogram() -> Histogram {
    Histogram::new(exponential_buckets(4096.0, 4.0, 16))
}

/// The daemon's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    publishes: Family<OutcomeLabels, Counter>,
    publish_duration: Histogram,
    capture_duration: Histogram,
    gate_wait: Histogram,
    gate_hold: Histogram,
    capture_bytes: Histogram,
    errors: Family<ErrorLabels, Counter>,
    missed_events: Counter,
    /// Ready inits waiting for a session (`owned::ReadyInits` sets it).
    ready_inits: Gauge,
    /// The last accounting (docs/architecture.md, "History: branches, squash, GC,
    /// accounting") and when it was taken.
    usage: tokio::sync::Mutex<Option<(std::time::Instant, layerstack_engine::store::Usage)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Every event metric at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let publishes = Family::<OutcomeLabels, Counter>::default();
        for k in OUTCOMES {
            let _ = publishes.get_or_create(&OutcomeLabels {
                outcome: k.as_str(),
            });
        }
        registry.register(
            "layerstack_publishes",
            "Runs of sessions ended, by outcome (committed, merged, no-change, conflict, discarded, failed, busy, unsupported, unknown)",
            publishes.clone(),
        );
        let publish_duration = duration_histogram();
        registry.register_with_unit(
            "layerstack_publish_duration",
            "Whole publish, from its start to the recorded outcome (outcomes that gated: committed, merged, conflict)",
            Unit::Seconds,
            publish_duration.clone(),
        );
        let capture_duration = duration_histogram();
        registry.register_with_unit(
            "layerstack_publish_capture_duration",
            "Capture, sealing and gate planning of a publish, outside the gate",
            Unit::Seconds,
            capture_duration.clone(),
        );
        let gate_wait = duration_histogram();
        registry.register_with_unit(
            "layerstack_publish_gate_wait",
            "Time a publish waited for its branch's gate",
            Unit::Seconds,
            gate_wait.clone(),
        );
        let gate_hold = duration_histogram();
        registry.register_with_unit(
            "layerstack_publish_gate_hold",
            "Time a publish held its branch's gate (head re-check, re-plan, apply, commit)",
            Unit::Seconds,
            gate_hold.clone(),
        );
        let capture_bytes = bytes_histogram();
        registry.register_with_unit(
            "layerstack_publish_capture",
            "Content bytes of the files a publish captured as written (their sizes summed; outcomes that gated: committed, merged, conflict)",
            Unit::Bytes,
            capture_bytes.clone(),
        );
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "layerstack_errors",
            "gRPC requests answered with an error, by socket (api: snapshots, admin) and error kind (containerd errdefs: not_found, already_exists, failed_precondition, invalid_argument, conflict, unavailable, busy, unsupported, corrupt, internal, ...)",
            errors.clone(),
        );
        let missed_events = Counter::default();
        registry.register(
            "layerstack_outcome_events_missed",
            "Outcome events this endpoint missed (a slow consumer): layerstack_publishes undercounts by this much",
            missed_events.clone(),
        );
        let ready_inits = Gauge::default();
        registry.register(
            "layerstack_sandbox_ready_inits",
            "Inits of daemon-owned sessions made ahead and waiting for a session ([sandbox] ready_inits)",
            ready_inits.clone(),
        );
        registry.register(
            "layerstack_build",
            "The daemon's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        Self {
            registry,
            publishes,
            publish_duration,
            capture_duration,
            gate_wait,
            gate_hold,
            capture_bytes,
            errors,
            missed_events,
            ready_inits,
            usage: tokio::sync::Mutex::new(None),
        }
    }

    /// The store-wide accounting, taken again when older than [`USAGE_MAX_AGE`]
    /// (one walk at a time; a scrape meanwhile waits for it). `None` when the
    /// walk failed (logged).
    async fn usage(&self, engine: &Engine) -> Option<layerstack_engine::store::Usage> {
        let mut cached = self.usage.lock().await;
        if let Some((at, u)) = cached.as_ref() {
            if at.elapsed() < USAGE_MAX_AGE {
                return Some(u.clone());
            }
        }
        match engine.disk_usage().await {
            Ok(d) => {
                *cached = Some((std::time::Instant::now(), d.total.clone()));
                Some(d.total)
            }
            Err(e) => {
                warn!(error = %layerstack_engine::error_chain(&e), "metrics: cannot account the store's bytes");
                None
            }
        }
    }

    /// The gauge of ready inits (`layerstack_sandbox_ready_inits`).
    pub fn ready_inits_gauge(&self) -> Gauge {
        self.ready_inits.clone()
    }

    /// Counts one recorded outcome, with the timings of its publish when it gated.
    pub fn outcome(&self, kind: OutcomeKind, timings: Option<&PublishTimings>) {
        self.publishes
            .get_or_create(&OutcomeLabels {
                outcome: kind.as_str(),
            })
            .inc();
        if let Some(t) = timings {
            let s = |us: u64| us as f64 / 1e6;
            self.publish_duration.observe(s(t.total_us));
            self.capture_duration.observe(s(t.capture_us));
            self.gate_wait.observe(s(t.gate_wait_us));
            self.gate_hold.observe(s(t.gate_hold_us));
            self.capture_bytes.observe(t.capture_bytes as f64);
        }
    }

    /// Counts `n` outcome events that were missed.
    pub fn missed(&self, n: u64) {
        self.missed_events.inc_by(n);
    }

    /// Counts one error answer on socket `api` with gRPC status `code`.
    pub fn error(&self, api: &'static str, code: tonic::Code) {
        self.errors
            .get_or_create(&ErrorLabels {
                api,
                kind: layerstack_api::kind_name(code),
            })
            .inc();
    }

    /// The scrape's text: event metrics, then state metrics read from the store
    /// now. A store that cannot be read leaves the state metrics out and sets
    /// `layerstack_store_up` to 0 (the event metrics are still served).
    pub async fn render(&self, engine: &Engine, events_subscribed: bool) -> String {
        let state = match engine.sessions().await {
            Ok(sessions) => engine.stacks().await.map(|stacks| (sessions, stacks)),
            Err(e) => Err(e),
        };
        let mut now = Registry::default();
        let up = Gauge::<i64>::default();
        now.register(
            "layerstack_store_up",
            "1 when this scrape could read the store (sessions, branches), else 0",
            up.clone(),
        );
        let subscribed = Gauge::<i64>::default();
        subscribed.set(i64::from(events_subscribed));
        now.register(
            "layerstack_containerd_events_subscribed",
            "1 while the daemon is subscribed to containerd's task events (task deletes publish), else 0",
            subscribed,
        );
        match state {
            Ok((sessions, stacks)) => {
                up.set(1);
                let live = Family::<OwnerLabels, Gauge>::default();
                for kind in ["container", "sandbox", "wasi", "operation"] {
                    let _ = live.get_or_create(&OwnerLabels { owner_kind: kind });
                }
                for s in sessions.iter().filter(|s| !s.released) {
                    let owner_kind = s.owner.kind_str();
                    live.get_or_create(&OwnerLabels { owner_kind }).inc();
                }
                now.register(
                    "layerstack_sessions",
                    "Live sessions (not released by their owner), by owner kind",
                    live,
                );
                let depth = Family::<BranchLabels, Gauge>::default();
                for st in &stacks {
                    for b in &st.branches {
                        depth
                            .get_or_create(&BranchLabels {
                                // Empty for an imported base: to Prometheus an
                                // empty label value is no label.
                                namespace: st.namespace.clone().unwrap_or_default(),
                                stack: st.id.clone(),
                                branch: b.name.clone(),
                            })
                            .set(b.depth);
                    }
                }
                now.register(
                    "layerstack_branch_depth",
                    "Published layers in a branch head's manifest (overlayfs stacks at most 500 lowers with the base layers)",
                    depth,
                );
            }
            Err(e) => {
                warn!(error = %layerstack_engine::error_chain(&e), "metrics: cannot read the store");
            }
        }
        let runs = engine.history_runs();
        for (name, help, value, unit) in [
            (
                "layerstack_squash_runs",
                "Squashes that committed a squashed layer, automatic and on demand",
                runs.squashes,
                None,
            ),
            (
                "layerstack_squashed_layers",
                "Layers replaced by squashed layers",
                runs.squashed_layers,
                None,
            ),
            (
                "layerstack_gc_runs",
                "Garbage collections that completed, periodic and on demand",
                runs.gcs,
                None,
            ),
            (
                "layerstack_gc_freed_layers",
                "Layer directories garbage collection freed",
                runs.gc_layers,
                None,
            ),
            (
                "layerstack_gc_freed",
                "Real allocated bytes garbage collection freed",
                runs.gc_bytes_freed,
                Some(Unit::Bytes),
            ),
        ] {
            let c = Counter::<u64>::default();
            c.inc_by(value);
            match unit {
                Some(u) => now.register_with_unit(name, help, u, c),
                None => now.register(name, help, c),
            }
        }
        if let Some(u) = self.usage(engine).await {
            let bytes = Family::<ClassLabels, Gauge<i64>>::default();
            for (class, v) in [
                ("hot", u.hot),
                ("cold", u.cold),
                ("uppers", u.uppers),
                ("staging", u.staging),
                ("metadata", u.metadata),
                ("snapshots", u.snapshots),
            ] {
                bytes
                    .get_or_create(&ClassLabels { class })
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
            now.register_with_unit(
                "layerstack_store",
                "Real allocated bytes of the store by accounting class (layerstack df; docs/architecture.md, section \"History: branches, squash, GC, accounting\"): hot = layers branch heads show, cold = layers only leases, nodes or history reach, uppers = live and kept uppers, staging = in-flight builds, metadata = SQLite and the store's own files, snapshots = containerd's snapshots of no stack; taken at most once a minute",
                Unit::Bytes,
                bytes,
            );
        }
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &now);
        let _ = encode_eof(&mut out);
        out
    }
}

/// Counts error answers of one gRPC server: a tower layer over its responses. An
/// error a handler returns is a trailers-only response, whose headers carry
/// `grpc-status` (an error inside a stream already under way is not seen).
pub fn error_layer(
    metrics: Option<Arc<Metrics>>,
    api: &'static str,
) -> tower::util::MapResponseLayer<
    impl Fn(
            tonic::codegen::http::Response<tonic::body::BoxBody>,
        ) -> tonic::codegen::http::Response<tonic::body::BoxBody>
        + Clone,
> {
    tower::util::MapResponseLayer::new(
        move |resp: tonic::codegen::http::Response<tonic::body::BoxBody>| {
            if let Some(m) = &metrics {
                let code = resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map(tonic::Code::from_i32);
                if let Some(code) = code.filter(|c| *c != tonic::Code::Ok) {
                    m.error(api, code);
                }
            }
            resp
        },
    )
}

/// Binds the endpoint's listener (before the daemon reports ready, so a taken
/// port stops the start with a message naming the setting). `explicit`: the
/// address was given (`[metrics] address`, `--metrics-address`). The default
/// address taken by another process (a second daemon on the host) is a warning
/// and a free port on the same IP instead; `layerstack status` and the
/// "serving" log line show the port.
pub fn bind(address: SocketAddr, explicit: bool) -> Result<std::net::TcpListener> {
    let l = match std::net::TcpListener::bind(address) {
        Ok(l) => l,
        Err(e) if !explicit && e.kind() == std::io::ErrorKind::AddrInUse => {
            let any = SocketAddr::new(address.ip(), 0);
            let l = std::net::TcpListener::bind(any).with_context(|| {
                format!("cannot serve metrics on {address} (taken) nor on a free port of {}: set [metrics] address (or --metrics-address), or [metrics] enabled = false", address.ip())
            })?;
            warn!(
                default = %address,
                address = %l.local_addr().context("metrics listener address")?,
                "the default metrics port is taken (another daemon?): serving metrics on a free port instead; set [metrics] address to choose one"
            );
            l
        }
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "cannot serve metrics on {address}: choose another [metrics] address (or --metrics-address), or set [metrics] enabled = false"
                )
            })
        }
    };
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves `GET /metrics` on `listener` until the daemon stops.
pub async fn serve(
    listener: std::net::TcpListener,
    metrics: Arc<Metrics>,
    engine: Arc<Engine>,
    subscribed: Arc<AtomicBool>,
) -> Result<()> {
    use hyper::service::{make_service_fn, service_fn};
    use hyper::{Body, Method, Request, Response, StatusCode};

    let make = make_service_fn(move |_conn| {
        let (metrics, engine, subscribed) = (metrics.clone(), engine.clone(), subscribed.clone());
        async move {
            Ok::<_, Infallible>(service_fn(move |req: Request<Body>| {
                let (metrics, engine, subscribed) =
                    (metrics.clone(), engine.clone(), subscribed.clone());
                async move {
                    let reply = |status: StatusCode, ctype: &str, body: String| {
                        Response::builder()
                            .status(status)
                            .header("content-type", ctype)
                            .body(Body::from(body))
                    };
                    let r = match (req.method(), req.uri().path()) {
                        (&Method::GET | &Method::HEAD, "/metrics") => {
                            let text = metrics
                                .render(&engine, subscribed.load(Ordering::SeqCst))
                                .await;
                            debug!(bytes = text.len(), "metrics scraped");
                            reply(StatusCode::OK, CONTENT_TYPE, text)
                        }
                        (&Method::GET | &Method::HEAD, "/") => reply(
                            StatusCode::OK,
                            "text/plain; charset=utf-8",
                            "containerd-layerstack-grpc: metrics at /metrics\n".into(),
                        ),
                        (&Method::GET | &Method::HEAD, _) => reply(
                            StatusCode::NOT_FOUND,
                            "text/plain; charset=utf-8",
                            "not found: metrics are at /metrics\n".into(),
                        ),
                        _ => reply(
                            StatusCode::METHOD_NOT_ALLOWED,
                            "text/plain; charset=utf-8",
                            "only GET\n".into(),
                        ),
                    };
                    Ok::<_, Infallible>(r.unwrap_or_else(|_| Response::new(Body::empty())))
                }
            }))
        }
    });
    hyper::Server::from_tcp(listener)
        .context("metrics listener")?
        .serve(make)
        .await
        .context("metrics server")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A scrape's samples by series (`name{labels}` → value).
    fn samples(text: &str) -> BTreeMap<String, f64> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    fn event_text(m: &Metrics) -> String {
        let mut out = String::new();
        encode_registry(&mut out, &m.registry).unwrap();
        encode_eof(&mut out).unwrap();
        out
    }

    #[test]
    fn every_outcome_series_exists_at_zero_and_counts() {
        let m = Metrics::new();
        let s = samples(&event_text(&m));
        for k in OUTCOMES {
            assert_eq!(
                s[&format!("layerstack_publishes_total{{outcome=\"{}\"}}", k.as_str())],
                0.0
            );
        }
        m.outcome(
            OutcomeKind::Committed,
            Some(&PublishTimings {
                capture_us: 1_000,
                gate_wait_us: 0,
                gate_hold_us: 3_000,
                total_us: 5_000,
                capture_bytes: 10_000,
            }),
        );
        m.outcome(OutcomeKind::NoChange, None);
        m.error("snapshots", tonic::Code::NotFound);
        m.error("admin", tonic::Code::Aborted);
        m.missed(2);
        let text = event_text(&m);
        let s = samples(&text);
        assert_eq!(s["layerstack_publishes_total{outcome=\"committed\"}"], 1.0);
        assert_eq!(s["layerstack_publishes_total{outcome=\"no-change\"}"], 1.0);
        assert_eq!(s["layerstack_publish_duration_seconds_count"], 1.0);
        assert!((s["layerstack_publish_duration_seconds_sum"] - 0.005).abs() < 1e-9);
        assert_eq!(s["layerstack_publish_gate_hold_seconds_count"], 1.0);
        assert_eq!(s["layerstack_publish_capture_bytes_sum"], 10_000.0);
        assert_eq!(
            s["layerstack_publish_capture_bytes_bucket{le=\"16384.0\"}"],
            1.0
        );
        assert_eq!(
            s["layerstack_publish_capture_bytes_bucket{le=\"4096.0\"}"],
            0.0
        );
        assert_eq!(
            s["layerstack_errors_total{api=\"snapshots\",kind=\"not_found\"}"],
            1.0
        );
        assert_eq!(
            s["layerstack_errors_total{api=\"admin\",kind=\"conflict\"}"],
            1.0
        );
        assert_eq!(s["layerstack_outcome_events_missed_total"], 2.0);
        assert_eq!(s["layerstack_build_info{version=\"0.1.0\"}"], 1.0);
        assert!(text.contains("# TYPE layerstack_publish_duration_seconds histogram"));
        assert!(text.contains("# UNIT layerstack_publish_duration_seconds seconds"));
        assert!(text.ends_with("# EOF\n"));
    }
}
