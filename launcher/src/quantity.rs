//! Kubernetes resource quantities (`512Mi`, `1G`, `1.5Gi`, `2e9`) as byte counts.
//!
//! k8s-openapi keeps a `Quantity` as its string and does not parse it; the launcher only needs
//! sizes in bytes, so this is a small parser for that subset (no milli-units).

/// Parses a quantity to a whole number of bytes, rounding a fractional result up.
pub fn bytes(q: &str) -> Result<u64, String> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    if number.is_empty() || number.matches('.').count() > 1 {
        return Err(format!("{q:?} is not a quantity"));
    }
    let multiplier: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        s if s.starts_with(['e', 'E']) => {
            let exp: i32 = s[1..]
                .parse()
                .map_err(|_| format!("{q:?} has a bad exponent"))?;
            10f64.powi(exp)
        }
        other => return Err(format!("{q:?} has an unknown suffix {other:?}")),
    };
    // Integers are exact in the common case; only fractions go through floating point.
    if !number.contains('.') && multiplier.fract() == 0.0 && multiplier < 1e18 {
        let n: u64 = number.parse().map_err(|_| format!("{q:?} is too large"))?;
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let m = multiplier as u64;
        return n
            .checked_mul(m)
            .ok_or_else(|| format!("{q:?} is too large"));
    }
    let n: f64 = number
        .parse()
        .map_err(|_| format!("{q:?} is not a quantity"))?;
    let v = (n * multiplier).ceil();
    if !(0.0..1.8e19).contains(&v) {
        return Err(format!("{q:?} is out of range"));
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(bytes("512Mi"), Ok(512 << 20));
        assert_eq!(bytes("1Gi"), Ok(1 << 30));
        assert_eq!(bytes("1G"), Ok(1_000_000_000));
        assert_eq!(bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(bytes("2e3"), Ok(2000));
        assert_eq!(bytes("100"), Ok(100));
    }

    #[test]
    fn rejects_garbage() {
        assert!(bytes("").is_err());
        assert!(bytes("Mi").is_err());
        assert!(bytes("1Qi").is_err());
        assert!(bytes("1.2.3").is_err());
        assert!(bytes("99999999999999999999Ei").is_err());
    }
}
