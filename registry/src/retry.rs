//! Retrying transient registry failures: which failures are transient
//! ([`transient`]), the backoff schedule ([`Backoff`]) and the jitter that
//! spreads clients apart ([`Jitter`]).
//!
//! Only whole idempotent steps are retried (a `HEAD`, a `GET` of a manifest or
//! a blob into a fresh temp file, a manifest `PUT`, a blob upload from a new
//! upload session with the file read again from its start); the step's
//! callers in `client.rs` decide that, this module only decides *whether* and
//! *when*.

use std::time::Duration;

use crate::RegistryError;

/// Default attempts per step (the first try and up to 3 retries).
pub const DEFAULT_RETRY_ATTEMPTS: u32 = 4;
/// Default delay before the first retry, ms (doubled per retry).
pub const DEFAULT_RETRY_BASE_MS: u64 = 200;
/// Default longest delay between two attempts, ms.
pub const DEFAULT_RETRY_MAX_MS: u64 = 5_000;
/// The most attempts [`crate::RegistryOptions::retry_attempts`] may ask for.
pub const MAX_RETRY_ATTEMPTS: u32 = 100;
/// The longest [`crate::RegistryOptions::retry_max_ms`] may be, ms (10 min).
pub const MAX_RETRY_MAX_MS: u64 = 600_000;
/// Default [`crate::RegistryOptions::connect_timeout_ms`]: 15 s.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 15_000;
/// Default [`crate::RegistryOptions::read_timeout_ms`]: 120 s.
pub const DEFAULT_READ_TIMEOUT_MS: u64 = 120_000;
/// The longest either timeout may be, ms (1 hour).
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;

/// Why a failed step may be tried again, and how long the registry asked us
/// to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transient {
    /// The registry's `Retry-After` (seconds), when one was seen.
    pub retry_after: Option<Duration>,
}

/// `Some` when `e` is a failure that trying again may cure: the registry
/// could not be reached (refused, reset, timed out, a temporary DNS failure),
/// or it answered 408, 429, or a 5xx other than 501 Not Implemented. `None`
/// for everything else: other 4xx, 401/403, not found, digest or size
/// mismatches, invalid references or arguments, TLS and protocol mismatches,
/// local file errors.
pub(crate) fn transient(e: &RegistryError) -> Option<Transient> {
    match e {
        RegistryError::Unreachable { transient, .. } if *transient => {
            Some(Transient { retry_after: None })
        }
        RegistryError::Rejected {
            status: Some(s),
            retry_after_s,
            ..
        } if retryable_status(*s) => Some(Transient {
            retry_after: retry_after_s.map(Duration::from_secs),
        }),
        _ => None,
    }
}

/// 408 Request Timeout, 429 Too Many Requests, and 5xx except 501 Not
/// Implemented (which does not go away).
pub(crate) fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 429) || ((500..600).contains(&status) && status != 501)
}

/// The schedule: `attempts` tries in all; before retry `n` (1-based) a delay
/// drawn from `[c/2, c]` where `c = min(max, base · 2^(n-1))` ("equal
/// jitter": never less than half the exponential step, so clients that
/// failed together spread out but none hammers the registry). A
/// `Retry-After` from the registry raises the delay to that many seconds,
/// capped at `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Backoff {
    /// Tries per step, the first one included (≥ 1).
    pub attempts: u32,
    /// Ceiling of the first retry's delay.
    pub base: Duration,
    /// Ceiling of every delay, `Retry-After` included.
    pub max: Duration,
}

impl Backoff {
    /// The delay before retry `retry` (1 = the second attempt), for `unit`
    /// in `[0, 1)` (the jitter draw) and the registry's `Retry-After`.
    pub fn delay(&self, retry: u32, unit: f64, retry_after: Option<Duration>) -> Duration {
        let shift = retry.saturating_sub(1).min(32);
        let ceiling = self
            .base
            .checked_mul(1u32 << shift.min(31))
            .unwrap_or(self.max)
            .min(self.max);
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let half = ceiling / 2;
        let jittered = half + (ceiling - half).mul_f64(unit);
        match retry_after {
            Some(ra) => jittered.max(ra.min(self.max)),
            None => jittered,
        }
    }
}

/// A small xorshift64* generator for the jitter draws: no cryptographic
/// strength needed, only that two clients (two daemons) draw differently.
#[derive(Debug)]
pub(crate) struct Jitter(u64);

impl Jitter {
    /// Seeded from the process's hash randomness and the clock.
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        Self::seeded(h.finish())
    }

    /// Seeded with `seed` (tests: a fixed sequence).
    pub fn seeded(seed: u64) -> Self {
        // splitmix64 of the seed: nearby seeds give unrelated states, and
        // the state is never 0 (xorshift's fixed point).
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    /// The next draw, in `[0, 1)`.
    pub fn next_unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        // The top 53 bits as a fraction.
        (r >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::io;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn rejected(status: Option<u16>, retry_after_s: Option<u64>) -> RegistryError {
        RegistryError::Rejected {
            registry: "reg.example".into(),
            op: "push",
            target: "blob".into(),
            status,
            retry_after_s,
            detail: "x".into(),
        }
    }

    #[test]
    fn which_failures_are_transient() {
        for s in [408, 429, 500, 502, 503, 504, 599] {
            assert!(transient(&rejected(Some(s), None)).is_some(), "{s}");
        }
        for s in [400, 401, 403, 404, 405, 409, 413, 416, 501] {
            assert!(transient(&rejected(Some(s), None)).is_none(), "{s}");
        }
        assert!(
            transient(&rejected(None, None)).is_none(),
            "no status: not known to be transient"
        );
        assert_eq!(
            transient(&rejected(Some(429), Some(3))),
            Some(Transient {
                retry_after: Some(Duration::from_secs(3))
            })
        );
        let unreachable = |transient| RegistryError::Unreachable {
            registry: "reg.example".into(),
            detail: "connection refused".into(),
            transient,
        };
        assert!(transient(&unreachable(true)).is_some());
        assert!(
            transient(&unreachable(false)).is_none(),
            "a name that does not resolve"
        );
        let never = [
            RegistryError::Denied {
                registry: "r".into(),
                op: "push",
                target: "t".into(),
                status: 401,
                anonymous: true,
            },
            RegistryError::NotFound {
                registry: "r".into(),
                target: "t".into(),
            },
            RegistryError::Corrupt {
                registry: "r".into(),
                target: "t".into(),
                expected: "a".into(),
                actual: "b".into(),
            },
            RegistryError::NotThatBlob {
                registry: "r".into(),
                digest: "d".into(),
                path: "/f".into(),
                detail: "x".into(),
            },
            RegistryError::InvalidReference {
                reference: "x".into(),
                reason: "y".into(),
            },
            RegistryError::InvalidDigest { digest: "d".into() },
            RegistryError::NotHttps {
                registry: "r".into(),
                detail: "x".into(),
            },
            RegistryError::TlsUntrusted {
                registry: "r".into(),
                detail: "x".into(),
            },
            RegistryError::io("read", "/f", io::Error::from(io::ErrorKind::TimedOut)),
        ];
        for e in never {
            assert!(transient(&e).is_none(), "{e}");
        }
    }

    #[test]
    fn the_schedule_doubles_within_half_and_whole_and_is_capped() {
        let b = Backoff {
            attempts: 8,
            base: ms(200),
            max: ms(5000),
        };
        // unit 0 → half the ceiling; unit → 1 → the ceiling.
        let lows: Vec<_> = (1..=7).map(|n| b.delay(n, 0.0, None)).collect();
        assert_eq!(
            lows,
            [100, 200, 400, 800, 1600, 2500, 2500].map(ms).to_vec()
        );
        let highs: Vec<_> = (1..=7).map(|n| b.delay(n, 1.0, None)).collect();
        assert_eq!(
            highs,
            [200, 400, 800, 1600, 3200, 5000, 5000].map(ms).to_vec()
        );
        assert_eq!(b.delay(3, 0.5, None), ms(600));
        // Far retries neither overflow nor exceed the cap.
        assert_eq!(b.delay(40, 1.0, None), ms(5000));
        assert_eq!(b.delay(u32::MAX, 0.0, None), ms(2500));
        // Out-of-range draws are clamped.
        assert_eq!(b.delay(1, 7.0, None), ms(200));
        assert_eq!(b.delay(1, f64::NAN, None), ms(100));
    }

    #[test]
    fn retry_after_raises_the_delay_up_to_the_cap() {
        let b = Backoff {
            attempts: 4,
            base: ms(200),
            max: ms(5000),
        };
        assert_eq!(b.delay(1, 0.0, Some(Duration::from_secs(1))), ms(1000));
        assert_eq!(
            b.delay(1, 0.0, Some(Duration::from_secs(3600))),
            ms(5000),
            "capped at max"
        );
        // A Retry-After shorter than the schedule does not shorten it.
        assert_eq!(b.delay(5, 1.0, Some(Duration::from_secs(1))), ms(3200));
    }

    #[test]
    fn seeded_jitter_is_deterministic_and_in_range() {
        let mut a = Jitter::seeded(42);
        let mut b = Jitter::seeded(42);
        let xs: Vec<f64> = (0..1000).map(|_| a.next_unit()).collect();
        let ys: Vec<f64> = (0..1000).map(|_| b.next_unit()).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        // Spread: both halves of the range are drawn.
        assert!(xs.iter().any(|x| *x < 0.5) && xs.iter().any(|x| *x >= 0.5));
        let mut c = Jitter::seeded(43);
        assert_ne!(c.next_unit(), xs[0]);
        // A schedule from a seeded draw is reproducible.
        let sched = Backoff {
            attempts: 4,
            base: ms(200),
            max: ms(5000),
        };
        let mut j1 = Jitter::seeded(7);
        let mut j2 = Jitter::seeded(7);
        let d1: Vec<_> = (1..4)
            .map(|n| sched.delay(n, j1.next_unit(), None))
            .collect();
        let d2: Vec<_> = (1..4)
            .map(|n| sched.delay(n, j2.next_unit(), None))
            .collect();
        assert_eq!(d1, d2);
        for (n, d) in (1..4).zip(&d1) {
            let ceiling = ms(200 * (1 << (n - 1)));
            assert!(*d >= ceiling / 2 && *d <= ceiling, "{n}: {d:?}");
        }
    }
}
