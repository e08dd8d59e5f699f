//! Leader election on a `coordination.k8s.io` Lease, as KubeVirt's virt-controller and
//! virt-operator elect theirs: one replica works, the others wait; a replica that loses the
//! Lease stops working (KubeVirt's exit then, so a restart rejoins as a follower).

use std::future::Future;

/// Lease timing as KubeVirt's: 15 s lease; the holder renews 5 s before expiry (10 s renew
/// deadline). kube-lease-manager re-tries a held lease on its own schedule rather than
/// KubeVirt's 2 s retry period; followers take over within one lease duration.
pub const LEASE_DURATION_SECS: u64 = 15;
/// Seconds before expiry the holder renews.
pub const LEASE_GRACE_SECS: u64 = 5;

/// Why a replica stopped leading.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Leader election failed.
    #[error("leader election on Lease {namespace}/{name}")]
    Lease {
        namespace: String,
        name: String,
        source: kube_lease_manager::LeaseManagerError,
    },
    /// Another replica took the Lease.
    #[error("lost the lease {0}; another replica leads now")]
    LostLease(String),
}

/// Waits for the Lease `namespace/name` as `identity`, then runs `work` while holding it;
/// `leading` hears each change of leadership. The work's result, or [`LeaderError::LostLease`]
/// when another replica takes over first.
pub async fn lead<F: Future>(
    client: kube::Client,
    namespace: &str,
    name: &str,
    identity: &str,
    leading: impl Fn(bool),
    work: F,
) -> Result<F::Output, LeaderError> {
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client, name)
        .with_namespace(namespace)
        .with_identity(identity)
        .with_duration(LEASE_DURATION_SECS)
        .with_grace(LEASE_GRACE_SECS)
        .build()
        .await
        .map_err(|source| LeaderError::Lease {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            source,
        })?;
    let (mut held, lease_task) = manager.watch().await;
    while !*held.borrow_and_update() {
        if held.changed().await.is_err() {
            return Err(LeaderError::LostLease(name.to_owned()));
        }
    }
    tracing::info!(identity, lease = name, "became leader");
    leading(true);
    let result = tokio::select! {
        r = work => Ok(r),
        () = async {
            while held.changed().await.is_ok() && *held.borrow() {}
        } => Err(LeaderError::LostLease(name.to_owned())),
    };
    leading(false);
    drop(held);
    lease_task.abort();
    result
}
