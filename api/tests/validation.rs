//! Validation reports every mistake with its field path; unsupported KubeVirt features are
//! refused by name.

mod common;

use api::validation::{self, FieldError, UNSUPPORTED};
use api::{ClusterConfig, VirtualMachineInstance};
use common::valid;
use serde_json::{Value, json};

fn set(v: &mut Value, pointer: &str, value: Value) {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let parent = v
        .pointer_mut(parent)
        .unwrap_or_else(|| panic!("no {parent}"));
    match parent {
        Value::Object(o) => {
            if value.is_null() {
                o.remove(key);
            } else {
                o.insert(key.to_owned(), value);
            }
        }
        Value::Array(a) => {
            let i: usize = key.parse().unwrap();
            if i == a.len() {
                a.push(value);
            } else {
                a[i] = value;
            }
        }
        _ => panic!("{pointer}: parent is a scalar"),
    }
}

fn errors(v: Value, cfg: &ClusterConfig) -> Vec<FieldError> {
    let vmi: VirtualMachineInstance = serde_json::from_value(v).unwrap();
    validation::validate_vmi(&vmi, cfg)
}

struct Mistake {
    name: &'static str,
    edits: Vec<(&'static str, Value)>,
    path: &'static str,
    message: &'static str,
}

fn m(
    name: &'static str,
    edits: Vec<(&'static str, Value)>,
    path: &'static str,
    message: &'static str,
) -> Mistake {
    Mistake {
        name,
        edits,
        path,
        message,
    }
}

fn mistakes() -> Vec<Mistake> {
    let cfg_volume = json!({"name": "cfg", "configMap": {"name": "app"}});
    let claim = json!({"name": "data", "persistentVolumeClaim": {"claimName": "data"}});
    vec![
        m(
            "filesystem without a volume",
            vec![(
                "/spec/domain/devices/filesystems",
                json!([{"name": "nothing", "virtiofs": {}}]),
            )],
            "spec.domain.devices.filesystems[0].name",
            r#"no volume named "nothing""#,
        ),
        m(
            "filesystem twice",
            vec![
                ("/spec/volumes/2", cfg_volume.clone()),
                (
                    "/spec/domain/devices/filesystems",
                    json!([{"name": "cfg", "virtiofs": {}}, {"name": "cfg", "virtiofs": {}}]),
                ),
            ],
            "spec.domain.devices.filesystems[1].name",
            r#"duplicate filesystem name "cfg""#,
        ),
        m(
            "volume as disk and filesystem",
            vec![(
                "/spec/domain/devices/filesystems",
                json!([{"name": "seed", "virtiofs": {}}]),
            )],
            "spec.domain.devices.filesystems[0].name",
            r#"volume "seed" is used by a disk as well"#,
        ),
        m(
            "container disk as filesystem",
            vec![
                (
                    "/spec/volumes/2",
                    json!({"name": "img", "containerDisk": {"image": "x"}}),
                ),
                (
                    "/spec/domain/devices/filesystems",
                    json!([{"name": "img", "virtiofs": {}}]),
                ),
            ],
            "spec.domain.devices.filesystems[0].name",
            "a containerDisk volume cannot be a filesystem",
        ),
        m(
            "claim as filesystem without the gate",
            vec![
                ("/spec/volumes/2", claim.clone()),
                (
                    "/spec/domain/devices/filesystems",
                    json!([{"name": "data", "virtiofs": {}}]),
                ),
            ],
            "spec.domain.devices.filesystems",
            "virtiofs is not allowed: virtiofs feature gate is not enabled for PVC",
        ),
        m(
            "filesystem tag too long",
            vec![
                (
                    "/spec/volumes/2",
                    json!({"name": "a".repeat(37), "configMap": {"name": "app"}}),
                ),
                (
                    "/spec/domain/devices/filesystems",
                    json!([{"name": "a".repeat(37), "virtiofs": {}}]),
                ),
            ],
            "spec.domain.devices.filesystems[0].name",
            "is longer than the 36 bytes of a virtiofs tag",
        ),
        m(
            "unknown video type",
            vec![("/spec/domain/devices/video", json!({"type": "qxl"}))],
            "spec.domain.devices.video.type",
            r#"unknown video type "qxl" (vga, cirrus, vmvga, virtio, bochs, ramfb)"#,
        ),
        m(
            "keyboard input",
            vec![(
                "/spec/domain/devices/inputs",
                json!([{"name": "k", "type": "keyboard", "bus": "usb"}]),
            )],
            "spec.domain.devices.inputs[0].type",
            "input device can have only tablet type",
        ),
        m(
            "diag288 watchdog",
            vec![(
                "/spec/domain/devices/watchdog",
                json!({"name": "w", "diag288": {}}),
            )],
            "spec.domain.devices.watchdog.diag288",
            "not supported",
        ),
        // Found by fuzzing (fuzz/, qemu_argv): the launcher put a NUL in QEMU's argv.
        m(
            "watchdog name with a NUL",
            vec![(
                "/spec/domain/devices/watchdog",
                json!({"name": "w\u{0}", "i6300esb": {}}),
            )],
            "spec.domain.devices.watchdog.name",
            "may only contain alphabetical characters, numbers, dashes (-) or underscores (_)",
        ),
        m(
            "input name with a comma",
            vec![(
                "/spec/domain/devices/inputs",
                json!([{"name": "t,help", "type": "tablet", "bus": "usb"}]),
            )],
            "spec.domain.devices.inputs[0].name",
            r#""t,help": may only contain"#,
        ),
        m(
            "CPU feature name that is no QEMU property",
            vec![(
                "/spec/domain/cpu",
                json!({"features": [{"name": "pcid"}, {"name": "avx,kvm=off"}]}),
            )],
            "spec.domain.cpu.features[1].name",
            r#""avx,kvm=off" is not a CPU feature name"#,
        ),
        m(
            "CPU feature with an unknown policy",
            vec![(
                "/spec/domain/cpu",
                json!({"features": [{"name": "pcid", "policy": "demand"}]}),
            )],
            "spec.domain.cpu.features[0].policy",
            "CPU feature pcid uses policy demand that is not supported",
        ),
        m(
            "CPU model with a comma",
            vec![("/spec/domain/cpu", json!({"model": "Skylake,kvm=off"}))],
            "spec.domain.cpu.model",
            r#""Skylake,kvm=off" is not a CPU model name"#,
        ),
        m(
            "CPU model that asks QEMU for help",
            vec![("/spec/domain/cpu", json!({"model": "help"}))],
            "spec.domain.cpu.model",
            "asks QEMU for its list of CPU models",
        ),
        m(
            "disk name not a DNS label",
            vec![("/spec/domain/devices/disks/1/name", json!("Seed.1"))],
            "spec.domain.devices.disks[1].name",
            r#""Seed.1" is not a DNS label"#,
        ),
        m(
            "disk without a volume",
            vec![("/spec/domain/devices/disks/1/name", json!("x"))],
            "spec.domain.devices.disks[1].name",
            r#"no volume named "x""#,
        ),
        m(
            "duplicate disk name",
            vec![("/spec/domain/devices/disks/1/name", json!("root"))],
            "spec.domain.devices.disks[1].name",
            r#"duplicate disk name "root""#,
        ),
        m(
            "duplicate volume name",
            vec![("/spec/volumes/1/name", json!("root"))],
            "spec.volumes[1].name",
            r#"duplicate volume name "root""#,
        ),
        m(
            "volume name not a DNS label",
            vec![(
                "/spec/volumes/2",
                json!({"name": "Bad_Name", "emptyDisk": {"capacity": "1Gi"}}),
            )],
            "spec.volumes[2].name",
            "is not a DNS label",
        ),
        m(
            "volume with two sources",
            vec![("/spec/volumes/0/emptyDisk", json!({"capacity": "1Gi"}))],
            "spec.volumes[0]",
            "must have exactly one source set, has containerDisk, emptyDisk",
        ),
        m(
            "volume with no source",
            vec![("/spec/volumes/0/containerDisk", Value::Null)],
            "spec.volumes[0]",
            "must have exactly one source set",
        ),
        m(
            "disk with two targets",
            vec![("/spec/domain/devices/disks/0/cdrom", json!({}))],
            "spec.domain.devices.disks[0]",
            "must have only one of disk, cdrom, lun (has disk, cdrom)",
        ),
        m(
            "memory request does not parse",
            vec![("/spec/domain/resources/requests/memory", json!("12XB"))],
            "spec.domain.resources.requests.memory",
            r#""12XB" has an unknown suffix "XB""#,
        ),
        m(
            "guest memory does not parse",
            vec![("/spec/domain/memory/guest", json!("lots"))],
            "spec.domain.memory.guest",
            "is not a quantity",
        ),
        m(
            "empty disk capacity does not parse",
            vec![(
                "/spec/volumes/2",
                json!({"name": "scratch", "emptyDisk": {"capacity": "1.2.3Gi"}}),
            )],
            "spec.volumes[2].emptyDisk.capacity",
            "is not a quantity",
        ),
        m(
            "no memory at all",
            vec![
                ("/spec/domain/resources", json!({})),
                ("/spec/domain/memory", Value::Null),
            ],
            "spec.domain.resources.requests.memory",
            "no memory requested",
        ),
        m(
            "memory request above the limit",
            vec![("/spec/domain/resources/requests/memory", json!("1Gi"))],
            "spec.domain.resources.requests.memory",
            "must not be greater than limits.memory",
        ),
        m(
            "guest memory above the limit",
            vec![("/spec/domain/memory/guest", json!("1Gi"))],
            "spec.domain.memory.guest",
            "must not be greater than the memory limit",
        ),
        m(
            "usb disk bus",
            vec![("/spec/domain/devices/disks/1/disk/bus", json!("usb"))],
            "spec.domain.devices.disks[1].disk.bus",
            "usb: not supported by kubevirt-rs yet",
        ),
        m(
            "unknown disk bus",
            vec![("/spec/domain/devices/disks/1/disk/bus", json!("ide"))],
            "spec.domain.devices.disks[1].disk.bus",
            r#"unknown bus "ide" (virtio, sata or scsi)"#,
        ),
        m(
            "too many vCPUs",
            vec![("/spec/domain/cpu/cores", json!(600))],
            "spec.domain.cpu.cores",
            "must not exceed 512",
        ),
        m(
            "more sockets than maxSockets",
            vec![("/spec/domain/cpu/sockets", json!(8))],
            "spec.domain.cpu.sockets",
            "must not be greater than maxSockets",
        ),
        m(
            "isolateEmulatorThread without dedicated CPUs",
            vec![("/spec/domain/cpu/isolateEmulatorThread", json!(true))],
            "spec.domain.cpu.isolateEmulatorThread",
            "IsolateEmulatorThread should be only set in combination with DedicatedCPUPlacement",
        ),
        m(
            "malformed MAC address",
            vec![(
                "/spec/domain/devices/interfaces/0/macAddress",
                json!("02:00:00:0g:00:01"),
            )],
            "spec.domain.devices.interfaces[0].macAddress",
            "is not a MAC address",
        ),
        m(
            "MAC reserved for the pod bridge",
            vec![(
                "/spec/domain/devices/interfaces/0/macAddress",
                json!("02:00:00:00:00:00"),
            )],
            "spec.domain.devices.interfaces[0].macAddress",
            "reserved for the in-pod bridge",
        ),
        m(
            "port out of range",
            vec![(
                "/spec/domain/devices/interfaces/0/ports/0/port",
                json!(70000),
            )],
            "spec.domain.devices.interfaces[0].ports[0].port",
            "must be in range 0 < x < 65536",
        ),
        m(
            "port protocol",
            vec![(
                "/spec/domain/devices/interfaces/0/ports/0/protocol",
                json!("SCTP"),
            )],
            "spec.domain.devices.interfaces[0].ports[0].protocol",
            "only TCP or UDP",
        ),
        m(
            "interface without a network",
            vec![("/spec/domain/devices/interfaces/0/name", json!("other"))],
            "spec.domain.devices.interfaces[0].name",
            r#"no network named "other""#,
        ),
        m(
            "network without an interface",
            vec![("/spec/networks/0/name", json!("other"))],
            "spec.networks[0].name",
            r#"no interface named "other""#,
        ),
        m(
            "two interfaces on one network",
            vec![(
                "/spec/domain/devices/interfaces/1",
                json!({"name": "default", "masquerade": {}}),
            )],
            "spec.domain.devices.interfaces[1].name",
            "only one interface can be connected to one specific network",
        ),
        m(
            "duplicate network",
            vec![("/spec/networks/1", json!({"name": "default", "pod": {}}))],
            "spec.networks[1].name",
            "already exists",
        ),
        m(
            "interface with two bindings",
            vec![("/spec/domain/devices/interfaces/0/bridge", json!({}))],
            "spec.domain.devices.interfaces[0]",
            "must have exactly one binding method",
        ),
        m(
            "unknown NIC model",
            vec![("/spec/domain/devices/interfaces/0/model", json!("vmxnet3"))],
            "spec.domain.devices.interfaces[0].model",
            r#"model "vmxnet3" is not supported"#,
        ),
        m(
            "discontinued slirp binding",
            vec![
                ("/spec/domain/devices/interfaces/0/masquerade", Value::Null),
                ("/spec/domain/devices/interfaces/0/slirp", json!({})),
            ],
            "spec.domain.devices.interfaces[0].slirp",
            "discontinued",
        ),
        m(
            "bad pod network CIDR",
            vec![("/spec/networks/0/pod/vmNetworkCIDR", json!("10.0.2.0/33"))],
            "spec.networks[0].pod.vmNetworkCIDR",
            "is not a CIDR",
        ),
        m(
            "pod network CIDR of the wrong family",
            vec![(
                "/spec/networks/0/pod/vmNetworkCIDR",
                json!("fd10:0:2::/120"),
            )],
            "spec.networks[0].pod.vmNetworkCIDR",
            "is not an IPv4 CIDR",
        ),
        m(
            "pod network CIDR too small for gateway and guest",
            vec![("/spec/networks/0/pod/vmNetworkCIDR", json!("10.0.2.0/31"))],
            "spec.networks[0].pod.vmNetworkCIDR",
            "no room for the gateway and the guest",
        ),
        m(
            "pod IPv6 network CIDR of the wrong family",
            vec![(
                "/spec/networks/0/pod/vmIPv6NetworkCIDR",
                json!("10.0.2.0/24"),
            )],
            "spec.networks[0].pod.vmIPv6NetworkCIDR",
            "is not an IPv6 CIDR",
        ),
        m(
            "kernelArgs without a kernel",
            vec![(
                "/spec/domain/firmware/kernelBoot",
                json!({"kernelArgs": "console=ttyS0"}),
            )],
            "spec.domain.firmware.kernelBoot.kernelArgs",
            "cannot be provided without an external kernel",
        ),
        m(
            "kernel boot container without kernelPath and initrdPath",
            vec![(
                "/spec/domain/firmware/kernelBoot",
                json!({"container": {"image": "k:1"}}),
            )],
            "spec.domain.firmware.kernelBoot.container",
            "at least one of kernelPath, initrdPath",
        ),
        m(
            "relative kernelPath",
            vec![(
                "/spec/domain/firmware/kernelBoot",
                json!({"container": {"image": "k:1", "kernelPath": "boot/vmlinuz"}}),
            )],
            "spec.domain.firmware.kernelBoot.container.kernelPath",
            "must be an absolute path",
        ),
        m(
            "secure boot without SMM",
            vec![("/spec/domain/firmware/bootloader", json!({"efi": {}}))],
            "spec.domain.firmware.bootloader.efi.secureBoot",
            "requires SMM",
        ),
        m(
            "BIOS and EFI together",
            vec![(
                "/spec/domain/firmware/bootloader",
                json!({"bios": {}, "efi": {"secureBoot": false}}),
            )],
            "spec.domain.firmware.bootloader",
            "mutually exclusive",
        ),
        m(
            "a serial BIOS console without a serial port",
            vec![
                (
                    "/spec/domain/firmware/bootloader",
                    json!({"bios": {"useSerial": true}}),
                ),
                ("/spec/domain/devices/autoattachSerialConsole", json!(false)),
            ],
            "spec.domain.firmware.bootloader.bios.useSerial",
            "needs a serial console, but spec.domain.devices.autoattachSerialConsole is false",
        ),
        m(
            "two ports with one name",
            vec![(
                "/spec/domain/devices/interfaces/0/ports",
                json!([{"name": "http", "port": 80}, {"name": "http", "port": 8080}]),
            )],
            "spec.domain.devices.interfaces[0].ports[1].name",
            "duplicate port name \"http\"",
        ),
        m(
            "boot order zero",
            vec![("/spec/domain/devices/disks/0/bootOrder", json!(0))],
            "spec.domain.devices.disks[0].bootOrder",
            "must be greater than 0",
        ),
        m(
            "boot order used twice",
            vec![("/spec/domain/devices/interfaces/0/bootOrder", json!(1))],
            "spec.domain.devices.interfaces[0].bootOrder",
            "boot order 1 is already used by spec.domain.devices.disks[0].bootOrder",
        ),
        m(
            "machine type not q35",
            vec![("/spec/domain/machine/type", json!("pc-i440fx-7.2"))],
            "spec.domain.machine.type",
            "pc-i440fx-7.2 is not supported",
        ),
        m(
            "two cloud-init user data sources",
            vec![(
                "/spec/volumes/1/cloudInitNoCloud/userDataBase64",
                json!("IyEvYmluL3NoCg=="),
            )],
            "spec.volumes[1].cloudInitNoCloud",
            "must have only one of userData, userDataBase64, secretRef",
        ),
        m(
            "cloud-init Secret reference without a name",
            vec![(
                "/spec/volumes/1/cloudInitNoCloud",
                json!({"secretRef": {"name": ""}}),
            )],
            "spec.volumes[1].cloudInitNoCloud.secretRef.name",
            "required",
        ),
        m(
            "configMap volume without a name",
            vec![("/spec/volumes/2", json!({"name": "cm", "configMap": {}}))],
            "spec.volumes[2].configMap.name",
            "required",
        ),
        m(
            "secret volume without a secret name",
            vec![("/spec/volumes/2", json!({"name": "s", "secret": {}}))],
            "spec.volumes[2].secret.secretName",
            "required",
        ),
        m(
            "two serviceAccount volumes",
            vec![
                (
                    "/spec/volumes/2",
                    json!({"name": "sa1", "serviceAccount": {"serviceAccountName": "a"}}),
                ),
                (
                    "/spec/volumes/3",
                    json!({"name": "sa2", "serviceAccount": {"serviceAccountName": "a"}}),
                ),
            ],
            "spec.volumes",
            "must have max one serviceAccount volume set",
        ),
        m(
            "serviceAccount volume of another account than serviceAccountName",
            vec![
                ("/spec/serviceAccountName", json!("a")),
                (
                    "/spec/volumes/2",
                    json!({"name": "sa", "serviceAccount": {"serviceAccountName": "b"}}),
                ),
            ],
            "spec.serviceAccountName",
            "must reference the same service account",
        ),
        m(
            "cloud-init base64 that is not",
            vec![(
                "/spec/volumes/1/cloudInitNoCloud",
                json!({"userDataBase64": "not base64!"}),
            )],
            "spec.volumes[1].cloudInitNoCloud.userDataBase64",
            "is not valid base64",
        ),
        m(
            "host disk without the feature gate",
            vec![(
                "/spec/volumes/2",
                json!({"name": "hd", "hostDisk": {"path": "/d.img", "type": "Disk"}}),
            )],
            "spec.volumes[2].hostDisk",
            "HostDisk feature gate is not enabled",
        ),
        m(
            "host disk capacity with type Disk",
            vec![(
                "/spec/volumes/2",
                json!({"name": "hd", "hostDisk": {"path": "/d.img", "type": "Disk", "capacity": "1Gi"}}),
            )],
            "spec.volumes[2].hostDisk.capacity",
            "allowed only with type DiskOrCreate",
        ),
        m(
            "relative host disk path",
            vec![(
                "/spec/volumes/2",
                json!({"name": "hd", "hostDisk": {"path": "disks/d.img", "type": "Disk"}}),
            )],
            "spec.volumes[2].hostDisk.path",
            r#""disks/d.img" must be an absolute path without '..'"#,
        ),
        m(
            "host disk path climbing out of its directory",
            vec![(
                "/spec/volumes/2",
                json!({"name": "hd", "hostDisk": {"path": "/var/disks/../../etc/shadow", "type": "Disk"}}),
            )],
            "spec.volumes[2].hostDisk.path",
            "must be an absolute path without '..'",
        ),
        m(
            "container disk path climbing out of the image",
            vec![(
                "/spec/volumes/0/containerDisk/path",
                json!("/disk/../../../etc/shadow"),
            )],
            "spec.volumes[0].containerDisk.path",
            "must be an absolute path without '..'",
        ),
        m(
            "kernel path climbing out of the image",
            vec![(
                "/spec/domain/firmware/kernelBoot",
                json!({"container": {"image": "k:1", "kernelPath": "/boot/../../vmlinuz"}}),
            )],
            "spec.domain.firmware.kernelBoot.container.kernelPath",
            "must be an absolute path without '..'",
        ),
        m(
            "kernel path with a NUL byte (found by fuzzing: it reached QEMU's argv)",
            vec![(
                "/spec/domain/firmware/kernelBoot",
                json!({"container": {"image": "k:1", "kernelPath": "/boot/\u{0}"}}),
            )],
            "spec.domain.firmware.kernelBoot.container.kernelPath",
            "holds a NUL byte",
        ),
        m(
            "unknown eviction strategy",
            vec![("/spec/evictionStrategy", json!("Sometimes"))],
            "spec.evictionStrategy",
            "unknown eviction strategy",
        ),
        m(
            "probe with two actions",
            vec![(
                "/spec/readinessProbe",
                json!({"guestAgentPing": {}, "tcpSocket": {"port": 22}}),
            )],
            "spec.readinessProbe",
            "must have exactly one of",
        ),
        m(
            "TCP probe without the pod network",
            vec![
                ("/spec/networks", json!([])),
                ("/spec/domain/devices/interfaces", json!([])),
                ("/spec/livenessProbe", json!({"tcpSocket": {"port": 22}})),
            ],
            "spec.livenessProbe.tcpSocket",
            "only allowed if the Pod Network is attached",
        ),
        m(
            "exec probe without a command",
            vec![("/spec/readinessProbe", json!({"exec": {"command": []}}))],
            "spec.readinessProbe.exec.command",
            "must not be empty",
        ),
        m(
            "liveness probe needing two successes",
            vec![(
                "/spec/livenessProbe",
                json!({"guestAgentPing": {}, "successThreshold": 2}),
            )],
            "spec.livenessProbe.successThreshold",
            "must be 1",
        ),
        m(
            "hostname not a DNS label",
            vec![("/spec/hostname", json!("My_Host"))],
            "spec.hostname",
            "is not a DNS label",
        ),
        m(
            "negative grace period",
            vec![("/spec/terminationGracePeriodSeconds", json!(-1))],
            "spec.terminationGracePeriodSeconds",
            "must not be negative",
        ),
        m(
            "unknown DNS policy",
            vec![("/spec/dnsPolicy", json!("Sometimes"))],
            "spec.dnsPolicy",
            "is not supported",
        ),
        m(
            "dnsPolicy None without dnsConfig",
            vec![("/spec/dnsPolicy", json!("None"))],
            "spec.dnsConfig",
            "required when dnsPolicy is None",
        ),
        m(
            "unsupported hugepage size",
            vec![("/spec/domain/memory/hugepages", json!({"pageSize": "4Ki"}))],
            "spec.domain.memory.hugepages.pageSize",
            "is not a supported page size",
        ),
        m(
            "guest memory not a multiple of the hugepage size",
            vec![
                ("/spec/domain/memory/hugepages", json!({"pageSize": "1Gi"})),
                ("/spec/domain/memory/guest", json!("1536Mi")),
                ("/spec/domain/resources/limits/memory", json!("2Gi")),
            ],
            "spec.domain.memory.hugepages.pageSize",
            "not a multiple of the page size 1Gi",
        ),
        m(
            "a time zone that does not exist",
            vec![(
                "/spec/domain/clock",
                json!({"timezone": "Mars/Olympus_Mons"}),
            )],
            "spec.domain.clock.timezone",
            "unknown time zone \"Mars/Olympus_Mons\"",
        ),
        m(
            "a clock in UTC and in a time zone",
            vec![(
                "/spec/domain/clock",
                json!({"utc": {}, "timezone": "Europe/Paris"}),
            )],
            "spec.domain.clock.timezone",
            "only one of utc and timezone",
        ),
        m(
            "an ephemeral volume without its claim",
            vec![("/spec/volumes/0", json!({"name": "root", "ephemeral": {}}))],
            "spec.volumes[0].ephemeral.persistentVolumeClaim",
            "required",
        ),
        m(
            "paused start with a liveness probe",
            vec![
                ("/spec/startStrategy", json!("Paused")),
                ("/spec/livenessProbe", json!({"guestAgentPing": {}})),
            ],
            "spec.startStrategy",
            "cannot have a livenessProbe",
        ),
        m(
            "dedicated CPUs with a fractional CPU request",
            vec![
                ("/spec/domain/cpu/dedicatedCpuPlacement", json!(true)),
                ("/spec/domain/resources/requests/cpu", json!("1500m")),
            ],
            "spec.domain.resources.requests.cpu",
            "provided resources CPU requests must be an integer",
        ),
        m(
            "dedicated CPUs with memory request below the limit",
            vec![("/spec/domain/cpu/dedicatedCpuPlacement", json!(true))],
            "spec.domain.resources.requests.memory",
            "spec.domain.resources.requests.memory must be equal to spec.domain.resources.limits.memory",
        ),
        m(
            "dedicated CPUs with a request that does not match the topology",
            vec![
                ("/spec/domain/cpu/dedicatedCpuPlacement", json!(true)),
                ("/spec/domain/resources/requests/cpu", json!("3")),
            ],
            "spec.domain.cpu.dedicatedCpuPlacement",
            "spec.domain.resources.requests.cpu or spec.domain.resources.limits.cpu must not be \
             provided at the same time with spec.domain.cpu.cores when DedicatedCPUPlacement is true",
        ),
        m(
            "dedicated CPUs with three threads per core",
            vec![
                ("/spec/domain/cpu/dedicatedCpuPlacement", json!(true)),
                ("/spec/domain/cpu/threads", json!(3)),
            ],
            "spec.domain.cpu.dedicatedCpuPlacement",
            "Not more than two threads must be provided at spec.domain.cpu.threads (got 3) when \
             DedicatedCPUPlacement is true",
        ),
        m(
            "dedicated CPUs with CPU requests and limits that differ",
            vec![
                ("/spec/domain/cpu/dedicatedCpuPlacement", json!(true)),
                ("/spec/domain/resources/requests/cpu", json!("1")),
                ("/spec/domain/resources/limits/cpu", json!("2")),
            ],
            "spec.domain.cpu.dedicatedCpuPlacement",
            "spec.domain.resources.requests.cpu or spec.domain.resources.limits.cpu must be equal \
             when DedicatedCPUPlacement is true",
        ),
        m(
            "unsupported architecture",
            vec![("/spec/architecture", json!("s390x"))],
            "spec.architecture",
            "unsupported architecture: s390x",
        ),
    ]
}

#[test]
fn the_valid_base_is_clean() {
    assert_eq!(errors(valid(), &ClusterConfig::default()), vec![]);
}

#[test]
fn each_mistake_is_reported_at_its_path() {
    let cases = mistakes();
    assert!(cases.len() >= 20);
    let mut names = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for case in cases {
        assert!(names.insert(case.name), "duplicate case {}", case.name);
        let mut v = valid();
        for (pointer, value) in case.edits {
            set(&mut v, pointer, value);
        }
        let errs = errors(v, &ClusterConfig::default());
        if !errs
            .iter()
            .any(|e| e.path == case.path && e.message.contains(case.message))
        {
            failures.push(format!(
                "{}: want {}: ...{}..., got {:#?}",
                case.name,
                case.path,
                case.message,
                errs.iter().map(ToString::to_string).collect::<Vec<_>>()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_problem_is_reported_at_once() {
    let mut v = valid();
    set(&mut v, "/spec/domain/devices/disks/1/name", json!("x"));
    set(
        &mut v,
        "/spec/domain/devices/interfaces/0/macAddress",
        json!("nope"),
    );
    set(
        &mut v,
        "/spec/domain/resources/limits/memory",
        json!("12XB"),
    );
    let errs = errors(v, &ClusterConfig::default());
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        text,
        [
            r#"spec.domain.resources.limits.memory: "12XB" has an unknown suffix "XB""#,
            r#"spec.domain.devices.disks[1].name: no volume named "x""#,
            r#"spec.domain.devices.interfaces[0].macAddress: "nope" is not a MAC address (e.g. de:ad:00:00:be:af)"#,
        ]
    );
}

#[test]
fn the_host_disk_gate_lets_host_disks_through() {
    let mut v = valid();
    set(
        &mut v,
        "/spec/volumes/2",
        json!({"name": "hd", "hostDisk": {"path": "/d.img", "type": "DiskOrCreate", "capacity": "1Gi"}}),
    );
    set(
        &mut v,
        "/spec/domain/devices/disks/2",
        json!({"name": "hd", "disk": {"bus": "virtio"}}),
    );
    let cfg = ClusterConfig {
        feature_gates: vec!["HostDisk".into()],
        ..ClusterConfig::default()
    };
    assert_eq!(errors(v, &cfg), vec![]);
}

#[test]
fn config_volumes_are_filesystems_and_claims_need_the_storage_gate() {
    let mut v = valid();
    for (i, volume) in [
        json!({"name": "cm", "configMap": {"name": "app"}}),
        json!({"name": "sec", "secret": {"secretName": "keys"}}),
        json!({"name": "sa", "serviceAccount": {"serviceAccountName": "default"}}),
        json!({"name": "down", "downwardAPI": {"fields": []}}),
        json!({"name": "data", "persistentVolumeClaim": {"claimName": "data"}}),
    ]
    .into_iter()
    .enumerate()
    {
        let name = volume["name"].clone();
        set(&mut v, &format!("/spec/volumes/{}", i + 2), volume);
        let fs = json!({"name": name, "virtiofs": {}});
        let pointer = "/spec/domain/devices/filesystems";
        match v.pointer_mut(pointer) {
            Some(Value::Array(list)) => list.push(fs),
            _ => set(&mut v, pointer, json!([fs])),
        }
    }
    let refused = errors(v.clone(), &ClusterConfig::default());
    assert_eq!(
        refused.iter().map(ToString::to_string).collect::<Vec<_>>(),
        [
            "spec.domain.devices.filesystems: virtiofs is not allowed: virtiofs feature gate is \
          not enabled for PVC"
        ]
    );
    let cfg = ClusterConfig {
        feature_gates: vec![api::virtiofs::STORAGE_VOLUMES_GATE.into()],
        ..ClusterConfig::default()
    };
    assert_eq!(errors(v.clone(), &cfg), vec![]);
    set(
        &mut v,
        "/spec/volumes/6/persistentVolumeClaim/hotpluggable",
        json!(true),
    );
    assert_eq!(
        errors(v, &cfg)
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["spec.domain.devices.filesystems[4].name: a hotpluggable volume cannot be a filesystem"]
    );
}

/// A manifest as a KubeVirt user might write it, using features kubevirt-rs does not have.
const UNSUPPORTED_MANIFEST: &str = r"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: fancy
spec:
  accessCredentials:
    - sshPublicKey:
        source: {secret: {secretName: keys}}
        propagationMethod: {qemuGuestAgent: {users: [root]}}
  domain:
    cpu:
      numa: {guestMappingPassthrough: {}}
    features:
      hyperv: {relaxed: {}}
    firmware:
      acpi: {slicNameRef: slic}
    launchSecurity: {sev: {}}
    memory:
      guest: 1Gi
    devices:
      gpus: [{name: gpu1, deviceName: nvidia.com/GP102GL}]
      hostDevices: [{name: hd, deviceName: vendor.com/dev}]
      tpm: {}
      sound: {name: snd}
      autoattachVSOCK: true
      disks:
        - name: dv
          disk: {bus: virtio}
        - name: lun
          lun: {}
      interfaces:
        - name: default
          masquerade: {}
        - name: sriov-net
          sriov: {}
  networks:
    - name: default
      pod: {}
    - name: sriov-net
      multus: {networkName: sriov}
  volumes:
    - name: dv
      dataVolume: {name: my-dv}
    - name: lun
      persistentVolumeClaim: {claimName: block}
    - name: metrics
      downwardMetrics: {}
";

#[test]
fn unsupported_kubevirt_features_are_refused_by_name() {
    let vmi: VirtualMachineInstance = serde_saphyr::from_str(UNSUPPORTED_MANIFEST).unwrap();
    // Nothing was dropped on the way in.
    let original: Value = serde_saphyr::from_str(UNSUPPORTED_MANIFEST).unwrap();
    assert_eq!(serde_json::to_value(&vmi).unwrap(), original);

    let errs = validation::validate_vmi(&vmi, &ClusterConfig::default());
    let unsupported: Vec<&str> = errs
        .iter()
        .filter(|e| e.message == UNSUPPORTED)
        .map(|e| e.path.as_str())
        .collect();
    for path in [
        "spec.accessCredentials",
        "spec.domain.cpu.numa",
        "spec.domain.features.hyperv",
        "spec.domain.firmware.acpi",
        "spec.domain.launchSecurity",
        "spec.domain.devices.gpus",
        "spec.domain.devices.hostDevices",
        "spec.domain.devices.tpm",
        "spec.domain.devices.sound",
        "spec.domain.devices.autoattachVSOCK",
        "spec.domain.devices.disks[1].lun",
        "spec.domain.devices.interfaces[1].sriov",
        "spec.networks[1].multus",
        "spec.volumes[0].dataVolume",
        "spec.volumes[2].downwardMetrics",
    ] {
        assert!(
            unsupported.contains(&path),
            "{path} not refused; got {errs:#?}"
        );
    }
    let shown = validation::ValidationErrors(errs).to_string();
    assert!(
        shown.contains("spec.domain.devices.gpus: not supported by kubevirt-rs yet"),
        "{shown}"
    );
}

#[test]
fn vm_and_replicaset_mistakes() {
    let cfg = ClusterConfig::default();
    let vm: api::VirtualMachine = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "vm"},
        "spec": {
            "running": true,
            "runStrategy": "Sometimes",
            "dataVolumeTemplates": [{"metadata": {"name": "dv"}, "spec": {}}],
            "template": {"spec": {"domain": {"devices": {"disks": [{"name": "x"}]}}}}
        }
    }))
    .unwrap();
    let text: Vec<String> = validation::validate_vm(&vm, &cfg)
        .iter()
        .map(ToString::to_string)
        .collect();
    for want in [
        "spec.running: running and runStrategy are mutually exclusive; use runStrategy",
        "spec.runStrategy: unknown run strategy \"Sometimes\"",
        "spec.dataVolumeTemplates: not supported by kubevirt-rs yet",
        "spec.template.spec.domain.devices.disks[0].name: no volume named \"x\"",
        "spec.template.spec.domain.resources.requests.memory: no memory requested",
    ] {
        assert!(
            text.iter().any(|t| t.starts_with(want)),
            "missing {want}: {text:#?}"
        );
    }

    let rs: api::VirtualMachineInstanceReplicaSet = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceReplicaSet",
        "metadata": {"name": "rs"},
        "spec": {
            "replicas": -1,
            "selector": {"matchLabels": {"app": "a"}},
            "template": {"metadata": {"labels": {"app": "b"}}, "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {}}}}
        }
    }))
    .unwrap();
    let text: Vec<String> = validation::validate_replicaset(&rs, &cfg)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        text,
        [
            "spec.replicas: must be greater than or equal to 0",
            "spec.selector.matchLabels: app=a does not match the template's labels (spec.template.metadata.labels)",
        ]
    );

    let mig: api::VirtualMachineInstanceMigration = serde_json::from_value(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
        "metadata": {"name": "m"}, "spec": {}
    }))
    .unwrap();
    let text: Vec<String> = validation::validate_migration(&mig)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(text, ["spec.vmiName: required"]);
}

/// Dedicated CPUs with Guaranteed-shaped resources, as KubeVirt's rules want them, pass.
#[test]
fn dedicated_cpus_with_guaranteed_resources_pass() {
    let mut v = valid();
    set(
        &mut v,
        "/spec/domain/cpu/dedicatedCpuPlacement",
        json!(true),
    );
    set(
        &mut v,
        "/spec/domain/cpu/isolateEmulatorThread",
        json!(true),
    );
    set(
        &mut v,
        "/spec/domain/resources/requests",
        json!({"cpu": "1", "memory": "512Mi"}),
    );
    set(
        &mut v,
        "/spec/domain/resources/limits",
        json!({"cpu": "1", "memory": "512Mi"}),
    );
    let text: Vec<String> = errors(v, &ClusterConfig::default())
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(text, Vec::<String>::new());
}

/// What QEMU cannot do with the clock and disk options kubevirt-rs implements is named at its
/// path; KubeVirt's other values pass.
#[test]
fn clock_and_disk_values_qemu_cannot_honour_are_named() {
    let cases: Vec<(&str, Value, &str, &str)> = vec![
        (
            "/spec/domain/clock",
            json!({"timer": {"pit": {"tickPolicy": "merge"}}}),
            "spec.domain.clock.timer.pit.tickPolicy",
            "QEMU's pit has no \"merge\" tick policy",
        ),
        (
            "/spec/domain/clock",
            json!({"timer": {"rtc": {"tickPolicy": "discard"}}}),
            "spec.domain.clock.timer.rtc.tickPolicy",
            "QEMU's rtc has no \"discard\" tick policy",
        ),
        (
            "/spec/domain/clock",
            json!({"timer": {"rtc": {"track": "boot"}}}),
            "spec.domain.clock.timer.rtc.track",
            "unknown track",
        ),
        (
            "/spec/domain/devices/disks/0/io",
            json!("native"),
            "spec.domain.devices.disks[0].io",
            "native needs cache none",
        ),
        (
            "/spec/domain/devices/disks/0/shareable",
            json!(true),
            "spec.domain.devices.disks[0].cache",
            "a shareable disk needs cache none",
        ),
        (
            "/spec/domain/devices/disks/0/errorPolicy",
            json!("retry"),
            "spec.domain.devices.disks[0].errorPolicy",
            "unknown error policy",
        ),
        (
            "/spec/domain/devices/disks/0/disk/pciAddress",
            json!("00:05.0"),
            "spec.domain.devices.disks[0].disk.pciAddress",
            "is not a PCI address",
        ),
        (
            "/spec/domain/devices/disks/0/disk/pciAddress",
            json!("0000:01:05.0"),
            "spec.domain.devices.disks[0].disk.pciAddress",
            "0000:01:05.0: on bus 01 (pcie-root-port) the slot must be 00-00",
        ),
        (
            "/spec/domain/ioThreadsPolicy",
            json!("supplementalPool"),
            "spec.domain.ioThreadsPolicy",
            UNSUPPORTED,
        ),
    ];
    for (pointer, value, path, message) in cases {
        let mut v = valid();
        set(
            &mut v,
            "/spec/domain/devices/disks/0/cache",
            json!("writeback"),
        );
        set(&mut v, pointer, value.clone());
        let errs = errors(v, &ClusterConfig::default());
        assert!(
            errs.iter()
                .any(|e| e.path == path && e.message.contains(message)),
            "{pointer} = {value}: want {path}: ...{message}..., got {errs:#?}"
        );
    }
    // One slot, one ACPI index: the second user is named with the first.
    let mut v = valid();
    set(
        &mut v,
        "/spec/domain/devices/disks/0/disk/pciAddress",
        json!("0000:00:0a.0"),
    );
    set(
        &mut v,
        "/spec/domain/devices/interfaces/0/pciAddress",
        json!("0000:00:0A.0"),
    );
    let errs = errors(v, &ClusterConfig::default());
    assert!(
        errs.iter()
            .any(|e| e.path == "spec.domain.devices.interfaces[0].pciAddress"
                && e.message
                    == "PCI address 0000:00:0a.0 is already used by \
                    spec.domain.devices.disks[0].disk.pciAddress"),
        "{errs:#?}"
    );
    let mut v = valid();
    set(
        &mut v,
        "/spec/domain/devices/interfaces",
        json!([
            {"name": "default", "masquerade": {}, "acpiIndex": 2},
            {"name": "other", "bridge": {}, "acpiIndex": 2},
        ]),
    );
    set(
        &mut v,
        "/spec/networks",
        json!([{"name": "default", "pod": {}}, {"name": "other", "multus": {"networkName": "n"}}]),
    );
    let errs = errors(v, &ClusterConfig::default());
    assert!(
        errs.iter()
            .any(|e| e.path == "spec.domain.devices.interfaces[1].acpiIndex"
                && e.message.starts_with("ACPI index 2 is already used by")),
        "{errs:#?}"
    );
    let mut v = valid();
    set(
        &mut v,
        "/spec/domain/clock",
        json!({"utc": {"offsetSeconds": -7200}, "timer": {
            "pit": {"tickPolicy": "discard"}, "rtc": {"tickPolicy": "catchup", "track": "wall"},
            "hpet": {"present": false}, "kvm": {"present": true}, "hyperv": {"present": false},
        }}),
    );
    set(&mut v, "/spec/domain/ioThreadsPolicy", json!("auto"));
    set(&mut v, "/spec/domain/devices/disks/0/cache", json!("none"));
    set(&mut v, "/spec/domain/devices/disks/0/io", json!("native"));
    set(
        &mut v,
        "/spec/domain/devices/disks/0/shareable",
        json!(true),
    );
    set(
        &mut v,
        "/spec/domain/devices/disks/0/errorPolicy",
        json!("enospace"),
    );
    set(
        &mut v,
        "/spec/domain/devices/disks/0/dedicatedIOThread",
        json!(true),
    );
    set(
        &mut v,
        "/spec/domain/devices/disks/0/disk/pciAddress",
        json!("0000:00:0a.0"),
    );
    // Off the root bus: libvirt's root ports 1 and 2, the NIC behind the second.
    set(
        &mut v,
        "/spec/domain/devices/interfaces/0/pciAddress",
        json!("0000:02:00.0"),
    );
    set(&mut v, "/spec/domain/devices/blockMultiQueue", json!(true));
    assert_eq!(errors(v, &ClusterConfig::default()), []);
}

/// `networkInterfaceMultiqueue` is admitted whatever the NICs' models, as KubeVirt admits it
/// since it dropped its "no virtio interfaces defined" rule: non-virtio NICs keep one queue.
#[test]
fn network_multiqueue_is_admitted_with_any_nic_model() {
    let mut v = valid();
    set(
        &mut v,
        "/spec/domain/devices/networkInterfaceMultiqueue",
        json!(true),
    );
    assert_eq!(errors(v.clone(), &ClusterConfig::default()), []);
    set(
        &mut v,
        "/spec/domain/devices/interfaces/0/model",
        json!("e1000"),
    );
    assert_eq!(errors(v, &ClusterConfig::default()), []);
}
