//! Choosing the accelerator. `/dev/kvm` can exist, open and even run real-mode code, yet fail
//! as soon as a guest enables paging in long mode (this machine's nested KVM does exactly that:
//! a Linux kernel stops right after "Probing EDD"). So the probe boots a real machine through the
//! same steps a 64-bit kernel takes: a 64 KiB firmware switches to protected mode, builds
//! identity page tables, enables PAE, long mode and paging, and only then writes to
//! `isa-debug-exit`. If QEMU exits with the code that write produces, KVM can run a kernel.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::Stdio;

use nix::sys::memfd::{MFdFlags, memfd_create};
use std::time::Duration;

use tokio::process::Command;

use crate::qemu::Accel;

/// The exit status `isa-debug-exit` gives for the byte the probe writes: `(0x2a << 1) | 1`.
const PROBE_EXIT: i32 = 85;
/// How long QEMU may take to start (paused, until its QMP greeting): seconds on a loaded
/// machine, and not what the probe measures.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the probe code may run once QEMU is up. Under a working KVM the few instructions
/// take microseconds once the vCPU thread is scheduled; a broken KVM hangs, so this is what it
/// costs to find out, once per launcher.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The probe code, loaded at 0xF0000 (the start of the 64 KiB BIOS window). Assembled with GNU
/// `as --32` from:
///
/// ```text
/// .code16
///   cli
///   cs lgdtl gdt_desc                  ; GDT: null, code32, data, code64
///   movl %cr0,%eax; orl $1,%eax; movl %eax,%cr0
///   ljmpl $0x08, $(0xF0000 + pm32)
/// .code32
/// pm32:
///   movw $0x10,%ax; movw %ax,%ds; movw %ax,%es; movw %ax,%ss
///   movl $0x1000,%edi; xorl %eax,%eax; movl $3072,%ecx; rep stosl   ; clear 3 pages
///   movl $0x2003,0x1000; movl $0x3003,0x2000; movl $0x83,0x3000    ; PML4 -> PDPT -> 2M page
///   movl %cr4,%eax; orl $0x20,%eax; movl %eax,%cr4                   ; PAE
///   movl $0x1000,%eax; movl %eax,%cr3
///   movl $0xC0000080,%ecx; rdmsr; orl $0x100,%eax; wrmsr             ; EFER.LME
///   movl %cr0,%eax; orl $0x80000000,%eax; movl %eax,%cr0             ; paging on
///   ljmpl $0x18, $(0xF0000 + lm64)
/// .code64
/// lm64:
///   movb $0x2a,%al; outb %al,$0xf4
/// 1: hlt; jmp 1b
/// .align 8
/// gdt: .quad 0, 0x00CF9A000000FFFF, 0x00CF92000000FFFF, 0x00AF9A000000FFFF
/// gdt_desc: .word 31; .long 0xF0000 + gdt
/// ```
const PROBE_CODE: [u8; 174] = [
    0xFA, 0x2E, 0x66, 0x0F, 0x01, 0x16, 0xA8, 0x00, 0x0F, 0x20, 0xC0, 0x66, 0x83, 0xC8, 0x01, 0x0F,
    0x22, 0xC0, 0x66, 0xEA, 0x1A, 0x00, 0x0F, 0x00, 0x08, 0x00, 0x66, 0xB8, 0x10, 0x00, 0x8E, 0xD8,
    0x8E, 0xC0, 0x8E, 0xD0, 0xBF, 0x00, 0x10, 0x00, 0x00, 0x31, 0xC0, 0xB9, 0x00, 0x0C, 0x00, 0x00,
    0xF3, 0xAB, 0xC7, 0x05, 0x00, 0x10, 0x00, 0x00, 0x03, 0x20, 0x00, 0x00, 0xC7, 0x05, 0x00, 0x20,
    0x00, 0x00, 0x03, 0x30, 0x00, 0x00, 0xC7, 0x05, 0x00, 0x30, 0x00, 0x00, 0x83, 0x00, 0x00, 0x00,
    0x0F, 0x20, 0xE0, 0x83, 0xC8, 0x20, 0x0F, 0x22, 0xE0, 0xB8, 0x00, 0x10, 0x00, 0x00, 0x0F, 0x22,
    0xD8, 0xB9, 0x80, 0x00, 0x00, 0xC0, 0x0F, 0x32, 0x0D, 0x00, 0x01, 0x00, 0x00, 0x0F, 0x30, 0x0F,
    0x20, 0xC0, 0x0D, 0x00, 0x00, 0x00, 0x80, 0x0F, 0x22, 0xC0, 0xEA, 0x81, 0x00, 0x0F, 0x00, 0x18,
    0x00, 0xB0, 0x2A, 0xE6, 0xF4, 0xF4, 0xEB, 0xFD, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0xFF, 0xFF, 0x00, 0x00, 0x00, 0x9A, 0xCF, 0x00, 0xFF, 0xFF, 0x00, 0x00, 0x00, 0x92, 0xCF, 0x00,
    0xFF, 0xFF, 0x00, 0x00, 0x00, 0x9A, 0xAF, 0x00, 0x1F, 0x00, 0x88, 0x00, 0x0F, 0x00,
];

/// The firmware image: the probe code at the bottom, and at the reset vector (offset 0xFFF0)
/// a far jump to it (`ljmp $0xF000, $0`).
pub fn probe_firmware() -> Vec<u8> {
    let mut image = vec![0u8; 64 * 1024];
    image[..PROBE_CODE.len()].copy_from_slice(&PROBE_CODE);
    image[0xFFF0..0xFFF5].copy_from_slice(&[0xEA, 0x00, 0x00, 0x00, 0xF0]);
    image
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    Works,
    Fails(String),
}

/// Runs the probe firmware under `accel` and reports whether it reached the exit port
/// `within` that long of running. QEMU starts paused and is let go only once its QMP monitor
/// greets, so the time it takes to start (up to [`STARTUP_TIMEOUT`]) does not count.
pub async fn probe(qemu: &Path, accel: Accel, within: Duration) -> Probe {
    if accel == Accel::Kvm
        && let Err(e) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
    {
        return Probe::Fails(format!("cannot open /dev/kvm: {e}"));
    }
    let firmware = match firmware_memfd() {
        Ok(fd) => fd,
        Err(e) => return Probe::Fails(format!("cannot hold the probe firmware in a memfd: {e}")),
    };
    let mut cmd = Command::new(qemu);
    cmd.args(["-machine", "pc", "-accel"])
        .arg(accel.to_string())
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-m",
            "16M",
            "-device",
            "isa-debug-exit,iobase=0xf4,iosize=0x04",
            "-S",
            "-qmp",
            "stdio",
            "-bios",
        ])
        .arg(format!("/proc/self/fd/{}", firmware.as_raw_fd()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // A broken KVM never finishes the probe: it must not outlive a launcher that exits early.
    crate::child::die_with_launcher(&mut cmd);
    inherit_in_child(&mut cmd, firmware.as_raw_fd());
    let result = match cmd.spawn() {
        Err(e) => Probe::Fails(format!("cannot run {}: {e}", qemu.display())),
        Ok(child) => run_paused(child, within).await,
    };
    drop(firmware);
    result
}

/// Lets the paused probe QEMU run once it greets, and waits `within` for it to exit.
async fn run_paused(mut child: tokio::process::Child, within: Duration) -> Probe {
    use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
    let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        return Probe::Fails("the probe's QMP pipes are missing".into());
    };
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let greeted = tokio::time::timeout(STARTUP_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if line.starts_with("{\"QMP\"") {
                return Ok(true);
            }
        }
        Ok::<_, std::io::Error>(false)
    })
    .await;
    match greeted {
        Err(_) => {
            return Probe::Fails(format!(
                "the probe QEMU did not start within {STARTUP_TIMEOUT:?}"
            ));
        }
        // No greeting: QEMU ended before its monitor came up; its status and stderr say why.
        Ok(Ok(false) | Err(_)) => return ended(child.wait_with_output().await),
        Ok(Ok(true)) => {}
    }
    let go = b"{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"cont\"}\n";
    if let Err(e) = stdin.write_all(go).await {
        return Probe::Fails(format!("starting the probe guest: {e}"));
    }
    // The replies go unread: a few hundred bytes, well within the pipe.
    match tokio::time::timeout(within, child.wait()).await {
        Err(_) => Probe::Fails(format!("the probe guest did not finish within {within:?}")),
        Ok(_) => ended(child.wait_with_output().await),
    }
}

/// What the probe QEMU's exit says: the exit port's code, or why not (its status and stderr).
fn ended(out: std::io::Result<std::process::Output>) -> Probe {
    match out {
        Err(e) => Probe::Fails(format!("waiting for the probe: {e}")),
        Ok(out) if out.status.code() == Some(PROBE_EXIT) => Probe::Works,
        Ok(out) => Probe::Fails(format!(
            "the probe guest ended with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// The firmware lives in memory only: a file would be left behind whenever a launcher is killed
/// mid-probe (tests and pod deletions do that), one per launcher.
fn firmware_memfd() -> std::io::Result<OwnedFd> {
    let fd = memfd_create(c"kubevirt-rs-accel-probe", MFdFlags::MFD_CLOEXEC)?;
    let mut file = std::fs::File::from(fd);
    file.write_all(&probe_firmware())?;
    Ok(OwnedFd::from(file))
}

/// The memfd is close-on-exec so no other child of the launcher inherits it; only the probe's
/// QEMU, which opens it by its `/proc/self/fd` path, keeps it across exec.
fn inherit_in_child(cmd: &mut Command, fd: RawFd) {
    // SAFETY: fcntl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// KVM when it runs guest code, else TCG when emulation is allowed.
pub async fn choose(qemu: &Path, allow_emulation: bool) -> Result<(Accel, Option<String>), String> {
    match probe(qemu, Accel::Kvm, PROBE_TIMEOUT).await {
        Probe::Works => Ok((Accel::Kvm, None)),
        Probe::Fails(why) if allow_emulation => Ok((Accel::Tcg, Some(why))),
        Probe::Fails(why) => Err(why),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_vector_is_at_the_top() {
        let fw = probe_firmware();
        assert_eq!(fw.len(), 65536);
        assert_eq!(fw[0xFFF0], 0xEA, "far jump at the reset vector");
        assert_eq!(&fw[..2], &[0xFA, 0x2E]);
    }

    /// The payload itself is proven under TCG, so a KVM failure means KVM, not the payload.
    /// Its correctness, not its speed: TCG translates the code first.
    #[tokio::test]
    async fn probe_payload_runs_under_tcg() {
        let qemu = Path::new("qemu-system-x86_64");
        assert_eq!(
            probe(qemu, Accel::Tcg, Duration::from_mins(2)).await,
            Probe::Works
        );
    }

    #[tokio::test]
    async fn missing_binary_is_reported() {
        match probe(Path::new("/nonexistent/qemu"), Accel::Tcg, PROBE_TIMEOUT).await {
            Probe::Fails(why) => assert!(why.contains("/nonexistent/qemu"), "{why}"),
            Probe::Works => panic!("a missing binary cannot work"),
        }
    }
}
