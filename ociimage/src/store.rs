use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use crate::digest::{Digest, Hashing};
use crate::layout::{IndexEntry, Layout, LayoutError, temp_name};
use crate::reference::{Reference, ReferenceError};

/// Why an image could not be imported or run.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Reference(#[from] ReferenceError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "image {image} is not in the local image store (it has: {known}); load it with `localcluster load ARCHIVE`"
    )]
    NotFound { image: String, known: String },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What an image says about running it (the OCI config's `config`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `NAME=value` pairs.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

/// An image ready to run: its layers unpacked, bottom first.
#[derive(Debug, Clone)]
pub struct Image {
    /// The reference it was found by, normalised.
    pub name: String,
    /// `repository@manifest-digest`: the pod status's `imageID`.
    pub id: String,
    pub config: ImageConfig,
    pub layers: Vec<PathBuf>,
}

/// The images a node can run: an OCI layout (`<dir>/oci`) holding every imported image, and
/// each layer unpacked once (`<dir>/layers/<diff-id hex>`) to serve as a read-only overlay
/// lower layer.
#[derive(Debug, Clone)]
pub struct Store {
    layout: Layout,
    layers: PathBuf,
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let layout = Layout::create(&dir.join("oci"))?;
        let layers = dir.join("layers");
        std::fs::create_dir_all(&layers).map_err(io(&layers))?;
        Ok(Self { layout, layers })
    }

    /// The image names the store holds, sorted.
    pub fn names(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .layout
            .index()?
            .into_iter()
            .filter_map(|e| e.name)
            .collect())
    }

    /// Imports every named image of an OCI archive (a file) or image layout (a directory);
    /// returns their names. Blobs are checked against their digests as they come in.
    pub fn import(&self, path: &Path) -> Result<Vec<String>, StoreError> {
        if path.is_dir() {
            return self.import_layout(&Layout::open(path)?);
        }
        let staging = temp_name(self.layout.dir(), "import");
        let result = unpack_archive(path, &staging)
            .and_then(|()| Ok(Layout::open(&staging)?))
            .and_then(|l| self.import_layout(&l));
        let _ = std::fs::remove_dir_all(&staging);
        result
    }

    fn import_layout(&self, from: &Layout) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        for entry in from.index()? {
            let Some(name) = entry.name.clone() else {
                continue;
            };
            let reference = Reference::parse(&name)?;
            let manifest = self.copy_image(from, &entry)?;
            self.layout.name(&reference, &manifest)?;
            names.push(reference.to_string());
        }
        if names.is_empty() {
            return Err(StoreError::Invalid {
                path: from.dir().display().to_string(),
                message: format!(
                    "no named image: each index entry needs an {} annotation or an org.opencontainers.image.ref.name that is a whole reference",
                    crate::ANNOTATION_IMAGE_NAME
                ),
            });
        }
        Ok(names)
    }

    /// Copies one image's blobs (choosing linux/amd64 from a multi-platform index); returns
    /// the index entry of its image manifest.
    fn copy_image(&self, from: &Layout, entry: &IndexEntry) -> Result<IndexEntry, StoreError> {
        self.copy_blob(from, &entry.digest)?;
        if entry.media_type.contains("index") || entry.media_type.contains("manifest.list") {
            let path = from.blob(&entry.digest);
            let index: oci_spec::image::ImageIndex =
                serde_json::from_slice(&from.read_blob(&entry.digest)?).map_err(|e| {
                    StoreError::Invalid {
                        path: path.display().to_string(),
                        message: format!("not an image index: {e}"),
                    }
                })?;
            let chosen = index
                .manifests()
                .iter()
                .find(|m| {
                    m.platform().as_ref().is_none_or(|p| {
                        p.os().to_string() == "linux" && p.architecture().to_string() == "amd64"
                    })
                })
                .ok_or_else(|| StoreError::Invalid {
                    path: path.display().to_string(),
                    message: "the index has no linux/amd64 image".into(),
                })?;
            let chosen = IndexEntry {
                name: None,
                digest: Digest::parse(chosen.digest().as_ref()).map_err(|e| {
                    StoreError::Invalid {
                        path: path.display().to_string(),
                        message: e.to_string(),
                    }
                })?,
                size: chosen.size(),
                media_type: chosen.media_type().to_string(),
            };
            return self.copy_image(from, &chosen);
        }
        for blob in from.manifest_blobs(&entry.digest)? {
            self.copy_blob(from, &blob)?;
        }
        Ok(entry.clone())
    }

    /// Links (or copies) a blob in, after checking its bytes hash to its name.
    fn copy_blob(&self, from: &Layout, digest: &Digest) -> Result<(), StoreError> {
        let target = self.layout.blob(digest);
        if target.exists() {
            return Ok(());
        }
        let source = from.blob(digest);
        let temp = temp_name(&self.layout.dir().join("blobs/sha256"), "blob");
        if std::fs::hard_link(&source, &temp).is_err() {
            std::fs::copy(&source, &temp).map_err(io(&source))?;
        }
        let mut r = Hashing::new(File::open(&temp).map_err(io(&temp))?);
        std::io::copy(&mut r, &mut std::io::sink()).map_err(io(&source))?;
        let (_, actual, _) = r.finish();
        if actual != *digest {
            let _ = std::fs::remove_file(&temp);
            return Err(StoreError::Invalid {
                path: source.display().to_string(),
                message: format!("the blob's content hashes to {actual}, not {digest}"),
            });
        }
        std::fs::rename(&temp, &target).map_err(io(&target))
    }

    /// Removes the blobs and unpacked layers no named image uses (images replaced by a newer
    /// load of the same name leave theirs behind); returns how many bytes of blobs went. Only
    /// safe while no container runs from the store: `localcluster up` calls it before its nodes
    /// start.
    pub fn prune(&self) -> Result<u64, StoreError> {
        let mut blobs = std::collections::BTreeSet::new();
        let mut layers = std::collections::BTreeSet::new();
        for entry in self.layout.index()? {
            // The config first, then the layers.
            let used = self.layout.manifest_blobs(&entry.digest)?;
            if let Some(config) = used.first()
                && let Ok(c) = serde_json::from_slice::<oci_spec::image::ImageConfiguration>(
                    &self.layout.read_blob(config)?,
                )
            {
                for d in c.rootfs().diff_ids() {
                    layers.insert(d.trim_start_matches("sha256:").to_owned());
                }
            }
            blobs.insert(entry.digest.hex().to_owned());
            blobs.extend(used.iter().map(|d| d.hex().to_owned()));
        }
        let mut freed = 0;
        let blob_dir = self.layout.dir().join("blobs/sha256");
        for entry in std::fs::read_dir(&blob_dir).map_err(io(&blob_dir))? {
            let entry = entry.map_err(io(&blob_dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !blobs.contains(&name) && !name.starts_with(".tmp-") {
                freed += entry.metadata().map_or(0, |m| m.len());
                std::fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
            }
        }
        for entry in std::fs::read_dir(&self.layers).map_err(io(&self.layers))? {
            let entry = entry.map_err(io(&self.layers))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !layers.contains(&name) {
                std::fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
            }
        }
        Ok(freed)
    }

    /// The image `image` names (a tag or a digest reference), with its layers unpacked.
    pub fn resolve(&self, image: &str) -> Result<Image, StoreError> {
        let wanted = Reference::parse(image)?;
        let entries = self.layout.index()?;
        let found = entries.iter().find(|e| {
            let Some(name) = e.name.as_deref() else {
                return false;
            };
            match wanted.digest() {
                Some(d) => {
                    e.digest.as_str() == d
                        && Reference::parse(name)
                            .is_ok_and(|n| n.repository() == wanted.repository())
                }
                None => name == wanted.to_string(),
            }
        });
        let Some(entry) = found else {
            let known: Vec<_> = entries.iter().filter_map(|e| e.name.clone()).collect();
            return Err(StoreError::NotFound {
                image: wanted.to_string(),
                known: if known.is_empty() {
                    "nothing".into()
                } else {
                    known.join(", ")
                },
            });
        };
        let manifest_path = self.layout.blob(&entry.digest);
        let invalid = |path: &Path, message: String| StoreError::Invalid {
            path: path.display().to_string(),
            message,
        };
        let manifest: oci_spec::image::ImageManifest =
            serde_json::from_slice(&self.layout.read_blob(&entry.digest)?)
                .map_err(|e| invalid(&manifest_path, format!("not an image manifest: {e}")))?;
        let config_digest = Digest::parse(manifest.config().digest().as_ref())
            .map_err(|e| invalid(&manifest_path, e.to_string()))?;
        let config_path = self.layout.blob(&config_digest);
        let config: oci_spec::image::ImageConfiguration =
            serde_json::from_slice(&self.layout.read_blob(&config_digest)?)
                .map_err(|e| invalid(&config_path, format!("not an image config: {e}")))?;
        let platform = (config.os().to_string(), config.architecture().to_string());
        if platform != ("linux".into(), "amd64".into()) {
            return Err(invalid(
                &config_path,
                format!(
                    "image {wanted} is for {}/{}, not linux/amd64",
                    platform.0, platform.1
                ),
            ));
        }
        let diff_ids = config.rootfs().diff_ids();
        if diff_ids.len() != manifest.layers().len() {
            return Err(invalid(
                &config_path,
                format!(
                    "{} layers but {} diff IDs",
                    manifest.layers().len(),
                    diff_ids.len()
                ),
            ));
        }
        let mut layers = Vec::new();
        for (layer, diff_id) in manifest.layers().iter().zip(diff_ids) {
            let digest = Digest::parse(layer.digest().as_ref())
                .map_err(|e| invalid(&manifest_path, e.to_string()))?;
            let diff_id =
                Digest::parse(diff_id).map_err(|e| invalid(&config_path, e.to_string()))?;
            layers.push(self.unpack(layer.media_type().as_ref(), &digest, &diff_id)?);
        }
        let run = config.config().clone().unwrap_or_default();
        Ok(Image {
            name: wanted.to_string(),
            id: format!("{}@{}", wanted.repository(), entry.digest),
            config: ImageConfig {
                entrypoint: run.entrypoint().clone().unwrap_or_default(),
                cmd: run.cmd().clone().unwrap_or_default(),
                env: run.env().clone().unwrap_or_default(),
                working_dir: run.working_dir().clone().filter(|w| !w.is_empty()),
                user: run.user().clone().filter(|u| !u.is_empty()),
            },
            layers,
        })
    }

    /// The directory holding the layer's files, unpacked on first use. OCI whiteouts become
    /// overlayfs ones (`.wh.name` a 0:0 character device, `.wh..wh..opq` the opaque
    /// attribute), so the kernel applies them when the layers are stacked.
    fn unpack(
        &self,
        media_type: &str,
        blob: &Digest,
        diff_id: &Digest,
    ) -> Result<PathBuf, StoreError> {
        let dir = self.layers.join(diff_id.hex());
        if dir.is_dir() {
            return Ok(dir);
        }
        let path = self.layout.blob(blob);
        let file = std::io::BufReader::new(File::open(&path).map_err(io(&path))?);
        let stream: Box<dyn Read> = match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar" => Box::new(file),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
                Box::new(flate2::read::GzDecoder::new(file))
            }
            other => {
                return Err(StoreError::Invalid {
                    path: path.display().to_string(),
                    message: format!(
                        "layer media type {other} is not supported (tar and tar+gzip are)"
                    ),
                });
            }
        };
        let temp = temp_name(&self.layers, diff_id.hex());
        std::fs::create_dir(&temp).map_err(io(&temp))?;
        let result = unpack_layer(stream, &temp);
        match result {
            Ok(actual) if actual == *diff_id => {}
            Ok(actual) => {
                let _ = std::fs::remove_dir_all(&temp);
                return Err(StoreError::Invalid {
                    path: path.display().to_string(),
                    message: format!("the layer unpacks to {actual}, not its diff ID {diff_id}"),
                });
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&temp);
                return Err(io(&path)(e));
            }
        }
        if std::fs::rename(&temp, &dir).is_err() {
            // Another unpack of the same layer won the race.
            let _ = std::fs::remove_dir_all(&temp);
        }
        Ok(dir)
    }
}

/// The path of a tar entry below the root, or an error if it would leave it.
fn entry_path(path: &Path) -> std::io::Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("layer entry {} leaves the layer's root", path.display()),
                ));
            }
        }
    }
    Ok(out)
}

/// Unpacks one layer's tar stream into `dir`; returns the stream's digest (its diff ID).
fn unpack_layer(stream: impl Read, dir: &Path) -> std::io::Result<Digest> {
    let mut archive = tar::Archive::new(Hashing::new(stream));
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry_path(&entry.path()?)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        match name.as_deref().and_then(|n| n.strip_prefix(".wh.")) {
            Some(".wh..opq") => {
                let parent = dir.join(path.parent().unwrap_or(Path::new("")));
                std::fs::create_dir_all(&parent)?;
                xattr::set(&parent, "trusted.overlay.opaque", b"y")?;
            }
            Some(hidden) => {
                let parent = dir.join(path.parent().unwrap_or(Path::new("")));
                std::fs::create_dir_all(&parent)?;
                nix::sys::stat::mknod(
                    &parent.join(hidden),
                    nix::sys::stat::SFlag::S_IFCHR,
                    nix::sys::stat::Mode::empty(),
                    0,
                )?;
            }
            None => {
                entry.unpack_in(dir)?;
            }
        }
    }
    let mut rest = archive.into_inner();
    std::io::copy(&mut rest, &mut std::io::sink())?;
    let (_, digest, _) = rest.finish();
    Ok(digest)
}

/// Extracts an OCI archive's `oci-layout`, `index.json` and `blobs/sha256/*` into `dir`.
fn unpack_archive(path: &Path, dir: &Path) -> Result<(), StoreError> {
    let file = File::open(path).map_err(io(path))?;
    std::fs::create_dir_all(dir.join("blobs/sha256")).map_err(io(dir))?;
    let mut archive = tar::Archive::new(std::io::BufReader::new(file));
    let mut docker = false;
    for entry in archive.entries().map_err(io(path))? {
        let mut entry = entry.map_err(io(path))?;
        let name = entry_path(&entry.path().map_err(io(path))?).map_err(io(path))?;
        let keep = match name.to_str() {
            Some("oci-layout" | "index.json") => true,
            Some(n) => {
                docker |= n == "manifest.json";
                n.strip_prefix("blobs/sha256/")
                    .is_some_and(|h| Digest::parse(&format!("sha256:{h}")).is_ok())
            }
            None => false,
        };
        if keep && entry.header().entry_type().is_file() {
            let target = dir.join(&name);
            let mut out = File::create(&target).map_err(io(&target))?;
            std::io::copy(&mut entry, &mut out).map_err(io(&target))?;
        }
    }
    if !dir.join("oci-layout").exists() {
        return Err(StoreError::Invalid {
            path: path.display().to_string(),
            message: if docker {
                "a Docker archive, not an OCI archive: convert it with `skopeo copy docker-archive:FILE oci-archive:OUT`".into()
            } else {
                "not an OCI archive (no oci-layout file)".into()
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Compression, ImageSpec, Source, Tree};

    fn layout_with(dir: &Path, name: &str, layers: Vec<Tree>) -> (Layout, crate::layout::Written) {
        let layout = Layout::create(dir).unwrap();
        let mut spec = ImageSpec::new(Reference::parse(name).unwrap());
        spec.layers = layers;
        spec.entrypoint = vec!["/bin/app".into()];
        spec.cmd = vec!["--flag".into()];
        spec.working_dir = Some("/work".into());
        let written = layout.write_image(&spec, Compression::Gzip).unwrap();
        (layout, written)
    }

    fn tree(files: &[(&str, &str)]) -> Tree {
        let mut t = Tree::new();
        for (p, text) in files {
            t.file(p, Source::Bytes(text.as_bytes().to_vec()), 0o644);
        }
        t
    }

    #[test]
    fn archives_import_and_resolve_by_tag_or_digest() {
        let build = tempfile::tempdir().unwrap();
        let (layout, written) = layout_with(
            build.path(),
            "kubevirt-rs/app:v1",
            vec![
                tree(&[("bin/app", "app"), ("etc/a", "a")]),
                tree(&[("etc/b", "b")]),
            ],
        );
        let archive = build.path().join("app.tar");
        layout
            .write_archive(std::slice::from_ref(&written.name), &archive)
            .unwrap();

        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(matches!(
            store.resolve("kubevirt-rs/app:v1"),
            Err(StoreError::NotFound { .. })
        ));
        assert_eq!(
            store.import(&archive).unwrap(),
            ["docker.io/kubevirt-rs/app:v1"]
        );
        let image = store.resolve("docker.io/kubevirt-rs/app:v1").unwrap();
        assert_eq!(image.config.entrypoint, ["/bin/app"]);
        assert_eq!(image.config.cmd, ["--flag"]);
        assert_eq!(image.config.working_dir.as_deref(), Some("/work"));
        assert_eq!(
            image.id,
            format!("docker.io/kubevirt-rs/app@{}", written.manifest)
        );
        assert_eq!(image.layers.len(), 2);
        assert_eq!(
            std::fs::read_to_string(image.layers[0].join("bin/app")).unwrap(),
            "app"
        );
        assert_eq!(
            std::fs::read_to_string(image.layers[1].join("etc/b")).unwrap(),
            "b"
        );
        let pinned = format!("kubevirt-rs/app@{}", written.manifest);
        assert_eq!(store.resolve(&pinned).unwrap().layers, image.layers);
        let other_repo = format!("kubevirt-rs/other@{}", written.manifest);
        assert!(store.resolve(&other_repo).is_err());
        // From the layout directory too, and again: nothing changes.
        store.import(build.path()).unwrap();
        assert_eq!(store.names().unwrap(), ["docker.io/kubevirt-rs/app:v1"]);
        assert_eq!(store.prune().unwrap(), 0, "everything is in use");

        // A new build of the same name replaces it; pruning drops what only the old one used.
        let rebuilt = tempfile::tempdir().unwrap();
        layout_with(
            rebuilt.path(),
            "kubevirt-rs/app:v1",
            vec![tree(&[("bin/app", "app 2")]), tree(&[("etc/b", "b")])],
        );
        store.import(rebuilt.path()).unwrap();
        assert!(store.prune().unwrap() > 0);
        let again = store.resolve("kubevirt-rs/app:v1").unwrap();
        assert_eq!(
            std::fs::read_to_string(again.layers[0].join("bin/app")).unwrap(),
            "app 2"
        );
        assert!(!image.layers[0].exists(), "the old bottom layer is gone");
        assert_eq!(again.layers[1], image.layers[1], "the shared layer stays");
        assert!(store.resolve(&pinned).is_err());
    }

    #[test]
    fn corrupt_blobs_and_docker_archives_are_refused() {
        let build = tempfile::tempdir().unwrap();
        let (layout, written) = layout_with(build.path(), "x/y:1", vec![tree(&[("f", "data")])]);
        let layer = layout.manifest_blobs(&written.manifest).unwrap()[1].clone();
        std::fs::write(layout.blob(&layer), b"tampered").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let err = store.import(build.path()).unwrap_err().to_string();
        assert!(err.contains("hashes to"), "{err}");

        let docker = build.path().join("docker.tar");
        let mut t = Tree::new();
        t.file("manifest.json", Source::Bytes(b"[]".to_vec()), 0o644);
        let (w, _) = t
            .write_tar(File::create(&docker).unwrap(), Compression::None)
            .unwrap();
        drop(w);
        let err = store.import(&docker).unwrap_err().to_string();
        assert!(err.contains("skopeo copy docker-archive"), "{err}");
    }

    #[test]
    fn whiteouts_become_overlay_whiteouts() {
        use std::os::unix::fs::FileTypeExt as _;
        let mut plain = Vec::new();
        {
            let mut b = tar::Builder::new(&mut plain);
            for (path, data) in [
                ("etc/.wh.gone", ""),
                ("opt/.wh..wh..opq", ""),
                ("opt/kept", "k"),
            ] {
                let mut h = tar::Header::new_gnu();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
                b.append_data(&mut h, path, data.as_bytes()).unwrap();
            }
            b.finish().unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let digest = unpack_layer(&plain[..], dir.path()).unwrap();
        assert_eq!(digest, Digest::of(&plain));
        let gone = std::fs::symlink_metadata(dir.path().join("etc/gone")).unwrap();
        assert!(gone.file_type().is_char_device());
        assert_eq!(
            xattr::get(dir.path().join("opt"), "trusted.overlay.opaque").unwrap(),
            Some(b"y".to_vec())
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("opt/kept")).unwrap(),
            "k"
        );

        let mut evil = Vec::new();
        {
            let mut b = tar::Builder::new(&mut evil);
            let mut h = tar::Header::new_gnu();
            h.set_size(0);
            h.as_old_mut().name[..13].copy_from_slice(b"../.wh.escape");
            h.set_cksum();
            b.append(&h, &[][..]).unwrap();
            b.finish().unwrap();
        }
        assert!(unpack_layer(&evil[..], dir.path()).is_err());
    }
}
