//! Connections and transactions.
//!
//! One writer connection behind a mutex: every write is one `IMMEDIATE`
//! transaction ([`Db::write`]), committed when the closure returns `Ok` and
//! rolled back otherwise. Reads run on read-only connections from a small pool,
//! each in one read transaction ([`Db::read`]): with WAL they see the last
//! committed state and never wait for the writer.
//!
//! WAL checkpoints run on a thread of their own ([`Checkpointer`]), not in the
//! commit that happens to cross SQLite's threshold: that commit may be a
//! publish's, under its branch's gate, which every other publish of the branch
//! waits on.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior};
use tracing::info;

use crate::error::{OpenError, StoreError};
use crate::schema::{FORMAT_VERSION, MIGRATIONS, SCHEMA};
use crate::Durability;

/// How long a connection waits for SQLite's file lock (another store instance
/// writing) before failing with `SQLITE_BUSY`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Prepared statements kept per connection: more than the store's distinct
/// statements on any hot path, so none is parsed twice on one connection.
const STATEMENT_CACHE: usize = 512;

/// The writer connection's page cache, KiB (`PRAGMA cache_size` = −KiB).
///
/// SQLite's default is 2,000 KiB. A store's database grows by ~60 KiB per
/// published 100-file layer (its path index, verdicts, blame rows and
/// manifest positions): ~200 MB after 3,000 such publishes. The writer's
/// inserts land at random places of the path-keyed indexes, so with the
/// default every staged publish re-read most of its B-tree pages (measured
/// in P5: staging 1.0 → 1.7 ms and the commit transaction 0.3 → 0.9 ms per
/// publish as the database grew from a few MB to ~200 MB). 64 MiB keeps the
/// indexes' inner pages and the recent leaves of a much larger store.
const WRITER_CACHE_KIB: i64 = 64 * 1024;

/// `PRAGMA mmap_size`, bytes, of the writer connection: none (see
/// [`READER_MMAP_BYTES`]). The writer reads pages through its page cache
/// ([`WRITER_CACHE_KIB`]), so what a write transaction that reads much of
/// the database adds to the daemon's RSS is bounded by that cache, not by
/// the database's size. It mapped up to 1 GiB before: a GC over a graph of
/// 1,000,000 nodes then took the daemon's peak RSS to 3.8× that with 1,000
/// (bench P12: 126 MiB against 33; 1.9× without the mapping). P5 measured
/// the same without it: growth 1.03× against 1.06× with it (release builds
/// that differ only in this constant, 2026-12-07).
const MMAP_BYTES: i64 = 0;

/// The writer's page cache, KiB, during a [`Db::write_lean`]: SQLite's
/// default.
const LEAN_CACHE_KIB: i64 = 2000;

/// `PRAGMA mmap_size` of the read connections: none. Every page a mapping
/// touches counts in the daemon's RSS while mapped, so a read that walks a
/// large table — ShowGraph's pages over a graph of 1,000,000 nodes, the
/// start-up's recovery reads — took the daemon's peak RSS from 40 MiB to
/// 736 MiB (bench P12: VmHWM 18.5× that with 1,000 nodes; 5.8× at 200,000
/// nodes, 1.6× without the readers' mappings). A reader copies pages
/// through its own bounded cache (SQLite's default 2,000 KiB) from the
/// kernel's page cache instead: one `pread` per page missing from it; no
/// change measured in P5's publish bursts.
const READER_MMAP_BYTES: i64 = 0;

/// Statements through the connection's prepared-statement cache.
///
/// rusqlite's `Connection::execute` and `query_row` parse their SQL on every
/// call; SQLite's parser was ~13 % of the daemon's CPU in a Mode B session
/// (`sqlite3LockAndPrepare`, profile of `session run … true`) and runs inside
/// a publish's commit under its branch's gate. These parse each distinct SQL
/// text once per connection ([`STATEMENT_CACHE`] of them).
pub(crate) trait Cached {
    /// `Connection::execute` with a cached statement: rows changed.
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    /// `Connection::query_row` with a cached statement.
    fn one<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
}

impl Cached for Connection {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn one<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }
}

pub(crate) struct Db {
    path: PathBuf,
    writer: Mutex<Connection>,
    first: FirstInLine,
    idle: Mutex<Vec<Connection>>,
    checkpointer: Checkpointer,
    /// Times the writer was taken ([`Db::writes`]).
    writes: AtomicU64,
    /// Read transactions begun ([`Db::reads`]).
    reads: AtomicU64,
}

/// Lets a branch's gate holder take the writer before the other writers
/// waiting for it (the preparation of other publishes, which every publish of
/// the branch waits on otherwise): while one waits in [`Db::writer_first`], a
/// new [`Db::writer`] call waits until it has the connection. Writers already
/// blocked on the connection when it arrived may still go first, so its wait
/// is bounded by those few transactions.
#[derive(Default)]
struct FirstInLine {
    waiting: AtomicUsize,
    turn: Mutex<()>,
    served: Condvar,
}

impl FirstInLine {
    fn give_way(&self) {
        if self.waiting.load(Ordering::Acquire) == 0 {
            return;
        }
        let g = self.turn.lock().unwrap_or_else(|p| p.into_inner());
        let _g = self
            .served
            .wait_while(g, |()| self.waiting.load(Ordering::Acquire) > 0)
            .unwrap_or_else(|p| p.into_inner());
    }

    fn arrive(&self) {
        self.waiting.fetch_add(1, Ordering::AcqRel);
    }

    fn served(&self) {
        if self.waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Taken under `turn`: a writer between its check and its wait
            // cannot miss the wake-up.
            let _g = self.turn.lock().unwrap_or_else(|p| p.into_inner());
            self.served.notify_all();
        }
    }
}

/// Checkpoints the WAL off the writers' path: woken every
/// [`CHECKPOINT_EVERY`] write transactions (and once a second after any),
/// it runs `PRAGMA wal_checkpoint(PASSIVE)` on its own connection, which
/// neither waits for nor blocks readers and writers (sqlite.org/wal.html,
/// "Checkpointing"). The writer's automatic checkpoint stays as a backstop at
/// [`Checkpointer::BACKSTOP_PAGES`], for a checkpointer that falls far behind.
/// Stopped and joined when the store closes.
struct Checkpointer {
    shared: Arc<(Mutex<CheckpointState>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct CheckpointState {
    writes: u64,
    stop: bool,
}

/// Write transactions between two checkpoints ([`Checkpointer`]).
pub(crate) const CHECKPOINT_EVERY: u64 = 32;

impl Checkpointer {
    const BACKSTOP_PAGES: i64 = 16_384;

    fn start(path: PathBuf) -> Checkpointer {
        let shared = Arc::new((Mutex::new(CheckpointState::default()), Condvar::new()));
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("store-checkpoint".into())
            .spawn(move || Self::run(&path, &s))
            .map_err(|e| tracing::warn!(error = %e, "no checkpoint thread: the writer checkpoints"))
            .ok();
        Checkpointer { shared, thread }
    }

    fn run(path: &Path, shared: &(Mutex<CheckpointState>, Condvar)) {
        // Behind the writers it serves (nice +10 on this thread): a checkpoint
        // can wait, a commit under a branch's gate cannot. The backstop bounds
        // the WAL if it falls behind.
        crate::priority::background_thread();
        let conn = match Connection::open(path)
            .and_then(|c| c.busy_timeout(BUSY_TIMEOUT).map(|()| c))
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "checkpoint thread: cannot open the database; the writer checkpoints");
                return;
            }
        };
        let (lock, cvar) = shared;
        let mut done = 0;
        loop {
            let writes = {
                let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
                if !st.stop && st.writes.saturating_sub(done) < CHECKPOINT_EVERY {
                    st = cvar
                        .wait_timeout(st, Duration::from_secs(1))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                if st.stop {
                    return;
                }
                st.writes
            };
            if writes == done {
                continue;
            }
            if let Err(e) = conn.one("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                tracing::debug!(error = %e, "WAL checkpoint failed; retried after the next writes");
            }
            done = writes;
        }
    }

    /// One write transaction is about to run.
    fn wrote(&self) {
        let (lock, cvar) = &*self.shared;
        let mut st = lock.lock().unwrap_or_else(|p| p.into_inner());
        st.writes += 1;
        if st.writes % CHECKPOINT_EVERY == 0 {
            cvar.notify_one();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (lock, cvar) = &*self.shared;
        lock.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        cvar.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Db {
    /// At most this many idle read connections are kept.
    const MAX_IDLE: usize = 32;
    /// Idle read connections kept by [`Db::release_memory`] (the rest are
    /// closed): enough for the reads of a quiet daemon (a poll, a status).
    const IDLE_AT_REST: usize = 2;

    /// Opens `<root>/store.db`, creating the schema in an empty database, and
    /// refusing one of another format version before changing anything.
    pub(crate) fn open(root: &Path, durability: Durability) -> Result<Db, OpenError> {
        let path = root.join("store.db");
        let mut conn = Connection::open(&path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        let sync = match durability {
            Durability::Disposable => "OFF",
            Durability::Durable => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync)?;
        conn.pragma_update(None, "wal_autocheckpoint", Checkpointer::BACKSTOP_PAGES)?;
        // Off while the schema is made or migrated (a migration may rebuild a
        // table others refer to; the pragma cannot change inside a
        // transaction): checked by `foreign_key_check` before the commit and
        // on for everything after.
        conn.pragma_update(None, "foreign_keys", "OFF")?;
        conn.pragma_update(None, "cache_size", -WRITER_CACHE_KIB)?;
        conn.pragma_update(None, "mmap_size", MMAP_BYTES)?;
        {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let tables: i64 = tx.one(
                "SELECT count(*) FROM sqlite_master WHERE type='table'",
                [],
                |r| r.get(0),
            )?;
            if tables == 0 {
                tx.execute_batch(SCHEMA)?;
                tx.execute_batch(crate::schema::FORMAT_INDEXES)?;
                tx.exec(
                    "INSERT INTO meta(key, value) VALUES ('format_version', ?1)",
                    [FORMAT_VERSION.to_string()],
                )?;
                info!(root = %root.display(), version = FORMAT_VERSION, "created store");
            } else {
                let has_meta: bool = tx.one(
                    "SELECT count(*) FROM sqlite_master WHERE type='table' AND name='meta'",
                    [],
                    |r| r.get::<_, i64>(0).map(|n| n > 0),
                )?;
                let v: Option<String> = if has_meta {
                    tx.one(
                        "SELECT value FROM meta WHERE key='format_version'",
                        [],
                        |r| r.get(0),
                    )
                    .optional()?
                } else {
                    None
                };
                let mut v = v.and_then(|v| v.parse::<i64>().ok()).unwrap_or(-1);
                let found = v;
                for (from, what, sql) in MIGRATIONS {
                    if v == *from {
                        tx.execute_batch(sql)?;
                        v = from + 1;
                        tx.exec(
                            "UPDATE meta SET value = ?1 WHERE key = 'format_version'",
                            [v.to_string()],
                        )?;
                        info!(root = %root.display(), from = *from, to = v, change = *what, "migrated the store's format");
                    }
                }
                if v != FORMAT_VERSION {
                    return Err(OpenError::Version {
                        root: root.to_path_buf(),
                        found: v,
                        expected: FORMAT_VERSION,
                    });
                }
                // Indexes added within a format (additive: an older build of
                // the same format reads the store as before).
                tx.execute_batch(crate::schema::FORMAT_INDEXES)?;
                // Only after a migration: the check reads every row of every
                // table that refers to another — the whole database, which an
                // ordinary start must not (a graph of 1,000,000 nodes made
                // the daemon's start-up and memory grow with it; P12).
                let dangling: Option<String> = if v != found {
                    tx.one("PRAGMA foreign_key_check", [], |r| r.get(0))
                        .optional()?
                } else {
                    None
                };
                if let Some(table) = dangling {
                    // Rolled back: the store stays as it was.
                    return Err(OpenError::Store(StoreError::corrupt(
                        "foreign_key_check",
                        table,
                        "a row of this table refers to one that does not exist (PRAGMA foreign_key_check); the store was left unmigrated",
                    )));
                }
            }
            tx.commit()?;
        }
        conn.pragma_update(None, "foreign_keys", "ON")?;
        let checkpointer = Checkpointer::start(path.clone());
        Ok(Db {
            path,
            writer: Mutex::new(conn),
            first: FirstInLine::default(),
            idle: Mutex::new(Vec::new()),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            checkpointer,
        })
    }

    /// The writer connection, for the rare caller that must keep other writers
    /// out across a transaction and the filesystem step after it (a publish's
    /// rename into `l/`).
    pub(crate) fn writer(&self) -> MutexGuard<'_, Connection> {
        self.first.give_way();
        self.checkpointer.wrote();
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Db::writer`] ahead of the writers that arrive after this call (see
    /// [`FirstInLine`]): for the commit of a publish, under its branch's gate.
    pub(crate) fn writer_first(&self) -> MutexGuard<'_, Connection> {
        self.first.arrive();
        self.checkpointer.wrote();
        self.writes.fetch_add(1, Ordering::Relaxed);
        let conn = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        self.first.served();
        conn
    }

    /// Runs `f` in one `IMMEDIATE` write transaction; commits on `Ok`.
    pub(crate) fn write<T>(
        &self,
        f: impl FnOnce(&Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.writer();
        write_on(&mut conn, f)
    }

    /// [`Db::write`] for a maintenance step that reads much of the database
    /// (the GC's mark and sweep): the writer's page cache is held to
    /// [`LEAN_CACHE_KIB`] for it — lowering `cache_size` frees the cached
    /// pages beyond it at once — and given its [`WRITER_CACHE_KIB`] back
    /// after, so that the step does not grow the daemon's RSS by the writer's
    /// whole cache (bench P12: the GC over 1,000,000 nodes set the daemon's
    /// peak). The publishes after it read their index pages again from the
    /// kernel's page cache.
    pub(crate) fn write_lean<T>(
        &self,
        f: impl FnOnce(&Transaction<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        /// Gives the writer its cache back however the step ends (a panic
        /// included: the writer's lock is taken again after one).
        struct Lean<'a>(MutexGuard<'a, Connection>);
        impl Drop for Lean<'_> {
            fn drop(&mut self) {
                if let Err(e) = self.0.pragma_update(None, "cache_size", -WRITER_CACHE_KIB) {
                    tracing::warn!(error = %e, "cannot give the store's writer its page cache back");
                }
            }
        }
        let conn = self.writer();
        conn.pragma_update(None, "cache_size", -LEAN_CACHE_KIB)?;
        let mut lean = Lean(conn);
        write_on(&mut lean.0, f)
    }

    /// Runs `each` for every item of `items` in `IMMEDIATE` write transactions:
    /// one while no gate holder waits for the writer; when one arrives in
    /// [`Db::writer_first`], what was written so far is committed and the
    /// writer handed over (the rest continues in a new transaction after it).
    /// For bulk rows that nobody reads before a later transaction makes them
    /// visible (a staged publish's path index, verdicts and blame, under a
    /// `pending` layer): a commit under a branch's gate then waits for at most
    /// one row's insert, not for a whole staging (P5's gate hold).
    ///
    /// On `Err` the current transaction is rolled back; items committed before
    /// it stay (the caller drops them with the staged publish).
    pub(crate) fn write_each<I>(
        &self,
        items: &[I],
        mut each: impl FnMut(&Transaction<'_>, &I) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut rest = items;
        while !rest.is_empty() {
            let mut conn = self.writer();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let mut done = 0;
            for item in rest {
                each(&tx, item)?;
                done += 1;
                if self.first.waiting.load(Ordering::Acquire) > 0 {
                    break;
                }
            }
            tx.commit()?;
            rest = &rest[done..];
        }
        Ok(())
    }

    /// How many times the writer connection was taken since the store was
    /// opened (an idleness probe: unchanged between two looks, nothing was
    /// written in between).
    pub(crate) fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// How many read transactions were begun since the store was opened
    /// (with [`Db::writes`], the memory watcher's probe of a store in use).
    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Frees the page caches of the writer and of the idle read connections
    /// (`sqlite3_db_release_memory`: unused cached pages; nothing is lost,
    /// later reads come from the file or the WAL), and any mapping of the
    /// database file a connection holds (`mmap_size` set to 0 and back to
    /// [`MMAP_BYTES`] / [`READER_MMAP_BYTES`], which makes SQLite's unix VFS
    /// unmap it; both are 0 now, so this only matters for a store opened with
    /// a mapping). The writer is skipped when in use (never waits for it). Idle read connections beyond [`Db::IDLE_AT_REST`] are
    /// closed: each holds its own parsed schema, prepared statements and
    /// lookaside buffers (~200 KiB), and a burst of concurrent reads opens
    /// up to [`Db::MAX_IDLE`] of them (33 after the workload of bench P12
    /// on a 200,000-node graph, ~6 MiB of the daemon's heap; a later burst
    /// opens them again in ~0.1 ms each). Answers the connections released
    /// or closed.
    pub(crate) fn release_memory(&self) -> usize {
        fn release(c: &Connection, mmap: i64) -> bool {
            c.release_memory().is_ok()
                && (mmap == 0
                    || (c.pragma_update(None, "mmap_size", 0).is_ok()
                        && c.pragma_update(None, "mmap_size", mmap).is_ok()))
        }
        let mut n = 0;
        if let Ok(w) = self.writer.try_lock() {
            n += usize::from(release(&w, MMAP_BYTES));
        }
        let surplus = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let keep = idle.len().min(Self::IDLE_AT_REST);
            let surplus = idle.split_off(keep);
            for c in idle.iter() {
                n += usize::from(release(c, READER_MMAP_BYTES));
            }
            surplus
        };
        // Closed outside the pool's lock. The writer keeps the database
        // open, so no close of a reader checkpoints or removes the WAL.
        n += surplus.len();
        drop(surplus);
        n
    }

    /// Runs `f` in a read transaction on a read-only connection (one consistent
    /// snapshot of the last committed state; never waits for the writer).
    pub(crate) fn read<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let mut c = match self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            Some(c) => c,
            None => {
                let c = Connection::open_with_flags(
                    &self.path,
                    OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                c.busy_timeout(BUSY_TIMEOUT)?;
                c.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
                c.pragma_update(None, "mmap_size", READER_MMAP_BYTES)?;
                c
            }
        };
        let result = {
            let tx = c.transaction()?;
            // Dropped without commit: a read transaction ends by rolling back.
            f(&tx)
        };
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < Self::MAX_IDLE {
            idle.push(c);
        }
        result
    }
}

/// [`Db::write`] on a connection the caller already holds.
pub(crate) fn write_on<T>(
    conn: &mut Connection,
    f: impl FnOnce(&Transaction<'_>) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let out = f(&tx)?;
    tx.commit()?;
    Ok(out)
}

/// A 32-byte digest column; anything else is a corrupt row.
pub(crate) fn digest_col(
    v: Option<Vec<u8>>,
    table: &'static str,
    key: &dyn Fn() -> String,
) -> Result<Option<[u8; 32]>, StoreError> {
    match v {
        None => Ok(None),
        Some(b) => <[u8; 32]>::try_from(b.as_slice())
            .map(Some)
            .map_err(|_| StoreError::corrupt(table, key(), format!("digest of {} bytes", b.len()))),
    }
}

/// A non-negative integer column that must fit a `u32` (mode, uid, gid).
pub(crate) fn u32_col(
    v: Option<i64>,
    table: &'static str,
    key: &dyn Fn() -> String,
) -> Result<Option<u32>, StoreError> {
    match v {
        None => Ok(None),
        Some(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| StoreError::corrupt(table, key(), format!("value {n} out of range"))),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// A writer that releases the connection and at once asks for it again
    /// (it would win the race against a thread that must first be woken) gets
    /// it only after the gate holder that was waiting in `writer_first`.
    #[test]
    fn the_gate_holders_commit_goes_before_a_writer_that_comes_back() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Db::open(dir.path(), Durability::Disposable).unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..20 {
            order.lock().unwrap().clear();
            let held = db.writer();
            let first_done = Arc::new(AtomicBool::new(false));
            let c = {
                let (db, order, done) = (db.clone(), order.clone(), first_done.clone());
                std::thread::spawn(move || {
                    let _conn = db.writer_first();
                    order.lock().unwrap().push("first");
                    done.store(true, Ordering::Release);
                })
            };
            while db.first.waiting.load(Ordering::Acquire) == 0 {
                std::thread::yield_now();
            }
            // Parked on the connection's lock by now.
            std::thread::sleep(Duration::from_millis(5));
            drop(held);
            let again = db.writer();
            order.lock().unwrap().push("again");
            drop(again);
            c.join().unwrap();
            assert!(first_done.load(Ordering::Acquire));
            assert_eq!(*order.lock().unwrap(), ["first", "again"]);
        }
    }

    /// Writes are counted (the memory watcher's idleness probe), and the
    /// page caches are freed without losing anything: the rows read back.
    #[test]
    fn writes_are_counted_and_caches_released_without_loss() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Disposable).unwrap();
        let before = db.writes();
        db.write(|tx| {
            tx.execute_batch(
                "CREATE TABLE t(i INTEGER PRIMARY KEY); INSERT INTO t VALUES (1), (2)",
            )?;
            Ok(())
        })
        .unwrap();
        assert_eq!(db.writes(), before + 1);
        let n = db
            .read(|c| Ok(c.one("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))?))
            .unwrap();
        assert_eq!(n, 2);
        assert!(db.release_memory() >= 2, "the writer and the idle reader");
        let held = db.writer();
        assert_eq!(db.release_memory(), 1, "a writer in use is skipped");
        drop(held);
        let n = db
            .read(|c| Ok(c.one("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))?))
            .unwrap();
        assert_eq!(n, 2);
        assert_eq!(db.writes(), before + 2, "reads are not writes");
        assert_eq!(db.reads(), 2, "the two reads");
    }

    /// A burst of concurrent reads leaves one idle connection per reader;
    /// releasing memory closes all but [`Db::IDLE_AT_REST`] of them, and
    /// reads go on (a new burst opens them again).
    #[test]
    fn releasing_memory_closes_the_surplus_idle_readers() {
        fn nested(db: &Db, depth: usize) -> Result<i64, StoreError> {
            db.read(|c| {
                let n: i64 = c.one("SELECT count(*) FROM t", [], |r| r.get(0))?;
                Ok(if depth == 0 {
                    n
                } else {
                    n + nested(db, depth - 1)?
                })
            })
        }
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Disposable).unwrap();
        db.write(|tx| {
            tx.execute_batch("CREATE TABLE t(i INTEGER PRIMARY KEY); INSERT INTO t VALUES (1)")?;
            Ok(())
        })
        .unwrap();
        // Six reads open at once: six connections, all idle afterwards.
        assert_eq!(nested(&db, 5).unwrap(), 6);
        assert_eq!(db.idle.lock().unwrap().len(), 6);
        assert_eq!(
            db.release_memory(),
            1 + 6,
            "the writer and the two kept readers released, four closed"
        );
        assert_eq!(db.idle.lock().unwrap().len(), Db::IDLE_AT_REST);
        assert_eq!(nested(&db, 5).unwrap(), 6, "a new burst reads as before");
        assert_eq!(db.idle.lock().unwrap().len(), 6);
    }

    /// A lean write runs with SQLite's default page cache on the writer,
    /// whose own comes back after — also when the step fails; the writer maps
    /// nothing of the database.
    #[test]
    fn a_lean_write_holds_the_writers_cache_small_and_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path(), Durability::Disposable).unwrap();
        let cache =
            |c: &Connection| -> i64 { c.one("PRAGMA cache_size", [], |r| r.get(0)).unwrap() };
        let during = db.write_lean(|tx| Ok(cache(tx))).unwrap();
        assert_eq!(during, -LEAN_CACHE_KIB);
        assert_eq!(db.write(|tx| Ok(cache(tx))).unwrap(), -WRITER_CACHE_KIB);
        let err = db
            .write_lean(|_| Err::<(), _>(StoreError::InvalidArgument("no".into())))
            .unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::InvalidArgument);
        assert_eq!(db.write(|tx| Ok(cache(tx))).unwrap(), -WRITER_CACHE_KIB);
        let mmap: i64 = db
            .write(|tx| Ok(tx.one("PRAGMA mmap_size", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(mmap, 0);
    }

    /// A bulk write gives the writer to a gate holder that arrives in the
    /// middle of it: the holder's commit lands between two items, every item
    /// is written once, and the items before and after it are both committed.
    #[test]
    fn a_bulk_write_lets_the_gate_holder_in_between_two_items() {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(Db::open(dir.path(), Durability::Disposable).unwrap());
        db.write(|tx| {
            tx.execute_batch("CREATE TABLE t(i INTEGER PRIMARY KEY, holder_seen INTEGER)")?;
            Ok(())
        })
        .unwrap();
        let items: Vec<i64> = (0..200).collect();
        let arrived = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let holder = {
            let (db, arrived, done) = (db.clone(), arrived.clone(), done.clone());
            std::thread::spawn(move || {
                // Wait until the bulk write is under way.
                while !arrived.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
                let mut conn = db.writer_first();
                let n = write_on(&mut conn, |tx| {
                    Ok(tx.one("SELECT count(*) FROM t", [], |r| r.get::<_, i64>(0))?)
                })
                .unwrap();
                // Still holding the writer.
                done.store(true, Ordering::Release);
                n
            })
        };
        let mut holder_seen = None;
        db.write_each(&items, |tx, i| {
            if *i == 10 {
                arrived.store(true, Ordering::Release);
                // The holder is parked on the writer by now.
                while db.first.waiting.load(Ordering::Acquire) == 0 {
                    std::thread::yield_now();
                }
            }
            if *i > 10 && holder_seen.is_none() && done.load(Ordering::Acquire) {
                holder_seen = Some(*i);
            }
            tx.exec("INSERT INTO t(i) VALUES (?1)", [*i])?;
            Ok(())
        })
        .unwrap();
        let counted = holder.join().unwrap();
        // The holder read the committed items up to and including the one
        // during which it arrived, and was done before the next was written.
        assert_eq!(counted, 11);
        assert_eq!(holder_seen, Some(11));
        let n: i64 = db
            .read(|c| Ok(c.one("SELECT count(*) FROM t", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(n, 200);
    }
}
