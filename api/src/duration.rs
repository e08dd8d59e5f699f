//! Durations written as Go writes them (`30s`, `5m`, `1h30m`, `1.5h`, `500ms`), the form
//! KubeVirt's components take in their flags (`--qemu-timeout 5m`, `--watchdog-timeout 30s`).
//!
//! Go's `time.ParseDuration` grammar for values that are not negative: one or more
//! `<number>[.<fraction>]<unit>` with the units `ns`, `us` (`µs`), `ms`, `s`, `m` and `h`.
//! A bare whole number is seconds, which Go refuses but kubevirt-rs' flags have always taken.

use std::time::Duration;

/// Why a duration string does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not `<number><unit>...`.
    #[error("{0:?} is not a duration like 30s, 5m, 1h30m or 500ms")]
    Syntax(String),
    /// A unit Go does not know.
    #[error("{0:?}: unknown unit {1:?} (use ns, us, ms, s, m or h)")]
    Unit(String, String),
    /// More than a `Duration` holds.
    #[error("{0:?} is too long")]
    Overflow(String),
}

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Parses a duration; usable as a clap `value_parser`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let syntax = || DurationError::Syntax(s.to_owned());
    let overflow = || DurationError::Overflow(s.to_owned());
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map(Duration::from_secs).map_err(|_| overflow());
    }
    let mut rest = s.strip_prefix('+').unwrap_or(s);
    if rest.is_empty() {
        return Err(syntax());
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let (whole, after) = split_digits(rest);
        let (fraction, after) = match after.strip_prefix('.') {
            Some(a) => split_digits(a),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(syntax());
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => NANOS_PER_SEC,
            "m" => 60 * NANOS_PER_SEC,
            "h" => 3600 * NANOS_PER_SEC,
            "" => return Err(syntax()),
            other => return Err(DurationError::Unit(s.to_owned(), other.to_owned())),
        };
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| overflow())?
        };
        // Digits past the 20th are below a nanosecond for every unit; Go drops them too.
        let fraction = &fraction[..fraction.len().min(20)];
        let part = if fraction.is_empty() {
            0
        } else {
            let digits: u128 = fraction.parse().map_err(|_| syntax())?;
            let len = u32::try_from(fraction.len()).map_err(|_| syntax())?;
            digits * scale / 10u128.pow(len)
        };
        nanos = whole
            .checked_mul(scale)
            .and_then(|n| n.checked_add(part))
            .and_then(|n| n.checked_add(nanos))
            .ok_or_else(overflow)?;
        rest = after;
    }
    let secs = u64::try_from(nanos / NANOS_PER_SEC).map_err(|_| overflow())?;
    let sub = u32::try_from(nanos % NANOS_PER_SEC).map_err(|_| overflow())?;
    Ok(Duration::new(secs, sub))
}

/// The leading ASCII digits of `s`, and what follows them.
fn split_digits(s: &str) -> (&str, &str) {
    s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations_and_bare_seconds() {
        let ms = Duration::from_millis;
        let secs = Duration::from_secs;
        let cases: &[(&str, Duration)] = &[
            ("30", secs(30)),
            ("0", secs(0)),
            ("30s", secs(30)),
            ("5m", secs(300)),
            ("2h", secs(7200)),
            ("500ms", ms(500)),
            ("1h30m", secs(5400)),
            ("1m30.5s", ms(90_500)),
            ("1.5h", secs(5400)),
            (".5s", ms(500)),
            ("1.s", secs(1)),
            ("+10s", secs(10)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("0.000000001s", Duration::from_nanos(1)),
            ("1.0000000000000000000009s", secs(1)),
        ];
        for (s, want) in cases {
            assert_eq!(parse_duration(s), Ok(*want), "{s}");
        }
    }

    #[test]
    fn refuses_what_is_not_a_duration() {
        for s in [
            "", "+", "s", "-5s", "1.5", "5m3", ".s", "1..5s", "abc", " 5s",
        ] {
            assert_eq!(
                parse_duration(s),
                Err(DurationError::Syntax(s.to_owned())),
                "{s:?}"
            );
        }
        assert_eq!(
            parse_duration("5d"),
            Err(DurationError::Unit("5d".into(), "d".into()))
        );
        assert_eq!(
            parse_duration("5m3x"),
            Err(DurationError::Unit("5m3x".into(), "x".into()))
        );
        for s in ["99999999999999999999999", "99999999999999999999999999999h"] {
            assert_eq!(parse_duration(s), Err(DurationError::Overflow(s.into())));
        }
    }

    #[test]
    fn errors_say_what_to_write() {
        assert_eq!(
            parse_duration("soon").unwrap_err().to_string(),
            "\"soon\" is not a duration like 30s, 5m, 1h30m or 500ms"
        );
        assert_eq!(
            parse_duration("3d").unwrap_err().to_string(),
            "\"3d\": unknown unit \"d\" (use ns, us, ms, s, m or h)"
        );
    }
}
