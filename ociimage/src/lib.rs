//! OCI images without a container engine: reproducible layers built from file trees, image
//! layouts and archives (`skopeo`, `ctr images import` and `kind load image-archive` read them),
//! and the local image store localcluster's kubelet runs containers from.
//!
//! Reproducible means the same inputs give the same digests: tar entries are sorted, owned by
//! root with a zero modification time, gzip headers carry no time or name, and configs carry
//! no creation date.

mod digest;
mod layer;
mod layout;
mod reference;
mod store;

pub use digest::{Digest, DigestError};
pub use layer::{Compression, Node, Source, Tree};
pub use layout::{ANNOTATION_IMAGE_NAME, ImageSpec, Layout, LayoutError};
pub use reference::{Reference, ReferenceError};
pub use store::{Image, ImageConfig, Store, StoreError};
