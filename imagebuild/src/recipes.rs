//! The project's images: what each contains and how it starts.
//!
//! - Rust components (`virt-operator`, `virt-api`, `virt-controller`, `virt-handler`): a distroless-style base
//!   layer (the C library closure of our programs, `/etc/passwd`, `/tmp`) shared by every
//!   component image, plus the program (and for virt-handler, `nft`).
//! - `virt-launcher`: the same base, a QEMU layer (`qemu-system-x86_64`, `qemu-img`,
//!   `virtiofsd`, the TCG accelerator module, firmware, VNC keymaps and exactly the libraries
//!   they need, copied from this machine's Debian packages) and the launcher with `virt-probe` (the kubelet runs it for
//!   a VMI's exec and guestAgentPing probes), `container-disk` and `cp`, which the launcher
//!   pod's `container-disk-binary` init container runs, as KubeVirt's does.
//! - `container-disk`: the static helper alone.
//! - Test images (`test-guest-disk`, `test-guest-kernel`, `test-tools`) from the test guest
//!   build and Debian's static busybox.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ociimage::{ImageSpec, Reference, Source, Tree};

use crate::files::{self, FilesError, Layer};

/// The component images, by name (also their programs' names).
pub const COMPONENTS: [&str; 6] = [
    "virt-operator",
    "virt-api",
    "virt-controller",
    "virt-handler",
    "virt-launcher",
    "container-disk",
];

/// The test images, by name.
pub const TEST_IMAGES: [&str; 3] = ["test-guest-disk", "test-guest-kernel", "test-tools"];

/// Where images' inputs are.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The Rust programs (a cargo profile directory).
    pub bin_dir: PathBuf,
    /// The statically linked `container-disk`.
    pub container_disk: PathBuf,
    /// The test guest build (`hack/guest/build.sh`), for the test images.
    pub guest_dir: Option<PathBuf>,
}

/// How images are named: `<registry>/<name>:<tag>`.
#[derive(Debug, Clone)]
pub struct Naming {
    pub registry: String,
    pub tag: String,
}

impl Naming {
    pub fn reference(&self, name: &str) -> Result<Reference, ociimage::ReferenceError> {
        Reference::parse(&format!("{}/{name}:{}", self.registry, self.tag))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    Reference(#[from] ociimage::ReferenceError),
    #[error(
        "{0}: the test images need the test guest build (hack/guest/build.sh); give --guest-dir"
    )]
    NoGuest(&'static str),
    #[error("unknown image {0:?} (components: {components}; tests: {tests})", components = COMPONENTS.join(", "), tests = TEST_IMAGES.join(", "))]
    Unknown(String),
}

/// QEMU, qemu-img, and virtiofsd (Debian 12's is QEMU's C daemon, in `qemu-system-common`),
/// which a launcher pod's `virtiofs-<volume>` containers run from this image.
const QEMU_PROGRAMS: [&str; 3] = [
    "/usr/bin/qemu-system-x86_64",
    "/usr/bin/qemu-img",
    "/usr/lib/qemu/virtiofsd",
];
/// QEMU loads its TCG accelerator as a module (Debian builds it modular); KVM is built in.
const QEMU_MODULES: [&str; 1] = ["/usr/lib/x86_64-linux-gnu/qemu/accel-tcg-x86_64.so"];
/// Firmware QEMU finds in its data directories (Debian's qemu-system-data, seabios, ipxe-qemu),
/// the OVMF images the launcher's EFI boot uses (4 MiB builds, plain and secure boot), and the
/// VNC keymaps (en-us by default).
const QEMU_DATA: [&str; 12] = [
    "/usr/share/qemu/kvmvapic.bin",
    "/usr/share/qemu/linuxboot.bin",
    "/usr/share/qemu/linuxboot_dma.bin",
    "/usr/share/qemu/multiboot_dma.bin",
    "/usr/share/qemu/pvh.bin",
    "/usr/share/qemu/keymaps",
    "/usr/share/seabios",
    "/usr/lib/ipxe/qemu",
    "/usr/share/OVMF/OVMF_CODE_4M.fd",
    "/usr/share/OVMF/OVMF_VARS_4M.fd",
    "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd",
    "/usr/share/OVMF/OVMF_VARS_4M.ms.fd",
];

fn labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("org.opencontainers.image.title".into(), name.into()),
        (
            "org.opencontainers.image.source".into(),
            "https://github.com/kubevirt-rs/kubevirt-rs".into(),
        ),
        (
            "org.opencontainers.image.licenses".into(),
            "Apache-2.0".into(),
        ),
    ])
}

/// The base of every component image: the C library our programs link against (with its
/// loader), accounts for root and KubeVirt's qemu user (107), `/tmp` and `/run`.
fn base_layer(inputs: &Inputs) -> Result<Tree, FilesError> {
    let mut layer = Layer::new(None);
    // The programs go in their own layers; their libraries are shared here.
    for program in [
        "virt-operator",
        "virt-api",
        "virt-controller",
        "virt-handler",
        "virt-launcher",
        "virt-probe",
    ] {
        for lib in files::libraries(&inputs.bin_dir.join(program))? {
            layer.host_path(&lib)?;
        }
    }
    layer
        .tree
        .file(
            "/etc/passwd",
            Source::Bytes(
                b"root:x:0:0:root:/root:/sbin/nologin\nqemu:x:107:107:qemu:/:/sbin/nologin\n"
                    .to_vec(),
            ),
            0o644,
        )
        .file(
            "/etc/group",
            Source::Bytes(b"root:x:0:\nqemu:x:107:\n".to_vec()),
            0o644,
        )
        .dir("/tmp", 0o1777)
        .dir("/run", 0o755)
        .symlink("/var/run", "/run")
        .dir("/root", 0o700);
    Ok(layer.tree)
}

/// The programs a component runs besides its own: virt-handler plugs pod networks with
/// nftables through `nft` (the `nftables` crate drives its JSON interface).
fn tools_of(program: &str) -> &'static [&'static str] {
    match program {
        "virt-handler" => &["/usr/sbin/nft"],
        _ => &[],
    }
}

/// Our programs an image carries besides its component's: the kubelet runs `virt-probe` in
/// the launcher's compute container for a VMI's exec and guestAgentPing probes.
fn companions_of(program: &str) -> &'static [&'static str] {
    match program {
        "virt-launcher" => &["virt-probe"],
        _ => &[],
    }
}

/// The component's program, and the tools it runs with what they need beyond `base`.
fn program_layer(inputs: &Inputs, program: &str, base: &Tree) -> Result<Tree, FilesError> {
    let mut layer = Layer::new(Some(base));
    for p in std::iter::once(program).chain(companions_of(program).iter().copied()) {
        layer.program(&inputs.bin_dir.join(p), &Path::new("/usr/bin").join(p))?;
    }
    for tool in tools_of(program) {
        layer.elf_with_libraries(Path::new(tool))?;
    }
    Ok(layer.tree)
}

fn qemu_layer(base: &Tree) -> Result<Tree, FilesError> {
    let mut layer = Layer::new(Some(base));
    for program in QEMU_PROGRAMS
        .iter()
        .chain(&QEMU_MODULES)
        .chain(&["/usr/bin/cp"])
    {
        layer.elf_with_libraries(Path::new(program))?;
    }
    for data in QEMU_DATA {
        layer.host_path(Path::new(data))?;
    }
    Ok(layer.tree)
}

fn component(name: &str, layers: Vec<Tree>, naming: &Naming) -> Result<ImageSpec, RecipeError> {
    let mut spec = ImageSpec::new(naming.reference(name)?);
    spec.layers = layers;
    spec.entrypoint = vec![format!("/usr/bin/{name}")];
    spec.labels = labels(name);
    Ok(spec)
}

/// The component images.
pub fn components(inputs: &Inputs, naming: &Naming) -> Result<Vec<ImageSpec>, RecipeError> {
    let base = base_layer(inputs)?;
    let qemu = qemu_layer(&base)?;
    let mut out = Vec::new();
    for name in ["virt-operator", "virt-api", "virt-controller"] {
        out.push(component(
            name,
            vec![base.clone(), program_layer(inputs, name, &base)?],
            naming,
        )?);
    }
    // virt-handler's node labeller asks the node's QEMU for its CPU models and features, as
    // KubeVirt's asks libvirt in an init container of the launcher image: the same QEMU layer,
    // stored once.
    out.push(component(
        "virt-handler",
        vec![
            base.clone(),
            qemu.clone(),
            program_layer(inputs, "virt-handler", &base)?,
        ],
        naming,
    )?);
    files::check_static(&inputs.container_disk)?;
    let disk = Source::Path(inputs.container_disk.clone());
    let mut launcher = program_layer(inputs, "virt-launcher", &base)?;
    launcher.file("/usr/bin/container-disk", disk.clone(), 0o755);
    out.push(component(
        "virt-launcher",
        vec![base, qemu, launcher],
        naming,
    )?);
    let mut alone = Tree::new();
    alone.file("/usr/bin/container-disk", disk, 0o755);
    out.push(component("container-disk", vec![alone], naming)?);
    Ok(out)
}

/// The test images: the guest's container disk (`/disk/disk.qcow2`, KubeVirt's layout) and
/// kernel (`/boot/vmlinuz`, `/boot/initrd.img`), and [`test_tools`].
pub fn test_images(inputs: &Inputs, naming: &Naming) -> Result<Vec<ImageSpec>, RecipeError> {
    let guest = inputs
        .guest_dir
        .as_deref()
        .ok_or(RecipeError::NoGuest("test-guest-disk"))?;
    let mut disk = Tree::new();
    disk.file(
        "/disk/disk.qcow2",
        Source::Path(guest.join("disk.qcow2")),
        0o444,
    );
    let mut kernel = Tree::new();
    kernel
        .file("/boot/vmlinuz", Source::Path(guest.join("vmlinuz")), 0o444)
        .file(
            "/boot/initrd.img",
            Source::Path(guest.join("initrd.img")),
            0o444,
        );
    let mut out = Vec::new();
    for (name, tree) in [("test-guest-disk", disk), ("test-guest-kernel", kernel)] {
        let mut spec = ImageSpec::new(naming.reference(name)?);
        spec.layers = vec![tree];
        spec.labels = labels(name);
        out.push(spec);
    }
    out.push(test_tools(naming)?);
    Ok(out)
}

/// The tree of `test-tools`: Debian's static busybox with a link for each of its applets,
/// and socat and curl with their libraries.
pub fn test_tools_layer() -> Result<Tree, FilesError> {
    let mut tools = Layer::new(None);
    files::check_static(Path::new("/bin/busybox"))?;
    tools.program(Path::new("/bin/busybox"), Path::new("/bin/busybox"))?;
    tools.elf_with_libraries(Path::new("/usr/bin/socat"))?;
    tools.elf_with_libraries(Path::new("/usr/bin/curl"))?;
    let applets = std::process::Command::new("/bin/busybox")
        .arg("--list-full")
        .output()
        .map_err(|source| FilesError::Io {
            path: "/bin/busybox --list-full".into(),
            source,
        })?;
    for applet in String::from_utf8_lossy(&applets.stdout).lines() {
        let path = Path::new("/").join(applet);
        if tools.tree.get(&path).is_none() {
            tools.tree.symlink(&path, "/bin/busybox");
        }
    }
    tools.tree.dir("/tmp", 0o1777).file(
        "/etc/passwd",
        Source::Bytes(b"root:x:0:0:root:/root:/bin/sh\n".to_vec()),
        0o644,
    );
    Ok(tools.tree)
}

/// `test-tools`: a shell and tools for plain test pods.
pub fn test_tools(naming: &Naming) -> Result<ImageSpec, RecipeError> {
    let mut spec = ImageSpec::new(naming.reference("test-tools")?);
    spec.layers = vec![test_tools_layer()?];
    spec.labels = labels("test-tools");
    spec.cmd = vec!["/bin/sh".into()];
    Ok(spec)
}
