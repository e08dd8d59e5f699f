//! Well-known label, annotation, finalizer and pod condition keys of KubeVirt, so every component
//! spells them as KubeVirt does (tools and users select on them). Each names the Go constant of
//! `kubevirt.io/api/core/v1` (`types.go`) it mirrors.

/// `AppLabel`: marks every KubeVirt resource; the value is the component (`virt-launcher`,
/// `virt-handler`...).
pub const APP: &str = "kubevirt.io";
/// `CreatedByLabel`: launcher pod label, the UID of the VMI the pod was created for.
pub const CREATED_BY: &str = "kubevirt.io/created-by";
/// `NodeNameLabel`: the node a VMI runs on (virt-handler watches VMIs by this label).
pub const NODE_NAME: &str = "kubevirt.io/nodeName";
/// `DomainAnnotation`: launcher pod annotation, the name of the VMI (domain) the pod runs.
pub const DOMAIN: &str = "kubevirt.io/domain";
/// `NodeSchedulable`: node label, whether virt-handler on the node accepts VMIs.
pub const NODE_SCHEDULABLE: &str = "kubevirt.io/schedulable";
/// `VirtHandlerHeartbeat`: node annotation, virt-handler's last heartbeat.
pub const VIRT_HANDLER_HEARTBEAT: &str = "kubevirt.io/heartbeat";
/// `CPUModelLabel`: node label prefix, a CPU model guests can have on the node.
pub const CPU_MODEL: &str = "cpu-model.node.kubevirt.io/";
/// `CPUFeatureLabel`: node label prefix, a CPU feature guests can have on the node.
pub const CPU_FEATURE: &str = "cpu-feature.node.kubevirt.io/";
/// `SupportedHostModelMigrationCPU`: node label prefix, a CPU model the node knows.
pub const SUPPORTED_HOST_MODEL_MIGRATION_CPU: &str = "cpu-model-migration.node.kubevirt.io/";
/// `CPUModelVendorLabel`: node label prefix, the vendor of the node's CPU.
pub const CPU_MODEL_VENDOR: &str = "cpu-vendor.node.kubevirt.io/";
/// `HostModelCPULabel`: node label prefix, the model `host-model` stands for on the node.
pub const HOST_MODEL_CPU: &str = "host-model-cpu.node.kubevirt.io/";
/// `HostModelRequiredFeaturesLabel`: node label prefix, a feature the node's CPU has beyond its
/// host model.
pub const HOST_MODEL_REQUIRED_FEATURES: &str = "host-model-required-features.node.kubevirt.io/";
/// `NodeHostModelIsObsoleteLabel`: node label, the host model is an obsolete one.
pub const NODE_HOST_MODEL_IS_OBSOLETE: &str = "node-labeller.kubevirt.io/obsolete-host-model";
/// `LabellerSkipNodeAnnotation`: node annotation, the node labeller leaves the node alone.
pub const LABELLER_SKIP_NODE: &str = "node-labeller.kubevirt.io/skip-node";
/// `CPUManager`: node label, whether the kubelet's static CPU manager policy is on.
pub const CPU_MANAGER: &str = "kubevirt.io/cpumanager";
/// `DeprecatedCPUManager`: the older spelling of [`CPU_MANAGER`]; KubeVirt still sets both.
pub const DEPRECATED_CPU_MANAGER: &str = "cpumanager";
/// `MigrationJobLabel`: target pod label, the migration's UID.
pub const MIGRATION_JOB_UID: &str = "kubevirt.io/migrationJobUID";
/// `MigrationNameLabel`: name of the migration.
pub const MIGRATION_NAME: &str = "kubevirt.io/migrationName";
/// `MigrationTargetNodeNameLabel`: VMI label, the node a migration goes to.
pub const MIGRATION_TARGET_NODE_NAME: &str = "kubevirt.io/migrationTargetNodeName";
/// `EvictionSourceAnnotation`: VMI annotation virt-api sets when the descheduler asked for the
/// eviction (its evacuation migration gets a lower priority); removed once the VMI moved.
pub const EVICTION_SOURCE: &str = "kubevirt.io/eviction-source";
/// `EvacuationMigrationAnnotation`: migration annotation naming the node being evacuated; it
/// also marks the migration as the evacuation controller's.
pub const EVACUATION_MIGRATION: &str = "kubevirt.io/evacuationMigration";
/// `MigrationJobNameAnnotation`: target pod annotation, the migration's name.
pub const MIGRATION_JOB_NAME: &str = "kubevirt.io/migrationJobName";
/// `AllowPodBridgeNetworkLiveMigrationAnnotation`: VMI annotation, a bridge binding on the pod
/// network does not block live migration.
pub const ALLOW_POD_BRIDGE_NETWORK_LIVE_MIGRATION: &str =
    "kubevirt.io/allow-pod-bridge-network-live-migration";
/// `MigrationTransportUnixAnnotation`: launcher pod annotation, migrations go over unix
/// sockets proxied by virt-handler.
pub const MIGRATION_TRANSPORT_UNIX: &str = "kubevirt.io/migrationTransportUnix";
/// `OutdatedLauncherImageLabel`: on a VMI whose launcher image is older than the installed one.
pub const OUTDATED_LAUNCHER_IMAGE: &str = "kubevirt.io/outdatedLauncherImage";
/// `MemoryOverheadAnnotationBytes`: memory overhead of the launcher, in bytes.
pub const MEMORY_OVERHEAD_BYTES: &str = "kubevirt.io/memory-overhead-bytes";
/// `PciTopologyVersionAnnotation`: PCI topology version of a VMI.
pub const PCI_TOPOLOGY_VERSION: &str = crate::defaults::PCI_TOPOLOGY_VERSION_ANNOTATION;
/// `DeprecatedVirtualMachineNameLabel`: launcher pod label, the VMI's host name (deprecated in
/// KubeVirt in favour of [`VMI_ID`], still set).
pub const VM_NAME: &str = "vm.kubevirt.io/name";
/// `VirtualMachineInstanceIDLabel`: launcher pod label, a stable id of the VMI for service
/// selectors (the name, truncated and hashed when longer than 63 characters).
pub const VMI_ID: &str = "vmi.kubevirt.io/id";
/// `VirtualMachineGenerationAnnotation`: VMI annotation, the generation of the VM it was
/// started from.
pub const VM_GENERATION: &str = "kubevirt.io/vm-generation";
/// `ControllerAPILatestVersionObservedAnnotation`: kept off launcher pods.
pub const CONTROLLER_API_LATEST_VERSION_OBSERVED: &str = "kubevirt.io/latest-observed-api-version";
/// `ControllerAPIStorageVersionObservedAnnotation`: kept off launcher pods.
pub const CONTROLLER_API_STORAGE_VERSION_OBSERVED: &str =
    "kubevirt.io/storage-observed-api-version";
/// `VirtualMachineUnpaused`: the launcher pod's readiness gate and pod condition type,
/// `True` while the guest is not paused.
pub const VIRTUAL_MACHINE_UNPAUSED: &str = "kubevirt.io/virtual-machine-unpaused";
/// `K8sDevicePrefix` (virt-handler's `DeviceNamespace`): the namespace of the extended resources
/// virt-handler's device plugins advertise and launcher pods request.
pub const DEVICE_RESOURCE_PREFIX: &str = "devices.kubevirt.io";
/// `KvmDevice`: the extended resource of `/dev/kvm`.
pub const KVM_RESOURCE: &str = "devices.kubevirt.io/kvm";
/// `TunDevice`: the extended resource of `/dev/net/tun`.
pub const TUN_RESOURCE: &str = "devices.kubevirt.io/tun";
/// `VhostNetDevice`: the extended resource of `/dev/vhost-net`.
pub const VHOST_NET_RESOURCE: &str = "devices.kubevirt.io/vhost-net";
/// `InstallStrategyLabel`: on objects an install strategy created.
pub const INSTALL_STRATEGY: &str = "kubevirt.io/install-strategy";
/// `InstallStrategyVersionAnnotation`: version of the install strategy.
pub const INSTALL_STRATEGY_VERSION: &str = "kubevirt.io/install-strategy-version";
/// `InstallStrategyRegistryAnnotation`: registry of the install strategy.
pub const INSTALL_STRATEGY_REGISTRY: &str = "kubevirt.io/install-strategy-registry";
/// `InstallStrategyIdentifierAnnotation`: identifier of the install strategy.
pub const INSTALL_STRATEGY_IDENTIFIER: &str = "kubevirt.io/install-strategy-identifier";
/// `KubeVirtGenerationAnnotation`: generation of the KubeVirt CR an object was made for.
pub const KUBEVIRT_GENERATION: &str = "kubevirt.io/generation";
/// `ManagedByLabelOperatorValue`: `app.kubernetes.io/managed-by` value on objects virt-operator
/// manages.
pub const MANAGED_BY_OPERATOR: &str = "virt-operator";

/// `FuncTestLauncherFailFastAnnotation`: VMI annotation, the launcher exits at once (how
/// KubeVirt's own tests make a VM crash-loop).
pub const FUNC_TEST_LAUNCHER_FAIL_FAST: &str = "kubevirt.io/func-test-virt-launcher-fail-fast";

/// `VirtualMachineInstanceFinalizer`: finalizer on every VMI.
pub const VMI_FINALIZER: &str = crate::defaults::VMI_FINALIZER;
/// `DeprecatedVirtualMachineInstanceFinalizer`: the finalizer older KubeVirt releases put on
/// VMIs; still honoured.
pub const DEPRECATED_VMI_FINALIZER: &str = "foregroundDeleteVirtualMachine";
/// `VirtualMachineControllerFinalizer`: finalizer the VM controller puts on VMs and on the VMIs
/// it starts.
pub const VM_CONTROLLER_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";
/// The name kubevirt-rs gave [`VM_CONTROLLER_FINALIZER`] before it matched KubeVirt's; objects
/// that still carry it are given the right name.
pub const LEGACY_VM_CONTROLLER_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalizer";
/// Kubernetes' finalizer on an object deleted with `propagationPolicy: Orphan`: the garbage
/// collector strips its dependents' owner references before it goes.
pub const ORPHAN_DEPENDENTS_FINALIZER: &str = "orphan";
/// `VirtualMachineInstanceMigrationFinalizer`: finalizer on migrations.
pub const MIGRATION_FINALIZER: &str = "kubevirt.io/migrationJobFinalize";
/// `VirtOperatorComponentFinalizer`: finalizer virt-operator puts on the KubeVirt CR.
pub const OPERATOR_FINALIZER: &str = "kubevirt.io/virtOperatorFinalizer";

/// Whether `s` can be the name part of a label key (Kubernetes' qualified name: at most 63
/// characters, alphanumerics, `-`, `_` and `.`, alphanumeric at both ends). CPU model and
/// feature names become such names in the node labeller's labels.
pub fn is_label_name(s: &str) -> bool {
    let alnum = |c: Option<u8>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    s.len() <= 63
        && alnum(s.bytes().next())
        && alnum(s.bytes().last())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// KubeVirt's `CalculateVirtualMachineInstanceID`, the value of [`VMI_ID`]: the VMI's name, or
/// for a name longer than a DNS label (63) its first 54 characters, `-` and the first 8 hex
/// digits of its SHA-1.
pub fn vmi_id(name: &str) -> String {
    use sha1::Digest as _;
    const MAX: usize = 63;
    // The first 8 hex digits of the hash, and the `-` before them.
    const HASH: usize = 8;
    if name.len() <= MAX {
        return name.to_owned();
    }
    // A name is ASCII (a DNS subdomain), so byte offsets are character offsets.
    let prefix = name.get(..MAX - HASH - 1).unwrap_or(name);
    let digest = sha1::Sha1::digest(name.as_bytes());
    let [a, b, c, d, ..] = digest.as_slice() else {
        unreachable!("SHA-1 digests are 20 bytes")
    };
    format!("{prefix}-{a:02x}{b:02x}{c:02x}{d:02x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn label_names_are_kubernetes_qualified_names() {
        for ok in [
            "sse4.1",
            "lahf_lm",
            "Skylake-Client-v4",
            "a",
            &"x".repeat(63),
        ] {
            assert!(super::is_label_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-pcid",
            "pcid.",
            "kvm=off",
            "a,b",
            "a/b",
            &"x".repeat(64),
        ] {
            assert!(!super::is_label_name(bad), "{bad}");
        }
    }

    #[test]
    fn the_vmi_id_label_is_kubevirts() {
        assert_eq!(super::vmi_id("testvmi"), "testvmi");
        let long = "a".repeat(70);
        // Python: name[:54] + "-" + hashlib.sha1(name).hexdigest()[:8]
        assert_eq!(super::vmi_id(&long), format!("{}-ed6c69d9", &long[..54]));
    }

    use super::*;

    #[test]
    fn device_resources_are_in_the_device_namespace() {
        for (r, name) in [
            (KVM_RESOURCE, "kvm"),
            (TUN_RESOURCE, "tun"),
            (VHOST_NET_RESOURCE, "vhost-net"),
        ] {
            assert_eq!(r, format!("{DEVICE_RESOURCE_PREFIX}/{name}"));
        }
    }
}
