//! The launcher's errors, each with a stable code and an HTTP status for the command API.

use crate::convert::ConvertError;
use crate::prepare::PrepareError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the VMI cannot be run: {0}")]
    InvalidVmi(#[from] ConvertError),
    #[error("the VMI's files cannot be prepared: {0}")]
    Prepare(#[from] PrepareError),
    #[error(
        "this launcher runs VMI uid {running}; refusing a sync for uid {offered} (one launcher \
         serves one VMI)"
    )]
    UidMismatch { running: String, offered: String },
    #[error("the request body is not a VirtualMachineInstance: {0}")]
    BadRequest(String),
    #[error("no domain: sync a VMI first")]
    NoDomain,
    #[error("the domain is {state}: {action} needs it {needs}")]
    WrongState {
        state: String,
        action: &'static str,
        needs: &'static str,
    },
    #[error(
        "no usable accelerator: {0} (KVM failed and emulation is not allowed; pass --allow-emulation to use TCG)"
    )]
    NoAccelerator(String),
    #[error("cannot start QEMU ({binary}): {message}")]
    QemuStart { binary: String, message: String },
    #[error("QEMU exited while starting: {0}")]
    QemuExited(String),
    #[error("QMP: {0}")]
    Qmp(#[from] qmp::Error),
    #[error("the guest agent is not connected (is qemu-guest-agent running in the guest?)")]
    AgentNotConnected,
    #[error("guest agent: {0}")]
    Agent(qmp::Error),
    #[error("guest agent: the answer to {command} does not fit the command API: {source}")]
    AgentAnswer {
        command: &'static str,
        source: serde_json::Error,
    },
    #[error("hotplug of disk {disk}: {message}")]
    Hotplug { disk: String, message: String },
    #[error("network: {0}")]
    Network(String),
    #[error("migration: {0}")]
    Migration(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn code(&self) -> &'static str {
        match self {
            Error::InvalidVmi(_) => "InvalidVMI",
            Error::Prepare(_) => "PrepareFailed",
            Error::UidMismatch { .. } => "UIDMismatch",
            Error::BadRequest(_) => "BadRequest",
            Error::NoDomain => "NoDomain",
            Error::WrongState { .. } => "WrongState",
            Error::NoAccelerator(_) => "NoAccelerator",
            Error::QemuStart { .. } => "QemuStartFailed",
            Error::QemuExited(_) => "QemuExited",
            Error::Qmp(_) => "QMPError",
            Error::AgentNotConnected => "AgentNotConnected",
            Error::Agent(_) | Error::AgentAnswer { .. } => "AgentError",
            Error::Hotplug { .. } => "HotplugFailed",
            Error::Network(_) => "NetworkFailed",
            Error::Migration(_) => "MigrationFailed",
            Error::Io { .. } => "IOError",
        }
    }

    pub fn status(&self) -> u16 {
        match self {
            Error::InvalidVmi(_) | Error::Prepare(_) | Error::Hotplug { .. } => 422,
            Error::BadRequest(_) => 400,
            Error::UidMismatch { .. } | Error::WrongState { .. } | Error::Migration(_) => 409,
            Error::NoDomain => 404,
            Error::AgentNotConnected => 503,
            Error::Qmp(_) | Error::Agent(_) | Error::AgentAnswer { .. } => 502,
            Error::NoAccelerator(_)
            | Error::QemuStart { .. }
            | Error::QemuExited(_)
            | Error::Network(_)
            | Error::Io { .. } => 500,
        }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }
}
