//! vmhost: the host daemon's library.
//!
//! The tree is the table of contents. Pure planning lives in [`config`], [`hardware`],
//! [`validate`], [`capacity`], [`plan`] and [`placement`]'s allocator (which CPUs, NUMA nodes and
//! hugepages a VM's QEMU gets); each host resource has one owner ([`disk`] for
//! overlays, [`qemu`] for processes, [`state`] for records); only [`lifecycle`] coordinates them.
//! [`sandbox`] confines the daemon at start. [`rpc`] is the socket front end and [`client`] the matching client used by `vmhostctl`, the
//! benchmark and the tests; [`console`] serves the VMs' serial consoles through that socket.

pub mod agent;
pub mod api;
pub mod backup;
pub mod blocking;
pub mod capacity;
pub mod client;
pub mod config;
pub mod console;
pub mod crashpoint;
pub mod disk;
pub mod events;
pub mod fuzz;
pub mod guest_text;
pub mod hardware;
pub mod host_usage;
pub mod images;
pub mod ipv4;
#[cfg(test)]
mod layers;
pub mod lifecycle;
pub mod logcap;
pub mod migration;
pub mod net;
pub mod nic;
pub mod owner_errors;
pub mod pci;
pub mod placement;
pub mod plan;
pub mod preflight;
pub mod process;
pub mod qemu;
pub mod rpc;
pub mod sandbox;
pub mod seed;
pub mod state;
pub mod stats;
pub mod tpm;
pub mod validate;
