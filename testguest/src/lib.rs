//! The test guest's side of the tests (docs/test-guest.md): where `hack/guest/build.sh` put
//! it, and the disks its init script looks for. Shared by every crate whose tests boot it.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

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

/// Whether the console's last line is the shell's continuation prompt (`> `, perhaps followed
/// by the line editor's cursor query).
fn at_continuation_prompt(out: &[u8]) -> bool {
    String::from_utf8_lossy(out)
        .rsplit('\n')
        .next()
        .is_some_and(|last| last.starts_with("> "))
}

/// `text` without the kernel's log records (`[    14.123456] random: crng init done` up to its
/// newline). The kernel prints them on the same serial console as the shell, at any moment and
/// even in the middle of a command's output line; a record is written whole, so cutting it
/// out leaves the command's output as the shell wrote it.
fn without_kernel_messages(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('[') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let stamp = after.trim_start_matches(' ');
        let digits = |s: &str| s.len() - s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let whole = digits(stamp);
        let is_record = whole > 0
            && stamp[whole..].starts_with('.')
            && digits(&stamp[whole + 1..]) > 0
            && stamp[whole + 1 + digits(&stamp[whole + 1..])..].starts_with("] ");
        if is_record {
            rest = after.find('\n').map_or("", |n| &after[n + 1..]);
        } else {
            out.push('[');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The test guest's serial console (a root shell on ttyS0 once its init script is done): runs
/// shell commands and returns what they printed between two markers.
#[derive(Debug)]
pub struct Console {
    s: UnixStream,
    seq: u32,
}

impl Console {
    pub fn connect(path: &Path) -> Self {
        let s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("the console {}: {e}", path.display()));
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        Self { s, seq: 0 }
    }

    pub fn run(&mut self, cmd: &str, limit: Duration) -> String {
        self.seq += 1;
        let begin = format!("BEGIN-{}-MARK", self.seq);
        let end = format!("END-{}-MARK", self.seq);
        // The markers are built by the shell (`echo BEGIN-1-''MARK`) so the echoed command line
        // itself never matches them.
        let line = format!(
            "echo BEGIN-{n}-''MARK; {cmd}; echo END-{n}-''MARK\n",
            n = self.seq
        );
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let mut last_send = None::<Instant>;
        loop {
            // Resend until the shell answers: the first bytes may reach a console that is still
            // starting its getty.
            if last_send.is_none_or(|t| t.elapsed() > Duration::from_secs(20))
                && !String::from_utf8_lossy(&out).contains(&begin)
            {
                // A line sent while the getty was still starting can reach the shell cut, e.g.
                // only its tail `'MARK`: an open quote that swallows every later line at the
                // shell's continuation prompt `> `. Ctrl-C drops it for a fresh prompt; sent
                // only then, since before the shell runs it would interrupt login instead.
                if at_continuation_prompt(&out) {
                    self.s.write_all(b"\x03").unwrap();
                }
                self.s.write_all(line.as_bytes()).unwrap();
                last_send = Some(Instant::now());
            }
            match self.s.read(&mut buf) {
                Ok(0) => panic!("console closed"),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
            let text = without_kernel_messages(&String::from_utf8_lossy(&out).replace('\r', ""));
            if let (Some(b), Some(e)) = (text.find(&begin), text.rfind(&end))
                && b < e
            {
                return text[b + begin.len()..e].trim().to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "console: no answer to {cmd:?}; got {text:?}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_records_are_cut_out_even_mid_line() {
        assert_eq!(
            without_kernel_messages(
                "BEGIN-1-MARK\n[   14.123456] random: crng init done\n12.3[   15.000001] x\n4\nEND"
            ),
            "BEGIN-1-MARK\n12.34\nEND"
        );
        // Brackets that are not a record's stamp stay.
        for kept in ["[ -f x ]", "a[1] b", "[12] c", "[ 1.2]x", "[1.]"] {
            assert_eq!(without_kernel_messages(kept), kept);
        }
        // A record cut off at the end of what arrived goes, up to the end.
        assert_eq!(without_kernel_messages("ok\n[    1.5] half"), "ok\n");
    }
}
