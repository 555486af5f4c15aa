//! The owner of host networking: the bridges of configured networks and the taps of VM NICs.
//!
//! Order of use: [`HostNet::connect`] once at daemon start, then [`HostNet::ensure_networks`]
//! (bridges exist, owned ones configured) and [`HostNet::remove_orphans`] (links carrying a VM
//! marker whose VM has no live QEMU) before the socket is served. Per VM start,
//! [`HostNet::attach_nics`] makes the taps and returns their fds for QEMU; after a stop or
//! destroy, [`HostNet::detach_nics`] removes whatever is left.
//!
//! Every link vmhostd creates carries an ifalias marker ([`owner_alias`]); a link without one is
//! never changed or deleted. Taps are not persistent: they vanish when the last fd closes, so a
//! QEMU or daemon that dies cannot leave one behind on its own.

use super::link::{LinkInfo, Netlink};
use super::tap::create_tap_queues;
use super::NetError;
use super::{owner_alias, parse_owner, Owner};
use crate::api::NicSpec;
use crate::config::{Config, Network};
use crate::nic::NicAlloc;
use std::collections::HashSet;
use std::os::fd::OwnedFd;

/// What `ensure_networks` found for one network, for `host.check` and `host.info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkState {
    /// Network name.
    pub name: String,
    /// True when the bridge exists and, if vmhostd owns it, is configured.
    pub ready: bool,
    /// What happened or what is wrong.
    pub detail: String,
}

/// Why a VM's NICs could not be attached ([`HostNet::attach_nics`]). The API codes are given at
/// the boundary (`crate::owner_errors`).
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// NIC `nic` names a network the config does not define.
    #[error("no network {network:?}")]
    NoNetwork {
        /// The NIC's index in `spec.nics`.
        nic: usize,
        /// The network it names.
        network: String,
    },
    /// A host step for NIC `nic` failed; the taps made so far are gone.
    #[error("host networking failed at {step}: {source}")]
    Step {
        /// The NIC's index in `spec.nics`.
        nic: usize,
        /// The step (`bridge`, `tap`, `alias`, `mtu`, `attach`, `vlan`, `up`).
        step: &'static str,
        /// What the kernel said.
        #[source]
        source: NetError,
    },
}

/// Host networking through one netlink connection.
pub struct HostNet {
    nl: Netlink,
}

impl HostNet {
    /// Opens the netlink connection.
    ///
    /// # Errors
    /// The netlink socket cannot be opened.
    pub fn connect() -> Result<HostNet, NetError> {
        Ok(HostNet { nl: Netlink::connect()? })
    }

    /// The netlink connection, for read-only queries of other owners (host usage checks).
    pub fn netlink(&self) -> &Netlink {
        &self.nl
    }

    /// Makes every configured network usable: owned bridges (`create = true`) are created or
    /// adopted (only when they carry our marker) and configured; external bridges must exist.
    pub async fn ensure_networks(&self, config: &Config) -> Vec<NetworkState> {
        let mut out = Vec::new();
        for net in config.networks.values() {
            let state = match self.ensure_network(net).await {
                Ok(detail) => NetworkState { name: net.name.clone(), ready: true, detail },
                Err(detail) => {
                    tracing::error!(network = %net.name, %detail, "network not usable");
                    NetworkState { name: net.name.clone(), ready: false, detail }
                }
            };
            out.push(state);
        }
        out
    }

    /// Reports whether each network's bridge is present (and, for owned bridges, marked as
    /// ours) without changing anything: what `host.check` shows.
    pub async fn probe_networks(&self, config: &Config) -> Vec<NetworkState> {
        let mut out = Vec::new();
        for net in config.networks.values() {
            let (ready, detail) = match self.nl.link_by_name(&net.bridge).await {
                Ok(Some(l)) if l.kind.as_deref() != Some("bridge") => {
                    (false, format!("{} is a {:?}, not a bridge", net.bridge, l.kind))
                }
                Ok(Some(l)) if net.create && l.alias.as_deref() != Some(owner_alias_network(&net.name).as_str()) => {
                    (false, format!("{} exists without vmhostd's marker", net.bridge))
                }
                Ok(Some(l)) => (true, format!("bridge {} present, {}", net.bridge, if l.up { "up" } else { "down" })),
                Ok(None) => (false, format!("bridge {} does not exist", net.bridge)),
                Err(e) => (false, format!("cannot look up {}: {e}", net.bridge)),
            };
            out.push(NetworkState { name: net.name.clone(), ready, detail });
        }
        out
    }

    async fn ensure_network(&self, net: &Network) -> Result<String, String> {
        let existing = self.nl.link_by_name(&net.bridge).await.map_err(|e| e.to_string())?;
        if !net.create {
            return match existing {
                Some(l) if l.kind.as_deref() == Some("bridge") => Ok(format!("bridge {} present", net.bridge)),
                Some(l) => Err(format!("{} exists but is a {:?}, not a bridge", net.bridge, l.kind)),
                None => Err(format!("bridge {} does not exist (create = false)", net.bridge)),
            };
        }
        let marker = owner_alias_network(&net.name);
        let (bridge, verb) = match existing {
            Some(l) if l.alias.as_deref() == Some(marker.as_str()) => (l, "adopted"),
            Some(_) => {
                return Err(format!(
                    "{} exists without vmhostd's marker; refusing to take it over (set create = false to use it)",
                    net.bridge
                ))
            }
            None => {
                let l =
                    self.nl.create_bridge(&net.bridge, net.vlan_filtering, &marker).await.map_err(|e| e.to_string())?;
                (l, "created")
            }
        };
        if let Some(mtu) = net.mtu {
            if bridge.mtu != mtu {
                self.nl.set_mtu(bridge.index, mtu).await.map_err(|e| e.to_string())?;
            }
        }
        if let Some(addr) = net.address {
            let have = self.nl.addresses(bridge.index).await.map_err(|e| e.to_string())?;
            if !have.iter().any(|(a, p)| *a == std::net::IpAddr::V4(addr.addr) && *p == addr.prefix) {
                self.nl.add_address(bridge.index, addr.addr, addr.prefix).await.map_err(|e| e.to_string())?;
            }
        }
        if let Some(uplink) = &net.uplink {
            let u = self
                .nl
                .link_by_name(uplink)
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("uplink {uplink} does not exist"))?;
            if u.master != Some(bridge.index) {
                self.nl.set_master(u.index, bridge.index).await.map_err(|e| e.to_string())?;
            }
            for vid in &net.trunk {
                self.nl.bridge_vlan_add(u.index, *vid, false).await.map_err(|e| e.to_string())?;
            }
            self.nl.set_up(u.index).await.map_err(|e| e.to_string())?;
        }
        self.nl.set_up(bridge.index).await.map_err(|e| e.to_string())?;
        Ok(format!("bridge {} {verb}", net.bridge))
    }

    /// Deletes links that carry a VM marker for a VM not in `live_vms` (taps of a QEMU that is
    /// gone). Links without our marker are never touched. Returns the names deleted.
    pub async fn remove_orphans(&self, live_vms: &HashSet<String>) -> Vec<String> {
        let links = match self.nl.links().await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot list links for orphan cleanup");
                return Vec::new();
            }
        };
        let mut removed = Vec::new();
        for l in links {
            let Some(Owner::Vm(vm)) = l.alias.as_deref().and_then(parse_owner) else { continue };
            if live_vms.contains(&vm) {
                continue;
            }
            match self.nl.delete_link(l.index).await {
                Ok(()) => {
                    tracing::info!(link = %l.name, vm = %vm, "removed orphaned link");
                    removed.push(l.name);
                }
                Err(e) => tracing::warn!(link = %l.name, error = %e, "cannot remove orphaned link"),
            }
        }
        removed
    }

    /// Creates and attaches the taps of a VM's NICs; returns their fds in NIC order, for QEMU:
    /// one per queue of each NIC (`nics[i].queues`, a multiqueue tap above 1), queue 0 first.
    /// On error, every tap made so far is gone (its fds are dropped) and nothing else changed.
    ///
    /// # Errors
    /// [`AttachError::NoNetwork`] for a network the config lacks, [`AttachError::Step`] naming
    /// the step and the NIC.
    pub async fn attach_nics(
        &self,
        config: &Config,
        vm: &str,
        nics: &[NicSpec],
        allocs: &[NicAlloc],
    ) -> Result<Vec<Vec<OwnedFd>>, AttachError> {
        let mut fds = Vec::with_capacity(nics.len());
        for (i, (nic, alloc)) in nics.iter().zip(allocs).enumerate() {
            let net = config
                .networks
                .get(&nic.network)
                .ok_or_else(|| AttachError::NoNetwork { nic: i, network: nic.network.clone() })?;
            let fd = self.attach_one(vm, net, nic, alloc).await.map_err(|(step, source)| AttachError::Step {
                nic: i,
                step,
                source,
            })?;
            fds.push(fd);
        }
        Ok(fds)
    }

    async fn attach_one(
        &self,
        vm: &str,
        net: &Network,
        nic: &NicSpec,
        alloc: &NicAlloc,
    ) -> Result<Vec<OwnedFd>, (&'static str, NetError)> {
        let bridge: LinkInfo = self
            .nl
            .link_by_name(&net.bridge)
            .await
            .map_err(|e| ("bridge", e))?
            .ok_or_else(|| ("bridge", NetError::NotFound(net.bridge.clone())))?;
        // A stale tap of this VM (say from a QEMU that just died) would make TUNSETIFF attach to
        // it; remove it first, but only if it is ours.
        if let Some(old) = self.nl.link_by_name(&alloc.tap).await.map_err(|e| ("tap", e))? {
            match old.alias.as_deref().and_then(parse_owner) {
                Some(Owner::Vm(owner)) if owner == vm => {
                    self.nl.delete_link(old.index).await.map_err(|e| ("tap", e))?
                }
                _ => return Err(("tap", NetError::Exists(alloc.tap.clone()))),
            }
        }
        let fd = create_tap_queues(&alloc.tap, nic.queues).map_err(|e| ("tap", e))?;
        let tap = self
            .nl
            .link_by_name(&alloc.tap)
            .await
            .map_err(|e| ("tap", e))?
            .ok_or_else(|| ("tap", NetError::NotFound(alloc.tap.clone())))?;
        self.nl.set_alias(tap.index, &owner_alias(&Owner::Vm(vm.to_string()))).await.map_err(|e| ("alias", e))?;
        self.nl.set_mtu(tap.index, bridge.mtu).await.map_err(|e| ("mtu", e))?;
        self.nl.set_master(tap.index, bridge.index).await.map_err(|e| ("attach", e))?;
        if let Some(vid) = nic.vlan {
            // The tap is an access port: untagged frames enter VLAN `vid`, and leave untagged.
            self.nl.bridge_vlan_add(tap.index, vid, true).await.map_err(|e| ("vlan", e))?;
            let _ = self.nl.bridge_vlan_del(tap.index, 1).await;
        }
        self.nl.set_up(tap.index).await.map_err(|e| ("up", e))?;
        Ok(fd)
    }

    /// Removes any link still carrying `vm`'s marker (normally none: taps vanish with QEMU).
    pub async fn detach_nics(&self, vm: &str) {
        let Ok(links) = self.nl.links().await else { return };
        for l in links {
            if let Some(Owner::Vm(owner)) = l.alias.as_deref().and_then(parse_owner) {
                if owner == vm {
                    if let Err(e) = self.nl.delete_link(l.index).await {
                        tracing::warn!(link = %l.name, error = %e, "cannot remove the VM's link");
                    }
                }
            }
        }
    }

    /// Names of the taps present for `vm` (for tests and `host.info`).
    pub async fn vm_links(&self, vm: &str) -> Vec<String> {
        let Ok(links) = self.nl.links().await else { return Vec::new() };
        links
            .into_iter()
            .filter(|l| matches!(l.alias.as_deref().and_then(parse_owner), Some(Owner::Vm(o)) if o == vm))
            .map(|l| l.name)
            .collect()
    }
}

/// The marker of a bridge vmhostd owns for network `name`.
fn owner_alias_network(name: &str) -> String {
    owner_alias(&Owner::Network(name.to_string()))
}
