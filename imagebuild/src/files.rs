//! Files of this machine (installed from Debian packages) copied into a layer as they lie: every
//! symlink along a path is kept as a symlink, so the image has the same layout as the host
//! (Debian 12's merged `/usr`: `/lib64 -> usr/lib64`, `/bin -> usr/bin`), and a program finds
//! its loader, libraries and data at the paths it was built for.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Component, Path, PathBuf};

use ociimage::{Node, Source, Tree};

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: too many levels of symbolic links")]
    Loop { path: String },
    #[error("reading the ELF dependencies of {path}: {message}")]
    Elf { path: String, message: String },
    #[error("{path} needs {library}, which is not installed on this machine")]
    MissingLibrary { path: String, library: String },
    #[error(
        "{path} must be statically linked (it runs in images with no C library), but it needs {needs}"
    )]
    NotStatic { path: String, needs: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> FilesError + '_ {
    move |source| FilesError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `path` with `.` and `..` applied lexically; absolute in, absolute out.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(p) => out.push(p),
            _ => {}
        }
    }
    out
}

/// Adds files to a layer, skipping what a lower layer (`below`) already has.
#[derive(Debug)]
pub struct Layer<'a> {
    pub tree: Tree,
    below: Option<&'a Tree>,
}

impl<'a> Layer<'a> {
    pub fn new(below: Option<&'a Tree>) -> Self {
        Self {
            tree: Tree::new(),
            below,
        }
    }

    fn has(&self, path: &Path) -> bool {
        self.tree.get(path).is_some() || self.below.is_some_and(|b| b.get(path).is_some())
    }

    /// Adds the host's `path` at the same path: its symlinks (along the way and at the end)
    /// as symlinks, then what they point to; a file with its permission bits; a directory
    /// with everything below it.
    pub fn host_path(&mut self, path: &Path) -> Result<(), FilesError> {
        self.host_path_at(&normalize(path), 0)
    }

    fn host_path_at(&mut self, path: &Path, links: usize) -> Result<(), FilesError> {
        if links > 40 {
            return Err(FilesError::Loop {
                path: path.display().to_string(),
            });
        }
        let parts: Vec<_> = path.components().skip(1).collect();
        let mut at = PathBuf::from("/");
        for (i, part) in parts.iter().enumerate() {
            at.push(part);
            let meta = std::fs::symlink_metadata(&at).map_err(io(&at))?;
            if meta.is_symlink() {
                let target = std::fs::read_link(&at).map_err(io(&at))?;
                if !self.has(&at) {
                    self.tree.symlink(&at, &target);
                }
                let mut next = at.parent().unwrap_or(Path::new("/")).join(&target);
                for rest in &parts[i + 1..] {
                    next.push(rest);
                }
                return self.host_path_at(&normalize(&next), links + 1);
            }
        }
        let meta = std::fs::metadata(&at).map_err(io(&at))?;
        let mode = meta.permissions().mode() & 0o7777;
        if meta.is_dir() {
            if !self.has(&at) {
                self.tree.dir(&at, mode);
            }
            let mut children: Vec<_> = std::fs::read_dir(&at)
                .map_err(io(&at))?
                .map(|e| e.map(|e| e.path()))
                .collect::<Result<_, _>>()
                .map_err(io(&at))?;
            children.sort();
            for child in children {
                self.host_path_at(&child, links)?;
            }
        } else if !self.has(&at) {
            self.tree.file(&at, Source::Path(at.clone()), mode);
        }
        Ok(())
    }

    /// Adds an ELF program or library with its loader and every shared library it needs.
    pub fn elf_with_libraries(&mut self, path: &Path) -> Result<(), FilesError> {
        self.host_path(path)?;
        for lib in libraries(path)? {
            self.host_path(&lib)?;
        }
        Ok(())
    }

    /// Adds the file `source` at `inside` (a program: mode 0755).
    pub fn program(&mut self, source: &Path, inside: &Path) -> Result<(), FilesError> {
        if !source.is_file() {
            return Err(io(source)(std::io::Error::from(
                std::io::ErrorKind::NotFound,
            )));
        }
        self.tree
            .file(inside, Source::Path(source.to_path_buf()), 0o755);
        Ok(())
    }
}

fn analyze(program: &Path) -> Result<lddtree::DependencyTree, FilesError> {
    lddtree::DependencyAnalyzer::new(PathBuf::from("/"))
        .analyze(program)
        .map_err(|e| FilesError::Elf {
            path: program.display().to_string(),
            message: e.to_string(),
        })
}

/// The loader and the shared libraries an ELF file needs, found as the host's loader would
/// find them (`ld.so.conf`, run paths), the program itself not included.
pub fn libraries(program: &Path) -> Result<Vec<PathBuf>, FilesError> {
    let deps = analyze(program)?;
    let mut out: Vec<PathBuf> = deps.interpreter.iter().map(PathBuf::from).collect();
    let mut libs: Vec<_> = deps.libraries.into_values().collect();
    libs.sort_by(|a, b| a.name.cmp(&b.name));
    for lib in libs {
        if !lib.found() {
            return Err(FilesError::MissingLibrary {
                path: program.display().to_string(),
                library: lib.name,
            });
        }
        out.push(lib.path);
    }
    Ok(out)
}

/// Refuses a dynamically linked program: it is meant to run in images with no C library.
pub fn check_static(program: &Path) -> Result<(), FilesError> {
    let deps = analyze(program)?;
    if deps.interpreter.is_some() || !deps.needed.is_empty() {
        let mut needs: Vec<String> = deps.interpreter.into_iter().collect();
        needs.extend(deps.needed);
        return Err(FilesError::NotStatic {
            path: program.display().to_string(),
            needs: needs.join(", "),
        });
    }
    Ok(())
}

/// Whether the tree has a regular file at `path`.
pub fn has_file(tree: &Tree, path: &str) -> bool {
    matches!(tree.get(path), Some(Node::File { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_paths_keep_their_symlinks() {
        let mut layer = Layer::new(None);
        // Debian 12: /lib64 -> usr/lib64, and the loader there is a link into /lib/x86_64-linux-gnu.
        layer
            .host_path(Path::new("/lib64/ld-linux-x86-64.so.2"))
            .unwrap();
        assert!(matches!(
            layer.tree.get("lib64"),
            Some(Node::Symlink { .. })
        ));
        let real = std::fs::canonicalize("/lib64/ld-linux-x86-64.so.2").unwrap();
        assert!(
            has_file(&layer.tree, real.to_str().unwrap()),
            "{layer:?}",
            layer = layer.tree
        );
    }

    #[test]
    fn programs_bring_their_libraries_and_lower_layers_are_not_repeated() {
        let mut base = Layer::new(None);
        base.elf_with_libraries(Path::new("/usr/bin/cp")).unwrap();
        let libc = std::fs::canonicalize("/lib/x86_64-linux-gnu/libc.so.6").unwrap();
        assert!(has_file(&base.tree, libc.to_str().unwrap()));
        let mut upper = Layer::new(Some(&base.tree));
        upper.elf_with_libraries(Path::new("/usr/bin/ls")).unwrap();
        assert!(
            upper.tree.get(&libc).is_none(),
            "libc is in the lower layer"
        );
        assert!(has_file(&upper.tree, "/usr/bin/ls"));
    }

    #[test]
    fn dynamic_programs_are_not_static() {
        let err = check_static(Path::new("/usr/bin/cp"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("must be statically linked") && err.contains("libc.so.6"),
            "{err}"
        );
        check_static(Path::new("/bin/busybox")).unwrap();
    }
}
