//! The cloud-init seed images (ISO9660 + Joliet): whatever a VMI's cloud-init volume carries,
//! the image `cloudinit` writes is read back by an independent reader (the `cdfs` crate, which
//! reads the Joliet tree, as a guest's kernel does) with the right volume label and every file
//! byte for byte.
#![no_main]

use std::io::Read as _;
use std::path::Path;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use cdfs::{DirectoryEntry, ISO9660};
use cloudinit::{ConfigDriveSeed, NoCloudSeed, SeedFile};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Seed {
    config_drive: bool,
    instance_id: String,
    hostname: String,
    /// Repeated `1 + repeat % 64` times, so that files span many sectors.
    user_data: Vec<u8>,
    repeat: u8,
    network: Option<Vec<u8>>,
}

fn dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"))
        .path()
}

fuzz_target!(|seed: Seed| {
    let path = dir().join("seed.iso");
    let user_data = seed.user_data.repeat(1 + usize::from(seed.repeat % 64));
    let (label, files) = if seed.config_drive {
        let seed = ConfigDriveSeed {
            instance_id: seed.instance_id,
            hostname: seed.hostname,
            user_data,
            network_data: seed.network,
        };
        cloudinit::write_config_drive(&path, &seed).expect("the image is written");
        (
            cloudinit::CONFIG_DRIVE_LABEL,
            cloudinit::config_drive_files(&seed),
        )
    } else {
        let seed = NoCloudSeed {
            instance_id: seed.instance_id,
            hostname: seed.hostname,
            user_data,
            network_config: seed.network,
        };
        cloudinit::write_nocloud(&path, &seed).expect("the image is written");
        (cloudinit::NOCLOUD_LABEL, cloudinit::nocloud_files(&seed))
    };
    let image = std::fs::read(&path).expect("the image");
    // cdfs does not show the volume identifier: ECMA-119 8.4.6 puts it in sector 16, at 40.
    let volume_id = image
        .get(16 * 2048 + 40..16 * 2048 + 72)
        .expect("a volume descriptor");
    assert_eq!(volume_id.trim_ascii_end(), label.as_bytes());
    let iso = ISO9660::new(std::io::Cursor::new(image)).expect("a readable ISO9660");
    for SeedFile { path, content } in files.expect("the seed's files") {
        let Ok(Some(DirectoryEntry::File(file))) = iso.open(&path) else {
            panic!("{path} is not in the image");
        };
        let mut read = Vec::new();
        file.read().read_to_end(&mut read).expect("the file reads");
        assert!(read == content, "{path} reads back as other bytes");
    }
});
