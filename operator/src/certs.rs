//! KubeVirt's self-signed PKI as pure functions over PEM text and a clock: the lifetimes
//! `certificateRotateStrategy` asks for, issuing the CA and the components' certificates with
//! KubeVirt's names, when one must be renewed, and the CA bundle that keeps a rotated CA
//! trusted until it expires.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use serde_json::Value;

use crate::strategy::FieldError;

/// `KubeVirtCASecretName`: the CA's certificate and key.
pub const CA_SECRET: &str = "kubevirt-ca";
/// The ConfigMap (same name as the CA's Secret) whose `ca-bundle` every component trusts.
pub const CA_BUNDLE_CONFIGMAP: &str = "kubevirt-ca";
/// `CABundleKey`.
pub const CA_BUNDLE_KEY: &str = "ca-bundle";

/// KubeVirt's defaults: the CA lives 7 days, a server certificate 1 day, each renewed when a
/// fifth of its life is left.
const CA_DURATION: Duration = Duration::from_hours(7 * 24);
const CERT_DURATION: Duration = Duration::from_hours(24);

/// How long certificates of one kind live, and how long before their end they are renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    pub duration: Duration,
    pub renew_before: Duration,
}

impl Lifetime {
    fn with_default_renewal(duration: Duration) -> Self {
        Self {
            duration,
            renew_before: duration / 5,
        }
    }
}

/// The CA's lifetime and the components' certificates' lifetime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    pub ca: Lifetime,
    pub server: Lifetime,
}

/// The lifetimes `spec.certificateRotateStrategy` asks for, as KubeVirt reads it:
/// `selfSigned.ca` and `selfSigned.server` (`duration`, `renewBefore`), the deprecated
/// `caRotateInterval`, `caOverlapInterval` and `certRotateInterval` first when set.
pub fn rotation(strategy: Option<&Value>) -> Result<Rotation, FieldError> {
    const FIELD: &str = "spec.certificateRotateStrategy.selfSigned";
    let self_signed = strategy.and_then(|s| s.get("selfSigned"));
    let duration = |path: &str| -> Result<Option<Duration>, FieldError> {
        let Some(v) = self_signed.and_then(|s| s.pointer(path)) else {
            return Ok(None);
        };
        let field = format!("{FIELD}{}", path.replace('/', "."));
        let text = v
            .as_str()
            .ok_or_else(|| FieldError::new(&field, "must be a duration string such as 24h"))?;
        let d = api::duration::parse_duration(text)
            .map_err(|e| FieldError::new(&field, e.to_string()))?;
        if d.is_zero() {
            return Err(FieldError::new(&field, "must be longer than zero"));
        }
        Ok(Some(d))
    };
    let ca_duration = duration("/caRotateInterval")?
        .or(duration("/ca/duration")?)
        .unwrap_or(CA_DURATION);
    let ca_renew = duration("/caOverlapInterval")?.or(duration("/ca/renewBefore")?);
    let server_duration = duration("/certRotateInterval")?
        .or(duration("/server/duration")?)
        .unwrap_or(CERT_DURATION);
    let server_renew = duration("/server/renewBefore")?;
    let lifetime = |duration: Duration, renew: Option<Duration>, field: &str| {
        let mut l = Lifetime::with_default_renewal(duration);
        if let Some(r) = renew {
            if r >= duration {
                return Err(FieldError::new(
                    format!("{FIELD}.{field}.renewBefore"),
                    "must be shorter than the duration, or the certificate is renewed forever",
                ));
            }
            l.renew_before = r;
        }
        Ok(l)
    };
    let rotation = Rotation {
        ca: lifetime(ca_duration, ca_renew, "ca")?,
        server: lifetime(server_duration, server_renew, "server")?,
    };
    if rotation.server.duration > rotation.ca.duration {
        return Err(FieldError::new(
            format!("{FIELD}.server.duration"),
            "must not be longer than the CA's: a certificate cannot outlive its issuer",
        ));
    }
    Ok(rotation)
}

/// What a component's certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    Server,
    Client,
    /// Both: virt-handler's server certificate also dials the other handlers' migration
    /// listeners, as KubeVirt's does.
    ServerAndClient,
}

/// One component certificate, as KubeVirt names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leaf {
    /// The Secret holding it (`tls.crt`, `tls.key`, and `ca.crt` with the bundle).
    pub secret: &'static str,
    /// Its common name; `{ns}` is the namespace.
    pub common_name: &'static str,
    /// The Service whose DNS names it carries (server certificates).
    pub service: Option<&'static str>,
    pub usage: Usage,
}

/// The certificates the components use, with KubeVirt's Secret names and subjects.
pub const LEAVES: [Leaf; 4] = [
    Leaf {
        secret: "kubevirt-virt-api-certs",
        common_name: "virt-api.{ns}.pod.cluster.local",
        service: Some("virt-api"),
        usage: Usage::Server,
    },
    Leaf {
        secret: "kubevirt-controller-certs",
        common_name: "virt-controller.{ns}.pod.cluster.local",
        service: Some("virt-controller"),
        usage: Usage::Server,
    },
    Leaf {
        secret: "kubevirt-virt-handler-server-certs",
        common_name: "kubevirt.io:system:node:virt-handler",
        service: Some("virt-handler"),
        usage: Usage::ServerAndClient,
    },
    Leaf {
        secret: "kubevirt-virt-handler-certs",
        common_name: "kubevirt.io:system:client:virt-handler",
        service: None,
        usage: Usage::Client,
    },
];

/// A certificate and its key, PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("issuing {what}: {source}")]
    Issue { what: String, source: rcgen::Error },
}

fn issue_error(what: &str) -> impl FnOnce(rcgen::Error) -> CertError + '_ {
    move |source| CertError::Issue {
        what: what.to_owned(),
        source,
    }
}

fn validity(params: &mut CertificateParams, now: SystemTime, duration: Duration) {
    // A minute of slack for clocks that are a little behind ours.
    params.not_before = time::OffsetDateTime::from(now - Duration::from_mins(1));
    params.not_after = time::OffsetDateTime::from(now + duration);
}

/// A new self-signed CA (`kubevirt.io@<seconds since the epoch>`, as KubeVirt names it).
pub fn issue_ca(now: SystemTime, lifetime: Lifetime) -> Result<Issued, CertError> {
    let mut params = CertificateParams::default();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let seconds = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kubevirt.io@{seconds}"));
    params.distinguished_name = dn;
    validity(&mut params, now, lifetime.duration);
    let key = KeyPair::generate().map_err(issue_error("the CA's key"))?;
    let cert = params.self_signed(&key).map_err(issue_error("the CA"))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// `leaf`'s certificate for `namespace`, signed by `ca`.
pub fn issue(
    leaf: &Leaf,
    namespace: &str,
    ca: &Issued,
    now: SystemTime,
    lifetime: Lifetime,
) -> Result<Issued, CertError> {
    let names: Vec<String> = leaf
        .service
        .map(|s| {
            vec![
                s.to_owned(),
                format!("{s}.{namespace}"),
                format!("{s}.{namespace}.svc"),
                format!("{s}.{namespace}.svc.cluster.local"),
            ]
        })
        .unwrap_or_default();
    let mut params = CertificateParams::new(names).map_err(issue_error(leaf.secret))?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        leaf.common_name.replace("{ns}", namespace),
    );
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = match leaf.usage {
        Usage::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
        Usage::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
        Usage::ServerAndClient => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    };
    validity(&mut params, now, lifetime.duration);
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(issue_error("the CA's key"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key).map_err(issue_error("the CA"))?;
    let key = KeyPair::generate().map_err(issue_error(leaf.secret))?;
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(issue_error(leaf.secret))?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// The certificates of a PEM text (each re-encoded the same way) with their validity ends, in
/// order; what does not parse is left out.
fn parse_certificates(pem_text: &str) -> Vec<(String, SystemTime)> {
    let mut out = Vec::new();
    for pem in x509_parser::pem::Pem::iter_from_buffer(pem_text.as_bytes()).flatten() {
        let Ok(cert) = pem.parse_x509() else {
            continue;
        };
        let Ok(seconds) = u64::try_from(cert.validity().not_after.timestamp()) else {
            continue;
        };
        let not_after = SystemTime::UNIX_EPOCH + Duration::from_secs(seconds);
        let text = format!(
            "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
            base64_lines(&pem.contents)
        );
        out.push((text, not_after));
    }
    out
}

fn base64_lines(der: &[u8]) -> String {
    use base64::Engine as _;
    let text = base64::engine::general_purpose::STANDARD.encode(der);
    text.as_bytes()
        .chunks(64)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `cert_pem` must be (re)issued: missing or unreadable, signed by another CA than
/// `ca_pem`, or within `renew_before` of its end.
pub fn needs_renewal(
    cert_pem: Option<&str>,
    ca_pem: &str,
    now: SystemTime,
    renew_before: Duration,
) -> bool {
    let Some(cert_pem) = cert_pem else {
        return true;
    };
    let parse = |text: &str| {
        x509_parser::pem::Pem::iter_from_buffer(text.as_bytes())
            .flatten()
            .next()
    };
    let (Some(cert_pem), Some(ca_pem)) = (parse(cert_pem), parse(ca_pem)) else {
        return true;
    };
    let (Ok(cert), Ok(ca)) = (cert_pem.parse_x509(), ca_pem.parse_x509()) else {
        return true;
    };
    // Signed by this CA's key, not merely by a CA of the same name.
    if cert.verify_signature(Some(ca.public_key())).is_err() {
        return true;
    }
    let Ok(seconds) = u64::try_from(cert.validity().not_after.timestamp()) else {
        return true;
    };
    let not_after = SystemTime::UNIX_EPOCH + Duration::from_secs(seconds);
    now + renew_before >= not_after
}

/// The CA bundle after `current` became the CA: `current` first, then the certificates of
/// `previous` that are still valid (a component whose certificate an older CA signed keeps
/// being trusted until it is renewed), each once.
pub fn ca_bundle(current: &str, previous: &str, now: SystemTime) -> String {
    let mut out: Vec<String> = Vec::new();
    for (text, not_after) in parse_certificates(current)
        .into_iter()
        .chain(parse_certificates(previous))
    {
        if not_after > now && !out.contains(&text) {
            out.push(text);
        }
    }
    out.concat()
}

/// A component Secret's data: its certificate and key, and the CA bundle as `ca.crt` (which
/// our components read next to their certificate).
pub fn secret_data(issued: &Issued, bundle: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("tls.crt".to_owned(), issued.cert_pem.clone()),
        ("tls.key".to_owned(), issued.key_pem.clone()),
        ("ca.crt".to_owned(), bundle.to_owned()),
    ])
}

/// The certificate objects an install should hold now, and when to look again.
#[derive(Debug, Clone, PartialEq)]
pub struct Certificates {
    /// The CA Secret, the CA bundle ConfigMap and the components' Secrets, in `namespace`.
    pub objects: Vec<serde_json::Value>,
    /// The CA bundle (PEM) for APIServices and webhooks.
    pub bundle: String,
    /// The earliest moment one of them is due for renewal.
    pub next_renewal: SystemTime,
}

fn not_after(pem_text: &str) -> Option<SystemTime> {
    parse_certificates(pem_text).first().map(|(_, t)| *t)
}

fn issued_of(data: Option<&BTreeMap<String, String>>) -> Option<Issued> {
    let data = data?;
    Some(Issued {
        cert_pem: data.get("tls.crt")?.clone(),
        key_pem: data.get("tls.key")?.clone(),
    })
}

fn secret(name: &str, namespace: &str, data: &BTreeMap<String, String>) -> serde_json::Value {
    use base64::Engine as _;
    let encoded: BTreeMap<&String, String> = data
        .iter()
        .map(|(k, v)| (k, base64::engine::general_purpose::STANDARD.encode(v)))
        .collect();
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "type": "kubernetes.io/tls",
        "data": encoded,
    })
}

/// The Secret keeping the CA a new one replaced, while the new one propagates; gone after.
pub const PREVIOUS_CA_SECRET: &str = "kubevirt-ca-previous";

/// How long a new CA is only published (in every bundle: the components' `ca.crt`, the
/// APIServices' and webhooks' `caBundle`) before it signs anything: every component must
/// trust it before any presents a certificate it signed. The process kubelet projects secrets
/// again every 10 s; a real kubelet within a minute or two. At most half the CA's
/// `renewBefore`, so the old CA still has time left when the components change over.
pub fn propagation(rotation: &Rotation) -> Duration {
    Duration::from_mins(2).min(rotation.ca.renew_before / 2)
}

/// When `cert_pem` was issued: its validity starts a minute earlier (clock slack).
fn issued_at(cert_pem: &str) -> Option<SystemTime> {
    let pem = x509_parser::pem::Pem::iter_from_buffer(cert_pem.as_bytes())
        .flatten()
        .next()?;
    let cert = pem.parse_x509().ok()?;
    let seconds = u64::try_from(cert.validity().not_before.timestamp()).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_mins(1))
}

/// KubeVirt's certificate manager as one pure step: from the Secrets' data as they are
/// (`secrets`, by name, decoded) and the bundle as published, keep what is still good and
/// issue what is missing, signed by another CA, or due; the bundle holds the current CA and
/// the earlier ones until they expire. A CA due for renewal is replaced by a new one that is
/// published at once but signs only after [`propagation`]; until then the old one (kept in the
/// CA Secret) goes on signing. A CA that is gone (its Secret deleted) has no key left to sign
/// with: the new one signs at once.
pub fn certificates(
    secrets: &BTreeMap<String, BTreeMap<String, String>>,
    published_bundle: Option<&str>,
    namespace: &str,
    rotation: &Rotation,
    now: SystemTime,
) -> Result<Certificates, CertError> {
    let stored = secrets.get(CA_SECRET);
    let due = |ca: &Issued| {
        needs_renewal(
            Some(&ca.cert_pem),
            &ca.cert_pem,
            now,
            rotation.ca.renew_before,
        )
    };
    let kept = issued_of(secrets.get(PREVIOUS_CA_SECRET));
    let (ca, previous) = match issued_of(stored) {
        Some(ca) if !due(&ca) => (ca, kept),
        Some(old) => (issue_ca(now, rotation.ca)?, Some(old)),
        None => (issue_ca(now, rotation.ca)?, None),
    };
    let switch_at = issued_at(&ca.cert_pem).map_or(now, |t| t + propagation(rotation));
    let previous =
        previous.filter(|p| now < switch_at && not_after(&p.cert_pem).is_some_and(|end| end > now));
    let signer = previous.as_ref().unwrap_or(&ca);
    let bundle = ca_bundle(
        &ca.cert_pem,
        &format!(
            "{}{}",
            previous.as_ref().map_or("", |p| p.cert_pem.as_str()),
            published_bundle.unwrap_or_default()
        ),
        now,
    );
    let mut next_renewal = not_after(&ca.cert_pem).map_or(now, |t| t - rotation.ca.renew_before);
    let ca_data = |ca: &Issued| {
        BTreeMap::from([
            ("tls.crt".to_owned(), ca.cert_pem.clone()),
            ("tls.key".to_owned(), ca.key_pem.clone()),
        ])
    };
    let mut objects = vec![
        secret(CA_SECRET, namespace, &ca_data(&ca)),
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CA_BUNDLE_CONFIGMAP, "namespace": namespace},
            "data": {CA_BUNDLE_KEY: bundle},
        }),
    ];
    if let Some(p) = &previous {
        next_renewal = next_renewal.min(switch_at);
        objects.push(secret(PREVIOUS_CA_SECRET, namespace, &ca_data(p)));
    }
    for leaf in &LEAVES {
        let current = issued_of(secrets.get(leaf.secret));
        let issued = match current {
            Some(c)
                if !needs_renewal(
                    Some(&c.cert_pem),
                    &signer.cert_pem,
                    now,
                    rotation.server.renew_before,
                ) =>
            {
                c
            }
            _ => issue(leaf, namespace, signer, now, rotation.server)?,
        };
        if let Some(end) = not_after(&issued.cert_pem) {
            next_renewal = next_renewal.min(end - rotation.server.renew_before);
        }
        objects.push(secret(
            leaf.secret,
            namespace,
            &secret_data(&issued, &bundle),
        ));
    }
    Ok(Certificates {
        objects,
        bundle,
        next_renewal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HOUR: Duration = Duration::from_hours(1);

    #[test]
    fn lifetimes_follow_kubevirt() {
        let r = rotation(None).unwrap();
        assert_eq!(r.ca.duration, 168 * HOUR);
        assert_eq!(r.ca.renew_before, Duration::from_mins(168 * 60 / 5));
        assert_eq!(r.server.duration, 24 * HOUR);
        assert_eq!(r.server.renew_before, Duration::from_mins(24 * 60 / 5));
        let s = json!({"selfSigned": {"ca": {"duration": "48h", "renewBefore": "12h"},
                                      "server": {"duration": "2h"}}});
        let r = rotation(Some(&s)).unwrap();
        assert_eq!((r.ca.duration, r.ca.renew_before), (48 * HOUR, 12 * HOUR));
        assert_eq!(r.server.renew_before, Duration::from_mins(2 * 60 / 5));
        // The deprecated intervals win, as in KubeVirt.
        let s = json!({"selfSigned": {"caRotateInterval": "72h", "ca": {"duration": "48h"},
                                      "certRotateInterval": "1h", "caOverlapInterval": "3h"}});
        let r = rotation(Some(&s)).unwrap();
        assert_eq!((r.ca.duration, r.ca.renew_before), (72 * HOUR, 3 * HOUR));
        assert_eq!(r.server.duration, HOUR);
        for (s, field) in [
            (
                json!({"selfSigned": {"ca": {"duration": "soon"}}}),
                "spec.certificateRotateStrategy.selfSigned.ca.duration",
            ),
            (
                json!({"selfSigned": {"server": {"duration": "2h", "renewBefore": "2h"}}}),
                "spec.certificateRotateStrategy.selfSigned.server.renewBefore",
            ),
            (
                json!({"selfSigned": {"ca": {"duration": "1h"}, "server": {"duration": "2h"}}}),
                "spec.certificateRotateStrategy.selfSigned.server.duration",
            ),
        ] {
            assert_eq!(rotation(Some(&s)).unwrap_err().field, field, "{s}");
        }
    }

    #[test]
    fn certificates_carry_kubevirt_names_and_chain_to_the_ca() {
        let now = SystemTime::now();
        let r = rotation(None).unwrap();
        let ca = issue_ca(now, r.ca).unwrap();
        for leaf in &LEAVES {
            let issued = issue(leaf, "virt", &ca, now, r.server).unwrap();
            let pem = x509_parser::pem::Pem::iter_from_buffer(issued.cert_pem.as_bytes())
                .next()
                .unwrap()
                .unwrap();
            let cert = pem.parse_x509().unwrap();
            let cn = cert
                .subject()
                .iter_common_name()
                .next()
                .unwrap()
                .as_str()
                .unwrap()
                .to_owned();
            assert_eq!(cn, leaf.common_name.replace("{ns}", "virt"));
            let ca_pem = x509_parser::pem::Pem::iter_from_buffer(ca.cert_pem.as_bytes())
                .next()
                .unwrap()
                .unwrap();
            let ca_cert = ca_pem.parse_x509().unwrap();
            cert.verify_signature(Some(ca_cert.public_key()))
                .expect("signed by the CA");
            let life =
                cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
            assert_eq!(life, 24 * 3600 + 60, "a day, from a minute ago");
            let names: Vec<String> = cert
                .subject_alternative_name()
                .unwrap()
                .map(|san| {
                    san.value
                        .general_names
                        .iter()
                        .map(ToString::to_string)
                        .collect()
                })
                .unwrap_or_default();
            match leaf.service {
                Some(s) => assert!(
                    names.contains(&format!("DNSName({s}.virt.svc)")),
                    "{names:?}"
                ),
                None => assert!(names.is_empty()),
            }
            assert!(!needs_renewal(
                Some(&issued.cert_pem),
                &ca.cert_pem,
                now,
                r.server.renew_before
            ));
        }
    }

    #[test]
    fn renewal_is_due_near_the_end_for_another_ca_or_for_nothing() {
        let now = SystemTime::now();
        let r = rotation(None).unwrap();
        let ca = issue_ca(now, r.ca).unwrap();
        let cert = issue(&LEAVES[0], "kubevirt", &ca, now, r.server).unwrap();
        let renew = r.server.renew_before;
        assert!(!needs_renewal(
            Some(&cert.cert_pem),
            &ca.cert_pem,
            now + 19 * HOUR,
            renew
        ));
        assert!(needs_renewal(
            Some(&cert.cert_pem),
            &ca.cert_pem,
            now + 20 * HOUR,
            renew
        ));
        // Another CA, even of the same name (made in the same second).
        let other = issue_ca(now, r.ca).unwrap();
        assert!(needs_renewal(
            Some(&cert.cert_pem),
            &other.cert_pem,
            now,
            renew
        ));
        assert!(needs_renewal(None, &ca.cert_pem, now, renew));
        assert!(needs_renewal(Some("garbage"), &ca.cert_pem, now, renew));
    }

    #[test]
    fn the_bundle_keeps_a_rotated_ca_until_it_expires() {
        let now = SystemTime::now();
        let short = Lifetime::with_default_renewal(2 * HOUR);
        let old = issue_ca(now, short).unwrap();
        let new = issue_ca(now + HOUR, Lifetime::with_default_renewal(48 * HOUR)).unwrap();
        let bundle = ca_bundle(&new.cert_pem, &old.cert_pem, now + HOUR);
        assert_eq!(parse_certificates(&bundle).len(), 2);
        assert_eq!(
            parse_certificates(&bundle)[0].0,
            parse_certificates(&new.cert_pem)[0].0,
            "the current CA first"
        );
        let again = ca_bundle(&new.cert_pem, &bundle, now + HOUR);
        assert_eq!(again, bundle, "each once");
        let later = ca_bundle(&new.cert_pem, &bundle, now + 3 * HOUR);
        assert_eq!(
            parse_certificates(&later).len(),
            1,
            "the expired CA is gone"
        );
        let data = secret_data(&old, &bundle);
        assert_eq!(
            data.keys().collect::<Vec<_>>(),
            ["ca.crt", "tls.crt", "tls.key"]
        );
    }

    fn decoded(c: &Certificates) -> (BTreeMap<String, BTreeMap<String, String>>, String) {
        use base64::Engine as _;
        let mut secrets = BTreeMap::new();
        for o in c.objects.iter().filter(|o| o["kind"] == "Secret") {
            let data = o["data"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(v.as_str().unwrap())
                        .unwrap();
                    (k.clone(), String::from_utf8(bytes).unwrap())
                })
                .collect();
            secrets.insert(o["metadata"]["name"].as_str().unwrap().to_owned(), data);
        }
        (secrets, c.bundle.clone())
    }

    #[test]
    fn certificates_are_kept_until_due_and_a_new_ca_keeps_the_old_in_the_bundle() {
        let s = json!({"selfSigned": {"ca": {"duration": "10h", "renewBefore": "3h"},
                                      "server": {"duration": "5h", "renewBefore": "1h"}}});
        let r = rotation(Some(&s)).unwrap();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        let first = certificates(&BTreeMap::new(), None, "kubevirt", &r, t0).unwrap();
        assert_eq!(first.objects.len(), 2 + LEAVES.len());
        assert_eq!(
            first.next_renewal,
            t0 + 4 * HOUR,
            "the servers are due first"
        );
        let (secrets, bundle) = decoded(&first);
        assert_eq!(secrets[LEAVES[0].secret]["ca.crt"], bundle);

        let later = certificates(&secrets, Some(&bundle), "kubevirt", &r, t0 + HOUR).unwrap();
        assert_eq!(later, first, "nothing is due after an hour");

        // Within the servers' renewBefore: new leaves, same CA.
        let renewed = certificates(&secrets, Some(&bundle), "kubevirt", &r, t0 + 4 * HOUR).unwrap();
        let (renewed_secrets, renewed_bundle) = decoded(&renewed);
        assert_eq!(renewed_secrets[CA_SECRET], secrets[CA_SECRET]);
        assert_eq!(renewed_bundle, bundle);
        for leaf in &LEAVES {
            assert_ne!(
                renewed_secrets[leaf.secret]["tls.crt"],
                secrets[leaf.secret]["tls.crt"]
            );
        }

        // Within the CA's: a new CA, published at once in every bundle, while the old one
        // goes on signing until the new one has propagated.
        let due = t0 + 7 * HOUR + Duration::from_mins(1);
        let rotated =
            certificates(&renewed_secrets, Some(&renewed_bundle), "kubevirt", &r, due).unwrap();
        let (rotated_secrets, rotated_bundle) = decoded(&rotated);
        let new_ca = &rotated_secrets[CA_SECRET]["tls.crt"];
        let old_ca = &secrets[CA_SECRET]["tls.crt"];
        assert_ne!(new_ca, old_ca);
        assert_eq!(&rotated_secrets[PREVIOUS_CA_SECRET]["tls.crt"], old_ca);
        assert!(rotated_bundle.starts_with(new_ca.as_str()));
        assert!(rotated_bundle.contains(old_ca.trim()));
        assert_eq!(rotated.next_renewal, due + propagation(&r));
        for leaf in &LEAVES {
            assert_eq!(
                rotated_secrets[leaf.secret]["tls.crt"], renewed_secrets[leaf.secret]["tls.crt"],
                "{} is not re-signed before the new CA propagated",
                leaf.secret
            );
            assert_eq!(rotated_secrets[leaf.secret]["ca.crt"], rotated_bundle);
        }

        // Propagated: the new CA signs new leaves and the old one's key is dropped.
        let later = due + propagation(&r);
        let switched = certificates(
            &rotated_secrets,
            Some(&rotated_bundle),
            "kubevirt",
            &r,
            later,
        )
        .unwrap();
        let (switched_secrets, switched_bundle) = decoded(&switched);
        assert_eq!(&switched_secrets[CA_SECRET]["tls.crt"], new_ca);
        assert!(
            !switched_secrets.contains_key(PREVIOUS_CA_SECRET),
            "the old CA's key is not kept (the install plan deletes its Secret)"
        );
        assert!(
            switched_bundle.contains(old_ca.trim()),
            "still trusted until it expires"
        );
        for leaf in &LEAVES {
            let cert = &switched_secrets[leaf.secret]["tls.crt"];
            assert!(!needs_renewal(
                Some(cert),
                new_ca,
                later,
                r.server.renew_before
            ));
        }

        // A deleted CA Secret leaves no key to sign with: the new CA signs at once.
        let mut lost = switched_secrets.clone();
        lost.remove(CA_SECRET);
        let forced = certificates(&lost, Some(&switched_bundle), "kubevirt", &r, later).unwrap();
        let (forced_secrets, forced_bundle) = decoded(&forced);
        let forced_ca = &forced_secrets[CA_SECRET]["tls.crt"];
        assert!(
            forced_bundle.contains(new_ca.trim()),
            "the lost CA stays trusted"
        );
        for leaf in &LEAVES {
            let cert = &forced_secrets[leaf.secret]["tls.crt"];
            assert!(!needs_renewal(
                Some(cert),
                forced_ca,
                later,
                r.server.renew_before
            ));
        }
    }
}
