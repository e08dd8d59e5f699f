//! The guest-agent client against qemu-ga in the real test guest (hack/guest/build.sh), booted
//! under TCG. Test names start with `guest_` so nextest bounds how many boot at once.

mod common;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Qemu, init_tracing};
use qmp::qapi::qga;
use qmp::{AgentOptions, ConnectOptions, GuestAgent, QmpClient};

/// TCG on a loaded two-core machine: generous.
const BOOT_DEADLINE: Duration = Duration::from_mins(3);

fn agent(qemu: &Qemu) -> GuestAgent {
    GuestAgent::new(qemu.path("qga.sock"), AgentOptions::default())
}

/// Poll `guest-sync` until the agent in the guest answers.
async fn wait_for_agent(agent: &GuestAgent, qemu: &Qemu) {
    let deadline = Instant::now() + BOOT_DEADLINE;
    loop {
        match agent.sync(Duration::from_secs(3)).await {
            Ok(()) => return,
            Err(err) if Instant::now() < deadline => {
                tracing::debug!(%err, "agent not answering yet");
            }
            Err(err) => panic!(
                "the guest agent did not answer within {BOOT_DEADLINE:?}: {err}\nconsole:\n{}",
                std::fs::read_to_string(qemu.path("console.log")).unwrap_or_default()
            ),
        }
    }
}

#[tokio::test]
async fn guest_agent_answers_typed_queries() {
    init_tracing();
    let qemu = Qemu::boot_guest("q35");
    let agent = agent(&qemu);
    wait_for_agent(&agent, &qemu).await;

    agent.ping().await.unwrap();
    let info = agent.info().await.unwrap();
    assert!(info.version.starts_with("7."), "{info:?}");
    assert!(
        info.supported_commands
            .iter()
            .any(|c| c.name == "guest-get-osinfo" && c.enabled),
        "{info:?}"
    );
    let os = agent.osinfo().await.unwrap();
    assert!(
        os.kernel_release.as_deref().unwrap_or("").contains("amd64"),
        "{os:?}"
    );
    assert_eq!(os.machine.as_deref(), Some("x86_64"), "{os:?}");
    let host = agent.host_name().await.unwrap();
    assert!(!host.is_empty());
    let interfaces = agent.network_interfaces().await.unwrap();
    assert!(interfaces.iter().any(|i| i.name == "lo"), "{interfaces:?}");
    agent.users().await.unwrap();
    agent.fsinfo().await.unwrap();
    let guest_ns = agent.time().await.unwrap();
    let host_ns = i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    )
    .unwrap();
    // The guest's RTC starts from the host clock; a day is slack for any reasonable skew.
    assert!(
        (host_ns - guest_ns).abs() < 86_400 * 1_000_000_000,
        "guest {guest_ns} host {host_ns}"
    );
    agent.timezone().await.unwrap();

    assert_eq!(
        agent.fsfreeze_status().await.unwrap(),
        qga::GuestFsfreezeStatus::thawed
    );
    let frozen = agent.fsfreeze_freeze().await.unwrap();
    // The initramfs has nothing to freeze, and qemu-ga 7.2 leaves the frozen state when it
    // froze nothing.
    let expected = if frozen > 0 {
        qga::GuestFsfreezeStatus::frozen
    } else {
        qga::GuestFsfreezeStatus::thawed
    };
    assert_eq!(agent.fsfreeze_status().await.unwrap(), expected);
    assert_eq!(agent.fsfreeze_thaw().await.unwrap(), frozen);
    assert_eq!(
        agent.fsfreeze_status().await.unwrap(),
        qga::GuestFsfreezeStatus::thawed
    );

    let err = agent
        .execute_raw(
            "guest-no-such-command",
            serde_json::Value::Null,
            Duration::from_secs(10),
        )
        .await
        .unwrap_err();
    assert_eq!(err.command_class(), Some("CommandNotFound"), "{err}");
    // The error left the channel usable.
    assert_eq!(agent.host_name().await.unwrap(), host);
}

#[tokio::test]
async fn guest_timed_out_calls_and_reconnects_do_not_confuse_replies() {
    init_tracing();
    let qemu = Qemu::boot_guest("q35");
    let agent = agent(&qemu);
    wait_for_agent(&agent, &qemu).await;
    let host = agent.host_name().await.unwrap();

    // A reply cannot cross the virtio-serial port and TCG within a millisecond, so these time
    // out and their replies arrive later, in front of the next call's.
    let mut timeouts = 0;
    for _ in 0..5 {
        match agent
            .execute_with_timeout(qga::guest_get_osinfo {}, Duration::from_millis(1))
            .await
        {
            Err(err) if err.is_timeout() => timeouts += 1,
            Err(err) => panic!("{err}"),
            Ok(_) => {}
        }
        // A stale osinfo reply taken for this call would not decode as a host name.
        assert_eq!(agent.host_name().await.unwrap(), host);
    }
    assert!(timeouts > 0, "no call timed out; the test proved nothing");

    // A new host connection (as after a launcher restart) resynchronises too.
    let late = agent.execute_with_timeout(qga::guest_get_users {}, Duration::from_millis(1));
    assert!(late.await.is_err());
    drop(agent);
    let fresh = GuestAgent::new(qemu.path("qga.sock"), AgentOptions::default());
    assert_eq!(fresh.host_name().await.unwrap(), host);
}

#[tokio::test]
async fn guest_shutdown_through_the_agent_powers_the_vm_off() {
    init_tracing();
    let mut qemu = Qemu::boot_guest("pc");
    let qmp = QmpClient::connect(qemu.qmp(), &ConnectOptions::default())
        .await
        .unwrap();
    let mut events = qmp.events();
    let agent = agent(&qemu);
    wait_for_agent(&agent, &qemu).await;

    agent
        .shutdown(Some(qga::GuestShutdownMode::Powerdown))
        .await
        .unwrap();
    let shutdown = events
        .wait_for(BOOT_DEADLINE, |e| e.name == "SHUTDOWN")
        .await
        .unwrap();
    match shutdown.typed() {
        Some(qmp::qapi::qmp::Event::SHUTDOWN { data, .. }) => assert!(data.guest, "{data:?}"),
        other => panic!("SHUTDOWN did not decode: {other:?}"),
    }
    tokio::time::timeout(BOOT_DEADLINE, qmp.closed())
        .await
        .unwrap();
    let deadline = Instant::now() + BOOT_DEADLINE;
    while qemu.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "QEMU did not exit");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
