//! What the fuzz targets share: VMIs from fuzz input (JSON as given, or generated from the
//! VMI CRD's own schema), QEMU's option syntax as a checker, and one tokio runtime.

pub mod argv;
pub mod vmi;

use std::sync::OnceLock;

/// One current-thread runtime for every input: building one per input would cost more than the
/// input's own work.
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

/// What the launcher would run for `vmi` on a KVM and on a TCG host: the converter's answer,
/// and for a plan its argv, checked against QEMU's syntax (a panic names the broken rule).
/// Paths hold commas, so that escaping is exercised by every plan.
pub fn check_conversion(vmi: &api::VirtualMachineInstance) {
    use launcher::qemu::Accel;
    let root = std::path::Path::new("/run/kubevirt,x");
    let dirs = launcher::paths::Dirs {
        share: root.join("share"),
        private: root.join("private"),
        ephemeral: root.join("ephemeral"),
        container_disks: root.join("container-disks"),
        hotplug_disks: root.join("hotplug-disks"),
        block_devices: root.join("dev"),
        nvram: root.join("nvram"),
    };
    for accel in [Accel::Kvm, Accel::Tcg] {
        let host = launcher::convert::Host {
            accel,
            ovmf_dir: "/usr/share/OVMF".into(),
            hugepages_dir: root.join("hugepages"),
            block_volumes: ["data".to_owned()].into(),
            network: [("default".to_owned(), cached_interface())].into(),
        };
        if let Ok(plan) = launcher::convert::convert(vmi, &dirs, &host) {
            let argv = plan.config.argv();
            if let Err(why) = argv::check(&argv) {
                panic!("{why}\nargv: {argv:?}");
            }
        }
    }
}

/// The masquerade interface phase 1 caches for the pod network (with IPv6).
pub fn cached_interface() -> network::cache::CachedInterface {
    use network::cache::{Binding, CachedInterface, Cidr};
    CachedInterface {
        name: "default".into(),
        binding: Binding::Masquerade,
        pod_interface: "eth0".into(),
        bridge: "k6t-eth0".into(),
        tap: "tap0".into(),
        mtu: 1450,
        pod_mac: "52:54:00:12:34:56".into(),
        pod_ipv4: None,
        routes: Vec::new(),
        guest_ipv4: Some(Cidr {
            address: [10, 0, 2, 2].into(),
            prefix: 24,
        }),
        gateway_ipv4: Some([10, 0, 2, 1].into()),
        server_ipv4: [10, 0, 2, 1].into(),
        guest_ipv6: Some(Cidr {
            address: "fd10:0:2::2".parse().expect("an address"),
            prefix: 120,
        }),
        gateway_ipv6: Some("fd10:0:2::1".parse().expect("an address")),
    }
}
