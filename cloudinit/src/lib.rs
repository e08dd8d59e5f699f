//! cloud-init seed images for the `cloudInitNoCloud` and `cloudInitConfigDrive` volumes, and
//! the ISO9660 writer under them, which the launcher also uses for config disks.
//!
//! KubeVirt writes the seed files to a directory and runs `xorrisofs -volid <label> -joliet
//! -rock` on it. We build the same kind of image in Rust, with no external tool: ISO9660 with a
//! Joliet tree, volume label `cidata` (NoCloud) or `config-2` (ConfigDrive); no Rock Ridge, as
//! Joliet already carries the long, mixed-case names. ISO9660 rather than VFAT because it is
//! what KubeVirt ships, so guests find the file system type they find under KubeVirt, and
//! because it mounts from a disk and from a CD-ROM alike (Linux will not mount a FAT whose
//! 512-byte sectors are smaller than a CD-ROM's 2048-byte blocks). The `fatfs` crate was tried
//! first: its 0.3 release writes long-name entries before `.` and `..`, which `fsck.fat` rejects.
//!
//! The metadata follows KubeVirt's `pkg/cloud-init`: NoCloud `meta-data` is the JSON object
//! `{"instance-id", "local-hostname"}`; ConfigDrive `openstack/latest/meta_data.json` carries
//! `instance_id`, `uuid` and `hostname`.

mod iso;

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// What a NoCloud seed (volume label `cidata`) carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NoCloudSeed {
    pub instance_id: String,
    pub hostname: String,
    pub user_data: Vec<u8>,
    pub network_config: Option<Vec<u8>>,
}

/// What a ConfigDrive seed (volume label `config-2`) carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigDriveSeed {
    /// The instance's UUID; also used as its `instance_id`.
    pub instance_id: String,
    pub hostname: String,
    pub user_data: Vec<u8>,
    pub network_data: Option<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot write seed image {path}")]
    Create { path: PathBuf, source: io::Error },
    #[error("cannot move finished seed image {from} to {to}")]
    Rename {
        from: PathBuf,
        to: PathBuf,
        source: io::Error,
    },
    #[error("cannot encode the seed metadata")]
    Metadata(#[source] serde_json::Error),
}

/// The volume label cloud-init's NoCloud source looks for.
pub const NOCLOUD_LABEL: &str = "cidata";
/// The volume label cloud-init's ConfigDrive source looks for.
pub const CONFIG_DRIVE_LABEL: &str = "config-2";

/// One file of a seed image: a `/`-separated path relative to the root, and its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedFile {
    pub path: String,
    pub content: Vec<u8>,
}

#[derive(Serialize)]
struct NoCloudMetadata<'a> {
    #[serde(rename = "instance-id")]
    instance_id: &'a str,
    #[serde(rename = "local-hostname", skip_serializing_if = "str::is_empty")]
    local_hostname: &'a str,
}

#[derive(Serialize)]
struct ConfigDriveMetadata<'a> {
    instance_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    hostname: &'a str,
    uuid: &'a str,
}

/// The files of a NoCloud seed, in the order they are written.
pub fn nocloud_files(seed: &NoCloudSeed) -> Result<Vec<SeedFile>, Error> {
    let meta = serde_json::to_vec(&NoCloudMetadata {
        instance_id: &seed.instance_id,
        local_hostname: &seed.hostname,
    })
    .map_err(Error::Metadata)?;
    let mut files = vec![
        SeedFile {
            path: "meta-data".into(),
            content: meta,
        },
        SeedFile {
            path: "user-data".into(),
            content: seed.user_data.clone(),
        },
    ];
    if let Some(network) = &seed.network_config {
        files.push(SeedFile {
            path: "network-config".into(),
            content: network.clone(),
        });
    }
    Ok(files)
}

/// The files of a ConfigDrive seed, in the order they are written.
pub fn config_drive_files(seed: &ConfigDriveSeed) -> Result<Vec<SeedFile>, Error> {
    let meta = serde_json::to_vec(&ConfigDriveMetadata {
        instance_id: &seed.instance_id,
        hostname: &seed.hostname,
        uuid: &seed.instance_id,
    })
    .map_err(Error::Metadata)?;
    let mut files = vec![
        SeedFile {
            path: "openstack/latest/meta_data.json".into(),
            content: meta,
        },
        SeedFile {
            path: "openstack/latest/user_data".into(),
            content: seed.user_data.clone(),
        },
    ];
    if let Some(network) = &seed.network_data {
        files.push(SeedFile {
            path: "openstack/latest/network_data.json".into(),
            content: network.clone(),
        });
    }
    Ok(files)
}

/// Writes a NoCloud seed image (ISO9660 + Joliet, label `cidata`) to `path`, replacing any file there.
pub fn write_nocloud(path: &Path, seed: &NoCloudSeed) -> Result<(), Error> {
    write_image(path, NOCLOUD_LABEL, &nocloud_files(seed)?)
}

/// Writes a ConfigDrive seed image (ISO9660 + Joliet, label `config-2`) to `path`, replacing any file there.
pub fn write_config_drive(path: &Path, seed: &ConfigDriveSeed) -> Result<(), Error> {
    write_image(path, CONFIG_DRIVE_LABEL, &config_drive_files(seed)?)
}

/// Writes an ISO9660 + Joliet image of `files` with volume label `label` to `path`, replacing
/// any file there: the seed images above, and KubeVirt's config disks (ConfigMap, Secret...).
/// The image is built next to `path` and renamed into place, so that a reader never sees a
/// half-written one.
pub fn write_image(path: &Path, label: &str, files: &[SeedFile]) -> Result<(), Error> {
    let mut staging = path.as_os_str().to_owned();
    staging.push(".staging");
    let staging = PathBuf::from(staging);
    let result = fill_image(&staging, label, files).and_then(|()| {
        fs::rename(&staging, path).map_err(|source| Error::Rename {
            from: staging.clone(),
            to: path.to_owned(),
            source,
        })
    });
    if result.is_err() {
        // The staging file is ours alone; a failure to remove it changes nothing for the caller.
        let _ = fs::remove_file(&staging);
    }
    result
}

fn fill_image(path: &Path, label: &str, files: &[SeedFile]) -> Result<(), Error> {
    let create = |source| Error::Create {
        path: path.to_owned(),
        source,
    };
    let mut file = File::create(path).map_err(create)?;
    file.write_all(&iso::build(label, files)).map_err(create)?;
    file.sync_all().map_err(create)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iso::SECTOR;

    fn le32(b: &[u8]) -> usize {
        u32::from_le_bytes(b[..4].try_into().unwrap()) as usize
    }

    fn decode(id: &[u8], joliet: bool) -> String {
        if joliet {
            let units: Vec<u16> = id
                .chunks(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect();
            String::from_utf16(&units).unwrap()
        } else {
            String::from_utf8(id.to_vec()).unwrap()
        }
    }

    /// Walks one tree of the image the way a reader does, from its volume descriptor; returns
    /// the volume label and every file, path-sorted.
    fn read_tree(img: &[u8], joliet: bool) -> (String, Vec<(String, Vec<u8>)>) {
        let vd = &img[(16 + usize::from(joliet)) * SECTOR..][..SECTOR];
        assert_eq!(vd[0], if joliet { 2 } else { 1 });
        assert_eq!(&vd[1..6], b"CD001");
        assert_eq!(le32(&vd[80..]) * SECTOR, img.len(), "volume space size");
        let label = decode(&vd[40..72], joliet)
            .trim_end_matches([' ', '\0'])
            .to_string();
        let mut out = Vec::new();
        let mut stack = vec![(String::new(), le32(&vd[156 + 2..]), le32(&vd[156 + 10..]))];
        while let Some((prefix, extent, size)) = stack.pop() {
            let data = &img[extent * SECTOR..extent * SECTOR + size];
            let mut pos = 0;
            while pos < data.len() {
                let len = usize::from(data[pos]);
                if len == 0 {
                    pos = (pos / SECTOR + 1) * SECTOR;
                    continue;
                }
                let r = &data[pos..pos + len];
                pos += len;
                let id = &r[33..33 + usize::from(r[32])];
                if id == [0] || id == [1] {
                    continue;
                }
                let name = format!("{prefix}{}", decode(id, joliet));
                let (start, length) = (le32(&r[2..]), le32(&r[10..]));
                if r[25] & 2 == 2 {
                    stack.push((format!("{name}/"), start, length));
                } else {
                    let content = img[start * SECTOR..start * SECTOR + length].to_vec();
                    out.push((name, content));
                }
            }
        }
        out.sort();
        (label, out)
    }

    fn read_back(path: &Path) -> (String, Vec<(String, Vec<u8>)>) {
        let img = fs::read(path).unwrap();
        assert_eq!(img.len() % SECTOR, 0);
        let (label, files) = read_tree(&img, true);
        let stripped = files
            .into_iter()
            .map(|(n, c)| (n.strip_suffix(";1").unwrap().to_string(), c))
            .collect();
        (label, stripped)
    }

    #[test]
    fn nocloud_image_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("noCloud.iso");
        let seed = NoCloudSeed {
            instance_id: "vmi-uid-1".into(),
            hostname: "testvm".into(),
            user_data: b"#!/bin/sh\necho hi\n".to_vec(),
            network_config: Some(b"version: 2\n".to_vec()),
        };
        write_nocloud(&path, &seed).unwrap();
        let (label, files) = read_back(&path);
        assert_eq!(label, "cidata");
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["meta-data", "network-config", "user-data"]);
        let meta: serde_json::Value = serde_json::from_slice(&files[0].1).unwrap();
        assert_eq!(
            meta,
            serde_json::json!({"instance-id": "vmi-uid-1", "local-hostname": "testvm"})
        );
        assert_eq!(files[1].1, b"version: 2\n");
        assert_eq!(files[2].1, seed.user_data);
        assert!(!dir.path().join("noCloud.iso.staging").exists());
    }

    #[test]
    fn config_drive_image_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("configdrive.iso");
        let seed = ConfigDriveSeed {
            instance_id: "6a1c2b3e-0000-4000-8000-000000000001".into(),
            hostname: "cdvm".into(),
            user_data: b"#cloud-config\n".to_vec(),
            network_data: Some(br#"{"links":[]}"#.to_vec()),
        };
        write_config_drive(&path, &seed).unwrap();
        let (label, files) = read_back(&path);
        assert_eq!(label, "config-2");
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "openstack/latest/meta_data.json",
                "openstack/latest/network_data.json",
                "openstack/latest/user_data",
            ]
        );
        let meta: serde_json::Value = serde_json::from_slice(&files[0].1).unwrap();
        assert_eq!(
            meta,
            serde_json::json!({
                "instance_id": seed.instance_id,
                "uuid": seed.instance_id,
                "hostname": "cdvm",
            })
        );
        assert_eq!(files[1].1, br#"{"links":[]}"#);
        assert_eq!(files[2].1, seed.user_data);
    }

    /// The primary tree holds the same files under ECMA-119 names, for readers without Joliet.
    #[test]
    fn primary_tree_has_plain_names() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("configdrive.iso");
        let seed = ConfigDriveSeed {
            instance_id: "u".into(),
            hostname: "h".into(),
            user_data: b"data".to_vec(),
            network_data: None,
        };
        write_config_drive(&path, &seed).unwrap();
        let (label, files) = read_tree(&fs::read(&path).unwrap(), false);
        assert_eq!(label, "config-2");
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "OPENSTACK/LATEST/META_DATA.JSON;1",
                "OPENSTACK/LATEST/USER_DATA.;1"
            ]
        );
        assert_eq!(files[1].1, b"data");
    }

    #[test]
    fn optional_parts_are_left_out() {
        let nocloud = nocloud_files(&NoCloudSeed {
            instance_id: "i".into(),
            ..NoCloudSeed::default()
        })
        .unwrap();
        assert_eq!(nocloud.len(), 2);
        assert_eq!(nocloud[0].content, br#"{"instance-id":"i"}"#);
        let drive = config_drive_files(&ConfigDriveSeed {
            instance_id: "u".into(),
            ..ConfigDriveSeed::default()
        })
        .unwrap();
        assert_eq!(drive.len(), 2);
        assert_eq!(drive[0].content, br#"{"instance_id":"u","uuid":"u"}"#);
    }

    #[test]
    fn large_and_empty_files_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.iso");
        let user_data: Vec<u8> = (0..5 * 1024 * 1024_u32)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        let seed = ConfigDriveSeed {
            instance_id: "u".into(),
            hostname: "h".into(),
            user_data: user_data.clone(),
            network_data: Some(Vec::new()),
        };
        write_config_drive(&path, &seed).unwrap();
        let (_, files) = read_back(&path);
        assert_eq!(files[1].1, b"");
        assert_eq!(files[2].1, user_data);
    }

    /// Enough files to fill more than one sector of directory records: records must not
    /// straddle sectors and all of them must still be found.
    #[test]
    fn directory_spanning_sectors_reads_back() {
        let files: Vec<SeedFile> = (0..60)
            .map(|i| SeedFile {
                path: format!("dir/a-fairly-long-file-name-number-{i:02}"),
                content: format!("file {i}").into_bytes(),
            })
            .collect();
        let img = iso::build("many", &files);
        let (_, read) = read_tree(&img, true);
        assert_eq!(read.len(), 60);
        for (i, (name, content)) in read.iter().enumerate() {
            assert_eq!(
                name,
                &format!("dir/a-fairly-long-file-name-number-{i:02};1")
            );
            assert_eq!(content, &format!("file {i}").into_bytes());
        }
    }

    #[test]
    fn replaces_an_existing_image() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seed.iso");
        fs::write(&path, vec![0xff; 10 * SECTOR]).unwrap();
        let seed = NoCloudSeed {
            instance_id: "i".into(),
            hostname: "h".into(),
            user_data: b"new".to_vec(),
            network_config: None,
        };
        write_nocloud(&path, &seed).unwrap();
        let (_, files) = read_back(&path);
        assert_eq!(files[1], ("user-data".to_string(), b"new".to_vec()));
    }

    #[test]
    fn missing_directory_is_reported_with_its_path() {
        let path = Path::new("/nonexistent-kubevirt-rs-dir/seed.iso");
        let err = write_nocloud(path, &NoCloudSeed::default()).unwrap_err();
        assert!(matches!(err, Error::Create { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("/nonexistent-kubevirt-rs-dir/seed.iso.staging")
        );
    }

    /// An independent reader, util-linux's blkid, recognises the image and its label, which is
    /// how cloud-init and our test guest find the seed.
    #[test]
    fn blkid_sees_the_label() {
        let dir = tempfile::tempdir().unwrap();
        for (name, label) in [("nocloud.iso", "cidata"), ("configdrive.iso", "config-2")] {
            let path = dir.path().join(name);
            if label == "cidata" {
                write_nocloud(&path, &NoCloudSeed::default()).unwrap();
            } else {
                write_config_drive(&path, &ConfigDriveSeed::default()).unwrap();
            }
            let blkid = std::process::Command::new("blkid")
                .args(["-p", "-o", "export"])
                .arg(&path)
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&blkid.stdout);
            assert!(out.contains(&format!("\nLABEL={label}\n")), "{out}");
            assert!(out.contains("\nTYPE=iso9660\n"), "{out}");
        }
    }

    #[test]
    fn image_is_deterministic() {
        let seed = NoCloudSeed {
            instance_id: "i".into(),
            hostname: "h".into(),
            user_data: b"x".to_vec(),
            network_config: None,
        };
        let files = nocloud_files(&seed).unwrap();
        assert_eq!(iso::build("cidata", &files), iso::build("cidata", &files));
    }
}
