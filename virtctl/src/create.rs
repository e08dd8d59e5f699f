//! `create vm`: a VirtualMachine manifest from flags, printed as YAML, after KubeVirt's
//! `pkg/virtctl/create/vm`. Nothing is sent to the cluster.
//!
//! The manifest is built as an [`api::VirtualMachine`], so it deserializes and (after the
//! webhook defaults) validates in kubevirt-rs by construction. Flags for what kubevirt-rs does
//! not have (inferring instance types and preferences from volumes, CDI DataVolumes, sysprep,
//! access credentials) are refused by name.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::bail;
use api::VirtualMachine;
use api::instancetype::{
    CLUSTER_INSTANCETYPE_SINGULAR, CLUSTER_PREFERENCE_SINGULAR, INSTANCETYPE_SINGULAR,
    PREFERENCE_SINGULAR,
};
use api::vm::{Matcher, RunStrategy, VirtualMachineSpec};
use api::vmi::{
    CloudInitNoCloudSource, ContainerDiskSource, Disk, DomainSpec, Memory,
    PersistentVolumeClaimSource, VirtualMachineInstanceSpec, Volume,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Default guest memory, as KubeVirt's.
pub const DEFAULT_MEMORY: &str = "512Mi";
const CLOUD_INIT_DISK: &str = "cloudinitdisk";
const CLOUD_CONFIG_HEADER: &str = "#cloud-config";
const RUN_STRATEGIES: [&str; 5] = ["Always", "Manual", "Halted", "Once", "RerunOnFailure"];
/// `k8s.io/apimachinery/pkg/util/rand`'s alphabet (no vowels, no look-alikes).
const RAND_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

/// The flags of `create vm`, KubeVirt's names and defaults.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CreateVmArgs {
    /// Specify the name of the VM (default: vm-<5 random characters>).
    #[arg(long)]
    pub name: Option<String>,
    /// Specify the RunStrategy of the VM: Always, Manual, Halted, Once or RerunOnFailure.
    #[arg(long, default_value = "Always")]
    pub run_strategy: String,
    /// Specify the termination grace period of the VM.
    #[arg(long, default_value_t = 180, allow_negative_numbers = true)]
    pub termination_grace_period: i64,
    /// Specify the memory of the VM [default: 512Mi].
    #[arg(long)]
    pub memory: Option<String>,
    /// Specify the Instance Type of the VM: [kind/]name, kind virtualmachineinstancetype or
    /// virtualmachineclusterinstancetype (the default). Mutually exclusive with --memory and
    /// the instancetype inference flags.
    #[arg(long)]
    pub instancetype: Option<String>,
    /// Not supported by kubevirt-rs (no inference from volumes); only =false is accepted.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub infer_instancetype: Option<bool>,
    /// Not supported by kubevirt-rs (no inference from volumes).
    #[arg(long)]
    pub infer_instancetype_from: Option<String>,
    /// Specify the Preference of the VM: [kind/]name, kind virtualmachinepreference or
    /// virtualmachineclusterpreference (the default). Mutually exclusive with the preference
    /// inference flags.
    #[arg(long)]
    pub preference: Option<String>,
    /// Not supported by kubevirt-rs (no inference from volumes); only =false is accepted.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub infer_preference: Option<bool>,
    /// Not supported by kubevirt-rs (no inference from volumes).
    #[arg(long)]
    pub infer_preference_from: Option<String>,
    /// Specify a containerdisk to be used by the VM. Can be provided multiple times.
    /// Supported parameters: name:string,src:string,bootorder:uint
    #[arg(long, value_name = "PARAMS")]
    pub volume_containerdisk: Vec<String>,
    /// Specify a PVC to be used by the VM. Can be provided multiple times.
    /// Supported parameters: name:string,src:string,bootorder:uint
    #[arg(long, value_name = "PARAMS")]
    pub volume_pvc: Vec<String>,
    /// Not supported by kubevirt-rs (no CDI DataVolumes).
    #[arg(long, value_name = "PARAMS")]
    pub volume_import: Vec<String>,
    /// Not supported by kubevirt-rs (no CDI DataVolumes).
    #[arg(long, value_name = "PARAMS")]
    pub volume_datasource: Vec<String>,
    /// Not supported by kubevirt-rs (no CDI DataVolumes).
    #[arg(long, value_name = "PARAMS")]
    pub volume_clone_pvc: Vec<String>,
    /// Not supported by kubevirt-rs (no CDI DataVolumes).
    #[arg(long, value_name = "PARAMS")]
    pub volume_blank: Vec<String>,
    /// Not supported by kubevirt-rs (no sysprep volumes).
    #[arg(long, value_name = "PARAMS")]
    pub volume_sysprep: Option<String>,
    /// Specify the user in the cloud-init user data that is added to the VM.
    /// (On `create vm` this is the cloud-init user, not the kubeconfig user.)
    #[arg(long)]
    pub user: Option<String>,
    /// Specify a file to read the password from for the cloud-init user data.
    #[arg(long)]
    pub password_file: Option<PathBuf>,
    /// Specify one or more SSH authorized keys in the cloud-init user data.
    #[arg(long, value_delimiter = ',')]
    pub ssh_key: Vec<String>,
    /// Let the qemu-guest-agent manage SSH keys (adds a runcmd to the cloud-init user data).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub ga_manage_ssh: Option<bool>,
    /// Not supported by kubevirt-rs (no access credentials).
    #[arg(long, value_name = "PARAMS")]
    pub access_cred: Vec<String>,
    /// Specify the type of the generated cloud-init data source: nocloud, configdrive, none
    /// [default: nocloud].
    #[arg(long)]
    pub cloud_init: Option<String>,
    /// Specify the base64 encoded cloud-init user data of the VM.
    #[arg(long, conflicts_with_all = ["user", "password_file", "ssh_key", "ga_manage_ssh"])]
    pub cloud_init_user_data: Option<String>,
    /// Specify the base64 encoded cloud-init network data of the VM.
    #[arg(long)]
    pub cloud_init_network_data: Option<String>,
}

/// What the manifest is built from besides the flags: the I/O done beforehand.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// The name when `--name` is not given.
    pub generated_name: String,
    /// The namespace, when given with `-n` (KubeVirt writes it only then).
    pub namespace: Option<String>,
    /// The content of `--password-file`.
    pub password: Option<String>,
}

/// KubeVirt's `params.FlagErr` wording.
fn flag_err(flag: &str, msg: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("failed to parse \"--{flag}\" flag: {msg}")
}

fn unsupported(flag: &str, what: &str) -> anyhow::Error {
    flag_err(flag, format!("not supported by kubevirt-rs: {what}"))
}

/// KubeVirt's `params.Map` for `key:value,key2:value2` flags: every key must be in `known`.
pub fn parse_params(
    flag: &str,
    s: &str,
    known: &[&str],
) -> anyhow::Result<BTreeMap<String, String>> {
    if s.is_empty() {
        return Err(flag_err(flag, "params may not be empty"));
    }
    let mut out = BTreeMap::new();
    for param in s.split(',') {
        let Some((k, v)) = param.split_once(':') else {
            return Err(flag_err(
                flag,
                format!("params need to have at least one colon: {param}"),
            ));
        };
        out.insert(k.to_owned(), v.to_owned());
    }
    let unknown: Vec<String> = out
        .iter()
        .filter(|(k, _)| !known.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}:{v}"))
        .collect();
    if !unknown.is_empty() {
        return Err(flag_err(
            flag,
            format!("unknown param(s): {}", unknown.join(",")),
        ));
    }
    Ok(out)
}

/// `name:string,src:string,bootorder:uint` of `--volume-containerdisk` and `--volume-pvc`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VolumeParams {
    pub name: Option<String>,
    pub src: Option<String>,
    pub boot_order: Option<u32>,
}

pub fn volume_params(flag: &str, s: &str) -> anyhow::Result<VolumeParams> {
    let mut m = parse_params(flag, s, &["name", "src", "bootorder"])?;
    let boot_order = m
        .remove("bootorder")
        .map(|b| {
            b.parse::<u32>()
                .map_err(|e| flag_err(flag, format!("failed to parse param \"bootorder\": {e}")))
        })
        .transpose()?;
    Ok(VolumeParams {
        name: m.remove("name").filter(|n| !n.is_empty()),
        src: m.remove("src").filter(|s| !s.is_empty()),
        boot_order,
    })
}

/// KubeVirt's `params.SplitPrefixedName`: `[prefix/]name`.
pub fn split_prefixed_name(s: &str) -> anyhow::Result<(Option<&str>, &str)> {
    let parts: Vec<&str> = s.split('/').collect();
    let (prefix, name) = match parts.as_slice() {
        [name] => (None, *name),
        [prefix, name] => (Some(*prefix), *name),
        _ => bail!(
            "invalid count {} of slashes in prefix/name",
            parts.len() - 1
        ),
    };
    if name.is_empty() {
        bail!("name cannot be empty");
    }
    Ok((prefix.filter(|p| !p.is_empty()), name))
}

/// `validation.IsDNS1123Label`, KubeVirt's wording.
pub fn dns1123_label_errors(s: &str) -> Vec<&'static str> {
    let mut errs = Vec::new();
    if s.len() > 63 {
        errs.push("must be no more than 63 characters");
    }
    let ok_chars = s
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let alnum = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !ok_chars || !alnum(s.bytes().next()) || !alnum(s.bytes().last()) {
        errs.push(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or \
             '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or \
             '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')",
        );
    }
    errs
}

/// Builds the manifest; the warnings KubeVirt prints on stderr come back alongside it.
struct Builder {
    spec: VirtualMachineInstanceSpec,
    boot_orders: BTreeMap<u32, String>,
}

impl Builder {
    fn add_volume(
        &mut self,
        flag: &str,
        volume: Volume,
        boot_order: Option<u32>,
    ) -> anyhow::Result<()> {
        let name = volume.name.clone();
        if let Some(errs) = Some(dns1123_label_errors(&name)).filter(|e| !e.is_empty()) {
            return Err(flag_err(
                flag,
                format!("invalid name \"{name}\": {}", errs.join(",")),
            ));
        }
        if self.spec.volumes.iter().any(|v| v.name == name) {
            return Err(flag_err(
                flag,
                format!("there is already a volume with name \"{name}\""),
            ));
        }
        self.spec.volumes.push(volume);
        if let Some(order) = boot_order {
            if order == 0 {
                return Err(flag_err(flag, "bootorder must be greater than 0"));
            }
            if self.boot_orders.contains_key(&order) {
                return Err(flag_err(
                    flag,
                    format!("bootorder {order} was specified multiple times"),
                ));
            }
            self.spec.domain.devices.disks.push(Disk {
                name: name.clone(),
                boot_order: Some(order),
                ..Disk::default()
            });
            self.boot_orders.insert(order, name);
        }
        Ok(())
    }
}

/// cobra's `MarkFlagsMutuallyExclusive` groups of KubeVirt's command, checked as cobra does
/// before anything else, with its message.
fn refuse_exclusive(a: &CreateVmArgs) -> anyhow::Result<()> {
    let groups: [&[(&str, bool)]; 2] = [
        &[
            ("memory", a.memory.is_some()),
            ("instancetype", a.instancetype.is_some()),
            ("infer-instancetype", a.infer_instancetype.is_some()),
            (
                "infer-instancetype-from",
                a.infer_instancetype_from.is_some(),
            ),
        ],
        &[
            ("preference", a.preference.is_some()),
            ("infer-preference", a.infer_preference.is_some()),
            ("infer-preference-from", a.infer_preference_from.is_some()),
        ],
    ];
    for group in groups {
        let mut set: Vec<&str> = group.iter().filter(|(_, s)| *s).map(|(f, _)| *f).collect();
        if set.len() > 1 {
            set.sort_unstable();
            let names: Vec<&str> = group.iter().map(|(f, _)| *f).collect();
            bail!(
                "if any flags in the group [{}] are set none of the others can be; [{}] were all set",
                names.join(" "),
                set.join(" ")
            );
        }
    }
    Ok(())
}

/// KubeVirt's `withInstancetype` / `withPreference`: `[kind/]name`, the kind lower-cased and
/// left out when not given (the cluster kind is the default).
fn matcher(flag: &str, value: &str, kinds: [&str; 2]) -> anyhow::Result<Matcher> {
    let (kind, name) = split_prefixed_name(value).map_err(|e| flag_err(flag, e))?;
    let kind = kind.map(str::to_lowercase);
    if let Some(k) = kind.as_deref().filter(|k| !kinds.contains(k)) {
        return Err(flag_err(
            flag,
            format!(
                "invalid {flag} kind \"{k}\", supported values are: {}, {}",
                kinds[0], kinds[1]
            ),
        ));
    }
    Ok(Matcher {
        name: Some(name.to_owned()),
        kind,
        ..Matcher::default()
    })
}

fn refuse_unsupported(a: &CreateVmArgs) -> anyhow::Result<()> {
    const INFERENCE: &str = "inferring instance types and preferences from volumes";
    const DATA_VOLUMES: &str = "DataVolumes (CDI)";
    let set = [
        (
            "infer-instancetype",
            a.infer_instancetype == Some(true),
            INFERENCE,
        ),
        (
            "infer-instancetype-from",
            a.infer_instancetype_from.is_some(),
            INFERENCE,
        ),
        (
            "infer-preference",
            a.infer_preference == Some(true),
            INFERENCE,
        ),
        (
            "infer-preference-from",
            a.infer_preference_from.is_some(),
            INFERENCE,
        ),
        ("volume-import", !a.volume_import.is_empty(), DATA_VOLUMES),
        (
            "volume-datasource",
            !a.volume_datasource.is_empty(),
            DATA_VOLUMES,
        ),
        (
            "volume-clone-pvc",
            !a.volume_clone_pvc.is_empty(),
            DATA_VOLUMES,
        ),
        ("volume-blank", !a.volume_blank.is_empty(), DATA_VOLUMES),
        (
            "volume-sysprep",
            a.volume_sysprep.is_some(),
            "sysprep volumes",
        ),
        (
            "access-cred",
            !a.access_cred.is_empty(),
            "access credentials",
        ),
    ];
    match set.into_iter().find(|(_, given, _)| *given) {
        Some((flag, _, what)) => Err(unsupported(flag, what)),
        None => Ok(()),
    }
}

/// The VirtualMachine `create vm` prints, and the warnings it writes to stderr.
pub fn manifest(
    a: &CreateVmArgs,
    inputs: &Inputs,
) -> anyhow::Result<(VirtualMachine, Vec<String>)> {
    refuse_exclusive(a)?;
    refuse_unsupported(a)?;
    let instancetype = a
        .instancetype
        .as_deref()
        .map(|v| {
            matcher(
                "instancetype",
                v,
                [INSTANCETYPE_SINGULAR, CLUSTER_INSTANCETYPE_SINGULAR],
            )
        })
        .transpose()?;
    let preference = a
        .preference
        .as_deref()
        .map(|v| {
            matcher(
                "preference",
                v,
                [PREFERENCE_SINGULAR, CLUSTER_PREFERENCE_SINGULAR],
            )
        })
        .transpose()?;
    let name = a
        .name
        .clone()
        .unwrap_or_else(|| inputs.generated_name.clone());
    let memory = a.memory.as_deref().unwrap_or(DEFAULT_MEMORY);
    api::quantity::ParsedQuantity::parse(memory).map_err(|e| flag_err("memory", e))?;
    let Some(run_strategy) = RUN_STRATEGIES
        .iter()
        .find(|s| s.eq_ignore_ascii_case(&a.run_strategy))
    else {
        return Err(flag_err(
            "run-strategy",
            format!(
                "invalid run strategy \"{}\", supported values are: {}",
                a.run_strategy,
                RUN_STRATEGIES.join(", ")
            ),
        ));
    };

    let mut b = Builder {
        spec: VirtualMachineInstanceSpec {
            termination_grace_period_seconds: Some(a.termination_grace_period),
            domain: DomainSpec {
                // The instance type gives the memory.
                memory: instancetype.is_none().then(|| Memory {
                    guest: Some(Quantity(memory.to_owned())),
                    ..Memory::default()
                }),
                ..DomainSpec::default()
            },
            ..VirtualMachineInstanceSpec::default()
        },
        boot_orders: BTreeMap::new(),
    };

    // Containerdisks, then PVCs: KubeVirt's boot order when none is given.
    for (i, v) in a.volume_containerdisk.iter().enumerate() {
        const FLAG: &str = "volume-containerdisk";
        let p = volume_params(FLAG, v)?;
        let Some(image) = p.src else {
            return Err(flag_err(FLAG, "src must be specified"));
        };
        let vol_name = p
            .name
            .unwrap_or_else(|| format!("{name}-containerdisk-{i}"));
        let volume = Volume {
            name: vol_name,
            container_disk: Some(ContainerDiskSource {
                image,
                ..ContainerDiskSource::default()
            }),
            ..Volume::default()
        };
        b.add_volume(FLAG, volume, p.boot_order)?;
    }
    for v in &a.volume_pvc {
        const FLAG: &str = "volume-pvc";
        let p = volume_params(FLAG, v)?;
        let Some(src) = p.src else {
            return Err(flag_err(FLAG, "src must be specified"));
        };
        let (namespace, claim) =
            split_prefixed_name(&src).map_err(|e| flag_err(FLAG, format!("src invalid: {e}")))?;
        if namespace.is_some() {
            return Err(flag_err(
                FLAG,
                format!("not allowed to specify namespace of pvc \"{claim}\""),
            ));
        }
        let volume = Volume {
            name: p.name.unwrap_or_else(|| claim.to_owned()),
            persistent_volume_claim: Some(PersistentVolumeClaimSource {
                claim_name: claim.to_owned(),
                ..PersistentVolumeClaimSource::default()
            }),
            ..Volume::default()
        };
        b.add_volume(FLAG, volume, p.boot_order)?;
    }

    let mut warnings = Vec::new();
    if let Some(volume) = cloud_init_volume(a, inputs, &mut warnings)? {
        if b.spec.volumes.iter().any(|v| v.name == CLOUD_INIT_DISK) {
            bail!("there is already a volume with name \"{CLOUD_INIT_DISK}\"");
        }
        b.spec.volumes.push(volume);
    }

    let mut vm = VirtualMachine::new(
        &name,
        VirtualMachineSpec {
            run_strategy: Some(RunStrategy::from(*run_strategy)),
            instancetype,
            preference,
            ..VirtualMachineSpec::default()
        },
    );
    vm.metadata.namespace = inputs.namespace.clone().filter(|n| !n.is_empty());
    vm.spec.template.spec = Some(b.spec);
    Ok((vm, warnings))
}

/// KubeVirt's `cloudInitConfig`: a `cloudinitdisk` volume when any cloud-init flag is given,
/// unless it would carry nothing but the `#cloud-config` header.
fn cloud_init_volume(
    a: &CreateVmArgs,
    inputs: &Inputs,
    warnings: &mut Vec<String>,
) -> anyhow::Result<Option<Volume>> {
    let changed = a.user.is_some()
        || a.password_file.is_some()
        || !a.ssh_key.is_empty()
        || a.ga_manage_ssh.is_some()
        || a.cloud_init.is_some()
        || a.cloud_init_user_data.is_some()
        || a.cloud_init_network_data.is_some();
    if !changed {
        return Ok(None);
    }
    if a.password_file.is_some() {
        warnings.push(
            "WARNING: --password-file: The password is stored in cleartext in the VM definition!"
                .to_owned(),
        );
    }
    let kind = a.cloud_init.as_deref().unwrap_or("nocloud").to_lowercase();
    let config_drive = match kind.as_str() {
        "nocloud" => false,
        "configdrive" => true,
        "none" => {
            if a.password_file.is_some()
                || !a.ssh_key.is_empty()
                || a.ga_manage_ssh.is_some()
                || a.cloud_init_user_data.is_some()
                || a.cloud_init_network_data.is_some()
            {
                warnings.push(
                    "WARNING: --cloud-init: was set to none, not creating a data source \
                     although other cloud-init options were set"
                        .to_owned(),
                );
            }
            return Ok(None);
        }
        _ => {
            return Err(flag_err(
                "cloud-init",
                format!(
                    "invalid cloud-init data source type \"{}\", supported values are: nocloud, \
                     configdrive, none",
                    a.cloud_init.as_deref().unwrap_or_default()
                ),
            ));
        }
    };
    let mut src = CloudInitNoCloudSource {
        network_data_base64: a.cloud_init_network_data.clone().filter(|d| !d.is_empty()),
        ..CloudInitNoCloudSource::default()
    };
    match a.cloud_init_user_data.as_deref().filter(|d| !d.is_empty()) {
        Some(data) => src.user_data_base64 = Some(data.to_owned()),
        None => src.user_data = Some(cloud_config(a, inputs.password.as_deref())),
    }
    let empty =
        src.user_data.as_deref() == Some(CLOUD_CONFIG_HEADER) && src.network_data_base64.is_none();
    if a.cloud_init.is_none() && empty {
        return Ok(None);
    }
    let mut volume = Volume {
        name: CLOUD_INIT_DISK.to_owned(),
        ..Volume::default()
    };
    if config_drive {
        volume.cloud_init_config_drive = Some(src);
    } else {
        volume.cloud_init_no_cloud = Some(src);
    }
    Ok(Some(volume))
}

/// KubeVirt's `buildCloudInitConfig`.
pub fn cloud_config(a: &CreateVmArgs, password: Option<&str>) -> String {
    let mut config = CLOUD_CONFIG_HEADER.to_owned();
    if let Some(user) = a.user.as_deref().filter(|u| !u.is_empty()) {
        config.push_str("\nuser: ");
        config.push_str(user);
    }
    if let Some(password) = password.map(str::trim).filter(|p| !p.is_empty()) {
        config.push_str("\npassword: ");
        config.push_str(password);
        config.push_str("\nchpasswd: { expire: False }");
    }
    if !a.ssh_key.is_empty() {
        config.push_str("\nssh_authorized_keys:");
        for key in &a.ssh_key {
            config.push_str("\n  - ");
            config.push_str(key);
        }
    }
    if a.ga_manage_ssh == Some(true) {
        config.push_str("\nruncmd:\n  - [ setsebool, -P, 'virt_qemu_ga_manage_ssh', 'on' ]");
    }
    config
}

/// `vm-` and five characters of `rand.String`'s alphabet, as KubeVirt names an unnamed VM.
pub fn generated_name(random: [u8; 5]) -> String {
    let suffix: String = random
        .iter()
        .map(|b| char::from(RAND_ALPHABET[usize::from(*b) % RAND_ALPHABET.len()]))
        .collect();
    format!("vm-{suffix}")
}

pub fn to_yaml(vm: &VirtualMachine) -> anyhow::Result<String> {
    let options = serde_saphyr::ser_options! { folded_wrap_chars: usize::MAX };
    Ok(serde_saphyr::to_string_with_options(vm, options)?)
}

/// `create vm`: reads `--password-file` and the random source, prints the manifest.
pub fn run(a: &CreateVmArgs, namespace: Option<&str>) -> anyhow::Result<()> {
    use std::io::Read as _;
    let mut random = [0u8; 5];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut random))
        .map_err(|e| anyhow::anyhow!("cannot read /dev/urandom: {e}"))?;
    // Flag errors come before the password file is read, as in KubeVirt's order.
    refuse_unsupported(a)?;
    let password = match &a.password_file {
        Some(path) => {
            Some(std::fs::read_to_string(path).map_err(|e| flag_err("password-file", e))?)
        }
        None => None,
    };
    let inputs = Inputs {
        generated_name: generated_name(random),
        namespace: namespace.map(str::to_owned),
        password,
    };
    let (vm, warnings) = manifest(a, &inputs)?;
    for w in warnings {
        eprintln!("{w}");
    }
    print!("{}", to_yaml(&vm)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::{ClusterConfig, defaults, validation};

    fn args(flags: &[&str]) -> CreateVmArgs {
        #[derive(Debug, clap::Parser)]
        struct P {
            #[command(flatten)]
            a: CreateVmArgs,
        }
        use clap::Parser as _;
        P::try_parse_from(std::iter::once("vm").chain(flags.iter().copied()))
            .unwrap()
            .a
    }

    fn inputs() -> Inputs {
        Inputs {
            generated_name: "vm-abcde".into(),
            ..Inputs::default()
        }
    }

    /// The printed manifest, parsed back, defaulted and validated as virt-api would.
    fn round_trip(flags: &[&str]) -> VirtualMachine {
        let (vm, _) = manifest(&args(flags), &inputs()).unwrap();
        let yaml = to_yaml(&vm).unwrap();
        let mut back: VirtualMachine = serde_saphyr::from_str(&yaml).unwrap();
        assert_eq!(back, vm, "{yaml}");
        let cfg = ClusterConfig::default();
        defaults::apply_vm(&mut back, &cfg);
        defaults::apply(back.spec.template.spec.as_mut().unwrap(), &cfg).unwrap();
        let errors = validation::validate_vm(&back, &cfg);
        assert!(errors.is_empty(), "{flags:?}: {errors:?}\n{yaml}");
        vm
    }

    fn template(vm: &VirtualMachine) -> &VirtualMachineInstanceSpec {
        vm.spec.template.spec.as_ref().unwrap()
    }

    #[test]
    fn defaults_are_kubevirts() {
        let vm = round_trip(&[]);
        assert_eq!(vm.metadata.name.as_deref(), Some("vm-abcde"));
        assert_eq!(vm.metadata.namespace, None);
        assert_eq!(vm.spec.run_strategy, Some(RunStrategy::Always));
        let t = template(&vm);
        assert_eq!(t.termination_grace_period_seconds, Some(180));
        assert_eq!(
            t.domain.memory.as_ref().unwrap().guest,
            Some(Quantity("512Mi".into()))
        );
        assert!(t.volumes.is_empty());
        let yaml = to_yaml(&vm).unwrap();
        assert!(
            yaml.starts_with("apiVersion: kubevirt.io/v1\nkind: VirtualMachine\n"),
            "{yaml}"
        );
    }

    #[test]
    fn name_namespace_strategy_memory() {
        let (vm, _) = manifest(
            &args(&[
                "--name",
                "my-vm",
                "--run-strategy",
                "rerunonfailure",
                "--memory",
                "1Gi",
                "--termination-grace-period",
                "0",
            ]),
            &Inputs {
                namespace: Some("team".into()),
                ..inputs()
            },
        )
        .unwrap();
        assert_eq!(vm.metadata.name.as_deref(), Some("my-vm"));
        assert_eq!(vm.metadata.namespace.as_deref(), Some("team"));
        assert_eq!(vm.spec.run_strategy, Some(RunStrategy::RerunOnFailure));
        let t = template(&vm);
        assert_eq!(t.termination_grace_period_seconds, Some(0));
        assert_eq!(
            t.domain.memory.as_ref().unwrap().guest,
            Some(Quantity("1Gi".into()))
        );
        round_trip(&["--run-strategy", "Halted", "--memory", "2G"]);
    }

    #[test]
    fn volumes_in_kubevirts_order() {
        let vm = round_trip(&[
            "--volume-pvc",
            "src:data,bootorder:2",
            "--volume-containerdisk",
            "src:quay.io/containerdisks/fedora:41",
            "--volume-containerdisk",
            "name:second,src:img:1,bootorder:1",
            "--volume-pvc",
            "name:other,src:claim",
        ]);
        let t = template(&vm);
        let names: Vec<&str> = t.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            ["vm-abcde-containerdisk-0", "second", "data", "other"]
        );
        assert_eq!(
            t.volumes[0].container_disk.as_ref().unwrap().image,
            "quay.io/containerdisks/fedora:41"
        );
        assert_eq!(
            t.volumes[3]
                .persistent_volume_claim
                .as_ref()
                .unwrap()
                .claim_name,
            "claim"
        );
        let disks: Vec<(&str, Option<u32>)> = t
            .domain
            .devices
            .disks
            .iter()
            .map(|d| (d.name.as_str(), d.boot_order))
            .collect();
        assert_eq!(disks, [("second", Some(1)), ("data", Some(2))]);
    }

    #[test]
    fn flag_errors_are_kubevirts() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--run-strategy", "sometimes"],
                "failed to parse \"--run-strategy\" flag: invalid run strategy \"sometimes\", supported values are: Always, Manual, Halted, Once, RerunOnFailure",
            ),
            (
                &["--volume-containerdisk", "name:x"],
                "failed to parse \"--volume-containerdisk\" flag: src must be specified",
            ),
            (
                &["--volume-containerdisk", "src:a,size:1Gi"],
                "failed to parse \"--volume-containerdisk\" flag: unknown param(s): size:1Gi",
            ),
            (
                &["--volume-containerdisk", "image"],
                "failed to parse \"--volume-containerdisk\" flag: params need to have at least one colon: image",
            ),
            (
                &["--volume-containerdisk", "src:a,name:Bad_Name"],
                "failed to parse \"--volume-containerdisk\" flag: invalid name \"Bad_Name\": a lowercase RFC 1123 label",
            ),
            (
                &[
                    "--volume-containerdisk",
                    "src:a,name:d",
                    "--volume-pvc",
                    "src:d",
                ],
                "failed to parse \"--volume-pvc\" flag: there is already a volume with name \"d\"",
            ),
            (
                &["--volume-pvc", "src:ns/claim"],
                "failed to parse \"--volume-pvc\" flag: not allowed to specify namespace of pvc \"claim\"",
            ),
            (
                &["--volume-pvc", "src:a/b/c"],
                "failed to parse \"--volume-pvc\" flag: src invalid: invalid count 2 of slashes in prefix/name",
            ),
            (
                &["--volume-pvc", "src:a,bootorder:0"],
                "failed to parse \"--volume-pvc\" flag: bootorder must be greater than 0",
            ),
            (
                &[
                    "--volume-pvc",
                    "src:a,bootorder:1",
                    "--volume-containerdisk",
                    "src:i,bootorder:1",
                ],
                "failed to parse \"--volume-pvc\" flag: bootorder 1 was specified multiple times",
            ),
            (
                &["--volume-pvc", "src:a,bootorder:x"],
                "failed to parse \"--volume-pvc\" flag: failed to parse param \"bootorder\"",
            ),
            (
                &["--volume-pvc", "src:cloudinitdisk", "--user", "u"],
                "there is already a volume with name \"cloudinitdisk\"",
            ),
            (&["--memory", "lots"], "failed to parse \"--memory\" flag:"),
            (
                &["--cloud-init", "ignition"],
                "failed to parse \"--cloud-init\" flag: invalid cloud-init data source type \"ignition\", supported values are: nocloud, configdrive, none",
            ),
            (
                &["--infer-instancetype"],
                "failed to parse \"--infer-instancetype\" flag: not supported by kubevirt-rs: inferring instance types and preferences from volumes",
            ),
            (
                &["--infer-preference-from", "disk"],
                "failed to parse \"--infer-preference-from\" flag: not supported by kubevirt-rs: inferring instance types and preferences from volumes",
            ),
            (
                &["--instancetype", "u1.small", "--memory", "1Gi"],
                "if any flags in the group [memory instancetype infer-instancetype infer-instancetype-from] are set none of the others can be; [instancetype memory] were all set",
            ),
            (
                &["--preference", "fedora", "--infer-preference=false"],
                "if any flags in the group [preference infer-preference infer-preference-from] are set none of the others can be; [infer-preference preference] were all set",
            ),
            (
                &["--instancetype", "virtualmachinepreference/u1.small"],
                "failed to parse \"--instancetype\" flag: invalid instancetype kind \"virtualmachinepreference\", supported values are: virtualmachineinstancetype, virtualmachineclusterinstancetype",
            ),
            (
                &["--preference", "Pods/fedora"],
                "failed to parse \"--preference\" flag: invalid preference kind \"pods\", supported values are: virtualmachinepreference, virtualmachineclusterpreference",
            ),
            (
                &["--instancetype", "a/b/c"],
                "failed to parse \"--instancetype\" flag: invalid count 2 of slashes in prefix/name",
            ),
            (
                &["--preference", "kind/"],
                "failed to parse \"--preference\" flag: name cannot be empty",
            ),
            (
                &["--volume-import", "type:blank,size:1Gi"],
                "failed to parse \"--volume-import\" flag: not supported by kubevirt-rs: DataVolumes (CDI)",
            ),
            (
                &["--volume-sysprep", "src:cm"],
                "failed to parse \"--volume-sysprep\" flag: not supported by kubevirt-rs: sysprep volumes",
            ),
            (
                &["--access-cred", "src:keys"],
                "failed to parse \"--access-cred\" flag: not supported by kubevirt-rs: access credentials",
            ),
        ];
        for (flags, want) in cases {
            let err = manifest(&args(flags), &inputs()).unwrap_err().to_string();
            assert!(err.starts_with(want), "{flags:?}: {err}");
        }
        // Inference switched off explicitly is what kubevirt-rs does anyway.
        round_trip(&["--infer-instancetype=false", "--infer-preference=false"]);
    }

    #[test]
    fn instancetype_and_preference() {
        let (vm, _) = manifest(
            &args(&[
                "--instancetype",
                "u1.medium",
                "--preference",
                "VirtualMachinePreference/fedora",
                "--volume-containerdisk",
                "src:img",
            ]),
            &inputs(),
        )
        .unwrap();
        assert_eq!(
            vm.spec.instancetype,
            Some(Matcher {
                name: Some("u1.medium".into()),
                ..Matcher::default()
            })
        );
        assert_eq!(
            vm.spec.preference,
            Some(Matcher {
                name: Some("fedora".into()),
                kind: Some("virtualmachinepreference".into()),
                ..Matcher::default()
            })
        );
        // The instance type gives the memory: none is written, not even the default.
        assert_eq!(template(&vm).domain.memory, None);
        let yaml = to_yaml(&vm).unwrap();
        assert!(
            yaml.contains("instancetype:\n    name: u1.medium\n"),
            "{yaml}"
        );
        assert!(!yaml.contains("memory"), "{yaml}");

        let (vm, _) = manifest(
            &args(&["--instancetype", "virtualmachineinstancetype/small"]),
            &inputs(),
        )
        .unwrap();
        assert_eq!(
            vm.spec.instancetype.unwrap().kind.as_deref(),
            Some("virtualmachineinstancetype")
        );
        // A preference alone leaves the memory flag's default in place.
        let (vm, _) = manifest(&args(&["--preference", "fedora"]), &inputs()).unwrap();
        assert_eq!(
            template(&vm).domain.memory.as_ref().unwrap().guest,
            Some(Quantity(DEFAULT_MEMORY.into()))
        );
    }

    #[test]
    fn cloud_init_from_user_and_keys() {
        let vm = round_trip(&[
            "--user",
            "cloud-user",
            "--ssh-key",
            "ssh-ed25519 AAAA1 a@b,ssh-ed25519 AAAA2",
            "--ssh-key",
            "ssh-rsa AAAA3",
            "--ga-manage-ssh",
        ]);
        let vol = template(&vm).volumes.last().unwrap();
        assert_eq!(vol.name, "cloudinitdisk");
        assert_eq!(
            vol.cloud_init_no_cloud
                .as_ref()
                .unwrap()
                .user_data
                .as_deref(),
            Some(
                "#cloud-config\nuser: cloud-user\nssh_authorized_keys:\n  - ssh-ed25519 AAAA1 a@b\n  - ssh-ed25519 AAAA2\n  - ssh-rsa AAAA3\nruncmd:\n  - [ setsebool, -P, 'virt_qemu_ga_manage_ssh', 'on' ]"
            )
        );
    }

    #[test]
    fn cloud_init_sources() {
        // Base64 user and network data, config drive.
        let vm = round_trip(&[
            "--volume-containerdisk",
            "src:img",
            "--cloud-init",
            "ConfigDrive",
            "--cloud-init-user-data",
            "I2Nsb3VkLWNvbmZpZw==",
            "--cloud-init-network-data",
            "bmV0d29yazoge30=",
        ]);
        let vol = &template(&vm).volumes[1];
        assert!(vol.cloud_init_no_cloud.is_none());
        let src = vol.cloud_init_config_drive.as_ref().unwrap();
        assert_eq!(
            src.user_data_base64.as_deref(),
            Some("I2Nsb3VkLWNvbmZpZw==")
        );
        assert_eq!(src.network_data_base64.as_deref(), Some("bmV0d29yazoge30="));
        assert_eq!(src.user_data, None);

        // Only the header: no volume, unless --cloud-init asked for one.
        let (vm, _) = manifest(&args(&["--ga-manage-ssh=false"]), &inputs()).unwrap();
        assert!(template(&vm).volumes.is_empty());
        let vm = round_trip(&["--cloud-init", "nocloud"]);
        assert_eq!(
            template(&vm).volumes[0]
                .cloud_init_no_cloud
                .as_ref()
                .unwrap()
                .user_data
                .as_deref(),
            Some("#cloud-config")
        );

        // none: no volume, a warning when other cloud-init flags were given.
        let (vm, warnings) = manifest(
            &args(&["--cloud-init", "none", "--ssh-key", "k"]),
            &inputs(),
        )
        .unwrap();
        assert!(template(&vm).volumes.is_empty());
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].starts_with("WARNING: --cloud-init: was set to none"));

        // A password file: in the config, with KubeVirt's warning.
        let (vm, warnings) = manifest(
            &args(&["--user", "u", "--password-file", "/p"]),
            &Inputs {
                password: Some("secret\n".into()),
                ..inputs()
            },
        )
        .unwrap();
        assert_eq!(
            template(&vm).volumes[0]
                .cloud_init_no_cloud
                .as_ref()
                .unwrap()
                .user_data
                .as_deref(),
            Some("#cloud-config\nuser: u\npassword: secret\nchpasswd: { expire: False }")
        );
        assert_eq!(
            warnings,
            ["WARNING: --password-file: The password is stored in cleartext in the VM definition!"]
        );
    }

    #[test]
    fn user_data_excludes_generated_config() {
        #[derive(Debug, clap::Parser)]
        struct P {
            #[command(flatten)]
            a: CreateVmArgs,
        }
        use clap::Parser as _;
        for flag in [
            &["--user", "u"][..],
            &["--ssh-key", "k"],
            &["--ga-manage-ssh"],
        ] {
            let argv = ["vm", "--cloud-init-user-data", "eA=="]
                .into_iter()
                .chain(flag.iter().copied());
            assert!(P::try_parse_from(argv).is_err(), "{flag:?}");
        }
    }

    #[test]
    fn generated_names() {
        assert_eq!(generated_name([0, 1, 2, 26, 27]), "vm-bcd9b");
        for b in 0..=255u8 {
            let name = generated_name([b; 5]);
            assert!(dns1123_label_errors(&name).is_empty(), "{name}");
        }
    }

    #[test]
    fn dns_labels() {
        assert!(dns1123_label_errors("a-1").is_empty());
        for bad in ["", "-a", "a-", "A", "a_b", &"a".repeat(64)] {
            assert!(!dns1123_label_errors(bad).is_empty(), "{bad}");
        }
    }
}
