//! The guest agent protocol's message shapes: the `params` the daemon sends and the `result`s the
//! agent answers with, for every method of protocol version [`PROTOCOL_VERSION`].
//!
//! This crate exists so that the channel has one definition: the daemon (`vmhostd`) serializes
//! requests and parses replies with these types, the agent (`vmhost-agent`) parses requests and
//! serializes replies with the same ones, so the two sides cannot drift apart. It holds shapes only
//! (serde derives, no logic and no dependency but serde), because the agent is a small static binary.
//!
//! Every type is closed (`deny_unknown_fields`): the daemon treats what a guest writes as hostile
//! and refuses a reply with anything else in it rather than half-understanding it, and the agent
//! refuses an unknown request member with -32602. Where the two sides need different leniency the
//! type says so: the request types default their optional members (the agent accepts a partial
//! request, the daemon always sends every member), and [`DesiredInterface`] is generic over the
//! VLAN id's integer type.
//!
//! A member is added without breaking either side of a mixed pair (the daemon and the agent are
//! upgraded separately): a member the **daemon** sends is `#[serde(default)]` for the agent and
//! left out when it has its default value, and a daemon sends a non-default value only to an agent
//! whose `hello` lists the capability that introduced it (an older agent would refuse the unknown
//! member with -32602); a member the **agent** sends is `#[serde(default)]` for the daemon and
//! sent only when the request asked for it (an older daemon's closed types would refuse the
//! whole reply). Capture NICs (issue 31) are the first such addition: [`CAPTURE_CAPABILITY`].
//! The JSON framing, the JSON-RPC envelope and the methods themselves are
//! described in `guest-agent/README.md`. The one codec the shapes need, base64 for bulk bytes,
//! is here too ([`base64`]).

use serde::{Deserialize, Serialize};

pub mod base64;
pub mod exec;

/// The protocol version `hello` announces and the daemon requires; bumped on any incompatible
/// change.
pub const PROTOCOL_VERSION: u32 = 1;

/// The `hello` capability of agents that understand capture NICs: [`ExpectedNic::capture`],
/// [`ApplyParams::capture`] and [`NetStateParams::promisc`] (hence [`Interface::promisc`]). A
/// daemon sends none of these to an agent without it.
pub const CAPTURE_CAPABILITY: &str = "net.capture";

/// `serde`'s `skip_serializing_if` for members that are left out when false.
fn is_false(value: &bool) -> bool {
    !*value
}

/// Parameters of `sync`, the first request of a host session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncParams {
    /// A fresh value the agent echoes back, so the daemon can tell this session's answer from stale
    /// ones.
    pub nonce: String,
}

/// The reply of `sync`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncReply {
    /// The nonce of the request.
    pub nonce: String,
}

/// The reply of `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The agent's version (its crate version).
    pub agent_version: String,
    /// The protocol version the agent speaks ([`PROTOCOL_VERSION`] of the agent's build).
    pub protocol_version: u32,
    /// The method groups the agent serves (`agent.info`, `net.state`, ...).
    pub capabilities: Vec<String>,
}

/// The reply of `agent.info`, the daemon's liveness ping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentInfo {
    /// The agent's version (its crate version).
    pub version: String,
    /// The guest's host name (`/proc/sys/kernel/hostname`).
    pub hostname: String,
    /// The guest's kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// Whole seconds since the guest booted (`/proc/uptime`).
    pub uptime_s: u64,
    /// The kernel's random id of this boot (`/proc/sys/kernel/random/boot_id`): the host tells a
    /// guest reboot by it changing, which an uptime cannot tell when the reboot is fast.
    pub boot_id: String,
    /// The agent's own resident set size in KiB.
    pub rss_kib: u64,
    /// The guest's operating system: `PRETTY_NAME` of `/etc/os-release` (or
    /// `/usr/lib/os-release`), absent when neither names one (agents before issue 29 never send it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
}

/// The reply of `net.state`: the guest's network as the host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {
    /// Every link, in index order.
    pub interfaces: Vec<Interface>,
    /// IPv4 unicast routes of the main table.
    pub routes: Vec<RouteView>,
    /// The resolver configuration.
    pub dns: Dns,
}

/// One link as `net.state` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Interface {
    /// Interface name.
    pub name: String,
    /// Hardware address (`aa:bb:cc:dd:ee:ff`), empty for links without a six-byte one.
    pub mac: String,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    /// MTU in bytes.
    pub mtu: u32,
    /// Link kind (`vlan`, `dummy`, ...), empty for a plain device such as a hardware NIC.
    pub kind: String,
    /// Interface alias, empty when unset; `vmhost-agent` on links the agent created.
    pub alias: String,
    /// IPv4 addresses as `a.b.c.d/p`, in the kernel's order.
    pub addresses: Vec<String>,
    /// Promiscuous mode as set on the link (`IFF_PROMISC` of the link's flags: what
    /// `ip link set promisc on` sets, not the count packet sockets take). Present only when the
    /// request asked for it ([`NetStateParams::promisc`]): an older daemon's closed type would
    /// refuse the reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promisc: Option<bool>,
}

/// Parameters of `net.state` (older daemons send `{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetStateParams {
    /// Report [`Interface::promisc`] of every link. Sent only to agents with
    /// [`CAPTURE_CAPABILITY`].
    #[serde(default, skip_serializing_if = "is_false")]
    pub promisc: bool,
}

/// One route as `net.state` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteView {
    /// `default` or `a.b.c.d/p`.
    pub dst: String,
    /// Next hop, `null` for a directly connected network.
    pub gateway: Option<String>,
    /// Output interface name; empty for a multipath route (not decoded).
    pub dev: String,
}

/// The guest's resolver configuration (`/etc/resolv.conf`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dns {
    /// `nameserver` entries, in file order.
    pub servers: Vec<String>,
    /// The search list: the domains of the last `search` or `domain` line (as the resolver uses).
    pub search: Vec<String>,
}

/// Parameters of `net.check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckParams {
    /// What the host declared.
    pub expected: Expected,
}

/// The host's expectations for `net.check`, always derived from the VM's spec and record, never
/// from the guest. Every member is optional for the agent (an absent one is not checked); the
/// daemon sends them all.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    /// NICs, identified by MAC.
    #[serde(default)]
    pub interfaces: Vec<ExpectedNic>,
    /// The default gateway; `null` or absent: no route or probe check.
    #[serde(default)]
    pub gateway: Option<String>,
    /// DNS servers that must be configured (IPv4 or IPv6).
    #[serde(default)]
    pub dns: Vec<String>,
    /// Search domains that must be configured.
    #[serde(default)]
    pub search: Vec<String>,
    /// Send ICMP echo requests to the gateway.
    #[serde(default)]
    pub probe_gateway: bool,
}

/// One expected NIC of [`Expected`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedNic {
    /// Its MAC address (from the VM record).
    pub mac: String,
    /// IPv4 addresses (`a.b.c.d/p`) it must have (from the spec); absent: none.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Whether it must be administratively up; absent: `true`.
    #[serde(default = "yes")]
    pub up: bool,
    /// A capture NIC (a monitor NIC of the VM spec): checked up, promiscuous and without an IPv4
    /// address instead of the plain `up` check; `addresses` must then be empty and `up` true.
    /// Absent: `false`. Sent only to agents with [`CAPTURE_CAPABILITY`].
    #[serde(default, skip_serializing_if = "is_false")]
    pub capture: bool,
}

/// The default of [`ExpectedNic::up`].
fn yes() -> bool {
    true
}

/// The reply of `net.check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckReport {
    /// True when every check passed.
    pub ok: bool,
    /// Every check, in a stable order: NICs (presence, up, addresses), route, probe, DNS, search.
    pub checks: Vec<Check>,
}

/// One item of a [`CheckReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// What is checked, e.g. `address 10.0.0.5/24 on eth0`.
    pub name: String,
    /// Whether the observation matches.
    pub ok: bool,
    /// The expected value, from the host.
    pub expected: String,
    /// What the guest has.
    pub observed: String,
}

/// Parameters of `net.apply`: the complete desired set of agent-owned interfaces (an empty list
/// deletes every interface the agent made). `VlanId` as in [`DesiredInterface`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, bound(deserialize = "VlanId: Deserialize<'de>"))]
pub struct ApplyParams<VlanId> {
    /// The desired interfaces.
    pub interfaces: Vec<DesiredInterface<VlanId>>,
    /// The MACs of the capture NICs: each is set up and promiscuous (its addresses are never
    /// touched, and none is added). Absent: none. Sent only to agents with
    /// [`CAPTURE_CAPABILITY`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capture: Vec<String>,
}

/// One interface the agent is to create and prove: a VLAN when `link` and `vlan_id` are given, a
/// dummy otherwise (`guest_interfaces` in the VM spec).
///
/// `VlanId` is the integer type the VLAN id is parsed as, the one deliberate difference between
/// the sides: the daemon uses `u16`, so its spec parser refuses anything larger, while the agent
/// uses `i64` and then refuses any id outside 1..=4094 itself, with its 5100 error naming the field.
/// Both serialize the same JSON number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, bound(deserialize = "VlanId: Deserialize<'de>"))]
pub struct DesiredInterface<VlanId> {
    /// Interface name, 1 to 15 bytes.
    pub name: String,
    /// The link a VLAN sits on (e.g. `eth0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// The 802.1Q id, 1 to 4094, with `link`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_id: Option<VlanId>,
    /// Its one IPv4 address, `a.b.c.d/p`.
    pub address: String,
}

/// The reply of a successful `net.apply`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyReport {
    /// Whether anything was changed.
    pub changed: bool,
    /// Interfaces created.
    pub created: Vec<String>,
    /// Interfaces changed in place or recreated (a different kind, VLAN link or id).
    pub updated: Vec<String>,
    /// Owned interfaces deleted because they are no longer declared.
    pub deleted: Vec<String>,
}

/// Parameters of `fs.freeze`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeParams {
    /// The agent thaws by itself after this many seconds (1 to 60) if no `fs.thaw` came: a
    /// host that froze the guest and went away never leaves it frozen.
    pub timeout_s: u32,
}

/// The reply of `fs.freeze` and `fs.thaw`: the mount points frozen (or thawed), in order, and
/// (`fs.freeze`) the writable block-device file systems left unfrozen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeReport {
    /// The mount points.
    pub mounts: Vec<String>,
    /// `fs.freeze`: every writable file system on a block device the agent did not freeze (its
    /// kernel cannot freeze that type: `EOPNOTSUPP`), so that "all frozen" (`[]`) is told from
    /// "some skipped". Absent from `fs.thaw` and from agents that did not report it (a host must
    /// then not take the freeze for complete).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<Vec<FreezeSkip>>,
}

/// A writable file system on a block device that `fs.freeze` left unfrozen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeSkip {
    /// Its mount point.
    pub mount: String,
    /// Its type (`vfat`, ...).
    pub fstype: String,
    /// The errno `FIFREEZE` failed with (95, `EOPNOTSUPP`).
    pub errno: i32,
    /// The kernel's text for it (`Operation not supported (os error 95)`).
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_the_daemon_sends_the_agent_reads() {
        let sent = ApplyParams::<u16> {
            interfaces: vec![
                DesiredInterface {
                    name: "eth0.20".into(),
                    link: Some("eth0".into()),
                    vlan_id: Some(20),
                    address: "10.20.0.5/24".into(),
                },
                DesiredInterface { name: "d0".into(), link: None, vlan_id: None, address: "10.9.0.1/24".into() },
            ],
            capture: vec![],
        };
        let wire = serde_json::to_value(&sent).expect("serializes");
        assert_eq!(
            wire,
            json!({"interfaces": [
                {"name": "eth0.20", "link": "eth0", "vlan_id": 20, "address": "10.20.0.5/24"},
                {"name": "d0", "address": "10.9.0.1/24"}
            ]})
        );
        let read: ApplyParams<i64> = serde_json::from_value(wire).expect("parses");
        assert_eq!(read.interfaces[0].vlan_id, Some(20));
        // Only the agent's side takes an id outside u16.
        let big = json!({"name": "v", "link": "eth0", "vlan_id": 70000, "address": "10.9.0.1/24"});
        assert!(serde_json::from_value::<DesiredInterface<i64>>(big.clone()).is_ok());
        assert!(serde_json::from_value::<DesiredInterface<u16>>(big).is_err());
    }

    #[test]
    fn check_requests_default_for_the_agent_and_are_complete_from_the_daemon() {
        let read: CheckParams =
            serde_json::from_value(json!({"expected": {"interfaces": [{"mac": "m"}]}})).expect("parses");
        assert_eq!(
            read.expected.interfaces,
            [ExpectedNic { mac: "m".into(), addresses: vec![], up: true, capture: false }]
        );
        let sent = serde_json::to_value(CheckParams { expected: Expected::default() }).expect("serializes");
        assert_eq!(
            sent,
            json!({"expected": {"interfaces": [], "gateway": null, "dns": [], "search": [], "probe_gateway": false}})
        );
        // Closed, both ways.
        assert!(serde_json::from_value::<CheckParams>(json!({"expected": {}, "x": 1})).is_err());
        assert!(serde_json::from_value::<SyncReply>(json!({"nonce": "n", "x": 1})).is_err());
    }

    /// The shapes of a daemon and an agent from before capture NICs, as they were: closed, without
    /// the new members.
    mod before_capture {
        use serde::Deserialize;

        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        pub struct ExpectedNic {
            pub mac: String,
            #[serde(default)]
            pub addresses: Vec<String>,
            #[serde(default)]
            pub up: Option<bool>,
        }

        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        pub struct ApplyParams {
            pub interfaces: Vec<serde_json::Value>,
        }

        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        pub struct Interface {
            pub name: String,
            pub mac: String,
            pub up: bool,
            pub mtu: u32,
            pub kind: String,
            pub alias: String,
            pub addresses: Vec<String>,
        }

        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct NoParams {}
    }

    #[test]
    fn capture_members_reach_an_older_peer_only_when_it_asked_or_announced_them() {
        // A bridge NIC, no capture NICs, a net.state nobody asked promisc of: the wire is what it
        // was, so an older agent and an older daemon read it.
        let nic = ExpectedNic { mac: "m".into(), addresses: vec!["10.0.0.5/24".into()], up: true, capture: false };
        let wire = serde_json::to_value(&nic).expect("serializes");
        assert_eq!(wire, json!({"mac": "m", "addresses": ["10.0.0.5/24"], "up": true}));
        assert!(serde_json::from_value::<before_capture::ExpectedNic>(wire).is_ok());
        let apply = serde_json::to_value(ApplyParams::<u16> { interfaces: vec![], capture: vec![] }).expect("ser");
        assert_eq!(apply, json!({"interfaces": []}));
        assert!(serde_json::from_value::<before_capture::ApplyParams>(apply).is_ok());
        let ask = serde_json::to_value(NetStateParams::default()).expect("serializes");
        assert_eq!(ask, json!({}));
        assert!(serde_json::from_value::<before_capture::NoParams>(ask).is_ok());
        let link = Interface {
            name: "eth1".into(),
            mac: "m".into(),
            up: true,
            mtu: 1500,
            kind: String::new(),
            alias: String::new(),
            addresses: vec![],
            promisc: None,
        };
        let wire = serde_json::to_value(&link).expect("serializes");
        assert!(serde_json::from_value::<before_capture::Interface>(wire).is_ok());
        // The new members are what an older peer refuses: hence the capability and the request's
        // opt-in.
        let capture = ExpectedNic { mac: "m".into(), addresses: vec![], up: true, capture: true };
        let wire = serde_json::to_value(&capture).expect("serializes");
        assert_eq!(wire["capture"], true);
        assert!(serde_json::from_value::<before_capture::ExpectedNic>(wire.clone()).is_err());
        assert_eq!(serde_json::from_value::<ExpectedNic>(wire).expect("parses"), capture);
        let apply = ApplyParams::<u16> { interfaces: vec![], capture: vec!["m".into()] };
        let wire = serde_json::to_value(&apply).expect("serializes");
        assert!(serde_json::from_value::<before_capture::ApplyParams>(wire.clone()).is_err());
        assert_eq!(serde_json::from_value::<ApplyParams<i64>>(wire).expect("parses").capture, ["m"]);
        let ask = serde_json::to_value(NetStateParams { promisc: true }).expect("serializes");
        assert!(serde_json::from_value::<before_capture::NoParams>(ask.clone()).is_err());
        assert!(serde_json::from_value::<NetStateParams>(ask).expect("parses").promisc);
        let promisc = serde_json::to_value(Interface { promisc: Some(true), ..link }).expect("serializes");
        assert!(serde_json::from_value::<before_capture::Interface>(promisc.clone()).is_err());
        assert_eq!(serde_json::from_value::<Interface>(promisc).expect("parses").promisc, Some(true));
        // An older agent's reply and request shapes read with the new types.
        let old =
            json!({"name": "eth0", "mac": "m", "up": true, "mtu": 1500, "kind": "", "alias": "", "addresses": []});
        assert_eq!(serde_json::from_value::<Interface>(old).expect("parses").promisc, None);
        let old = serde_json::from_value::<ExpectedNic>(json!({"mac": "m"})).expect("parses");
        assert!(!old.capture);
        assert!(serde_json::from_value::<ApplyParams<i64>>(json!({"interfaces": []}))
            .expect("parses")
            .capture
            .is_empty());
    }

    #[test]
    fn a_freeze_report_without_skipped_is_told_from_one_that_skipped_nothing() {
        let old: FreezeReport = serde_json::from_value(json!({"mounts": ["/"]})).expect("parses");
        assert_eq!(old.skipped, None, "an agent that does not say what it skipped");
        let none: FreezeReport = serde_json::from_value(json!({"mounts": ["/"], "skipped": []})).expect("parses");
        assert_eq!(none.skipped, Some(vec![]));
        let skip = FreezeSkip {
            mount: "/boot/efi".into(),
            fstype: "vfat".into(),
            errno: 95,
            error: "Operation not supported (os error 95)".into(),
        };
        let report = FreezeReport { mounts: vec!["/".into()], skipped: Some(vec![skip]) };
        let wire = serde_json::to_value(&report).expect("serializes");
        assert_eq!(wire["skipped"][0]["errno"], 95);
        assert_eq!(serde_json::from_value::<FreezeReport>(wire).expect("parses"), report);
        // A thaw's report has no member for it.
        let thaw = serde_json::to_value(FreezeReport { mounts: vec![], skipped: None }).expect("serializes");
        assert_eq!(thaw, json!({"mounts": []}));
        assert!(serde_json::from_value::<FreezeSkip>(
            json!({"mount": "/", "fstype": "x", "errno": 1, "error": "e", "y": 1})
        )
        .is_err());
    }
}
