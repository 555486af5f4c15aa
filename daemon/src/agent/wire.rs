//! The guest agent's protocol types, as the daemon sends and accepts them.
//!
//! Replies are closed types (`deny_unknown_fields`): a guest that sends anything else gets its
//! reply refused, never half-understood. Nothing in them is ever used as a host path or to pick
//! a host action; they are only shown to the operator or compared with the spec.

use serde::{Deserialize, Serialize};

/// Reply to `sync`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncReply {
    /// The nonce the daemon sent.
    pub nonce: String,
}

/// Reply to `hello`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// Agent version.
    pub agent_version: String,
    /// Protocol version (1).
    pub protocol_version: u32,
    /// Methods the agent serves.
    pub capabilities: Vec<String>,
}

/// Reply to `agent.info`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentInfo {
    /// Agent version.
    pub version: String,
    /// Guest hostname.
    pub hostname: String,
    /// Guest kernel release.
    pub kernel: String,
    /// Guest uptime.
    pub uptime_s: u64,
    /// The guest kernel's id of this boot; a new one means the guest rebooted.
    pub boot_id: String,
    /// The agent's own memory use.
    pub rss_kib: u64,
}

/// One guest interface in `net.state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestInterface {
    /// Name.
    pub name: String,
    /// MAC address.
    pub mac: String,
    /// Administratively and operationally up.
    pub up: bool,
    /// MTU.
    pub mtu: u32,
    /// Link kind (`vlan`, `dummy`, or empty).
    pub kind: String,
    /// ifalias (`vmhost-agent` on links the agent made).
    pub alias: String,
    /// IPv4 addresses `a.b.c.d/p`.
    pub addresses: Vec<String>,
}

/// One guest route.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestRoute {
    /// `default` or `a.b.c.d/p`.
    pub dst: String,
    /// Next hop.
    pub gateway: Option<String>,
    /// Interface.
    pub dev: String,
}

/// Guest DNS configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestDns {
    /// Name servers.
    pub servers: Vec<String>,
    /// Search domains.
    pub search: Vec<String>,
}

/// Reply to `net.state`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {
    /// Interfaces.
    pub interfaces: Vec<GuestInterface>,
    /// IPv4 routes.
    pub routes: Vec<GuestRoute>,
    /// resolv.conf.
    pub dns: GuestDns,
}

/// What a NIC should look like, sent with `net.check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedNic {
    /// MAC (from the VM record).
    pub mac: String,
    /// Addresses (from the spec).
    pub addresses: Vec<String>,
    /// Must be up.
    pub up: bool,
}

/// `net.check` expectations: always derived from the spec, never from the guest.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expected {
    /// NICs.
    pub interfaces: Vec<ExpectedNic>,
    /// Default gateway.
    pub gateway: Option<String>,
    /// DNS servers.
    pub dns: Vec<String>,
    /// Search domains.
    pub search: Vec<String>,
    /// Ping the gateway.
    pub probe_gateway: bool,
}

/// One check result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Passed.
    pub ok: bool,
    /// Expected value.
    pub expected: String,
    /// Observed value.
    pub observed: String,
}

/// Reply to `net.check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckReport {
    /// All checks passed.
    pub ok: bool,
    /// The checks.
    pub checks: Vec<Check>,
}

/// A guest interface the agent creates (`guest_interfaces` in the spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestInterfaceSpec {
    /// Interface name, 1-15 characters.
    pub name: String,
    /// Lower link for a VLAN.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// VLAN id, with `link`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan_id: Option<u16>,
    /// Address `a.b.c.d/p`.
    pub address: String,
}

/// Reply to `net.apply`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyReport {
    /// Something changed.
    pub changed: bool,
    /// Created.
    pub created: Vec<String>,
    /// Updated.
    pub updated: Vec<String>,
    /// Deleted.
    pub deleted: Vec<String>,
}
