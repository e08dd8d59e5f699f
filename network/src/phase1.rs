//! Phase 1: the privileged half of a binding, run by virt-handler inside the pod's network
//! namespace before the first sync. It builds the bridge, the tap and the NAT, and caches what
//! it found and built in the pod's private dir, where the launcher (phase 2) reads it.
//!
//! Both [`setup`] and [`teardown`] are idempotent: run them after every restart, on every
//! reconcile. An established connection to the guest survives a re-run (nothing it uses is
//! deleted; the NAT table is swapped atomically and conntrack keeps its mapping).

use std::io::{Read as _, Write as _};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use api::VirtualMachineInstance;
use isolation::{NsKind, PodIsolation, Resolve};
use nix::fcntl::{OFlag, openat, renameat};
use nix::sys::stat::Mode;
use nix::unistd::{UnlinkatFlags, unlinkat};
use tracing::info;

use crate::cache::{self, Binding, CachedInterface, Ipv4Cidr};
use crate::error::{NetworkError, Result};
use crate::link::{self, Link, Netlink};
use crate::nft;
use crate::plan::{self, InterfacePlan, MASQUERADE_BRIDGE_MAC};

/// Wires every interface of `vmi` in the pod and returns (and caches) what the launcher needs.
///
/// `cache_dir` is a directory *as the pod sees it* (the launcher's `--private-dir`, KubeVirt's
/// `/var/run/kubevirt-private`); it is reached through the pod's root with `openat2`, so a
/// symlink planted by the pod cannot redirect the handler's writes. The tap is owned by the
/// pod process's user, so an unprivileged launcher's QEMU can open it.
pub fn setup(
    vmi: &VirtualMachineInstance,
    pod: &PodIsolation,
    cache_dir: &Path,
) -> Result<Vec<CachedInterface>> {
    let plans = plan::plan(vmi)?;
    if plans.is_empty() {
        return Ok(Vec::new());
    }
    let proc_dir = format!("/proc/{}", pod.pid);
    let meta =
        std::fs::metadata(&proc_dir).map_err(NetworkError::io(format!("reading {proc_dir}")))?;
    let (uid, gid) = (meta.uid(), meta.gid());
    let dir = CacheDir::open(pod, cache_dir)?;
    let mut out = Vec::new();
    for p in &plans {
        let previous = dir.read(&p.pod_interface)?;
        let iface = pod.run_in_namespace(NsKind::Net, || {
            in_runtime(async {
                let nl = Netlink::connect()?;
                match p.binding {
                    Binding::Masquerade => masquerade(&nl, p, previous.as_ref(), uid, gid).await,
                    Binding::Bridge => bridge(&nl, p, previous.as_ref(), uid, gid).await,
                }
            })
        })??;
        if previous.as_ref() != Some(&iface) {
            dir.write(&iface)?;
        }
        info!(iface = %iface.name, binding = ?iface.binding, tap = %iface.tap, "pod network ready");
        out.push(iface);
    }
    Ok(out)
}

/// Undoes [`setup`]: deletes the tap, the bridge and the NAT table; a bridged pod interface
/// gets its name, MAC, address and routes back; the cache files are removed.
pub fn teardown(vmi: &VirtualMachineInstance, pod: &PodIsolation, cache_dir: &Path) -> Result<()> {
    let plans = plan::plan(vmi)?;
    let dir = CacheDir::open(pod, cache_dir)?;
    for p in &plans {
        let previous = dir.read(&p.pod_interface)?;
        pod.run_in_namespace(NsKind::Net, || {
            in_runtime(async {
                let nl = Netlink::connect()?;
                nl.delete(&p.tap).await?;
                match p.binding {
                    Binding::Masquerade => {
                        nft::apply(
                            &nft::delete_ruleset(&p.pod_interface),
                            "deleting the masquerade tables",
                        )?;
                        nl.delete(&p.bridge).await
                    }
                    Binding::Bridge => {
                        nl.delete(&p.bridge).await?;
                        restore_pod_interface(&nl, p, previous.as_ref()).await
                    }
                }
            })
        })??;
        dir.remove(&p.pod_interface)?;
    }
    Ok(())
}

fn in_runtime<T>(f: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(NetworkError::io("starting a runtime for netlink"))?
        .block_on(f)
}

/// KubeVirt's name for the pod interface once a bridge binding has taken it over.
fn bridged_nic_name(pod_interface: &str) -> String {
    format!("{pod_interface}-nic")
}

async fn ensure_tap(
    nl: &Netlink,
    p: &InterfacePlan,
    bridge: &Link,
    mtu: u32,
    uid: u32,
    gid: u32,
) -> Result<()> {
    if nl.link(&p.tap).await?.is_none() {
        link::create_tap(&p.tap, p.queues, uid, gid)?;
    }
    let tap = nl.require_link(&p.tap).await?;
    nl.enslave(&tap, bridge, mtu).await
}

async fn masquerade(
    nl: &Netlink,
    p: &InterfacePlan,
    previous: Option<&CachedInterface>,
    uid: u32,
    gid: u32,
) -> Result<CachedInterface> {
    let pod = nl.require_link(&p.pod_interface).await?;
    let pod_ipv4 =
        match previous.and_then(|c| c.pod_ipv4) {
            Some(a) => a,
            None => *nl.ipv4_addresses(&pod).await?.first().ok_or_else(|| {
                NetworkError::NoPodAddress {
                    iface: p.pod_interface.clone(),
                    purpose: "masquerade the guest behind",
                }
            })?,
        };
    // The guest gets IPv6 when the pod has it (as in KubeVirt). Once decided it stays: the
    // cache is the record, so a re-run agrees with the launcher's DHCPv6 server.
    let ipv6 = match previous {
        Some(c) => c.guest_ipv6.is_some(),
        None => !nl.ipv6_global_addresses(&pod).await?.is_empty(),
    };
    let mtu = pod.mtu;
    let bridge = nl
        .ensure_bridge(&p.bridge, mtu, Some(MASQUERADE_BRIDGE_MAC))
        .await?;
    nl.ensure_address(&bridge, p.gateway()).await?;
    // Lets the output chain's DNAT of 127.0.0.1 (the pod reaching its guest on localhost) be
    // routed out of the bridge.
    link::sysctl(&format!("ipv4/conf/{}/route_localnet", p.bridge), "1")?;
    link::sysctl("ipv4/ip_forward", "1")?;
    if ipv6 {
        // No duplicate address detection on a bridge only the guest joins: the address is
        // usable at once instead of "tentative" for a second, and the bridge's link-local
        // address (the source of router advertisements) too.
        link::sysctl(&format!("ipv6/conf/{}/accept_dad", p.bridge), "0")?;
        nl.ensure_address(&bridge, p.gateway_ipv6()).await?;
        link::sysctl("ipv6/conf/all/forwarding", "1")?;
    }
    ensure_tap(nl, p, &bridge, mtu, uid, gid).await?;
    nl.set_up(&bridge).await?;
    nft::apply(
        &nft::masquerade_ruleset(p, ipv6),
        "installing the masquerade tables",
    )?;
    Ok(CachedInterface {
        name: p.name.clone(),
        binding: Binding::Masquerade,
        pod_interface: p.pod_interface.clone(),
        bridge: p.bridge.clone(),
        tap: p.tap.clone(),
        mtu,
        pod_mac: plan::format_mac(mac6(&pod.mac)),
        pod_ipv4: Some(pod_ipv4),
        routes: Vec::new(),
        guest_ipv4: Some(p.guest()),
        gateway_ipv4: Some(p.gateway().address),
        server_ipv4: p.gateway().address,
        guest_ipv6: ipv6.then(|| p.guest_ipv6()),
        gateway_ipv6: ipv6.then(|| p.gateway_ipv6().address),
    })
}

fn mac6(b: &[u8]) -> [u8; 6] {
    let mut m = [0u8; 6];
    for (d, s) in m.iter_mut().zip(b) {
        *d = *s;
    }
    m
}

async fn bridge(
    nl: &Netlink,
    p: &InterfacePlan,
    previous: Option<&CachedInterface>,
    uid: u32,
    gid: u32,
) -> Result<CachedInterface> {
    let nic_name = bridged_nic_name(&p.pod_interface);
    let nic = nl.link(&nic_name).await?;
    let (pod_mac, mtu, pod_ipv4, routes) = match (previous, &nic) {
        (Some(c), _) => (c.pod_mac.clone(), c.mtu, c.pod_ipv4, c.routes.clone()),
        (None, None) => {
            let pod = nl.require_link(&p.pod_interface).await?;
            let addr = nl.ipv4_addresses(&pod).await?.first().copied();
            let routes = nl.ipv4_routes(&pod).await?;
            (plan::format_mac(mac6(&pod.mac)), pod.mtu, addr, routes)
        }
        // Set up before, but the cache that held the pod's address is gone: nothing left says
        // what the guest should get.
        (None, Some(_)) => {
            return Err(NetworkError::NoPodAddress {
                iface: p.pod_interface.clone(),
                purpose: "hand to the guest (it was moved off the pod interface and its cache is lost)",
            });
        }
    };
    let Some(pod_ipv4) = pod_ipv4 else {
        return Err(NetworkError::NoPodAddress {
            iface: p.pod_interface.clone(),
            purpose: "hand to the guest",
        });
    };
    let bridge = nl.ensure_bridge(&p.bridge, mtu, None).await?;
    nl.ensure_address(
        &bridge,
        Ipv4Cidr {
            address: p.bridge_server_address(),
            prefix: 32,
        },
    )
    .await?;
    let nic = if let Some(n) = nic {
        n
    } else {
        // The guest takes the pod's address and MAC; the pod's interface becomes a plain
        // bridge port. It must not keep the MAC (the bridge would treat frames for the guest
        // as its own) nor the address (the pod would answer ARP for the guest).
        let pod = nl.require_link(&p.pod_interface).await?;
        nl.set_down(&pod).await?;
        nl.flush_ipv4(&pod).await?;
        nl.rename(&pod, &nic_name, &bridge.mac).await?;
        nl.require_link(&nic_name).await?
    };
    nl.enslave(&nic, &bridge, mtu).await?;
    ensure_tap(nl, p, &bridge, mtu, uid, gid).await?;
    nl.set_up(&bridge).await?;
    let gateway = routes
        .iter()
        .find(|r| r.prefix == 0)
        .and_then(|r| r.gateway);
    Ok(CachedInterface {
        name: p.name.clone(),
        binding: Binding::Bridge,
        pod_interface: p.pod_interface.clone(),
        bridge: p.bridge.clone(),
        tap: p.tap.clone(),
        mtu,
        pod_mac,
        pod_ipv4: Some(pod_ipv4),
        routes,
        guest_ipv4: Some(pod_ipv4),
        gateway_ipv4: gateway,
        server_ipv4: p.bridge_server_address(),
        guest_ipv6: None,
        gateway_ipv6: None,
    })
}

async fn restore_pod_interface(
    nl: &Netlink,
    p: &InterfacePlan,
    previous: Option<&CachedInterface>,
) -> Result<()> {
    let Some(nic) = nl.link(&bridged_nic_name(&p.pod_interface)).await? else {
        return Ok(());
    };
    let mac = previous
        .and_then(|c| plan::parse_mac(&c.pod_mac))
        .map_or_else(|| nic.mac.clone(), |m| m.to_vec());
    nl.set_down(&nic).await?;
    nl.rename(&nic, &p.pod_interface, &mac).await?;
    let pod = nl.require_link(&p.pod_interface).await?;
    nl.set_up(&pod).await?;
    if let Some(c) = previous {
        if let Some(a) = c.pod_ipv4 {
            nl.ensure_address(&pod, a).await?;
        }
        for r in &c.routes {
            nl.add_route(&pod, r).await?;
        }
    }
    Ok(())
}

/// The cache directory inside the pod, held open by descriptor; files are reached relative to
/// it without following symlinks.
struct CacheDir {
    fd: OwnedFd,
    shown: String,
}

impl CacheDir {
    fn open(pod: &PodIsolation, dir: &Path) -> Result<Self> {
        let root = pod.open_mount_root()?;
        let fd = root
            .open_file(dir, Resolve::InRoot, OFlag::O_PATH | OFlag::O_DIRECTORY)?
            .into();
        Ok(Self {
            fd,
            shown: format!("{} (in pod {})", dir.display(), pod.pid),
        })
    }

    fn io(&self, what: &str, name: &str) -> impl FnOnce(nix::Error) -> NetworkError {
        let action = format!("{what} {name} in {}", self.shown);
        move |e| NetworkError::io(action)(e.into())
    }

    fn read(&self, pod_interface: &str) -> Result<Option<CachedInterface>> {
        let name = cache::file_name(pod_interface);
        let fd = match openat(
            self.fd.as_fd(),
            name.as_str(),
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(nix::Error::ENOENT) => return Ok(None),
            Err(e) => return Err(self.io("opening", &name)(e)),
        };
        let mut bytes = Vec::new();
        std::fs::File::from(fd)
            .read_to_end(&mut bytes)
            .map_err(NetworkError::io(format!(
                "reading {name} in {}",
                self.shown
            )))?;
        cache::decode(Path::new(&name), &bytes).map(Some)
    }

    /// Writes next to the target and renames, so a reader never sees half a file.
    fn write(&self, iface: &CachedInterface) -> Result<()> {
        let name = cache::file_name(&iface.pod_interface);
        let tmp = format!(".{name}.tmp");
        let create = || {
            openat(
                self.fd.as_fd(),
                tmp.as_str(),
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o644),
            )
        };
        let fd = match create() {
            // Left by a handler that died mid-write.
            Err(nix::Error::EEXIST) => {
                unlinkat(self.fd.as_fd(), tmp.as_str(), UnlinkatFlags::NoRemoveDir)
                    .map_err(self.io("removing", &tmp))?;
                create()
            }
            r => r,
        }
        .map_err(self.io("creating", &tmp))?;
        std::fs::File::from(fd)
            .write_all(&cache::encode(iface))
            .map_err(NetworkError::io(format!("writing {tmp} in {}", self.shown)))?;
        renameat(
            self.fd.as_fd(),
            tmp.as_str(),
            self.fd.as_fd(),
            name.as_str(),
        )
        .map_err(self.io("renaming into place", &name))
    }

    fn remove(&self, pod_interface: &str) -> Result<()> {
        let name = cache::file_name(pod_interface);
        match unlinkat(self.fd.as_fd(), name.as_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(nix::Error::ENOENT) => Ok(()),
            Err(e) => Err(self.io("removing", &name)(e)),
        }
    }
}
