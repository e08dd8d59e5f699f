//! Kubernetes resource quantities, for resource requests, limits and extended resources.

/// Parses a Kubernetes quantity into thousandths of its unit (`"100m"` -> 100, `"1Ki"` ->
/// 1_024_000). `None` when it is not a quantity.
pub fn parse_quantity(q: &str) -> Option<i128> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let (mantissa, exp10): (&str, i32) = if let Some(e) = suffix
        .strip_prefix('e')
        .or_else(|| suffix.strip_prefix('E'))
        .filter(|e| !e.is_empty())
    {
        (number, e.parse().ok()?)
    } else {
        let exp = match suffix {
            "" => 0,
            "n" => -9,
            "u" => -6,
            "m" => -3,
            "k" => 3,
            "M" => 6,
            "G" => 9,
            "T" => 12,
            "P" => 15,
            "E" => 18,
            binary => {
                let power = match binary {
                    "Ki" => 1,
                    "Mi" => 2,
                    "Gi" => 3,
                    "Ti" => 4,
                    "Pi" => 5,
                    "Ei" => 6,
                    _ => return None,
                };
                let base = scaled(number, 3)?;
                return base.checked_mul(1024_i128.checked_pow(power)?);
            }
        };
        (number, exp)
    };
    scaled(mantissa, exp10 + 3)
}

/// `number` times 10^`exp`, rounded up like Kubernetes rounds quantities.
fn scaled(number: &str, exp: i32) -> Option<i128> {
    let (negative, digits) = match number.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, number.strip_prefix('+').unwrap_or(number)),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    if !int.chars().chain(frac.chars()).all(|c| c.is_ascii_digit()) {
        return None;
    }
    let all: String = format!("{int}{frac}");
    let mut value: i128 = if all.is_empty() { 0 } else { all.parse().ok()? };
    let mut exp = exp - i32::try_from(frac.len()).ok()?;
    while exp > 0 {
        value = value.checked_mul(10)?;
        exp -= 1;
    }
    while exp < 0 {
        let rest = value % 10;
        value /= 10;
        if rest != 0 {
            value += 1;
        }
        exp += 1;
    }
    Some(if negative { -value } else { value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        let cases = [
            ("1", Some(1000)),
            ("100m", Some(100)),
            ("0.5", Some(500)),
            ("1Ki", Some(1_024_000)),
            ("2Gi", Some(2 * 1024 * 1024 * 1024 * 1000)),
            ("1M", Some(1_000_000_000)),
            ("1e3", Some(1_000_000)),
            ("1.5k", Some(1_500_000)),
            ("1n", Some(1)),
            ("", None),
            ("abc", None),
            ("1Xi", None),
        ];
        for (q, want) in cases {
            assert_eq!(parse_quantity(q), want, "{q}");
        }
    }
}
