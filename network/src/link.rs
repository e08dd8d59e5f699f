//! Links, addresses and routes in the calling thread's network namespace, over rtnetlink; taps
//! over the tun driver's ioctls. Every function is idempotent: it looks before it acts.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd as _;

use futures::TryStreamExt as _;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::{Handle, LinkBridge, LinkUnspec, RouteMessageBuilder};

use crate::cache::{Cidr, Ipv4Cidr, Ipv6Cidr, Route};
use crate::error::{NetworkError, Result};

/// One link as netlink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub mac: Vec<u8>,
    pub mtu: u32,
    pub controller: Option<u32>,
    pub kind: Option<InfoKind>,
}

impl Link {
    fn from_message(m: &LinkMessage) -> Self {
        let mut l = Link {
            index: m.header.index,
            name: String::new(),
            mac: Vec::new(),
            mtu: 0,
            controller: None,
            kind: None,
        };
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => l.name.clone_from(n),
                LinkAttribute::Address(mac) => l.mac.clone_from(mac),
                LinkAttribute::Mtu(mtu) => l.mtu = *mtu,
                LinkAttribute::Controller(c) => l.controller = Some(*c),
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        if let LinkInfo::Kind(k) = i {
                            l.kind = Some(k.clone());
                        }
                    }
                }
                _ => {}
            }
        }
        l
    }
}

fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

/// A netlink connection opened in the calling thread's network namespace (a netlink socket
/// belongs to the namespace it was created in, whatever thread uses it later).
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
}

impl Netlink {
    /// Must be called inside a tokio runtime; the connection task is spawned on it.
    pub fn connect() -> Result<Self> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(NetworkError::io("opening a netlink socket"))?;
        tokio::spawn(conn);
        Ok(Self { handle })
    }

    pub async fn link(&self, name: &str) -> Result<Option<Link>> {
        let mut s = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match s.try_next().await {
            Ok(m) => Ok(m.as_ref().map(Link::from_message)),
            Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
            Err(e) => Err(NetworkError::netlink(format!("looking up link {name}"))(e)),
        }
    }

    pub async fn require_link(&self, name: &str) -> Result<Link> {
        self.link(name)
            .await?
            .ok_or_else(|| NetworkError::NoPodInterface {
                iface: name.to_owned(),
            })
    }

    async fn set(&self, msg: LinkMessage, what: String) -> Result<()> {
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .map_err(NetworkError::netlink(what))
    }

    /// Creates the bridge if it does not exist; sets its MTU (and MAC, when given) either way.
    pub async fn ensure_bridge(&self, name: &str, mtu: u32, mac: Option<[u8; 6]>) -> Result<Link> {
        if self.link(name).await?.is_none() {
            let mut b = LinkBridge::new(name).mtu(mtu);
            if let Some(mac) = mac {
                b = b.address(mac.to_vec());
            }
            match self.handle.link().add(b.build()).execute().await {
                Ok(()) => {}
                Err(e) if is_errno(&e, libc::EEXIST) => {}
                Err(e) => return Err(NetworkError::netlink(format!("creating bridge {name}"))(e)),
            }
        }
        let l = self.require_link(name).await?;
        let mut m = LinkUnspec::new_with_index(l.index).mtu(mtu);
        if let Some(mac) = mac {
            m = m.address(mac.to_vec());
        }
        self.set(m.build(), format!("setting MTU/MAC of {name}"))
            .await?;
        self.require_link(name).await
    }

    pub async fn set_up(&self, l: &Link) -> Result<()> {
        self.set(
            LinkUnspec::new_with_index(l.index).up().build(),
            format!("bringing {} up", l.name),
        )
        .await
    }

    pub async fn set_down(&self, l: &Link) -> Result<()> {
        self.set(
            LinkUnspec::new_with_index(l.index).down().build(),
            format!("bringing {} down", l.name),
        )
        .await
    }

    /// Puts `port` on `bridge` with the given MTU and brings it up.
    pub async fn enslave(&self, port: &Link, bridge: &Link, mtu: u32) -> Result<()> {
        self.set(
            LinkUnspec::new_with_index(port.index)
                .controller(bridge.index)
                .mtu(mtu)
                .up()
                .build(),
            format!("attaching {} to {}", port.name, bridge.name),
        )
        .await
    }

    /// Renames a link (it must be down) and sets its MAC.
    pub async fn rename(&self, l: &Link, name: &str, mac: &[u8]) -> Result<()> {
        self.set(
            LinkUnspec::new_with_index(l.index)
                .name(name.to_owned())
                .address(mac.to_vec())
                .build(),
            format!("renaming {} to {name}", l.name),
        )
        .await
    }

    pub async fn delete(&self, name: &str) -> Result<()> {
        let Some(l) = self.link(name).await? else {
            return Ok(());
        };
        match self.handle.link().del(l.index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::ENODEV) => Ok(()),
            Err(e) => Err(NetworkError::netlink(format!("deleting link {name}"))(e)),
        }
    }

    /// The link's address messages. The kernel filters by index only with strict checking, so
    /// they are filtered again here.
    async fn address_messages(&self, l: &Link) -> Result<Vec<AddressMessage>> {
        let msgs: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .set_link_index_filter(l.index)
            .execute()
            .try_collect()
            .await
            .map_err(NetworkError::netlink(format!(
                "listing addresses of {}",
                l.name
            )))?;
        Ok(msgs
            .into_iter()
            .filter(|m| m.header.index == l.index)
            .collect())
    }

    /// Every address of the link, both families.
    pub async fn addresses(&self, l: &Link) -> Result<Vec<Cidr<IpAddr>>> {
        let msgs = self.address_messages(l).await?;
        let mut out = Vec::new();
        for m in msgs {
            for a in &m.attributes {
                if let AddressAttribute::Local(ip) | AddressAttribute::Address(ip) = a {
                    let c = Cidr {
                        address: *ip,
                        prefix: m.header.prefix_len,
                    };
                    if !out.contains(&c) {
                        out.push(c);
                    }
                }
            }
        }
        Ok(out)
    }

    pub async fn ipv4_addresses(&self, l: &Link) -> Result<Vec<Ipv4Cidr>> {
        Ok(self
            .addresses(l)
            .await?
            .into_iter()
            .filter_map(|c| match c.address {
                IpAddr::V4(address) => Some(Cidr {
                    address,
                    prefix: c.prefix,
                }),
                IpAddr::V6(_) => None,
            })
            .collect())
    }

    /// IPv6 addresses beyond link-local (`fe80::/10`, which every link has).
    pub async fn ipv6_global_addresses(&self, l: &Link) -> Result<Vec<Ipv6Cidr>> {
        Ok(self
            .addresses(l)
            .await?
            .into_iter()
            .filter_map(|c| match c.address {
                IpAddr::V6(address) if !address.is_unicast_link_local() => Some(Cidr {
                    address,
                    prefix: c.prefix,
                }),
                _ => None,
            })
            .collect())
    }

    pub async fn ensure_address<A: Into<IpAddr> + std::fmt::Display + Copy>(
        &self,
        l: &Link,
        addr: Cidr<A>,
    ) -> Result<()> {
        let ip: IpAddr = addr.address.into();
        let wanted = Cidr {
            address: ip,
            prefix: addr.prefix,
        };
        if self.addresses(l).await?.contains(&wanted) {
            return Ok(());
        }
        match self
            .handle
            .address()
            .add(l.index, ip, addr.prefix)
            .execute()
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
            Err(e) => Err(NetworkError::netlink(format!(
                "adding {addr} to {}",
                l.name
            ))(e)),
        }
    }

    /// Removes every IPv4 address of the link (their subnet routes go with them).
    pub async fn flush_ipv4(&self, l: &Link) -> Result<()> {
        let msgs = self.address_messages(l).await?;
        for m in msgs {
            if m.header.family != rtnetlink::packet_route::AddressFamily::Inet {
                continue;
            }
            self.handle
                .address()
                .del(m)
                .execute()
                .await
                .map_err(NetworkError::netlink(format!(
                    "removing addresses of {}",
                    l.name
                )))?;
        }
        Ok(())
    }

    /// The main table's IPv4 routes through the link that have a gateway or are not the
    /// kernel's own subnet routes.
    pub async fn ipv4_routes(&self, l: &Link) -> Result<Vec<Route>> {
        let msgs: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_collect()
            .await
            .map_err(NetworkError::netlink("listing IPv4 routes"))?;
        let mut out = Vec::new();
        for m in msgs {
            if m.header.table != RouteHeader::RT_TABLE_MAIN {
                continue;
            }
            let mut oif = None;
            let mut dst = Ipv4Addr::UNSPECIFIED;
            let mut gw = None;
            for a in &m.attributes {
                match a {
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Destination(RouteAddress::Inet(d)) => dst = *d,
                    RouteAttribute::Gateway(RouteAddress::Inet(g)) => gw = Some(*g),
                    _ => {}
                }
            }
            if oif == Some(l.index) && gw.is_some() {
                out.push(Route {
                    destination: dst,
                    prefix: m.header.destination_prefix_length,
                    gateway: gw,
                });
            }
        }
        Ok(out)
    }

    pub async fn add_route(&self, l: &Link, r: &Route) -> Result<()> {
        let mut b = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(r.destination, r.prefix)
            .output_interface(l.index);
        if let Some(g) = r.gateway {
            b = b.gateway(g);
        }
        match self.handle.route().add(b.build()).execute().await {
            Ok(()) => Ok(()),
            Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
            Err(e) => Err(NetworkError::netlink(format!(
                "adding route {}/{} via {:?} on {}",
                r.destination, r.prefix, r.gateway, l.name
            ))(e)),
        }
    }
}

// The tun driver has no netlink "newlink": a tap is created, given an owner and made to outlive
// its file descriptor only through ioctls on /dev/net/tun (the kernel answers EOPNOTSUPP to an
// RTM_NEWLINK of kind tun, which is why rtnetlink's LinkTun cannot do it).
mod tun {
    nix::ioctl_write_ptr_bad!(set_iff, 0x4004_54ca, libc::ifreq);
    nix::ioctl_write_int_bad!(set_persist, 0x4004_54cb);
    nix::ioctl_write_int_bad!(set_owner, 0x4004_54cc);
    nix::ioctl_write_int_bad!(set_group, 0x4004_54ce);
}

/// Creates a persistent tap owned by `uid`/`gid` in the calling thread's network namespace
/// (the tun driver uses the namespace of the thread that calls TUNSETIFF). A tap that exists
/// already is left alone: QEMU may hold it open, and TUNSETIFF on it would fail.
///
/// With more than one queue the tap is made with `IFF_MULTI_QUEUE` (KubeVirt's
/// `virt-chroot create-tap --queue-number`, libvirt's flags): the kernel then lets QEMU
/// attach one file per queue, and refuses a second attach to a single-queue tap.
pub fn create_tap(name: &str, queues: u32, uid: u32, gid: u32) -> Result<()> {
    let err = |what: &str| {
        let what = format!("{what} tap {name}");
        move |e: nix::Error| NetworkError::io(what)(std::io::Error::from(e))
    };
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(NetworkError::io("opening /dev/net/tun"))?;
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(NetworkError::io(format!("naming tap {name}"))(
            std::io::Error::from_raw_os_error(libc::ENAMETOOLONG),
        ));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s.cast_signed();
    }
    // IFF_VNET_HDR: QEMU's virtio-net passes offloads through the header; it sets the flag again
    // when it opens the tap, but a tap created without it can refuse the later TUNSETIFF.
    let multi_queue = if queues > 1 { libc::IFF_MULTI_QUEUE } else { 0 };
    req.ifr_ifru.ifru_flags =
        libc::c_short::try_from(libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | multi_queue)
            .expect("the tun flags fit in a short");
    let fd = tun.as_raw_fd();
    // SAFETY: fd is an open /dev/net/tun; req is a valid ifreq that outlives the call.
    unsafe { tun::set_iff(fd, &raw const req) }.map_err(err("creating"))?;
    // SAFETY: fd is the tun file just attached to the tap; the arguments are plain integers.
    unsafe { tun::set_owner(fd, uid.cast_signed()) }.map_err(err("setting the owner of"))?;
    // SAFETY: as above.
    unsafe { tun::set_group(fd, gid.cast_signed()) }.map_err(err("setting the group of"))?;
    // SAFETY: as above.
    unsafe { tun::set_persist(fd, 1) }.map_err(err("making persistent"))?;
    Ok(())
}

/// Writes a sysctl under /proc/sys/net, which the kernel resolves in the writing thread's
/// network namespace.
pub fn sysctl(path: &str, value: &str) -> Result<()> {
    let p = format!("/proc/sys/net/{path}");
    std::fs::write(&p, value).map_err(NetworkError::io(format!("writing {value} to {p}")))
}
