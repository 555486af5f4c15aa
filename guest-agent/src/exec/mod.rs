//! `vmhost-agent --exec`: the exec ports' server (issue 29): commands as root, files in and
//! out, the clock, shutdown and SSH keys, for the host's `vm.exec`, `vm.file_push`,
//! `vm.file_pull`, `vm.sync_time`, `vm.stop {method: "agent"}` and the spec's `ssh`.
//!
//! Why a mode of its own: the network agent runs sandboxed (no clock, no reboot, few
//! capabilities), and these methods are root's by nature, so they are served by a second
//! process of the same binary under its own unit (`vmhost-agent-exec.service`), on their own
//! ports `org.vmhost.exec.0..7` (one slot each, so eight requests run at once and none waits on
//! another or on the network agent).
//!
//! Order of use: `main.rs` starts one thread per port; each finds and opens its port
//! ([`crate::port`]) and runs a [`server::ExecServer`], which cuts the input into frames
//! ([`crate::protocol`]), answers `sync` and `hello`, and hands each real request to its
//! module: [`command`] (`exec`), [`files`] (`file.push`, `file.pull`), [`clock`] (`time.set`),
//! [`power`] (`guest.shutdown`), [`ssh`] (`ssh.authorize`, with [`accounts`]); bulk bytes go
//! through [`chunks`]. The protocol's shapes are `vmhost_agent_protocol::exec`.

pub mod accounts;
pub mod chunks;
pub mod clock;
pub mod command;
pub mod files;
pub mod power;
pub mod server;
pub mod ssh;
