//! The VirtualMachineInstance actions: `pause`, `unpause`, `freeze`, `unfreeze`, `soft-reboot`,
//! and the guest-agent reads `guestosinfo`, `userlist`, `fslist`.

use std::time::Duration;

use anyhow::bail;
use api::subresources::{FreezeUnfreezeTimeout, PauseOptions, VmiSubresource, vmi_path};
use api::vm::RunStrategy;

use crate::client::Cluster;
use crate::error::RequestError;
use crate::vm::dry_run;

/// The two kinds `pause` and `unpause` take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Vm,
    Vmi,
}

/// KubeVirt's spellings, case-insensitive.
pub fn parse_kind(s: &str) -> anyhow::Result<Kind> {
    match s.to_ascii_lowercase().as_str() {
        "vm" | "vms" | "virtualmachine" | "virtualmachines" => Ok(Kind::Vm),
        "vmi" | "vmis" | "virtualmachineinstance" | "virtualmachineinstances" => Ok(Kind::Vmi),
        _ => bail!(
            "unsupported resource type {s:?}: use vm (virtualmachine) or vmi (virtualmachineinstance)"
        ),
    }
}

pub fn scheduled(name: &str, action: &str) -> String {
    format!("VMI {name} was scheduled to {action}")
}

/// Why pausing a VM's instance found none: the VM is not meant to run, or its VMI is gone.
pub fn pause_not_found(vm: &str, strategy: &RunStrategy) -> String {
    if *strategy == RunStrategy::Halted {
        format!("Error pausing VirtualMachineInstance {vm}. VirtualMachine {vm} is not set to run")
    } else {
        format!("Error pausing VirtualMachineInstance {vm}, it was not found")
    }
}

async fn get_vm(cluster: &Cluster, name: &str) -> anyhow::Result<api::VirtualMachine> {
    let vms: kube::Api<api::VirtualMachine> =
        kube::Api::namespaced(cluster.client.clone(), &cluster.namespace);
    vms.get(name).await.map_err(|e| {
        anyhow::anyhow!(
            "Error getting VirtualMachine {name}: {}",
            RequestError::from(e)
        )
    })
}

async fn put_vmi<B: serde::Serialize>(
    cluster: &Cluster,
    name: &str,
    sub: VmiSubresource,
    body: Option<&B>,
) -> Result<Vec<u8>, RequestError> {
    cluster
        .put(&vmi_path(&cluster.namespace, name, sub), body)
        .await
}

pub async fn pause(cluster: &Cluster, kind: Kind, name: &str, dry: bool) -> anyhow::Result<()> {
    let opts = PauseOptions {
        dry_run: dry_run(dry),
    };
    // A VM's instance carries the VM's name, which is what KubeVirt pauses.
    let vm = match kind {
        Kind::Vm => Some(get_vm(cluster, name).await?),
        Kind::Vmi => None,
    };
    if let Err(e) = put_vmi(cluster, name, VmiSubresource::Pause, Some(&opts)).await {
        if let (Some(vm), true) = (&vm, e.is_not_found()) {
            bail!(
                "{}",
                pause_not_found(name, &vm.spec.effective_run_strategy())
            );
        }
        bail!("Error pausing VirtualMachineInstance {name}: {e}");
    }
    println!("{}", scheduled(name, "pause"));
    Ok(())
}

pub async fn unpause(cluster: &Cluster, kind: Kind, name: &str, dry: bool) -> anyhow::Result<()> {
    let opts = PauseOptions {
        dry_run: dry_run(dry),
    };
    if kind == Kind::Vm {
        get_vm(cluster, name).await?;
    }
    put_vmi(cluster, name, VmiSubresource::Unpause, Some(&opts))
        .await
        .map_err(|e| anyhow::anyhow!("Error unpausing VirtualMachineInstance {name}: {e}"))?;
    println!("{}", scheduled(name, "unpause"));
    Ok(())
}

pub async fn freeze(
    cluster: &Cluster,
    name: &str,
    unfreeze_timeout: Duration,
) -> anyhow::Result<()> {
    let body = FreezeUnfreezeTimeout {
        unfreeze_timeout: Some(go_duration(unfreeze_timeout)),
    };
    put_vmi(cluster, name, VmiSubresource::Freeze, Some(&body))
        .await
        .map_err(|e| anyhow::anyhow!("Error freezing VirtualMachineInstance {name}: {e}"))?;
    println!("{}", scheduled(name, "freeze"));
    Ok(())
}

pub async fn unfreeze(cluster: &Cluster, name: &str) -> anyhow::Result<()> {
    put_vmi::<()>(cluster, name, VmiSubresource::Unfreeze, None)
        .await
        .map_err(|e| anyhow::anyhow!("Error unfreezing VirtualMachineInstance {name}: {e}"))?;
    println!("{}", scheduled(name, "unfreeze"));
    Ok(())
}

pub async fn soft_reboot(cluster: &Cluster, name: &str) -> anyhow::Result<()> {
    put_vmi::<()>(cluster, name, VmiSubresource::SoftReboot, None)
        .await
        .map_err(|e| anyhow::anyhow!("Error soft rebooting VirtualMachineInstance {name}: {e}"))?;
    println!("{}", scheduled(name, "soft-reboot"));
    Ok(())
}

/// A guest-agent read: which subresource, and how KubeVirt words its failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestRead {
    OsInfo,
    Users,
    Filesystems,
}

impl GuestRead {
    fn subresource(self) -> VmiSubresource {
        match self {
            GuestRead::OsInfo => VmiSubresource::GuestOsInfo,
            GuestRead::Users => VmiSubresource::UserList,
            GuestRead::Filesystems => VmiSubresource::FilesystemList,
        }
    }

    fn failure(self, name: &str) -> String {
        match self {
            GuestRead::OsInfo => {
                format!("Error getting guestosinfo of VirtualMachineInstance {name}")
            }
            GuestRead::Users => format!("Error listing users of VirtualMachineInstance {name}"),
            GuestRead::Filesystems => {
                format!("Error listing filesystems of VirtualMachineInstance {name}")
            }
        }
    }
}

pub async fn guest_read(cluster: &Cluster, what: GuestRead, name: &str) -> anyhow::Result<()> {
    let body = cluster
        .get(&vmi_path(&cluster.namespace, name, what.subresource()))
        .await
        .map_err(|e| anyhow::anyhow!("{}, {e}", what.failure(name)))?;
    let text = indent_json(&body)
        .map_err(|e| anyhow::anyhow!("{}, the answer is not JSON: {e}", what.failure(name)))?;
    println!("{text}");
    Ok(())
}

/// Re-indents JSON as Go's `json.MarshalIndent(v, "", "  ")` writes it, keeping the server's
/// key order (which is KubeVirt's struct order) rather than sorting it.
pub fn indent_json(raw: &[u8]) -> Result<String, serde_json::Error> {
    serde_json::from_slice::<serde::de::IgnoredAny>(raw)?;
    let text = String::from_utf8_lossy(raw);
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut chars = text.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(char::is_ascii_whitespace) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}' | ']')) {
                    out.extend(chars.next());
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
    }
    Ok(out)
}

/// A duration as Go's `time.Duration.String()` writes it (`5m0s`, `1h0m0s`, `1.5s`, `500ms`),
/// the form a `metav1.Duration` has on the wire.
pub fn go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000_000_000 {
        let (scale, unit) = match nanos {
            n if n < 1_000 => (1, "ns"),
            n if n < 1_000_000 => (1_000, "µs"),
            _ => (1_000_000, "ms"),
        };
        return format!("{}{unit}", decimal(nanos, scale));
    }
    let secs = nanos / 1_000_000_000;
    let seconds = decimal(nanos % 60_000_000_000, 1_000_000_000);
    let (h, m) = (secs / 3600, secs % 3600 / 60);
    match (h, m) {
        (0, 0) => format!("{seconds}s"),
        (0, m) => format!("{m}m{seconds}s"),
        (h, m) => format!("{h}h{m}m{seconds}s"),
    }
}

/// `value / scale` with the fraction's trailing zeros dropped.
fn decimal(value: u128, scale: u128) -> String {
    let whole = value / scale;
    let frac = value % scale;
    if frac == 0 {
        return whole.to_string();
    }
    let width = scale.ilog10() as usize;
    let digits = format!("{frac:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        for s in ["vm", "VM", "virtualmachine", "VirtualMachines", "vms"] {
            assert_eq!(parse_kind(s).unwrap(), Kind::Vm, "{s}");
        }
        for s in ["vmi", "VMI", "virtualmachineinstance", "vmis"] {
            assert_eq!(parse_kind(s).unwrap(), Kind::Vmi, "{s}");
        }
        assert!(parse_kind("pod").is_err());
    }

    #[test]
    fn not_found_wording() {
        assert_eq!(
            pause_not_found("demo", &RunStrategy::Halted),
            "Error pausing VirtualMachineInstance demo. VirtualMachine demo is not set to run"
        );
        assert_eq!(
            pause_not_found("demo", &RunStrategy::Always),
            "Error pausing VirtualMachineInstance demo, it was not found"
        );
    }

    #[test]
    fn go_durations() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_mins(5), "5m0s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_hours(1), "1h0m0s"),
            (Duration::from_mins(90), "1h30m0s"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_millis(61_250), "1m1.25s"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_micros(1500), "1.5ms"),
            (Duration::from_nanos(1500), "1.5µs"),
            (Duration::from_nanos(7), "7ns"),
        ];
        for (d, want) in cases {
            assert_eq!(go_duration(d), want, "{d:?}");
        }
    }

    #[test]
    fn json_indents_like_go() {
        let cases: [(&str, &str); 5] = [
            ("{}", "{}"),
            ("[ ]", "[]"),
            (
                r#"{"guestAgentVersion":"5.2.0","os":{"name":"Debian","id":"debian"},"fsInfo":{}}"#,
                "{\n  \"guestAgentVersion\": \"5.2.0\",\n  \"os\": {\n    \"name\": \"Debian\",\n    \"id\": \"debian\"\n  },\n  \"fsInfo\": {}\n}",
            ),
            (
                r#"{"items":[{"userName":"root","loginTime":1.7e9}]}"#,
                "{\n  \"items\": [\n    {\n      \"userName\": \"root\",\n      \"loginTime\": 1.7e9\n    }\n  ]\n}",
            ),
            (
                r#"{"s":"a, {b}: \"c\""}"#,
                "{\n  \"s\": \"a, {b}: \\\"c\\\"\"\n}",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(indent_json(input.as_bytes()).unwrap(), want, "{input}");
        }
        assert!(indent_json(b"not json").is_err());
    }

    #[test]
    fn scheduled_lines() {
        assert_eq!(
            scheduled("demo", "pause"),
            "VMI demo was scheduled to pause"
        );
    }
}
