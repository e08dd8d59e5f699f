//! `build-images` as the release step runs it: gzip layers, one OCI archive per image, the
//! install manifests pinned by digest. Built twice from the same inputs, the digests are the
//! same; skopeo (what users load and push images with) reads every archive.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn build(out: &Path) -> String {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_build-images"));
    let bins = exe.parent().expect("the profile dir");
    let output = Command::new(&exe)
        .arg("--bin-dir")
        .arg(bins)
        .arg("--guest-dir")
        .arg(testguest::dir())
        .arg("--layout")
        .arg(out.join("oci"))
        .arg("--archives")
        .arg(out.join("images"))
        .arg("--gzip")
        .args(["--registry", "quay.io/kubevirt-rs", "--tag", "v9.9.9"])
        .arg("--release-manifests")
        .arg(out.join("manifests"))
        .output()
        .expect("running build-images");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "build-images failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn skopeo(args: &[&str]) -> Value {
    let out = Command::new("skopeo")
        .arg("inspect")
        .args(args)
        .output()
        .expect("running skopeo (hack/deps.sh installs it)");
    assert!(
        out.status.success(),
        "skopeo inspect {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("skopeo's JSON")
}

#[test]
fn release_images_are_reproducible_inspectable_and_pinned() {
    let first = tempfile::tempdir().unwrap();
    let second = tempfile::tempdir().unwrap();
    let printed = build(first.path());
    println!("{printed}");
    build(second.path());

    let index = |dir: &Path| -> Value {
        serde_json::from_slice(&std::fs::read(dir.join("oci/index.json")).unwrap()).unwrap()
    };
    assert_eq!(
        index(first.path()),
        index(second.path()),
        "same inputs, same digests"
    );

    let images = [
        "virt-operator",
        "virt-api",
        "virt-controller",
        "virt-handler",
        "virt-launcher",
        "container-disk",
        "test-guest-disk",
        "test-guest-kernel",
        "test-tools",
    ];
    for image in images {
        let archive = first.path().join(format!("images/{image}.tar"));
        assert_eq!(
            std::fs::read(&archive).unwrap(),
            std::fs::read(second.path().join(format!("images/{image}.tar"))).unwrap(),
            "{image}.tar is byte for byte the same"
        );
        let reference = format!("oci-archive:{}", archive.display());
        let inspected = skopeo(&[&reference]);
        let config = skopeo(&["--config", &reference]);
        let layers = inspected["Layers"].as_array().expect("layers").len();
        let entrypoint = &config["config"]["Entrypoint"];
        let expected_layers = match image {
            "virt-launcher" | "virt-handler" => 3,
            "virt-operator" | "virt-api" | "virt-controller" => 2,
            _ => 1,
        };
        assert_eq!(layers, expected_layers, "{image}: {inspected}");
        if image.starts_with("test-") {
            continue;
        }
        assert_eq!(
            entrypoint,
            &serde_json::json!([format!("/usr/bin/{image}")]),
            "{image}"
        );
        let digest = inspected["Digest"].as_str().expect("digest");
        assert!(
            printed.contains(&format!("quay.io/kubevirt-rs/{image}:v9.9.9"))
                && printed.contains(digest),
            "{image} {digest} is what build-images printed"
        );
        let operator_manifest =
            std::fs::read_to_string(first.path().join("manifests/kubevirt-operator.yaml")).unwrap();
        let objects: Vec<Value> = serde_saphyr::from_multiple(&operator_manifest).unwrap();
        let container = objects
            .iter()
            .find(|o| o["kind"] == "Deployment")
            .map(|d| &d["spec"]["template"]["spec"]["containers"][0])
            .expect("the operator's Deployment");
        let env = |name: &str| {
            container["env"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|e| e["name"] == name)
                .map(|e| e["value"].clone())
        };
        match image {
            "virt-operator" => assert_eq!(
                container["image"],
                format!("quay.io/kubevirt-rs/virt-operator@{digest}"),
                "the operator's Deployment runs its image pinned"
            ),
            "container-disk" => {}
            _ => assert_eq!(
                env(&format!(
                    "{}_SHASUM",
                    image.to_uppercase().replace('-', "_")
                )),
                Some(Value::from(digest)),
                "the operator is told {image}'s digest"
            ),
        }
        assert_eq!(env("KUBEVIRT_VERSION"), Some(Value::from("v9.9.9")));
        assert!(
            !operator_manifest.contains(&format!("kubevirt-rs/{image}:")),
            "{image} is named by digest only"
        );
    }
    let cr = std::fs::read_to_string(first.path().join("manifests/kubevirt-cr.yaml")).unwrap();
    assert!(cr.contains("kind: KubeVirt"), "{cr}");
}
