//! Phase 2 of pod networking (phase 1 is virt-handler's, `network::phase1`): read what phase 1
//! cached in the private dir, and serve DHCP to the guest on each interface's bridge (and,
//! where phase 1 gave the guest IPv6, DHCPv6 and router advertisements). The NIC itself is
//! rendered by `convert` from the same cache (MAC, MTU).

use std::collections::BTreeMap;
use std::path::Path;

use api::VirtualMachineInstance;
use network::CachedInterface;
use tokio::task::AbortHandle;

use crate::error::Error;
use crate::qemu::Nic;

/// The pod's resolver configuration, whose servers and search domains the guest gets.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// Phase 1's cache for every interface of the VMI that has one, by interface name. An
/// interface without a cache (phase 1 has not run, or the VMI has no pod network) is simply
/// absent; conversion then falls back to a generated MAC and no MTU, and no DHCP is served.
pub fn read_caches(
    vmi: &VirtualMachineInstance,
    private_dir: &Path,
) -> Result<BTreeMap<String, CachedInterface>, Error> {
    // An unplannable VMI is refused by conversion, which names the field; nothing to read here.
    let Ok(plans) = network::plan::plan(vmi) else {
        return Ok(BTreeMap::new());
    };
    let mut out = BTreeMap::new();
    for p in plans {
        let cached = network::cache::read(private_dir, &p.pod_interface)
            .map_err(|e| Error::Network(with_causes(&e)))?;
        if let Some(c) = cached {
            out.insert(p.name, c);
        }
    }
    Ok(out)
}

/// The error and its causes in one line, for an API answer that has room for one string.
fn with_causes(e: &network::NetworkError) -> String {
    let mut msg = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        msg.push_str(": ");
        msg.push_str(&c.to_string());
        cause = c.source();
    }
    msg
}

/// The DHCP servers (and router advertisers) of one domain; dropping this stops them.
#[derive(Debug, Default)]
pub struct Dhcp(Vec<AbortHandle>);

impl Dhcp {
    /// Binds one server per NIC that phase 1 set up, answering that NIC's MAC; for a guest
    /// with IPv6 also a DHCPv6 server and router advertisements. Binding errors (the bridge is
    /// gone, no privilege for port 67 or 547 or a raw socket) fail the start: a guest that
    /// would never get an address is worse than a clear error.
    pub fn start(
        vmi: &VirtualMachineInstance,
        nics: &[Nic],
        caches: &BTreeMap<String, CachedInterface>,
        resolv_conf: &str,
    ) -> Result<Self, Error> {
        let hostname = vmi
            .spec
            .hostname
            .clone()
            .or_else(|| vmi.metadata.name.clone())
            .unwrap_or_default();
        let mut tasks = Dhcp::default();
        for nic in nics {
            let Some(cached) = caches.get(&nic.name) else {
                continue;
            };
            let Some(mac) = nic.mac.as_deref().and_then(network::plan::parse_mac) else {
                continue;
            };
            let failed = |what: &str| {
                let what = format!("{what} for interface {}", nic.name);
                move |e: network::NetworkError| {
                    Error::Network(format!("{what}: {}", with_causes(&e)))
                }
            };
            if let Some(cfg) = network::dhcp::config(cached, mac, &hostname, resolv_conf) {
                let serve = network::dhcp::serve(cfg).map_err(failed("DHCP"))?;
                tasks.0.push(tokio::spawn(serve).abort_handle());
            }
            if let Some(cfg) = network::dhcp6::config(cached, mac, resolv_conf) {
                let serve = network::dhcp6::serve(cfg).map_err(failed("DHCPv6"))?;
                tasks.0.push(tokio::spawn(serve).abort_handle());
            }
            if let Some(cfg) = network::ra::config(cached) {
                let serve = network::ra::serve(cfg).map_err(failed("router advertisements"))?;
                tasks.0.push(tokio::spawn(serve).abort_handle());
            }
        }
        Ok(tasks)
    }
}

impl Drop for Dhcp {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}
