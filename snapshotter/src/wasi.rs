//! WASI sessions (owner kind `wasi`, issue 24): WebAssembly modules the daemon
//! runs with wasmtime (`layerstack_wasi`) over a session's tree.
//! docs/architecture.md "WASI sessions".
//!
//! ```text
//! CreateSession{wasi}   session row + lease (the engine's, owner wasi:<name>,
//!                       daemon-owned), the overlay built as for a holder
//!                       (sandbox::attach: fsopen/fsconfig/fsmount) and kept
//!                       here as a detached mount fd — in no mount table
//! Exec                  the module (bytes, a cached digest, or a path in the
//!                       tree) run on a blocking thread with
//!                       /proc/self/fd/<mount fd> preopened as `/`: cap-std
//!                       resolves every path beneath it
//! files                 openat2(RESOLVE_IN_ROOT) beneath the mount fd
//! CloseSession          runs cancelled, the mount fd closed once no run or
//!                       file call holds it (the overlay is gone with its last
//!                       descriptor), then the engine's close: capture, gate,
//!                       outcome by the exit policy
//! ```
//!
//! Why a detached mount and not a view over the layers without a mount: the
//! kernel then writes the upper exactly as for a container or a Mode B
//! session — copy-up, whiteouts (0:0 character devices), opaque directories,
//! renames — so capture, the gate, merge, blame and export see nothing new;
//! and a read is the kernel's, not a lookup through every layer per path in
//! the daemon. The mount is a few milliseconds of a session's start (P11 in
//! docs/benchmarks.md); it is never attached, so no other process sees it,
//! and it is freed when its last descriptor closes.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use layerstack_api as api;
use layerstack_engine::store::SessionId;
use layerstack_engine::EndAction;
use layerstack_sandbox::sys;
use layerstack_wasi::{
    digest_string, Invocation, ModuleDigest, ModuleRef, TrapKind, WasiError, WasiLimits, WasiRunner,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::{debug, info, warn};

use crate::admin::AdminService;
use crate::owned::Stream;

/// Largest module Exec takes (bytes, inline or from the session's tree).
pub const MAX_MODULE_BYTES: u64 = api::MAX_WASI_MODULE_BYTES;

/// Exit code of a trapped run: the wasmtime CLI's (128 + SIGABRT).
pub const TRAP_EXIT_CODE: i32 = 134;

/// How long CloseSession waits for runs and file calls to let go of the
/// overlay after cancelling them (a run stops within one 10 ms epoch tick).
const RELEASE_PATIENCE: Duration = Duration::from_secs(10);

/// WASI runs at once in this daemon; more wait (asynchronously) for a turn.
/// A run is a future on the daemon's runtime (its code yields every 10 ms),
/// and each of its file calls a task on tokio's blocking pool (512 threads):
/// the bound keeps the runs' CPU and memory, and their share of that pool,
/// in check. (When runs held a blocking thread each, 512 of them waited for
/// threads none of them freed: a deadlock benchmark P11 found.)
pub const RUNS_AT_ONCE: usize = 128;

/// The turns of [`RUNS_AT_ONCE`].
static RUN_TURNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(RUNS_AT_ONCE);

/// The daemon's WASI runtime (one engine, one module cache), made on the
/// first WASI session; `Err`: why there is none.
static RUNNER: OnceLock<Result<Arc<WasiRunner>, String>> = OnceLock::new();

/// The WASI runtime starts (started now if it had not been): WASI sessions
/// can run.
pub(crate) fn runtime_up() -> bool {
    runner().is_ok()
}

fn runner() -> Result<Arc<WasiRunner>, Status> {
    match RUNNER.get_or_init(|| WasiRunner::new().map(Arc::new).map_err(|e| e.to_string())) {
        Ok(r) => Ok(r.clone()),
        Err(why) => Err(Status::internal(format!(
            "the WASI runtime could not start in this daemon ({why}): WASI sessions are unavailable; the daemon's log has more"
        ))),
    }
}

/// A live WASI session: its overlay and the defaults of its runs.
pub(crate) struct WasiLive {
    /// The detached overlay mount (fsmount's descriptor).
    root: OwnedFd,
    env: Vec<(String, String)>,
    limits: WasiLimits,
    /// Set by CloseSession: every run ends `cancelled`, no new one starts.
    closing: Arc<AtomicBool>,
    /// Linear memory its runs hold now: `limits.memory_bytes` (its slot in
    /// the memory budget) caps their sum, however many run at once.
    memory: Arc<std::sync::atomic::AtomicU64>,
    /// A session of a stack and branch that keeps ready sessions (claimed
    /// from them, or made when none was ready): its close tops them up
    /// ([`release`]).
    ready_key: Option<ReadyKey>,
}

impl WasiLive {
    /// A descriptor of the session's root for the file calls (a duplicate:
    /// the caller owns it).
    pub(crate) fn root(&self, id: SessionId) -> Result<OwnedFd, Status> {
        if self.closing.load(Ordering::Relaxed) {
            return Err(Status::failed_precondition(format!(
                "WASI session {id} is closing: its tree is no longer served"
            )));
        }
        self.root.try_clone().map_err(|e| {
            Status::internal(format!("cannot duplicate WASI session {id}'s root: {e}"))
        })
    }
}

/// The limits of a session's runs: each field of `o` given, else the default.
fn limits_of(o: &api::WasiOptions) -> Result<WasiLimits, Status> {
    let d = WasiLimits::default();
    if o.memory_bytes != 0 && o.memory_bytes < 65536 {
        return Err(Status::invalid_argument(format!(
            "wasi.memory_bytes {} is below one WebAssembly page (65536 bytes): give at least 65536, or 0 for the default ({} bytes)",
            o.memory_bytes, d.memory_bytes
        )));
    }
    Ok(WasiLimits {
        fuel: if o.fuel == 0 { d.fuel } else { Some(o.fuel) },
        deadline_ms: if o.deadline_ms == 0 {
            d.deadline_ms
        } else {
            Some(o.deadline_ms)
        },
        memory_bytes: if o.memory_bytes == 0 {
            d.memory_bytes
        } else {
            o.memory_bytes
        },
        output_bytes: if o.output_bytes == 0 {
            d.output_bytes
        } else {
            usize::try_from(o.output_bytes).unwrap_or(usize::MAX)
        },
    })
}

/// `CreateSession` with `wasi`: a ready session of the request's stack and
/// branch when there is one ([`Ready`]), else one made now; either way the
/// branch's ready sessions are topped up afterwards, in the background.
pub(crate) async fn create(
    admin: &AdminService,
    r: api::CreateSessionRequest,
) -> Result<api::CreateSessionResponse, Status> {
    let opts = r.wasi.clone().unwrap_or_default();
    if r.sandbox.is_some() {
        return Err(Status::invalid_argument(
            "sandbox and wasi are exclusive: a session runs Linux processes (sandbox) or WebAssembly modules (wasi)",
        ));
    }
    let env = crate::owned::parse_env("wasi.env", &opts.env)?;
    let limits = limits_of(&opts)?;
    // The runtime first: no session is made that could not run anything.
    runner()?;
    let ready = &admin.holders.wasi_ready;
    // Ready sessions are made with the default limits: their slot in the
    // pool's memory budget is the default's.
    let key = (ready.enabled()
        && r.node.is_empty()
        && limits.memory_bytes == WasiLimits::default().memory_bytes)
        .then(|| ReadyKey::of(&r));
    let mut stale = Vec::new();
    if let Some(key) = &key {
        let started = Instant::now();
        let claimed = match claim(admin, key, &r, &env, &limits, &mut stale).await {
            Ok(c) => c,
            Err(e) => {
                discard_ready(
                    admin,
                    stale,
                    "its branch moved, or the request's key names a session",
                );
                return Err(e);
            }
        };
        if let Some(claimed) = claimed {
            info!(
                session.id = claimed.session.as_ref().map_or(0, |s| s.id),
                claim_us = started.elapsed().as_micros() as u64,
                "WASI session claimed"
            );
            // Topped up when this session closes, off the path of its runs;
            // now only when none is left (a burst of creates) or stale ones
            // must go.
            if ready.is_empty(key) || !stale.is_empty() {
                refill(admin, key.clone(), stale);
            }
            return Ok(claimed);
        }
    }
    // A session of a pooled branch made now (none was ready, or they were
    // stale) tops the branch up when it closes too, as a claimed one does:
    // a refill that found the cap still taken by the stale ones' slots would
    // otherwise leave the branch short until the next claim.
    let answer = make(admin, r, env, limits, key.clone()).await;
    match key {
        Some(key) if answer.is_ok() => refill(admin, key, stale),
        _ => discard_ready(
            admin,
            stale,
            "its branch moved, or the request's key names a session",
        ),
    }
    answer.map(|(resp, _)| resp)
}

/// Makes a WASI session for `r` now: the engine's session, then its overlay
/// (kept here, detached). Answers the response and, for a session made now,
/// its live state.
async fn make(
    admin: &AdminService,
    r: api::CreateSessionRequest,
    env: Vec<(String, String)>,
    limits: WasiLimits,
    ready_key: Option<ReadyKey>,
) -> Result<(api::CreateSessionResponse, Option<Arc<WasiLive>>), Status> {
    let reserve = layerstack_engine::Reservation {
        cpu_millis: 0,
        memory_bytes: limits.memory_bytes,
    };
    let (session, spec, created) = admin.sandbox_create_spec(r, true, reserve, None).await?;
    let id = session.id;
    let holders = admin.holders.clone();
    if !created && session.released {
        // A retry of a key whose session ended: its end as recorded.
        return Ok((
            api::CreateSessionResponse {
                mounts: Vec::new(),
                session: Some(session),
                created: false,
            },
            None,
        ));
    }
    if !created {
        return match holders.map().get(&id) {
            Some(h) if h.wasi.is_some() => Ok((
                api::CreateSessionResponse {
                    mounts: Vec::new(),
                    session: Some(session),
                    created: false,
                },
                None,
            )),
            _ => Err(Status::failed_precondition(format!(
                "idempotency key names session {id}, which is not a live WASI session of this daemon: close it and create another"
            ))),
        };
    }
    let conn = holders.next_conn.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let fd = match crate::sandbox::attach(&admin.engine, &holders, conn, id, Some(spec.clone()))
        .await
    {
        Ok(fd) => fd,
        Err(reply) => {
            if let Err(e) = admin
                .engine
                .close_sandbox_session(
                    id,
                    EndAction::Discard,
                    "session setup failed",
                    RELEASE_PATIENCE,
                )
                .await
            {
                warn!(session.id = id, error = %api::error_chain(&e), "cannot discard a WASI session whose overlay could not be built");
            }
            return Err(crate::owned::reply_status(reply));
        }
    };
    let live = Arc::new(WasiLive {
        root: fd,
        env,
        limits,
        closing: Arc::new(AtomicBool::new(false)),
        memory: Default::default(),
        ready_key,
    });
    if let Some(h) = holders.map().get_mut(&id).filter(|h| h.conn == conn) {
        h.wasi = Some(live.clone());
    }
    info!(
        session.id = id,
        mount_us = started.elapsed().as_micros() as u64,
        "WASI session started"
    );
    Ok((
        api::CreateSessionResponse {
            // Not handed out: a mount of the upper made elsewhere would be one
            // the daemon does not stop before capture (no census looks at
            // WASI uppers).
            mounts: Vec::new(),
            session: Some(session),
            created: true,
        },
        Some(live),
    ))
}

/// How many stacks and branches keep ready sessions at once; the one used
/// longest ago loses its sessions to a new one.
const READY_BRANCHES: usize = 8;

/// A stack and branch as CreateSession names them (namespace, stack, branch:
/// the request's own strings, not resolved — a lookup per request is what
/// ready sessions save).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ReadyKey(String, String, String);

impl ReadyKey {
    fn of(r: &api::CreateSessionRequest) -> Self {
        Self(r.namespace.clone(), r.stack.clone(), r.branch.clone())
    }
}

/// WASI sessions made ahead of their requests (`[sandbox] wasi_ready` per
/// stack and branch): each a whole session — its store rows and lease on the
/// branch's head, its directories, its overlay built and held here — owned
/// by `wasi:(ready)` ([`layerstack_engine::store::READY_OWNER`]) until a
/// CreateSession claims it, which then only records its owner, key and
/// options (one short transaction: benchmark P11). A session whose branch
/// moved since it was made is stale: a claim finds that in its transaction,
/// and the branch's ready sessions are discarded and made again on the new
/// head. Ready sessions count against `[sandbox] max_sessions`; a create
/// refused for the cap discards one and tries again. A daemon's restart ends
/// the ready sessions of the last one (`interrupted`, as any WASI session).
#[derive(Default)]
pub(crate) struct Ready {
    per_branch: std::sync::atomic::AtomicUsize,
    inner: std::sync::Mutex<ReadyInner>,
}

/// One ready session: its id, the stack it is on, its overlay.
struct ReadyOne {
    id: SessionId,
    stack: String,
    root: OwnedFd,
}

#[derive(Default)]
struct ReadyInner {
    /// Ready sessions by stack and branch, oldest first.
    pools: std::collections::HashMap<ReadyKey, std::collections::VecDeque<ReadyOne>>,
    /// Stacks and branches being topped up.
    filling: std::collections::HashSet<ReadyKey>,
    /// Stacks and branches by last use, the most recent last.
    recent: std::collections::VecDeque<ReadyKey>,
}

impl Ready {
    /// Keeps `n` ready sessions per stack and branch from now on (0: none).
    pub(crate) fn set_per_branch(&self, n: usize) {
        self.per_branch.store(n, Ordering::Relaxed);
    }

    fn enabled(&self) -> bool {
        self.per_branch.load(Ordering::Relaxed) > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReadyInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `key` has no ready session now.
    fn is_empty(&self, key: &ReadyKey) -> bool {
        self.lock().pools.get(key).is_none_or(|q| q.is_empty())
    }

    /// The oldest ready session of `key`, taken out.
    fn take(&self, key: &ReadyKey) -> Option<ReadyOne> {
        self.lock().pools.get_mut(key)?.pop_front()
    }

    /// Every ready session of `key`, taken out.
    fn drain(&self, key: &ReadyKey) -> Vec<ReadyOne> {
        self.lock()
            .pools
            .get_mut(key)
            .map(|q| q.drain(..).collect())
            .unwrap_or_default()
    }

    /// One ready session of the stack and branch used longest ago, taken out
    /// (to free its slot for a request).
    fn take_any(&self) -> Option<ReadyOne> {
        let mut g = self.lock();
        let keys: Vec<ReadyKey> = g.recent.iter().cloned().collect();
        keys.iter().find_map(|k| g.pools.get_mut(k)?.pop_front())
    }

    /// How many ready sessions `key` lacks, marking it being filled (`None`:
    /// full, or filled already). Makes `key` the most recent; the key used
    /// longest ago beyond [`READY_BRANCHES`] gives back its sessions.
    fn start_fill(&self, key: &ReadyKey) -> (Option<usize>, Vec<ReadyOne>) {
        let want = self.per_branch.load(Ordering::Relaxed);
        let mut g = self.lock();
        g.recent.retain(|k| k != key);
        g.recent.push_back(key.clone());
        let mut evicted = Vec::new();
        while g.recent.len() > READY_BRANCHES {
            if let Some(old) = g.recent.pop_front() {
                g.filling.remove(&old);
                evicted.extend(g.pools.remove(&old).into_iter().flatten());
            }
        }
        let have = g.pools.get(key).map_or(0, |q| q.len());
        if have >= want || !g.filling.insert(key.clone()) {
            return (None, evicted);
        }
        (Some(want - have), evicted)
    }

    /// Adds a ready session to `key` (`false`: `key` was given up meanwhile:
    /// the caller discards it).
    fn put(&self, key: &ReadyKey, one: ReadyOne) -> Result<(), ReadyOne> {
        let mut g = self.lock();
        if !g.recent.contains(key) {
            return Err(one);
        }
        g.pools.entry(key.clone()).or_default().push_back(one);
        Ok(())
    }

    fn end_fill(&self, key: &ReadyKey) {
        self.lock().filling.remove(key);
    }

    /// Every ready session, taken out (the daemon is stopping).
    fn take_all(&self) -> Vec<ReadyOne> {
        let mut g = self.lock();
        g.filling.clear();
        g.pools.drain().flat_map(|(_, q)| q).collect()
    }
}

/// Claims a ready session of `key` for `r` (`None`: there is none that is
/// current; the branch's stale ones are moved to `stale`, for the caller to
/// discard).
async fn claim(
    admin: &AdminService,
    key: &ReadyKey,
    r: &api::CreateSessionRequest,
    env: &[(String, String)],
    limits: &WasiLimits,
    stale: &mut Vec<ReadyOne>,
) -> Result<Option<api::CreateSessionResponse>, Status> {
    let ready = &admin.holders.wasi_ready;
    let Some(one) = ready.take(key) else {
        return Ok(None);
    };
    // A stack named otherwise than by its id (an image reference, a base
    // digest) is resolved again: the name may lead elsewhere now (an image
    // pulled again under its tag).
    if r.stack != one.stack {
        let now = admin.sandbox_stack(&r.namespace, &r.stack).await;
        if now.as_ref().ok() != Some(&one.stack) {
            stale.extend(ready.drain(key));
            stale.push(one);
            // Resolved elsewhere: made the usual way; not resolved: the
            // usual way answers why.
            return now.map(|_| None);
        }
    }
    let ReadyOne {
        id,
        stack,
        root: fd,
    } = one;
    let reserve = layerstack_engine::Reservation {
        cpu_millis: 0,
        memory_bytes: limits.memory_bytes,
    };
    // The stack is the ready session's own: no resolution (a lookup per
    // request is what a ready session saves).
    let req = match admin
        .sandbox_request_with(r.clone(), true, reserve, false)
        .await
    {
        Ok(req) => req,
        Err(e) => {
            // The request is at fault, not the session: it stays ready.
            if let Err(back) = ready.put(
                key,
                ReadyOne {
                    id,
                    stack,
                    root: fd,
                },
            ) {
                discard_ready(admin, vec![back], "its stack and branch were given up");
            }
            return Err(e);
        }
    };
    match admin.engine.claim_ready_session(id, req).await {
        Ok(Some(s)) => {
            let live = Arc::new(WasiLive {
                root: fd,
                env: env.to_vec(),
                limits: limits.clone(),
                closing: Arc::new(AtomicBool::new(false)),
                memory: Default::default(),
                ready_key: Some(key.clone()),
            });
            if let Some(h) = admin.holders.map().get_mut(&id) {
                h.wasi = Some(live);
            }
            debug!(session.id = id, "WASI session from a ready one");
            Ok(Some(api::CreateSessionResponse {
                mounts: Vec::new(),
                session: Some(admin.to_api(s).await?),
                created: true,
            }))
        }
        Ok(None) => {
            // Stale (the branch moved) or the key is taken: the branch's ready
            // sessions were made on one head, so all go.
            stale.extend(ready.drain(key));
            stale.push(ReadyOne {
                id,
                stack,
                root: fd,
            });
            Ok(None)
        }
        Err(e) => {
            discard_ready(
                admin,
                vec![ReadyOne {
                    id,
                    stack,
                    root: fd,
                }],
                "its claim failed",
            );
            Err(crate::admin::engine_status(e))
        }
    }
}

/// Tops up the ready sessions of `key` in the background, after discarding
/// its `stale` ones (whose slots the new ones take; one filler per key at a
/// time; a fill that finds the pool's cap or rate taken stops quietly).
fn refill(admin: &AdminService, key: ReadyKey, stale: Vec<ReadyOne>) {
    let ready = &admin.holders.wasi_ready;
    let (missing, evicted) = ready.start_fill(&key);
    discard_ready(admin, evicted, "its stack and branch were unused longest");
    let Some(missing) = missing else {
        discard_ready(
            admin,
            stale,
            "its branch moved, or the request's key names a session",
        );
        return;
    };
    let admin = admin.clone();
    tokio::spawn(async move {
        discard_now(
            &admin,
            stale,
            "its branch moved, or the request's key names a session",
        )
        .await;
        let ready = &admin.holders.wasi_ready;
        let mut made = 0;
        for _ in 0..missing {
            let r = api::CreateSessionRequest {
                namespace: key.0.clone(),
                stack: key.1.clone(),
                branch: key.2.clone(),
                name: layerstack_engine::store::READY_OWNER.into(),
                wasi: Some(api::WasiOptions::default()),
                ..Default::default()
            };
            let made_now = match make(&admin, r, Vec::new(), WasiLimits::default(), None).await {
                Ok((resp, Some(live))) => {
                    drop(live);
                    resp.session.map(|s| (s.id, s.stack))
                }
                Ok(_) => None,
                Err(e) => {
                    // The pool's cap or rate, most often: requests go first.
                    info!(stack = %key.1, branch = %key.2, error = %e.message(), "no ready WASI session made");
                    None
                }
            };
            let Some((id, stack)) = made_now else { break };
            // The overlay goes into the pool; the holder keeps no live state
            // until a claim.
            let live = admin.holders.map().get_mut(&id).and_then(|h| h.wasi.take());
            let Some(live) = live.and_then(|l| Arc::try_unwrap(l).ok()) else {
                warn!(
                    session.id = id,
                    "a ready WASI session was in use before it was ready: left to its user"
                );
                break;
            };
            if let Err(back) = ready.put(
                &key,
                ReadyOne {
                    id,
                    stack,
                    root: live.root,
                },
            ) {
                discard_ready(&admin, vec![back], "its stack and branch were given up");
                break;
            }
            made += 1;
        }
        ready.end_fill(&key);
        debug!(stack = %key.1, branch = %key.2, made, "ready WASI sessions made");
    });
}

/// After the close of a session claimed from the ready ones of `key`: tops
/// them up (in the background).
pub(crate) fn closed(admin: &AdminService, key: Option<ReadyKey>) {
    if let Some(key) = key {
        refill(admin, key, Vec::new());
    }
}

/// Discards ready sessions in the background (their overlays closed first).
fn discard_ready(admin: &AdminService, sessions: Vec<ReadyOne>, why: &'static str) {
    if sessions.is_empty() {
        return;
    }
    let admin = admin.clone();
    tokio::spawn(async move { discard_now(&admin, sessions, why).await });
}

async fn discard_now(admin: &AdminService, sessions: Vec<ReadyOne>, why: &str) {
    for ReadyOne { id, root, .. } in sessions {
        drop(root);
        admin.holders.map().remove(&id);
        if let Err(e) = admin
            .engine
            .close_sandbox_session(
                id,
                EndAction::Discard,
                &format!("ready WASI session unused: {why}"),
                RELEASE_PATIENCE,
            )
            .await
        {
            warn!(session.id = id, error = %api::error_chain(&e), "cannot discard a ready WASI session");
        }
    }
}

/// Frees one ready session's slot for a request the pool's cap refused:
/// discards the oldest ready session of the stack and branch used longest
/// ago (`false`: there is none).
pub(crate) async fn yield_slot(admin: &AdminService) -> bool {
    match admin.holders.wasi_ready.take_any() {
        Some(s) => {
            discard_now(admin, vec![s], "its slot went to a request").await;
            true
        }
        None => false,
    }
}

/// Ends every ready session (the daemon is stopping): discarded, so that the
/// next daemon finds no session of this one to mark `interrupted`.
pub(crate) async fn discard_all_ready(admin: &AdminService) {
    let all = admin.holders.wasi_ready.take_all();
    discard_now(admin, all, "the daemon is stopping").await;
}

/// The live WASI session `id`, if it is one.
pub(crate) fn live(admin: &AdminService, id: SessionId) -> Option<Arc<WasiLive>> {
    admin.holders.map().get(&id).and_then(|h| h.wasi.clone())
}

/// Refuses `what` (an end of the run, or a read that needs the upper at rest:
/// publish, discard, checkpoint, dry run) on a WASI session that is live here:
/// its module may be writing into the upper, and only CloseSession stops its
/// runs and releases its overlay first. The engine relies on this: it takes
/// no census of a WASI session's upper (engine/src/lib.rs `census_applies`).
pub(crate) fn refuse_live(admin: &AdminService, id: SessionId, what: &str) -> Result<(), Status> {
    match live(admin, id) {
        Some(_) => Err(Status::failed_precondition(format!(
            "session {id} is a live WASI session: {what} needs its runs stopped and its overlay released first; end it with CloseSession (`layerstack session close {id}`, Python `Sandbox.close`), which does both"
        ))),
        None => Ok(()),
    }
}

/// CloseSession of a WASI session, before the engine's close: its runs are
/// cancelled and its overlay released (the mount fd closed once nothing else
/// holds it). Nothing to do for another session. With `discard`, nothing
/// will read the upper: the last close of the mount (the kernel's unmount of
/// the overlay, ~0.2 ms) happens off the caller's path.
pub(crate) async fn release(
    admin: &AdminService,
    id: SessionId,
    discard: bool,
) -> Option<ReadyKey> {
    let live = live(admin, id)?;
    let key = live.ready_key.clone();
    live.closing.store(true, Ordering::Relaxed);
    admin.holders.map().remove(&id);
    // Runs and file calls hold a clone each: wait for them to end (a run
    // stops within one epoch tick of `closing`).
    let deadline = Instant::now() + RELEASE_PATIENCE;
    let mut live = live;
    loop {
        match Arc::try_unwrap(live) {
            Ok(l) if discard => {
                tokio::task::spawn_blocking(move || drop(l));
                debug!(session.id = id, "WASI session's overlay let go");
                return key;
            }
            Ok(l) => {
                drop(l);
                debug!(session.id = id, "WASI session's overlay released");
                return key;
            }
            Err(back) => live = back,
        }
        if Instant::now() >= deadline {
            warn!(
                session.id = id,
                holders = Arc::strong_count(&live),
                "a run or file call of the WASI session still holds its overlay: closing anyway"
            );
            return key;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `sha256:<64 hex>` → a digest.
fn parse_digest(s: &str) -> Option<ModuleDigest> {
    crate::admin::hex_decode(s.strip_prefix("sha256:")?)?
        .try_into()
        .ok()
}

/// The module of an Exec: inline bytes, a cached digest, or a file of the
/// session's tree.
enum Module {
    Bytes(Vec<u8>),
    Digest(ModuleDigest),
}

fn read_module(live: &WasiLive, id: SessionId, path: &str) -> Result<Vec<u8>, Status> {
    use std::io::Read;
    let rel = crate::owned::rel_path(path)?;
    let root = live.root(id)?;
    let fd = sys::openat2_in_root(
        &root,
        &crate::owned::cpath(&rel),
        libc::O_RDONLY | libc::O_NOCTTY | libc::O_NONBLOCK,
        0,
    )
    .map_err(|e| {
        let code = if e.raw_os_error() == Some(libc::ENOENT) {
            tonic::Code::NotFound
        } else {
            tonic::Code::InvalidArgument
        };
        Status::new(
            code,
            format!("module {path:?} in WASI session {id}: {e}: give a path of the session's tree, sha256:<hex> of a module run before, or the module's bytes (ExecRequest.module)"),
        )
    })?;
    let f = std::fs::File::from(fd);
    let md = f
        .metadata()
        .map_err(|e| Status::internal(format!("cannot stat module {path:?}: {e}")))?;
    if !md.is_file() {
        return Err(Status::invalid_argument(format!(
            "module {path:?} in WASI session {id} is not a regular file"
        )));
    }
    if md.len() > MAX_MODULE_BYTES {
        return Err(Status::invalid_argument(format!(
            "module {path:?} is {} bytes, more than {MAX_MODULE_BYTES}",
            md.len()
        )));
    }
    let mut bytes = Vec::with_capacity(md.len() as usize);
    f.take(MAX_MODULE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Status::internal(format!("cannot read module {path:?}: {e}")))?;
    Ok(bytes)
}

fn wasi_status(e: &WasiError) -> Status {
    match e {
        WasiError::Compile(_) | WasiError::Link(_) => Status::invalid_argument(e.to_string()),
        WasiError::UnknownDigest(_) => Status::failed_precondition(format!(
            "{e}: send the module's bytes (ExecRequest.module) once"
        )),
        WasiError::Preopen { .. } | WasiError::Runtime(_) => Status::internal(e.to_string()),
    }
}

/// `Exec` in WASI session `id`.
pub(crate) async fn exec(
    live: Arc<WasiLive>,
    id: SessionId,
    r: api::ExecRequest,
) -> Result<Stream<api::ExecReply>, Status> {
    if live.closing.load(Ordering::Relaxed) {
        return Err(Status::failed_precondition(format!(
            "WASI session {id} is closing: no new run starts"
        )));
    }
    if !(r.cwd.is_empty() || r.cwd == "/") {
        return Err(Status::invalid_argument(format!(
            "cwd {:?}: a WASI module's working directory is its root; give \"\" or \"/\" and name paths from the root",
            r.cwd
        )));
    }
    if r.has_user {
        return Err(Status::invalid_argument(
            "has_user: a WASI module runs as no user (its files are the daemon's, 0:0); leave the user unset",
        ));
    }
    if r.module.len() as u64 > MAX_MODULE_BYTES {
        return Err(Status::invalid_argument(format!(
            "module is {} bytes, more than {MAX_MODULE_BYTES} (64 MiB) an Exec carries: write it into the session's tree (WriteFile, UploadTar) and exec it by its path — the same limit holds there",
            r.module.len()
        )));
    }
    let (module, argv0) = if !r.module.is_empty() {
        let argv0 = r.argv.first().cloned();
        (Module::Bytes(r.module), argv0)
    } else {
        let Some(first) = r.argv.first() else {
            return Err(Status::invalid_argument(
                "argv is empty and no module bytes were given: name the module in argv[0] (a path of the session's tree or sha256:<hex>) or send it in ExecRequest.module",
            ));
        };
        if first.starts_with("sha256:") {
            let d = parse_digest(first).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "argv[0] {first:?} is not sha256:<64 lowercase hex>"
                ))
            })?;
            (Module::Digest(d), Some(first.clone()))
        } else {
            let l = live.clone();
            let p = first.clone();
            let bytes = tokio::task::spawn_blocking(move || read_module(&l, id, &p))
                .await
                .map_err(|e| Status::internal(format!("module read task failed: {e}")))??;
            (Module::Bytes(bytes), Some(first.clone()))
        }
    };
    let mut env = live.env.clone();
    for (k, v) in crate::owned::parse_env("env", &r.env)? {
        env.retain(|(ek, _)| *ek != k);
        env.push((k, v));
    }
    let mut limits = live.limits.clone();
    if r.timeout_ms > 0 {
        limits.deadline_ms = Some(r.timeout_ms.into());
    }
    let inv = Invocation {
        argv0,
        args: r.argv.iter().skip(1).cloned().collect(),
        env,
        stdin: r.stdin,
        cancel: Some(live.closing.clone()),
        limits,
        memory_pool: Some(live.memory.clone()),
    };
    let runner = runner()?;
    // A turn first (see RUNS_AT_ONCE); a close meanwhile cancels the run
    // as soon as it starts.
    let turn = RUN_TURNS
        .acquire()
        .await
        .map_err(|_| Status::internal("the WASI run queue is closed"))?;
    // Compiling is CPU work: on a blocking thread, once per digest.
    let (digest, compiled) = match module {
        Module::Bytes(b) => {
            let r = runner.clone();
            tokio::task::spawn_blocking(move || r.prepare(&b))
                .await
                .map_err(|e| Status::internal(format!("WASI compile task failed: {e}")))?
                .map_err(|e| wasi_status(&e))?
        }
        Module::Digest(d) => (d, false),
    };
    // The run is a future on this task: its code yields every 10 ms, and its
    // deadline and the session's close stop it also inside a host call.
    // `live` (the overlay) is held until it ends.
    let root = std::path::PathBuf::from(format!("/proc/self/fd/{}", live.root.as_raw_fd()));
    let mut out = runner
        .run_async(ModuleRef::Digest(digest), &root, &inv)
        .await
        .map_err(|e| wasi_status(&e))?;
    out.compiled = compiled;
    drop(live);
    drop(turn);
    debug!(
        session.id = id,
        digest = %digest_string(&out.digest),
        code = ?out.exit_code,
        trap = ?out.trap.map(TrapKind::as_str),
        wall_ms = out.wall_ms,
        "WASI run ended"
    );
    let (tx, rx) = mpsc::channel(8);
    let mut replies: Vec<api::ExecReply> = Vec::new();
    for c in out.stdout.chunks(crate::owned::CHUNK) {
        replies.push(api::ExecReply {
            kind: Some(api::exec_reply::Kind::Stdout(c.to_vec())),
        });
    }
    for c in out.stderr.chunks(crate::owned::CHUNK) {
        replies.push(api::ExecReply {
            kind: Some(api::exec_reply::Kind::Stderr(c.to_vec())),
        });
    }
    let code = out.exit_code.unwrap_or(TRAP_EXIT_CODE);
    replies.push(api::ExecReply {
        kind: Some(api::exec_reply::Kind::Exit(api::ExecExit {
            code,
            signal: 0,
            timed_out: out.trap == Some(TrapKind::Deadline),
            duration_ms: out.wall_ms as u64,
            oom_killed: false,
            session_memory_peak_bytes: 0,
            session_cpu_usec: 0,
            trap: out.trap.map(|t| t.as_str().to_string()).unwrap_or_default(),
            trap_message: out.trap_message.unwrap_or_default(),
            fuel_used: out.fuel_used,
            module_digest: digest_string(&out.digest),
            module_compiled: out.compiled,
            stdout_truncated: out.stdout_truncated,
            stderr_truncated: out.stderr_truncated,
            // A module that cannot be started is refused before any run.
            start_failed: false,
        })),
    });
    tokio::spawn(async move {
        for r in replies {
            if tx.send(Ok(r)).await.is_err() {
                return;
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn module_digests_parse_only_in_their_one_form() {
        let hex = "ab".repeat(32);
        let d = parse_digest(&format!("sha256:{hex}")).unwrap();
        assert_eq!(digest_string(&d), format!("sha256:{hex}"));
        for bad in [
            hex.clone(),
            format!("sha256:{}", &hex[..62]),
            format!("sha256:{hex}00"),
            format!("sha512:{hex}"),
            format!("sha256:{}zz", &hex[..62]),
        ] {
            assert!(parse_digest(&bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn limits_default_each_unset_field_and_refuse_less_than_a_page() {
        let d = WasiLimits::default();
        let l = limits_of(&api::WasiOptions::default()).unwrap();
        assert_eq!(
            (l.fuel, l.deadline_ms, l.memory_bytes, l.output_bytes),
            (d.fuel, d.deadline_ms, d.memory_bytes, d.output_bytes)
        );
        let l = limits_of(&api::WasiOptions {
            fuel: 7,
            memory_bytes: 1 << 20,
            deadline_ms: 5,
            output_bytes: 10,
            env: vec![],
        })
        .unwrap();
        assert_eq!(
            (l.fuel, l.deadline_ms, l.memory_bytes, l.output_bytes),
            (Some(7), Some(5), 1 << 20, 10)
        );
        let e = limits_of(&api::WasiOptions {
            memory_bytes: 4096,
            ..Default::default()
        })
        .err()
        .unwrap();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("65536"), "{}", e.message());
        // The environment is checked as a sandbox's (`owned::parse_env`).
        let env = crate::owned::parse_env("wasi.env", &["A=1".into(), "B=".into()]).unwrap();
        assert_eq!(
            env,
            vec![("A".into(), "1".into()), ("B".into(), String::new())]
        );
        let e = crate::owned::parse_env("wasi.env", &["=x".into()]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("wasi.env"), "{}", e.message());
    }
}
