//! The kubelet API (placeholder being written by helper-1; these two signatures are what
//! kubelet/mod.rs calls).

use std::sync::Arc;

use super::{KubeletError, Serving, Shared};

pub async fn bind(host_ip: &str, port: u16) -> Result<tokio::net::TcpListener, KubeletError> {
    tokio::net::TcpListener::bind((host_ip, port))
        .await
        .map_err(|source| KubeletError::Io {
            path: format!("{host_ip}:{port}"),
            source,
        })
}

pub async fn serve(shared: Arc<Shared>, listener: tokio::net::TcpListener, serving: Serving) {
    let _ = (shared, listener, serving);
}
