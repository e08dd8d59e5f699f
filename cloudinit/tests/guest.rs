//! Boots the real test guest (built by `hack/guest/build.sh`) under TCG and checks its contract:
//! the console markers, an answering guest agent, kernel boot and disk boot with SeaBIOS and
//! OVMF on pc and q35, ACPI power-down, and the user-data of the seed images this crate writes.
//!
//! QEMU is run directly with raw JSON on its sockets: these tests hold the guest to its
//! contract without depending on the project's own QMP client.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cloudinit::{ConfigDriveSeed, NoCloudSeed, write_config_drive, write_nocloud};

const DEADLINE: Duration = Duration::from_mins(3);
const READY: &str = "KUBEVIRT-RS-GUEST-READY";
const USERDATA_DONE: &str = "KUBEVIRT-RS-USERDATA-DONE";
const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
const OVMF_CODE_SECBOOT: &str = "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd";
/// Variables with Microsoft's keys enrolled and Secure Boot enabled.
const OVMF_VARS_MS: &str = "/usr/share/OVMF/OVMF_VARS_4M.ms.fd";

fn guest_dir() -> PathBuf {
    let dir = testguest::dir();
    assert!(
        dir.join("manifest.json").is_file(),
        "no test guest in {}: run hack/guest/build.sh (or set KUBEVIRT_RS_GUEST_DIR)",
        dir.display()
    );
    dir
}

enum Boot {
    /// `-kernel`/`-initrd` with `console=ttyS0`.
    Kernel,
    /// The bootable disk through the machine's default firmware (SeaBIOS).
    Bios,
    /// The bootable disk through OVMF.
    Efi,
    /// The bootable disk through OVMF with Secure Boot on (needs SMM: use a q35 machine with
    /// `smm=on`).
    EfiSecure,
}

/// A running QEMU and its sockets; killed and cleaned up on drop, whatever the test's outcome.
struct Guest {
    child: Child,
    dir: tempfile::TempDir,
    started: Instant,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Guest {
    fn start(machine: &str, boot: &Boot, extra: &[String]) -> Guest {
        let guest = guest_dir();
        let dir = tempfile::tempdir().unwrap();
        let p = |name: &str| dir.path().join(name).display().to_string();
        let mut args: Vec<String> = [
            "-machine",
            machine,
            "-accel",
            "tcg",
            "-m",
            "512",
            "-nodefaults",
            "-display",
            "none",
            "-no-user-config",
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        args.extend([
            "-serial".into(),
            format!("file:{}", p("serial.log")),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p("qmp.sock")),
            "-chardev".into(),
            format!("socket,id=qga,path={},server=on,wait=off", p("qga.sock")),
            "-device".into(),
            "virtio-serial-pci,id=vser".into(),
            "-device".into(),
            "virtserialport,chardev=qga,name=org.qemu.guest_agent.0".into(),
        ]);
        match boot {
            Boot::Kernel => args.extend([
                "-kernel".into(),
                guest.join("vmlinuz").display().to_string(),
                "-initrd".into(),
                guest.join("initrd.img").display().to_string(),
                "-append".into(),
                "console=ttyS0".into(),
            ]),
            Boot::Bios | Boot::Efi | Boot::EfiSecure => {
                let firmware = match boot {
                    Boot::Efi => Some((OVMF_CODE, OVMF_VARS)),
                    Boot::EfiSecure => {
                        // The firmware's flash may only be written from SMM.
                        args.extend([
                            "-global".into(),
                            "driver=cfi.pflash01,property=secure,value=on".into(),
                        ]);
                        Some((OVMF_CODE_SECBOOT, OVMF_VARS_MS))
                    }
                    _ => None,
                };
                if let Some((code, vars)) = firmware {
                    fs::copy(vars, dir.path().join("vars.fd")).unwrap();
                    args.extend([
                        "-drive".into(),
                        format!("if=pflash,format=raw,unit=0,readonly=on,file={code}"),
                        "-drive".into(),
                        format!("if=pflash,format=raw,unit=1,file={}", p("vars.fd")),
                    ]);
                }
                args.extend([
                    "-drive".into(),
                    format!(
                        "file={},format=qcow2,if=virtio,snapshot=on",
                        guest.join("disk.qcow2").display()
                    ),
                ]);
            }
        }
        args.extend(extra.iter().cloned());
        let child = Command::new("qemu-system-x86_64")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.path().join("qemu.stderr")).unwrap())
            .spawn()
            .expect("qemu-system-x86_64 runs");
        Guest {
            child,
            dir,
            started: Instant::now(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn console(&self) -> String {
        String::from_utf8_lossy(&fs::read(self.path("serial.log")).unwrap_or_default()).into_owned()
    }

    /// Polls the console until it shows `marker`; fails with the console's tail and QEMU's
    /// stderr if the deadline passes or QEMU exits first.
    fn wait_for_console(&mut self, marker: &str) -> Duration {
        loop {
            if self.console().contains(marker) {
                return self.started.elapsed();
            }
            let exited = self.child.try_wait().unwrap();
            if exited.is_some() || self.started.elapsed() > DEADLINE {
                let console = self.console();
                let tail: String = console
                    .chars()
                    .skip(console.chars().count().saturating_sub(3000))
                    .collect();
                panic!(
                    "no {marker} on the console (qemu exit: {exited:?}, after {:?})\n--- console tail\n{tail}\n--- qemu stderr\n{}",
                    self.started.elapsed(),
                    fs::read_to_string(self.path("qemu.stderr")).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Polls `guest-ping` on the agent's socket until it answers `{"return": {}}`.
    fn wait_for_agent(&self) -> Duration {
        let mut last = String::new();
        while self.started.elapsed() < DEADLINE {
            match agent_ping(&self.path("qga.sock")) {
                Ok(()) => return self.started.elapsed(),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("guest agent never answered guest-ping: {last}");
    }

    /// Sends one QMP command (after the capabilities handshake) and returns its reply line.
    fn qmp(&self, command: &str) -> String {
        let stream = UnixStream::connect(self.path("qmp.sock")).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut writer = stream;
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert!(line.contains("QMP"), "QMP greeting: {line}");
        for cmd in [r#"{"execute":"qmp_capabilities"}"#, command] {
            writer.write_all(cmd.as_bytes()).unwrap();
            writer.write_all(b"\n").unwrap();
            loop {
                line.clear();
                reader.read_line(&mut line).unwrap();
                if line.contains("\"return\"") || line.contains("\"error\"") {
                    break;
                }
            }
        }
        line
    }

    fn wait_for_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < within,
                "QEMU still running {within:?} after the request; console:\n{}",
                self.console()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// One guest-agent command on a fresh connection; the reply's `return` value.
fn agent_call(sock: &Path, command: &str) -> Result<serde_json::Value, String> {
    let stream = UnixStream::connect(sock).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let mut writer = stream.try_clone().map_err(|e| e.to_string())?;
    writer
        .write_all(format!("{{\"execute\":\"{command}\"}}\n").as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(|e| format!("read: {e}"))?;
    let mut reply: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("reply {line:?}: {e}"))?;
    reply
        .get_mut("return")
        .map(serde_json::Value::take)
        .ok_or_else(|| format!("{command}: unexpected reply {line:?}"))
}

fn agent_ping(sock: &Path) -> Result<(), String> {
    let reply = agent_call(sock, "guest-ping")?;
    if reply == serde_json::json!({}) {
        Ok(())
    } else {
        Err(format!("guest-ping returned {reply}"))
    }
}

/// Boots, waits for the ready marker and the agent, and prints the times (figures, not asserts).
fn boot_and_check(name: &str, machine: &str, boot: &Boot) {
    let mut guest = Guest::start(machine, boot, &[]);
    let ready = guest.wait_for_console(READY);
    let agent = guest.wait_for_agent();
    assert!(
        !guest.console().contains(USERDATA_DONE),
        "no seed attached, yet user-data ran"
    );
    eprintln!("{name}: console ready after {ready:?}, agent answered after {agent:?}");
}

#[test]
fn guest_kernel_boot_pc() {
    boot_and_check("kernel boot, pc", "pc", &Boot::Kernel);
}

/// Beyond the ping: what the agent reports comes from the guest's /etc/os-release, its
/// hostname and the console login recorded in utmp.
#[test]
fn guest_kernel_boot_q35_agent_reports() {
    let mut guest = Guest::start("q35", &Boot::Kernel, &[]);
    let ready = guest.wait_for_console(READY);
    let agent = guest.wait_for_agent();
    eprintln!("kernel boot, q35: console ready after {ready:?}, agent answered after {agent:?}");
    let sock = guest.path("qga.sock");
    let osinfo = agent_call(&sock, "guest-get-osinfo").unwrap();
    assert_eq!(osinfo["id"], "kubevirt-rs-guest", "{osinfo}");
    assert_eq!(osinfo["version-id"], "12", "{osinfo}");
    let host = agent_call(&sock, "guest-get-host-name").unwrap();
    assert_eq!(host["host-name"], "testvm");
    // The console login follows the ready marker: poll for it.
    let start = Instant::now();
    loop {
        let users = agent_call(&sock, "guest-get-users").unwrap();
        if users
            .as_array()
            .is_some_and(|u| u.iter().any(|u| u["user"] == "root"))
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_mins(1), "users: {users}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn guest_disk_boot_seabios_pc() {
    boot_and_check("disk boot, SeaBIOS, pc", "pc", &Boot::Bios);
}

#[test]
fn guest_disk_boot_seabios_q35() {
    boot_and_check("disk boot, SeaBIOS, q35", "q35", &Boot::Bios);
}

#[test]
fn guest_disk_boot_ovmf_q35() {
    boot_and_check("disk boot, OVMF, q35", "q35", &Boot::Efi);
}

/// shim (signed by Microsoft's UEFI CA), GRUB and the kernel (signed by Debian) make the disk
/// boot with Secure Boot enforced.
#[test]
fn guest_disk_boot_secure_boot_q35() {
    let mut guest = Guest::start("q35,smm=on", &Boot::EfiSecure, &[]);
    let ready = guest.wait_for_console(READY);
    let agent = guest.wait_for_agent();
    assert!(
        guest.console().contains("secureboot: Secure boot enabled"),
        "{}",
        guest.console()
    );
    eprintln!(
        "disk boot, OVMF Secure Boot, q35: console ready after {ready:?}, agent answered after {agent:?}"
    );
}

/// The ACPI power button (QMP system_powerdown) reaches busybox acpid, which powers the guest
/// off through init; QEMU then exits on its own.
#[test]
fn guest_acpi_powerdown_powers_off() {
    let mut guest = Guest::start("q35", &Boot::Kernel, &[]);
    guest.wait_for_console(READY);
    let reply = guest.qmp(r#"{"execute":"system_powerdown"}"#);
    assert!(reply.contains("\"return\""), "system_powerdown: {reply}");
    let status = guest.wait_for_exit(Duration::from_mins(2));
    assert!(
        status.success(),
        "QEMU exit after guest poweroff: {status:?}"
    );
    assert!(
        guest.console().contains("reboot: Power down"),
        "{}",
        guest.console()
    );
}

/// The agent's guest-shutdown runs `/sbin/shutdown -h -P +0 ...`, which the guest maps to
/// busybox's poweroff; QEMU exits. The agent sends no reply to a successful shutdown.
#[test]
fn guest_agent_shutdown_powers_off() {
    let mut guest = Guest::start("pc", &Boot::Kernel, &[]);
    guest.wait_for_console(READY);
    guest.wait_for_agent();
    let mut stream = UnixStream::connect(guest.path("qga.sock")).unwrap();
    stream
        .write_all(b"{\"execute\":\"guest-shutdown\",\"arguments\":{\"mode\":\"powerdown\"}}\n")
        .unwrap();
    let status = guest.wait_for_exit(Duration::from_mins(2));
    assert!(
        status.success(),
        "QEMU exit after guest-shutdown: {status:?}"
    );
    assert!(
        guest.console().contains("reboot: Power down"),
        "{}",
        guest.console()
    );
}

fn seed_drive(path: &Path, how: &str) -> Vec<String> {
    match how {
        "virtio" => vec![
            "-drive".into(),
            format!("file={},format=raw,if=virtio,readonly=on", path.display()),
        ],
        // A CD-ROM on q35's built-in AHCI controller, as KubeVirt's sata cdrom.
        "sata-cdrom" => vec![
            "-drive".into(),
            format!(
                "file={},format=raw,if=none,id=seed,media=cdrom,readonly=on",
                path.display()
            ),
            "-device".into(),
            "ide-cd,drive=seed,bus=ide.1".into(),
        ],
        "scsi" => vec![
            "-device".into(),
            "virtio-scsi-pci,id=scsi0".into(),
            "-drive".into(),
            format!(
                "file={},format=raw,if=none,id=seed,readonly=on",
                path.display()
            ),
            "-device".into(),
            "scsi-hd,drive=seed,bus=scsi0.0".into(),
        ],
        other => panic!("unknown seed attachment {other}"),
    }
}

/// Boots with a seed image attached and checks that its user-data script ran, printed its own
/// output, and that the guest took the seed's hostname.
fn user_data_runs(machine: &str, attach: &str, config_drive: bool) {
    let seeds = tempfile::tempdir().unwrap();
    let token = format!("seed-output-{}", std::process::id());
    let script = format!("#!/bin/sh\necho \"{token} $(hostname)\"\n").into_bytes();
    let image = seeds.path().join("seed.iso");
    if config_drive {
        write_config_drive(
            &image,
            &ConfigDriveSeed {
                instance_id: "6a1c2b3e-0000-4000-8000-000000000001".into(),
                hostname: "cdhost".into(),
                user_data: script,
                network_data: Some(b"{}".to_vec()),
            },
        )
        .unwrap();
    } else {
        write_nocloud(
            &image,
            &NoCloudSeed {
                instance_id: "vmi-1".into(),
                hostname: "nchost".into(),
                user_data: script,
                network_config: Some(b"version: 2\n".to_vec()),
            },
        )
        .unwrap();
    }
    let mut guest = Guest::start(machine, &Boot::Kernel, &seed_drive(&image, attach));
    let done = guest.wait_for_console(USERDATA_DONE);
    guest.wait_for_console(READY);
    let console = guest.console();
    let host = if config_drive { "cdhost" } else { "nchost" };
    assert!(
        console.contains(&format!("{token} {host}")),
        "user-data output missing:\n{console}"
    );
    let ran = console.find(&token).unwrap();
    assert!(
        ran < console.find(USERDATA_DONE).unwrap(),
        "marker printed before the script ran"
    );
    eprintln!("user-data ({attach}, config drive: {config_drive}) done after {done:?}");
}

#[test]
fn guest_nocloud_user_data_runs() {
    user_data_runs("q35", "virtio", false);
}

#[test]
fn guest_config_drive_user_data_runs() {
    user_data_runs("pc", "virtio", true);
}

#[test]
fn guest_config_drive_from_scsi_disk() {
    user_data_runs("q35", "scsi", true);
}

#[test]
fn guest_nocloud_from_sata_cdrom() {
    user_data_runs("q35", "sata-cdrom", false);
}
