//! The owner of host networking: the bridges of configured networks and the taps of VM NICs.
//!
//! Order of use: [`HostNet::connect`] once at daemon start, then [`HostNet::ensure_networks`]
//! (bridges exist, owned ones configured) and [`HostNet::remove_orphans`] (links carrying a VM
//! marker whose VM has no live QEMU) before the socket is served. Per VM start,
//! [`HostNet::attach_nics`] makes the taps and returns their fds for QEMU; after a stop or
//! destroy, [`HostNet::detach_nics`] removes whatever is left.
//!
//! A bridge NIC's tap is a port of its network's bridge: an access port (`vlan`) and/or a trunk
//! (`vlans` tagged, or `trunk`: every VLAN 1-4094 tagged). A monitor NIC's tap (`mode =
//! "monitor"`) is on no bridge and never gets an address: it only receives the copies of its
//! source's frames that `net::capture` mirrors into it, so it takes the source's MTU, has IPv6
//! address generation off (no link-local address, so the host sends nothing into it of its own),
//! and a drop filter on its ingress throws away whatever the guest sends.
//!
//! Every link vmhostd creates carries an ifalias marker ([`owner_alias`]); a link without one is
//! never changed or deleted. Taps are not persistent: they vanish when the last fd closes, so a
//! QEMU or daemon that dies cannot leave one behind on its own (a monitor tap's qdisc and drop
//! filter go with it).

use super::link::{LinkInfo, Netlink, VlanSet};
use super::tap::create_tap_queues;
use super::tc::Hook;
use super::NetError;
use super::{owner_alias, parse_owner, Owner};
use crate::api::{NicMode, NicSpec};
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
        /// The step (`bridge`, `tap`, `alias`, `mtu`, `attach`, `vlan`, `trunk`, `up`; for a
        /// monitor NIC `source`, `tap`, `alias`, `mtu`, `ipv6`, `drop`, `up`).
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
            if !net.trunk.is_empty() {
                let tagged = VlanSet::new(net.trunk.iter().copied()).map_err(|e| e.to_string())?;
                self.nl.bridge_vlan_add_tagged(u.index, &tagged).await.map_err(|e| e.to_string())?;
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
    /// `nics[i].mode` decides what a tap is: a bridge port, or a monitor tap (on no bridge; the
    /// copies of its source's frames are added later by `net::capture`).
    /// On error, every tap made so far is gone (its fds are dropped) and nothing else changed.
    ///
    /// # Errors
    /// [`AttachError::NoNetwork`] for a network the config lacks, [`AttachError::Step`] naming
    /// the step and the NIC (step `source` with [`NetError::NotFound`] when a monitor NIC's
    /// source does not exist).
    pub async fn attach_nics(
        &self,
        config: &Config,
        vm: &str,
        nics: &[NicSpec],
        allocs: &[NicAlloc],
    ) -> Result<Vec<Vec<OwnedFd>>, AttachError> {
        let mut fds = Vec::with_capacity(nics.len());
        for (i, (nic, alloc)) in nics.iter().zip(allocs).enumerate() {
            let made = match nic.mode {
                NicMode::Bridge => {
                    let net = config
                        .networks
                        .get(&nic.network)
                        .ok_or_else(|| AttachError::NoNetwork { nic: i, network: nic.network.clone() })?;
                    self.attach_one(vm, net, nic, alloc).await
                }
                NicMode::Monitor => self.attach_monitor(vm, nic, alloc).await,
            };
            let fd = made.map_err(|(step, source)| AttachError::Step { nic: i, step, source })?;
            fds.push(fd);
        }
        Ok(fds)
    }

    /// Makes the tap `alloc.tap` for `vm`, marked as the VM's, and returns its descriptors and
    /// what the kernel says of it.
    async fn make_tap(
        &self,
        vm: &str,
        nic: &NicSpec,
        alloc: &NicAlloc,
    ) -> Result<(Vec<OwnedFd>, LinkInfo), (&'static str, NetError)> {
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
        Ok((fd, tap))
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
        let (fd, tap) = self.make_tap(vm, nic, alloc).await?;
        self.nl.set_mtu(tap.index, bridge.mtu).await.map_err(|e| ("mtu", e))?;
        self.nl.set_master(tap.index, bridge.index).await.map_err(|e| ("attach", e))?;
        if let Some(vid) = nic.vlan {
            // The tap is an access port: untagged frames enter VLAN `vid`, and leave untagged.
            self.nl.bridge_vlan_add(tap.index, vid, true).await.map_err(|e| ("vlan", e))?;
            let _ = self.nl.bridge_vlan_del(tap.index, 1).await;
        }
        if let Some(tagged) = trunk_vlans(nic).map_err(|e| ("trunk", e))? {
            self.nl.bridge_vlan_add_tagged(tap.index, &tagged).await.map_err(|e| ("trunk", e))?;
        }
        self.nl.set_up(tap.index).await.map_err(|e| ("up", e))?;
        Ok(fd)
    }

    /// A monitor NIC's tap: no bridge, the source's MTU (a copy as large as the source takes in
    /// must fit), no IPv6 (set before up, so it never has a link-local address and the host
    /// sends it nothing of its own), and a drop filter on its ingress (what the guest sends goes
    /// nowhere). Only then up.
    async fn attach_monitor(
        &self,
        vm: &str,
        nic: &NicSpec,
        alloc: &NicAlloc,
    ) -> Result<Vec<OwnedFd>, (&'static str, NetError)> {
        let name = nic.source.as_deref().unwrap_or_default();
        let source = self
            .nl
            .link_by_name(name)
            .await
            .map_err(|e| ("source", e))?
            .ok_or_else(|| ("source", NetError::NotFound(format!("capture source {name}"))))?;
        let (fd, tap) = self.make_tap(vm, nic, alloc).await?;
        self.nl.set_mtu(tap.index, source.mtu).await.map_err(|e| ("mtu", e))?;
        self.nl.set_ipv6_off(tap.index).await.map_err(|e| ("ipv6", e))?;
        self.nl.add_clsact(tap.index).await.map_err(|e| ("drop", e))?;
        self.nl.add_drop_all(tap.index, Hook::Ingress).await.map_err(|e| ("drop", e))?;
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

/// The VLANs a bridge NIC's tap carries tagged: every VLAN with `trunk`, else `vlans`; without
/// the port's PVID (the access `vlan`, or the default VLAN 1), which keeps its untagged PVID
/// entry. `None` when the NIC is no trunk.
fn trunk_vlans(nic: &NicSpec) -> Result<Option<VlanSet>, NetError> {
    let set = if nic.trunk {
        VlanSet::all()
    } else if nic.vlans.is_empty() {
        return Ok(None);
    } else {
        VlanSet::new(nic.vlans.iter().copied())?
    };
    Ok(Some(set.without(nic.vlan.unwrap_or(1))))
}

/// The marker of a bridge vmhostd owns for network `name`.
fn owner_alias_network(name: &str) -> String {
    owner_alias(&Owner::Network(name.to_string()))
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::process::Command;

    use super::super::tc::ETH_P_ALL;
    use super::super::testing::{in_netns, read_test_frames, send_frame, test_frame, write_tap};
    use super::*;

    fn config() -> Config {
        let text = "[hardware]\ncpu = 4\nmemory_gib = 8\n[networks.lan]\nbridge = \"br-lan\"\n";
        Config::parse(text, Path::new("t.toml")).unwrap()
    }

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn alloc(tap: &str) -> NicAlloc {
        NicAlloc { mac: "02:00:00:00:00:10".into(), tap: tap.into(), vhost: false }
    }

    fn monitor(source: &str) -> NicSpec {
        NicSpec { mode: NicMode::Monitor, source: Some(source.into()), ..NicSpec::default() }
    }

    #[test]
    fn a_monitor_tap_is_on_no_bridge_quiet_and_drops_what_the_guest_sends() {
        in_netns(|| async {
            let net = HostNet::connect().unwrap();
            let nl = net.netlink();
            ip(&["link", "add", "eth7", "mtu", "9000", "type", "veth", "peer", "name", "eth7p"]);
            let fds = net.attach_nics(&config(), "cap", &[monitor("eth7")], &[alloc("vmhmon0n0")]).await.unwrap();
            assert_eq!(fds.len(), 1);
            let tap = nl.link_by_name("vmhmon0n0").await.unwrap().unwrap();
            assert_eq!(parse_owner(tap.alias.as_deref().unwrap()), Some(Owner::Vm("cap".into())));
            assert_eq!(tap.master, None, "never enslaved");
            assert_eq!(tap.mtu, 9000, "the source's MTU");
            assert!(tap.up);
            assert_eq!(nl.addresses(tap.index).await.unwrap(), [], "no address, not even fe80");
            assert!(nl.has_clsact(tap.index).await.unwrap());
            let drops = nl.filters(tap.index, Hook::Ingress).await.unwrap();
            assert_eq!(drops.len(), 1, "{drops:?}");
            assert_eq!(
                (drops[0].id.kind.as_str(), drops[0].id.protocol, drops[0].cookie.as_ref()),
                ("bpf", ETH_P_ALL, None)
            );
            // Nothing the source has changed.
            let src = nl.link_by_name("eth7").await.unwrap().unwrap();
            assert!(!src.promisc && !nl.has_clsact(src.index).await.unwrap());

            // What the guest writes is dropped at the tap's ingress. The drop filter has no action
            // to count it, the clsact qdisc does.
            let frame = test_frame([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], None, &[1; 46]);
            write_tap(&fds[0][0], &frame);
            let shown = Command::new("tc").args(["-s", "qdisc", "show", "dev", "vmhmon0n0"]).output().unwrap();
            let shown = String::from_utf8_lossy(&shown.stdout).into_owned();
            assert!(shown.contains("dropped 1"), "{shown}");

            // A copy put into the tap by a mirror reaches the guest's side.
            nl.set_up(src.index).await.unwrap();
            nl.set_up(nl.link_by_name("eth7p").await.unwrap().unwrap().index).await.unwrap();
            nl.add_clsact(src.index).await.unwrap();
            nl.add_mirror(src.index, Hook::Ingress, 0, tap.index, b"vmhcmon0n0").await.unwrap();
            send_frame("eth7p", &frame);
            assert_eq!(read_test_frames(&fds[0][0], 1, std::time::Duration::from_secs(10)), [frame]);

            // The tap, its qdisc and its filter go with the descriptor.
            drop(fds);
            crate::net::testing::wait_link_gone(nl, "vmhmon0n0").await;
        });
    }

    #[test]
    fn a_missing_source_fails_at_step_source_and_leaves_no_tap() {
        in_netns(|| async {
            let net = HostNet::connect().unwrap();
            let nl = net.netlink();
            ip(&["link", "add", "eth7", "type", "veth", "peer", "name", "eth7p"]);
            let nics = [monitor("eth7"), monitor("eth8")];
            let err = net.attach_nics(&config(), "cap", &nics, &[alloc("vmhmon0n0"), alloc("vmhmon0n1")]).await;
            let Err(AttachError::Step { nic: 1, step: "source", source: NetError::NotFound(what) }) = err else {
                panic!("{err:?}")
            };
            assert!(what.contains("eth8"), "{what}");
            assert_eq!(nl.link_by_name("vmhmon0n1").await.unwrap(), None, "never made");
            crate::net::testing::wait_link_gone(nl, "vmhmon0n0").await;
        });
    }

    #[test]
    fn bridge_nics_with_tagged_vlans_need_vlan_filtering_here() {
        in_netns(|| async {
            let net = HostNet::connect().unwrap();
            net.netlink().create_bridge("br-lan", false, "").await.unwrap();
            let plain = NicSpec { network: "lan".into(), ..NicSpec::default() };
            let fds =
                net.attach_nics(&config(), "vm", std::slice::from_ref(&plain), &[alloc("vmhbr0n0")]).await.unwrap();
            drop(fds);
            for nic in [NicSpec { trunk: true, ..plain.clone() }, NicSpec { vlans: vec![10, 20], ..plain.clone() }] {
                let err = net.attach_nics(&config(), "vm", &[nic], &[alloc("vmhbr0n1")]).await;
                let Err(AttachError::Step { nic: 0, step: "trunk", source: NetError::Unsupported { .. } }) = err else {
                    panic!("{err:?}")
                };
            }
        });
    }

    #[test]
    fn trunk_vlans_leave_the_pvid_alone() {
        let nic = |vlan, vlans: Vec<u16>, trunk| NicSpec { vlan, vlans, trunk, ..NicSpec::default() };
        assert_eq!(trunk_vlans(&nic(None, vec![], false)).unwrap(), None);
        assert_eq!(trunk_vlans(&nic(None, vec![], true)).unwrap().unwrap().ranges(), [(2, 4094)]);
        assert_eq!(trunk_vlans(&nic(Some(5), vec![], true)).unwrap().unwrap().ranges(), [(1, 4), (6, 4094)]);
        assert_eq!(trunk_vlans(&nic(Some(5), vec![10, 11], false)).unwrap().unwrap().ranges(), [(10, 11)]);
        assert_eq!(trunk_vlans(&nic(None, vec![1, 7], false)).unwrap().unwrap().ranges(), [(7, 7)]);
        assert!(matches!(trunk_vlans(&nic(None, vec![4095], false)), Err(NetError::InvalidVlan(4095))));
    }
}
