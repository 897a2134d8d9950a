//! Crash points for tests: a named point where an armed process aborts, as if
//! killed with SIGKILL between two steps of an operation (no destructor runs, no
//! transaction commits after it). Armable only with the `failpoints` feature
//! (tests); without it [`hit`] is an empty inline function and a shipped build
//! has no crash point.

#[cfg(feature = "failpoints")]
static ARMED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Arms point `name`: the next [`hit`] of it aborts the process.
#[cfg(feature = "failpoints")]
pub fn arm(name: &str) {
    *ARMED.lock().unwrap_or_else(|p| p.into_inner()) = Some(name.to_string());
}

/// Aborts the process (SIGABRT, no unwinding) when `name` is armed.
#[inline(always)]
pub fn hit(name: &str) {
    #[cfg(feature = "failpoints")]
    {
        let armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        if armed.as_deref() == Some(name) {
            eprintln!("failpoint {name}: aborting");
            std::process::abort();
        }
    }
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}
