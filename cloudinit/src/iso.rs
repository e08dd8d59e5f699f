//! A minimal ISO9660 writer: one volume with a primary tree (ECMA-119 names, upper case) and a
//! Joliet tree (the names as given), like `xorrisofs -volid <label> -joliet`, which KubeVirt runs.
//!
//! Hand-written because the Rust ISO writers on crates.io are either readers only or pre-release;
//! a seed image needs only the plain subset: a handful of small files in a shallow tree, no boot
//! record, no Rock Ridge (Joliet already carries the long, mixed-case names to Linux and Windows).

use crate::SeedFile;

pub(crate) const SECTOR: usize = 2048;
/// Sectors 0-15 are the system area, left empty.
const FIRST_DESCRIPTOR: usize = 16;
/// Padding after the last file, as genisoimage and xorriso add by default: probers such as
/// busybox's `findfs` read the first 68 KiB of a device and give up on a smaller one, and
/// Linux reads ahead past the end of the last file.
const PADDING_SECTORS: usize = 150;
/// A recording date of 1970-01-01 00:00 UTC, fixed so that the same seed gives the same bytes.
const RECORD_DATE: [u8; 7] = [70, 1, 1, 0, 0, 0, 0];

/// Which of the two directory trees a name or record belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tree {
    Primary,
    Joliet,
}

struct Dir {
    name: String,
    parent: usize,
    /// Child directories (indices into the directory list) and files (indices into the files).
    dirs: Vec<usize>,
    files: Vec<usize>,
}

/// Builds the image of `files` with volume identifier `label`.
pub(crate) fn build(label: &str, files: &[SeedFile]) -> Vec<u8> {
    let dirs = directory_tree(files);

    // Layout: descriptors (primary, Joliet, terminator), four path tables, the two trees'
    // directory extents, then the file data, each starting on a sector.
    let mut next = FIRST_DESCRIPTOR + 3;
    let path_table_len = path_table(&dirs, Tree::Primary, &[], false).len();
    let joliet_path_table_len = path_table(&dirs, Tree::Joliet, &[], false).len();
    let mut tables = [0; 4];
    for (i, len) in [
        path_table_len,
        path_table_len,
        joliet_path_table_len,
        joliet_path_table_len,
    ]
    .into_iter()
    .enumerate()
    {
        tables[i] = next;
        next += len.div_ceil(SECTOR);
    }
    let mut extents = Vec::new();
    for tree in [Tree::Primary, Tree::Joliet] {
        let mut starts = Vec::with_capacity(dirs.len());
        for (i, _) in dirs.iter().enumerate() {
            starts.push(next);
            next += dir_sectors(&dirs, i, files, tree);
        }
        extents.push(starts);
    }
    let mut file_starts = Vec::with_capacity(files.len());
    for f in files {
        file_starts.push(next);
        next += f.content.len().div_ceil(SECTOR);
    }
    let total = next + PADDING_SECTORS;

    let mut image = vec![0u8; total * SECTOR];
    let layout = Layout {
        dirs: &dirs,
        files,
        file_starts: &file_starts,
    };
    for (t, tree) in [Tree::Primary, Tree::Joliet].into_iter().enumerate() {
        let dir_starts = &extents[t];
        let l_table = path_table(&dirs, tree, dir_starts, false);
        let m_table = path_table(&dirs, tree, dir_starts, true);
        put(&mut image, tables[2 * t] * SECTOR, &l_table);
        put(&mut image, tables[2 * t + 1] * SECTOR, &m_table);
        for i in 0..dirs.len() {
            let extent = layout.dir_extent(i, tree, dir_starts);
            put(&mut image, dir_starts[i] * SECTOR, &extent);
        }
        let root = record(
            &[0],
            dir_starts[0],
            dir_sectors(&dirs, 0, files, tree) * SECTOR,
            true,
        );
        let descriptor = volume_descriptor(
            tree,
            label,
            total,
            l_table.len(),
            (tables[2 * t], tables[2 * t + 1]),
            &root,
        );
        put(&mut image, (FIRST_DESCRIPTOR + t) * SECTOR, &descriptor);
    }
    let terminator = FIRST_DESCRIPTOR + 2;
    put(
        &mut image,
        terminator * SECTOR,
        &[255, b'C', b'D', b'0', b'0', b'1', 1],
    );
    for (f, start) in files.iter().zip(&file_starts) {
        put(&mut image, start * SECTOR, &f.content);
    }
    image
}

fn put(image: &mut [u8], at: usize, bytes: &[u8]) {
    image[at..at + bytes.len()].copy_from_slice(bytes);
}

/// The directories named by the files' paths, root first, in path-table order: by level, then
/// parent, then name.
fn directory_tree(files: &[SeedFile]) -> Vec<Dir> {
    let mut dirs = vec![Dir {
        name: String::new(),
        parent: 0,
        dirs: Vec::new(),
        files: Vec::new(),
    }];
    // Built in arrival order first, then renumbered breadth first.
    for (fi, f) in files.iter().enumerate() {
        let mut parts: Vec<&str> = f.path.split('/').collect();
        parts.pop();
        let mut cur = 0;
        for part in parts {
            let found = dirs[cur]
                .dirs
                .iter()
                .copied()
                .find(|&d| dirs[d].name == part);
            cur = if let Some(d) = found {
                d
            } else {
                dirs.push(Dir {
                    name: part.to_owned(),
                    parent: cur,
                    dirs: Vec::new(),
                    files: Vec::new(),
                });
                let d = dirs.len() - 1;
                dirs[cur].dirs.push(d);
                d
            };
        }
        dirs[cur].files.push(fi);
    }
    let mut order = vec![0];
    let mut i = 0;
    while i < order.len() {
        let mut children = dirs[order[i]].dirs.clone();
        children.sort_by(|a, b| dirs[*a].name.cmp(&dirs[*b].name));
        order.extend(children);
        i += 1;
    }
    let mut new_index = vec![0; dirs.len()];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    let mut out: Vec<Dir> = order
        .iter()
        .map(|&old| Dir {
            name: dirs[old].name.clone(),
            parent: new_index[dirs[old].parent],
            dirs: dirs[old].dirs.iter().map(|&d| new_index[d]).collect(),
            files: dirs[old].files.clone(),
        })
        .collect();
    for d in &mut out {
        d.dirs.sort_unstable();
    }
    out
}

/// The identifier of `name` in `tree`. Primary names keep to ECMA-119's d-characters (upper
/// case letters, digits, `_`), files get the `.` and `;1` version suffix; Joliet names are
/// UCS-2 big endian, files with `;1` as mkisofs writes them.
fn identifier(name: &str, tree: Tree, is_dir: bool) -> Vec<u8> {
    match tree {
        Tree::Primary => {
            let mapped: String = name
                .chars()
                .map(|c| match c.to_ascii_uppercase() {
                    u @ ('A'..='Z' | '0'..='9' | '_' | '.') => u,
                    _ => '_',
                })
                .collect();
            if is_dir {
                mapped
                    .replace('.', "_")
                    .chars()
                    .take(31)
                    .collect::<String>()
                    .into_bytes()
            } else {
                let (base, ext) = mapped.rsplit_once('.').unwrap_or((&mapped, ""));
                let base: String = base
                    .replace('.', "_")
                    .chars()
                    .take(30 - ext.len().min(8))
                    .collect();
                let ext: String = ext.chars().take(8).collect();
                format!("{base}.{ext};1").into_bytes()
            }
        }
        Tree::Joliet => {
            let mut units: Vec<u16> = name
                .chars()
                .take(64)
                .map(|c| match c {
                    '*' | '/' | ':' | ';' | '?' | '\\' => u16::from(b'_'),
                    c => u16::try_from(u32::from(c)).unwrap_or(u16::from(b'_')),
                })
                .collect();
            if !is_dir {
                units.extend([u16::from(b';'), u16::from(b'1')]);
            }
            units.iter().flat_map(|u| u.to_be_bytes()).collect()
        }
    }
}

fn both_u32(out: &mut Vec<u8>, v: u32) {
    out.extend(v.to_le_bytes());
    out.extend(v.to_be_bytes());
}

fn both_u16(out: &mut Vec<u8>, v: u16) {
    out.extend(v.to_le_bytes());
    out.extend(v.to_be_bytes());
}

/// Image offsets are far below 4 GiB (the image is built in memory from small seed files);
/// saturating keeps the arithmetic total without a panic path.
fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// One directory record (ECMA-119 9.1).
fn record(id: &[u8], extent: usize, len: usize, is_dir: bool) -> Vec<u8> {
    let id_len = u8::try_from(id.len()).unwrap_or(u8::MAX);
    let mut r = Vec::with_capacity(34 + id.len());
    r.push(0);
    r.push(0);
    both_u32(&mut r, u32_of(extent));
    both_u32(&mut r, u32_of(len));
    r.extend(RECORD_DATE);
    r.push(if is_dir { 2 } else { 0 });
    r.push(0);
    r.push(0);
    both_u16(&mut r, 1);
    r.push(id_len);
    r.extend(&id[..usize::from(id_len)]);
    if r.len() % 2 == 1 {
        r.push(0);
    }
    r[0] = u8::try_from(r.len()).unwrap_or(u8::MAX);
    r
}

struct Layout<'a> {
    dirs: &'a [Dir],
    files: &'a [SeedFile],
    file_starts: &'a [usize],
}

/// The children of directory `i` in `tree`: (identifier, is_dir, index), sorted by identifier as
/// ECMA-119 requires.
fn children(dirs: &[Dir], i: usize, files: &[SeedFile], tree: Tree) -> Vec<(Vec<u8>, bool, usize)> {
    let mut out: Vec<(Vec<u8>, bool, usize)> = dirs[i]
        .dirs
        .iter()
        .map(|&d| (identifier(&dirs[d].name, tree, true), true, d))
        .chain(dirs[i].files.iter().map(|&f| {
            let name = files[f].path.rsplit('/').next().unwrap_or_default();
            (identifier(name, tree, false), false, f)
        }))
        .collect();
    out.sort();
    out
}

/// Records laid into sectors: a record never crosses a sector boundary.
fn pack(records: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        let used = out.len() % SECTOR;
        if used + r.len() > SECTOR {
            out.resize(out.len() + SECTOR - used, 0);
        }
        out.extend(r);
    }
    let padded = out.len().div_ceil(SECTOR).max(1) * SECTOR;
    out.resize(padded, 0);
    out
}

fn dir_sectors(dirs: &[Dir], i: usize, files: &[SeedFile], tree: Tree) -> usize {
    // Lengths do not depend on extents, so placeholders size the extent exactly.
    let mut records = vec![record(&[0], 0, 0, true), record(&[1], 0, 0, true)];
    records.extend(
        children(dirs, i, files, tree)
            .into_iter()
            .map(|(id, is_dir, _)| record(&id, 0, 0, is_dir)),
    );
    pack(&records).len() / SECTOR
}

impl Layout<'_> {
    fn dir_extent(&self, i: usize, tree: Tree, dir_starts: &[usize]) -> Vec<u8> {
        let size = |d: usize| dir_sectors(self.dirs, d, self.files, tree) * SECTOR;
        let parent = self.dirs[i].parent;
        let mut records = vec![
            record(&[0], dir_starts[i], size(i), true),
            record(&[1], dir_starts[parent], size(parent), true),
        ];
        for (id, is_dir, idx) in children(self.dirs, i, self.files, tree) {
            records.push(if is_dir {
                record(&id, dir_starts[idx], size(idx), true)
            } else {
                record(
                    &id,
                    self.file_starts[idx],
                    self.files[idx].content.len(),
                    false,
                )
            });
        }
        pack(&records)
    }
}

/// A path table (ECMA-119 9.4), little endian (type L) or big endian (type M).
fn path_table(dirs: &[Dir], tree: Tree, dir_starts: &[usize], big_endian: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, d) in dirs.iter().enumerate() {
        let id = if i == 0 {
            vec![0]
        } else {
            identifier(&d.name, tree, true)
        };
        let extent = u32_of(dir_starts.get(i).copied().unwrap_or(0));
        // Path table parent numbers count from 1.
        let parent = u16::try_from(d.parent + 1).unwrap_or(u16::MAX);
        out.push(u8::try_from(id.len()).unwrap_or(u8::MAX));
        out.push(0);
        if big_endian {
            out.extend(extent.to_be_bytes());
            out.extend(parent.to_be_bytes());
        } else {
            out.extend(extent.to_le_bytes());
            out.extend(parent.to_le_bytes());
        }
        out.extend(&id);
        if id.len() % 2 == 1 {
            out.push(0);
        }
    }
    out
}

/// A text field of a volume descriptor: ASCII padded with spaces, or for Joliet UCS-2 big
/// endian padded with U+0020.
fn text(tree: Tree, s: &str, len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = match tree {
        Tree::Primary => s.bytes().take(len).collect(),
        Tree::Joliet => s
            .encode_utf16()
            .take(len / 2)
            .flat_map(u16::to_be_bytes)
            .collect(),
    };
    while out.len() < len {
        out.push(if tree == Tree::Joliet && out.len().is_multiple_of(2) {
            0
        } else {
            b' '
        });
    }
    out
}

/// The primary (ECMA-119 8.4) or Joliet supplementary (8.5) volume descriptor.
fn volume_descriptor(
    tree: Tree,
    label: &str,
    total_sectors: usize,
    path_table_len: usize,
    (l_table, m_table): (usize, usize),
    root: &[u8],
) -> Vec<u8> {
    let mut d = Vec::with_capacity(SECTOR);
    d.push(if tree == Tree::Primary { 1 } else { 2 });
    d.extend(b"CD001");
    d.push(1);
    d.push(0);
    d.extend(text(tree, "LINUX", 32));
    d.extend(text(tree, label, 32));
    d.extend([0; 8]);
    both_u32(&mut d, u32_of(total_sectors));
    let mut escapes = [0u8; 32];
    if tree == Tree::Joliet {
        // UCS-2 level 3.
        escapes[..3].copy_from_slice(b"%/E");
    }
    d.extend(escapes);
    both_u16(&mut d, 1);
    both_u16(&mut d, 1);
    both_u16(&mut d, 2048);
    both_u32(&mut d, u32_of(path_table_len));
    d.extend(u32_of(l_table).to_le_bytes());
    d.extend([0; 4]);
    d.extend(u32_of(m_table).to_be_bytes());
    d.extend([0; 4]);
    d.extend(root);
    for len in [128, 128, 128, 128, 37, 37, 37] {
        d.extend(text(tree, "", len));
    }
    for _ in 0..4 {
        // "Not specified": sixteen ASCII zeros and a zero time zone.
        d.extend([b'0'; 16]);
        d.push(0);
    }
    d.push(1);
    d.resize(SECTOR, 0);
    d
}
