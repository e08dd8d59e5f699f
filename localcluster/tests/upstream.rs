//! The upstream control plane with the real `kubectl` (from `PATH`) and our manifests: the
//! version it reports, protobuf bodies, our CRDs' printer columns, and what our RBAC manifests
//! let virt-controller and virt-handler do, with tokens from TokenRequest.

mod common;

use common::Cluster;
use serde_json::Value;

/// The repository's `manifests/<path>`.
fn manifest(path: &str) -> String {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../manifests")
        .join(path)
        .display()
        .to_string()
}

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

/// A table's rows (the header first), each cell cut at its header's column (an empty cell
/// stays, as an empty string).
fn rows(table: &str) -> Vec<Vec<String>> {
    let mut lines = table.lines();
    let header = lines.next().unwrap_or_default();
    let mut starts: Vec<usize> = header
        .char_indices()
        .filter(|&(i, ch)| ch != ' ' && (i == 0 || header.as_bytes()[i - 1] == b' '))
        .map(|(i, _)| i)
        .collect();
    starts.push(usize::MAX);
    std::iter::once(header)
        .chain(lines)
        .map(|line| {
            starts
                .windows(2)
                .map(|w| {
                    let end = w[1].min(line.len());
                    line.get(w[0].min(end)..end)
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                })
                .collect()
        })
        .collect()
}

async fn install_crds(c: &Cluster) {
    ok(c, &["apply", "-f", &manifest("crds/")]).await;
    ok(
        c,
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=120s",
        ],
    )
    .await;
}

#[tokio::test]
async fn kubectl_sees_the_pinned_release_and_sends_protobuf() {
    let c = Cluster::start().await;
    let out = ok(&c, &["version", "-o", "json"]).await;
    let version: Value = serde_json::from_str(&out).expect("kubectl version's JSON");
    let expected = localcluster::controlplane::upstream_version();
    assert!(expected.starts_with("v1."), "{expected}");
    assert_eq!(
        version["serverVersion"]["gitVersion"], expected,
        "the release upstream/go.mod pins, unsuffixed: {version:#}"
    );
    // kubectl's generators send protobuf bodies, which kube-apiserver decodes.
    let out = ok(
        &c,
        &["create", "secret", "generic", "x", "--from-literal=a=b"],
    )
    .await;
    assert_eq!(out.trim(), "secret/x created");
    assert_eq!(
        ok(&c, &["get", "secret", "x", "-o", "jsonpath={.data.a}"]).await,
        "Yg==",
        "base64 of b"
    );
    let out = ok(&c, &["create", "configmap", "y", "--from-literal=k=v"]).await;
    assert_eq!(out.trim(), "configmap/y created");
}

/// A VMI as virt-controller and virt-handler leave a running one: no status subresource on
/// the VMI CRD, so the status goes in with the object.
const VMI: &str = r"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: printed
spec:
  domain:
    resources:
      requests:
        memory: 64Mi
    devices: {}
status:
  phase: Running
  nodeName: node-7
  interfaces:
  - name: default
    ipAddress: 10.244.7.9
  conditions:
  - type: Ready
    status: 'True'
  - type: LiveMigratable
    status: 'False'
  - type: Paused
    status: 'False'
";

#[tokio::test]
async fn kubectl_prints_our_vmi_columns() {
    let c = Cluster::start().await;
    install_crds(&c).await;
    let out = ok_stdin(&c, &["apply", "-f", "-"], VMI).await;
    assert!(
        out.contains("virtualmachineinstance.kubevirt.io/printed created"),
        "{out}"
    );
    assert_eq!(
        ok(
            &c,
            &[
                "get",
                "vmi",
                "printed",
                "-o",
                "jsonpath={.status.conditions[0].type}={.status.conditions[0].status}"
            ]
        )
        .await,
        "Ready=True",
        "the status is stored"
    );

    let table = rows(&ok(&c, &["get", "vmi"]).await);
    assert_eq!(
        table[0],
        ["NAME", "AGE", "PHASE", "IP", "NODENAME", "READY"],
        "priority-1 columns only with -o wide"
    );
    let row = &table[1];
    assert_eq!(row[0], "printed");
    assert_eq!(row[2..], ["Running", "10.244.7.9", "node-7", "True"]);

    let wide = rows(&ok(&c, &["get", "vmi", "-o", "wide"]).await);
    assert_eq!(
        wide[0],
        [
            "NAME",
            "AGE",
            "PHASE",
            "IP",
            "NODENAME",
            "READY",
            "LIVE-MIGRATABLE",
            "PAUSED"
        ]
    );
    assert_eq!(
        wide[1][2..],
        ["Running", "10.244.7.9", "node-7", "True", "False", "False"]
    );

    // A status change shows in the next table (a plain merge patch: status is part of the
    // object).
    ok(
        &c,
        &[
            "patch",
            "vmi",
            "printed",
            "--type=merge",
            "-p",
            r#"{"status":{"conditions":[{"type":"Ready","status":"False"},{"type":"Paused","status":"True"}]}}"#,
        ],
    )
    .await;
    let wide = rows(&ok(&c, &["get", "vmi", "printed", "-o", "wide"]).await);
    assert_eq!(wide[1][5..], ["False", "", "True"]);
    // The plural resolves too.
    let named = ok(&c, &["get", "virtualmachineinstances", "-o", "name"]).await;
    assert_eq!(named.trim(), "virtualmachineinstance.kubevirt.io/printed");
}

/// `kubectl auth can-i <verb> <resource>[/<subresource>] --as <service account>`, as a yes or
/// no.
async fn can_i(c: &Cluster, sa: &str, namespace: &str, verb: &str, resource: &str) -> bool {
    let user = format!("system:serviceaccount:kubevirt:{sa}");
    // `TYPE/NAME` names an object to can-i: a subresource goes in its own flag.
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let subresource = format!("--subresource={subresource}");
    let mut args = vec![
        "auth", "can-i", verb, resource, "--as", &user, "-n", namespace,
    ];
    if subresource != "--subresource=" {
        args.push(&subresource);
    }
    let (yes, out, err) = c.kubectl(&args).await;
    let answer = out.trim();
    assert!(
        answer == "yes" || answer == "no",
        "can-i {verb} {resource} as {sa}: {out} {err}"
    );
    assert_eq!(yes, answer == "yes");
    yes
}

#[tokio::test]
async fn rbac_manifests_grant_what_virt_controller_and_virt_handler_use() {
    let c = Cluster::start().await;
    install_crds(&c).await;
    ok(
        &c,
        &[
            "apply",
            "-f",
            &manifest("install/00-namespace.yaml"),
            "-f",
            &manifest("install/10-virt-controller-rbac.yaml"),
            "-f",
            &manifest("install/20-virt-handler-rbac.yaml"),
            "--namespace=kubevirt",
        ],
    )
    .await;
    let controller = "kubevirt-controller";
    let handler = "kubevirt-handler";
    // (service account, namespace, verb, resource, allowed)
    let cases = [
        (
            controller,
            "default",
            "create",
            "virtualmachineinstances",
            true,
        ),
        (
            controller,
            "default",
            "delete",
            "virtualmachineinstances",
            true,
        ),
        (
            controller,
            "default",
            "patch",
            "virtualmachines/status",
            true,
        ),
        // The pool controller creates, rewrites and deletes its VMs, as KubeVirt's does.
        (controller, "default", "update", "virtualmachines", true),
        (controller, "default", "create", "pods", true),
        (controller, "default", "patch", "pods/status", true),
        (controller, "default", "update", "pods", false),
        (controller, "default", "get", "secrets", false),
        (controller, "default", "patch", "nodes", true),
        (controller, "default", "delete", "nodes", false),
        (controller, "kubevirt", "create", "leases", true),
        (controller, "default", "create", "leases", false),
        (
            controller,
            "default",
            "create",
            "events.events.k8s.io",
            true,
        ),
        (handler, "default", "patch", "virtualmachineinstances", true),
        (
            handler,
            "default",
            "update",
            "virtualmachineinstances",
            false,
        ),
        (
            handler,
            "default",
            "create",
            "virtualmachineinstances",
            false,
        ),
        (handler, "default", "list", "pods", true),
        (handler, "default", "delete", "pods", false),
        (handler, "default", "patch", "nodes", true),
        (handler, "default", "watch", "kubevirts", true),
        (handler, "default", "patch", "kubevirts", false),
        (handler, "kubevirt", "create", "leases", false),
    ];
    let mut wrong = Vec::new();
    for (sa, ns, verb, resource, allowed) in cases {
        if can_i(&c, sa, ns, verb, resource).await != allowed {
            wrong.push(format!(
                "{sa} {verb} {resource} -n {ns}: expected {allowed}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");

    // Nothing more than each component uses: every resource rule the service account holds,
    // as `auth can-i --list` reports it, is exactly the manifests', once what any service
    // account gets from the default roles (discovery, self reviews, cluster trust bundles) is
    // left out: what an account with no bindings holds.
    let granted = |sa: &'static str, namespace: &'static str| {
        let c = &c;
        async move {
            let rules = |sa: &str| {
                let user = format!("system:serviceaccount:kubevirt:{sa}");
                async move {
                    let table = ok(
                        c,
                        &["auth", "can-i", "--list", "--as", &user, "-n", namespace],
                    )
                    .await;
                    rows(&table)
                        .into_iter()
                        .skip(1)
                        .filter(|row| !row.first().is_none_or(String::is_empty))
                        .map(|row| {
                            format!("{} {}", row[0], row.last().cloned().unwrap_or_default())
                        })
                        .collect::<Vec<String>>()
                }
            };
            let baseline = rules("no-bindings").await;
            let mut own: Vec<String> = rules(sa)
                .await
                .into_iter()
                .filter(|r| !baseline.contains(r))
                .collect();
            own.sort();
            own
        }
    };
    let sorted = |rules: &[&str]| {
        let mut v: Vec<String> = rules.iter().map(ToString::to_string).collect();
        v.sort();
        v
    };
    let controller_everywhere = [
        "virtualmachines.kubevirt.io [get list watch patch create update delete]",
        "virtualmachines.kubevirt.io/status [patch]",
        "virtualmachinepools.pool.kubevirt.io [get list watch patch]",
        "virtualmachinepools.pool.kubevirt.io/status [patch]",
        "virtualmachineinstances.kubevirt.io [get list watch create delete patch]",
        "virtualmachineinstancereplicasets.kubevirt.io [get list watch patch]",
        "virtualmachineinstancereplicasets.kubevirt.io/status [patch]",
        "virtualmachineinstancemigrations.kubevirt.io [create get list watch patch delete]",
        "virtualmachineinstancemigrations.kubevirt.io/status [patch]",
        "virtualmachineinstancetypes.instancetype.kubevirt.io [get]",
        "virtualmachineclusterinstancetypes.instancetype.kubevirt.io [get]",
        "virtualmachinepreferences.instancetype.kubevirt.io [get]",
        "virtualmachineclusterpreferences.instancetype.kubevirt.io [get]",
        "controllerrevisions.apps [get create list watch delete]",
        "migrationpolicies.migrations.kubevirt.io [get list watch]",
        "namespaces [get list watch]",
        "poddisruptionbudgets.policy [list watch delete]",
        "kubevirts.kubevirt.io [get list watch]",
        "pods [get list watch create delete]",
        // Creates the backend-storage claim of a VMI with persistent EFI variables; a
        // migration's hand-off relabels the target's and deletes the source's.
        "persistentvolumeclaims [get list watch create patch delete]",
        "storageclasses.storage.k8s.io [get list]",
        "pods/status [patch]",
        "nodes [get list watch patch]",
        "events.events.k8s.io [create patch]",
    ];
    assert_eq!(
        granted(controller, "default").await,
        sorted(&controller_everywhere)
    );
    let mut controller_in_kubevirt = controller_everywhere.to_vec();
    controller_in_kubevirt.push("leases.coordination.k8s.io [get create patch delete]");
    assert_eq!(
        granted(controller, "kubevirt").await,
        sorted(&controller_in_kubevirt)
    );
    let handler_everywhere = [
        "virtualmachineinstances.kubevirt.io [get list watch patch]",
        "kubevirts.kubevirt.io [get list watch]",
        "pods [get list watch]",
        "nodes [get list watch patch]",
        "events.events.k8s.io [create patch]",
    ];
    for namespace in ["default", "kubevirt"] {
        assert_eq!(
            granted(handler, namespace).await,
            sorted(&handler_everywhere),
            "{namespace}"
        );
    }

    // TokenRequest: a token for the service account, with no pod, authenticates as it and
    // gets what RBAC grants it.
    let token = ok(&c, &["create", "token", controller, "-n", "kubevirt"]).await;
    let token = token.trim();
    assert_eq!(token.split('.').count(), 3, "a JWT: {token}");
    let as_token = |args: &[&str]| {
        let mut full = vec![
            "--kubeconfig=/dev/null".to_string(),
            format!("--server={}", c.plane.url()),
            format!(
                "--certificate-authority={}",
                c.plane.pki().ca().cert_path.display()
            ),
            format!("--token={token}"),
        ];
        full.extend(args.iter().map(|a| (*a).to_string()));
        full
    };
    let run = |args: Vec<String>| async move {
        let out = localcluster::kubectl::Kubectl::bare()
            .output_async(&args, None)
            .await
            .expect("running kubectl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (success, out, err) = run(as_token(&[
        "auth",
        "whoami",
        "-o",
        "jsonpath={.status.userInfo.username}",
    ]))
    .await;
    assert!(success, "{err}");
    assert_eq!(out, format!("system:serviceaccount:kubevirt:{controller}"));
    let (success, out, err) = run(as_token(&["get", "vmi", "-A", "-o", "name"])).await;
    assert!(success, "listing VMIs is granted: {err}");
    assert!(out.trim().is_empty(), "{out}");
    let (success, _, err) = run(as_token(&["get", "secrets", "-n", "kubevirt"])).await;
    assert!(!success, "secrets are not granted");
    assert!(
        err.contains(&format!(
            "User \"system:serviceaccount:kubevirt:{controller}\" cannot list resource \"secrets\""
        )),
        "{err}"
    );
}
