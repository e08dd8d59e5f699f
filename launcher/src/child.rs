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

/// Lets the child inherit `fd` (Rust opens every descriptor close-on-exec). Only the child's
/// copy changes: the flag is cleared after the fork.
pub fn inherit_fd(cmd: &mut Command, fd: std::os::fd::RawFd) {
    // SAFETY: fcntl(F_SETFD) is async-signal-safe and changes only the child's descriptor
    // table; `fd` is open in the parent until after the spawn, so it is open in the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
