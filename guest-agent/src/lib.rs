//! vmhost guest agent: answers the host daemon's JSON-RPC requests on a virtio-serial port.
//!
//! The binary (`src/main.rs`) finds the port ([`port::find_port`]), opens it and runs a
//! [`port::Server`] with the [`agent::Agent`] methods; the server cuts the byte stream into frames
//! and hands each to [`protocol::handle_line`]. The methods read the network through
//! [`netlink`] and [`state`], check it ([`check`], with [`probe`] for the gateway) and change it
//! ([`apply`]). README.md documents the protocol and the reasoning behind it.
//!
//! The design is blocking and single-threaded on purpose: the agent answers one host, one request
//! at a time, and must fit a 2 MiB static binary and 4 MiB of RSS.

pub mod addr;
pub mod agent;
pub mod apply;
pub mod check;
pub mod freeze;
pub mod fuzz;
pub mod info;
pub mod netlink;
pub mod port;
pub mod probe;
pub mod protocol;
pub mod state;

/// Writes one line to stderr (the serial console in the test guest, the journal under systemd).
pub fn log(message: &str) {
    eprintln!("vmhost-agent: {message}");
}

#[cfg(test)]
mod kernel_tests;
