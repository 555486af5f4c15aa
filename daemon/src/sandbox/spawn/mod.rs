//! Running programs: QEMU, modprobe and their `--version` probes.
//!
//! A sandboxed daemon cannot run them itself: its seccomp filter has no `execve`, and whatever it
//! started would inherit its filter, its Landlock domain and its capability bounding set. So when
//! the sandbox is on, [`crate::sandbox::enter`] forks a **spawner** before it confines the daemon. The
//! spawner is a small single-threaded process with its own, different confinement (its own
//! capabilities, see [`crate::sandbox::caps`], and its own Landlock domain, see [`crate::sandbox::landlock`]; no
//! seccomp filter, so QEMU is not bound to the daemon's syscall table). Every program it starts
//! but the image download gets a small filter of its own, [`crate::sandbox::child_seccomp`]: no IP
//! socket, whatever the kernel's Landlock and the unit's address families allow. It does one thing: on a
//! request over a `SOCK_SEQPACKET` socket pair it starts one of the programs it was configured to
//! allow, with the descriptors the daemon sent along (`SCM_RIGHTS`), and reports the pid (with a
//! pidfd) and later the exit status on a per-request reply socket.
//!
//! [`Command`] and [`Child`] are the daemon's side ([`client`]) and behave like tokio's: a captured stdout or
//! stderr is an async pipe, [`Child::wait`] returns the exit status, the child is killed when the
//! [`Child`] is dropped before it was waited for. Without a spawner (`sandbox = "off"`, and unit
//! tests) the same types start the program in-process with tokio.
//!
//! The spawner only runs programs on its allowlist (the configured `qemu.binary`, and `modprobe
//! vfio-pci` when passthrough is configured), with an empty environment except `PATH`, stdin on
//! `/dev/null` (curl alone gets its config there: [`Command::stdin_data`], checked with its
//! arguments). The QEMU binary always runs as `qemu.user`, whether it boots a VM or works on
//! an image file without a guest ([`crate::disk::offline_qemu`]). It also opens boot files, probes `/dev/kvm` as QEMU's user, and hands VFIO group nodes to
//! QEMU's group and back ([`vfio_node`]); those three are in [`requests`].
//!
//! The control socket is driven asynchronously ([`wire::Control`]): a full socket makes the sending
//! task wait on the reactor, never a runtime thread.
//!
//! **Every program starts in a session (and process group) of its own** (`setsid()` between
//! fork and exec, through the spawner and without one), so a signal meant for the daemon's
//! process group or terminal never reaches it: Ctrl-C on a vmhostd started from a shell, a
//! `kill -- -PGID` of its group, or the hang-up of its terminal end the daemon (and its spawner)
//! but no VM, and the next daemon adopts every QEMU as it was (docs/lifecycle.md). Only the
//! daemon decides when something it started dies: [`Child::start_kill`] and the kill on drop
//! signal one process (its pidfd or pid), never a group. This holds for the short-lived programs
//! too (QEMU writing an overlay without a guest, modprobe, the `--version` probes), for one rule
//! rather than a list of exceptions: a Ctrl-C meant for the daemon must not half-kill a QEMU
//! creating an overlay or a `modprobe` loading a module either. A daemon that dies while one runs leaves it
//! to finish by itself, as a `kill -9` of the daemon's pid always did, and a restart settles the
//! interrupted operation from its record. None of them has a controlling terminal (stdin is
//! `/dev/null`), so a new session costs nothing.
//!
//! ## The files, by role, lowest first
//!
//! Each file imports only those above it in this list (the crate's layers test,
//! `daemon/src/layers.rs`, fails on any import cycle):
//!
//! 1. [`setup`]: what a program gets between fork and exec, in either process (session,
//!    memlock, user and groups, stdin, passed descriptors). Knows nothing of the wire.
//! 2. [`wire`]: the protocol, both ends: requests, replies, the control socket and its
//!    per-request reply sockets.
//! 3. [`client`]: [`Command`] and [`Child`], the daemon's way to run a program; what the
//!    resource owners (image download, modprobe, QEMU, offline QEMU) use.
//! 4. [`requests`]: the spawner's other requests ([`boot_file`], [`kvm_access`],
//!    [`vfio_node`]), each with its in-process fallback; used by the lifecycle and preflight.
//! 5. [`server`]: the spawner process itself ([`Allowlist`], [`serve`]): checks every request
//!    and does the work, reaching into the owners (boot files, KVM probe, VFIO nodes, the
//!    download's argument check); only [`crate::sandbox`]'s start-up calls it.
//!
//! Callers keep using the paths `crate::sandbox::spawn::NAME`: everything they need is
//! re-exported here.

mod client;
mod requests;
mod server;
mod setup;
mod wire;

pub use crate::config::UserIds;
pub use client::{has_spawner, Child, Command, Pipe};
pub use requests::{boot_file, kvm_access, tpm_state_file, tpm_state_place, vfio_node, VFIO_NODE_MODES};
pub(crate) use server::serve;
pub use server::{Allowlist, MODPROBE};
pub(crate) use setup::become_user;
pub use setup::{FIRST_PASSED_FD, MAX_PASSED_FDS, MAX_STDIN};
pub use wire::NodeAccess;
pub(crate) use wire::{control_pair, install};

/// Process group and session of `pid` (fields 5 and 6 of /proc/PID/stat; `self` works).
#[cfg(test)]
fn pgrp_and_session(pid: &str) -> (i32, i32) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name (field 2) may hold spaces; the fields after it do not.
    let rest: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    (rest[2].parse().unwrap(), rest[3].parse().unwrap())
}

/// The `Cpus_allowed_list:` of process `pid` (`self` works).
#[cfg(test)]
fn cpus_allowed(pid: i32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim().to_string()
}
