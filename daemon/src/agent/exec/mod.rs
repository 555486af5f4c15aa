//! The exec ports: short sessions with `vmhost-agent --exec` in the guest, one per call, for
//! commands, files, the clock, shutdown and SSH keys (issue 29, docs/guest-exec.md).
//!
//! Separate from the agent session ([`super::supervisor`]) because these calls run as root in
//! the guest and may take long: each holds one of the VM's eight ports ([`slots`]) for its own
//! session ([`session`]: connect, sync, one request, its bulk bytes, its reply), so a command
//! never waits on the network agent, on another command, or on another VM. In order of use:
//! [`slots::ExecSlots::try_acquire`], then [`session::call`] (one typed request and reply) or
//! [`session::Session::open`] followed by [`session::Session::exec`], [`files::push`] or
//! [`files::pull`]; [`files::open_source`] first for a push whose bytes come from
//! `[agent] files_dir`. [`base64`] is how bulk bytes travel in JSON.

pub use vmhost_agent_protocol::base64;
pub mod files;
pub mod session;
pub mod slots;

#[cfg(test)]
mod tests;
