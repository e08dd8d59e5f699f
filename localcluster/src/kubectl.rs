//! The real `kubectl` (from `PATH`, the release the control plane is built from) against a
//! cluster: the one place that says which kubeconfig, namespace and discovery cache a run uses,
//! for the tests of every crate and for the e2e stack.

use std::ffi::{OsStr, OsString};
use std::io::{self, Write as _};
use std::path::PathBuf;
use std::process::{Output, Stdio};

/// How to run kubectl; each run is a new process.
#[derive(Debug, Clone, Default)]
pub struct Kubectl {
    kubeconfig: Option<PathBuf>,
    namespace: Option<String>,
    cache_dir: Option<PathBuf>,
}

impl Kubectl {
    /// kubectl with `--kubeconfig <kubeconfig>`.
    pub fn new(kubeconfig: impl Into<PathBuf>) -> Self {
        Self {
            kubeconfig: Some(kubeconfig.into()),
            ..Self::default()
        }
    }

    /// kubectl with no kubeconfig of ours: the arguments say where and as whom (`--server`,
    /// `--token`, ...).
    pub fn bare() -> Self {
        Self::default()
    }

    /// `--namespace <namespace>` on every run.
    #[must_use]
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// kubectl's discovery cache (`KUBECACHEDIR`): one per cluster, so that a cluster on a
    /// reused port never sees another's cached API groups.
    #[must_use]
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }

    fn leading_args(&self) -> Vec<OsString> {
        let mut out = Vec::new();
        if let Some(k) = &self.kubeconfig {
            out.extend([OsString::from("--kubeconfig"), k.clone().into_os_string()]);
        }
        if let Some(ns) = &self.namespace {
            out.extend([OsString::from("--namespace"), OsString::from(ns)]);
        }
        out
    }

    /// The command, not started, for callers that set up its stdio themselves.
    pub fn command<I>(&self, args: I) -> std::process::Command
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        let mut cmd = std::process::Command::new("kubectl");
        cmd.args(self.leading_args()).args(args);
        if let Some(dir) = &self.cache_dir {
            cmd.env("KUBECACHEDIR", dir);
        }
        cmd
    }

    /// [`command`](Self::command) on tokio, killed when dropped.
    pub fn async_command<I>(&self, args: I) -> tokio::process::Command
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        let mut cmd = tokio::process::Command::from(self.command(args));
        cmd.kill_on_drop(true);
        cmd
    }

    /// The command with its output captured and `stdin` piped when there is input (else an
    /// empty stdin).
    fn piped<I>(&self, args: I, stdin: Option<&str>) -> std::process::Command
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        let mut cmd = self.command(args);
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        cmd
    }

    /// Runs kubectl to the end with `stdin` as its input (none: an empty stdin); its whole
    /// output, whatever its exit status.
    pub fn output<I>(&self, args: I, stdin: Option<&str>) -> io::Result<Output>
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        let mut child = self.piped(args, stdin).spawn()?;
        if let (Some(text), Some(mut input)) = (stdin, child.stdin.take()) {
            input.write_all(text.as_bytes())?;
        }
        child.wait_with_output()
    }

    /// [`output`](Self::output) without blocking the runtime, so that a test's own tasks
    /// (controllers, heartbeats) keep running meanwhile; kubectl is killed if this is dropped.
    pub async fn output_async<I>(&self, args: I, stdin: Option<&str>) -> io::Result<Output>
    where
        I: IntoIterator,
        I::Item: AsRef<OsStr>,
    {
        use tokio::io::AsyncWriteExt as _;
        let mut child = tokio::process::Command::from(self.piped(args, stdin))
            .kill_on_drop(true)
            .spawn()?;
        if let (Some(text), Some(mut input)) = (stdin, child.stdin.take()) {
            input.write_all(text.as_bytes()).await?;
        }
        child.wait_with_output().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_and_cache() {
        let cmd = Kubectl::new("/k/config")
            .namespace("ns")
            .cache_dir("/k/cache")
            .command(["get", "pods"]);
        let args: Vec<_> = cmd.get_args().collect();
        assert_eq!(
            args,
            [
                "--kubeconfig",
                "/k/config",
                "--namespace",
                "ns",
                "get",
                "pods"
            ]
        );
        assert!(
            cmd.get_envs()
                .any(|(k, v)| k == "KUBECACHEDIR" && v == Some(OsStr::new("/k/cache")))
        );
        assert_eq!(Kubectl::bare().command(["version"]).get_args().count(), 1);
    }
}
