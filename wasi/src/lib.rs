//! LayerStack WASI executor: runs a WASI preview1 (`wasi_snapshot_preview1`)
//! module with wasmtime, the session's tree as its only preopen (guest path
//! `/`), under a fuel budget, a wall-clock deadline (epoch interruption) and a
//! linear-memory cap. Modules are compiled once and cached by the sha256 of
//! their bytes (the cache holds a linked `InstancePre`, so a second run of the
//! same digest neither compiles nor links).
//!
//! What the module gets: its args, the env given (nothing inherited), the
//! stdin bytes given (else an empty stdin), stdout and stderr captured into
//! bounded buffers, a monotonic and a wall
//! clock, random bytes, and one directory. No sockets (wasmtime-wasi denies
//! TCP, UDP and name lookup unless allowed, and preview1 has no socket
//! creation), no host path outside the preopen: paths are resolved by
//! cap-std beneath the preopened directory, `..` past its root and absolute
//! symlinks out of it fail with `ENOTCAPABLE`.
//!
//! This crate is the only one in the workspace that links wasmtime.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use wasmtime::{
    Config, Engine, InstancePre, Linker, Module, ResourceLimiter, Store, Trap, UpdateDeadline,
};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::p2::pipe::{MemoryInputPipe, MemoryOutputPipe};
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

/// A module's identity in the cache: the sha256 of its bytes (32 bytes).
pub type ModuleDigest = [u8; 32];

/// The sha256 of `bytes` as a cache key.
pub fn module_digest(bytes: &[u8]) -> ModuleDigest {
    Sha256::digest(bytes).into()
}

/// `sha256:<hex>` form of a digest, as reported in outcomes and logs.
pub fn digest_string(d: &ModuleDigest) -> String {
    let mut s = String::from("sha256:");
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Errors before the module runs (a trap or an exit is not an error: see
/// [`WasiExit`]).
#[derive(Debug, thiserror::Error)]
pub enum WasiError {
    /// The bytes are not a valid WebAssembly module (binary or text).
    #[error("the module does not compile ({0}); give a WebAssembly module (binary .wasm) built for wasm32-wasi (preview1)")]
    Compile(String),
    /// The module imports something other than `wasi_snapshot_preview1`
    /// functions, or lacks an exported `_start`.
    #[error("the module cannot be linked ({0}); it may import only wasi_snapshot_preview1 functions and must export _start (a WASI command)")]
    Link(String),
    /// A run by digest named a module not in the cache.
    #[error("no module with digest {0} is cached; run it once by its bytes first")]
    UnknownDigest(String),
    /// The preopen root cannot be opened.
    #[error("cannot open the session tree {path} as the module's root: {reason}")]
    Preopen { path: String, reason: String },
    /// Engine construction or instantiation failed for a reason of the host.
    #[error("the WASI runtime failed: {0}")]
    Runtime(String),
}

/// The fuel of a run without a fuel limit (2^62 units: at ~3·10^9 units/s,
/// some 50 years of computing).
const UNLIMITED_FUEL: u64 = 1 << 62;

/// Fuel between two stores of a run's count (`fuel_async_yield_interval`): ~3 ms
/// of a tight loop here.
const FUEL_YIELD: u64 = 10_000_000;

/// Resource limits of one run.
#[derive(Debug, Clone)]
pub struct WasiLimits {
    /// Fuel budget (wasmtime fuel units, ~one per wasm instruction);
    /// `None` = unbounded (the deadline still applies).
    pub fuel: Option<u64>,
    /// Wall-clock deadline in milliseconds, enforced by epoch interruption
    /// (10 ms granularity); `None` = none.
    pub deadline_ms: Option<u64>,
    /// Cap on the total linear memory of the instance, in bytes.
    pub memory_bytes: u64,
    /// Bytes kept of stdout and of stderr each; output beyond is dropped
    /// (`WasiExit::stdout_truncated` / `stderr_truncated`).
    pub output_bytes: usize,
}

impl Default for WasiLimits {
    fn default() -> Self {
        WasiLimits {
            fuel: Some(10_000_000_000),
            deadline_ms: Some(60_000),
            memory_bytes: 256 << 20,
            output_bytes: 1 << 20,
        }
    }
}

/// Why a run ended other than by returning from `_start` or `proc_exit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrapKind {
    /// The fuel budget was used up (`WasiLimits::fuel`).
    OutOfFuel,
    /// The wall-clock deadline passed (`WasiLimits::deadline_ms`).
    Deadline,
    /// The module tried to grow memory beyond `WasiLimits::memory_bytes`.
    MemoryLimit,
    /// A wasm trap (unreachable, out-of-bounds access, stack overflow, ...).
    Trap,
    /// The run's cancel flag was set ([`Invocation::cancel`]): the session
    /// is closing.
    Cancelled,
}

impl TrapKind {
    /// Stable lowercase name for APIs and logs: `out_of_fuel`, `deadline`,
    /// `memory_limit`, `trap`, `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            TrapKind::OutOfFuel => "out_of_fuel",
            TrapKind::Deadline => "deadline",
            TrapKind::MemoryLimit => "memory_limit",
            TrapKind::Trap => "trap",
            TrapKind::Cancelled => "cancelled",
        }
    }
}

/// How one run is invoked beyond its module and root ([`WasiRunner::run_with`]).
#[derive(Debug, Clone, Default)]
pub struct Invocation {
    /// argv[0] as the module sees it (default `module.wasm`).
    pub argv0: Option<String>,
    /// The arguments after argv[0].
    pub args: Vec<String>,
    /// The environment, KEY=VALUE pairs (nothing is inherited).
    pub env: Vec<(String, String)>,
    /// What the module reads on stdin (then end of file).
    pub stdin: Vec<u8>,
    /// The run ends with [`TrapKind::Cancelled`] within one epoch tick
    /// (10 ms) of this flag being set.
    pub cancel: Option<Arc<AtomicBool>>,
    /// Limits of the run.
    pub limits: WasiLimits,
    /// Bytes of linear memory that the runs of one session hold now, shared
    /// by its concurrent runs: `limits.memory_bytes` then caps their sum —
    /// the session's slot in the daemon's memory budget — not each run's.
    /// `None`: the cap is this run's alone.
    pub memory_pool: Option<Arc<AtomicU64>>,
}

/// Why the epoch callback stopped a run.
#[derive(Debug)]
enum Stopped {
    Deadline,
    Cancelled,
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stopped::Deadline => f.write_str("the run's wall-clock deadline passed"),
            Stopped::Cancelled => f.write_str("the run was cancelled (its session is closing)"),
        }
    }
}

impl std::error::Error for Stopped {}

/// Compiled modules kept at once; the oldest compiled goes first beyond it.
pub const CACHED_MODULES: usize = 256;

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct WasiExit {
    /// `proc_exit` code, 0 when `_start` returned; `None` when it trapped.
    pub exit_code: Option<i32>,
    /// Set when the run was stopped by a limit or a trap.
    pub trap: Option<TrapKind>,
    /// Text of the trap (wasmtime's message with the wasm backtrace).
    pub trap_message: Option<String>,
    /// Captured stdout (at most `output_bytes`).
    pub stdout: Vec<u8>,
    /// Captured stderr (at most `output_bytes`).
    pub stderr: Vec<u8>,
    /// stdout reached `output_bytes`: what the module wrote beyond it, if
    /// anything, was dropped.
    pub stdout_truncated: bool,
    /// The same for stderr.
    pub stderr_truncated: bool,
    /// Fuel consumed (0 when the run had no fuel budget).
    pub fuel_used: u64,
    /// Wall time of instantiate + run, in milliseconds.
    pub wall_ms: f64,
    /// Whether this run compiled the module (false: served from the cache).
    pub compiled: bool,
    /// sha256 of the module.
    pub digest: ModuleDigest,
}

/// What to run: module bytes (compiled if not cached) or a cached digest.
pub enum ModuleRef<'a> {
    Bytes(&'a [u8]),
    Digest(ModuleDigest),
}

struct State {
    wasi: WasiP1Ctx,
    limiter: MemCap,
}

struct MemCap {
    max: u64,
    hit: bool,
    /// [`Invocation::memory_pool`], and what this run counted in it.
    pool: Option<Arc<AtomicU64>>,
    held: u64,
    /// The last grow counted in the pool (given back if it then failed).
    last_grow: u64,
}

/// The run's store is gone (whatever ended it, a dropped future included):
/// what it counted in the shared pool is given back.
impl Drop for MemCap {
    fn drop(&mut self) {
        if let Some(p) = &self.pool {
            p.fetch_sub(std::mem::take(&mut self.held), Ordering::Relaxed);
        }
    }
}

impl ResourceLimiter for MemCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired as u64 > self.max {
            self.hit = true;
            return Err(wasmtime::Error::msg(format!(
                "memory cap: the module asked for {desired} bytes of linear memory, the cap is {} bytes",
                self.max
            )));
        }
        if let Some(pool) = &self.pool {
            let grow = (desired as u64).saturating_sub(current as u64);
            let taken = pool.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (used.saturating_add(grow) <= self.max).then_some(used + grow)
            });
            match taken {
                Ok(_) => {
                    self.held += grow;
                    self.last_grow = grow;
                }
                Err(used) => {
                    self.hit = true;
                    return Err(wasmtime::Error::msg(format!(
                        "memory cap: the module asked for {grow} more bytes of linear memory; the session's runs hold {used} of its {} bytes",
                        self.max
                    )));
                }
            }
        }
        Ok(true)
    }

    /// A grow the limiter allowed failed after all (past the module's own
    /// maximum, no memory to map): what it counted goes back to the pool.
    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        if let Some(pool) = &self.pool {
            let back = std::mem::take(&mut self.last_grow);
            pool.fetch_sub(back, Ordering::Relaxed);
            self.held -= back;
        }
        Ok(())
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

/// Compiles, caches and runs WASI modules. One per process; `run` may be
/// called from many threads at once (each run has its own store).
pub struct WasiRunner {
    engine: Engine,
    linker: Linker<State>,
    cache: Mutex<Cache>,
    compiles: AtomicU64,
    ticker_stop: Arc<AtomicBool>,
}

/// The module cache: linked modules by digest, and their order of
/// compilation (evicted first to last beyond [`CACHED_MODULES`]).
#[derive(Default)]
struct Cache {
    modules: HashMap<ModuleDigest, InstancePre<State>>,
    order: VecDeque<ModuleDigest>,
}

/// Epoch tick period: the deadline's granularity.
const TICK: Duration = Duration::from_millis(10);

impl WasiRunner {
    /// An engine with fuel metering and epoch interruption on, the
    /// preview1 functions linked, and a thread ticking the epoch every 10 ms.
    pub fn new() -> Result<Self, WasiError> {
        let mut config = Config::new();
        config.consume_fuel(true);
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| WasiError::Runtime(format!("{e:#}")))?;
        let mut linker: Linker<State> = Linker::new(&engine);
        wasmtime_wasi::p1::add_to_linker_async(&mut linker, |s: &mut State| &mut s.wasi)
            .map_err(|e| WasiError::Runtime(format!("{e:#}")))?;
        let ticker_stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = ticker_stop.clone();
            std::thread::Builder::new()
                .name("wasi-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| WasiError::Runtime(format!("epoch thread: {e}")))?;
        }
        Ok(WasiRunner {
            engine,
            linker,
            cache: Mutex::new(Cache::default()),
            compiles: AtomicU64::new(0),
            ticker_stop,
        })
    }

    /// How many modules this runner has compiled (cache misses).
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }

    /// Compiles and links `bytes` (a wasm binary) unless its
    /// digest is cached. Returns the digest and whether it compiled.
    pub fn prepare(&self, bytes: &[u8]) -> Result<(ModuleDigest, bool), WasiError> {
        let digest = module_digest(bytes);
        if self.lock_cache().modules.contains_key(&digest) {
            return Ok((digest, false));
        }
        let module = Module::new(&self.engine, bytes).map_err(|e| {
            // One line: wasmtime's text may hold a multi-line byte list
            // (a bad magic number's `expected=[…]`).
            let text = format!("{e:#}");
            WasiError::Compile(text.split_whitespace().collect::<Vec<_>>().join(" "))
        })?;
        let pre = self
            .linker
            .instantiate_pre(&module)
            .map_err(|e| WasiError::Link(format!("{e:#}")))?;
        if module.get_export("_start").is_none() {
            return Err(WasiError::Link("no export _start".into()));
        }
        self.compiles.fetch_add(1, Ordering::Relaxed);
        let mut c = self.lock_cache();
        if c.modules.insert(digest, pre).is_none() {
            c.order.push_back(digest);
            while c.order.len() > CACHED_MODULES {
                if let Some(old) = c.order.pop_front() {
                    c.modules.remove(&old);
                }
            }
        }
        Ok((digest, true))
    }

    /// Whether a module of this digest is compiled and cached.
    pub fn is_cached(&self, digest: &ModuleDigest) -> bool {
        self.lock_cache().modules.contains_key(digest)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `_start` of the module with `root` preopened read-write as `/`
    /// (fd 3). `root` is a directory path; a detached mount is given as
    /// `/proc/self/fd/<fd>`. `args` excludes argv[0] (the module's name,
    /// `module.wasm`, is prepended). Blocks the calling thread until the run
    /// ends (on a runtime of its own: not from inside a tokio runtime; there,
    /// [`WasiRunner::run_async`]).
    pub fn run(
        &self,
        module: ModuleRef<'_>,
        root: &Path,
        args: &[String],
        env: &[(String, String)],
        limits: &WasiLimits,
    ) -> Result<WasiExit, WasiError> {
        let inv = Invocation {
            args: args.to_vec(),
            env: env.to_vec(),
            limits: limits.clone(),
            ..Default::default()
        };
        self.run_with(module, root, &inv)
    }

    /// [`WasiRunner::run`] with every part of the invocation given: argv[0],
    /// stdin and a cancel flag besides args, env and limits. Blocking, as
    /// [`WasiRunner::run`].
    pub fn run_with(
        &self,
        module: ModuleRef<'_>,
        root: &Path,
        inv: &Invocation,
    ) -> Result<WasiExit, WasiError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| WasiError::Runtime(format!("a runtime for the run: {e}")))?;
        rt.block_on(self.run_async(module, root, inv))
    }

    /// The run as a future (inside a tokio runtime with its timer). The
    /// module's code yields every epoch tick (10 ms); beside it a watchdog
    /// checks the deadline and the cancel flag every tick, so a run ends on
    /// time also while the module waits in a host call (a sleep, a read):
    /// the call is dropped. A blocking file call the host made on a thread
    /// of its own (e.g. an open of a FIFO with no writer) keeps that thread
    /// until it returns; the run has ended by then.
    pub async fn run_async(
        &self,
        module: ModuleRef<'_>,
        root: &Path,
        inv: &Invocation,
    ) -> Result<WasiExit, WasiError> {
        let limits = &inv.limits;
        let (digest, compiled) = match module {
            ModuleRef::Bytes(b) => self.prepare(b)?,
            ModuleRef::Digest(d) => (d, false),
        };
        let pre = self
            .lock_cache()
            .modules
            .get(&digest)
            .cloned()
            .ok_or_else(|| WasiError::UnknownDigest(digest_string(&digest)))?;

        let stdout = MemoryOutputPipe::new(limits.output_bytes);
        let stderr = MemoryOutputPipe::new(limits.output_bytes);
        let mut b = WasiCtxBuilder::new();
        let mut argv = vec![inv.argv0.clone().unwrap_or_else(|| "module.wasm".into())];
        argv.extend(inv.args.iter().cloned());
        b.args(&argv);
        b.envs(&inv.env);
        b.stdin(MemoryInputPipe::new(inv.stdin.clone()));
        b.stdout(stdout.clone());
        b.stderr(stderr.clone());
        b.allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false);
        b.preopened_dir(root, "/", FsPerms::ReadWrite)
            .map_err(|e| WasiError::Preopen {
                path: root.display().to_string(),
                reason: format!("{e:#}"),
            })?;
        let mut store = Store::new(
            &self.engine,
            State {
                wasi: b.build_p1(),
                limiter: MemCap {
                    max: limits.memory_bytes,
                    hit: false,
                    pool: inv.memory_pool.clone(),
                    held: 0,
                    last_grow: 0,
                },
            },
        );
        store.limiter(|s| &mut s.limiter);
        // No limit: more fuel than any run burns, yet far from u64::MAX —
        // wasmtime's fuel arithmetic saturates there, and `get_fuel` then
        // answered u64::MAX after any run (fuel_used 0, bench: a 1 s spin
        // reported 2404).
        let fuel = limits.fuel.unwrap_or(UNLIMITED_FUEL);
        store
            .set_fuel(fuel)
            .map_err(|e| WasiError::Runtime(format!("{e:#}")))?;
        // Compiled code keeps its fuel count in a register and stores it
        // only on a call out; a loop without calls stopped by its deadline
        // (or a cancel) lost everything it burnt (fuel_used 0). Yielding
        // every FUEL_YIELD units stores it: the count is exact to that.
        store
            .fuel_async_yield_interval(Some(FUEL_YIELD))
            .map_err(|e| WasiError::Runtime(format!("{e:#}")))?;
        // Every epoch tick (10 ms) the run checks its deadline and its cancel
        // flag: both end it with an error the match below names.
        let started = Instant::now();
        let deadline = limits
            .deadline_ms
            .map(|ms| started + Duration::from_millis(ms));
        let cancel = inv.cancel.clone();
        let stopped = {
            let cancel = cancel.clone();
            move || {
                if cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) {
                    Some(Stopped::Cancelled)
                } else if deadline.is_some_and(|d| Instant::now() >= d) {
                    Some(Stopped::Deadline)
                } else {
                    None
                }
            }
        };
        let check = stopped.clone();
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |_| match check() {
            Some(s) => Err(wasmtime::Error::new(s)),
            None => Ok(UpdateDeadline::Yield(1)),
        });

        let result = {
            let call = async {
                let inst = pre.instantiate_async(&mut store).await?;
                let start = inst.get_typed_func::<(), ()>(&mut store, "_start")?;
                start.call_async(&mut store, ()).await
            };
            let watchdog = async {
                loop {
                    tokio::time::sleep(TICK).await;
                    if let Some(s) = stopped() {
                        return s;
                    }
                }
            };
            tokio::select! {
                r = call => r,
                s = watchdog => Err(wasmtime::Error::new(s)),
            }
        };
        let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
        let fuel_used = match limits.fuel {
            Some(f) => f.saturating_sub(store.get_fuel().unwrap_or(0)),
            None => UNLIMITED_FUEL.saturating_sub(store.get_fuel().unwrap_or(0)),
        };
        let mem_hit = store.data().limiter.hit;
        drop(store);

        let (exit_code, trap, trap_message) = match result {
            Ok(()) => (Some(0), None, None),
            Err(e) => {
                if let Some(exit) = e.downcast_ref::<I32Exit>() {
                    (Some(exit.0), None, None)
                } else {
                    let kind = if mem_hit {
                        TrapKind::MemoryLimit
                    } else if let Some(s) = e.downcast_ref::<Stopped>() {
                        match s {
                            Stopped::Deadline => TrapKind::Deadline,
                            Stopped::Cancelled => TrapKind::Cancelled,
                        }
                    } else {
                        match e.downcast_ref::<Trap>() {
                            Some(Trap::OutOfFuel) => TrapKind::OutOfFuel,
                            Some(Trap::Interrupt) => TrapKind::Deadline,
                            _ => TrapKind::Trap,
                        }
                    };
                    (None, Some(kind), Some(format!("{e:?}")))
                }
            }
        };
        Ok(WasiExit {
            exit_code,
            trap,
            trap_message,
            stdout_truncated: stdout.contents().len() >= limits.output_bytes,
            stderr_truncated: stderr.contents().len() >= limits.output_bytes,
            stdout: stdout.contents().to_vec(),
            stderr: stderr.contents().to_vec(),
            fuel_used,
            wall_ms,
            compiled,
            digest,
        })
    }
}

impl Drop for WasiRunner {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}
