//! The image table: how a container image reference becomes a root file system.
//!
//! There is no container engine or registry here, so each image the cluster may run is listed in
//! one YAML file mapping an image reference (or a prefix ending in `*`) to a root:
//!
//! ```yaml
//! kubevirt-rs/virt-launcher:*: {rootfs: host}
//! kubevirt-rs/test-guest-disk:latest: {rootfs: /work/main/.cache/guest/containerdisk}
//! ```
//!
//! `host` means the host's own root file system (our component images: their binaries and QEMU
//! are host binaries, found through the bin dir put first on `PATH`). A directory's top-level
//! entries are bound read-only over the host root, so a container-disk image shows its
//! `disk/disk.qcow2` at `/disk/disk.qcow2` while host tools still run inside it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Why the image table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("reading the image table {path}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing the image table {path}")]
    Parse {
        path: String,
        source: Box<serde_saphyr::Error>,
    },
    #[error("image table {path}: entry {image:?} has an empty rootfs")]
    EmptyRoot { path: String, image: String },
}

/// The root file system of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rootfs {
    /// The host's root, as is.
    Host,
    /// This directory's entries bound read-only over the host's root.
    Dir(PathBuf),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    rootfs: String,
}

/// Image references and their roots, exact references first, then prefixes (longest first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageTable {
    exact: BTreeMap<String, Rootfs>,
    prefixes: Vec<(String, Rootfs)>,
}

impl ImageTable {
    /// Parses a table; `origin` names it in errors and relative directories are taken from `base`.
    pub fn parse(text: &str, origin: &str, base: &Path) -> Result<Self, ImageError> {
        let raw: BTreeMap<String, Entry> =
            serde_saphyr::from_str(text).map_err(|source| ImageError::Parse {
                path: origin.into(),
                source: Box::new(source),
            })?;
        let mut table = Self::default();
        for (image, entry) in raw {
            let root = match entry.rootfs.as_str() {
                "" => {
                    return Err(ImageError::EmptyRoot {
                        path: origin.into(),
                        image,
                    });
                }
                "host" => Rootfs::Host,
                dir => Rootfs::Dir(base.join(dir)),
            };
            table.insert(&image, root);
        }
        Ok(table)
    }

    /// Reads a table file; relative directories are taken from the file's directory.
    pub fn load(path: &Path) -> Result<Self, ImageError> {
        let text = std::fs::read_to_string(path).map_err(|source| ImageError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(
            &text,
            &path.display().to_string(),
            path.parent().unwrap_or(Path::new("/")),
        )
    }

    /// The project's own images: components run on the host root, the test guest's container
    /// disk and kernel images come from the guest build under `guest_dir`.
    pub fn builtin(guest_dir: &Path) -> Self {
        let mut table = Self::default();
        table.insert("kubevirt-rs/*", Rootfs::Host);
        table.insert("quay.io/kubevirt/*", Rootfs::Host);
        table.insert(
            "kubevirt-rs/test-guest-disk:latest",
            Rootfs::Dir(guest_dir.join("containerdisk")),
        );
        table.insert(
            "kubevirt-rs/test-guest-kernel:latest",
            Rootfs::Dir(guest_dir.join("kernel-image")),
        );
        table
    }

    /// Adds or replaces one entry (a trailing `*` makes it a prefix).
    pub fn insert(&mut self, image: &str, root: Rootfs) {
        if let Some(prefix) = image.strip_suffix('*') {
            self.prefixes.retain(|(p, _)| p != prefix);
            self.prefixes.push((prefix.to_string(), root));
            self.prefixes
                .sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        } else {
            self.exact.insert(image.to_string(), root);
        }
    }

    /// Entries of `other` override this table's.
    pub fn merge(&mut self, other: Self) {
        for (image, root) in other.exact {
            self.exact.insert(image, root);
        }
        for (prefix, root) in other.prefixes {
            self.insert(&format!("{prefix}*"), root);
        }
    }

    /// The root of `image`: its exact entry, else the longest matching prefix.
    pub fn resolve(&self, image: &str) -> Option<&Rootfs> {
        self.exact.get(image).or_else(|| {
            self.prefixes
                .iter()
                .find(|(p, _)| image.starts_with(p.as_str()))
                .map(|(_, r)| r)
        })
    }
}

/// Where a `host` image shows the binaries of the kubelet's bin dir, as if the image shipped them.
pub const IMAGE_BIN_DIR: &str = "/usr/bin";

/// The programs of a bin dir that `host` images carry in [`IMAGE_BIN_DIR`]: its executable
/// regular files (symlinks followed), sorted. A cargo target dir also holds `.d` files, rlibs and
/// directories, none of which is a program. Empty when the bin dir is `/usr/bin` itself.
pub fn image_binaries(bin_dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::PermissionsExt as _;
    if std::fs::canonicalize(bin_dir)? == Path::new(IMAGE_BIN_DIR) {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(bin_dir)? {
        let path = entry?.path();
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if meta.is_file() && meta.permissions().mode() & 0o111 != 0 {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Lays out the test guest's kernel image (`boot/vmlinuz`, `boot/initrd.img`) under
/// `<guest_dir>/kernel-image` from the guest build's `vmlinuz` and `initrd.img`, by hard link
/// where possible, so `kubevirt-rs/test-guest-kernel:latest` resolves to a real directory.
pub fn prepare_guest_kernel_image(guest_dir: &Path) -> std::io::Result<PathBuf> {
    let dir = guest_dir.join("kernel-image");
    let boot = dir.join("boot");
    std::fs::create_dir_all(&boot)?;
    for file in ["vmlinuz", "initrd.img"] {
        let target = boot.join(file);
        if target.exists() {
            continue;
        }
        let source = guest_dir.join(file);
        if std::fs::hard_link(&source, &target).is_err() {
            std::fs::copy(&source, &target)?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_beats_prefix_and_longest_prefix_wins() {
        let table = ImageTable::parse(
            "kubevirt-rs/*: {rootfs: host}\nkubevirt-rs/disks/*: {rootfs: disks}\nkubevirt-rs/disks/one:1: {rootfs: /one}\n",
            "t.yaml",
            Path::new("/base"),
        )
        .unwrap();
        assert_eq!(
            table.resolve("kubevirt-rs/virt-handler:v1"),
            Some(&Rootfs::Host)
        );
        assert_eq!(
            table.resolve("kubevirt-rs/disks/two:1"),
            Some(&Rootfs::Dir("/base/disks".into()))
        );
        assert_eq!(
            table.resolve("kubevirt-rs/disks/one:1"),
            Some(&Rootfs::Dir("/one".into()))
        );
        assert_eq!(table.resolve("docker.io/library/nginx:1"), None);
    }

    #[test]
    fn bad_tables_name_the_file() {
        let err = ImageTable::parse("a: {root: host}", "images.yaml", Path::new("/"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("images.yaml"), "{err}");
        let err = ImageTable::parse("a: {rootfs: ''}", "images.yaml", Path::new("/"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"a\" has an empty rootfs"), "{err}");
    }

    #[test]
    fn image_binaries_are_the_executable_files() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, mode: u32| {
            let p = dir.path().join(name);
            std::fs::write(&p, b"x").unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        write("virt-launcher", 0o755);
        write("container-disk", 0o700);
        write("virt-launcher.d", 0o644);
        write("libapi.rlib", 0o644);
        std::fs::create_dir(dir.path().join("deps")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("virt-launcher"), dir.path().join("alias"))
            .unwrap();
        std::os::unix::fs::symlink(dir.path().join("missing"), dir.path().join("dangling"))
            .unwrap();
        let names: Vec<String> = image_binaries(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["alias", "container-disk", "virt-launcher"]);
        assert!(image_binaries(Path::new("/usr/bin")).unwrap().is_empty());
    }

    #[test]
    fn builtin_maps_the_guest_images() {
        let mut table = ImageTable::builtin(Path::new("/g"));
        assert_eq!(
            table.resolve("kubevirt-rs/test-guest-disk:latest"),
            Some(&Rootfs::Dir("/g/containerdisk".into()))
        );
        assert_eq!(
            table.resolve("kubevirt-rs/test-guest-kernel:latest"),
            Some(&Rootfs::Dir("/g/kernel-image".into()))
        );
        assert_eq!(
            table.resolve("kubevirt-rs/virt-launcher:dev"),
            Some(&Rootfs::Host)
        );
        table.merge(ImageTable::parse("kubevirt-rs/*: {rootfs: /x}", "o", Path::new("/")).unwrap());
        assert_eq!(
            table.resolve("kubevirt-rs/virt-launcher:dev"),
            Some(&Rootfs::Dir("/x".into()))
        );
    }
}
