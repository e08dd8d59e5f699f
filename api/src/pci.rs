//! Where the devices with a `pciAddress` go, and the PCI controllers that give them their bus.
//!
//! KubeVirt hands a disk's or interface's `pciAddress` to libvirt unchanged, and the bus in a
//! libvirt PCI address is the *index* of a PCI controller, not a number the guest sees. libvirt
//! (`qemuDomainAssignPCIAddresses`) first makes a dry run over the devices whose address the
//! config gives, growing the set of buses to the highest index named
//! (`virDomainPCIAddressSetGrow`): every missing index becomes a `pcie-root-port` for a PCI
//! Express device (on q35; one slot, 0) or a `pci-bridge` for a conventional PCI device
//! (slots 1-31); a conventional device on a q35 machine with no bus that takes a `pci-bridge`
//! yet first gets a `pcie-root-port` holding a `pcie-to-pci-bridge`, and when that pair is all
//! the growth needed the device moves one bus down, onto the bridge. Then the controllers, in
//! index order, take the first free slot of the first bus that accepts them (root ports share
//! the slots of the root bus eight functions to a slot). Firmware numbers the buses depth-first
//! in slot order, so a guest sees bus `N` where libvirt's index is `N` unless a
//! `pcie-to-pci-bridge` sits in an earlier root port ([`Placement::guest_bus`]).
//!
//! [`place`] is that computation; admission refuses what it refuses, with the field path, and
//! the launcher turns its result into QEMU's `-device` arguments.

use std::collections::BTreeMap;

use crate::vmi::{DiskBus, InterfaceModel, PciAddress, VirtualMachineInstanceSpec};

/// The machine's host bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootBus {
    /// q35's `pcie-root` (QEMU's `pcie.0`).
    Pcie,
    /// i440fx's `pci-root` (QEMU's `pci.0`).
    Pci,
}

/// A PCI controller libvirt adds, by libvirt's model name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    PcieRootPort,
    PcieToPciBridge,
    PciBridge,
}

impl Model {
    /// libvirt's name, which is also QEMU's device name except for `pcie-to-pci-bridge`.
    pub fn libvirt_name(self) -> &'static str {
        match self {
            Model::PcieRootPort => "pcie-root-port",
            Model::PcieToPciBridge => "pcie-to-pci-bridge",
            Model::PciBridge => "pci-bridge",
        }
    }
}

/// A controller with libvirt's index and the address it takes on its parent bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Controller {
    pub index: u8,
    pub model: Model,
    /// The index of the bus it is plugged into.
    pub bus: u8,
    pub slot: u8,
    pub function: u8,
    /// Function 0 of a slot whose other functions are used too.
    pub multifunction: bool,
}

/// A disk or interface of the VMI spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Disk(usize),
    Interface(usize),
}

/// A device whose address the spec gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pinned {
    pub device: Device,
    /// The `pciAddress` field's path.
    pub field: String,
    pub address: PciAddress,
    /// A PCI Express device (libvirt's connect flags): virtio non-transitional, e1000e, igb.
    pub express: bool,
}

/// A pinned device's final address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub device: Device,
    /// The requested address, one bus further for a conventional device behind a
    /// `pcie-to-pci-bridge` libvirt added for it.
    pub address: PciAddress,
    pub multifunction: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// Indexes 1.. in order; a parent always comes before its children.
    pub controllers: Vec<Controller>,
    pub devices: Vec<Placed>,
}

impl Placement {
    /// The bus number firmware gives the bus of controller `index` (0 for the root bus):
    /// depth-first over the bridges in slot order, as SeaBIOS and OVMF number them, counting
    /// only these controllers (others, such as empty hotplug ports, must come after them).
    pub fn guest_bus(&self, index: u8) -> Option<u8> {
        let mut next = 0u8;
        let mut numbers = BTreeMap::from([(0u8, 0u8)]);
        self.number(0, &mut next, &mut numbers);
        numbers.get(&index).copied()
    }

    fn number(&self, bus: u8, next: &mut u8, numbers: &mut BTreeMap<u8, u8>) {
        let mut children: Vec<&Controller> =
            self.controllers.iter().filter(|c| c.bus == bus).collect();
        children.sort_by_key(|c| (c.slot, c.function));
        for c in children {
            *next = next.saturating_add(1);
            numbers.insert(c.index, *next);
            self.number(c.index, next, numbers);
        }
    }
}

/// A pinned device that cannot be placed: its field and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub field: String,
    pub reason: String,
}

// What a bus accepts downstream (libvirt's VIR_PCI_CONNECT_TYPE_*).
const PCI_DEVICE: u8 = 1;
const PCIE_DEVICE: u8 = 1 << 1;
const PCIE_ROOT_PORT: u8 = 1 << 2;
const PCIE_TO_PCI_BRIDGE: u8 = 1 << 3;
const PCI_BRIDGE: u8 = 1 << 4;
const ENDPOINT: u8 = PCI_DEVICE | PCIE_DEVICE;

#[derive(Clone, Debug)]
struct Bus {
    /// `None` for the root bus.
    model: Option<Model>,
    accepts: u8,
    min_slot: u8,
    max_slot: u8,
    /// Used functions per slot, and the field (or the chipset) using each.
    used: BTreeMap<(u8, u8), String>,
    /// Slots whose functions root ports share.
    aggregate: Vec<u8>,
    /// The field whose address made libvirt add it.
    added_for: String,
}

impl Bus {
    fn root(root: RootBus) -> Self {
        let accepts = match root {
            RootBus::Pcie => PCIE_DEVICE | PCIE_ROOT_PORT,
            RootBus::Pci => PCI_DEVICE | PCI_BRIDGE,
        };
        let mut bus = Self::of(None, accepts, 1, 31);
        // The chipset's own functions, which libvirt reserves too.
        let (slot, functions, what) = match root {
            RootBus::Pcie => (
                0x1f,
                &[0u8, 2, 3][..],
                "q35's LPC, SATA and SMBus controllers",
            ),
            RootBus::Pci => (
                1,
                &[0u8, 1, 2, 3][..],
                "i440fx's PIIX3 (ISA, IDE, USB, ACPI)",
            ),
        };
        for f in functions {
            bus.used.insert((slot, *f), what.to_owned());
        }
        bus
    }

    fn of(model: Option<Model>, accepts: u8, min_slot: u8, max_slot: u8) -> Self {
        Self {
            model,
            accepts,
            min_slot,
            max_slot,
            used: BTreeMap::new(),
            aggregate: Vec::new(),
            added_for: String::new(),
        }
    }

    fn controller(model: Model) -> Self {
        match model {
            Model::PcieRootPort => Self::of(Some(model), PCIE_DEVICE | PCIE_TO_PCI_BRIDGE, 0, 0),
            Model::PcieToPciBridge | Model::PciBridge => {
                // Slot 0 of a bridge with a hotplug controller (SHPC) is not usable.
                Self::of(Some(model), PCI_DEVICE | PCI_BRIDGE, 1, 31)
            }
        }
    }

    fn slot_used(&self, slot: u8) -> bool {
        self.used.range((slot, 0)..=(slot, 7)).next().is_some()
    }
}

/// The connect flag of a controller on its parent bus.
fn connects_as(model: Model) -> u8 {
    match model {
        Model::PcieRootPort => PCIE_ROOT_PORT,
        Model::PcieToPciBridge => PCIE_TO_PCI_BRIDGE,
        Model::PciBridge => PCI_BRIDGE,
    }
}

/// The controllers libvirt adds for `pinned` (in libvirt's device order: disks, then
/// interfaces) and where everything goes, or the first device libvirt would refuse.
pub fn place(root: RootBus, pinned: &[Pinned]) -> Result<Placement, Refusal> {
    let mut buses = vec![Bus::root(root)];
    let mut devices = Vec::with_capacity(pinned.len());
    // The dry run: grow, check, reserve.
    for p in pinned {
        let refuse = |reason: String| Refusal {
            field: p.field.clone(),
            reason,
        };
        let (asked, a) = (p.address, p.address);
        if a.domain != 0 {
            return Err(refuse(format!("{asked}: only PCI domain 0000 exists")));
        }
        let express = p.express && root == RootBus::Pcie;
        let bus = grow(&mut buses, root, a.bus, express, &p.field)
            .ok_or_else(|| refuse(format!("{asked}: no PCI bus number is left for it")))?;
        let a = PciAddress { bus, ..a };
        let b = &mut buses[usize::from(bus)];
        if b.accepts & ENDPOINT == 0 {
            return Err(refuse(format!(
                "{asked}: bus {bus:02x} is the pcie-root-port libvirt adds to hold a \
                 pcie-to-pci-bridge for a conventional PCI device, and it takes no other device"
            )));
        }
        if a.slot < b.min_slot || a.slot > b.max_slot {
            let model = b.model.map_or("the root bus", Model::libvirt_name);
            let (min, max) = (b.min_slot, b.max_slot);
            return Err(refuse(format!(
                "{asked}: on bus {bus:02x} ({model}) the slot must be {min:02x}-{max:02x}"
            )));
        }
        if let Some(first) = b.used.get(&(a.slot, a.function)) {
            return Err(refuse(format!(
                "PCI address {a} is already used by {first}"
            )));
        }
        b.used.insert((a.slot, a.function), p.field.clone());
        devices.push(Placed {
            device: p.device,
            address: a,
            multifunction: false,
        });
    }
    // The real pass: the dry run's one-purpose root port is a plain one again, and each
    // controller, in index order, takes the first free place that accepts it.
    let mut controllers = Vec::new();
    for index in 1..buses.len() {
        let model = buses[index].model.expect("only bus 0 is the root bus");
        if model == Model::PcieRootPort {
            buses[index].accepts = PCIE_DEVICE | PCIE_TO_PCI_BRIDGE;
        }
        let flag = connects_as(model);
        let (bus, slot, function) = (0..buses.len())
            .filter(|&b| b != index && buses[b].accepts & flag != 0)
            .find_map(|b| free_place(&buses[b], model).map(|(s, f)| (b, s, f)))
            .ok_or_else(|| Refusal {
                field: buses[index].added_for.clone(),
                reason: format!(
                    "bus {index:02x} needs a {}, and no free slot is left for one",
                    model.libvirt_name()
                ),
            })?;
        let index_u8 = u8::try_from(index).expect("bus numbers fit a byte");
        buses[bus]
            .used
            .insert((slot, function), format!("PCI controller {index}"));
        if model == Model::PcieRootPort && function == 0 {
            buses[bus].aggregate.push(slot);
        }
        controllers.push(Controller {
            index: index_u8,
            model,
            bus: u8::try_from(bus).expect("bus numbers fit a byte"),
            slot,
            function,
            multifunction: false,
        });
    }
    // libvirt turns on multifunction for function 0 of every slot with others in use.
    let shared = |bus: u8, slot: u8, function: u8| {
        function == 0
            && buses[usize::from(bus)]
                .used
                .range((slot, 1)..=(slot, 7))
                .next()
                .is_some()
    };
    for c in &mut controllers {
        c.multifunction = shared(c.bus, c.slot, c.function);
    }
    for d in &mut devices {
        d.multifunction = shared(d.address.bus, d.address.slot, d.address.function);
    }
    // A guest finds a slot's functions through its function 0, and QEMU puts a device of its
    // own choosing at an empty function 0 of the root bus without `multifunction`, which then
    // fails to start. libvirt admits such an address and the guest never sees the device.
    for (d, p) in devices.iter().zip(pinned) {
        let a = d.address;
        if a.function != 0 && !buses[usize::from(a.bus)].used.contains_key(&(a.slot, 0)) {
            return Err(Refusal {
                field: p.field.clone(),
                reason: format!(
                    "{}: nothing is at function 0 of its slot, and a guest finds the other \
                     functions of a slot through function 0",
                    p.address
                ),
            });
        }
    }
    Ok(Placement {
        controllers,
        devices,
    })
}

/// `virDomainPCIAddressSetGrow`: adds the buses up to `bus` for a device of this kind and
/// returns the bus it goes on; `None` past bus ff.
fn grow(buses: &mut Vec<Bus>, root: RootBus, bus: u8, express: bool, field: &str) -> Option<u8> {
    let have = buses.len();
    if usize::from(bus) < have {
        return Some(bus);
    }
    let mut add = usize::from(bus) + 1 - have;
    let mut bus = bus;
    let mut new = Vec::new();
    if express {
        new.resize(add, Model::PcieRootPort);
    } else {
        let need_pci_topology =
            root == RootBus::Pcie && !buses.iter().any(|b| b.accepts & PCI_BRIDGE != 0);
        if need_pci_topology {
            if add == 1 {
                add = 2;
                bus = bus.checked_add(1)?;
            }
            new.extend([Model::PcieRootPort, Model::PcieToPciBridge]);
        }
        new.resize(add, Model::PciBridge);
    }
    let special = new.first() == Some(&Model::PcieRootPort) && !express;
    for (i, model) in new.into_iter().enumerate() {
        let mut b = Bus::controller(model);
        if special && i == 0 {
            // Only the pcie-to-pci-bridge may take it during the dry run.
            b.accepts = PCIE_TO_PCI_BRIDGE;
        }
        field.clone_into(&mut b.added_for);
        buses.push(b);
    }
    Some(bus)
}

/// The first free slot and function of `bus` for a controller: an empty slot, or for a root
/// port a free function of a slot other root ports share.
fn free_place(bus: &Bus, model: Model) -> Option<(u8, u8)> {
    (bus.min_slot..=bus.max_slot).find_map(|slot| {
        if !bus.slot_used(slot) {
            Some((slot, 0))
        } else if model == Model::PcieRootPort && bus.aggregate.contains(&slot) {
            (1..8)
                .find(|f| !bus.used.contains_key(&(slot, *f)))
                .map(|f| (slot, f))
        } else {
            None
        }
    })
}

/// The disks (virtio only: other buses have no PCI address, refused elsewhere) and interfaces
/// of `spec` with a parseable `pciAddress`, in libvirt's order, fields under `base`.
pub fn pinned(spec: &VirtualMachineInstanceSpec, base: &str) -> Vec<Pinned> {
    let devices = &spec.domain.devices;
    // libvirt's connect flags on q35: non-transitional virtio, e1000e and igb are PCI Express
    // devices, the rest conventional PCI.
    let transitional = devices.use_virtio_transitional == Some(true);
    let disks = devices.disks.iter().enumerate().filter_map(|(i, d)| {
        let t = d.disk.as_ref()?;
        if t.bus.as_ref().is_some_and(|b| *b != DiskBus::Virtio) {
            return None;
        }
        Some(Pinned {
            device: Device::Disk(i),
            field: format!("{base}.domain.devices.disks[{i}].disk.pciAddress"),
            address: PciAddress::parse(t.pci_address.as_deref()?)?,
            express: !transitional,
        })
    });
    let interfaces = devices.interfaces.iter().enumerate().filter_map(|(i, n)| {
        let express = match n.model_or_default() {
            InterfaceModel::Virtio => !transitional,
            InterfaceModel::E1000e | InterfaceModel::Igb => true,
            _ => false,
        };
        Some(Pinned {
            device: Device::Interface(i),
            field: format!("{base}.domain.devices.interfaces[{i}].pciAddress"),
            address: PciAddress::parse(n.pci_address.as_deref()?)?,
            express,
        })
    });
    disks.chain(interfaces).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pin(field: &str, address: &str, express: bool) -> Pinned {
        Pinned {
            device: Device::Disk(0),
            field: field.to_owned(),
            address: PciAddress::parse(address).unwrap(),
            express,
        }
    }

    fn q35(pins: &[(&str, &str, bool)]) -> Result<Placement, Refusal> {
        let pins: Vec<Pinned> = pins.iter().map(|(f, a, e)| pin(f, a, *e)).collect();
        place(RootBus::Pcie, &pins)
    }

    fn models(p: &Placement) -> Vec<(u8, &'static str, u8, u8, u8)> {
        p.controllers
            .iter()
            .map(|c| (c.index, c.model.libvirt_name(), c.bus, c.slot, c.function))
            .collect()
    }

    #[test]
    fn an_express_device_off_the_root_bus_gets_a_root_port_per_missing_bus() {
        let p = q35(&[("a", "0000:03:00.0", true)]).unwrap();
        // Root ports share slot 1 as functions 0-2 (multifunction on function 0).
        assert_eq!(
            models(&p),
            [
                (1, "pcie-root-port", 0, 1, 0),
                (2, "pcie-root-port", 0, 1, 1),
                (3, "pcie-root-port", 0, 1, 2),
            ]
        );
        assert!(p.controllers[0].multifunction);
        assert_eq!(
            p.devices[0].address,
            PciAddress::parse("0000:03:00.0").unwrap()
        );
        assert_eq!(p.guest_bus(3), Some(3));
    }

    #[test]
    fn root_ports_fill_eight_functions_a_slot_around_pinned_root_bus_devices() {
        let p = q35(&[("a", "0000:00:01.0", true), ("b", "0000:09:00.0", true)]).unwrap();
        let places: Vec<_> = p.controllers.iter().map(|c| (c.slot, c.function)).collect();
        assert_eq!(
            places[..8],
            [
                (2, 0),
                (2, 1),
                (2, 2),
                (2, 3),
                (2, 4),
                (2, 5),
                (2, 6),
                (2, 7)
            ]
        );
        assert_eq!(places[8], (3, 0));
        assert!(!p.controllers[8].multifunction, "alone in its slot");
        assert_eq!(p.guest_bus(9), Some(9));
    }

    #[test]
    fn a_root_port_has_slot_0_only_and_its_functions_are_multifunction() {
        let err = q35(&[("a", "0000:02:01.0", true)]).unwrap_err();
        assert_eq!(err.field, "a");
        assert!(err.reason.contains("slot must be 00-00"), "{}", err.reason);
        let p = q35(&[("a", "0000:01:00.0", true), ("b", "0000:01:00.1", false)]).unwrap();
        assert!(p.devices[0].multifunction);
        assert!(!p.devices[1].multifunction);
    }

    #[test]
    fn a_function_other_than_0_needs_function_0_of_its_slot_in_use() {
        let err = q35(&[("a", "0000:00:0a.3", true)]).unwrap_err();
        assert_eq!(err.field, "a");
        assert!(
            err.reason.contains("nothing is at function 0"),
            "{}",
            err.reason
        );
        assert!(q35(&[("a", "0000:00:0a.3", true), ("b", "0000:00:0a.0", true)]).is_ok());
        // The chipset's function 0 counts.
        assert!(q35(&[("a", "0000:00:1f.4", true)]).is_ok());
    }

    #[test]
    fn a_conventional_device_on_q35_gets_a_pcie_to_pci_bridge_and_moves_down_a_bus() {
        // The first growth by one bus turns into a root port and a bridge; the device follows.
        let p = q35(&[("a", "0000:01:05.0", false)]).unwrap();
        assert_eq!(
            models(&p),
            [
                (1, "pcie-root-port", 0, 1, 0),
                (2, "pcie-to-pci-bridge", 1, 0, 0)
            ]
        );
        assert_eq!(
            p.devices[0].address,
            PciAddress::parse("0000:02:05.0").unwrap()
        );
        assert_eq!(p.guest_bus(2), Some(2));
        // Further: root port, bridge, then pci-bridges on the bridge.
        let p = q35(&[("a", "0000:04:05.0", false)]).unwrap();
        assert_eq!(
            models(&p),
            [
                (1, "pcie-root-port", 0, 1, 0),
                (2, "pcie-to-pci-bridge", 1, 0, 0),
                (3, "pci-bridge", 2, 1, 0),
                (4, "pci-bridge", 2, 2, 0),
            ]
        );
        assert_eq!(p.devices[0].address.bus, 4);
        assert_eq!(p.guest_bus(4), Some(4));
        // A bridge's slot 0 is its hotplug controller's.
        let err = q35(&[("a", "0000:04:00.0", false)]).unwrap_err();
        assert!(err.reason.contains("slot must be 01-1f"), "{}", err.reason);
    }

    #[test]
    fn the_bridge_takes_the_first_free_root_port_so_the_guest_numbers_differ() {
        // The disk's bus 2 leaves root port 1 empty; the NIC's pcie-to-pci-bridge (index 4)
        // takes it, and firmware numbers the bridge 2 and the disk's root port 3, as with libvirt.
        let p = q35(&[
            ("disk", "0000:02:00.0", true),
            ("nic", "0000:04:03.0", false),
        ])
        .unwrap();
        assert_eq!(models(&p)[3], (4, "pcie-to-pci-bridge", 1, 0, 0));
        assert_eq!(p.guest_bus(2), Some(3));
        assert_eq!(p.guest_bus(4), Some(2));
    }

    #[test]
    fn what_libvirt_refuses() {
        let refused = |pins: &[(&str, &str, bool)]| q35(pins).unwrap_err().reason;
        assert!(refused(&[("a", "0001:01:00.0", true)]).contains("domain"));
        assert!(refused(&[("a", "0000:00:00.0", true)]).contains("slot must be 01-1f"));
        assert!(refused(&[("a", "0000:00:1f.2", true)]).contains("SATA"));
        // Bus ff is the last; moving a device past it is impossible.
        assert!(
            refused(&[("a", "0000:fe:00.0", true), ("b", "0000:ff:01.0", false)])
                .contains("no PCI bus number")
        );
        // 30 slots of 8 root ports each on q35's root bus.
        let full = q35(&[("a", "0000:f1:00.0", true)]).unwrap_err();
        assert_eq!(full.field, "a");
        assert!(full.reason.contains("no free slot"), "{}", full.reason);
        assert!(q35(&[("a", "0000:f0:00.0", true)]).is_ok());
        // Bus 1 holds only the bridge a conventional device made libvirt add.
        assert!(
            refused(&[("a", "0000:01:01.0", false), ("b", "0000:01:00.0", true)])
                .contains("takes no other device")
        );
        let twice = q35(&[("a", "0000:01:01.0", false), ("b", "0000:02:01.0", true)]).unwrap_err();
        assert_eq!(twice.field, "b");
        assert!(
            twice.reason.contains("already used by a"),
            "{}",
            twice.reason
        );
    }

    #[test]
    fn on_i440fx_every_bus_is_a_pci_bridge_on_the_root_bus() {
        let p = place(RootBus::Pci, &[pin("a", "0000:02:03.0", true)]).unwrap();
        assert_eq!(
            models(&p),
            [(1, "pci-bridge", 0, 2, 0), (2, "pci-bridge", 0, 3, 0)]
        );
        assert_eq!(p.devices[0].address.bus, 2);
        assert_eq!(p.guest_bus(2), Some(2));
    }
}
