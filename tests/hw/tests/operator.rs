//! virt-operator through the whole stack, as a KubeVirt user drives it: the operator manifest
//! and the KubeVirt CR install everything (`hack/install.sh`); an owned Deployment deleted and
//! an owned DaemonSet edited are put back; certificates rotated twice (a new CA, then the
//! servers' renewal) keep the console working; an `imageTag` update rolls the components while
//! a VM keeps running on the same QEMU; `BlockUninstallIfWorkloadsExist` holds the uninstall
//! while the VM exists; the uninstall leaves nothing of any kind; and an install whose
//! operator is killed half-way completes without a duplicate. A second CR is refused.

use std::collections::BTreeMap;
use std::time::Duration;

use e2e::{Stack, console_round_trip, processes, repo_root, wait_for};
use operator::owned::OWNED_KINDS;
use serde_json::Value;

const BOOT: Duration = Duration::from_mins(7);
const SETTLE: Duration = Duration::from_mins(5);
const SELECTOR: &str =
    "app.kubernetes.io/managed-by=virt-operator,app.kubernetes.io/component=kubevirt";

fn kv(stack: &Stack) -> Result<Value, String> {
    stack
        .get_json("kubevirt", "kv", "kubevirt")
        .map_err(|e| e.to_string())?
        .ok_or_else(|| "no KubeVirt kubevirt/kubevirt".to_owned())
}

fn condition(kv: &Value, type_: &str) -> (String, String, String) {
    kv["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .map(|c| {
            let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (text("status"), text("reason"), text("message"))
        })
        .unwrap_or_default()
}

/// Waits until the CR is Deployed and Available with `version` observed.
fn wait_deployed(stack: &Stack, version: &str) -> Value {
    wait_for(
        &format!("the KubeVirt CR Deployed and Available at {version}"),
        SETTLE,
        || {
            let kv = kv(stack)?;
            let s = &kv["status"];
            let available = condition(&kv, "Available").0 == "True";
            if s["phase"] == "Deployed" && available && s["observedKubeVirtVersion"] == version {
                Ok(Some(kv))
            } else {
                Err(format!(
                    "phase {}, Available {:?}, observed {}",
                    s["phase"],
                    condition(&kv, "Available"),
                    s["observedKubeVirtVersion"]
                ))
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Every object of every owned kind that carries virt-operator's labels, as `Kind ns/name`.
fn managed(stack: &Stack) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for k in &OWNED_KINDS {
        let resource = if k.group.is_empty() {
            k.plural.to_owned()
        } else {
            format!("{}.{}", k.plural, k.group)
        };
        let list: Value = serde_json::from_str(
            &stack
                .kubectl(&["get", &resource, "-A", "-l", SELECTOR, "-o", "json"])
                .unwrap_or_else(|e| panic!("listing {resource}: {e}")),
        )
        .expect("JSON");
        let mut names: Vec<String> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|o| {
                let m = &o["metadata"];
                match m["namespace"].as_str() {
                    Some(ns) => format!("{ns}/{}", m["name"].as_str().unwrap_or_default()),
                    None => m["name"].as_str().unwrap_or_default().to_owned(),
                }
            })
            .collect();
        names.sort();
        if !names.is_empty() {
            out.insert(k.kind.to_owned(), names);
        }
    }
    out
}

/// What the CR's strategy and certificates consist of, in the shape of [`managed`].
fn expected(stack: &Stack) -> BTreeMap<String, Vec<String>> {
    let cr = kv(stack).unwrap_or_else(|e| panic!("{e}"));
    let spec = serde_json::from_value(cr["spec"].clone()).expect("a KubeVirt spec");
    let release = operator::strategy::Release {
        registry: "kubevirt-rs".into(),
        tag: "latest".into(),
        digests: BTreeMap::new(),
    };
    let strategy = operator::strategy::render(&spec, &release, "kubevirt").expect("renders");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for o in &strategy.objects {
        let r = operator::owned::ObjectRef::of(o);
        let name = if r.namespace.is_empty() {
            r.name
        } else {
            format!("{}/{}", r.namespace, r.name)
        };
        out.entry(r.kind).or_default().push(name);
    }
    out.entry("ConfigMap".into())
        .or_default()
        .push(format!("kubevirt/{}", operator::certs::CA_BUNDLE_CONFIGMAP));
    let secrets = out.entry("Secret".into()).or_default();
    secrets.push(format!("kubevirt/{}", operator::certs::CA_SECRET));
    for leaf in &operator::certs::LEAVES {
        secrets.push(format!("kubevirt/{}", leaf.secret));
    }
    for names in out.values_mut() {
        names.sort();
    }
    out
}

fn secret_text(stack: &Stack, name: &str, key: &str) -> Result<String, String> {
    use base64::Engine as _;
    let s = stack
        .get_json("kubevirt", "secret", name)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("no secret {name}"))?;
    let encoded = s["data"][key].as_str().unwrap_or_default();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Waits until every pod that mounts `secret` sees its current certificate and key (the
/// kubelet projects secret volumes again on its own schedule).
fn wait_mounted(stack: &Stack, secret: &str) {
    wait_for(
        &format!("every pod mounting {secret} to see its new certificate"),
        Duration::from_mins(2),
        || {
            let want = [
                secret_text(stack, secret, "tls.crt")?,
                secret_text(stack, secret, "tls.key")?,
            ];
            let pods = stack.dir().join("nodes/node-1/var/lib/kubelet/pods");
            let mut seen = 0;
            for pod in std::fs::read_dir(&pods)
                .map_err(|e| e.to_string())?
                .flatten()
            {
                let dir = pod.path().join("volumes/kubernetes.io~secret").join(secret);
                let Ok(cert) = std::fs::read_to_string(dir.join("tls.crt")) else {
                    continue;
                };
                let key = std::fs::read_to_string(dir.join("tls.key")).unwrap_or_default();
                if [cert, key] != want {
                    return Err(format!("{} is not the new certificate yet", dir.display()));
                }
                seen += 1;
            }
            (seen > 0)
                .then_some(Some(()))
                .ok_or_else(|| format!("no pod mounts {secret}"))
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Waits until the secret's certificate differs from `before`; returns the new one.
fn wait_rotated(stack: &Stack, secret: &str, before: &str, within: Duration) -> String {
    wait_for(&format!("{secret} to be rotated"), within, || {
        let now = secret_text(stack, secret, "tls.crt")?;
        Ok((now != before).then_some(now))
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

fn qemu_pid() -> u32 {
    let pids = processes("qemu-system-x86_64", "guest=default_demo");
    assert_eq!(pids.len(), 1, "one QEMU for the demo VM: {pids:?}");
    pids[0]
}

/// The replica holding virt-operator's Lease.
fn lease_holder(stack: &Stack) -> String {
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "get",
            "lease",
            "virt-operator",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ])
        .expect("the operator's Lease")
}

fn patch_cr(stack: &Stack, patch: &str) {
    stack
        .kubectl(&[
            "-n", "kubevirt", "patch", "kv", "kubevirt", "--type", "merge", "-p", patch,
        ])
        .unwrap_or_else(|e| panic!("patching the CR with {patch}: {e}"));
}

fn images_of(stack: &Stack, kind: &str, name: &str) -> String {
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "get",
            kind,
            name,
            "-o",
            "jsonpath={.spec.template.spec.containers[*].image}",
        ])
        .unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn guest_operator_installs_restores_rotates_updates_and_uninstalls() {
    let stack = Stack::up().expect("the stack comes up through virt-operator");

    // Installed: Deployed, the KubeVirt conditions and versions, every object of the strategy.
    let cr = wait_deployed(&stack, "latest");
    let s = &cr["status"];
    assert_eq!(condition(&cr, "Available").1, "AllComponentsReady");
    assert_eq!(condition(&cr, "Progressing").0, "False");
    assert_eq!(condition(&cr, "Degraded").0, "False");
    assert_eq!(condition(&cr, "Created").1, "AllResourcesCreated");
    assert_eq!(s["operatorVersion"], "latest");
    assert_eq!(s["targetKubeVirtRegistry"], "kubevirt-rs");
    assert_eq!(s["observedDeploymentID"], s["targetDeploymentID"]);
    assert!(
        cr["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f.iter().any(|f| f == "kubevirt.io/virtOperatorFinalizer")),
        "{cr:#}"
    );
    assert_eq!(
        managed(&stack),
        expected(&stack),
        "the install is the strategy"
    );
    let events = stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "get",
            "events",
            "--field-selector",
            "involvedObject.kind=KubeVirt",
            "-o",
            "jsonpath={.items[*].reason}",
        ])
        .expect("events");
    assert!(
        events.contains("SuccessfulCreate"),
        "events on the CR: {events}"
    );

    // A second CR is refused while the first installs, and is deleted at once.
    let second = serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
        "metadata": {"name": "second", "namespace": "kubevirt"}, "spec": {}});
    stack
        .kubectl_with_input(&["create", "-f", "-"], &second.to_string())
        .expect("creating a second KubeVirt CR");
    wait_for(
        "the second CR to be refused",
        Duration::from_mins(1),
        || {
            let cr = stack
                .get_json("kubevirt", "kv", "second")
                .map_err(|e| e.to_string())?
                .ok_or("no second CR")?;
            let (status, reason, _) = condition(&cr, "Synchronized");
            (status == "False" && reason == "ExistingDeployment")
                .then_some(Some(()))
                .ok_or_else(|| format!("{}", cr["status"]))
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    stack
        .kubectl(&["-n", "kubevirt", "delete", "kv", "second", "--timeout=60s"])
        .expect("deleting the second CR");
    assert_eq!(
        kv(&stack).expect("the first CR")["status"]["phase"],
        "Deployed"
    );

    // The leader says so on /metrics (through kube-apiserver's pod proxy).
    let metrics = stack
        .kubectl(&[
            "get",
            "--raw",
            &format!(
                "/api/v1/namespaces/kubevirt/pods/{}:8443/proxy/metrics",
                lease_holder(&stack)
            ),
        ])
        .expect("the leader's /metrics");
    assert!(
        metrics.contains("kubevirt_virt_operator_leading_status 1")
            && metrics.contains("kubevirt_virt_operator_ready_status 1"),
        "{metrics}"
    );

    // A deleted Deployment and an edited DaemonSet are put back.
    let uid = |kind: &str, name: &str| {
        stack
            .get_json("kubevirt", kind, name)
            .ok()
            .flatten()
            .map(|o| o["metadata"]["uid"].as_str().unwrap_or_default().to_owned())
    };
    let controller_uid = uid("deployment", "virt-controller").expect("virt-controller");
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "delete",
            "deployment",
            "virt-controller",
            "--wait=false",
        ])
        .expect("deleting virt-controller");
    stack
        .kubectl(&[
            "-n", "kubevirt", "patch", "ds", "virt-handler", "--type", "json", "-p",
            r#"[{"op":"add","path":"/spec/template/spec/containers/0/env/-","value":{"name":"EDITED","value":"1"}}]"#,
        ])
        .expect("editing virt-handler");
    wait_for("virt-controller to be created again", SETTLE, || {
        Ok(uid("deployment", "virt-controller").filter(|u| *u != controller_uid))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    wait_for("the edit of virt-handler to be undone", SETTLE, || {
        let env = stack
            .kubectl(&[
                "-n",
                "kubevirt",
                "get",
                "ds",
                "virt-handler",
                "-o",
                "jsonpath={.spec.template.spec.containers[0].env[*].name}",
            ])
            .map_err(|e| e.to_string())?;
        (!env.contains("EDITED")).then_some(Some(())).ok_or(env)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // The CR may still read Available from before: wait for the rollouts themselves.
    for workload in ["daemonset/virt-handler", "deployment/virt-controller"] {
        stack
            .kubectl(&[
                "-n",
                "kubevirt",
                "rollout",
                "status",
                workload,
                "--timeout=300s",
            ])
            .unwrap_or_else(|e| panic!("{workload} rolled out again: {e}"));
    }
    wait_deployed(&stack, "latest");

    // A VM, and its console.
    stack
        .kubectl(&[
            "apply",
            "-f",
            &repo_root()
                .join("manifests/examples/vm-demo.yaml")
                .display()
                .to_string(),
        ])
        .expect("applying the demo VM");
    wait_for("the demo VMI to run", BOOT, || {
        let vmi = stack
            .get_json("default", "vmi", "demo")
            .map_err(|e| e.to_string())?;
        let phase = vmi
            .as_ref()
            .map(|v| v["status"]["phase"].clone())
            .unwrap_or_default();
        (phase == "Running")
            .then_some(Some(()))
            .ok_or(format!("phase {phase}"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    console_round_trip(&stack, "demo", "installed").unwrap_or_else(|e| panic!("{e}"));
    let qemu = qemu_pid();

    // Rotation 1: short lifetimes, and the CA Secret deleted (KubeVirt's way to force a new
    // CA): a new CA signs new certificates; the bundle keeps the old CA.
    let handler_server = "kubevirt-virt-handler-server-certs";
    let old_ca = secret_text(&stack, "kubevirt-ca", "tls.crt").expect("the CA");
    let before = secret_text(&stack, handler_server, "tls.crt").expect("the handler's certificate");
    patch_cr(
        &stack,
        r#"{"spec":{"certificateRotateStrategy":{"selfSigned":{"ca":{"duration":"6m","renewBefore":"3m"},"server":{"duration":"2m","renewBefore":"1m"}}}}}"#,
    );
    stack
        .kubectl(&["-n", "kubevirt", "delete", "secret", "kubevirt-ca"])
        .expect("deleting the CA");
    let first = wait_rotated(&stack, handler_server, &before, Duration::from_mins(1));
    let new_ca = secret_text(&stack, "kubevirt-ca", "tls.crt").expect("the new CA");
    assert_ne!(new_ca, old_ca);
    let bundle = stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "get",
            "configmap",
            "kubevirt-ca",
            "-o",
            "jsonpath={.data.ca-bundle}",
        ])
        .expect("the CA bundle");
    assert_eq!(
        bundle.matches("BEGIN CERTIFICATE").count(),
        2,
        "new and old CA: {bundle}"
    );
    for secret in [
        handler_server,
        "kubevirt-virt-handler-certs",
        "kubevirt-virt-api-certs",
    ] {
        wait_mounted(&stack, secret);
    }
    console_round_trip(&stack, "demo", "rotated-once").unwrap_or_else(|e| panic!("{e}"));

    // Rotation 2: the servers' certificates renew a minute before their two minutes end.
    wait_rotated(&stack, handler_server, &first, Duration::from_mins(3));
    for secret in [
        handler_server,
        "kubevirt-virt-handler-certs",
        "kubevirt-virt-api-certs",
    ] {
        wait_mounted(&stack, secret);
    }
    console_round_trip(&stack, "demo", "rotated-twice").unwrap_or_else(|e| panic!("{e}"));

    // An update: the same images under a new tag roll every component; the VM stays on its
    // QEMU.
    stack
        .load_components_tagged("next")
        .expect("loading the images tagged next");
    patch_cr(&stack, r#"{"spec":{"imageTag":"next"}}"#);
    let cr = wait_deployed(&stack, "next");
    assert_eq!(
        cr["status"]["observedDeploymentID"],
        cr["status"]["targetDeploymentID"]
    );
    for (kind, name) in [
        ("deployment", "virt-api"),
        ("deployment", "virt-controller"),
        ("daemonset", "virt-handler"),
    ] {
        assert_eq!(
            images_of(&stack, kind, name),
            format!("kubevirt-rs/{name}:next")
        );
    }
    // The old pods leave as their grace allows (virt-api keeps serving 15 s after SIGTERM).
    wait_for("every component pod to run the new images", SETTLE, || {
        let pods = stack
            .kubectl(&[
                "-n",
                "kubevirt",
                "get",
                "pods",
                "-l",
                "kubevirt.io in (virt-api,virt-controller,virt-handler)",
                "-o",
                "jsonpath={.items[*].spec.containers[0].image}",
            ])
            .map_err(|e| e.to_string())?;
        (!pods.contains(":latest")).then_some(Some(())).ok_or(pods)
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(qemu_pid(), qemu, "the VM kept its QEMU through the update");
    console_round_trip(&stack, "demo", "updated").unwrap_or_else(|e| panic!("{e}"));

    // BlockUninstallIfWorkloadsExist: the deletion waits while the VM exists.
    patch_cr(
        &stack,
        r#"{"spec":{"uninstallStrategy":"BlockUninstallIfWorkloadsExist"}}"#,
    );
    stack
        .kubectl(&["-n", "kubevirt", "delete", "kv", "kubevirt", "--wait=false"])
        .expect("deleting the CR");
    wait_for(
        "the uninstall to be refused",
        Duration::from_mins(1),
        || {
            let kv = kv(&stack)?;
            let (status, reason, message) = condition(&kv, "Synchronized");
            (kv["status"]["phase"] == "Deleting"
                && status == "False"
                && reason == "DeletionFailed"
                && message.contains("Virtual Machine Instances"))
            .then_some(Some(()))
            .ok_or_else(|| format!("{}", kv["status"]))
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        stack
            .get_json("kubevirt", "deployment", "virt-api")
            .unwrap()
            .is_some(),
        "the install stays"
    );
    assert_eq!(qemu_pid(), qemu, "the VM runs on");

    // Without the VM the uninstall goes through and leaves nothing.
    stack
        .kubectl(&["delete", "vm", "demo"])
        .expect("deleting the VM");
    wait_for("the KubeVirt CR to be gone", SETTLE, || {
        Ok(stack
            .get_json("kubevirt", "kv", "kubevirt")
            .map_err(|e| e.to_string())?
            .is_none()
            .then_some(()))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        managed(&stack),
        BTreeMap::new(),
        "nothing of the install is left"
    );
    let crds = stack.kubectl(&["get", "crd", "-o", "name"]).expect("CRDs");
    assert!(!crds.contains("virtualmachines.kubevirt.io"), "{crds}");
    assert!(
        crds.contains("kubevirts.kubevirt.io"),
        "the operator's own CRD stays: {crds}"
    );

    // A new install whose leading operator dies half-way completes with one of everything.
    stack
        .kubectl(&[
            "apply",
            "-f",
            &repo_root()
                .join("manifests/release/kubevirt-cr.yaml")
                .display()
                .to_string(),
        ])
        .expect("applying the CR again");
    wait_for("the install to have begun", Duration::from_mins(2), || {
        let n: usize = managed(&stack).values().map(Vec::len).sum();
        (n > 5).then_some(Some(())).ok_or(format!("{n} objects"))
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let leader = lease_holder(&stack);
    stack
        .kubectl(&[
            "-n",
            "kubevirt",
            "delete",
            "pod",
            &leader,
            "--grace-period=0",
            "--force",
        ])
        .unwrap_or_else(|e| panic!("killing the leader {leader}: {e}"));
    wait_deployed(&stack, "latest");
    assert_eq!(
        managed(&stack),
        expected(&stack),
        "one of everything after the takeover"
    );
    let holder = lease_holder(&stack);
    assert_ne!(holder, leader, "another replica took over");
}
