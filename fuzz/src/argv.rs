//! QEMU's command-line syntax as a checker: what the launcher's argv must satisfy for QEMU to
//! read each option as the launcher meant it.
//!
//! Rules (QEMU 7.2, `softmmu/vl.c` and `util/qemu-option.c` / `util/keyval.c`):
//! - every option is one QEMU knows, and one that takes a value has one;
//! - an option list (`-device`, `-blockdev`, `-chardev`, ...) splits at single commas, `,,`
//!   being a literal comma; only its first part may be positional (a driver or backend name),
//!   every other part is `key=value` with a plain key, no key twice (a value that smuggled in
//!   a comma would show up as a stray part or a repeated key);
//! - a positional part that is `help` or `?` makes QEMU print help and exit;
//! - `-cpu` is split at its first comma without unescaping (`parse_cpu_option`), so the model
//!   may not contain one, and its features at every comma (`x86_cpu_parse_featurestr`,
//!   `strtok`): each a `key=value` with a plain key and a value without a comma, no key twice;
//!   `-uuid` must be a UUID; `-m` a size;
//! - no argument holds a NUL byte, which `execve` cannot pass.

use std::collections::BTreeSet;

/// Options that take no value.
const FLAGS: &[&str] = &["-S", "-nodefaults", "-no-user-config"];

/// Options whose value is an option list.
const LISTS: &[&str] = &[
    "-name",
    "-machine",
    "-accel",
    "-smp",
    "-object",
    "-smbios",
    "-blockdev",
    "-global",
    "-chardev",
    "-mon",
    "-device",
    "-netdev",
    "-msg",
    "-vnc",
    "-rtc",
    "-boot",
];

/// Options whose value QEMU takes as it is.
const VERBATIM: &[&str] = &[
    "-display",
    "-vga",
    "-kernel",
    "-initrd",
    "-append",
    "-incoming",
    "-cpu",
    "-uuid",
    "-m",
    "-watchdog-action",
];

/// Checks `argv` (without the binary's name); the error says which argument breaks which rule.
pub fn check(argv: &[String]) -> Result<(), String> {
    if let Some(bad) = argv.iter().find(|a| a.contains('\0')) {
        return Err(format!("an argument holds a NUL byte: {bad:?}"));
    }
    let mut args = argv.iter();
    while let Some(opt) = args.next() {
        if FLAGS.contains(&opt.as_str()) {
            continue;
        }
        let known = LISTS.contains(&opt.as_str()) || VERBATIM.contains(&opt.as_str());
        if !known {
            return Err(format!("{opt:?} is not an option this checker knows"));
        }
        let value = args.next().ok_or_else(|| format!("{opt} has no value"))?;
        let fail = |why: &str| Err(format!("{opt} {value:?}: {why}"));
        match opt.as_str() {
            "-cpu" => {
                if let Err(why) = check_cpu(value) {
                    return fail(&why);
                }
            }
            "-uuid" if uuid::Uuid::try_parse(value).is_err() => return fail("not a UUID"),
            "-m" => {
                if let Err(why) = check_memory(value) {
                    return fail(&why);
                }
            }
            o if LISTS.contains(&o) => {
                if let Err(why) = check_list(value) {
                    return fail(&why);
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// A CPU model, then features split at every comma: a doubled comma is an empty feature, not
/// an escaped one.
fn check_cpu(value: &str) -> Result<(), String> {
    let mut parts = value.split(',');
    let model = parts.next().unwrap_or_default();
    if model.is_empty() || is_help(model) {
        return Err(format!("the CPU model is {model:?}"));
    }
    let mut keys = BTreeSet::new();
    for feature in parts {
        let plain = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        match feature.split_once('=') {
            Some((key, value)) if plain(key) && plain(value) => {
                if !keys.insert(key) {
                    return Err(format!("the CPU feature {key:?} is given twice"));
                }
            }
            _ => return Err(format!("the CPU feature {feature:?} is not key=value")),
        }
    }
    Ok(())
}

fn is_help(s: &str) -> bool {
    s == "help" || s == "?"
}

/// `-m <size>`, or `<size>,maxmem=<max>` with room to grow (QEMU refuses a smaller maximum).
fn check_memory(value: &str) -> Result<(), String> {
    let (size, max) = match value.split_once(",maxmem=") {
        Some((size, max)) => (size, Some(max)),
        None => (value, None),
    };
    let mib = |s: &str| {
        is_size(s)
            .then(|| s.trim_end_matches('M').parse::<u64>().ok())
            .flatten()
            .ok_or_else(|| format!("{s:?} is not a memory size"))
    };
    let size = mib(size)?;
    match max.map(mib).transpose()? {
        Some(max) if max <= size => Err(format!("maxmem {max}M is not above {size}M")),
        _ => Ok(()),
    }
}

fn is_size(s: &str) -> bool {
    s.strip_suffix('M')
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && n != "0")
}

/// Splits an option list as QEMU does, at single commas, keeping each part as written (`,,`
/// still doubled): whether a part is `key=value` depends on its first `=` or `,`.
fn split_raw(list: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = list.chars().peekable();
    while let Some(c) = chars.next() {
        let part = parts.last_mut().expect("never empty");
        if c != ',' {
            part.push(c);
        } else if chars.next_if_eq(&',').is_some() {
            part.push_str(",,");
        } else {
            parts.push(String::new());
        }
    }
    parts
}

/// QemuOpts and keyval read a key up to the first `=` or `,` (`strcspn(s, "=,")`): a part is
/// `key=value` when that is a `=`, else a positional value (with `,,` standing for a comma).
fn check_list(list: &str) -> Result<(), String> {
    let mut keys = BTreeSet::new();
    for (i, part) in split_raw(list).iter().enumerate() {
        let end = part.find([',', '=']).unwrap_or(part.len());
        if part[end..].starts_with('=') {
            let key = &part[..end];
            let plain = !key.is_empty()
                && key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !plain {
                return Err(format!("part {i} has the key {key:?}"));
            }
            if !keys.insert(key.to_owned()) {
                return Err(format!("the key {key:?} is given twice"));
            }
        } else if i > 0 {
            return Err(format!("part {i} ({part:?}) is not key=value"));
        } else {
            let value = part.replace(",,", ",");
            if value.is_empty() || is_help(&value) {
                return Err(format!("the positional part is {value:?}"));
            }
        }
    }
    Ok(())
}
