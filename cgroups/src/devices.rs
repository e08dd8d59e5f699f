//! Device access rules and what they amount to.
//!
//! The rules follow the v1 devices controller's model, which both backends enforce identically:
//! everything is denied unless an allow entry covers it. Rules apply in order; an allow rule
//! adds access to the entry with the same type, major and minor (creating it), a deny rule
//! takes access away from that exact entry only (a deny of `c 1:3` does not carve a hole in an
//! earlier allow of `c *:*`; that is what the v1 kernel does too). [`effective`] computes the
//! resulting allow list; the v1 backend writes it to the kernel, the v2 backend compiles it to
//! eBPF.

use std::fmt;
use std::str::FromStr;

use crate::error::{CgroupError, Result};

/// Which device nodes a rule covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    /// Both character and block devices.
    All,
    Char,
    Block,
}

impl DeviceKind {
    fn letter(self) -> char {
        match self {
            Self::All => 'a',
            Self::Char => 'c',
            Self::Block => 'b',
        }
    }
}

/// A set of access kinds. The bit values are the kernel's `BPF_DEVCG_ACC_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Access(u8);

impl Access {
    pub const NONE: Self = Self(0);
    pub const MKNOD: Self = Self(1);
    pub const READ: Self = Self(2);
    pub const WRITE: Self = Self(4);
    pub const ALL: Self = Self(7);

    /// The kernel's bit mask.
    pub fn bits(self) -> u8 {
        self.0
    }

    /// Only the bits that are valid access kinds are kept.
    pub fn from_bits_truncate(bits: u8) -> Self {
        Self(bits & Self::ALL.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    #[must_use]
    pub fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    #[must_use]
    pub fn minus(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (bit, letter) in [(Self::READ, 'r'), (Self::WRITE, 'w'), (Self::MKNOD, 'm')] {
            if self.contains(bit) {
                write!(f, "{letter}")?;
            }
        }
        Ok(())
    }
}

impl FromStr for Access {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        s.chars().try_fold(Self::NONE, |acc, c| match c {
            'r' => Ok(acc.union(Self::READ)),
            'w' => Ok(acc.union(Self::WRITE)),
            'm' => Ok(acc.union(Self::MKNOD)),
            other => Err(format!(
                "unknown access {other:?} in {s:?} (expected r, w, m)"
            )),
        })
    }
}

/// Largest major and minor numbers Linux encodes (12 and 20 bits).
pub const MAX_MAJOR: u32 = (1 << 12) - 1;
pub const MAX_MINOR: u32 = (1 << 20) - 1;

/// One allow or deny rule; `None` for major or minor means any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceRule {
    pub allow: bool,
    pub kind: DeviceKind,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    pub access: Access,
}

impl DeviceRule {
    pub fn allow(kind: DeviceKind, major: Option<u32>, minor: Option<u32>, access: Access) -> Self {
        Self {
            allow: true,
            kind,
            major,
            minor,
            access,
        }
    }

    pub fn deny(kind: DeviceKind, major: Option<u32>, minor: Option<u32>, access: Access) -> Self {
        Self {
            allow: false,
            ..Self::allow(kind, major, minor, access)
        }
    }
}

impl fmt::Display for DeviceRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verb = if self.allow { "allow" } else { "deny" };
        write!(
            f,
            "{verb} {}",
            DeviceEntry {
                kind: self.kind,
                major: self.major,
                minor: self.minor,
                access: self.access
            }
        )
    }
}

/// One entry of an effective allow list: always `Char` or `Block`, never `All`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceEntry {
    pub kind: DeviceKind,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    pub access: Access,
}

impl DeviceEntry {
    fn same_node(&self, other: &Self) -> bool {
        (self.kind, self.major, self.minor) == (other.kind, other.major, other.minor)
    }

    /// Whether this entry lets `access` to the device `kind major:minor` through.
    pub fn permits(&self, kind: DeviceKind, major: u32, minor: u32, access: Access) -> bool {
        self.kind == kind
            && self.major.is_none_or(|m| m == major)
            && self.minor.is_none_or(|m| m == minor)
            && self.access.contains(access)
    }
}

/// The v1 `devices.list` / `devices.allow` spelling: `c 1:3 rw`, `*` for any.
impl fmt::Display for DeviceEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let num = |n: Option<u32>| n.map_or_else(|| "*".to_owned(), |n| n.to_string());
        write!(
            f,
            "{} {}:{} {}",
            self.kind.letter(),
            num(self.major),
            num(self.minor),
            self.access
        )
    }
}

/// The allow list `rules` amount to (see the module docs), in first-seen order.
pub fn effective(rules: &[DeviceRule]) -> Result<Vec<DeviceEntry>> {
    let mut entries: Vec<DeviceEntry> = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        validate(index, rule)?;
        let kinds: &[DeviceKind] = match rule.kind {
            DeviceKind::All => &[DeviceKind::Char, DeviceKind::Block],
            DeviceKind::Char => &[DeviceKind::Char],
            DeviceKind::Block => &[DeviceKind::Block],
        };
        for &kind in kinds {
            let new = DeviceEntry {
                kind,
                major: rule.major,
                minor: rule.minor,
                access: rule.access,
            };
            let existing = entries.iter().position(|e| e.same_node(&new));
            match (rule.allow, existing) {
                (true, Some(i)) => entries[i].access = entries[i].access.union(new.access),
                (true, None) => entries.push(new),
                (false, Some(i)) => {
                    entries[i].access = entries[i].access.minus(new.access);
                    if entries[i].access.is_empty() {
                        entries.remove(i);
                    }
                }
                (false, None) => {}
            }
        }
    }
    Ok(entries)
}

fn validate(index: usize, rule: &DeviceRule) -> Result<()> {
    let invalid = |message: String| Err(CgroupError::InvalidRule { index, message });
    if rule.access.is_empty() {
        return invalid(format!("{rule}: no access given (need some of r, w, m)"));
    }
    if rule.major.is_some_and(|m| m > MAX_MAJOR) {
        return invalid(format!("{rule}: major is above {MAX_MAJOR}"));
    }
    if rule.minor.is_some_and(|m| m > MAX_MINOR) {
        return invalid(format!("{rule}: minor is above {MAX_MINOR}"));
    }
    Ok(())
}

/// Whether an allow list lets `access` to `kind major:minor` through.
pub fn permits(
    entries: &[DeviceEntry],
    kind: DeviceKind,
    major: u32,
    minor: u32,
    access: Access,
) -> bool {
    entries
        .iter()
        .any(|e| e.permits(kind, major, minor, access))
}

/// How to move a v1 devices cgroup from the allow list `current` to `wanted` without ever
/// denying what both allow: first the allow lines (the kernel merges access into an existing
/// entry), then deny lines that take away only what `wanted` no longer grants.
pub fn v1_transition(
    current: &[DeviceEntry],
    wanted: &[DeviceEntry],
) -> (Vec<DeviceEntry>, Vec<DeviceEntry>) {
    let access_in = |list: &[DeviceEntry], e: &DeviceEntry| {
        list.iter()
            .find(|x| x.same_node(e))
            .map_or(Access::NONE, |x| x.access)
    };
    let allows = wanted
        .iter()
        .filter(|w| !access_in(current, w).contains(w.access))
        .copied()
        .collect();
    let denies = current
        .iter()
        .filter_map(|c| {
            let gone = c.access.minus(access_in(wanted, c));
            (!gone.is_empty()).then_some(DeviceEntry { access: gone, ..*c })
        })
        .collect();
    (allows, denies)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn arb_access() -> impl Strategy<Value = Access> {
        (1u8..=7).prop_map(Access::from_bits_truncate)
    }

    pub(crate) fn arb_rule() -> impl Strategy<Value = DeviceRule> {
        (
            any::<bool>(),
            prop_oneof![
                Just(DeviceKind::All),
                Just(DeviceKind::Char),
                Just(DeviceKind::Block)
            ],
            prop::option::of(0u32..4),
            prop::option::of(0u32..4),
            arb_access(),
        )
            .prop_map(|(allow, kind, major, minor, access)| DeviceRule {
                allow,
                kind,
                major,
                minor,
                access,
            })
    }

    fn c(major: Option<u32>, minor: Option<u32>, access: &str) -> DeviceEntry {
        DeviceEntry {
            kind: DeviceKind::Char,
            major,
            minor,
            access: access.parse().unwrap(),
        }
    }

    #[test]
    fn access_text() {
        assert_eq!(Access::ALL.to_string(), "rwm");
        assert_eq!("mr".parse::<Access>().unwrap(), Access(3));
        assert!("rx".parse::<Access>().unwrap_err().contains("'x'"));
    }

    #[test]
    fn all_expands_and_deny_removes_exact_entries() {
        let rules = [
            DeviceRule::allow(DeviceKind::All, None, None, Access::READ),
            DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::ALL),
            DeviceRule::deny(DeviceKind::Char, Some(1), Some(3), Access::MKNOD),
            // Exact-match only: this does not narrow `c *:*`.
            DeviceRule::deny(DeviceKind::Char, Some(1), Some(5), Access::READ),
            DeviceRule::deny(DeviceKind::Block, None, None, Access::ALL),
        ];
        let got = effective(&rules).unwrap();
        assert_eq!(got, vec![c(None, None, "r"), c(Some(1), Some(3), "rw")]);
        assert_eq!(got[0].to_string(), "c *:* r");
        assert!(permits(&got, DeviceKind::Char, 1, 5, Access::READ));
        assert!(!permits(&got, DeviceKind::Char, 1, 5, Access::WRITE));
        assert!(permits(
            &got,
            DeviceKind::Char,
            1,
            3,
            Access::READ.union(Access::WRITE)
        ));
        assert!(!permits(&got, DeviceKind::Block, 8, 0, Access::READ));
    }

    #[test]
    fn invalid_rules_name_their_index() {
        let cases = [
            DeviceRule::allow(DeviceKind::Char, Some(1), Some(3), Access::NONE),
            DeviceRule::allow(DeviceKind::Char, Some(MAX_MAJOR + 1), None, Access::READ),
            DeviceRule::allow(DeviceKind::Char, None, Some(MAX_MINOR + 1), Access::READ),
        ];
        for bad in cases {
            let ok = DeviceRule::allow(DeviceKind::Char, None, None, Access::READ);
            let err = effective(&[ok, bad]).unwrap_err();
            assert!(
                matches!(err, CgroupError::InvalidRule { index: 1, .. }),
                "{err}"
            );
        }
    }

    #[test]
    fn transition_example() {
        let current = [c(Some(1), Some(3), "rw"), c(Some(10), Some(200), "rwm")];
        let wanted = [
            c(Some(1), Some(3), "rw"),
            c(Some(10), Some(200), "r"),
            c(Some(1), Some(5), "r"),
        ];
        let (allows, denies) = v1_transition(&current, &wanted);
        assert_eq!(allows, vec![c(Some(1), Some(5), "r")]);
        assert_eq!(denies, vec![c(Some(10), Some(200), "wm")]);
    }

    proptest! {
        /// Replaying current, then the allows, then the denies through the kernel's rules yields
        /// exactly `wanted`, and after the allows nothing both lists grant is missing.
        #[test]
        fn transition_reaches_wanted_without_a_gap(
            a in prop::collection::vec(arb_rule(), 0..8),
            b in prop::collection::vec(arb_rule(), 0..8),
        ) {
            let current = effective(&a).unwrap();
            let wanted = effective(&b).unwrap();
            let (allows, denies) = v1_transition(&current, &wanted);
            let as_rules = |list: &[DeviceEntry], allow: bool| -> Vec<DeviceRule> {
                list.iter().map(|e| DeviceRule { allow, kind: e.kind, major: e.major, minor: e.minor, access: e.access }).collect()
            };
            let mut replay = as_rules(&current, true);
            replay.extend(as_rules(&allows, true));
            let midway = effective(&replay).unwrap();
            replay.extend(as_rules(&denies, false));
            let mut end = effective(&replay).unwrap();
            let mut want_sorted = wanted.clone();
            end.sort();
            want_sorted.sort();
            prop_assert_eq!(end, want_sorted);
            for kind in [DeviceKind::Char, DeviceKind::Block] {
                for major in 0..4 {
                    for minor in 0..4 {
                        for bits in 1..=7 {
                            let access = Access::from_bits_truncate(bits);
                            if permits(&current, kind, major, minor, access) && permits(&wanted, kind, major, minor, access) {
                                prop_assert!(permits(&midway, kind, major, minor, access));
                            }
                        }
                    }
                }
            }
        }
    }
}
