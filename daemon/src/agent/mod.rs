//! The daemon side of the guest agent: sessions over each VM's virtio-serial chardev socket.
//!
//! The closed protocol types are the `vmhost_agent_protocol` crate's, shared with the agent;
//! [`frame`] holds the pure framing and reply matching,
//! [`conn`] one synchronised session, [`error`] the error both of them report, and
//! [`supervisor`] keeps one session per running VM alive (reconnecting after guest reboots and
//! daemon restarts) and serves the `vm.guest_*` and `vm.check` calls through it.
//! [`exec`] is the other channel: one short session per call on the exec ports, for commands,
//! files, the clock, shutdown and SSH keys.

pub mod conn;
pub mod error;
pub mod exec;
pub mod frame;
pub mod supervisor;
