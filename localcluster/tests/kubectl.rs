//! The real `kubectl` (v1.32) against the cluster: discovery, client- and server-side apply with
//! default validation, printing, watching, waiting, describing and deleting.

mod common;

use std::time::Duration;

use common::{Cluster, eventually};

const CRD: &str = r"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: gadgets.example.com
spec:
  group: example.com
  scope: Namespaced
  names: {plural: gadgets, singular: gadget, kind: Gadget, shortNames: [gd]}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    additionalPrinterColumns:
    - {name: Size, type: integer, jsonPath: .spec.size}
    - {name: Phase, type: string, jsonPath: .status.phase}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer, default: 3}
              color: {type: string}
          status:
            type: object
            properties:
              phase: {type: string}
              conditions:
                type: array
                items: {type: object, x-kubernetes-preserve-unknown-fields: true}
";

async fn ok(c: &Cluster, args: &[&str]) -> String {
    let (success, out, err) = c.kubectl(args).await;
    assert!(success, "kubectl {args:?} failed: {err}\n{out}");
    out
}

async fn ok_stdin(c: &Cluster, args: &[&str], stdin: &str) -> String {
    let (success, out, err) = c.kubectl_stdin(args, Some(stdin)).await;
    assert!(success, "kubectl {args:?} failed: {err}\n{out}");
    out
}

async fn install_gadgets(c: &Cluster) {
    ok_stdin(c, &["apply", "-f", "-"], CRD).await;
    ok(
        c,
        &[
            "wait",
            "--for=condition=Established",
            "crd/gadgets.example.com",
            "--timeout=30s",
        ],
    )
    .await;
}

#[tokio::test]
async fn kubectl_discovery_and_builtin_apply() {
    let c = Cluster::start().await;
    let resources = ok(&c, &["api-resources"]).await;
    for line in [
        "pods ",
        "deployments ",
        "customresourcedefinitions ",
        "leases ",
    ] {
        assert!(
            resources.contains(line),
            "api-resources lists {line}:\n{resources}"
        );
    }
    let manifest = |replicas: u32, value: &str| {
        format!(
            "apiVersion: v1
kind: ConfigMap
metadata: {{name: settings, labels: {{app: demo}}}}
data: {{key: \"{value}\"}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: demo}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: demo}}}}
  template:
    metadata: {{labels: {{app: demo}}}}
    spec:
      containers:
      - name: main
        image: busybox
        env: [{{name: A, value: \"1\"}}]
"
        )
    };
    let out = ok_stdin(&c, &["apply", "-f", "-"], &manifest(1, "one")).await;
    assert!(
        out.contains("configmap/settings created") && out.contains("deployment.apps/demo created"),
        "{out}"
    );
    let out = ok_stdin(&c, &["apply", "-f", "-"], &manifest(2, "two")).await;
    assert!(out.contains("configmap/settings configured"), "{out}");
    let yaml = ok(&c, &["get", "configmap", "settings", "-o", "yaml"]).await;
    assert!(
        yaml.contains("key: two") && yaml.contains("last-applied-configuration"),
        "{yaml}"
    );
    let replicas = ok(
        &c,
        &[
            "get",
            "deploy",
            "demo",
            "-o",
            "jsonpath={.spec.replicas} {.metadata.generation}",
        ],
    )
    .await;
    assert_eq!(replicas, "2 2");
    let out = ok_stdin(&c, &["apply", "-f", "-"], &manifest(2, "two")).await;
    assert!(
        out.contains("unchanged"),
        "re-applying the same manifest changes nothing: {out}"
    );

    // Server-side dry runs: diff shows the change, nothing is stored.
    let (_, diff, err) = c
        .kubectl_stdin(&["diff", "-f", "-"], Some(&manifest(2, "changed")))
        .await;
    assert!(
        diff.contains("+  key: changed"),
        "kubectl diff: {diff}{err}"
    );
    ok_stdin(
        &c,
        &["apply", "--dry-run=server", "-f", "-"],
        &manifest(2, "dry"),
    )
    .await;
    assert_eq!(
        ok(&c, &["get", "cm", "settings", "-o", "jsonpath={.data.key}"]).await,
        "two"
    );

    // Server-side apply, then a conflicting one from another manager.
    let out = ok_stdin(
        &c,
        &["apply", "--server-side", "-f", "-"],
        &manifest(3, "three"),
    )
    .await;
    assert!(out.contains("serverside-applied"), "{out}");
    let (success, _, err) = c
        .kubectl_stdin(
            &["apply", "--server-side", "--field-manager=other", "-f", "-"],
            Some(&manifest(5, "five")),
        )
        .await;
    assert!(!success && err.contains("conflict"), "{err}");
    ok_stdin(
        &c,
        &[
            "apply",
            "--server-side",
            "--field-manager=other",
            "--force-conflicts",
            "-f",
            "-",
        ],
        &manifest(5, "five"),
    )
    .await;
    assert_eq!(
        ok(
            &c,
            &["get", "deploy", "demo", "-o", "jsonpath={.spec.replicas}"]
        )
        .await,
        "5"
    );

    // create -f refuses what exists, and creates what does not.
    let (success, _, err) = c
        .kubectl_stdin(&["create", "-f", "-"], Some(&manifest(1, "x")))
        .await;
    assert!(!success && err.contains("AlreadyExists"), "{err}");
    let out = ok_stdin(
        &c,
        &["create", "-f", "-"],
        "apiVersion: v1\nkind: Secret\nmetadata: {name: s}\nstringData: {a: b}\n",
    )
    .await;
    assert!(out.contains("secret/s created"), "{out}");

    ok(&c, &["run", "pod-a", "--image=busybox"]).await;
    let pods = ok(&c, &["get", "pods"]).await;
    let header: Vec<&str> = pods.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]);
    assert!(pods.contains("pod-a") && pods.contains("Pending"), "{pods}");
    let described = ok(&c, &["describe", "pod", "pod-a"]).await;
    assert!(
        described.contains("Name:") && described.contains("pod-a"),
        "{described}"
    );
}

#[tokio::test]
async fn kubectl_custom_resources() {
    let c = Cluster::start().await;
    install_gadgets(&c).await;
    let gadget = |color: &str| {
        format!(
            "apiVersion: example.com/v1\nkind: Gadget\nmetadata: {{name: g1}}\nspec: {{color: {color}}}\n"
        )
    };
    let out = ok_stdin(&c, &["apply", "-f", "-"], &gadget("red")).await;
    assert!(out.contains("gadget.example.com/g1 created"), "{out}");
    ok_stdin(&c, &["apply", "-f", "-"], &gadget("blue")).await;
    let table = ok(&c, &["get", "gadgets"]).await;
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "SIZE", "PHASE"]);
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(row, ["g1", "3"]);
    assert_eq!(
        ok(&c, &["get", "gd", "g1", "-o", "jsonpath={.spec.color}"]).await,
        "blue"
    );

    // Default validation: an unknown field is refused.
    let (success, _, err) = c
        .kubectl_stdin(&["apply", "-f", "-"], Some("apiVersion: example.com/v1\nkind: Gadget\nmetadata: {name: g2}\nspec: {bogus: 1}\n"))
        .await;
    assert!(!success && err.contains("unknown field"), "{err}");

    // A bounded watch sees the status change; wait sees the condition.
    let watch = {
        let kubeconfig = c.kubeconfig.clone();
        let ns = c.namespace.clone();
        tokio::spawn(async move {
            let out = tokio::process::Command::new("timeout")
                .args(["5", "kubectl", "--kubeconfig"])
                .arg(kubeconfig)
                .args(["-n", &ns, "get", "gadgets", "-w"])
                .output()
                .await
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
    };
    let wait = {
        let kubeconfig = c.kubeconfig.clone();
        let ns = c.namespace.clone();
        tokio::spawn(async move {
            tokio::process::Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args([
                    "-n",
                    &ns,
                    "wait",
                    "--for=condition=Ready",
                    "gadget/g1",
                    "--timeout=30s",
                ])
                .output()
                .await
                .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    ok(
        &c,
        &[
            "patch",
            "gadget",
            "g1",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"phase":"Ready","conditions":[{"type":"Ready","status":"True"}]}}"#,
        ],
    )
    .await;
    let waited = wait.await.unwrap();
    assert!(
        waited.status.success(),
        "{}",
        String::from_utf8_lossy(&waited.stderr)
    );
    let watched = watch.await.unwrap();
    let rows: Vec<&str> = watched.lines().collect();
    assert_eq!(
        rows.iter().filter(|l| l.starts_with("NAME")).count(),
        1,
        "one header:\n{watched}"
    );
    assert!(
        rows.iter()
            .any(|l| l.starts_with("g1") && l.contains("Ready")),
        "{watched}"
    );

    // Deletion blocked by a finalizer.
    ok(
        &c,
        &[
            "patch",
            "gadget",
            "g1",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":["example.com/hold"]}}"#,
        ],
    )
    .await;
    ok(&c, &["delete", "gadget", "g1", "--wait=false"]).await;
    let ts = ok(
        &c,
        &[
            "get",
            "gadget",
            "g1",
            "-o",
            "jsonpath={.metadata.deletionTimestamp}",
        ],
    )
    .await;
    assert!(!ts.is_empty(), "the gadget is marked for deletion");
    let described = ok(&c, &["describe", "gadget", "g1"]).await;
    assert!(
        described.contains("Deletion Timestamp") || described.contains("Finalizers"),
        "{described}"
    );
    ok(
        &c,
        &[
            "patch",
            "gadget",
            "g1",
            "--type=json",
            "-p",
            r#"[{"op":"remove","path":"/metadata/finalizers"}]"#,
        ],
    )
    .await;
    eventually(30, "the gadget to go", || async {
        let (success, _, err) = c.kubectl(&["get", "gadget", "g1"]).await;
        (!success && err.contains("NotFound")).then_some(())
    })
    .await;
}

/// kubectl's generators (`create namespace|configmap|...`) send protobuf bodies, which this
/// server cannot decode: they get kube-apiserver's 415 `Status`, which kubectl reports as such,
/// and nothing is created. (A real cluster takes them, so this part is in-process only.)
#[tokio::test]
async fn kubectl_protobuf_bodies_get_a_415_status() {
    let c = Cluster::start().await;
    if !c.in_process() {
        return;
    }
    let (success, out, err) = c
        .kubectl(&[
            "create",
            "configmap",
            "from-generator",
            "--from-literal=a=b",
        ])
        .await;
    assert!(!success, "{out}");
    assert!(
        err.contains("the body of the request was in an unknown format - accepted media types include: application/json, application/yaml; got application/vnd.kubernetes.protobuf"),
        "{err}"
    );
    let (success, _, err) = c.kubectl(&["create", "namespace", "from-generator"]).await;
    assert!(!success);
    assert!(
        err.contains("Error from server (UnsupportedMediaType)"),
        "{err}"
    );
    let (success, _, _) = c.kubectl(&["get", "configmap", "from-generator"]).await;
    assert!(!success, "nothing was created");
    // The same object sent as JSON (`create -f`) is taken.
    let generated = ok(
        &c,
        &[
            "create",
            "configmap",
            "from-generator",
            "--from-literal=a=b",
            "--dry-run=client",
            "-o",
            "json",
        ],
    )
    .await;
    ok_stdin(&c, &["create", "-f", "-"], &generated).await;
    ok(&c, &["get", "configmap", "from-generator"]).await;
}
