//! virt-launcher: turns a VirtualMachineInstance into a QEMU process and supervises it over QMP,
//! with a small HTTP+JSON command API on a unix socket. No libvirt.

pub mod accel;
pub mod child;
pub mod console;
pub mod convert;
pub mod error;
pub mod net;
pub mod paths;
pub mod pinning;
pub mod prepare;
pub mod probe;
pub mod qemu;
pub mod server;
pub mod state;
pub mod vm;
