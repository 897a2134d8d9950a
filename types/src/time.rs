//! UTC calendar times without a date library: the one conversion the
//! daemon's image configs, the CLI's listings and the shim's log lines share.

/// The UTC calendar date and time of `secs` seconds since the Unix epoch:
/// `(year, month 1-12, day 1-31, hour, minute, second)` (Howard Hinnant's
/// "civil from days" algorithm, proleptic Gregorian).
pub fn civil_utc(secs: i64) -> (i64, i64, i64, i64, i64, i64) {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// `ns` nanoseconds since the epoch as RFC 3339 UTC to the second
/// (`2026-12-01T19:43:57Z`).
pub fn rfc3339(ns: i64) -> String {
    let (y, m, d, hh, mm, ss) = civil_utc(ns.div_euclid(1_000_000_000));
    format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_and_a_known_day() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_796_154_237_000_000_000), "2026-12-01T19:43:57Z");
        assert_eq!(civil_utc(951_782_400), (2000, 2, 29, 0, 0, 0));
        assert_eq!(rfc3339(-1_000_000_000), "1969-12-31T23:59:59Z");
    }
}
