//! Building blocks shared by every kind: preserved subtrees, tolerant string enums, conditions.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

/// A subtree of a KubeVirt object that kubevirt-rs keeps verbatim but does not interpret.
///
/// Its schema carries `x-kubernetes-preserve-unknown-fields`, so a real API server stores
/// whatever the user wrote instead of pruning it. Validation refuses the fields whose meaning
/// we do not implement, naming them; the rest (status bookkeeping, tuning knobs that do not
/// change the guest) are simply carried along.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Preserved(pub serde_json::Value);

impl JsonSchema for Preserved {
    fn schema_name() -> Cow<'static, str> {
        "Preserved".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
    }
}

/// An empty marker object such as `masquerade: {}` or `rng: {}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Empty {}

/// Declares a string-valued enum that keeps values it does not know.
///
/// KubeVirt's schemas type these fields as plain strings and its webhooks reject bad values
/// later. Parsing strictly would turn a typo into a deserialisation failure of the whole object
/// (no field path, and a controller that cannot even read the object to report on it), so an
/// unknown value is kept as `Other` and validation reports it with its path.
macro_rules! string_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A value this version of kubevirt-rs does not know, kept verbatim.
            Other(String),
        }

        impl $name {
            /// Every value this version knows, in declaration order.
            pub const KNOWN: &'static [&'static str] = &[$($value),+];

            /// The wire spelling.
            pub fn as_str(&self) -> &str {
                match self {
                    $( Self::$variant => $value, )+
                    Self::Other(s) => s,
                }
            }

            /// Whether the value is one this version knows.
            pub fn is_known(&self) -> bool {
                !matches!(self, Self::Other(_))
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                match s {
                    $( $value => Self::$variant, )+
                    other => Self::Other(other.to_owned()),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
                Ok(Self::from(s.as_ref()))
            }
        }

        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn inline_schema() -> bool {
                true
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                schemars::json_schema!({ "type": "string" })
            }
        }
    };
}
pub(crate) use string_enum;

string_enum! {
    /// `True`, `False` or `Unknown`, as in every Kubernetes condition.
    pub enum ConditionStatus {
        True = "True",
        False = "False",
        Unknown = "Unknown",
    }
}

string_enum! {
    /// Container image pull policy.
    pub enum PullPolicy {
        Always = "Always",
        IfNotPresent = "IfNotPresent",
        Never = "Never",
    }
}

/// Schema for an embedded `ObjectMeta` (templates): KubeVirt's CRDs keep it as an open object
/// because the API server does not validate nested metadata anyway.
pub(crate) fn embedded_object_meta(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true
    })
}
