//! Parsing Kubernetes resource quantities (`128Mi`, `1.5G`, `100m`, `1e3`).
//!
//! k8s-openapi's `Quantity` is an opaque string, and the parser crates on crates.io pin older
//! k8s-openapi releases, so the grammar of `k8s.io/apimachinery/pkg/api/resource` is implemented
//! here. Values are exact: they are held in nano-units in an `i128`.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Why a quantity string does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Empty string.
    #[error("quantity is empty")]
    Empty,
    /// Not `<sign><digits>[.<digits>]<suffix>`.
    #[error("{0:?} is not a quantity (expected e.g. 128Mi, 1G, 500m)")]
    Syntax(String),
    /// Suffix not in binarySI, decimalSI or decimal exponent form.
    #[error("{0:?} has an unknown suffix {1:?}")]
    Suffix(String, String),
    /// Too large to represent (or, for a byte count, to fit in a `u64`).
    #[error("{0:?} is too large")]
    Overflow(String),
    /// Below zero where only a size makes sense.
    #[error("{0:?} is negative")]
    Negative(String),
}

const NANO: i128 = 1_000_000_000;

/// Quantities compared by value, as KubeVirt's `Quantity.Equal` (`1Gi` = `1024Mi`); ones
/// that do not parse are compared as written.
pub fn same(a: &Quantity, b: &Quantity) -> bool {
    match (
        ParsedQuantity::from_quantity(a),
        ParsedQuantity::from_quantity(b),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// A parsed quantity: an exact value in units of 10^-9.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ParsedQuantity {
    nanos: i128,
}

impl ParsedQuantity {
    /// Parse a quantity string.
    pub fn parse(s: &str) -> Result<Self, QuantityError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(QuantityError::Empty);
        }
        let syntax = || QuantityError::Syntax(s.to_owned());
        let overflow = || QuantityError::Overflow(s.to_owned());
        let (negative, body) = match s.as_bytes()[0] {
            b'-' => (true, &s[1..]),
            b'+' => (false, &s[1..]),
            _ => (false, s),
        };
        let number_len = body
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(body.len());
        let (number, suffix) = body.split_at(number_len);
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(syntax());
        }
        if frac_part.contains('.') {
            return Err(syntax());
        }
        // Mantissa as an integer plus a base-10 exponent: 1.5 -> 15 x 10^-1.
        let digits = format!("{int_part}{frac_part}");
        let mantissa: i128 = digits
            .trim_start_matches('0')
            .parse::<i128>()
            .or_else(|_| {
                if digits.chars().all(|c| c == '0') {
                    Ok(0)
                } else {
                    Err(overflow())
                }
            })?;
        let mut exp10: i32 = -i32::try_from(frac_part.len()).map_err(|_| overflow())?;
        let mut pow2: u32 = 0;
        match suffix {
            "" => {}
            "Ki" => pow2 = 10,
            "Mi" => pow2 = 20,
            "Gi" => pow2 = 30,
            "Ti" => pow2 = 40,
            "Pi" => pow2 = 50,
            "Ei" => pow2 = 60,
            "n" => exp10 -= 9,
            "u" => exp10 -= 6,
            "m" => exp10 -= 3,
            "k" => exp10 += 3,
            "M" => exp10 += 6,
            "G" => exp10 += 9,
            "T" => exp10 += 12,
            "P" => exp10 += 15,
            "E" => exp10 += 18,
            other if other.starts_with(['e', 'E']) => {
                let e: i32 = other[1..]
                    .parse()
                    .map_err(|_| QuantityError::Suffix(s.to_owned(), other.to_owned()))?;
                exp10 = exp10.checked_add(e).ok_or_else(overflow)?;
            }
            other => return Err(QuantityError::Suffix(s.to_owned(), other.to_owned())),
        }
        let mut nanos = mantissa
            .checked_mul(1i128.checked_shl(pow2).ok_or_else(overflow)?)
            .ok_or_else(overflow)?;
        let scale = exp10 + 9;
        if scale >= 0 {
            let factor = 10i128
                .checked_pow(u32::try_from(scale).map_err(|_| overflow())?)
                .ok_or_else(overflow)?;
            nanos = nanos.checked_mul(factor).ok_or_else(overflow)?;
        } else {
            // Below a nano-unit: Kubernetes rounds up, and so do we.
            let divisor = 10i128
                .checked_pow(u32::try_from(-scale).map_err(|_| overflow())?)
                .ok_or_else(overflow)?;
            nanos = nanos.checked_add(divisor - 1).ok_or_else(overflow)? / divisor;
        }
        Ok(Self {
            nanos: if negative { -nanos } else { nanos },
        })
    }

    /// Parse a `Quantity`.
    pub fn from_quantity(q: &Quantity) -> Result<Self, QuantityError> {
        Self::parse(&q.0)
    }

    /// The value rounded up to a whole unit (bytes for memory), as Kubernetes' `Value()`.
    pub fn value(self) -> i128 {
        let whole = self.nanos.div_euclid(NANO);
        if self.nanos.rem_euclid(NANO) == 0 {
            whole
        } else {
            whole + 1
        }
    }

    /// The value in thousandths rounded up, as Kubernetes' `MilliValue()`.
    pub fn milli_value(self) -> i128 {
        let unit = NANO / 1000;
        let whole = self.nanos.div_euclid(unit);
        if self.nanos.rem_euclid(unit) == 0 {
            whole
        } else {
            whole + 1
        }
    }

    /// Whether the value is zero.
    pub fn is_zero(self) -> bool {
        self.nanos == 0
    }

    /// Whether the value is below zero.
    pub fn is_negative(self) -> bool {
        self.nanos < 0
    }
}

/// A byte count in Kubernetes' canonical binary-SI spelling (`4Gi`, `1536Mi`, `1000`).
pub fn format_binary_si(bytes: i128) -> String {
    const SUFFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let mut value = bytes;
    let mut suffix = "";
    for s in SUFFIXES {
        if value == 0 || value % 1024 != 0 {
            break;
        }
        value /= 1024;
        suffix = s;
    }
    format!("{value}{suffix}")
}

/// A size in bytes (memory, disk capacity, page size), rounded up to a whole byte as
/// Kubernetes' `Value()` rounds: `"1.5Gi"` is 1610612736, `"100m"` is 1.
pub fn bytes(s: &str) -> Result<u64, QuantityError> {
    let p = ParsedQuantity::parse(s)?;
    if p.is_negative() {
        return Err(QuantityError::Negative(s.trim().to_owned()));
    }
    u64::try_from(p.value()).map_err(|_| QuantityError::Overflow(s.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_kubernetes_accepts() {
        let cases: &[(&str, i128)] = &[
            ("128Mi", 128 << 20),
            ("1Gi", 1 << 30),
            ("1.5Gi", 3 << 29),
            ("1G", 1_000_000_000),
            ("1k", 1000),
            ("1e3", 1000),
            ("1E3", 1000),
            ("2", 2),
            ("0", 0),
            ("+5", 5),
            ("-5", -5),
            (".5k", 500),
            ("1.", 1),
        ];
        for (s, want) in cases {
            assert_eq!(ParsedQuantity::parse(s).unwrap().value(), *want, "{s}");
        }
        assert_eq!(ParsedQuantity::parse("100m").unwrap().milli_value(), 100);
        assert_eq!(ParsedQuantity::parse("100m").unwrap().value(), 1);
        assert_eq!(ParsedQuantity::parse("1").unwrap().milli_value(), 1000);
    }

    #[test]
    fn refuses_what_kubernetes_refuses() {
        for s in [
            "", "Mi", "12XB", "1.2.3", "1Mii", "abc", "--1", "1e", "1 Gi",
        ] {
            assert!(ParsedQuantity::parse(s).is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn milli_values_are_kubernetes_milli_values() {
        let cases: &[(&str, i128)] = &[
            ("1", 1000),
            ("100m", 100),
            ("0.5", 500),
            ("1Ki", 1_024_000),
            ("2Gi", 2 * 1024 * 1024 * 1024 * 1000),
            ("1M", 1_000_000_000),
            ("1e3", 1_000_000),
            ("1.5k", 1_500_000),
            ("1n", 1),
        ];
        for (s, want) in cases {
            assert_eq!(
                ParsedQuantity::parse(s).unwrap().milli_value(),
                *want,
                "{s}"
            );
        }
        for s in ["", "abc", "1Xi"] {
            assert!(ParsedQuantity::parse(s).is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn bytes_are_whole_and_unsigned() {
        assert_eq!(bytes("512Mi"), Ok(512 << 20));
        assert_eq!(bytes("1Gi"), Ok(1 << 30));
        assert_eq!(bytes("1G"), Ok(1_000_000_000));
        assert_eq!(bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(bytes("2e3"), Ok(2000));
        assert_eq!(bytes("100"), Ok(100));
        assert_eq!(bytes(" 1Ki "), Ok(1024));
        assert_eq!(bytes("100m"), Ok(1));
        assert_eq!(bytes("0"), Ok(0));
        assert_eq!(bytes("16Ei"), Err(QuantityError::Overflow("16Ei".into())));
        assert_eq!(bytes("-1Mi"), Err(QuantityError::Negative("-1Mi".into())));
        assert_eq!(
            bytes("1Qi"),
            Err(QuantityError::Suffix("1Qi".into(), "Qi".into()))
        );
        for s in ["", "Mi", "1.2.3", "99999999999999999999Ei"] {
            assert!(bytes(s).is_err(), "{s:?} parsed");
        }
    }

    #[test]
    fn formats_canonical_binary_si() {
        assert_eq!(format_binary_si(4 << 30), "4Gi");
        assert_eq!(format_binary_si(1536 << 20), "1536Mi");
        assert_eq!(format_binary_si(1000), "1000");
        assert_eq!(format_binary_si(0), "0");
    }

    #[test]
    fn orders_by_value_not_spelling() {
        let a = ParsedQuantity::parse("1Gi").unwrap();
        let b = ParsedQuantity::parse("1024Mi").unwrap();
        let c = ParsedQuantity::parse("1G").unwrap();
        assert_eq!(a, b);
        assert!(c < a);
    }
}
