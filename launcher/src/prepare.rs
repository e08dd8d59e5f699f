//! The files a plan needs before QEMU starts: overlays, empty disks, seed images, the EFI
//! variable store. The only I/O step between the pure converter and QEMU; images are made with
//! `qemu-img`, the tool that knows the formats QEMU will open.

use std::path::{Path, PathBuf};

use tokio::process::Command;

use crate::qemu::ImageFormat;

/// What a cloud-init seed image carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub config_drive: bool,
    pub instance_id: String,
    pub hostname: String,
    pub user_data: SeedData,
    pub network_data: Option<SeedData>,
}

/// Where a seed's user or network data comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeedData {
    /// Written in the VMI.
    Inline(Vec<u8>),
    /// A Secret's key, read when the seed is written: the first of `keys` that is a file in
    /// `dir`, where the launcher pod has the Secret mounted. The content is never kept in a
    /// plan, so it cannot reach a log. `field` names the reference.
    Secret {
        dir: PathBuf,
        keys: [&'static str; 2],
        field: String,
    },
}

/// One preparation step. `field` names the part of the VMI that asked for it, for errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prep {
    /// The file (or block device) must already exist.
    RequireFile { path: PathBuf, field: String },
    /// Copy a template unless the target exists (the EFI variable store survives reboots and,
    /// with `efi.persistent`, restarts); an existing target must have the template's size.
    CopyFile {
        from: PathBuf,
        to: PathBuf,
        field: String,
    },
    /// A fresh qcow2 overlay over `backing`. With no format given the backing file is probed,
    /// as KubeVirt does for container disks.
    Overlay {
        path: PathBuf,
        backing: PathBuf,
        backing_format: Option<ImageFormat>,
        field: String,
    },
    /// A sparse qcow2 of `size` bytes unless one exists.
    EmptyDisk {
        path: PathBuf,
        size: u64,
        field: String,
    },
    /// A sparse raw file of `size` bytes unless the path exists (hostDisk DiskOrCreate).
    RawIfMissing {
        path: PathBuf,
        size: u64,
        field: String,
    },
    CloudInit {
        path: PathBuf,
        seed: Seed,
        field: String,
    },
    /// An ISO image with volume label `label` of the files under `source` (a ConfigMap,
    /// Secret, Downward API or service account volume of the launcher pod), written afresh.
    ConfigDisk {
        source: PathBuf,
        path: PathBuf,
        label: String,
        field: String,
    },
    /// The tap device for an interface must exist in this network namespace.
    RequireTap { name: String, field: String },
    /// `path` must be a hugetlbfs mount of this page size. Elsewhere QEMU would quietly back
    /// guest RAM with ordinary pages in a plain file.
    RequireHugetlbfs {
        path: PathBuf,
        page_size: u64,
        field: String,
    },
    /// A unix socket another container of the pod binds (virtiofsd's) must appear within
    /// `within`. It is not connected to: virtiofsd serves the first connection only.
    WaitForSocket {
        path: PathBuf,
        within: std::time::Duration,
        field: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("{field}: {} does not exist", path.display())]
    Missing { field: String, path: PathBuf },
    #[error("{field}: {} is not a usable disk image: {message}", path.display())]
    BadImage {
        field: String,
        path: PathBuf,
        message: String,
    },
    #[error("{field}: qemu-img could not create {}: {message}", path.display())]
    QemuImg {
        field: String,
        path: PathBuf,
        message: String,
    },
    #[error("{field}: {}", path.display())]
    Io {
        field: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{field}: cannot write the seed image")]
    Seed {
        field: String,
        #[source]
        source: cloudinit::Error,
    },
    #[error(
        "{field}: the Secret has none of the keys {} (looked in {})",
        keys.join(", "),
        dir.display()
    )]
    NoSecretKey {
        field: String,
        dir: PathBuf,
        keys: [&'static str; 2],
    },
    #[error("{field}: cannot write the disk image")]
    ConfigDisk {
        field: String,
        #[source]
        source: cloudinit::Error,
    },
    #[error(
        "{field}: tap device {name} does not exist in the launcher's network namespace \
         (the node's network setup creates it)"
    )]
    NoTap { field: String, name: String },
    /// A kept file (the EFI variable store) that QEMU would refuse or misread: another
    /// firmware's, or damaged.
    #[error(
        "{field}: {} holds {size} bytes, but its template {} holds {want}: delete it to start \
         from the template again",
        path.display(),
        template.display()
    )]
    WrongSize {
        field: String,
        path: PathBuf,
        size: u64,
        template: PathBuf,
        want: u64,
    },
    #[error(
        "{field}: {} is not a hugetlbfs mount of {page_size}-byte pages ({found}); the node \
         must mount one (--hugepages-dir) and reserve pages",
        path.display()
    )]
    NoHugetlbfs {
        field: String,
        path: PathBuf,
        page_size: u64,
        found: String,
    },
    #[error(
        "{field}: no virtiofsd listens on {} after {within:?} (its container, virtiofs-<name>, \
         serves it)",
        path.display()
    )]
    NoSocket {
        field: String,
        path: PathBuf,
        within: std::time::Duration,
    },
}

fn io(field: &str, path: &Path) -> impl FnOnce(std::io::Error) -> PrepareError {
    let (field, path) = (field.to_owned(), path.to_owned());
    move |source| PrepareError::Io {
        field,
        path,
        source,
    }
}

fn ensure_parent(path: &Path, field: &str) -> Result<(), PrepareError> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(io(field, parent))?;
    }
    Ok(())
}

async fn qemu_img(qemu_img: &Path, args: &[&std::ffi::OsStr]) -> Result<Vec<u8>, String> {
    let out = Command::new(qemu_img)
        .args(args)
        .output()
        .await
        .map_err(|e| format!("cannot run {}: {e}", qemu_img.display()))?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

/// The format `qemu-img info` detects.
async fn probe_format(qemu_img: &Path, image: &Path) -> Result<String, String> {
    let out = qemu_img_info(qemu_img, image).await?;
    let v: serde_json::Value =
        serde_json::from_slice(&out).map_err(|e| format!("unreadable qemu-img info: {e}"))?;
    v["format"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| "qemu-img info reported no format".to_owned())
}

async fn qemu_img_info(bin: &Path, image: &Path) -> Result<Vec<u8>, String> {
    qemu_img(
        bin,
        &["info".as_ref(), "--output=json".as_ref(), image.as_os_str()],
    )
    .await
}

pub async fn run(qemu_img_bin: &Path, preps: &[Prep]) -> Result<(), PrepareError> {
    for p in preps {
        run_one(qemu_img_bin, p).await?;
    }
    Ok(())
}

async fn run_one(bin: &Path, prep: &Prep) -> Result<(), PrepareError> {
    match prep {
        Prep::RequireFile { path, field } => {
            if !path.exists() {
                return Err(PrepareError::Missing {
                    field: field.clone(),
                    path: path.clone(),
                });
            }
        }
        Prep::CopyFile { from, to, field } => match std::fs::metadata(to) {
            Ok(kept) => {
                let want = std::fs::metadata(from).map_err(io(field, from))?.len();
                if kept.len() != want {
                    return Err(PrepareError::WrongSize {
                        field: field.clone(),
                        path: to.clone(),
                        size: kept.len(),
                        template: from.clone(),
                        want,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                ensure_parent(to, field)?;
                std::fs::copy(from, to).map_err(io(field, from))?;
            }
            Err(e) => return Err(io(field, to)(e)),
        },
        Prep::Overlay {
            path,
            backing,
            backing_format,
            field,
        } => overlay(bin, path, backing, *backing_format, field).await?,
        Prep::EmptyDisk { path, size, field } => {
            if !path.exists() {
                empty_disk(bin, path, *size, field).await?;
            }
        }
        Prep::RawIfMissing { path, size, field } => {
            if !path.exists() {
                ensure_parent(path, field)?;
                let f = std::fs::File::create_new(path).map_err(io(field, path))?;
                f.set_len(*size).map_err(io(field, path))?;
            }
        }
        Prep::CloudInit { path, seed, field } => cloud_init(path, seed, field)?,
        Prep::ConfigDisk {
            source,
            path,
            label,
            field,
        } => config_disk(source, path, label, field)?,
        Prep::RequireTap { name, field } => {
            // Asked of the kernel in our network namespace: /sys/class/net shows the namespace
            // of whoever mounted sysfs, which in a pod without its own sysfs is the host's.
            if nix::net::if_::if_nametoindex(name.as_str()).is_err() {
                return Err(PrepareError::NoTap {
                    field: field.clone(),
                    name: name.clone(),
                });
            }
        }
        Prep::RequireHugetlbfs {
            path,
            page_size,
            field,
        } => require_hugetlbfs(path, *page_size, field)?,
        Prep::WaitForSocket {
            path,
            within,
            field,
        } => wait_for_socket(path, *within, field).await?,
    }
    Ok(())
}

/// Polls until `path` is a unix socket: the other container's start is not something this
/// process can be told about.
async fn wait_for_socket(
    path: &Path,
    within: std::time::Duration,
    field: &str,
) -> Result<(), PrepareError> {
    use std::os::unix::fs::FileTypeExt;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(PrepareError::NoSocket {
                field: field.to_owned(),
                path: path.to_owned(),
                within,
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A fresh qcow2 overlay over `backing` (any old one removed), in the backing format given or
/// the one `qemu-img info` detects.
async fn overlay(
    bin: &Path,
    path: &Path,
    backing: &Path,
    backing_format: Option<ImageFormat>,
    field: &str,
) -> Result<(), PrepareError> {
    if !backing.exists() {
        return Err(PrepareError::Missing {
            field: field.to_owned(),
            path: backing.to_owned(),
        });
    }
    let format = match backing_format {
        Some(f) => f.as_str().to_owned(),
        None => probe_format(bin, backing)
            .await
            .map_err(|message| PrepareError::BadImage {
                field: field.to_owned(),
                path: backing.to_owned(),
                message,
            })?,
    };
    ensure_parent(path, field)?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io(field, path)(e));
        }
        _ => {}
    }
    create_qcow2(
        bin,
        &[
            "-F".as_ref(),
            format.as_ref(),
            "-b".as_ref(),
            backing.as_os_str(),
            path.as_os_str(),
        ],
    )
    .await
    .map_err(|message| PrepareError::BadImage {
        field: field.to_owned(),
        path: backing.to_owned(),
        message,
    })
}

/// A sparse qcow2 image of `size` bytes.
async fn empty_disk(bin: &Path, path: &Path, size: u64, field: &str) -> Result<(), PrepareError> {
    ensure_parent(path, field)?;
    let size = size.to_string();
    create_qcow2(bin, &[path.as_os_str(), size.as_ref()])
        .await
        .map_err(|message| PrepareError::QemuImg {
            field: field.to_owned(),
            path: path.to_owned(),
            message,
        })
}

/// `qemu-img create -q -f qcow2 <args>`.
async fn create_qcow2(bin: &Path, args: &[&std::ffi::OsStr]) -> Result<(), String> {
    let mut all: Vec<&std::ffi::OsStr> = vec![
        "create".as_ref(),
        "-q".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
    ];
    all.extend_from_slice(args);
    qemu_img(bin, &all).await.map(drop)
}

/// The cloud-init seed image, written afresh every start.
fn cloud_init(path: &Path, seed: &Seed, field: &str) -> Result<(), PrepareError> {
    ensure_parent(path, field)?;
    let user_data = seed_data(&seed.user_data)?;
    let network_data = seed.network_data.as_ref().map(seed_data).transpose()?;
    let r = if seed.config_drive {
        cloudinit::write_config_drive(
            path,
            &cloudinit::ConfigDriveSeed {
                instance_id: seed.instance_id.clone(),
                hostname: seed.hostname.clone(),
                user_data,
                network_data,
            },
        )
    } else {
        cloudinit::write_nocloud(
            path,
            &cloudinit::NoCloudSeed {
                instance_id: seed.instance_id.clone(),
                hostname: seed.hostname.clone(),
                user_data,
                network_config: network_data,
            },
        )
    };
    r.map_err(|source| PrepareError::Seed {
        field: field.to_owned(),
        source,
    })
}

/// The bytes of a seed's user or network data. A Secret's key is read as KubeVirt reads it: the
/// first of the keys that can be read as a file (a key the Secret lacks is an empty directory
/// where the pod mounts it with `subPath`).
fn seed_data(data: &SeedData) -> Result<Vec<u8>, PrepareError> {
    match data {
        SeedData::Inline(bytes) => Ok(bytes.clone()),
        SeedData::Secret { dir, keys, field } => keys
            .iter()
            .find_map(|key| std::fs::read(dir.join(key)).ok())
            .ok_or_else(|| PrepareError::NoSecretKey {
                field: field.clone(),
                dir: dir.clone(),
                keys: *keys,
            }),
    }
}

/// A config disk, rebuilt every start from what the pod has mounted now, as KubeVirt does.
fn config_disk(source: &Path, path: &Path, label: &str, field: &str) -> Result<(), PrepareError> {
    if !source.is_dir() {
        return Err(PrepareError::Missing {
            field: field.to_owned(),
            path: source.to_owned(),
        });
    }
    let mut files = Vec::new();
    config_files(source, "", &mut files).map_err(io(field, source))?;
    ensure_parent(path, field)?;
    cloudinit::write_image(path, label, &files).map_err(|source| PrepareError::ConfigDisk {
        field: field.to_owned(),
        source,
    })
}

/// The files under `dir`, symbolic links followed (the kubelet's atomic writer links every key
/// to its current version), paths relative to the volume. Names starting with `..` are that
/// writer's bookkeeping (`..data`, `..<timestamp>`, `..<key>.tmp`), not keys: left out.
fn config_files(
    dir: &Path,
    prefix: &str,
    out: &mut Vec<cloudinit::SeedFile>,
) -> std::io::Result<()> {
    let mut entries = std::fs::read_dir(dir)?.collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("..") {
            continue;
        }
        let path = entry.path();
        let rel = format!("{prefix}{name}");
        if std::fs::metadata(&path)?.is_dir() {
            config_files(&path, &format!("{rel}/"), out)?;
        } else {
            out.push(cloudinit::SeedFile {
                path: rel,
                content: std::fs::read(&path)?,
            });
        }
    }
    Ok(())
}

/// `path` must be a hugetlbfs mount of `page_size`-byte pages.
fn require_hugetlbfs(path: &Path, page_size: u64, field: &str) -> Result<(), PrepareError> {
    let found = match nix::sys::statfs::statfs(path) {
        Err(e) => e.desc().to_owned(),
        Ok(fs) if fs.filesystem_type() != nix::sys::statfs::HUGETLBFS_MAGIC => {
            format!("file system type {:#x}", fs.filesystem_type().0)
        }
        Ok(fs) if u64::try_from(fs.block_size()).ok() != Some(page_size) => {
            format!("its pages are {} bytes", fs.block_size())
        }
        Ok(_) => return Ok(()),
    };
    Err(PrepareError::NoHugetlbfs {
        field: field.to_owned(),
        path: path.to_owned(),
        page_size,
        found,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img_bin() -> PathBuf {
        PathBuf::from("qemu-img")
    }

    /// The variable store is copied once, then kept as the guest left it; one of another size
    /// (another firmware's) is an error at the field, not QEMU's failure to start.
    #[tokio::test]
    async fn a_kept_variable_store_must_have_the_templates_size() {
        let dir = tempfile::tempdir().unwrap();
        let template = dir.path().join("OVMF_VARS_4M.fd");
        std::fs::write(&template, [0u8; 64]).unwrap();
        let vars = dir.path().join("nvram/vm1_VARS.fd");
        let prep = Prep::CopyFile {
            from: template,
            to: vars.clone(),
            field: "spec.domain.firmware.bootloader.efi.persistent".into(),
        };
        run(&qemu_img_bin(), std::slice::from_ref(&prep))
            .await
            .unwrap();
        std::fs::write(&vars, [7u8; 64]).unwrap();
        run(&qemu_img_bin(), std::slice::from_ref(&prep))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read(&vars).unwrap(),
            [7u8; 64],
            "kept, not copied again"
        );
        std::fs::write(&vars, [7u8; 32]).unwrap();
        let e = run(&qemu_img_bin(), std::slice::from_ref(&prep))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                PrepareError::WrongSize {
                    size: 32,
                    want: 64,
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with("spec.domain.firmware.bootloader.efi.persistent: "),
            "{e}"
        );
    }

    #[tokio::test]
    async fn overlay_over_a_qcow2_base() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        run(
            &qemu_img_bin(),
            &[Prep::EmptyDisk {
                path: base.clone(),
                size: 1 << 20,
                field: "f".into(),
            }],
        )
        .await
        .unwrap();
        let overlay = dir.path().join("o/disk.qcow2");
        let prep = Prep::Overlay {
            path: overlay.clone(),
            backing: base.clone(),
            backing_format: None,
            field: "f".into(),
        };
        run(&qemu_img_bin(), std::slice::from_ref(&prep))
            .await
            .unwrap();
        // Recreated, not reused: a second start gets a fresh overlay.
        run(&qemu_img_bin(), &[prep]).await.unwrap();
        let info = qemu_img_info(&qemu_img_bin(), &overlay).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&info).unwrap();
        assert_eq!(v["backing-filename"], base.to_str().unwrap());
        assert_eq!(v["backing-filename-format"], "qcow2");
    }

    #[tokio::test]
    async fn corrupt_qcow2_base_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("disk_0.img");
        let mut bytes = b"QFI\xfb".to_vec();
        bytes.extend([0xff; 508]);
        std::fs::write(&base, bytes).unwrap();
        let e = run(
            &qemu_img_bin(),
            &[Prep::Overlay {
                path: dir.path().join("o.qcow2"),
                backing: base.clone(),
                backing_format: None,
                field: "spec.volumes[0].containerDisk".into(),
            }],
        )
        .await
        .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, PrepareError::BadImage { .. }), "{msg}");
        assert!(msg.starts_with("spec.volumes[0].containerDisk: "), "{msg}");
        assert!(msg.contains("disk_0.img"), "{msg}");
    }

    #[tokio::test]
    async fn missing_files_and_taps_are_named() {
        let e = run(
            &qemu_img_bin(),
            &[Prep::RequireFile {
                path: "/nonexistent/vmlinuz".into(),
                field: "spec.domain.firmware.kernelBoot.container.kernelPath".into(),
            }],
        )
        .await
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "spec.domain.firmware.kernelBoot.container.kernelPath: /nonexistent/vmlinuz does \
             not exist"
        );
        let e = run(
            &qemu_img_bin(),
            &[Prep::RequireTap {
                name: "tap-nope9".into(),
                field: "spec.domain.devices.interfaces[0]".into(),
            }],
        )
        .await
        .unwrap_err();
        assert!(e.to_string().contains("tap-nope9"));
    }

    #[tokio::test]
    async fn hugepages_need_a_hugetlbfs_mount() {
        let dir = tempfile::tempdir().unwrap();
        let check = |path: PathBuf| Prep::RequireHugetlbfs {
            path,
            page_size: 2 << 20,
            field: "spec.domain.memory.hugepages".into(),
        };
        for path in [dir.path().to_owned(), dir.path().join("missing")] {
            let e = run(&qemu_img_bin(), &[check(path.clone())])
                .await
                .unwrap_err();
            let msg = e.to_string();
            assert!(msg.starts_with("spec.domain.memory.hugepages: "), "{msg}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains("not a hugetlbfs mount"), "{msg}");
        }
    }

    #[tokio::test]
    async fn a_virtiofs_socket_is_waited_for_and_a_missing_one_named() {
        let dir = tempfile::tempdir().unwrap();
        let wait = |path: PathBuf, within| Prep::WaitForSocket {
            path,
            within,
            field: "spec.domain.devices.filesystems[0]".into(),
        };
        let socket = dir.path().join("virtiofs-containers/cfg.sock");
        let prep = wait(socket.clone(), std::time::Duration::from_secs(20));
        let waiting = tokio::spawn(async move { run(&qemu_img_bin(), &[prep]).await });
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        waiting.await.unwrap().unwrap();

        // A file that is not a socket never satisfies the wait.
        let plain = dir.path().join("plain.sock");
        std::fs::write(&plain, "").unwrap();
        let e = run(
            &qemu_img_bin(),
            &[wait(plain.clone(), std::time::Duration::from_millis(200))],
        )
        .await
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("spec.domain.devices.filesystems[0]: no virtiofsd listens on "),
            "{msg}"
        );
        assert!(msg.contains(&plain.display().to_string()), "{msg}");
    }

    #[tokio::test]
    async fn disk_or_create_makes_a_sparse_file_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h/disk.img");
        let prep = Prep::RawIfMissing {
            path: path.clone(),
            size: 64 << 20,
            field: "f".into(),
        };
        run(&qemu_img_bin(), std::slice::from_ref(&prep))
            .await
            .unwrap();
        std::fs::write(&path, b"kept").unwrap();
        run(&qemu_img_bin(), &[prep]).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"kept");
    }

    /// A config disk holds the volume's keys as the pod has them (links followed, nested
    /// paths kept), not the kubelet's `..data` bookkeeping, under the volume's label.
    #[tokio::test]
    async fn config_disk_is_an_iso_of_the_mounted_keys() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("config-map/cm");
        let data = source.join("..2026_11_27_21_00_00.1");
        std::fs::create_dir_all(data.join("nested")).unwrap();
        std::fs::write(data.join("app.conf"), b"mode=fast\n").unwrap();
        std::fs::write(data.join("nested/b"), b"B").unwrap();
        std::os::unix::fs::symlink("..2026_11_27_21_00_00.1", source.join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/app.conf", source.join("app.conf")).unwrap();
        std::os::unix::fs::symlink("..data/nested", source.join("nested")).unwrap();
        let iso = dir.path().join("config-map-disks/cm.iso");
        let prep = Prep::ConfigDisk {
            source: source.clone(),
            path: iso.clone(),
            label: "appcfg".into(),
            field: "spec.volumes[1].configMap".into(),
        };
        run(&qemu_img_bin(), &[prep]).await.unwrap();
        let want = dir.path().join("want.iso");
        cloudinit::write_image(
            &want,
            "appcfg",
            &[
                cloudinit::SeedFile {
                    path: "app.conf".into(),
                    content: b"mode=fast\n".to_vec(),
                },
                cloudinit::SeedFile {
                    path: "nested/b".into(),
                    content: b"B".to_vec(),
                },
            ],
        )
        .unwrap();
        assert!(std::fs::read(&iso).unwrap() == std::fs::read(&want).unwrap());

        let e = run(
            &qemu_img_bin(),
            &[Prep::ConfigDisk {
                source: dir.path().join("secret/absent"),
                path: dir.path().join("secret-disks/absent.iso"),
                label: "cfgdata".into(),
                field: "spec.volumes[2].secret".into(),
            }],
        )
        .await
        .unwrap_err();
        assert!(
            e.to_string().starts_with("spec.volumes[2].secret: ")
                && e.to_string().contains("absent"),
            "{e}"
        );
    }

    /// A cloud-init Secret reference reads the first key the pod has as a file (a key the
    /// Secret lacks is an empty directory under `subPath`); none names the reference.
    #[tokio::test]
    async fn cloud_init_secret_keys_are_read_in_kubevirts_order() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = dir.path().join("secret/ci");
        std::fs::create_dir_all(secrets.join("userdata")).unwrap();
        std::fs::write(secrets.join("userData"), b"#cloud-config\n").unwrap();
        std::fs::create_dir_all(secrets.join("networkdata")).unwrap();
        std::fs::create_dir_all(secrets.join("networkData")).unwrap();
        let seed = |network: bool| Seed {
            config_drive: false,
            instance_id: "vm1.ns".into(),
            hostname: "vm1".into(),
            user_data: SeedData::Secret {
                dir: secrets.clone(),
                keys: api::configdisk::USER_DATA_KEYS,
                field: "spec.volumes[0].cloudInitNoCloud.secretRef".into(),
            },
            network_data: network.then(|| SeedData::Secret {
                dir: secrets.clone(),
                keys: api::configdisk::NETWORK_DATA_KEYS,
                field: "spec.volumes[0].cloudInitNoCloud.networkDataSecretRef".into(),
            }),
        };
        let path = dir.path().join("noCloud.iso");
        let prep = |network| Prep::CloudInit {
            path: path.clone(),
            seed: seed(network),
            field: "spec.volumes[0].cloudInitNoCloud".into(),
        };
        run(&qemu_img_bin(), &[prep(false)]).await.unwrap();
        let want = dir.path().join("want.iso");
        cloudinit::write_nocloud(
            &want,
            &cloudinit::NoCloudSeed {
                instance_id: "vm1.ns".into(),
                hostname: "vm1".into(),
                user_data: b"#cloud-config\n".to_vec(),
                network_config: None,
            },
        )
        .unwrap();
        assert!(std::fs::read(&path).unwrap() == std::fs::read(&want).unwrap());

        let e = run(&qemu_img_bin(), &[prep(true)]).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "spec.volumes[0].cloudInitNoCloud.networkDataSecretRef: the Secret has none of \
                 the keys networkdata, networkData (looked in {})",
                secrets.display()
            )
        );
    }
}
