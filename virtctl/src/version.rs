//! `version`: this client's version, and virt-api's from `/apis/subresources.kubevirt.io/v1/version`,
//! printed as Go's `%#v` of KubeVirt's `version.Info`.

use anyhow::Context as _;
use api::subresources::{VersionInfo, version_path};

use crate::client::{Cluster, KubeFlags};

/// What this binary is. Git and build-date fields stay empty: nothing records them at build time.
pub fn client_info() -> VersionInfo {
    VersionInfo {
        git_version: format!("v{}", env!("CARGO_PKG_VERSION")),
        compiler: "rustc".into(),
        platform: platform(std::env::consts::OS, std::env::consts::ARCH),
        ..VersionInfo::default()
    }
}

/// Go's `GOOS/GOARCH` naming of the platform, which is what KubeVirt reports.
pub fn platform(os: &str, arch: &str) -> String {
    let arch = match arch {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!("{os}/{arch}")
}

/// `version.Info{GitVersion:"v1.3.0", GitCommit:"...", ...}`.
pub fn go_struct(info: &VersionInfo) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    format!(
        "version.Info{{GitVersion:{}, GitCommit:{}, GitTreeState:{}, BuildDate:{}, GoVersion:{}, Compiler:{}, Platform:{}}}",
        q(&info.git_version),
        q(&info.git_commit),
        q(&info.git_tree_state),
        q(&info.build_date),
        q(&info.go_version),
        q(&info.compiler),
        q(&info.platform),
    )
}

pub async fn run(flags: &KubeFlags, client_only: bool) -> anyhow::Result<()> {
    println!("Client Version: {}", go_struct(&client_info()));
    if client_only {
        return Ok(());
    }
    let cluster = Cluster::connect(flags)
        .await
        .context("failed to get virtClient config")?;
    let body = cluster
        .get(&version_path())
        .await
        .map_err(|e| anyhow::anyhow!("failed to get server version: {e}"))?;
    let server: VersionInfo =
        serde_json::from_slice(&body).context("failed to get server version")?;
    println!("Server Version: {}", go_struct(&server));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_go() {
        let info = VersionInfo {
            git_version: "v1.3.0".into(),
            git_commit: "abc".into(),
            git_tree_state: "clean".into(),
            build_date: "2024-07-17T13:44:46Z".into(),
            go_version: "go1.22.4".into(),
            compiler: "gc".into(),
            platform: "linux/amd64".into(),
        };
        assert_eq!(
            go_struct(&info),
            r#"version.Info{GitVersion:"v1.3.0", GitCommit:"abc", GitTreeState:"clean", BuildDate:"2024-07-17T13:44:46Z", GoVersion:"go1.22.4", Compiler:"gc", Platform:"linux/amd64"}"#
        );
    }

    #[test]
    fn platforms() {
        let cases = [
            ("linux", "x86_64", "linux/amd64"),
            ("linux", "aarch64", "linux/arm64"),
            ("linux", "s390x", "linux/s390x"),
        ];
        for (os, arch, want) in cases {
            assert_eq!(platform(os, arch), want);
        }
    }

    #[test]
    fn client_version_is_the_crates() {
        let info = client_info();
        assert_eq!(info.git_version, format!("v{}", env!("CARGO_PKG_VERSION")));
        assert_eq!(info.compiler, "rustc");
    }
}
