use std::io::{Read, Write};

use sha2::{Digest as _, Sha256};

/// A content digest, `sha256:<64 hex digits>`: the only algorithm OCI requires.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(String);

#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a sha256 digest (sha256:<64 lowercase hex digits>)")]
pub struct DigestError(pub String);

impl Digest {
    pub fn parse(s: &str) -> Result<Self, DigestError> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| DigestError(s.into()))?;
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(DigestError(s.into()));
        }
        Ok(Self(s.into()))
    }

    pub fn of(bytes: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(bytes))
    }

    fn from_hasher(h: Sha256) -> Self {
        use std::fmt::Write as _;
        let mut s = String::with_capacity(71);
        s.push_str("sha256:");
        for b in h.finalize() {
            let _ = write!(s, "{b:02x}");
        }
        Self(s)
    }

    /// The hex part, which names the blob file.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Hashes and counts what passes through, in either direction.
pub(crate) struct Hashing<T> {
    pub inner: T,
    hasher: Sha256,
    pub len: u64,
}

impl<T> Hashing<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            hasher: Sha256::new(),
            len: 0,
        }
    }

    pub fn finish(self) -> (T, Digest, u64) {
        (self.inner, Digest::from_hasher(self.hasher), self.len)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_and_name_their_blob() {
        let d = Digest::of(b"");
        assert_eq!(
            d.as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert_eq!(d.hex().len(), 64);
        for bad in [
            "sha512:00",
            "e3b0",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:../../etc/passwd",
        ] {
            assert!(Digest::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hashing_writer_and_reader_agree() {
        let mut w = Hashing::new(Vec::new());
        w.write_all(b"hello").unwrap();
        let (bytes, wd, n) = w.finish();
        let mut r = Hashing::new(&bytes[..]);
        std::io::copy(&mut r, &mut std::io::sink()).unwrap();
        let (_, rd, m) = r.finish();
        assert_eq!((wd.clone(), n), (rd, m));
        assert_eq!(wd, Digest::of(b"hello"));
    }
}
