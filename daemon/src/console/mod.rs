//! Interactive serial consoles (`vm.console`, docs/console.md): attach to a running VM's serial
//! port through the daemon's socket, watch it, type into it.
//!
//! QEMU's serial port is a socket chardev on a listening socket the daemon bound
//! ([`crate::qemu::argv`]), with QEMU's own `logfile` appending everything the guest prints to
//! the serial log, whether anyone is connected or not: the log and its cap
//! ([`crate::logcap`]) work as before, also while vmhostd is down. While at least one client is
//! attached, the daemon holds the one connection QEMU serves and fans it out ([`hub`]).
//!
//! Order of use: the RPC server hands a `vm.console` request to [`Consoles::attach`] (checks,
//! then the VM's [`hub::Hub`], connected on the first attach), answers it, and runs
//! [`session::run`] on the connection, now a byte stream, until the client detaches. The
//! client's side of the stream (terminal, `Ctrl-]`) is [`terminal`].

pub mod hub;
pub mod ring;
pub mod session;
pub mod terminal;

use crate::api::{ApiError, Code, ConsoleParams, VmStatus};
use crate::lifecycle::Manager;
use crate::qemu::argv::VmPaths;
use crate::rpc::auth::Role;
use hub::{Attachment, Hub, Mode, Peer};
use std::collections::HashMap;
use std::sync::Arc;

/// The consoles of every VM: at most one [`Hub`] per VM, while clients are attached.
#[derive(Debug)]
pub struct Consoles {
    manager: Arc<Manager>,
    /// Held while a hub connects, so two first clients never race for QEMU's one connection.
    hubs: tokio::sync::Mutex<HashMap<String, Arc<Hub>>>,
}

impl Consoles {
    /// The consoles of `manager`'s VMs.
    pub fn new(manager: Arc<Manager>) -> Arc<Consoles> {
        Arc::new(Consoles { manager, hubs: tokio::sync::Mutex::new(HashMap::new()) })
    }

    /// Attaches a client of `role` to the console of the VM `p.name`.
    ///
    /// # Errors
    /// 1002 (`field: read_only`) when a read-only peer asks to write; 4040 for no such VM;
    /// 4091 when it is not running or has no console socket; 4090 when another client writes
    /// and `p.force` is not set; 1003 when read-only peers hold every place they may have.
    pub async fn attach(&self, p: &ConsoleParams, role: Role, peer: Peer) -> Result<Attachment, ApiError> {
        if role == Role::ReadOnly && !p.read_only {
            return Err(ApiError::new(
                Code::ReadOnly,
                "this peer has read-only access: it may only watch a console (read_only: true)",
            )
            .field("read_only"));
        }
        let view = self.manager.get(&p.name)?;
        if view.status != VmStatus::Running {
            return Err(ApiError::new(
                Code::ConsoleUnavailable,
                format!("{} is {}: only a running VM has a console", p.name, view.status),
            )
            .field("name")
            .details(serde_json::json!({"status": view.status})));
        }
        let paths = VmPaths::for_vm(self.manager.config(), &p.name);
        let mode =
            if p.read_only { Mode::Watch { limited: role == Role::ReadOnly } } else { Mode::Write { force: p.force } };
        let mut hubs = self.hubs.lock().await;
        hubs.retain(|_, hub| hub.alive());
        // Twice at most: the hub found may end (its last client leaving) before this one joins.
        let mut attempts = 0;
        let attached = loop {
            attempts += 1;
            let hub = match hubs.get(&p.name) {
                Some(hub) => Arc::clone(hub),
                None => {
                    let hub = Hub::connect(&p.name, &paths.console, &paths.serial_log).await.map_err(|e| {
                        ApiError::new(
                            Code::ConsoleUnavailable,
                            format!(
                                "cannot connect to the console of {} ({e}); a VM started by a vmhostd without \
                                 consoles gets one at its next start",
                                p.name
                            ),
                        )
                        .field("name")
                    })?;
                    hubs.insert(p.name.clone(), Arc::clone(&hub));
                    hub
                }
            };
            match hub.join(mode, peer) {
                Err(e) if e.code == Code::ConsoleUnavailable && attempts < 2 => {
                    hubs.remove(&p.name);
                }
                joined => break joined?,
            }
        };
        tracing::info!(vm = %p.name, uid = peer.uid, pid = peer.pid, ?mode, "console client attached");
        Ok(attached)
    }
}
