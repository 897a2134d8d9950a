//! Events from the inner shim, on their way to containerd.
//!
//! The inner shim publishes its task events (`TaskCreate`, `TaskExit`,
//! `TaskDelete`, …) to `TTRPC_ADDRESS`, which the proxy points at its own events
//! socket. [`EventGate`] forwards each event to containerd through [`Upstream`],
//! except the init process's `/tasks/delete`: that one is held until the proxy's
//! publish step for the init `Delete` has finished. Otherwise the daemon's
//! event-driven publisher (which publishes on `/tasks/delete` for runtimes without
//! the shim) could publish the session before the proxy applies the container's
//! policy (`layerstack.publish=never` would then publish).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use containerd_shim_protos::api::Empty;
use containerd_shim_protos::events::task::TaskDelete;
use containerd_shim_protos::protobuf::Message as _;
use containerd_shim_protos::shim::events::ForwardRequest;
use containerd_shim_protos::shim_async::{Client, Events, EventsClient};
use containerd_shim_protos::topics::TASK_DELETE_EVENT_TOPIC;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::{self, context};
use log::{debug, warn};
use tokio::sync::{mpsc, watch, Notify};

/// How long one event is retried before it is dropped (covers a containerd restart).
const RETRY_FOR: Duration = Duration::from_secs(60);

/// An ordered queue of events to containerd's ttrpc events service, retried with
/// backoff and reconnecting (containerd may restart under a running task).
pub struct Upstream {
    tx: mpsc::UnboundedSender<ForwardRequest>,
    pending: Arc<AtomicUsize>,
    idle: Arc<Notify>,
}

impl Upstream {
    /// Starts the forwarding task for containerd's ttrpc `address`.
    pub fn new(address: &str) -> Arc<Self> {
        let addr = if address.contains("://") {
            address.to_string()
        } else {
            format!("unix://{address}")
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<ForwardRequest>();
        let pending = Arc::new(AtomicUsize::new(0));
        let idle = Arc::new(Notify::new());
        let (p, n) = (pending.clone(), idle.clone());
        tokio::spawn(async move {
            let mut client: Option<EventsClient> = None;
            while let Some(req) = rx.recv().await {
                let deadline = tokio::time::Instant::now() + RETRY_FOR;
                let mut backoff = Duration::from_millis(100);
                loop {
                    if client.is_none() {
                        match Client::connect(&addr).await {
                            Ok(c) => client = Some(EventsClient::new(c)),
                            Err(e) => debug!("events: cannot connect to containerd at {addr}: {e}"),
                        }
                    }
                    if let Some(c) = &client {
                        match c
                            .forward(context::with_duration(Duration::from_secs(5)), &req)
                            .await
                        {
                            Ok(_) => break,
                            Err(e) => {
                                debug!("events: forward {} failed: {e}", req.envelope.topic);
                                client = None;
                            }
                        }
                    }
                    if tokio::time::Instant::now() >= deadline {
                        warn!(
                            "events: dropping {} after {RETRY_FOR:?} of retries",
                            req.envelope.topic
                        );
                        break;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
                if p.fetch_sub(1, Ordering::SeqCst) == 1 {
                    n.notify_waiters();
                }
            }
        });
        Arc::new(Self { tx, pending, idle })
    }

    /// Counts one event that will be sent later with [`Upstream::send_reserved`].
    pub fn reserve(&self) {
        self.pending.fetch_add(1, Ordering::SeqCst);
    }

    /// Queues an event reserved before.
    pub fn send_reserved(&self, req: ForwardRequest) {
        if self.tx.send(req).is_err() && self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Queues an event.
    pub fn send(&self, req: ForwardRequest) {
        self.reserve();
        self.send_reserved(req);
    }

    /// Waits until every queued (and reserved) event was delivered or dropped,
    /// at most `timeout`.
    pub async fn flush(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, async {
            loop {
                let idle = self.idle.notified();
                if self.pending.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        })
        .await;
    }
}

/// The proxy's events service (see the module docs).
pub struct EventGate {
    id: String,
    upstream: Arc<Upstream>,
    released: watch::Sender<bool>,
    hold_limit: Duration,
}

impl EventGate {
    /// Gate for container `id`; a held event is released after `hold_limit` at
    /// the latest.
    pub fn new(id: &str, upstream: Arc<Upstream>, hold_limit: Duration) -> Arc<Self> {
        Arc::new(Self {
            id: id.to_string(),
            upstream,
            released: watch::Sender::new(false),
            hold_limit,
        })
    }

    /// The init process's publish step is done: let its `/tasks/delete` through.
    pub fn release(&self) {
        self.released.send_replace(true);
    }

    fn holds(&self, req: &ForwardRequest) -> bool {
        let env = &req.envelope;
        if env.topic != TASK_DELETE_EVENT_TOPIC {
            return false;
        }
        let Some(any) = env.event.as_ref() else {
            return false;
        };
        match TaskDelete::parse_from_bytes(&any.value) {
            Ok(ev) => ev.container_id == self.id && (ev.id.is_empty() || ev.id == self.id),
            Err(_) => false,
        }
    }
}

#[async_trait]
impl Events for EventGate {
    async fn forward(&self, _ctx: &TtrpcContext, req: ForwardRequest) -> ttrpc::Result<Empty> {
        if self.holds(&req) && !*self.released.borrow() {
            debug!("events: holding the init /tasks/delete until the publish step is done");
            let mut rx = self.released.subscribe();
            let up = self.upstream.clone();
            let limit = self.hold_limit;
            up.reserve();
            tokio::spawn(async move {
                if tokio::time::timeout(limit, rx.wait_for(|v| *v))
                    .await
                    .is_err()
                {
                    warn!("events: releasing the held /tasks/delete after {limit:?}");
                }
                up.send_reserved(req);
            });
        } else {
            self.upstream.send(req);
        }
        Ok(Empty::new())
    }
}
