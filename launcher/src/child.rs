//! Child processes of the launcher.

use tokio::process::Command;

/// Makes the kernel SIGKILL the child when the launcher dies, however it dies: `kill_on_drop`
/// only helps when the launcher unwinds, and an exit on a fatal error or a SIGKILL drops
/// nothing. A QEMU or probe left behind would keep burning a CPU with no one to stop it.
pub fn die_with_launcher(cmd: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
