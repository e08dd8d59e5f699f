//! Quantity parsing agrees with formatting and with Kubernetes' ordering, for any value.

use api::quantity::{ParsedQuantity, format_binary_si};
use proptest::prelude::*;

proptest! {
    #[test]
    fn formatted_bytes_parse_back(bytes in 0i128..(1i128 << 62)) {
        let s = format_binary_si(bytes);
        prop_assert_eq!(ParsedQuantity::parse(&s).unwrap().value(), bytes);
    }

    #[test]
    fn suffixes_scale_exactly(n in 0i128..1_000_000, suffix in prop::sample::select(vec![
        ("", 1i128), ("k", 1_000), ("M", 1_000_000), ("G", 1_000_000_000),
        ("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40),
    ])) {
        let q = ParsedQuantity::parse(&format!("{n}{}", suffix.0)).unwrap();
        prop_assert_eq!(q.value(), n * suffix.1);
    }

    #[test]
    fn milli_values_round_up(m in 0i128..10_000_000) {
        let q = ParsedQuantity::parse(&format!("{m}m")).unwrap();
        prop_assert_eq!(q.milli_value(), m);
        prop_assert_eq!(q.value(), (m + 999) / 1000);
    }

    #[test]
    fn garbage_never_panics(s in "\\PC{0,12}") {
        let _ = ParsedQuantity::parse(&s);
    }
}

#[test]
fn huge_numbers_are_errors_not_panics() {
    for s in [
        "170141183460469231731687303715884105727e-1",
        "99999999999999999999999999999999999999Ei",
        "1e99999",
        "1e-99999",
    ] {
        assert!(ParsedQuantity::parse(s).is_err(), "{s}");
    }
}
