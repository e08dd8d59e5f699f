//! The test guest's side of the tests (docs/test-guest.md): where `hack/guest/build.sh` put
//! it, and the disks its init script looks for. Shared by every crate whose tests boot it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `$KUBEVIRT_RS_GUEST_DIR`, else the build's cache in the repository (`.cache/guest`).
pub fn dir() -> PathBuf {
    std::env::var_os("KUBEVIRT_RS_GUEST_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/guest"),
        PathBuf::from,
    )
}

/// The guest's freezable disk: a 16 MiB ext4 image labelled `kvrs-data`, which the guest
/// mounts at `/mnt/data`; its other file systems cannot be frozen. Panics, naming the file,
/// if the image cannot be made.
pub fn freezable_disk(path: &Path) {
    std::fs::File::create(path)
        .and_then(|f| f.set_len(16 << 20))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-L", "kvrs-data"])
        .arg(path)
        .output()
        .expect("mkfs.ext4 (e2fsprogs)");
    assert!(
        out.status.success(),
        "mkfs.ext4 {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The machine's load average (1, 5 and 15 minutes), which benchmarks that boot the guest print
/// next to their figures: under TCG a busy machine slows every boot.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}
