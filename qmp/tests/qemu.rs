//! The QMP client against a real QEMU 7.2.

mod common;

use std::time::Duration;

use common::{Qemu, init_tracing};
use qmp::qapi::qmp as cmd;
use qmp::{ConnectOptions, QmpClient};
use serde_json::json;

async fn connect(qemu: &Qemu) -> QmpClient {
    QmpClient::connect(qemu.qmp(), &ConnectOptions::default())
        .await
        .expect("connect to QMP")
}

#[tokio::test]
async fn connects_reads_greeting_and_queries_status() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let version = client.version();
    assert!(version.major >= 7, "version {version:?}");
    assert!(version.at_least(7, 0));
    let status = client.execute(cmd::query_status {}).await.unwrap();
    assert!(matches!(
        status.status,
        cmd::RunState::running | cmd::RunState::prelaunch
    ));
    let ver = client.execute(cmd::query_version {}).await.unwrap();
    assert_eq!(ver.qemu.major, i64::from(version.major));
}

#[tokio::test]
async fn pause_and_resume_emit_events() {
    init_tracing();
    let qemu = Qemu::q35_paused();
    let (client, mut events) =
        QmpClient::connect_with_events(qemu.qmp(), &ConnectOptions::default())
            .await
            .unwrap();
    let status = client.execute(cmd::query_status {}).await.unwrap();
    assert_eq!(status.status, cmd::RunState::prelaunch);
    client.execute(cmd::cont {}).await.unwrap();
    let resume = events
        .wait_for(Duration::from_secs(30), |e| e.name == "RESUME")
        .await
        .unwrap();
    assert!(matches!(resume.typed(), Some(cmd::Event::RESUME { .. })));
    client.execute(cmd::stop {}).await.unwrap();
    events
        .wait_for(Duration::from_secs(30), |e| e.name == "STOP")
        .await
        .unwrap();
    let status = client.execute(cmd::query_status {}).await.unwrap();
    assert_eq!(status.status, cmd::RunState::paused);
}

#[tokio::test]
async fn command_errors_are_reported_and_the_connection_survives() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let err = client
        .execute_raw("no-such-command", serde_json::Value::Null)
        .await
        .unwrap_err();
    assert_eq!(err.command_class(), Some("CommandNotFound"), "{err}");
    assert!(err.to_string().contains("no-such-command"), "{err}");
    let err = client
        .execute(cmd::device_del { id: "nope".into() })
        .await
        .unwrap_err();
    assert!(err.command_class().is_some(), "{err}");
    let raw = client.execute_raw("query-status", json!({})).await.unwrap();
    assert!(raw.get("status").is_some());
}

#[tokio::test]
async fn quit_closes_the_connection_and_fails_later_calls() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let mut events = client.events();
    client.execute(cmd::quit {}).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), client.closed())
        .await
        .expect("closed() resolves after quit");
    assert!(client.is_closed());
    // SHUTDOWN may or may not be read before the socket closes; then the stream must end.
    loop {
        match events.recv().await {
            Ok(_) => {}
            Err(qmp::RecvError::Closed) => break,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    let err = client.execute(cmd::query_status {}).await.unwrap_err();
    assert!(err.is_disconnected(), "{err}");
}

#[tokio::test]
async fn connect_waits_for_a_socket_that_appears_late() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("late.sock");
    let connecting = tokio::spawn({
        let sock = sock.clone();
        async move { QmpClient::connect(&sock, &ConnectOptions::default()).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _qemu = Qemu::spawn_with_socket(&["-machine", "none"], sock.clone());
    let client = connecting
        .await
        .unwrap()
        .expect("connect after the socket appeared");
    client.execute(cmd::query_status {}).await.unwrap();
}

#[tokio::test]
async fn connect_gives_up_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let options = ConnectOptions {
        connect_timeout: Duration::from_millis(200),
        ..ConnectOptions::default()
    };
    let err = QmpClient::connect(dir.path().join("never.sock"), &options)
        .await
        .unwrap_err();
    assert!(matches!(err, qmp::Error::Connect { .. }), "{err}");
    assert!(err.to_string().contains("never.sock"), "{err}");
}

#[tokio::test]
async fn getfd_passes_a_descriptor_that_qemu_can_use() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let file = std::fs::File::create(qemu.path("passed")).unwrap();
    client.getfd("passed0", &file).await.unwrap();
    // QEMU knows the name now: closing it succeeds, closing it twice fails.
    client
        .execute(cmd::closefd {
            fdname: "passed0".into(),
        })
        .await
        .unwrap();
    let err = client
        .execute(cmd::closefd {
            fdname: "passed0".into(),
        })
        .await
        .unwrap_err();
    assert!(err.command_class().is_some(), "{err}");
    // Without a descriptor attached, getfd is refused.
    let err = client
        .execute(cmd::getfd {
            fdname: "none".into(),
        })
        .await
        .unwrap_err();
    assert!(err.command_class().is_some(), "{err}");
}

#[tokio::test]
async fn concurrent_fd_passing_keeps_descriptors_with_their_commands() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..8 {
        let file = std::fs::File::create(qemu.path(&format!("f{i}"))).unwrap();
        let client = client.clone();
        tasks.spawn(async move {
            let add = cmd::add_fd {
                fdset_id: None,
                opaque: Some(format!("f{i}")),
            };
            client
                .execute_with_fds(add, &[file], Duration::from_secs(30))
                .await
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    // Each descriptor QEMU holds must be the file its command named.
    let pid = qemu.child.id();
    let fdsets = client.execute(cmd::query_fdsets {}).await.unwrap();
    let fds: Vec<_> = fdsets.iter().flat_map(|set| &set.fds).collect();
    assert_eq!(fds.len(), 8);
    for fd in fds {
        let target = std::fs::read_link(format!("/proc/{pid}/fd/{}", fd.fd)).unwrap();
        let opaque = fd.opaque.as_deref().unwrap();
        assert_eq!(target, qemu.path(opaque), "fd {} ({opaque})", fd.fd);
    }
}

#[tokio::test]
async fn compat_types_decode_what_the_schema_cannot() {
    init_tracing();
    let qemu = Qemu::spawn(&[
        "-M",
        "q35",
        "-accel",
        "tcg",
        "-S",
        "-m",
        "128",
        "-drive",
        "if=none,id=d0,file=/dev/null,format=raw,readonly=on",
        "-device",
        "virtio-blk-pci,drive=d0,id=vd0",
    ]);
    let client = connect(&qemu).await;
    let machines = client
        .execute(qmp::compat::query_machines {})
        .await
        .unwrap();
    assert!(
        machines.iter().any(|m| m.alias.as_deref() == Some("q35")),
        "{machines:?}"
    );
    let stats = client
        .execute(qmp::compat::query_blockstats::default())
        .await
        .unwrap();
    let d0 = stats
        .iter()
        .find(|s| s.device.as_deref() == Some("d0"))
        .unwrap();
    assert_eq!(d0.stats.wr_bytes, 0);
    let caps = client
        .execute(qmp::compat::query_migrate_capabilities {})
        .await
        .unwrap();
    assert!(
        caps.iter().any(|c| c.capability == "auto-converge"),
        "{caps:?}"
    );
}

#[tokio::test]
async fn many_concurrent_callers_each_get_their_own_reply() {
    init_tracing();
    let qemu = Qemu::machine_none();
    let client = connect(&qemu).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..32 {
        let client = client.clone();
        tasks.spawn(async move {
            for _ in 0..20 {
                // Alternate commands with different reply shapes, so a misrouted reply fails to
                // decode.
                if i % 2 == 0 {
                    client.execute(cmd::query_status {}).await.map(drop)?;
                } else {
                    client.execute(cmd::query_version {}).await.map(drop)?;
                }
            }
            Ok::<_, qmp::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
}
