//! The daemon side of the guest agent: sessions over each VM's virtio-serial chardev socket.
//!
//! [`wire`] holds the closed protocol types, [`frame`] the pure framing and reply matching,
//! [`conn`] one synchronised session, and
//! [`supervisor`] keeps one session per running VM alive (reconnecting after guest reboots and
//! daemon restarts) and serves the `vm.guest_*` and `vm.check` calls through it.

pub mod conn;
pub mod frame;
pub mod supervisor;
pub mod wire;
