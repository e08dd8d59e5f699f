//! Helpers the integration test files share.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::Path;

/// Runs the real `kubectl` against `kubeconfig`; panics with its output when it fails.
/// Async, so that the test's own tasks (controllers, heartbeats) keep running meanwhile.
pub async fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let out = localcluster::kubectl::Kubectl::new(kubeconfig)
        .output_async(args, None)
        .await
        .expect("running kubectl (is it on PATH?)");
    assert!(
        out.status.success(),
        "kubectl {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}
