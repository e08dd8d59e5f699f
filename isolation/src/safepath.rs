//! Reaching files inside a pod's filesystem without being steered out of it.
//!
//! The pod owns its filesystem and may plant symlinks anywhere in it. A privileged handler
//! that opens `/proc/<pid>/root/var/run/x` naively follows a symlink `x -> /etc/shadow` to
//! the *host's* file. Here every path is resolved by the kernel relative to a root
//! descriptor with openat2(2): `RESOLVE_IN_ROOT` treats the root as `/` for `..` and
//! absolute symlinks (as a chroot would), `RESOLVE_BENEATH` refuses them outright, and
//! `RESOLVE_NO_MAGICLINKS` refuses `/proc/*/root`-style links, which jump to another
//! process's files whatever the root. The result is a descriptor, and every later step
//! (open, chown, bind mount) works on the descriptor, so swapping a path component after the
//! check changes nothing. openat2 exists since Linux 5.6; on an older kernel this module
//! reports [`IsolationError::Openat2Unavailable`] rather than falling back to a weaker walk.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, mkdirat, mknodat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchownat, unlinkat};

use crate::error::{IsolationError, Result};

/// How paths may move around under the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolve {
    /// `..` and absolute symlinks stay inside the root, as if it were `/`. Right for a
    /// container's own filesystem, whose absolute symlinks mean its own `/`.
    InRoot,
    /// Anything that would leave the root, `..` above it or an absolute symlink, fails with
    /// [`IsolationError::PathEscapesRoot`].
    Beneath,
}

/// A directory used as the root for path resolution: usually a pod's `/proc/<pid>/root`.
#[derive(Debug)]
pub struct MountRoot {
    fd: OwnedFd,
    path: PathBuf,
}

impl MountRoot {
    /// Any directory of this mount namespace as a root.
    pub fn open(path: &Path) -> Result<Self> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| IsolationError::Path {
            op: "opening root",
            root: path.to_owned(),
            path: PathBuf::new(),
            source: e.into(),
        })?;
        Ok(Self::from_fd(fd, path.to_owned()))
    }

    pub(crate) fn from_fd(fd: OwnedFd, path: PathBuf) -> Self {
        Self { fd, path }
    }

    /// The root's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Resolves `path` (leading `/` allowed: it means the root) to an `O_PATH` handle.
    pub fn resolve(&self, path: &Path, how: Resolve) -> Result<SafePath> {
        let fd = self.openat2(path, how, OFlag::O_PATH, Mode::empty(), "resolving")?;
        Ok(SafePath {
            fd,
            root: self.path.clone(),
            path: path.to_owned(),
        })
    }

    /// Opens an existing file under the root (`flags` as for open(2), without `O_CREAT`).
    pub fn open_file(&self, path: &Path, how: Resolve, flags: OFlag) -> Result<File> {
        self.openat2(path, how, flags & !OFlag::O_CREAT, Mode::empty(), "opening")
            .map(File::from)
    }

    /// Creates a new file under the root for writing. `O_EXCL` makes the kernel refuse a
    /// symlink planted at the last component instead of following it.
    pub fn create_file(&self, path: &Path, how: Resolve, mode: u32) -> Result<File> {
        self.openat2(
            path,
            how,
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY,
            Mode::from_bits_truncate(mode),
            "creating",
        )
        .map(File::from)
    }

    /// Creates a directory under the root (its parent must exist) and returns a handle.
    pub fn create_dir(&self, path: &Path, how: Resolve, mode: u32) -> Result<SafePath> {
        let (parent_fd, name) = self.parent_of(path, how, "creating directory")?;
        mkdirat(&parent_fd, name, Mode::from_bits_truncate(mode))
            .map_err(|e| self.path_err("creating directory", path, e))?;
        self.reopen_new(&parent_fd, name, path, OFlag::O_DIRECTORY)
    }

    /// Makes a block device node for `rdev` under the root (its parent must exist) and
    /// returns a handle to the node, never to what a path might have been swapped for.
    pub fn create_block_device(
        &self,
        path: &Path,
        how: Resolve,
        mode: u32,
        rdev: u64,
    ) -> Result<SafePath> {
        let (parent_fd, name) = self.parent_of(path, how, "making device node")?;
        mknodat(
            &parent_fd,
            name,
            SFlag::S_IFBLK,
            Mode::from_bits_truncate(mode),
            rdev,
        )
        .map_err(|e| self.path_err("making device node", path, e))?;
        self.reopen_new(&parent_fd, name, path, OFlag::empty())
    }

    /// Removes the file (not a directory) at `path`; a symlink there is removed itself, never
    /// what it points to.
    pub fn remove_file(&self, path: &Path, how: Resolve) -> Result<()> {
        let (parent_fd, name) = self.parent_of(path, how, "removing")?;
        unlinkat(&parent_fd, name, UnlinkatFlags::NoRemoveDir)
            .map_err(|e| self.path_err("removing", path, e))
    }

    /// The status of the file at `path` itself: a symlink there is not followed.
    pub fn stat_no_follow(&self, path: &Path, how: Resolve) -> Result<FileStat> {
        let fd = self.openat2(
            path,
            how,
            OFlag::O_PATH | OFlag::O_NOFOLLOW,
            Mode::empty(),
            "resolving",
        )?;
        fstat(&fd).map_err(|e| self.path_err("stat", path, e))
    }

    /// The directory holding `path`'s last component, and that component.
    fn parent_of<'p>(
        &self,
        path: &'p Path,
        how: Resolve,
        op: &'static str,
    ) -> Result<(OwnedFd, &'p OsStr)> {
        let (parent, name) = split_last(path).ok_or_else(|| IsolationError::Path {
            op,
            root: self.path.clone(),
            path: path.to_owned(),
            source: Errno::EINVAL.into(),
        })?;
        let parent_fd = self
            .openat2(
                parent,
                how,
                OFlag::O_PATH | OFlag::O_DIRECTORY,
                Mode::empty(),
                "resolving the parent of",
            )
            .map_err(|e| match e {
                // Name the path asked for, not just its parent.
                IsolationError::Path { source, .. } => self.path_err_io(op, path, source),
                IsolationError::PathEscapesRoot { .. } => IsolationError::PathEscapesRoot {
                    root: self.path.clone(),
                    path: path.to_owned(),
                },
                other => other,
            })?;
        Ok((parent_fd, name))
    }

    /// Reopens what was just made in `parent_fd` without following anything: if it was
    /// swapped for a symlink in between, this fails instead of handing out the symlink's
    /// target.
    fn reopen_new(
        &self,
        parent_fd: &OwnedFd,
        name: &OsStr,
        path: &Path,
        flags: OFlag,
    ) -> Result<SafePath> {
        let fd = nix::fcntl::openat2(
            parent_fd,
            name,
            OpenHow::new()
                .flags(OFlag::O_PATH | flags | OFlag::O_CLOEXEC)
                .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS),
        )
        .map_err(|e| self.path_err("opening new", path, e))?;
        Ok(SafePath {
            fd,
            root: self.path.clone(),
            path: path.to_owned(),
        })
    }

    fn openat2(
        &self,
        path: &Path,
        how: Resolve,
        flags: OFlag,
        mode: Mode,
        op: &'static str,
    ) -> Result<OwnedFd> {
        let rel = relative(path);
        let resolve = ResolveFlag::RESOLVE_NO_MAGICLINKS
            | match how {
                Resolve::InRoot => ResolveFlag::RESOLVE_IN_ROOT,
                Resolve::Beneath => ResolveFlag::RESOLVE_BENEATH,
            };
        let open_how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .mode(mode)
            .resolve(resolve);
        loop {
            match openat2(&self.fd, rel, open_how) {
                Ok(fd) => return Ok(fd),
                // A rename or mount elsewhere raced the walk; the kernel asks for a retry.
                Err(Errno::EAGAIN) => {}
                Err(Errno::EXDEV) => {
                    return Err(IsolationError::PathEscapesRoot {
                        root: self.path.clone(),
                        path: path.to_owned(),
                    });
                }
                Err(Errno::ENOSYS) => return Err(IsolationError::Openat2Unavailable),
                Err(e) => return Err(self.path_err(op, path, e)),
            }
        }
    }

    fn path_err(&self, op: &'static str, path: &Path, e: Errno) -> IsolationError {
        self.path_err_io(op, path, e.into())
    }

    fn path_err_io(&self, op: &'static str, path: &Path, source: std::io::Error) -> IsolationError {
        IsolationError::Path {
            op,
            root: self.path.clone(),
            path: path.to_owned(),
            source,
        }
    }
}

/// Resolves the unix socket `path` for connecting, when its directory is trusted but the name
/// in it is not: a pod's emptyDir as the kubelet made it, seen from the node, holds whatever the
/// pod put there. A pod that replaced its socket with a symlink to a socket of the node (the
/// container runtime's, another pod's launcher) would have a plain `connect` by virt-handler,
/// root in the node's mount namespace, talk to that one instead. The name is resolved beneath
/// the directory, so an absolute or climbing link fails with
/// [`IsolationError::PathEscapesRoot`]; connect to the handle's [`SafePath::proc_fd_path`],
/// which reaches exactly the socket resolved. Other failures are [`IsolationError::Connect`].
pub fn open_socket(path: &Path) -> Result<SafePath> {
    let connect_err = |source| IsolationError::Connect {
        socket: path.to_owned(),
        source,
    };
    let (dir, name) = split_last(path)
        .ok_or_else(|| connect_err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let resolved =
        MountRoot::open(dir).and_then(|root| root.resolve(Path::new(name), Resolve::Beneath));
    resolved.map_err(|e| match e {
        IsolationError::Path { source, .. } => connect_err(source),
        e => e,
    })
}

/// `/a/b` and `a/b` both mean "a/b under the root"; the empty path means the root.
fn relative(path: &Path) -> &Path {
    let rel = path.strip_prefix("/").unwrap_or(path);
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

fn split_last(path: &Path) -> Option<(&Path, &OsStr)> {
    match path.components().next_back()? {
        Component::Normal(name) => Some((path.parent().unwrap_or(Path::new("")), name)),
        _ => None,
    }
}

/// A resolved file or directory under a root, held by an `O_PATH` descriptor.
#[derive(Debug)]
pub struct SafePath {
    fd: OwnedFd,
    root: PathBuf,
    path: PathBuf,
}

impl SafePath {
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The path it was resolved from, relative to [`SafePath::root`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `/proc/self/fd/<n>`: a name for exactly this file, for tools that want a path.
    /// It only works in a mount namespace whose `/proc` shows this process.
    pub fn proc_fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }

    pub fn metadata(&self) -> Result<FileStat> {
        fstat(&self.fd).map_err(|e| self.err("stat", e))
    }

    /// Opens the very file this handle holds (through its `/proc/self/fd` name, which the
    /// kernel resolves to the handle's file, not by walking a path again).
    pub fn open(&self, flags: OFlag) -> Result<File> {
        nix::fcntl::open(
            &self.proc_fd_path(),
            (flags | OFlag::O_CLOEXEC) & !OFlag::O_CREAT,
            Mode::empty(),
        )
        .map(File::from)
        .map_err(|e| self.err("reopening", e))
    }

    /// Changes owner and/or group of the file itself (never a symlink's target).
    pub fn chown(&self, uid: Option<u32>, gid: Option<u32>) -> Result<()> {
        fchownat(
            &self.fd,
            "",
            uid.map(Uid::from_raw),
            gid.map(Gid::from_raw),
            AtFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| self.err("chown", e))
    }

    /// Bind-mounts this file or directory onto `target`, both held by handles, with the
    /// new mount API (open_tree + move_mount): no path is walked again, and nothing depends
    /// on `/proc`. The kernel only mounts within the caller's mount namespace: to mount
    /// inside a pod, resolve both handles and call this inside
    /// [`crate::PodIsolation::run_in_namespace`] for [`crate::NsKind::Mnt`]. When source and
    /// target live in different mount namespaces, use [`SafePath::clone_mount`] in the
    /// source's and [`DetachedMount::attach_onto`] in the target's.
    pub fn bind_mount_onto(&self, target: &SafePath) -> Result<()> {
        self.clone_mount()?.attach_onto(target)
    }

    /// A copy of the mount at this file or directory (open_tree with `OPEN_TREE_CLONE`),
    /// attached nowhere yet. The kernel clones only mounts of the caller's own mount
    /// namespace (`EINVAL` otherwise), so for a file inside a pod call this within
    /// [`crate::PodIsolation::run_in_namespace`] of that pod's process.
    pub fn clone_mount(&self) -> Result<DetachedMount> {
        let source = self.root.join(relative(&self.path));
        // SAFETY: open_tree takes a dirfd we own, an empty C string and flags; it returns
        // a new descriptor or -1.
        let tree = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_EMPTY_PATH as u32,
            )
        };
        let mount_err = |e: Errno| IsolationError::Mount {
            source_path: source.clone(),
            target: PathBuf::new(),
            source: e.into(),
        };
        let tree = Errno::result(tree).map_err(mount_err)?;
        let tree = libc::c_int::try_from(tree).map_err(|_| mount_err(Errno::EBADF))?;
        // SAFETY: the kernel just returned this descriptor; nothing else owns it.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(tree) };
        Ok(DetachedMount { fd, source })
    }

    fn err(&self, op: &'static str, e: Errno) -> IsolationError {
        IsolationError::Path {
            op,
            root: self.root.clone(),
            path: self.path.clone(),
            source: e.into(),
        }
    }
}

/// A mount made by [`SafePath::clone_mount`] and not attached anywhere yet. Dropping it
/// unmounts it.
#[derive(Debug)]
pub struct DetachedMount {
    fd: OwnedFd,
    source: PathBuf,
}

impl DetachedMount {
    /// Makes the mount read-only (mount_setattr, Linux 5.12). Done before it is attached,
    /// the mount is never visible writable.
    pub fn make_read_only(&self) -> Result<()> {
        let mut attr = libc::mount_attr {
            attr_set: libc::MOUNT_ATTR_RDONLY,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        // SAFETY: a descriptor we own, an empty C string, and a mount_attr of the size
        // passed, valid for the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &raw mut attr,
                size_of::<libc::mount_attr>(),
            )
        };
        Errno::result(ret)
            .map(drop)
            .map_err(|e| IsolationError::Mount {
                source_path: self.source.clone(),
                target: PathBuf::new(),
                source: e.into(),
            })
    }

    /// Attaches the mount onto `target` (move_mount). The target must be in the caller's
    /// mount namespace: inside a pod, call this within
    /// [`crate::PodIsolation::run_in_namespace`] for [`crate::NsKind::Mnt`].
    pub fn attach_onto(self, target: &SafePath) -> Result<()> {
        // SAFETY: both descriptors are ours and live for the call; paths are empty strings.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                target.fd.as_raw_fd(),
                c"".as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        Errno::result(ret)
            .map(drop)
            .map_err(|e| IsolationError::Mount {
                source_path: self.source.clone(),
                target: target.root.join(relative(&target.path)),
                source: e.into(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_relative_to_the_root() {
        assert_eq!(relative(Path::new("/a/b")), Path::new("a/b"));
        assert_eq!(relative(Path::new("a/b")), Path::new("a/b"));
        assert_eq!(relative(Path::new("/")), Path::new("."));
        assert_eq!(relative(Path::new("")), Path::new("."));
    }

    #[test]
    fn last_component_must_be_a_name() {
        assert_eq!(
            split_last(Path::new("/a/b")),
            Some((Path::new("/a"), OsStr::new("b")))
        );
        assert_eq!(
            split_last(Path::new("b")),
            Some((Path::new(""), OsStr::new("b")))
        );
        assert_eq!(split_last(Path::new("a/..")), None);
        assert_eq!(split_last(Path::new("/")), None);
    }
}
