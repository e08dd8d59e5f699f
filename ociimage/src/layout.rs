use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use crate::digest::{Digest, Hashing};
use crate::layer::{Compression, Source, Tree};
use crate::reference::Reference;

/// The index annotation containerd (`ctr images import`, `kind load image-archive`) names an
/// imported image by; the store reads it too.
pub const ANNOTATION_IMAGE_NAME: &str = "io.containerd.image.name";
/// The OCI annotation for a manifest's name within a layout: by convention its tag.
const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not an OCI image layout (no oci-layout file)")]
    NotLayout { path: String },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("no image {name} in the layout {path}")]
    NoImage { path: String, name: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LayoutError + '_ {
    move |source| LayoutError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// What an image is made of: its layers, bottom first, and its runtime configuration.
#[derive(Debug, Clone)]
pub struct ImageSpec {
    pub name: Reference,
    pub layers: Vec<Tree>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub labels: BTreeMap<String, String>,
}

impl ImageSpec {
    pub fn new(name: Reference) -> Self {
        Self {
            name,
            layers: Vec::new(),
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
            working_dir: None,
            labels: BTreeMap::new(),
        }
    }
}

/// An image written to a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub name: Reference,
    pub manifest: Digest,
    /// Bytes of every blob of the image (manifest, config, layers).
    pub size: u64,
}

/// One image of a layout's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub name: Option<String>,
    pub digest: Digest,
    pub size: u64,
    pub media_type: String,
}

/// An OCI image layout directory: `oci-layout`, `index.json` and `blobs/sha256/<hex>`.
#[derive(Debug, Clone)]
pub struct Layout {
    dir: PathBuf,
}

static TEMP: AtomicU64 = AtomicU64::new(0);

/// A name in `dir` no other writer uses (this process's id and a counter), hidden with a
/// `.tmp-` prefix, for files and directories that are renamed into place once complete.
pub(crate) fn temp_name(dir: &Path, what: &str) -> PathBuf {
    dir.join(format!(
        ".tmp-{what}-{}-{}",
        std::process::id(),
        TEMP.fetch_add(1, Ordering::Relaxed)
    ))
}

impl Layout {
    /// Opens the layout at `dir`, creating it if it does not exist.
    pub fn create(dir: &Path) -> Result<Self, LayoutError> {
        let blobs = dir.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).map_err(io(&blobs))?;
        let marker = dir.join("oci-layout");
        if !marker.exists() {
            write_atomically(&marker, br#"{"imageLayoutVersion":"1.0.0"}"#)?;
        }
        let index = dir.join("index.json");
        if !index.exists() {
            write_atomically(&index, &index_json(&[]))?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    /// Opens an existing layout.
    pub fn open(dir: &Path) -> Result<Self, LayoutError> {
        if !dir.join("oci-layout").is_file() {
            return Err(LayoutError::NotLayout {
                path: dir.display().to_string(),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blob(&self, digest: &Digest) -> PathBuf {
        self.dir.join("blobs/sha256").join(digest.hex())
    }

    pub fn read_blob(&self, digest: &Digest) -> Result<Vec<u8>, LayoutError> {
        let path = self.blob(digest);
        std::fs::read(&path).map_err(io(&path))
    }

    /// Writes a blob through `fill`, which gets a writer that hashes; the blob is named by that
    /// hash once complete, so a reader never sees half a blob.
    pub(crate) fn put_with<T>(
        &self,
        fill: impl FnOnce(&mut Hashing<std::io::BufWriter<File>>) -> std::io::Result<T>,
    ) -> Result<(Digest, u64, T), LayoutError> {
        let temp = temp_name(&self.dir.join("blobs/sha256"), "blob");
        let file = File::create(&temp).map_err(io(&temp))?;
        let mut w = Hashing::new(std::io::BufWriter::new(file));
        let out = fill(&mut w).and_then(|out| w.flush().map(|()| out));
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                let _ = std::fs::remove_file(&temp);
                return Err(io(&temp)(e));
            }
        };
        let (_, digest, size) = w.finish();
        let path = self.blob(&digest);
        if path.exists() {
            std::fs::remove_file(&temp).map_err(io(&temp))?;
        } else {
            std::fs::rename(&temp, &path).map_err(io(&path))?;
        }
        Ok((digest, size, out))
    }

    pub(crate) fn put_bytes(&self, bytes: &[u8]) -> Result<(Digest, u64), LayoutError> {
        let digest = Digest::of(bytes);
        if !self.blob(&digest).exists() {
            self.put_with(|w| w.write_all(bytes))?;
        }
        Ok((digest, bytes.len() as u64))
    }

    /// Writes an image's blobs and names it in the index (replacing an image of that name).
    pub fn write_image(
        &self,
        spec: &ImageSpec,
        compression: Compression,
    ) -> Result<Written, LayoutError> {
        let mut layers = Vec::new();
        let mut diff_ids = Vec::new();
        let mut total = 0;
        for tree in &spec.layers {
            let (digest, size, diff_id) = self.put_with(|w| {
                let (_, diff_id) = tree.write_tar(w, compression)?;
                Ok(diff_id)
            })?;
            total += size;
            layers.push(json!({
                "mediaType": compression.media_type().to_string(),
                "digest": digest.as_str(),
                "size": size,
            }));
            diff_ids.push(diff_id.as_str().to_owned());
        }
        let mut config = json!({});
        if !spec.entrypoint.is_empty() {
            config["Entrypoint"] = json!(spec.entrypoint);
        }
        if !spec.cmd.is_empty() {
            config["Cmd"] = json!(spec.cmd);
        }
        if !spec.env.is_empty() {
            config["Env"] = json!(spec.env);
        }
        if let Some(w) = &spec.working_dir {
            config["WorkingDir"] = json!(w);
        }
        if !spec.labels.is_empty() {
            config["Labels"] = json!(spec.labels);
        }
        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let (config_digest, config_size) = self.put_bytes(&to_bytes(&config))?;
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "digest": config_digest.as_str(), "size": config_size},
            "layers": layers,
        });
        let (manifest_digest, manifest_size) = self.put_bytes(&to_bytes(&manifest))?;
        total += config_size + manifest_size;
        self.name(
            &spec.name,
            &IndexEntry {
                name: Some(spec.name.to_string()),
                digest: manifest_digest.clone(),
                size: manifest_size,
                media_type: MANIFEST.into(),
            },
        )?;
        Ok(Written {
            name: spec.name.clone(),
            manifest: manifest_digest,
            size: total,
        })
    }

    /// The index's images.
    pub fn index(&self) -> Result<Vec<IndexEntry>, LayoutError> {
        let path = self.dir.join("index.json");
        let text = std::fs::read(&path).map_err(io(&path))?;
        parse_index(&text).map_err(|message| LayoutError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    /// Names `entry` in the index as `name`, replacing what had that name. Read-modify-write
    /// under a lock on the layout, so concurrent writers do not lose each other's images.
    pub(crate) fn name(&self, name: &Reference, entry: &IndexEntry) -> Result<(), LayoutError> {
        let lock_path = self.dir.join(".lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        let _held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| io(&lock_path)(e.into()))?;
        let mut entries = self.index()?;
        let full = name.to_string();
        entries.retain(|e| e.name.as_deref() != Some(full.as_str()));
        let mut entry = entry.clone();
        entry.name = Some(full);
        entries.push(entry);
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        write_atomically(&self.dir.join("index.json"), &index_json(&entries))
    }

    /// The manifest digest of the image named `name`.
    pub fn find(&self, name: &Reference) -> Result<IndexEntry, LayoutError> {
        let full = name.to_string();
        self.index()?
            .into_iter()
            .find(|e| e.name.as_deref() == Some(full.as_str()))
            .ok_or_else(|| LayoutError::NoImage {
                path: self.dir.display().to_string(),
                name: full,
            })
    }

    /// The blobs an image manifest refers to: config and layers.
    pub(crate) fn manifest_blobs(&self, manifest: &Digest) -> Result<Vec<Digest>, LayoutError> {
        let path = self.blob(manifest);
        let m: oci_spec::image::ImageManifest = serde_json::from_slice(&self.read_blob(manifest)?)
            .map_err(|e| LayoutError::Invalid {
                path: path.display().to_string(),
                message: format!("not an image manifest: {e}"),
            })?;
        let mut out = Vec::new();
        for d in std::iter::once(m.config()).chain(m.layers()) {
            out.push(
                Digest::parse(d.digest().as_ref()).map_err(|e| LayoutError::Invalid {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?,
            );
        }
        Ok(out)
    }

    /// Writes an OCI archive (`oci-archive:` in skopeo's terms: this layout as a tar) holding
    /// the named images only.
    pub fn write_archive(&self, names: &[Reference], out: &Path) -> Result<(), LayoutError> {
        let mut entries = Vec::new();
        let mut tree = Tree::new();
        tree.dir("blobs/sha256", 0o755);
        for name in names {
            let entry = self.find(name)?;
            for blob in
                std::iter::once(entry.digest.clone()).chain(self.manifest_blobs(&entry.digest)?)
            {
                tree.file(
                    format!("blobs/sha256/{}", blob.hex()),
                    Source::Path(self.blob(&blob)),
                    0o644,
                );
            }
            entries.push(entry);
        }
        tree.file(
            "oci-layout",
            Source::Bytes(br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
            0o644,
        )
        .file("index.json", Source::Bytes(index_json(&entries)), 0o644);
        let temp = temp_name(out.parent().unwrap_or(Path::new(".")), "archive");
        let file = File::create(&temp).map_err(io(&temp))?;
        let (w, _) = tree
            .write_tar(std::io::BufWriter::new(file), Compression::None)
            .map_err(io(out))?;
        w.into_inner()
            .map_err(|e| io(out)(e.into_error()))?
            .sync_all()
            .map_err(io(out))?;
        std::fs::rename(&temp, out).map_err(io(out))
    }
}

/// Serialised without maps of random order, so the same value gives the same digest.
fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn index_json(entries: &[IndexEntry]) -> Vec<u8> {
    let manifests: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut d =
                json!({"mediaType": e.media_type, "digest": e.digest.as_str(), "size": e.size});
            if let Some(name) = &e.name {
                let mut annotations = json!({ANNOTATION_IMAGE_NAME: name});
                if let Ok(r) = Reference::parse(name)
                    && let Some(tag) = r.tag()
                {
                    annotations[ANNOTATION_REF_NAME] = json!(tag);
                }
                d["annotations"] = annotations;
            }
            d
        })
        .collect();
    to_bytes(&json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}))
}

/// An index's manifests with their names: `io.containerd.image.name`, else a
/// `org.opencontainers.image.ref.name` that is a whole reference (not only a tag).
pub(crate) fn parse_index(text: &[u8]) -> Result<Vec<IndexEntry>, String> {
    let index: oci_spec::image::ImageIndex =
        serde_json::from_slice(text).map_err(|e| format!("not an image index: {e}"))?;
    let mut out = Vec::new();
    for m in index.manifests() {
        let annotations = m.annotations().clone().unwrap_or_default();
        let name = annotations.get(ANNOTATION_IMAGE_NAME).cloned().or_else(|| {
            annotations
                .get(ANNOTATION_REF_NAME)
                .filter(|r| r.contains('/') || r.contains(':') || r.contains('.'))
                .cloned()
        });
        out.push(IndexEntry {
            name,
            digest: Digest::parse(m.digest().as_ref()).map_err(|e| e.to_string())?,
            size: m.size(),
            media_type: m.media_type().to_string(),
        });
    }
    Ok(out)
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), LayoutError> {
    let temp = temp_name(path.parent().unwrap_or(Path::new(".")), "write");
    std::fs::write(&temp, bytes).map_err(io(&temp))?;
    std::fs::rename(&temp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, text: &str) -> ImageSpec {
        let mut s = ImageSpec::new(Reference::parse(name).unwrap());
        let mut t = Tree::new();
        t.file("hello", Source::Bytes(text.as_bytes().to_vec()), 0o644);
        s.layers.push(t);
        s.entrypoint = vec!["/hello".into()];
        s
    }

    #[test]
    fn images_are_reproducible_and_named_in_the_index() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let la = Layout::create(a.path()).unwrap();
        let lb = Layout::create(b.path()).unwrap();
        let one = la
            .write_image(&spec("kubevirt-rs/one:v1", "1"), Compression::Gzip)
            .unwrap();
        la.write_image(&spec("kubevirt-rs/two", "2"), Compression::Gzip)
            .unwrap();
        let again = lb
            .write_image(&spec("kubevirt-rs/one:v1", "1"), Compression::Gzip)
            .unwrap();
        assert_eq!(one, again);
        let names: Vec<_> = la
            .index()
            .unwrap()
            .into_iter()
            .filter_map(|e| e.name)
            .collect();
        assert_eq!(
            names,
            [
                "docker.io/kubevirt-rs/one:v1",
                "docker.io/kubevirt-rs/two:latest"
            ]
        );
        // Renaming replaces, it does not add.
        let changed = la
            .write_image(&spec("kubevirt-rs/one:v1", "changed"), Compression::Gzip)
            .unwrap();
        assert_ne!(changed.manifest, one.manifest);
        assert_eq!(la.index().unwrap().len(), 2);

        let archive = a.path().join("one.tar");
        la.write_archive(&[Reference::parse("kubevirt-rs/one:v1").unwrap()], &archive)
            .unwrap();
        let archive2 = b.path().join("one.tar");
        lb.write_image(&spec("kubevirt-rs/one:v1", "changed"), Compression::Gzip)
            .unwrap();
        lb.write_archive(
            &[Reference::parse("kubevirt-rs/one:v1").unwrap()],
            &archive2,
        )
        .unwrap();
        assert_eq!(
            std::fs::read(&archive).unwrap(),
            std::fs::read(&archive2).unwrap()
        );
        let mut names: Vec<String> = tar::Archive::new(File::open(&archive).unwrap())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.retain(|n| !n.starts_with("blobs/sha256/"));
        assert_eq!(names, ["blobs", "blobs/sha256", "index.json", "oci-layout"]);
        assert!(matches!(
            la.write_archive(&[Reference::parse("kubevirt-rs/none").unwrap()], &archive),
            Err(LayoutError::NoImage { .. })
        ));
    }

    #[test]
    fn index_names_come_from_either_annotation() {
        let text = br#"{"schemaVersion":2,"manifests":[
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","size":1,
           "digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
           "annotations":{"org.opencontainers.image.ref.name":"quay.io/x/y:1"}},
          {"mediaType":"application/vnd.oci.image.manifest.v1+json","size":1,
           "digest":"sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
           "annotations":{"org.opencontainers.image.ref.name":"latest"}}]}"#;
        let names: Vec<_> = parse_index(text)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, [Some("quay.io/x/y:1".to_owned()), None]);
    }
}
