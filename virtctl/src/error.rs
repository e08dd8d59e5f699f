//! What went wrong talking to the API server, worded so that the user sees the HTTP status and
//! the server's own explanation (a `metav1.Status` message, or the body when it is not one).

use std::fmt;

use serde::Deserialize;

/// A request that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The server answered with an error status.
    #[error("{0}")]
    Api(ApiError),
    /// The request never got an answer (connection, TLS, credentials).
    #[error("{0}")]
    Transport(#[source] kube::Error),
    /// The answer was not what the protocol promises (no websocket upgrade, bad accept key).
    #[error("{0}")]
    Protocol(String),
}

impl RequestError {
    pub fn status(&self) -> Option<u16> {
        match self {
            RequestError::Api(e) => Some(e.code),
            _ => None,
        }
    }

    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }
}

impl From<kube::Error> for RequestError {
    fn from(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(status) => RequestError::Api(ApiError {
                code: status.code,
                message: status.message,
            }),
            other => RequestError::Transport(other),
        }
    }
}

/// An error status and the server's reason for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: u16,
    pub message: String,
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reason = http::StatusCode::from_u16(self.code)
            .ok()
            .and_then(|c| c.canonical_reason());
        let status = match reason {
            Some(r) => format!("HTTP {} {r}", self.code),
            None => format!("HTTP {}", self.code),
        };
        if self.message.is_empty() {
            f.write_str(&status)
        } else {
            write!(f, "{} ({status})", self.message)
        }
    }
}

#[derive(Deserialize)]
struct StatusBody {
    #[serde(default)]
    kind: String,
    #[serde(default)]
    message: String,
}

/// Longest piece of a non-Status error body worth showing: enough for a plain-text reason,
/// short enough that an HTML error page does not flood the terminal.
const MAX_BODY_SHOWN: usize = 512;

/// The error an error response carries: the `metav1.Status` message when the body is one,
/// else the body text itself.
pub fn api_error(code: u16, body: &[u8]) -> ApiError {
    let message = match serde_json::from_slice::<StatusBody>(body) {
        Ok(s) if s.kind == "Status" || !s.message.is_empty() => s.message,
        _ => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            match text.char_indices().nth(MAX_BODY_SHOWN) {
                Some((cut, _)) => format!("{}...", &text[..cut]),
                None => text.to_owned(),
            }
        }
    };
    ApiError { code, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies() {
        let cases: [(u16, &[u8], &str); 5] = [
            (
                404,
                br#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"virtualmachines.kubevirt.io \"demo\" not found","reason":"NotFound","code":404}"#,
                r#"virtualmachines.kubevirt.io "demo" not found (HTTP 404 Not Found)"#,
            ),
            (
                409,
                br#"{"kind":"Status","message":"VM is already running","code":409}"#,
                "VM is already running (HTTP 409 Conflict)",
            ),
            (
                500,
                b"  internal failure\n",
                "internal failure (HTTP 500 Internal Server Error)",
            ),
            (503, b"", "HTTP 503 Service Unavailable"),
            (599, b"", "HTTP 599"),
        ];
        for (code, body, want) in cases {
            assert_eq!(api_error(code, body).to_string(), want, "{code}");
        }
    }

    #[test]
    fn long_bodies_are_cut() {
        let body = "x".repeat(2000);
        let e = api_error(502, body.as_bytes());
        assert_eq!(e.message.len(), MAX_BODY_SHOWN + 3);
    }

    #[test]
    fn kube_api_errors_keep_their_status() {
        let status = kube::core::Status::failure("gone", "NotFound").with_code(404);
        let e = RequestError::from(kube::Error::Api(Box::new(status)));
        assert!(e.is_not_found());
        assert_eq!(e.to_string(), "gone (HTTP 404 Not Found)");
    }
}
