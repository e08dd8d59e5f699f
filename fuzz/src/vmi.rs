//! VirtualMachineInstances from fuzz input, structure-aware.
//!
//! An input that starts with `{` is taken as a VMI's JSON as it is (the seed corpus holds the
//! example manifests, and libFuzzer's dictionary the schema's field names, so mutations stay
//! close to real objects). Any other input drives a generator that walks the VMI CRD's
//! OpenAPI schema (the one `crdgen` installs): objects get real field names, enums real values,
//! strings mostly values KubeVirt users write and names that refer to each other (a disk and
//! its volume), sometimes odd ones (commas, `help`, NUL, long), and now and then a value of the
//! wrong type. Most generated objects therefore deserialize and reach defaults, validation and
//! the launcher's converter, rather than dying in serde.

use std::sync::OnceLock;

use api::VirtualMachineInstance;
use arbitrary::{Result, Unstructured};
use serde_json::{Map, Value, json};

/// How deep the generator follows the schema. The VMI spec's interesting fields sit within
/// seven levels (`spec.domain.devices.disks[].disk.bus`); deeper ones are reached from the
/// JSON seeds.
const MAX_DEPTH: usize = 9;

/// Names that disks, volumes, interfaces and networks share, so references resolve.
const NAMES: &[&str] = &[
    "default",
    "containerdisk",
    "cloudinit",
    "disk0",
    "data",
    "a",
];

/// Values users write into VMI string fields, and a few that QEMU or a parser would choke on.
const STRINGS: &[&str] = &[
    "virtio",
    "sata",
    "scsi",
    "usb",
    "q35",
    "pc",
    "pc-q35-7.2",
    "host-model",
    "host-passthrough",
    "Skylake-Client",
    "help",
    "?",
    "e1000",
    "e1000e",
    "rtl8139",
    "masquerade",
    "bridge",
    "pod",
    "tablet",
    "Always",
    "IfNotPresent",
    "None",
    "LiveMigrate",
    "reset",
    "shutdown",
    "poweroff",
    "ReadWriteOnce",
    "Filesystem",
    "Block",
    "kubevirt-rs/test-guest-disk:latest",
    "registry:5000/a/b@sha256:0123",
    "/vmlinuz",
    "/initrd.img",
    "console=ttyS0",
    "#cloud-config",
    "10.0.2.0/24",
    "fd10:0:2::/120",
    "52:54:00:12:34:56",
    "none",
    "writethrough",
    "native",
    "threads",
    "1",
    "0",
    "true",
    "5ef7e5b4-0c9b-4b6c-9a4d-f9d2a2e0c9b1",
    "a,b",
    "a,,b",
    "x,driver=file",
    "=",
    "",
    " ",
    "\u{0}",
    "é",
    "kubevirt.io/v1",
    "amd64",
    "arm64",
];

/// Quantities, for the fields the schema marks int-or-string.
const QUANTITIES: &[&str] = &[
    "64Mi",
    "128Mi",
    "512Mi",
    "1Gi",
    "2Gi",
    "16Ei",
    "1",
    "2",
    "100m",
    "0",
    "-1Gi",
    "1e3",
    "1.5Gi",
    "0.5",
    "18446744073709551616Ki",
    "1Ki",
    "Gi",
    "",
    "abc",
];

const INTEGERS: &[i64] = &[
    0,
    1,
    2,
    3,
    4,
    8,
    16,
    255,
    256,
    1024,
    65535,
    -1,
    i64::MAX,
    i64::MIN,
];

/// The VMI's schema as JSON, built once.
fn schema() -> &'static Value {
    static SCHEMA: OnceLock<Value> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        let crd = api::crds::crds()
            .into_iter()
            .find(|c| c.spec.names.kind == "VirtualMachineInstance")
            .expect("the VMI CRD");
        let crd = serde_json::to_value(crd).expect("a CRD serializes");
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
    })
}

/// The VMI this input stands for, if it deserializes into one.
pub fn from_input(data: &[u8]) -> Option<VirtualMachineInstance> {
    if data.first() == Some(&b'{') {
        return serde_json::from_slice(data).ok();
    }
    let value = generate(&mut Unstructured::new(data)).ok()?;
    serde_json::from_value(value).ok()
}

/// A VMI-shaped JSON object drawn from `u`.
fn generate(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut vmi = value(u, schema(), "", 0)?;
    if let Value::Object(map) = &mut vmi {
        map.insert("apiVersion".into(), json!("kubevirt.io/v1"));
        map.insert("kind".into(), json!("VirtualMachineInstance"));
        map.insert("metadata".into(), metadata(u)?);
    }
    Ok(vmi)
}

/// The CRD's schema leaves `metadata` opaque; the launcher needs a uid, mostly a UUID.
fn metadata(u: &mut Unstructured<'_>) -> Result<Value> {
    let uid = if u.ratio(7, 8)? {
        uuid::Uuid::from_bytes(u.arbitrary()?).to_string()
    } else {
        string(u, "uid")?
    };
    Ok(json!({
        "name": *u.choose(&["testvmi", "a", "vmi-with-a-long-name-0123456789-0123456789-01234"])?,
        "namespace": *u.choose(&["default", "kubevirt-test", "ns"])?,
        "uid": uid,
    }))
}

/// Whether to fill in an optional field. Never once the input is used up: `Unstructured`
/// answers `true` to every ratio then, which would fill in the whole schema.
fn chance(u: &mut Unstructured<'_>) -> Result<bool> {
    Ok(!u.is_empty() && u.ratio(1, 3)?)
}

fn value(u: &mut Unstructured<'_>, s: &Value, key: &str, depth: usize) -> Result<Value> {
    if !u.is_empty() && u.ratio(1, 64)? {
        return scalar(u);
    }
    if let Some(Value::Array(options)) = s.get("enum")
        && !options.is_empty()
        && u.ratio(7, 8)?
    {
        return Ok(u.choose(options)?.clone());
    }
    if s.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        return if u.ratio(3, 4)? {
            Ok(json!(*u.choose(QUANTITIES)?))
        } else {
            Ok(json!(*u.choose(INTEGERS)?))
        };
    }
    match s.get("type").and_then(Value::as_str) {
        Some("object") => object(u, s, depth),
        Some("array") => {
            let mut items = Vec::new();
            if depth < MAX_DEPTH {
                let item = s.get("items").unwrap_or(&Value::Null);
                for _ in 0..u.int_in_range(0..=3)? {
                    items.push(value(u, item, key, depth + 1)?);
                }
            }
            Ok(Value::Array(items))
        }
        Some("string") => Ok(Value::String(string(u, key)?)),
        Some("integer") => Ok(if u.ratio(3, 4)? {
            json!(*u.choose(INTEGERS)?)
        } else {
            json!(u.arbitrary::<i64>()?)
        }),
        Some("number") => Ok(json!(f64::from(u.arbitrary::<i32>()?) / 8.0)),
        Some("boolean") => Ok(Value::Bool(u.arbitrary()?)),
        _ => scalar(u),
    }
}

fn object(u: &mut Unstructured<'_>, s: &Value, depth: usize) -> Result<Value> {
    let mut map = Map::new();
    let required: Vec<&str> = s
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if let Some(Value::Object(props)) = s.get("properties") {
        for (name, sub) in props {
            let wanted = required.contains(&name.as_str()) || (depth < MAX_DEPTH && chance(u)?);
            if wanted {
                map.insert(name.clone(), value(u, sub, name, depth + 1)?);
            }
        }
    }
    if let Some(extra @ Value::Object(_)) = s.get("additionalProperties")
        && depth < MAX_DEPTH
    {
        for _ in 0..u.int_in_range(0..=2)? {
            let name = *u.choose(&["memory", "cpu", "devices.kubevirt.io/kvm", "key"])?;
            map.insert(name.to_owned(), value(u, extra, name, depth + 1)?);
        }
    }
    Ok(Value::Object(map))
}

fn string(u: &mut Unstructured<'_>, key: &str) -> Result<String> {
    if (key == "name" || key.ends_with("Name")) && u.ratio(3, 4)? {
        return Ok((*u.choose(NAMES)?).to_owned());
    }
    Ok(match u.int_in_range(0..=7)? {
        0 => u.arbitrary::<String>()?,
        1 => "x".repeat(usize::from(u.arbitrary::<u8>()?) * 2),
        _ => (*u.choose(STRINGS)?).to_owned(),
    })
}

/// A value of any JSON type, for a field of another type.
fn scalar(u: &mut Unstructured<'_>) -> Result<Value> {
    Ok(match u.int_in_range(0..=4)? {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => json!(u.arbitrary::<i64>()?),
        3 => Value::String(string(u, "")?),
        _ => json!({}),
    })
}
