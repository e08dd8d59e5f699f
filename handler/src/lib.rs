//! virt-handler: the node daemon. Turns the launcher's domain into VMI status, decides graceful
//! shutdown, heartbeats the node, talks to launchers over their unix sockets and serves VMI
//! consoles and lifecycle calls over mTLS.

pub mod deviceplugin;
pub mod devices;
pub mod events;
pub mod guestinfo;
pub mod heartbeat;
pub mod hotplug;
pub mod metrics;
pub mod migration;
pub mod mounts;
pub mod node;
pub mod nodelabeller;
pub mod rest;
pub mod server;
pub mod shutdown;
pub mod status;
pub mod vmistore;
pub mod volumes;
