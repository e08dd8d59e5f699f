/// An image reference, normalised as Docker and containerd do: `virt-handler` is
/// `docker.io/library/virt-handler:latest`, `kubevirt-rs/virt-handler` is
/// `docker.io/kubevirt-rs/virt-handler:latest`; a digest may replace or follow the tag.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Reference {
    /// `domain/path`.
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("image reference {reference:?}: {message}")]
pub struct ReferenceError {
    pub reference: String,
    pub message: String,
}

impl Reference {
    pub fn parse(s: &str) -> Result<Self, ReferenceError> {
        let err = |message: &str| ReferenceError {
            reference: s.into(),
            message: message.into(),
        };
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                crate::Digest::parse(d).map_err(|e| err(&e.to_string()))?;
                (r, Some(d.to_owned()))
            }
            None => (s, None),
        };
        let (name, tag) = match rest.rsplit_once(':') {
            Some((n, t)) if !t.contains('/') => (n, Some(t.to_owned())),
            _ => (rest, None),
        };
        if let Some(t) = &tag
            && (t.is_empty()
                || t.len() > 128
                || t.starts_with(['.', '-'])
                || !t
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)))
        {
            return Err(err(
                "the tag must be 1-128 of [A-Za-z0-9_.-], not starting with . or -",
            ));
        }
        if name.is_empty() {
            return Err(err("no repository name"));
        }
        let (domain, path) = match name.split_once('/') {
            Some((d, p)) if d.contains(['.', ':']) || d == "localhost" => {
                (d.to_owned(), p.to_owned())
            }
            _ => ("docker.io".to_owned(), name.to_owned()),
        };
        let path = if domain == "docker.io" && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
                && c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
        };
        if !path.split('/').all(component_ok) {
            return Err(err(
                "repository path components are lowercase letters, digits and . _ -, starting and ending with a letter or digit",
            ));
        }
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".to_owned())
        } else {
            tag
        };
        Ok(Self {
            repository: format!("{domain}/{path}"),
            tag,
            digest,
        })
    }

    pub fn repository(&self) -> &str {
        &self.repository
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// This repository with a tag and no digest.
    #[must_use]
    pub fn with_tag(&self, tag: &str) -> Self {
        Self {
            repository: self.repository.clone(),
            tag: Some(tag.to_owned()),
            digest: None,
        }
    }

    /// This repository pinned to `digest` (no tag): how release manifests name images.
    #[must_use]
    pub fn with_digest(&self, digest: &crate::Digest) -> Self {
        Self {
            repository: self.repository.clone(),
            tag: None,
            digest: Some(digest.to_string()),
        }
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_normalise_as_docker_does() {
        let d = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        for (given, full) in [
            ("busybox", "docker.io/library/busybox:latest".to_owned()),
            (
                "kubevirt-rs/virt-handler:v1.2",
                "docker.io/kubevirt-rs/virt-handler:v1.2".to_owned(),
            ),
            (
                "quay.io/kubevirt/virt-launcher",
                "quay.io/kubevirt/virt-launcher:latest".to_owned(),
            ),
            ("localhost:5000/a/b:c", "localhost:5000/a/b:c".to_owned()),
            ("localhost/a", "localhost/a:latest".to_owned()),
            (
                &format!("kubevirt-rs/x@{d}"),
                format!("docker.io/kubevirt-rs/x@{d}"),
            ),
            (&format!("reg.io/x:1@{d}"), format!("reg.io/x:1@{d}")),
        ] {
            assert_eq!(
                Reference::parse(given).unwrap().to_string(),
                full,
                "{given}"
            );
        }
        for bad in [
            "",
            "UPPER/case",
            "a//b",
            "x:",
            "x:-tag",
            "x@sha256:00",
            "-x",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
        let r = Reference::parse("kubevirt-rs/x:1").unwrap();
        assert_eq!(r.tag(), Some("1"));
        assert_eq!(
            r.with_digest(&crate::Digest::parse(d).unwrap()).to_string(),
            format!("docker.io/kubevirt-rs/x@{d}")
        );
    }
}
