//! Well-known label, annotation and finalizer keys of KubeVirt, so every component spells them
//! as KubeVirt does (tools and users select on them).

/// Marks every KubeVirt resource; value is the component (`virt-launcher`, `virt-handler`...).
pub const APP: &str = "kubevirt.io";
/// UID of the VMI a launcher pod was created for.
pub const CREATED_BY: &str = "kubevirt.io/created-by";
/// Node a VMI runs on (virt-handler watches VMIs by this label).
pub const NODE_NAME: &str = "kubevirt.io/nodeName";
/// Launcher pod annotation: the VMI's name.
pub const DOMAIN: &str = "kubevirt.io/domain";
/// Node label: whether virt-handler on the node accepts VMIs.
pub const NODE_SCHEDULABLE: &str = "kubevirt.io/schedulable";
/// Node annotation: virt-handler's last heartbeat.
pub const VIRT_HANDLER_HEARTBEAT: &str = "kubevirt.io/heartbeat";
/// Target pod label of a migration: the migration's UID.
pub const MIGRATION_JOB_UID: &str = "kubevirt.io/migrationJobUID";
/// Label: name of the migration.
pub const MIGRATION_NAME: &str = "kubevirt.io/migrationName";
/// VMI label: node a migration goes to.
pub const MIGRATION_TARGET_NODE_NAME: &str = "kubevirt.io/migrationTargetNodeName";
/// Label on a VMI whose launcher image is older than the installed one.
pub const OUTDATED_LAUNCHER_IMAGE: &str = "kubevirt.io/outdatedLauncherImage";
/// Annotation: memory overhead of the launcher, in bytes.
pub const MEMORY_OVERHEAD_BYTES: &str = "kubevirt.io/memory-overhead-bytes";
/// Annotation: PCI topology version of a VMI.
pub const PCI_TOPOLOGY_VERSION: &str = crate::defaults::PCI_TOPOLOGY_VERSION_ANNOTATION;
/// Launcher pod label: the VM's name (deprecated in KubeVirt in favour of [`VMI_ID`]).
pub const VM_NAME: &str = "vm.kubevirt.io/name";
/// Launcher pod label: a stable id of the VMI for service selectors (the name, hashed when
/// longer than 63 characters).
pub const VMI_ID: &str = "vmi.kubevirt.io/id";
/// Label of objects an install strategy created.
pub const INSTALL_STRATEGY: &str = "kubevirt.io/install-strategy";
/// Annotation: version of the install strategy.
pub const INSTALL_STRATEGY_VERSION: &str = "kubevirt.io/install-strategy-version";
/// Annotation: registry of the install strategy.
pub const INSTALL_STRATEGY_REGISTRY: &str = "kubevirt.io/install-strategy-registry";
/// Annotation: identifier of the install strategy.
pub const INSTALL_STRATEGY_IDENTIFIER: &str = "kubevirt.io/install-strategy-identifier";
/// Annotation: generation of the KubeVirt CR an object was made for.
pub const KUBEVIRT_GENERATION: &str = "kubevirt.io/generation";
/// `app.kubernetes.io/managed-by` value on objects virt-operator manages.
pub const MANAGED_BY_OPERATOR: &str = "virt-operator";

/// VMI annotation: the launcher exits at once (KubeVirt's `FuncTestLauncherFailFastAnnotation`,
/// how KubeVirt's own tests make a VM crash-loop).
pub const FUNC_TEST_LAUNCHER_FAIL_FAST: &str = "kubevirt.io/func-test-virt-launcher-fail-fast";

/// Finalizer on every VMI.
pub const VMI_FINALIZER: &str = crate::defaults::VMI_FINALIZER;
/// The finalizer older KubeVirt releases put on VMIs; still honoured.
pub const DEPRECATED_VMI_FINALIZER: &str = "foregroundDeleteVirtualMachine";
/// Finalizer the VM controller puts on VMs and on the VMIs it starts.
pub const VM_CONTROLLER_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";
/// The name kubevirt-rs gave [`VM_CONTROLLER_FINALIZER`] before it matched KubeVirt's; objects
/// that still carry it are given the right name.
pub const LEGACY_VM_CONTROLLER_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalizer";
/// Kubernetes' finalizer on an object deleted with `propagationPolicy: Orphan`: the garbage
/// collector strips its dependents' owner references before it goes.
pub const ORPHAN_DEPENDENTS_FINALIZER: &str = "orphan";
/// Finalizer on migrations.
pub const MIGRATION_FINALIZER: &str = "kubevirt.io/migrationJobFinalize";
/// Finalizer virt-operator puts on the KubeVirt CR.
pub const OPERATOR_FINALIZER: &str = "kubevirt.io/virtOperatorFinalizer";
