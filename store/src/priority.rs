//! Thread CPU priorities, in one place: who runs behind whom on a busy
//! machine (setpriority(2) on a thread id; Linux applies nice per thread).
//!
//! | who | nice | why |
//! |---|---|---|
//! | the commit under a branch's gate ([`Priority::gate_holder`]) | −5 | every other publish of the branch waits on it |
//! | a publish's preparation ([`Priority::background`]) | +10 | gives way to the gate holder; its store writes run at the priority it replaced ([`store_write`]) |
//! | the store's own threads (WAL checkpoints, the reaper) | +10 | nothing waits for them ([`background_thread`]) |

/// While alive, the calling thread runs at another CPU priority
/// (setpriority(2) on its thread id; Linux applies nice per thread), restored
/// on drop. A failure (never expected as root) leaves the priority as it was.
///
/// * [`Priority::background`] (nice +10): a publish's preparation gives way to
///   the one publish holding its branch's gate, which every other publish of
///   the branch waits on. Store writes made meanwhile run at the priority it
///   replaced ([`store_write`]): a lowered thread holding the store's one writer
///   would hold up the gate holder's commit behind it (priority inversion).
/// * [`Priority::gate_holder`] (nice −5, needs CAP_SYS_NICE): the commit under
///   the gate goes ahead of the daemon's other work (RPCs, censuses) on a busy
///   machine.
pub struct Priority {
    before: Option<i32>,
}

thread_local! {
    /// The priority a [`Priority::background`] on this thread replaced.
    static LOWERED_FROM: std::cell::Cell<Option<i32>> = const { std::cell::Cell::new(None) };
}

impl Priority {
    const BACKGROUND: i32 = 10;
    const GATE_HOLDER: i32 = -5;

    /// Lowers the calling thread by 10 until the guard drops (see the type's docs).
    pub fn background() -> Priority {
        let p = Self::by(Self::BACKGROUND);
        LOWERED_FROM.with(|c| c.set(p.before));
        p
    }

    /// Raises the calling thread by 5 until the guard drops (see the type's docs).
    pub fn gate_holder() -> Priority {
        Self::by(Self::GATE_HOLDER)
    }

    fn by(offset: i32) -> Priority {
        let now = Self::get();
        Priority {
            before: Self::set(now + offset).then_some(now),
        }
    }

    /// Runs `f` (a store write) at the priority the thread's
    /// [`Priority::background`] replaced, if there is one, and lowers the
    /// thread again afterwards.
    fn writing<T>(f: impl FnOnce() -> T) -> T {
        let Some(before) = LOWERED_FROM.with(std::cell::Cell::get) else {
            return f();
        };
        let raised = Self::set(before);
        let r = f();
        if raised {
            Self::set(before + Self::BACKGROUND);
        }
        r
    }

    fn get() -> i32 {
        // SAFETY: gettid and getpriority take and return plain integers; no
        // memory is shared with the kernel.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        // SAFETY: as above.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) }
    }

    fn set(nice: i32) -> bool {
        // SAFETY: gettid and setpriority take and return plain integers; no
        // memory is shared with the kernel.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        // SAFETY: as above.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) == 0 }
    }
}

impl Drop for Priority {
    fn drop(&mut self) {
        LOWERED_FROM.with(|c| c.set(None));
        if let Some(nice) = self.before {
            if !Self::set(nice) {
                tracing::warn!("a worker thread could not return to its CPU priority");
            }
        }
    }
}

/// Runs `f`, a store write made during a publish's preparation, at the
/// priority the thread's [`Priority::background`] replaced ([`Priority::writing`]).
pub fn store_write<T>(f: impl FnOnce() -> T) -> T {
    Priority::writing(f)
}

/// Lowers the calling thread's CPU priority by 10 for good: the store's own
/// background threads (WAL checkpoints, removing trees) run behind everything
/// that waits for an answer. A failure leaves the priority as it was.
pub(crate) fn background_thread() {
    let now = Priority::get();
    Priority::set(now + Priority::BACKGROUND);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{store_write, Priority};

    fn nice() -> i32 {
        // SAFETY: plain integers (see `Priority`).
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    #[test]
    fn the_gate_holder_runs_ahead_and_gives_it_back() {
        std::thread::spawn(|| {
            let before = nice();
            {
                let _g = Priority::gate_holder();
                if nix::unistd::geteuid().is_root() {
                    assert_eq!(nice(), (before + Priority::GATE_HOLDER).max(-20));
                } else {
                    assert!(
                        std::env::var("CI").as_deref() != Ok("true"),
                        "raising a thread's priority needs root under CI=true"
                    );
                }
                // Not a background thread: a store write changes nothing.
                assert_eq!(store_write(nice), nice());
            }
            assert_eq!(nice(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn preparation_runs_at_a_lower_priority_and_gives_it_back() {
        std::thread::spawn(|| {
            let before = nice();
            {
                let _b = Priority::background();
                let lowered = (before + Priority::BACKGROUND).min(19);
                assert_eq!(nice(), lowered);
                // A store write runs at the priority the thread had.
                assert_eq!(store_write(nice), before);
                assert_eq!(nice(), lowered, "lowered again after the write");
            }
            assert_eq!(store_write(nice), before, "nothing to restore outside");
            assert_eq!(
                nice(),
                before,
                "back to its priority (raising it needs root: CAP_SYS_NICE)"
            );
        })
        .join()
        .unwrap();
    }
}
