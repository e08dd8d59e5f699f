//! virt-api behind the real kube-apiserver's aggregation layer (see `common`): discovery, the
//! console relayed to virt-handler's console server, authorization by the API server and by
//! virt-api's own SubjectAccessReview, VMI actions relayed with the handler's answer, VM
//! start/stop/restart as patches of the VM, addvolume/removevolume as patches of the VM's
//! template or the VMI's spec.

mod common;

use api::VirtualMachineInstancePhase as Phase;
use api::vm::RunStrategy;
use common::{Cluster, NS, subresources, vm_path, vmi_path};
use futures::{SinkExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixListener;
use tokio_tungstenite::tungstenite::Message;

fn names(list: &Value) -> Vec<&str> {
    list["resources"]
        .as_array()
        .expect("resources")
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_through_kube_apiserver_and_an_unknown_subresource() {
    let c = Cluster::start().await;
    let admin = c.admin();
    for version in api::subresources::VERSIONS {
        let r = admin
            .request("GET", &subresources(version), &[], None)
            .await
            .expect("discovery");
        assert_eq!(r.status, 200, "{version}: {}", r.text());
        let list = r.json();
        assert_eq!(
            list["groupVersion"],
            format!("{}/{version}", api::subresources::GROUP)
        );
        let served = names(&list);
        for want in [
            "virtualmachineinstances/console",
            "virtualmachineinstances/vnc",
            "virtualmachineinstances/pause",
            "virtualmachineinstances/addvolume",
            "virtualmachines/start",
            "virtualmachines/removevolume",
        ] {
            assert!(served.contains(&want), "{version} lacks {want}: {served:?}");
        }
    }
    // kube-apiserver's own group list names the aggregated group.
    let groups = admin
        .request("GET", "/apis", &[("Accept", "application/json")], None)
        .await
        .expect("/apis");
    assert!(
        groups.json()["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .any(|g| g["name"] == api::subresources::GROUP),
        "{}",
        groups.text()
    );

    c.vmi("demo", Phase::Running).await;
    let r = admin
        .request("GET", &vmi_path("demo", "nonsense"), &[], None)
        .await
        .expect("request");
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.message().contains("nonsense"), "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_through_kube_apiserver_carries_bytes_both_ways() {
    let c = Cluster::start().await;
    c.vmi("demo", Phase::Running).await;
    let serial = UnixListener::bind(c.serial_socket("demo")).expect("bind the serial socket");
    let mut ws = c
        .admin()
        .websocket(&vmi_path("demo", "console"), &[])
        .await
        .expect("console websocket");
    let (mut peer, _) = serial.accept().await.expect("the handler connects");

    // The guest writes: the user reads it.
    peer.write_all(b"login: ").await.expect("guest writes");
    let mut got = Vec::new();
    while got.len() < b"login: ".len() {
        match ws.next().await {
            Some(Ok(Message::Binary(b))) => got.extend_from_slice(&b),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("after {got:?}: {other:?}"),
        }
    }
    assert_eq!(got, b"login: ");

    // The user types: the guest reads it.
    ws.send(Message::Binary(b"root\n".to_vec().into()))
        .await
        .expect("user types");
    let mut typed = [0u8; 5];
    peer.read_exact(&mut typed).await.expect("guest reads");
    assert_eq!(&typed, b"root\n");

    // The guest's side closing ends the session for the user.
    drop(peer);
    loop {
        match ws.next().await {
            None | Some(Ok(Message::Close(_)) | Err(_)) => break,
            Some(Ok(_)) => {}
        }
    }

    // No serial socket: the handler's 503 is the upgrade's answer.
    c.vmi("no-console", Phase::Running).await;
    let refused = c
        .admin()
        .websocket(&vmi_path("no-console", "console"), &[])
        .await
        .expect_err("refused");
    assert_eq!(refused.0, 503, "{}", refused.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_by_kube_apiserver_and_by_virt_api() {
    let c = Cluster::start().await;
    c.vmi("demo", Phase::Running).await;
    let _serial = UnixListener::bind(c.serial_socket("demo")).expect("bind the serial socket");

    // No RBAC: kube-apiserver refuses before the request reaches virt-api.
    let nobody = c.user("nobody", &[]);
    let refused = nobody
        .websocket(&vmi_path("demo", "console"), &[])
        .await
        .expect_err("refused");
    assert_eq!(refused.0, 403, "{}", refused.1);
    assert!(
        refused.1.contains("virtualmachineinstances/console") && refused.1.contains("nobody"),
        "{}",
        refused.1
    );
    let r = nobody
        .request("PUT", &vmi_path("demo", "pause"), &[], Some(json!({})))
        .await
        .expect("request");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.message().contains("virtualmachineinstances/pause"),
        "{}",
        r.text()
    );

    // A Role granting the console: kube-apiserver and virt-api's SubjectAccessReview agree.
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "console"},
        "rules": [{
            "apiGroups": [api::subresources::GROUP],
            "resources": ["virtualmachineinstances/console"],
            "verbs": ["get"],
        }],
    }))
    .expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "console"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "console"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "console-user"}],
    }))
    .expect("binding");
    Api::<Role>::namespaced(c.client.clone(), NS)
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    Api::<RoleBinding>::namespaced(c.client.clone(), NS)
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
    let console_user = c.user("console-user", &[]);
    // RBAC's cache in kube-apiserver follows the binding within moments.
    common::wait_for("the console-user's binding in effect", || async {
        match console_user
            .websocket(&vmi_path("demo", "console"), &[])
            .await
        {
            Ok(_) => true,
            Err((403, _)) => false,
            Err(other) => panic!("console-user: {other:?}"),
        }
    })
    .await;
    let r = console_user
        .request("PUT", &vmi_path("demo", "pause"), &[], Some(json!({})))
        .await
        .expect("request");
    assert_eq!(r.status, 403, "console does not grant pause: {}", r.text());

    // virt-api's own check, reached directly as kube-apiserver's front proxy would: the
    // SubjectAccessReview for the user in the headers refuses, naming the subresource.
    let front_proxy = c.virt_api_direct(true);
    let as_user = |user: &'static str| {
        [
            ("X-Remote-User", user),
            ("X-Remote-Group", "system:authenticated"),
        ]
    };
    let refused = front_proxy
        .websocket(&vmi_path("demo", "console"), &as_user("nobody"))
        .await
        .expect_err("refused");
    assert_eq!(refused.0, 403, "{}", refused.1);
    assert!(
        refused.1.contains("nobody") && refused.1.contains("virtualmachineinstances/console"),
        "{}",
        refused.1
    );
    let r = front_proxy
        .request(
            "PUT",
            &vmi_path("demo", "pause"),
            &as_user("console-user"),
            Some(json!({})),
        )
        .await
        .expect("request");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.message().contains("virtualmachineinstances/pause"),
        "{}",
        r.text()
    );
    front_proxy
        .websocket(&vmi_path("demo", "console"), &as_user("console-user"))
        .await
        .expect("console-user may open the console");

    // Headers from anyone but the front proxy are not believed.
    let r = c
        .virt_api_direct(false)
        .request(
            "PUT",
            &vmi_path("demo", "pause"),
            &[
                ("X-Remote-User", "test-admin"),
                ("X-Remote-Group", "system:masters"),
            ],
            Some(json!({})),
        )
        .await
        .expect("request");
    assert_eq!(r.status, 401, "{}", r.text());
    // Discovery and health need no authentication, as KubeVirt's.
    let r = c
        .virt_api_direct(false)
        .request("GET", &format!("{}/healthz", subresources("v1")), &[], None)
        .await
        .expect("healthz");
    assert_eq!((r.status, r.text().as_str()), (200, "ok"));
}

/// 401, or 403 for kube-apiserver's anonymous user (anonymous authentication is on by default
/// and RBAC grants `system:anonymous` nothing here).
fn unauthenticated(status: u16, body: &str) -> bool {
    status == 401 || (status == 403 && body.contains("system:anonymous"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_valid_credentials_are_refused() {
    let c = Cluster::start().await;
    c.vmi("demo", Phase::Running).await;
    let _serial = UnixListener::bind(c.serial_socket("demo")).expect("bind the serial socket");
    let (console, pause) = (vmi_path("demo", "console"), vmi_path("demo", "pause"));

    // Through kube-apiserver with no credentials at all.
    let nobody = c.without_certificate();
    let refused = nobody.websocket(&console, &[]).await.expect_err("refused");
    assert!(unauthenticated(refused.0, &refused.1), "{refused:?}");
    let r = nobody
        .request("PUT", &pause, &[], Some(json!({})))
        .await
        .expect("request");
    assert!(unauthenticated(r.status, &r.text()), "{}", r.text());

    // A bearer token kube-apiserver never issued.
    let forged = [("Authorization", "Bearer not-a-token")];
    let refused = nobody
        .websocket(&console, &forged)
        .await
        .expect_err("refused");
    assert_eq!(refused.0, 401, "{}", refused.1);
    let r = nobody
        .request("PUT", &pause, &forged, Some(json!({})))
        .await
        .expect("request");
    assert_eq!(r.status, 401, "{}", r.text());

    // A real service account token, without `virtualmachineinstances/console`: authenticated
    // (the refusal names the account), then refused.
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "viewer"}})).expect("service account");
    Api::<ServiceAccount>::namespaced(c.client.clone(), NS)
        .create(&PostParams::default(), &sa)
        .await
        .expect("service account");
    let r = c
        .admin()
        .request(
            "POST",
            &format!("/api/v1/namespaces/{NS}/serviceaccounts/viewer/token"),
            &[],
            Some(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}})),
        )
        .await
        .expect("token request");
    assert_eq!(r.status, 201, "{}", r.text());
    let bearer = format!(
        "Bearer {}",
        r.json()["status"]["token"].as_str().expect("a token")
    );
    let as_viewer = [("Authorization", bearer.as_str())];
    let refused = nobody
        .websocket(&console, &as_viewer)
        .await
        .expect_err("refused");
    assert_eq!(refused.0, 403, "{}", refused.1);
    for want in [
        &format!("system:serviceaccount:{NS}:viewer"),
        "virtualmachineinstances/console",
    ] {
        assert!(refused.1.contains(want), "{want}: {}", refused.1);
    }

    // Straight to virt-api with a certificate kube-apiserver trusts for an administrator, but
    // not the front proxy's: the request-header CA refuses it, whatever headers come with it.
    let impostor = c.virt_api_direct_as_user("test-admin", &["system:masters"]);
    let as_admin = [
        ("X-Remote-User", "test-admin"),
        ("X-Remote-Group", "system:masters"),
    ];
    match impostor
        .request("PUT", &pause, &as_admin, Some(json!({})))
        .await
    {
        Err(_) => {}
        Ok(r) => assert_eq!(r.status, 401, "{}", r.text()),
    }
    match impostor.websocket(&console, &as_admin).await {
        Ok(_) => panic!("the console opened for an impostor"),
        Err(refused) => assert!(matches!(refused.0, 0 | 401), "{refused:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmi_actions_relay_the_handlers_answer() {
    let c = Cluster::start().await;
    let admin = c.admin();
    // Running for the API (virt-api's checks pass), not yet for the handler: its 409.
    c.vmi("starting", Phase::Scheduled).await;
    let r = admin
        .request("PUT", &vmi_path("starting", "pause"), &[], Some(json!({})))
        .await
        .expect("pause");
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.message().contains("is not running (phase Scheduled)"),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["reason"], "Conflict", "{}", r.text());

    // Running for both, but no launcher answers: the handler's 503.
    c.vmi("no-launcher", Phase::Running).await;
    let r = admin
        .request(
            "PUT",
            &vmi_path("no-launcher", "pause"),
            &[],
            Some(json!({})),
        )
        .await
        .expect("pause");
    assert_eq!(r.status, 503, "{}", r.text());

    // dryRun returns before the handler is called.
    let r = admin
        .request(
            "PUT",
            &vmi_path("no-launcher", "pause"),
            &[],
            Some(json!({"dryRun": ["All"]})),
        )
        .await
        .expect("pause");
    assert_eq!(r.status, 200, "{}", r.text());

    // virt-api's own pre-checks, with KubeVirt's messages: a VMI not Running for the API.
    let r = admin
        .request("PUT", &vmi_path("missing", "pause"), &[], Some(json!({})))
        .await
        .expect("pause");
    assert_eq!(r.status, 404, "{}", r.text());
    let r = admin
        .request(
            "PUT",
            &vmi_path("no-launcher", "unpause"),
            &[],
            Some(json!({})),
        )
        .await
        .expect("unpause");
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.message().contains("VMI is not paused"), "{}", r.text());
}

fn halted_vm(name: &str) -> api::VirtualMachine {
    serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "runStrategy": "Halted",
            "template": {"spec": {"domain": {"devices": {}}}},
        },
    }))
    .expect("VM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_start_stop_restart_patch_the_vm() {
    let c = Cluster::start().await;
    let admin = c.admin();
    let vms: Api<api::VirtualMachine> = Api::namespaced(c.client.clone(), NS);
    vms.create(&PostParams::default(), &halted_vm("demo"))
        .await
        .expect("create the VM");
    let strategy = |vm: api::VirtualMachine| vm.spec.run_strategy;

    let r = admin
        .request("PUT", &vm_path("demo", "restart"), &[], Some(json!({})))
        .await
        .expect("restart");
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(
        r.message(),
        "Operation cannot be fulfilled on virtualmachine.kubevirt.io \"demo\": RunStategy Halted does not support manual restart requests"
    );

    let r = admin
        .request("PUT", &vm_path("demo", "start"), &[], Some(json!({})))
        .await
        .expect("start");
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(
        strategy(vms.get("demo").await.expect("VM")),
        Some(RunStrategy::Always)
    );

    // dryRun changes nothing.
    let r = admin
        .request(
            "PUT",
            &vm_path("demo", "stop"),
            &[],
            Some(json!({"dryRun": ["All"]})),
        )
        .await
        .expect("stop");
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(
        strategy(vms.get("demo").await.expect("VM")),
        Some(RunStrategy::Always)
    );

    let r = admin
        .request("PUT", &vm_path("demo", "stop"), &[], Some(json!({})))
        .await
        .expect("stop");
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(
        strategy(vms.get("demo").await.expect("VM")),
        Some(RunStrategy::Halted)
    );

    // Halted with no VMI: nothing to stop.
    let r = admin
        .request("PUT", &vm_path("demo", "stop"), &[], Some(json!({})))
        .await
        .expect("stop");
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.message().ends_with("VM is not running"), "{}", r.text());

    // The old API version is served the same.
    let r = admin
        .request(
            "PUT",
            &vm_path("demo", "start").replacen("/v1/", "/v1alpha3/", 1),
            &[],
            Some(json!({})),
        )
        .await
        .expect("start");
    assert_eq!(r.status, 202, "{}", r.text());

    let r = admin
        .request("PUT", &vm_path("missing", "start"), &[], Some(json!({})))
        .await
        .expect("start");
    assert_eq!(r.status, 404, "{}", r.text());
    // A VM subresource asked with the wrong method.
    let r = admin
        .request("GET", &vm_path("demo", "start"), &[], None)
        .await
        .expect("start");
    assert_eq!(r.status, 405, "{}", r.text());
}

/// `{op}volume` of `kind`'s `name` as the administrator: the answer's code and message.
async fn volume(c: &Cluster, kind: &str, name: &str, op: &str, body: Value) -> (u16, String) {
    let path = if kind == "vm" {
        vm_path(name, &format!("{op}volume"))
    } else {
        vmi_path(name, &format!("{op}volume"))
    };
    let r = c
        .admin()
        .request("PUT", &path, &[], Some(body))
        .await
        .expect("request");
    (r.status, r.message())
}

/// An `addvolume` body for the claim `claim` as the disk and volume `name`.
fn add_pvc(name: &str, claim: &str) -> Value {
    json!({
        "name": name,
        "disk": {"disk": {"bus": "scsi"}, "serial": name},
        "volumeSource": {"persistentVolumeClaim": {"claimName": claim}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addvolume_and_removevolume_patch_the_vm_template_and_the_vmi_spec() {
    let c = Cluster::start().await;
    let vms: Api<api::VirtualMachine> = Api::namespaced(c.client.clone(), NS);
    let vm: api::VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "demo", "namespace": NS},
        "spec": {"runStrategy": "Halted", "template": {"spec": {
            "domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
            "volumes": [{"name": "root", "containerDisk": {"image": "guest"}}],
        }}},
    }))
    .expect("VM");
    let vm = vms
        .create(&PostParams::default(), &vm)
        .await
        .expect("create the VM");
    let template = || async {
        let vm = vms.get("demo").await.expect("the VM");
        let spec = serde_json::to_value(vm.spec.template.spec).expect("JSON");
        (
            spec["volumes"].clone(),
            spec["domain"]["devices"]["disks"].clone(),
        )
    };
    let (root_volume, root_disk) = template().await;
    let conflict = |why: &str| {
        format!("Operation cannot be fulfilled on virtualmachine.kubevirt.io \"demo\": {why}")
    };

    // A dry run changes nothing; the real one appends the hotpluggable volume and its disk.
    let mut dry = add_pvc("data", "claim1");
    dry["dryRun"] = json!(["All"]);
    let accepted = (202, String::new());
    assert_eq!(volume(&c, "vm", "demo", "add", dry).await, accepted);
    assert_eq!(template().await, (root_volume.clone(), root_disk.clone()));
    assert_eq!(
        volume(&c, "vm", "demo", "add", add_pvc("data", "claim1")).await,
        accepted
    );
    let (volumes, disks) = template().await;
    assert_eq!(
        volumes[1],
        json!({"name": "data", "persistentVolumeClaim": {"claimName": "claim1", "hotpluggable": true}})
    );
    assert_eq!(
        disks[1],
        json!({"name": "data", "disk": {"bus": "scsi"}, "serial": "data"})
    );
    assert_eq!((&volumes[0], &disks[0]), (&root_volume[0], &root_disk[0]));

    // KubeVirt's refusals, each naming what was wrong.
    let cases = [
        (
            "add",
            add_pvc("data", "claim2"),
            409,
            conflict("Unable to add volume [data] because volume with that name already exists"),
        ),
        (
            "add",
            add_pvc("other", "claim1"),
            409,
            conflict("Unable to add volume source [claim1] because it already exists"),
        ),
        (
            "remove",
            json!({"name": "root"}),
            409,
            conflict("Unable to remove volume [root] because it is not hotpluggable"),
        ),
        (
            "remove",
            json!({"name": "nope"}),
            409,
            conflict("Unable to remove volume [nope] because it does not exist"),
        ),
        (
            "add",
            json!({}),
            400,
            "AddVolumeOptions requires name to be set".to_owned(),
        ),
        (
            "add",
            json!({"name": "x", "volumeSource": {}}),
            400,
            "AddVolumeOptions requires disk to not be nil".to_owned(),
        ),
        (
            "remove",
            json!({}),
            400,
            "RemoveVolumeOptions requires name to be set".to_owned(),
        ),
    ];
    for (op, body, code, message) in cases {
        assert_eq!(
            volume(&c, "vm", "demo", op, body.clone()).await,
            (code, message),
            "{op} {body}"
        );
    }
    assert_eq!(
        volume(&c, "vm", "missing", "add", add_pvc("data", "claim1"))
            .await
            .0,
        404
    );

    // Removed by a dry run: still there; then removed for real, disk and all.
    let remove = json!({"name": "data"});
    let dry = json!({"name": "data", "dryRun": ["All"]});
    assert_eq!(volume(&c, "vm", "demo", "remove", dry).await.0, 202);
    assert_eq!(template().await.0.as_array().map(Vec::len), Some(2));
    assert_eq!(
        volume(&c, "vm", "demo", "remove", remove.clone()).await.0,
        202
    );
    assert_eq!(template().await, (root_volume, root_disk));

    // The VM's own VMI is the VM's to change; a VMI of its own is patched, while Running.
    let vmis: Api<api::VirtualMachineInstance> = Api::namespaced(c.client.clone(), NS);
    let owned: api::VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "demo", "namespace": NS, "ownerReferences": [{
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "demo",
            "uid": vm.metadata.uid, "controller": true, "blockOwnerDeletion": true,
        }]},
        "spec": {"domain": {"devices": {}}},
        "status": {"phase": "Running", "nodeName": common::NODE},
    }))
    .expect("VMI");
    vmis.create(&PostParams::default(), &owned)
        .await
        .expect("create the VM's VMI");
    assert_eq!(
        volume(&c, "vmi", "demo", "add", add_pvc("data", "claim1")).await,
        (400, format!("VMI {NS}/demo is owned by a VM"))
    );
    c.vmi("solo", Phase::Running).await;
    let lists = || async {
        let v = vmis.get("solo").await.expect("the VMI");
        (v.spec.volumes, v.spec.domain.devices.disks)
    };
    // A spec with no volumes or disks yet, then with empty lists: both patched.
    for _ in 0..2 {
        assert_eq!(
            volume(&c, "vmi", "solo", "add", add_pvc("data", "claim1"))
                .await
                .0,
            202
        );
        let (volumes, disks) = lists().await;
        assert_eq!(
            (
                volumes.len(),
                volumes[0].name.as_str(),
                disks[0].name.as_str()
            ),
            (1, "data", "data")
        );
        assert_eq!(
            volume(&c, "vmi", "solo", "remove", remove.clone()).await.0,
            202
        );
        let (volumes, disks) = lists().await;
        assert!(
            volumes.is_empty() && disks.is_empty(),
            "{volumes:?} {disks:?}"
        );
    }
    vmis.patch(
        "solo",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .expect("the VMI ends");
    assert_eq!(
        volume(&c, "vmi", "solo", "add", add_pvc("data", "claim1")).await,
        (
            409,
            "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"solo\": VMI is not running".to_owned()
        )
    );

    // virt-api's SubjectAccessReview names the volume subresources.
    let front_proxy = c.virt_api_direct(true);
    let nobody = [
        ("X-Remote-User", "nobody"),
        ("X-Remote-Group", "system:authenticated"),
    ];
    for path in [
        vm_path("demo", "addvolume"),
        vmi_path("solo", "removevolume"),
    ] {
        let r = front_proxy
            .request("PUT", &path, &nobody, Some(remove.clone()))
            .await
            .expect("request");
        let sub = path.rsplit('/').take(3).collect::<Vec<_>>();
        let named = format!("{}/{}", sub[2], sub[0]);
        assert_eq!(r.status, 403, "{}", r.text());
        assert!(r.message().contains(&named), "{named}: {}", r.text());
    }

    // The deprecated gate lets a VM's VMI be patched directly; with neither gate nothing is.
    let kubevirts: Api<api::KubeVirt> = Api::namespaced(c.client.clone(), common::KUBEVIRT_NS);
    let gates = |enabled: Value| {
        json!({"spec": {"configuration": {"developerConfiguration": {
            "featureGates": enabled,
            "disabledFeatureGates": ["DeclarativeHotplugVolumes"],
        }}}})
    };
    let mut kv = gates(json!(["HotplugVolumes"]));
    kv["apiVersion"] = json!("kubevirt.io/v1");
    kv["kind"] = json!("KubeVirt");
    kv["metadata"] = json!({"name": "kubevirt", "namespace": common::KUBEVIRT_NS});
    kubevirts
        .create(
            &PostParams::default(),
            &serde_json::from_value(kv).expect("KubeVirt"),
        )
        .await
        .expect("create the KubeVirt CR");
    let mut dry = add_pvc("data", "claim1");
    dry["dryRun"] = json!(["All"]);
    common::wait_for("virt-api reads HotplugVolumes", || async {
        volume(&c, "vmi", "demo", "add", dry.clone()).await.0 == 202
    })
    .await;
    kubevirts
        .patch(
            "kubevirt",
            &PatchParams::default(),
            &Patch::Merge(gates(json!([]))),
        )
        .await
        .expect("no hotplug gate");
    common::wait_for("virt-api reads no hotplug gate", || async {
        volume(&c, "vm", "demo", "add", dry.clone()).await
            == (400, virtapi::volumes::HOTPLUG_NOT_ENABLED.to_owned())
    })
    .await;
}

/// KubeVirt's webhook configurations (`manifests/install/55-virt-api-webhooks.yaml`) with the
/// CA of virt-api's certificate: kube-apiserver reaches them through the same EndpointSlice.
async fn install_webhooks(c: &Cluster) {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/install/55-virt-api-webhooks.yaml"),
    )
    .expect("the webhooks manifest");
    let ca = || Some(ByteString(c.certs.ca_pem.as_bytes().to_vec()));
    for doc in text.split("\n---\n") {
        let v: Value = serde_saphyr::from_str(doc).expect("YAML");
        match v["kind"].as_str() {
            Some("MutatingWebhookConfiguration") => {
                let mut m: MutatingWebhookConfiguration =
                    serde_json::from_value(v).expect("mutating");
                for w in m.webhooks.iter_mut().flatten() {
                    w.client_config.ca_bundle = ca();
                }
                Api::all(c.client.clone())
                    .create(&PostParams::default(), &m)
                    .await
                    .expect("create the mutating webhooks");
            }
            Some("ValidatingWebhookConfiguration") => {
                let mut m: ValidatingWebhookConfiguration =
                    serde_json::from_value(v).expect("validating");
                for w in m.webhooks.iter_mut().flatten() {
                    w.client_config.ca_bundle = ca();
                }
                Api::all(c.client.clone())
                    .create(&PostParams::default(), &m)
                    .await
                    .expect("create the validating webhooks");
            }
            other => panic!("unexpected document {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_webhooks_default_and_validate_vmis() {
    let c = Cluster::start().await;
    install_webhooks(&c).await;
    let vmis: Api<api::VirtualMachineInstance> = Api::namespaced(c.client.clone(), NS);
    let minimal: api::VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "minimal", "namespace": NS},
        "spec": {"domain": {"devices": {"disks": [{"name": "data", "disk": {}}]},
                 "memory": {"guest": "64Mi"}},
                 "volumes": [{"name": "data", "emptyDisk": {"capacity": "16Mi"}}]}
    }))
    .expect("VMI");
    // kube-apiserver's webhook clients notice new configurations within moments.
    // kube-apiserver's webhook clients notice new configurations within moments: until then a
    // VMI is stored as sent.
    let deadline = std::time::Instant::now() + common::WAIT;
    let stored = loop {
        let mut v = minimal.clone();
        v.metadata.name = Some(format!("minimal-{}", uuid::Uuid::new_v4().simple()));
        let created = vmis
            .create(&PostParams::default(), &v)
            .await
            .expect("a minimal VMI is accepted");
        if created
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| !f.is_empty())
        {
            break created;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the mutating webhook is never called"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let stored = serde_json::to_value(stored).expect("JSON");
    let spec = &stored["spec"];
    assert_eq!(spec["domain"]["devices"]["disks"][0]["disk"]["bus"], "sata");
    assert_eq!(spec["domain"]["machine"]["type"], "q35");
    assert_eq!(
        spec["domain"]["devices"]["interfaces"][0]["name"],
        "default"
    );
    assert_eq!(spec["networks"][0]["pod"], json!({}));
    assert!(
        stored["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| f
                .iter()
                .any(|f| f == "kubevirt.io/foregroundDeleteVirtualMachine")),
        "{stored:#}"
    );

    let bad: api::VirtualMachineInstance = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": {"domain": {"devices": {"disks": [{"name": "nope", "disk": {}}]},
                 "memory": {"guest": "64Mi"}}}
    }))
    .expect("VMI");
    match vmis.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            assert!(
                s.message.contains("spec.domain.devices.disks[0].name"),
                "{s:?}"
            );
        }
        other => panic!("an invalid VMI is refused: {other:?}"),
    }
}
