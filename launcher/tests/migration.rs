//! Live migration between two launchers on this machine, a real guest under TCG. The test joins
//! the two launchers' migration sockets with symlinks where virt-handler's proxy would carry
//! them across nodes (the handler's tests cover the proxy).

mod common;

use std::time::Duration;

use common::{BOOT, Launcher, uid, vmi, wait_until};
use serde_json::{Value, json};
use testguest::Console;

const STREAMS: [&str; 2] = ["share/sockets/mig-mem", "share/sockets/mig-nbd"];

fn start_launcher() -> Launcher {
    Launcher::start_with(&[], |root| {
        common::place_kernel(root);
        common::place_container_disk(root, 0);
    })
}

fn spec() -> Value {
    json!({
        "domain": {
            "machine": {"type": "q35"},
            "resources": {"requests": {"memory": "256Mi"}},
            "firmware": {"kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                "image": "guest", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}},
            "devices": {"disks": [
                {"name": "cdisk", "disk": {"bus": "virtio"}, "serial": "CDISK1"},
                {"name": "scratch", "disk": {"bus": "virtio"}, "serial": "EMPTY1"},
                {"name": "ci", "disk": {"bus": "virtio"}},
            ]},
        },
        "volumes": [
            {"name": "cdisk", "containerDisk": {"image": "guest"}},
            {"name": "scratch", "emptyDisk": {"capacity": "64Mi"}},
            {"name": "ci", "cloudInitNoCloud": {"userData": "#!/bin/sh\ntrue\n"}},
        ],
    })
}

/// The target's sockets, reached from the source's share dir where QEMU looks for them.
fn join_streams(source: &Launcher, target: &Launcher) {
    for s in STREAMS {
        let at = source.dir(s);
        let _ = std::fs::remove_file(&at);
        std::os::unix::fs::symlink(target.dir(s), &at).unwrap();
    }
}

fn prepare_target(target: &Launcher, migration: &str, v: &Value) -> Value {
    let body = json!({"migrationUid": migration, "vmi": v, "copyDisks": ["cdisk", "scratch"],
                      "allowPostCopy": false});
    let (status, d) = target.request("PUT", "/v1/migration/target", Some(&body));
    assert_eq!(status, 200, "{d}\n{}", target.log());
    d
}

fn migrate(source: &Launcher, migration: &str, bandwidth: u64) -> Value {
    let body = json!({"migrationUid": migration, "copyDisks": ["cdisk", "scratch"],
                      "bandwidth": bandwidth, "completionTimeoutPerGib": 150,
                      "progressTimeout": 150, "allowAutoConverge": false, "allowPostCopy": false});
    let (status, d) = source.request("POST", "/v1/migration/start", Some(&body));
    assert_eq!(status, 200, "{d}\n{}", source.log());
    d
}

fn scratch_device(console: &mut Console) -> String {
    console.run(
        "for b in /sys/block/vd*; do [ \"$(cat $b/serial)\" = EMPTY1 ] && echo /dev/${b##*/}; done",
        BOOT,
    )
}

fn uptime(console: &mut Console) -> f64 {
    let said = console.run("cut -d' ' -f1 /proc/uptime", BOOT);
    said.parse()
        .unwrap_or_else(|e| panic!("the guest's uptime {said:?}: {e}"))
}

fn migration_of(d: &Value) -> &Value {
    &d["migration"]
}

/// A running guest moves with its disks' writes and its memory: the uptime goes on, a block
/// written to the emptyDisk before is read back from the target's disk after (page cache
/// dropped), the source's domain ends `Shutoff`/`Migrated` and its launcher exits. Then a
/// migration from the new home, throttled so it cannot finish, is cancelled: the guest runs on
/// where it was and the would-be target's QEMU gives up.
#[test]
fn guest_live_migration_completes_and_a_cancelled_one_leaves_the_guest_running() {
    let mut source = start_launcher();
    let id = uid();
    let v = vmi("mig", &id, spec());
    let (status, d) = source.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", source.log());
    source.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let mut console = Console::connect(&source.vm_dir(&id).join("virt-serial0"));
    let dev = scratch_device(&mut console);
    assert!(dev.starts_with("/dev/vd"), "{dev:?}");
    console.run(
        &format!("echo MIGRATION-PAYLOAD | dd of={dev} bs=512 count=1 conv=fsync 2>/dev/null"),
        BOOT,
    );
    let before = uptime(&mut console);

    let target = start_launcher();
    let d = prepare_target(&target, "m-1", &v);
    assert_eq!(d["state"], "Paused", "{d}");
    assert_eq!(d["reason"], "Migration");
    assert_eq!(migration_of(&d)["role"], "Target");
    assert_eq!(migration_of(&d)["phase"], "Preparing");
    join_streams(&source, &target);

    let source_qemu = source.domain()["qemuPid"].as_i64().unwrap();
    let d = migrate(&source, "m-1", 0);
    assert_eq!(migration_of(&d)["role"], "Source", "{d}");
    let socket = source.socket.clone();
    let lines = common::watch_until(&socket, BOOT, |d: &Value| d["state"] == "Shutoff");
    let last = lines.last().unwrap();
    assert_eq!(last["reason"], "Migrated", "{last}\n{}", source.log());
    let m = migration_of(last);
    assert_eq!(m["phase"], "Completed", "{m}");
    assert!(m["totalTimeMs"].as_u64().unwrap() > 0, "{m}");
    assert!(m["downtimeMs"].is_u64(), "{m}");
    assert!(m["memoryTotal"].as_u64().unwrap() >= 256 << 20, "{m}");
    assert!(m["disksTotal"].as_u64().unwrap() > 0, "{m}");
    assert!(source.wait_exit(Duration::from_secs(30)).success());
    assert!(!common::process_alive(source_qemu));

    let d = wait_until(BOOT, "the target's state is in", || {
        let d = target.domain();
        (migration_of(&d)["phase"] == "Completed").then_some(d)
    });
    assert_eq!(d["state"], "Paused", "resumes only when told: {d}");
    let d = target.post("/v1/migration/finish");
    assert_eq!(d["state"], "Running", "{d}");
    assert_eq!(d["reason"], "Migrated");
    // Asked again (virt-handler retries when its status write failed): the same answer.
    let again = target.post("/v1/migration/finish");
    assert_eq!(
        (&again["state"], &again["reason"]),
        (&d["state"], &d["reason"])
    );

    let mut console = Console::connect(&target.vm_dir(&id).join("virt-serial0"));
    let after = uptime(&mut console);
    assert!(after > before, "uptime went from {before} to {after}");
    let read = console.run(
        &format!(
            "echo 3 > /proc/sys/vm/drop_caches; dd if={dev} bs=512 count=1 2>/dev/null | head -c 17"
        ),
        BOOT,
    );
    // The kernel logs the cache drop on the console too.
    assert_eq!(read.lines().last(), Some("MIGRATION-PAYLOAD"), "{read}");

    // Throttled to 1 MiB/s, 256 MiB would take minutes: cancelled while it runs.
    let third = start_launcher();
    prepare_target(&third, "m-2", &v);
    join_streams(&target, &third);
    migrate(&target, "m-2", 1 << 20);
    wait_until(BOOT, "the memory on its way", || {
        let d = target.domain();
        (migration_of(&d)["phase"] == "Running"
            && migration_of(&d)["memoryTransferred"].as_u64() > Some(0))
        .then_some(())
    });
    let (status, e) = target.request(
        "POST",
        "/v1/migration/start",
        Some(&json!({
        "migrationUid": "m-3", "copyDisks": [], "completionTimeoutPerGib": 150,
        "progressTimeout": 150, "allowAutoConverge": false, "allowPostCopy": false})),
    );
    assert_eq!(
        (status, e["code"].as_str()),
        (409, Some("MigrationFailed")),
        "{e}"
    );
    let third_watch = common::Watch::open(&third.socket, BOOT);
    let third_end =
        std::thread::spawn(move || third_watch.until(BOOT, |d: &Value| d["state"] == "Shutoff"));
    target.post("/v1/migration/cancel");
    let d = wait_until(BOOT, "the migration aborted", || {
        let d = target.domain();
        migration_of(&d)["phase"]
            .as_str()
            .is_some_and(|p| p != "Running" && p != "Preparing")
            .then_some(d)
    });
    assert_eq!(migration_of(&d)["phase"], "Aborted", "{d}");
    assert_eq!(migration_of(&d)["failure"], "canceled on request");
    assert_eq!(d["state"], "Running", "{d}");
    assert_eq!(console.run("echo still-here", BOOT), "still-here");
    let lines = third_end.join().unwrap();
    let d = lines.last().unwrap();
    assert_eq!(d["reason"], "FailedMigration", "{d}");
}

/// Persistent EFI variables move with the guest: the target launcher's store (on the claim
/// KubeVirt makes for the target when the VMI's is not shared) starts as a fresh template copy,
/// and once the guest resumes there it holds what OVMF wrote on the source, as QEMU writes the
/// migrated flash back to its file.
#[test]
fn guest_persistent_efi_variables_move_with_the_guest() {
    let source_nvram = tempfile::tempdir().unwrap();
    let target_nvram = tempfile::tempdir().unwrap();
    let launcher = |nvram: &tempfile::TempDir| {
        Launcher::start_with(
            &["--nvram-dir", nvram.path().to_str().unwrap()],
            common::place_kernel,
        )
    };
    let source = launcher(&source_nvram);
    let id = uid();
    let v = vmi(
        "efi",
        &id,
        json!({
            "domain": {
                "machine": {"type": "q35"},
                "resources": {"requests": {"memory": "256Mi"}},
                "firmware": {
                    "bootloader": {"efi": {"secureBoot": false, "persistent": true}},
                    "kernelBoot": {"kernelArgs": "console=ttyS0", "container": {
                        "image": "guest", "kernelPath": "/boot/vmlinuz",
                        "initrdPath": "/boot/initrd.img"}},
                },
            },
        }),
    );
    let (status, d) = source.sync(&v);
    assert_eq!(status, 200, "{d}\n{}", source.log());
    source.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let template = std::fs::read("/usr/share/OVMF/OVMF_VARS_4M.fd").unwrap();
    let source_vars = source_nvram.path().join("efi_VARS.fd");
    let written = std::fs::read(&source_vars).unwrap();
    assert_ne!(written, template, "OVMF wrote no variable on the source");

    let target = launcher(&target_nvram);
    let body = json!({"migrationUid": "m-efi", "vmi": v, "copyDisks": [], "allowPostCopy": false});
    let (status, d) = target.request("PUT", "/v1/migration/target", Some(&body));
    assert_eq!(status, 200, "{d}\n{}", target.log());
    let target_vars = target_nvram.path().join("efi_VARS.fd");
    assert_eq!(
        std::fs::read(&target_vars).unwrap(),
        template,
        "a fresh store"
    );
    join_streams(&source, &target);
    let body = json!({"migrationUid": "m-efi", "copyDisks": [], "completionTimeoutPerGib": 150,
                      "progressTimeout": 150, "allowAutoConverge": false, "allowPostCopy": false});
    let (status, d) = source.request("POST", "/v1/migration/start", Some(&body));
    assert_eq!(status, 200, "{d}\n{}", source.log());
    wait_until(BOOT, "the migration completed on the target", || {
        (migration_of(&target.domain())["phase"] == "Completed").then_some(())
    });
    let d = target.post("/v1/migration/finish");
    assert_eq!(d["state"], "Running", "{d}");
    wait_until(BOOT, "the source's variables in the target's store", || {
        (std::fs::read(&target_vars).unwrap() == written).then_some(())
    });
}

/// One migration of `v` from `source` to a fresh target; QEMU's figures from the source's last
/// domain: (total ms, downtime ms, memory transferred bytes). The target is returned running.
fn measure(source: &Launcher, v: &Value, migration: &str) -> (Launcher, u64, u64, u64) {
    let target = start_launcher();
    prepare_target(&target, migration, v);
    join_streams(source, &target);
    let socket = source.socket.clone();
    migrate(source, migration, 0);
    let lines = common::watch_until(&socket, BOOT, |d: &Value| d["state"] == "Shutoff");
    let m = migration_of(lines.last().unwrap()).clone();
    assert_eq!(m["phase"], "Completed", "{m}");
    wait_until(BOOT, "the target's state is in", || {
        (migration_of(&target.domain())["phase"] == "Completed").then_some(())
    });
    target.post("/v1/migration/finish");
    (
        target,
        m["totalTimeMs"].as_u64().unwrap(),
        m["downtimeMs"].as_u64().unwrap(),
        m["memoryTransferred"].as_u64().unwrap(),
    )
}

/// The migration benchmark: an idle 256 MiB guest moved under TCG, then the same guest while
/// it rewrites 64 MiB of memory in a loop. Prints QEMU's own figures (total time, downtime,
/// memory sent) and the load average.
///
/// `cargo nextest run -p launcher --test migration --run-ignored only --no-capture`
#[test]
#[ignore = "benchmark: prints figures"]
fn guest_migration_benchmark_idle_and_dirtying() {
    let mut source = start_launcher();
    let id = uid();
    let v = vmi("bench", &id, spec());
    let (status, d) = source.sync(&v);
    assert_eq!(status, 200, "{d}");
    source.wait_console(&id, "KUBEVIRT-RS-GUEST-READY");
    let (mut target, total, downtime, sent) = measure(&source, &v, "idle");
    assert!(source.wait_exit(Duration::from_secs(30)).success());
    let load = testguest::load_average();
    println!(
        "migration, idle 256 MiB guest (TCG, unix sockets, block migration of its containerDisk \
         overlay and emptyDisk): total {total} ms, downtime {downtime} ms, memory sent {} KiB; \
         load average {}",
        sent / 1024,
        load
    );

    let mut console = Console::connect(&target.vm_dir(&id).join("virt-serial0"));
    console.run(
        "(while :; do dd if=/dev/zero of=/dev/shm/dirty bs=1M count=64 2>/dev/null; done) & echo started",
        BOOT,
    );
    let (_again, total, downtime, sent) = measure(&target, &v, "dirtying");
    assert!(target.wait_exit(Duration::from_secs(30)).success());
    let load = testguest::load_average();
    println!(
        "migration, the same guest rewriting 64 MiB in a loop: total {total} ms, downtime \
         {downtime} ms, memory sent {} KiB; load average {}",
        sent / 1024,
        load
    );
}
