use std::path::PathBuf;

/// What went wrong while wiring a VM's network, and where.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The VMI asks for something this binding code cannot do; names the field.
    #[error("{field}: {message}")]
    Spec { field: String, message: String },
    #[error("pod interface {iface} does not exist in the pod's network namespace")]
    NoPodInterface { iface: String },
    #[error("pod interface {iface} has no IPv4 address to {purpose}")]
    NoPodAddress {
        iface: String,
        purpose: &'static str,
    },
    #[error("netlink: {action}")]
    Netlink {
        action: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("{action}")]
    Io {
        action: String,
        #[source]
        source: std::io::Error,
    },
    #[error("nftables: {action}")]
    Nft {
        action: String,
        #[source]
        source: nftables::helper::NftablesError,
    },
    #[error("interface cache {}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Isolation(#[from] isolation::IsolationError),
}

impl NetworkError {
    pub(crate) fn io(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let action = action.into();
        move |source| NetworkError::Io { action, source }
    }

    pub(crate) fn netlink(action: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Self {
        let action = action.into();
        move |source| NetworkError::Netlink { action, source }
    }
}

pub type Result<T, E = NetworkError> = std::result::Result<T, E>;
