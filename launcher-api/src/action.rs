//! One type per endpoint of the command API, as Cloud Hypervisor and Firecracker model theirs:
//! its method, its path, what its request carries and what a success answers. The launcher routes
//! by these and the client calls by them, so neither end can ask for a path or a shape the other
//! does not have. A failure answers [`ApiError`](crate::domain::ApiError) with an HTTP status.

use api::VirtualMachineInstance;
use bytes::Bytes;
use http::Method;
use serde::{Deserialize, Serialize};

use crate::domain::{DiskStats, Domain, Info};
use crate::guest::{
    AgentInterface, GuestExecRequest, GuestExecResult, GuestPingRequest, QgaFilesystem,
    QgaHostName, QgaInfo, QgaOsInfo, QgaTimezone, QgaUser,
};
use crate::migration::{MigrateRequest, TargetRequest};

pub trait Action {
    const METHOD: Method;
    const PATH: &'static str;
    type Request: Body;
    /// A success's body: JSON unless the action says otherwise.
    type Response;
}

/// How a request travels, the same way from both ends.
pub trait Body: Sized {
    /// `None` for a request without a body.
    fn encode(&self) -> serde_json::Result<Option<Vec<u8>>>;
    fn decode(body: &[u8]) -> serde_json::Result<Self>;
}

/// No body: whatever a caller sends anyway is ignored.
impl Body for () {
    fn encode(&self) -> serde_json::Result<Option<Vec<u8>>> {
        Ok(None)
    }

    fn decode(_: &[u8]) -> serde_json::Result<Self> {
        Ok(())
    }
}

/// JSON request bodies.
macro_rules! json_bodies {
    ($($t:ty),+) => {
        $(
            impl Body for $t {
                fn encode(&self) -> serde_json::Result<Option<Vec<u8>>> {
                    serde_json::to_vec(self).map(Some)
                }

                fn decode(body: &[u8]) -> serde_json::Result<Self> {
                    serde_json::from_slice(body)
                }
            }
        )+
    };
}

json_bodies!(
    VirtualMachineInstance,
    TargetRequest,
    MigrateRequest,
    GuestPingRequest,
    GuestExecRequest
);

/// [`Ping`]'s answer: `{}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Empty {}

/// [`Freeze`]'s answer: how many file systems the guest agent froze.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Frozen {
    pub frozen_filesystems: i64,
}

/// [`Unfreeze`]'s answer: how many file systems the guest agent thawed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Thawed {
    pub thawed_filesystems: i64,
}

/// Declares the actions from one table, and [`ALL`] from the same rows, so that the list each
/// end checks itself against cannot miss one.
macro_rules! actions {
    ($($(#[$doc:meta])* $name:ident = $method:ident $path:literal, $request:ty => $response:ty;)+) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, Default)]
            pub struct $name;

            impl Action for $name {
                const METHOD: Method = Method::$method;
                const PATH: &'static str = $path;
                type Request = $request;
                type Response = $response;
            }
        )+

        /// Every action's method and path.
        pub const ALL: &[(Method, &str)] = &[$((<$name as Action>::METHOD, <$name as Action>::PATH)),+];
    };
}

actions! {
    /// Whether the launcher answers at all.
    Ping = GET "/v1/ping", () => Empty;
    /// The launcher's version, QEMU's, and the VMI uid it serves.
    GetInfo = GET "/v1/info", () => Info;
    /// The first sync starts the VMI; later ones apply what may change while it runs (disk
    /// hotplug). A VMI of another uid is refused.
    SyncVmi = PUT "/v1/sync", VirtualMachineInstance => Domain;
    GetDomain = GET "/v1/domain", () => Domain;
    /// Newline-delimited JSON, one [`Domain`] a line: the current one, then every change; the
    /// stream ends after a final state.
    WatchDomain = GET "/v1/domain/watch", () => Domain;
    /// Each VMI disk's I/O counters (QMP `query-blockstats`), in the VMI's disk order.
    GetBlockStats = GET "/v1/domain/blockstats", () => Vec<DiskStats>;
    Pause = POST "/v1/pause", () => Domain;
    Unpause = POST "/v1/unpause", () => Domain;
    /// The ACPI power button; the guest decides what to do with it.
    Shutdown = POST "/v1/shutdown", () => Domain;
    Kill = POST "/v1/kill", () => Domain;
    Reset = POST "/v1/reset", () => Domain;
    /// A reboot by the guest agent (`guest-shutdown` in reboot mode).
    SoftReboot = POST "/v1/softreboot", () => Domain;
    /// `guest-fsfreeze-freeze`; the domain's `fsFreezeStatus` is asked again before the answer.
    Freeze = POST "/v1/freeze", () => Frozen;
    /// `guest-fsfreeze-thaw`; the domain's `fsFreezeStatus` is asked again before the answer.
    Unfreeze = POST "/v1/unfreeze", () => Thawed;
    /// `guest-info`.
    GuestInfo = GET "/v1/guest/info", () => QgaInfo;
    /// `guest-get-osinfo`.
    GuestOsInfo = GET "/v1/guest/osinfo", () => QgaOsInfo;
    /// `guest-get-host-name`.
    GuestHostName = GET "/v1/guest/hostname", () => QgaHostName;
    /// `guest-get-timezone`.
    GuestTimezone = GET "/v1/guest/timezone", () => QgaTimezone;
    /// `guest-get-users`.
    GuestUsers = GET "/v1/guest/users", () => Vec<QgaUser>;
    /// `guest-get-fsinfo`.
    GuestFilesystems = GET "/v1/guest/filesystems", () => Vec<QgaFilesystem>;
    /// `guest-network-get-interfaces`.
    GuestInterfaces = GET "/v1/guest/interfaces", () => Vec<AgentInterface>;
    /// `guest-ping` within the request's timeout: virt-probe's `guestAgentPing` probes.
    GuestPing = POST "/v1/guest/ping", GuestPingRequest => Empty;
    /// `guest-exec` with the output captured, then `guest-exec-status` until the command has
    /// exited or the request's timeout has passed: virt-probe's `exec` probes. A command that
    /// ran answers its exit code, whatever it is; one that did not end in time is an error.
    GuestExec = POST "/v1/guest/exec", GuestExecRequest => GuestExecResult;
    /// The guest's display as `image/png` bytes, not JSON (QMP `screendump`). The launcher
    /// serves it on `POST` as well, as it has since it came.
    Screendump = GET "/v1/screendump", () => Bytes;
    /// Starts the VMI as a migration target: QEMU waits for the incoming state, the copied
    /// disks are served over NBD ([`crate::migration`]'s sockets). The domain is `Paused`,
    /// reason `Migration`, until [`FinishMigration`].
    PrepareTarget = PUT "/v1/migration/target", TargetRequest => Domain;
    /// Source: mirrors the copied disks, then sends the guest's memory; progress and the end
    /// show in the domain's `migration`. Answers once the migration has started.
    Migrate = POST "/v1/migration/start", MigrateRequest => Domain;
    /// Source: cancels a running migration; the guest runs on here.
    CancelMigration = POST "/v1/migration/cancel", () => Domain;
    /// Target: the source has completed; stop serving the disks and resume the guest.
    FinishMigration = POST "/v1/migration/finish", () => Domain;
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use pretty_assertions::assert_eq;
    use serde_json::json;

    use super::*;

    #[test]
    fn every_action_has_its_own_versioned_path() {
        let paths: BTreeSet<&str> = ALL.iter().map(|(_, p)| *p).collect();
        assert_eq!(paths.len(), ALL.len(), "a path is used twice: {ALL:?}");
        for (method, path) in ALL {
            assert!(path.starts_with("/v1/"), "{method} {path}");
            assert!(
                [Method::GET, Method::PUT, Method::POST].contains(method),
                "{method} {path}"
            );
        }
        assert_eq!(ALL.len(), 28);
    }

    #[test]
    fn request_bodies_round_trip() {
        assert_eq!(().encode().expect("encodes"), None);
        <() as Body>::decode(b"anything").expect("ignored");

        let vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u-1"},
            "spec": {"domain": {"devices": {}}}
        }))
        .expect("a VMI");
        let body = vmi.encode().expect("encodes").expect("a body");
        assert_eq!(VirtualMachineInstance::decode(&body).expect("decodes"), vmi);
        let e = VirtualMachineInstance::decode(b"{\"spec\": 1}").expect_err("not a VMI");
        assert!(e.to_string().contains("line 1"), "{e}");
    }

    #[test]
    fn small_answers_have_their_documented_shapes() {
        let cases = [
            (serde_json::to_value(Empty {}), json!({})),
            (
                serde_json::to_value(Frozen {
                    frozen_filesystems: 1,
                }),
                json!({"frozenFilesystems": 1}),
            ),
            (
                serde_json::to_value(Thawed {
                    thawed_filesystems: 2,
                }),
                json!({"thawedFilesystems": 2}),
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.expect("serializes"), want);
        }
        assert_eq!(
            serde_json::from_value::<Frozen>(json!({"frozenFilesystems": 3})).expect("decodes"),
            Frozen {
                frozen_filesystems: 3
            }
        );
        serde_json::from_value::<Empty>(json!({})).expect("decodes");
    }
}
