//! The bad-input cases, through the command API: each gets a clear error with a code,
//! the domain state says what went wrong, nothing panics, and the launcher keeps answering.

mod common;

use std::time::Duration;

use common::{Launcher, uid, vmi};
use serde_json::{Value, json};

fn kernel_spec() -> Value {
    json!({
        "domain": {
            "resources": {"requests": {"memory": "128Mi"}},
            "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                "image": "guest", "kernelPath": "/boot/vmlinuz"}}},
            "devices": {"disks": [{"name": "root", "disk": {}}]},
        },
        "volumes": [{"name": "root", "containerDisk": {"image": "x"}}],
    })
}

fn expect_error(l: &Launcher, v: &Value, status: u16, code: &str, mentions: &[&str]) {
    let (got, e) = l.sync(v);
    assert_eq!(got, status, "{e}");
    assert_eq!(e["code"], code, "{e}");
    let msg = e["message"].as_str().unwrap();
    for m in mentions {
        assert!(msg.contains(m), "{msg:?} should mention {m:?}");
    }
    let d = l.domain();
    assert_eq!(d["state"], "NoState", "{d}");
    assert_eq!(d["reason"], "FailedSync");
    assert_eq!(d["message"], msg);
}

#[test]
fn bad_vmis_get_clear_errors_and_leave_the_launcher_usable() {
    let l = Launcher::start_with(&["--keep-after-shutdown"], |root| {
        std::fs::create_dir_all(root.join("container-disks/kernel-boot")).unwrap();
        // A qcow2 header with garbage after it.
        let mut corrupt = b"QFI\xfb".to_vec();
        corrupt.extend([0xffu8; 1020]);
        std::fs::write(root.join("container-disks/disk_0.img"), corrupt).unwrap();
    });
    let id = uid();

    let mut missing_volume = kernel_spec();
    missing_volume["volumes"] = json!([]);
    expect_error(
        &l,
        &vmi("bad", &id, missing_volume),
        422,
        "InvalidVMI",
        &[
            "spec.domain.devices.disks[0].name",
            "no volume named \"root\"",
        ],
    );

    let mut usb = kernel_spec();
    usb["domain"]["devices"]["disks"][0]["disk"]["bus"] = "usb".into();
    expect_error(
        &l,
        &vmi("bad", &id, usb),
        422,
        "InvalidVMI",
        &["disks[0].disk.bus", "usb"],
    );

    expect_error(
        &l,
        &vmi("bad", &id, kernel_spec()),
        422,
        "PrepareFailed",
        &["kernelPath", "kernel-boot/vmlinuz", "does not exist"],
    );

    let mut corrupt = kernel_spec();
    corrupt["domain"]["firmware"] = json!({});
    expect_error(
        &l,
        &vmi("bad", &id, corrupt),
        422,
        "PrepareFailed",
        &["spec.volumes[0].containerDisk", "disk_0.img"],
    );

    let (status, e) = l.request("PUT", "/v1/sync", Some(&json!({"spec": 42})));
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["code"], "BadRequest");

    let (status, e) = l.request("POST", "/v1/pause", None);
    assert_eq!(status, 404, "{e}");
    assert_eq!(e["code"], "NoDomain");
    let (status, e) = l.request("GET", "/v1/guest/osinfo", None);
    assert_eq!(status, 404, "{e}");
    let (status, e) = l.request("GET", "/v1/domain/blockstats", None);
    assert_eq!(status, 404, "{e}");
    assert_eq!(e["code"], "NoDomain");
    let (status, e) = l.request("GET", "/v1/nope", None);
    assert_eq!(status, 400, "{e}");

    // The launcher is still healthy and answers.
    assert_eq!(l.get("/v1/ping"), json!({}));
    let info = l.get("/v1/info");
    assert_eq!(info["qemuBinary"], "qemu-system-x86_64");
    assert!(!l.log().contains("panicked"));
}

#[test]
fn missing_qemu_binary_is_reported() {
    let l = Launcher::start(&["--qemu-binary", "/nonexistent/qemu-system-x86_64"]);
    let (status, e) = l.sync(&vmi(
        "noqemu",
        &uid(),
        json!({
            "domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {}},
        }),
    ));
    assert_eq!(status, 500, "{e}");
    assert_eq!(e["code"], "QemuStartFailed");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/qemu-system-x86_64")
    );
    assert_eq!(l.domain()["reason"], "FailedSync");
}

#[test]
fn unwritable_socket_directory_stops_the_launcher_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_virt-launcher"))
        .arg("--kubevirt-share-dir")
        .arg(&file)
        .arg("--private-dir")
        .arg(dir.path().join("p"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot create the command socket"), "{err}");
    assert!(err.contains("not-a-dir/sockets/launcher-sock"), "{err}");
}

#[test]
fn ready_means_the_socket_exists_and_answers() {
    let l = Launcher::start(&[]);
    assert_eq!(l.get("/v1/ping"), json!({}));
    let d = l.domain();
    assert_eq!(d["state"], "NoState");
    // The watch stream opens with the current state.
    let lines = common::watch_until(&l.socket, Duration::from_secs(10), |d| {
        d["state"] == "NoState"
    });
    assert_eq!(lines[0]["state"], "NoState");
}

/// A second sync with another uid: refused with 409 before a domain exists (`--uid` names the
/// VMI) and while one runs, said in the domain state, and the running QEMU is left alone.
/// QEMU runs SeaBIOS with nothing to boot: enough to have a running domain, cheap under TCG.
#[test]
fn guest_second_sync_with_another_uid_keeps_the_running_domain() {
    let id = uid();
    let l = Launcher::start(&["--uid", &id, "--keep-after-shutdown"]);
    let spec = json!({
        "domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {}},
    });
    let foreign = uid();
    let (status, e) = l.sync(&vmi("other", &foreign, spec.clone()));
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["code"], "UIDMismatch");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(&id) && msg.contains(&foreign), "{msg}");
    let d = l.domain();
    assert_eq!(d["state"], "NoState", "{d}");
    assert_eq!(d["reason"], "FailedSync");
    assert_eq!(d["message"], msg);

    let (status, d) = l.sync(&vmi("mine", &id, spec.clone()));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert_eq!(d["state"], "Running");
    assert!(d.get("message").is_none(), "{d}");
    let pid = d["qemuPid"].as_i64().unwrap();

    let (status, e) = l.sync(&vmi("other", &foreign, spec));
    assert_eq!(status, 409, "{e}");
    assert_eq!(e["code"], "UIDMismatch");
    let d = l.domain();
    assert_eq!(d["state"], "Running", "{d}");
    assert_eq!(d["qemuPid"], pid);
    assert_eq!(d["uid"], id.as_str());
    assert_eq!(d["syncError"], e["message"]);
    assert!(common::process_alive(pid));
    let d = l.post("/v1/kill");
    assert_eq!(d["state"], "Shutoff", "{d}");
}

/// A sync whose client goes away while QEMU starts (a virt-handler killed mid-request) still
/// records the QEMU it starts: the domain runs it, and the next sync answers with that QEMU
/// instead of starting another beside it.
#[test]
fn guest_a_sync_whose_client_goes_away_still_owns_its_qemu() {
    use std::io::Write as _;
    let id = uid();
    let l = Launcher::start(&["--uid", &id]);
    let spec = json!({
        "domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {}},
    });
    let body = serde_json::to_vec(&vmi("gone", &id, spec.clone())).unwrap();
    let mut client = std::os::unix::net::UnixStream::connect(&l.socket).unwrap();
    write!(
        client,
        "PUT /v1/sync HTTP/1.1\r\nHost: launcher\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    client.write_all(&body).unwrap();
    // Gone once the launcher has begun (earlier, the request itself may go unread), and
    // looked at often so that it goes while QEMU starts.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while l.domain()["state"] == "NoState" {
        assert!(std::time::Instant::now() < deadline, "the sync never began");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(client);

    let d = l.wait_state("Running", common::BOOT);
    let pid = d["qemuPid"].as_i64().expect("a QEMU pid");
    let (status, d) = l.sync(&vmi("gone", &id, spec));
    assert_eq!(status, 200, "{d}\n{}", l.log());
    assert_eq!(d["qemuPid"], pid, "{d}");
    let qemus = common::qemus_with(&id);
    assert_eq!(qemus, vec![u32::try_from(pid).unwrap()], "QEMUs of the VMI");
}
