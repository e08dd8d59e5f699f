//! The launcher client against a real virt-launcher (and, for `guest_`, a real guest).

mod common;

use std::time::Duration;

use futures::StreamExt as _;
use handler::node::pod_socket;
use handler::status::{self, LauncherView, Observed, PodReady, PodView};
use launcher_api::client::{ClientError, LauncherClient};
use launcher_api::domain::DomainState;

fn client(l: &common::Launcher) -> LauncherClient {
    LauncherClient::new(&l.socket, Duration::from_secs(30))
}

#[tokio::test]
async fn typed_calls_against_a_launcher_without_a_domain() {
    let launcher = common::Launcher::start(false);
    let c = client(&launcher);
    c.ping().await.expect("ping");
    let info = c.info().await.expect("info");
    assert!(!info.launcher_version.is_empty());
    assert_eq!(info.uid, None);
    let d = c.domain().await.expect("domain");
    assert_eq!(d.state, DomainState::NoState);

    let e = c.pause().await.expect_err("nothing to pause");
    assert_eq!(e.api_code(), Some("NoDomain"), "{e}");
    assert!(!e.is_unreachable());
    let e = c.guest_osinfo().await.expect_err("no agent");
    assert_eq!(e.api_code(), Some("NoDomain"), "{e}");

    // A VMI the launcher cannot run: its error, with the field path, comes back typed.
    let mut bad = common::kernel_vmi("bad", "11111111-1111-1111-1111-111111111111");
    bad.spec.domain.devices = serde_json::from_value(serde_json::json!({
        "disks": [{"name": "root", "disk": {}}]
    }))
    .expect("devices");
    let e = c.sync(&bad).await.expect_err("a disk without a volume");
    match &e {
        ClientError::Api { status, error, .. } => {
            assert_eq!(*status, 422, "{e}");
            assert_eq!(error.code, "InvalidVMI");
            assert!(
                error.message.contains("spec.domain.devices.disks[0].name"),
                "{e}"
            );
        }
        other => panic!("expected an API error, got {other}"),
    }
    assert!(
        e.to_string().contains("launcher-sock"),
        "says which socket: {e}"
    );

    // The watch starts with the current state.
    let mut w = Box::pin(c.watch().await.expect("watch"));
    let first = w.next().await.expect("a first line").expect("a domain");
    assert_eq!(first.state, DomainState::NoState);
    assert_eq!(first.reason, "FailedSync");
}

#[tokio::test]
async fn an_absent_launcher_is_unreachable_with_the_socket_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = pod_socket(dir.path(), "pod-uid-1");
    assert!(socket.ends_with("pod-uid-1/volumes/kubernetes.io~empty-dir/sockets/launcher-sock"));
    let c = LauncherClient::new(&socket, Duration::from_secs(1));
    let e = c.ping().await.expect_err("nothing there");
    assert!(e.is_unreachable(), "{e}");
    assert!(e.to_string().contains("pod-uid-1"), "{e}");
    assert!(c.watch().await.is_err());
}

#[tokio::test]
async fn a_launcher_that_never_answers_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("launcher-sock");
    // Accepts connections and never answers: a hung launcher.
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let hung = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let c = LauncherClient::new(&socket, Duration::from_millis(300));
    let e = c.domain().await.expect_err("hung");
    assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
    assert!(e.is_unreachable());
    hung.abort();
}

fn running_pod() -> PodView {
    PodView::Running {
        ready: Some(PodReady {
            ready: true,
            reason: None,
            message: None,
        }),
    }
}

#[tokio::test]
async fn guest_watch_follows_boot_pause_agent_and_shutdown() {
    let launcher = common::Launcher::start(true);
    let c = client(&launcher);
    let uid = "22222222-2222-2222-2222-222222222222";
    let mut vmi = common::kernel_vmi("watched", uid);
    let mut w = Box::pin(c.watch().await.expect("watch"));
    assert_eq!(
        w.next().await.expect("first").expect("domain").state,
        DomainState::NoState
    );

    let d = c
        .sync(&vmi)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", launcher.log()));
    assert_eq!(d.state, DomainState::Running);
    assert_eq!(d.uid.as_deref(), Some(uid));

    // The stream reports every state up to Running, in order.
    let mut seen = Vec::new();
    while let Some(d) = w.next().await {
        let d = d.expect("domain");
        seen.push(d.state);
        if d.state == DomainState::Running {
            break;
        }
    }
    assert_eq!(seen.last(), Some(&DomainState::Running), "{seen:?}");

    // Status from the real domain: Scheduled -> Running with the Started event.
    vmi.status = Some(api::VirtualMachineInstanceStatus {
        phase: Some(api::VirtualMachineInstancePhase::Scheduled),
        ..Default::default()
    });
    let out = status::compute(
        &vmi,
        &Observed {
            launcher: LauncherView::Answering(Box::new(c.domain().await.expect("domain"))),
            pod: running_pod(),
            guest_os: None,
            guest_interfaces: None,
            sync_error: None,
            hotplug_mounted: std::collections::BTreeSet::new(),
            now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ),
        },
    );
    assert_eq!(
        out.status.phase,
        Some(api::VirtualMachineInstancePhase::Running)
    );
    assert_eq!(out.events[0].reason, "Started");

    let p = c.pause().await.expect("pause");
    assert_eq!((p.state, p.reason.as_str()), (DomainState::Paused, "User"));
    let next = w.next().await.expect("paused line").expect("domain");
    assert_eq!(next.state, DomainState::Paused);
    c.unpause().await.expect("unpause");

    // The guest agent comes up with the guest; then its data is there.
    let deadline = tokio::time::Instant::now() + common::BOOT;
    loop {
        if c.domain().await.expect("domain").agent_connected {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "agent never connected\n{}",
            launcher.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let info = c.guest_info().await.expect("guest info");
    assert!(!info.version.is_empty());
    assert!(
        info.supported_commands
            .iter()
            .any(|c| c.name == "guest-ping")
    );
    let os = c.guest_osinfo().await.expect("osinfo");
    assert!(os.kernel_release.is_some(), "{os:?}");
    c.guest_users().await.expect("users");
    let fs = c.guest_filesystems().await.expect("filesystems");
    assert!(fs.iter().all(|f| !f.mountpoint.is_empty()));

    // ACPI power-down: the guest powers off, the watch ends on the final state.
    c.shutdown().await.expect("shutdown");
    let mut last = None;
    let ended = tokio::time::timeout(common::BOOT, async {
        while let Some(d) = w.next().await {
            last = Some(d.expect("domain"));
        }
    })
    .await;
    assert!(ended.is_ok(), "watch did not end\n{}", launcher.log());
    let last = last.expect("a final state");
    assert_eq!(
        (last.state, last.reason.as_str()),
        (DomainState::Shutoff, "Shutdown")
    );
}
