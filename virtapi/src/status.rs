//! Kubernetes `Status` errors as KubeVirt's virt-api writes them (apimachinery's
//! `errors.NewConflict`, `NewNotFound`, ...), so kubectl and virtctl print the same messages.

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::json;

/// A refused request: an HTTP code, Kubernetes' reason and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    pub code: StatusCode,
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    /// `Operation cannot be fulfilled on virtualmachine.kubevirt.io "name": why` (409).
    pub fn conflict(resource: &str, name: &str, why: impl std::fmt::Display) -> Self {
        Refusal {
            code: StatusCode::CONFLICT,
            reason: "Conflict",
            message: format!(
                "Operation cannot be fulfilled on {resource}.kubevirt.io {name:?}: {why}"
            ),
        }
    }

    /// `virtualmachineinstance.kubevirt.io "name" not found` (404).
    pub fn not_found(resource: &str, name: &str) -> Self {
        Refusal {
            code: StatusCode::NOT_FOUND,
            reason: "NotFound",
            message: format!("{resource}.kubevirt.io {name:?} not found"),
        }
    }

    /// `virtualmachineinstance.kubevirt.io "name" is forbidden: why` (403).
    pub fn forbidden_object(resource: &str, name: &str, why: impl std::fmt::Display) -> Self {
        Refusal {
            code: StatusCode::FORBIDDEN,
            reason: "Forbidden",
            message: format!("{resource}.kubevirt.io {name:?} is forbidden: {why}"),
        }
    }

    /// A user RBAC does not allow (403), with the authorizer's reason.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Refusal {
            code: StatusCode::FORBIDDEN,
            reason: "Forbidden",
            message: message.into(),
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Refusal {
            code: StatusCode::UNAUTHORIZED,
            reason: "Unauthorized",
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Refusal {
            code: StatusCode::BAD_REQUEST,
            reason: "BadRequest",
            message: message.into(),
        }
    }

    /// `Internal error occurred: why` (500).
    pub fn internal(why: impl std::fmt::Display) -> Self {
        Refusal {
            code: StatusCode::INTERNAL_SERVER_ERROR,
            reason: "InternalError",
            message: format!("Internal error occurred: {why}"),
        }
    }

    /// The `metav1.Status` body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        })
    }

    /// Maps an API server error of a call virt-api made: the server's own Status passes
    /// through (a 404 or 409 stays one), anything else is internal.
    pub fn from_kube(e: kube::Error) -> Self {
        match e {
            kube::Error::Api(s) => Refusal {
                code: StatusCode::from_u16(s.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                reason: match s.code {
                    404 => "NotFound",
                    409 => "Conflict",
                    422 => "Invalid",
                    403 => "Forbidden",
                    400 => "BadRequest",
                    _ => "InternalError",
                },
                message: s.message,
            },
            other => Refusal::internal(other),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.code, axum::Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_apimachinerys() {
        assert_eq!(
            Refusal::conflict("virtualmachine", "demo", "VM is already running").message,
            "Operation cannot be fulfilled on virtualmachine.kubevirt.io \"demo\": VM is already running"
        );
        assert_eq!(
            Refusal::not_found("virtualmachineinstance", "x").message,
            "virtualmachineinstance.kubevirt.io \"x\" not found"
        );
        let b = Refusal::internal("boom").body();
        assert_eq!(b["code"], 500);
        assert_eq!(b["message"], "Internal error occurred: boom");
        assert_eq!(b["kind"], "Status");
    }
}
