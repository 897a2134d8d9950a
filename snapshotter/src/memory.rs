//! Giving the heap that a large operation freed back to the kernel.
//!
//! glibc's malloc keeps memory a thread freed in that thread's arena (up to
//! one per core × 8, 64 MiB each) for the next allocation, and returns only
//! the top of the main heap on its own. A publish of a 100,000-file session
//! (its capture, the changeset's path records, the index rows staged for the
//! commit) allocates ~100 MiB on the daemon's worker and blocking threads and
//! frees it at the end; glibc kept it, so the daemon's RSS stayed at that peak
//! (35 MB idle → 319–346 MB in a release build, issue 22; 38 → 139 MB in a
//! debug build, measured with `VmRSS`). Every [`CHECK_EVERY`] this task
//! estimates how much freed heap is still resident (`RssAnon` less what
//! `mallinfo2` counts in use: [`free_resident_bytes`]) and, when that grew by
//! more than [`TRIM_ABOVE`], returns it with `malloc_trim(0)` (which also
//! `madvise(MADV_DONTNEED)`s the free pages inside each arena). (It first
//! looked at malloc's free total, `fordblks`, which misses a burst that
//! re-uses the chunks a trim released and frees them again between two
//! checks: the total is unchanged, the pages resident again.) That alone
//! brought the session's 139 MB back to 62 MB; what stayed was live: the
//! SQLite page caches of the store's connections (the writer's up to 64 MiB,
//! `WRITER_CACHE_KIB`, and up to 32 idle readers' 2 MiB each), which a burst
//! of 256 sessions after it filled to 90–100 MB. So once the store has
//! been used by nothing for a whole interval after being used, this task
//! also frees those caches ([`Store::release_db_memory`], which also closes
//! the surplus idle read connections) and trims every arena whatever grew
//! ([`trim`]; a quiet period's free heap below [`TRIM_ABOVE`] stayed before).
//! What a trim cannot return — free chunks pinned between small long-lived
//! allocations spread over many arenas — is kept small by fewer arenas
//! ([`limit_arenas`]).
//! The test is `integration/tests/reliability.rs`
//! `daemon_rss_returns_near_idle_after_a_100000_file_session`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use layerstack_engine::store::Store;
use tracing::debug;

/// How often the daemon looks at its free heap.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Growth (bytes) of the heap that is free but still resident since the
/// last trim above which it is handed back: below this a trim costs more
/// than it returns.
pub const TRIM_ABOVE: usize = 8 << 20;

/// [`free_resident_bytes`] right after the last trim (or its lowest since):
/// the anonymous memory that is not malloc's (thread stacks, other
/// mappings) plus what a trim could not return.
static BASELINE: AtomicUsize = AtomicUsize::new(0);

/// Caps glibc's malloc arenas at one per core (its default is eight per
/// core: 16 here), unless `MALLOC_ARENA_MAX` is set (glibc reads it
/// itself; an operator's choice wins). Call first in `main`, before any
/// thread allocates: a thread is given an arena on its first `malloc`.
///
/// Why (bench P12): a search's read-only burst — ShowGraph streaming 200
/// pages of a 200,000-node graph, each page read on some blocking thread and
/// encoded on some worker — spreads its short-lived allocations over every
/// arena, and the long-lived small ones (prepared statements, tasks) left
/// among them pin the pages: ~12 MB free but resident that `malloc_trim`
/// cannot return (RssAnon after the workload 15.8 MiB against 7.0 MiB with
/// 1,000 nodes). With one arena per core it was 8.2 against 7.3 MiB. Each
/// thread keeps its own cache of small chunks (glibc's tcache), so threads
/// sharing an arena take its lock only on a cache miss.
pub fn limit_arenas() {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let n = libc::c_int::try_from(cores).unwrap_or(libc::c_int::MAX);
        // SAFETY: mallopt only sets malloc's parameter, under its lock.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, n);
        }
    }
}

/// Free bytes glibc's arenas hold (`mallinfo2().fordblks`, summed over every
/// arena), not counting chunks served by `mmap` (returned when freed).
/// Resident or not: a trim releases their pages but they stay counted.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[must_use]
pub fn free_heap_bytes() -> usize {
    // SAFETY: mallinfo2 only reads malloc's own state, under its locks.
    unsafe { libc::mallinfo2() }.fordblks
}

/// Another libc: nothing to measure.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[must_use]
pub fn free_heap_bytes() -> usize {
    0
}

/// Bytes of this process's anonymous memory that malloc does not count as
/// in use: `RssAnon` (`/proc/self/status`, proc(5)) less `mallinfo2`'s
/// `uordblks` (allocated) and `hblkhd` (mmap-served chunks). Its growth is
/// freed heap whose pages are still resident — which `fordblks` alone does
/// not show when an operation re-uses chunks a trim had released and frees
/// them again (the free total is then what it was, the pages resident once
/// more). `None` where it cannot be read.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[must_use]
pub fn free_resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    // SAFETY: as in free_heap_bytes.
    let mi = unsafe { libc::mallinfo2() };
    Some((kib << 10).saturating_sub(mi.uordblks + mi.hblkhd))
}

/// Another libc: nothing to measure.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[must_use]
pub fn free_resident_bytes() -> Option<usize> {
    None
}

/// Returns the free heap to the kernel when the free-but-resident part of
/// it grew by more than [`TRIM_ABOVE`] since the last trim; answers the
/// bytes it estimated before (`None`: it did not, nothing done).
pub fn trim_if_large() -> Option<usize> {
    let free = free_resident_bytes()?;
    let base = BASELINE.fetch_min(free, Ordering::Relaxed).min(free);
    if free < base + TRIM_ABOVE {
        return None;
    }
    trim();
    Some(free)
}

/// `malloc_trim(0)`: every arena's free pages back to the kernel (the top of
/// each heap unmapped or shrunk, the free chunks inside `madvise`d away);
/// then the new baseline for [`trim_if_large`]. Cost: one walk of the
/// arenas' free lists under their locks (well under a millisecond for the
/// daemon's heaps).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes malloc's locks itself; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
    BASELINE.store(free_resident_bytes().unwrap_or(0), Ordering::Relaxed);
}

/// Runs [`trim_if_large`] every [`CHECK_EVERY`] on a blocking thread, for
/// the daemon's lifetime; and once the store has written nothing for a whole
/// check interval after writing, frees its SQLite page caches
/// ([`Store::release_db_memory`]) and returns that heap too.
pub async fn watch(store: Arc<Store>) {
    let mut tick = tokio::time::interval(CHECK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = store.db_transactions();
    let mut released = false;
    loop {
        tick.tick().await;
        let used = store.db_transactions();
        let idle = used == seen;
        if !idle {
            released = false;
        }
        seen = used;
        let st = store.clone();
        let release = idle && !released;
        let done = tokio::task::spawn_blocking(move || {
            if release {
                // Once per quiet period: the caches' pages and whatever the
                // work left free in any arena, however little grew.
                let before = free_resident_bytes();
                let conns = st.release_db_memory();
                trim();
                (conns, before)
            } else {
                (0, trim_if_large())
            }
        })
        .await;
        if let Ok((conns, trimmed)) = done {
            released |= release;
            if conns > 0 || trimmed.is_some() {
                debug!(
                    db_connections_released = conns,
                    free_bytes = trimmed.unwrap_or(0),
                    after_bytes = free_resident_bytes().unwrap_or(0),
                    free_heap_bytes = free_heap_bytes(),
                    "returned memory to the kernel (SQLite caches, malloc_trim)"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 32 MiB in small blocks (not mmap-served), touched; then all but every
    /// 64th freed: runs of free memory between blocks still in use, which
    /// glibc cannot give back by shrinking its heap's top (as after a publish
    /// whose memory other data sits among).
    fn churn(v: &mut Vec<Vec<u8>>) {
        v.clear();
        v.extend((0..8_192).map(|_| vec![1u8; 4096]));
        for (i, b) in v.iter_mut().enumerate() {
            if i % 64 != 0 {
                *b = Vec::new();
            }
        }
    }

    #[test]
    fn a_large_free_heap_is_returned_each_time_it_is_touched_again() {
        let mut v = Vec::new();
        churn(&mut v);
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert!(free_heap_bytes() >= TRIM_ABOVE, "{}", free_heap_bytes());
            assert!(trim_if_large().is_some());
        }
        assert!(
            trim_if_large().is_none(),
            "nothing freed since: no second trim"
        );
        // The same chunks used and freed again: malloc's free total is what
        // it was after the trim, but the pages are resident once more.
        let free_before = free_heap_bytes();
        churn(&mut v);
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            let free_after = free_heap_bytes();
            assert!(
                free_after < free_before + TRIM_ABOVE,
                "the free total did not grow ({free_before} → {free_after} bytes)"
            );
            assert!(
                trim_if_large().is_some(),
                "re-touched free pages are returned again"
            );
        }
        drop(v);
    }
}
