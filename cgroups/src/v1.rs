//! Device rules through the cgroup v1 devices controller.

use std::fs;
use std::path::{Path, PathBuf};

use crate::devices::{self, Access, DeviceEntry, DeviceKind, DeviceRule};
use crate::error::{CgroupError, Result};

/// One cgroup's v1 device rules.
///
/// The kernel's `devices.allow` / `devices.deny` / `devices.list` files are written and read
/// directly, one line per entry in their `c 1:3 rwm` spelling; moving between two rule sets is
/// planned by `devices::v1_transition`.
#[derive(Debug)]
pub struct V1Devices {
    dir: PathBuf,
}

/// What a v1 devices cgroup currently grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum V1State {
    /// The default allow-everything behaviour (`a *:* rwm`), as in a fresh cgroup.
    AllowAll,
    /// Deny by default with these exceptions.
    Allowed(Vec<DeviceEntry>),
}

impl V1Devices {
    /// `dir` is the cgroup's directory in the devices hierarchy.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads `devices.list` back from the kernel.
    pub fn state(&self) -> Result<V1State> {
        let path = self.dir.join("devices.list");
        let text = fs::read_to_string(&path).map_err(|source| CgroupError::Read {
            path: path.clone(),
            source,
        })?;
        let mut entries = Vec::new();
        for line in text.lines() {
            let entry = parse_list_line(line).map_err(|message| CgroupError::Parse {
                path: path.clone(),
                message,
            })?;
            if entry.kind == DeviceKind::All {
                return Ok(V1State::AllowAll);
            }
            entries.push(entry);
        }
        Ok(V1State::Allowed(entries))
    }

    /// Makes the cgroup grant exactly what `rules` amount to. From a deny-by-default cgroup
    /// this never takes away, even briefly, what both the old and the new rules grant. From
    /// the allow-everything default the kernel offers no such path: switching to deny-all
    /// comes first, so set the first rules before the workload starts.
    pub fn set_rules(&self, rules: &[DeviceRule]) -> Result<()> {
        let wanted = devices::effective(rules)?;
        let current = match self.state()? {
            V1State::AllowAll => {
                self.write(
                    false,
                    DeviceEntry {
                        kind: DeviceKind::All,
                        major: None,
                        minor: None,
                        access: Access::ALL,
                    },
                )?;
                Vec::new()
            }
            V1State::Allowed(entries) => entries,
        };
        let (allows, denies) = devices::v1_transition(&current, &wanted);
        for e in allows {
            self.write(true, e)?;
        }
        for e in denies {
            self.write(false, e)?;
        }
        Ok(())
    }

    /// One line to `devices.allow` or `devices.deny`; the kernel takes one entry per write.
    fn write(&self, allow: bool, entry: DeviceEntry) -> Result<()> {
        let file = if allow {
            "devices.allow"
        } else {
            "devices.deny"
        };
        let path = self.dir.join(file);
        let value = entry.to_string();
        fs::write(&path, &value).map_err(|source| CgroupError::Write {
            path,
            value,
            source,
        })
    }
}

/// One `devices.list` line, `c 1:3 rwm` (`*` for any number, `a` for both types).
fn parse_list_line(line: &str) -> Result<DeviceEntry, String> {
    let bad = || format!("{line:?} is not a device entry (expected like \"c 1:3 rwm\")");
    let mut fields = line.split(' ');
    let (Some(kind), Some(numbers), Some(access), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return Err(bad());
    };
    let kind = match kind {
        "a" => DeviceKind::All,
        "c" => DeviceKind::Char,
        "b" => DeviceKind::Block,
        _ => return Err(bad()),
    };
    let (major, minor) = numbers.split_once(':').ok_or_else(bad)?;
    let number = |n: &str| -> Result<Option<u32>, String> {
        if n == "*" {
            Ok(None)
        } else {
            n.parse().map(Some).map_err(|_| bad())
        }
    };
    Ok(DeviceEntry {
        kind,
        major: number(major)?,
        minor: number(minor)?,
        access: access.parse()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_lines_round_trip() {
        for line in ["a *:* rwm", "c 1:3 rwm", "b 8:* r", "c *:5 wm", "c 136:0 "] {
            let entry = parse_list_line(line).unwrap();
            assert_eq!(entry.to_string(), line);
        }
        assert_eq!(
            parse_list_line("c 1:3 rw").unwrap(),
            DeviceEntry {
                kind: DeviceKind::Char,
                major: Some(1),
                minor: Some(3),
                access: Access::READ.union(Access::WRITE),
            }
        );
    }

    #[test]
    fn bad_list_lines_are_refused() {
        for line in [
            "",
            "c 1:3",
            "x 1:3 r",
            "c 1-3 r",
            "c a:3 r",
            "c 1:3 rx",
            "c 1:3 r extra",
        ] {
            assert!(parse_list_line(line).is_err(), "{line:?}");
        }
    }
}
