//! Device rules through the cgroup v1 devices controller.

use std::path::{Path, PathBuf};

use cgroups_rs::fs::devices::{DevicePermissions, DeviceType, DevicesController};

use crate::devices::{self, Access, DeviceEntry, DeviceKind, DeviceRule};
use crate::error::{CgroupError, Result};

/// One cgroup's v1 device rules.
///
/// cgroups-rs writes and parses the `devices.*` files; it has no notion of moving between two
/// rule sets, which `devices::v1_transition` plans here.
#[derive(Debug)]
pub struct V1Devices {
    dir: PathBuf,
    controller: DevicesController,
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
            controller: DevicesController::new(dir.to_owned(), dir.to_owned()),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads `devices.list` back from the kernel.
    pub fn state(&self) -> Result<V1State> {
        let list = self
            .controller
            .allowed_devices()
            .map_err(|source| self.err("reading devices.list", source))?;
        let mut entries = Vec::new();
        for resource in list {
            let access = resource
                .access
                .iter()
                .fold(Access::NONE, |acc, p| acc.union(access_of(*p)));
            let number = |n: i64| u32::try_from(n).ok();
            match resource.devtype {
                DeviceType::All => return Ok(V1State::AllowAll),
                DeviceType::Char | DeviceType::Block => entries.push(DeviceEntry {
                    kind: if resource.devtype == DeviceType::Char {
                        DeviceKind::Char
                    } else {
                        DeviceKind::Block
                    },
                    major: number(resource.major),
                    minor: number(resource.minor),
                    access,
                }),
            }
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
                self.write(false, DeviceType::All, None, None, Access::ALL)?;
                Vec::new()
            }
            V1State::Allowed(entries) => entries,
        };
        let (allows, denies) = devices::v1_transition(&current, &wanted);
        for e in allows {
            self.write(true, device_type(e.kind), e.major, e.minor, e.access)?;
        }
        for e in denies {
            self.write(false, device_type(e.kind), e.major, e.minor, e.access)?;
        }
        Ok(())
    }

    fn write(
        &self,
        allow: bool,
        kind: DeviceType,
        major: Option<u32>,
        minor: Option<u32>,
        access: Access,
    ) -> Result<()> {
        let number = |n: Option<u32>| n.map_or(-1, i64::from);
        let perms = permissions(access);
        let result = if allow {
            self.controller
                .allow_device(kind, number(major), number(minor), &perms)
        } else {
            self.controller
                .deny_device(kind, number(major), number(minor), &perms)
        };
        result.map_err(|source| {
            self.err(
                if allow {
                    "writing devices.allow"
                } else {
                    "writing devices.deny"
                },
                source,
            )
        })
    }

    fn err(&self, op: &'static str, source: cgroups_rs::fs::error::Error) -> CgroupError {
        CgroupError::CgroupsRs {
            op,
            path: self.dir.clone(),
            source,
        }
    }
}

fn device_type(kind: DeviceKind) -> DeviceType {
    match kind {
        DeviceKind::All => DeviceType::All,
        DeviceKind::Char => DeviceType::Char,
        DeviceKind::Block => DeviceType::Block,
    }
}

fn access_of(p: DevicePermissions) -> Access {
    match p {
        DevicePermissions::Read => Access::READ,
        DevicePermissions::Write => Access::WRITE,
        DevicePermissions::MkNod => Access::MKNOD,
    }
}

fn permissions(access: Access) -> Vec<DevicePermissions> {
    [
        (Access::READ, DevicePermissions::Read),
        (Access::WRITE, DevicePermissions::Write),
        (Access::MKNOD, DevicePermissions::MkNod),
    ]
    .into_iter()
    .filter(|(a, _)| access.contains(*a))
    .map(|(_, p)| p)
    .collect()
}
