use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use crate::digest::{Digest, Hashing};

/// Where a file's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A file on this machine, read when the layer is written (symlinks followed).
    Path(PathBuf),
    Bytes(Vec<u8>),
}

/// One entry of a layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir { mode: u32 },
    File { source: Source, mode: u32 },
    Symlink { target: PathBuf },
}

/// The files of one layer, by path inside the image. Parents are added as directories (0755)
/// when the layer is written, so a tree only names what it ships.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tree {
    entries: BTreeMap<PathBuf, Node>,
}

/// How a layer blob is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// `application/vnd.oci.image.layer.v1.tar+gzip`: what registries and releases carry.
    Gzip,
    /// `application/vnd.oci.image.layer.v1.tar`: faster to build and to unpack, for images that
    /// never leave this machine.
    None,
}

impl Compression {
    pub fn media_type(self) -> oci_spec::image::MediaType {
        match self {
            Self::Gzip => oci_spec::image::MediaType::ImageLayerGzip,
            Self::None => oci_spec::image::MediaType::ImageLayer,
        }
    }
}

/// `path` relative to the image root, with `.` and `..` refused: a tree names files inside the
/// image, never outside it.
fn inside(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                panic!("image path {} leaves the image root", path.display())
            }
        }
    }
    out
}

impl Tree {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn dir(&mut self, path: impl AsRef<Path>, mode: u32) -> &mut Self {
        self.entries
            .insert(inside(path.as_ref()), Node::Dir { mode });
        self
    }

    pub fn file(&mut self, path: impl AsRef<Path>, source: Source, mode: u32) -> &mut Self {
        self.entries
            .insert(inside(path.as_ref()), Node::File { source, mode });
        self
    }

    pub fn symlink(&mut self, path: impl AsRef<Path>, target: impl AsRef<Path>) -> &mut Self {
        self.entries.insert(
            inside(path.as_ref()),
            Node::Symlink {
                target: target.as_ref().to_path_buf(),
            },
        );
        self
    }

    pub fn get(&self, path: impl AsRef<Path>) -> Option<&Node> {
        self.entries.get(&inside(path.as_ref()))
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every entry with its parents, parents first (a path sorts before its children).
    fn complete(&self) -> BTreeMap<PathBuf, Node> {
        let mut all = self.entries.clone();
        for path in self.entries.keys() {
            for parent in path.ancestors().skip(1) {
                if !parent.as_os_str().is_empty() {
                    all.entry(parent.to_path_buf())
                        .or_insert(Node::Dir { mode: 0o755 });
                }
            }
        }
        all
    }

    /// Writes the layer's tar stream to `out`, compressed as asked; returns the digest of the
    /// uncompressed tar (the layer's diff ID).
    pub(crate) fn write_tar<W: Write>(
        &self,
        out: W,
        compression: Compression,
    ) -> std::io::Result<(W, Digest)> {
        match compression {
            Compression::None => {
                let (out, diff_id) = self.write_plain(out)?;
                Ok((out, diff_id))
            }
            Compression::Gzip => {
                // No time and no name in the header, so the bytes depend on the tree alone.
                let gz = flate2::GzBuilder::new()
                    .mtime(0)
                    .write(out, flate2::Compression::default());
                let (gz, diff_id) = self.write_plain(gz)?;
                Ok((gz.finish()?, diff_id))
            }
        }
    }

    fn write_plain<W: Write>(&self, out: W) -> std::io::Result<(W, Digest)> {
        let mut builder = tar::Builder::new(Hashing::new(out));
        builder.mode(tar::HeaderMode::Deterministic);
        for (path, node) in self.complete() {
            let mut header = tar::Header::new_gnu();
            header.set_mtime(0);
            header.set_uid(0);
            header.set_gid(0);
            match node {
                Node::Dir { mode } => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(mode);
                    header.set_size(0);
                    builder.append_data(&mut header, &path, std::io::empty())?;
                }
                Node::Symlink { target } => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_mode(0o777);
                    header.set_size(0);
                    builder.append_link(&mut header, &path, &target)?;
                }
                Node::File { source, mode } => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(mode);
                    match source {
                        Source::Bytes(b) => {
                            header.set_size(b.len() as u64);
                            builder.append_data(&mut header, &path, &b[..])?;
                        }
                        Source::Path(p) => {
                            let file = std::fs::File::open(&p).map_err(|e| {
                                std::io::Error::new(
                                    e.kind(),
                                    format!("{} (for {}): {e}", p.display(), path.display()),
                                )
                            })?;
                            header.set_size(file.metadata()?.len());
                            builder.append_data(&mut header, &path, file)?;
                        }
                    }
                }
            }
        }
        let hashing = builder.into_inner()?;
        let (out, diff_id, _) = hashing.finish();
        Ok((out, diff_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing(tar_bytes: &[u8]) -> Vec<(String, tar::EntryType, u32, u64)> {
        tar::Archive::new(tar_bytes)
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().display().to_string(),
                    h.entry_type(),
                    h.mode().unwrap(),
                    h.mtime().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn layers_are_sorted_with_parents_and_reproducible() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("prog");
        std::fs::write(&bin, b"#!binary").unwrap();
        let mut tree = Tree::new();
        tree.file("/usr/bin/prog", Source::Path(bin.clone()), 0o755)
            .symlink("/var/run", "../run")
            .dir("/tmp", 0o1777)
            .file(
                "etc/passwd",
                Source::Bytes(b"root:x:0:0::/:/bin/sh\n".to_vec()),
                0o644,
            );
        let (plain, diff_id) = tree.write_tar(Vec::new(), Compression::None).unwrap();
        assert_eq!(Digest::of(&plain), diff_id);
        let names: Vec<_> = listing(&plain).into_iter().map(|e| (e.0, e.2)).collect();
        assert_eq!(
            names,
            [
                ("etc", 0o755),
                ("etc/passwd", 0o644),
                ("tmp", 0o1777),
                ("usr", 0o755),
                ("usr/bin", 0o755),
                ("usr/bin/prog", 0o755),
                ("var", 0o755),
                ("var/run", 0o777),
            ]
            .map(|(n, m)| (n.to_string(), m))
        );
        assert!(listing(&plain).iter().all(|e| e.3 == 0), "no times");

        // Same inputs, same bytes; the file's own time does not matter.
        let (gz1, d1) = tree.write_tar(Vec::new(), Compression::Gzip).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&bin)
            .unwrap()
            .set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(99))
            .unwrap();
        let (gz2, d2) = tree.write_tar(Vec::new(), Compression::Gzip).unwrap();
        assert_eq!(gz1, gz2);
        assert_eq!((d1.clone(), d2), (diff_id.clone(), diff_id));
        let mut unzipped = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz1[..]), &mut unzipped)
            .unwrap();
        assert_eq!(unzipped, plain);
    }

    #[test]
    #[should_panic(expected = "leaves the image root")]
    fn paths_stay_inside_the_image() {
        Tree::new().dir("/a/../../etc", 0o755);
    }
}
