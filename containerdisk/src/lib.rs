//! What a containerDisk container runs: KubeVirt's `container-disk` program.
//!
//! A containerDisk image carries a disk file (`/disk/<file>`) and no program of its own. The
//! launcher pod runs the image anyway, with this binary copied in, so that the image's root
//! filesystem exists as a running container on the node. The program only serves a unix
//! socket at `<copy path>.sock` in the launcher's container-disk directory. virt-handler
//! connects to it and asks the kernel (SO_PEERCRED) which process listens: that process's
//! root (`/proc/<pid>/root`) holds the image, which virt-handler bind-mounts read-only into
//! the launcher. Connections carry no data; each is accepted and closed at once, so that
//! the queue never fills and no descriptor is held.
//!
//! It ends cleanly (exit 0, socket removed) on SIGTERM or SIGINT, and also when its socket
//! file disappears or is replaced: KubeVirt uses that as a second stop signal, because some
//! container runtimes were late to deliver SIGTERM.

use std::io;
use std::os::fd::AsFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// `sun_path` holds 108 bytes including the terminating NUL; `.sock` takes 5 of them.
pub const MAX_COPY_PATH: usize = 102;

/// How often the socket file is checked for removal when nothing else happens.
const CHECK_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "--copy-path {path:?} is {len} bytes; at most {MAX_COPY_PATH} fit a unix socket address \
         with the .sock suffix"
    )]
    CopyPathTooLong { path: PathBuf, len: usize },
    #[error("--copy-path {0:?} names no file")]
    CopyPathNoName(PathBuf),
    #[error("creating the socket directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("another process already serves {0}")]
    InUse(PathBuf),
    #[error("{op} {path}")]
    Socket {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("waiting for connections and signals")]
    Wait(#[source] nix::Error),
}

/// Why [`serve`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    Signal(Signal),
    /// The socket file was removed or replaced by someone else.
    SocketGone,
}

/// `<copy path>.sock`, after checking the path fits a socket address.
pub fn socket_path(copy_path: &Path) -> Result<PathBuf, Error> {
    let len = copy_path.as_os_str().len();
    if len > MAX_COPY_PATH {
        return Err(Error::CopyPathTooLong {
            path: copy_path.to_owned(),
            len,
        });
    }
    if copy_path.file_name().is_none() {
        return Err(Error::CopyPathNoName(copy_path.to_owned()));
    }
    let mut s = copy_path.as_os_str().to_owned();
    s.push(".sock");
    Ok(PathBuf::from(s))
}

/// A bound, listening socket and the identity of its file, removed again on drop.
#[derive(Debug)]
pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    inode: (u64, u64),
}

impl Server {
    /// Creates the directory if needed and binds `socket`. A socket file nobody listens on
    /// is left over from a killed predecessor (the emptyDir outlives container restarts)
    /// and is replaced; one somebody listens on is refused.
    pub fn bind(socket: &Path) -> Result<Self, Error> {
        let err = |op, source| Error::Socket {
            op,
            path: socket.to_owned(),
            source,
        };
        if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| Error::CreateDir {
                path: dir.to_owned(),
                source,
            })?;
        }
        match UnixStream::connect(socket) {
            Ok(_) => return Err(Error::InUse(socket.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %socket.display(), "removing a stale socket");
                std::fs::remove_file(socket).map_err(|e| err("removing stale socket", e))?;
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(socket).map_err(|e| err("binding", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| err("configuring", e))?;
        let meta = std::fs::symlink_metadata(socket).map_err(|e| err("checking", e))?;
        Ok(Self {
            listener,
            path: socket.to_owned(),
            inode: (meta.dev(), meta.ino()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Accepts and closes connections until a stop signal arrives or the socket file is
    /// gone. `signals` must be blocked in every thread, so that they queue on the signalfd.
    pub fn serve(&self, signals: &SignalFd) -> Result<Stopped, Error> {
        let timeout = PollTimeout::try_from(CHECK_INTERVAL).expect("one second fits");
        loop {
            let mut fds = [
                PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::Error::EINTR) => {}
                Err(e) => return Err(Error::Wait(e)),
            }
            if let Some(info) = signals.read_signal().map_err(Error::Wait)? {
                let signal = i32::try_from(info.ssi_signo)
                    .ok()
                    .and_then(|n| Signal::try_from(n).ok())
                    .unwrap_or(Signal::SIGTERM);
                return Ok(Stopped::Signal(signal));
            }
            self.drain()?;
            if !self.still_ours() {
                return Ok(Stopped::SocketGone);
            }
        }
    }

    fn drain(&self) -> Result<(), Error> {
        loop {
            match self.listener.accept() {
                Ok((conn, _)) => drop(conn),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => {}
                Err(e) => {
                    return Err(Error::Socket {
                        op: "accepting on",
                        path: self.path.clone(),
                        source: e,
                    });
                }
            }
        }
    }

    fn still_ours(&self) -> bool {
        std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode)
    }
}

impl Drop for Server {
    /// Removes the socket file, unless it has been replaced by someone else's.
    fn drop(&mut self) {
        if self.still_ours() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Blocks SIGTERM and SIGINT in the calling thread (do it before starting any other) and
/// returns a descriptor they arrive on instead.
pub fn stop_signals() -> Result<SignalFd, Error> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    mask.thread_block().map_err(Error::Wait)?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC).map_err(Error::Wait)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_path_appends_the_suffix() {
        assert_eq!(
            socket_path(Path::new("/var/run/kubevirt/container-disks/u/disk_0")).unwrap(),
            PathBuf::from("/var/run/kubevirt/container-disks/u/disk_0.sock")
        );
    }

    #[test]
    fn socket_path_must_fit_sun_path() {
        let ok = format!("/{}", "a".repeat(MAX_COPY_PATH - 1));
        let sock = socket_path(Path::new(&ok)).unwrap();
        assert_eq!(sock.as_os_str().len() + 1, 108);
        let long = format!("/{}", "a".repeat(MAX_COPY_PATH));
        let e = socket_path(Path::new(&long)).unwrap_err();
        assert!(e.to_string().contains("103 bytes"), "{e}");
    }

    #[test]
    fn socket_path_needs_a_file_name() {
        assert!(matches!(
            socket_path(Path::new("/")),
            Err(Error::CopyPathNoName(_))
        ));
        assert!(matches!(
            socket_path(Path::new("a/..")),
            Err(Error::CopyPathNoName(_))
        ));
    }
}
