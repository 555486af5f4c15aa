//! `net.apply`: makes the guest's VLAN and dummy interfaces what the host declared, and proves it.
//!
//! The rules (the same as empeira's guest-interface reconciler):
//! - the agent owns exactly the links whose `ifalias` is [`MARKER`]; it never changes, deletes or
//!   readdresses any other link, in particular not the primary NICs and their addresses. The one
//!   exception are the capture NICs the request names by MAC (`capture`: monitor NICs on the
//!   host, which carry copies of another network's frames): the agent sets them up and
//!   promiscuous (virtio-net passes only the guest's own unicast otherwise) and never adds,
//!   removes or changes an address on them;
//! - the request is the whole desired set: owned links that are not in it are deleted (that is how
//!   removal works), so the same request twice changes nothing the second time;
//! - names, VLAN ids and addresses are validated against the rules and the current state before
//!   anything changes, and refused with 5100 naming the field;
//! - the intent (the request's list) is saved to `intent.json` before any change;
//! - afterwards everything is read back and verified (kind, VLAN parent and id, address, alias, UP,
//!   default routes and the addresses of links the agent does not own unchanged); a failure is
//!   5101 naming what failed.
//!
//! Order of use: [`validate`] and [`validate_capture`] (pure, on a [`Snapshot`]), [`plan`] and
//! [`plan_capture`] (pure: the [`Step`]s from the snapshot to the desired state), [`save_intent`],
//! [`execute`] (netlink), then [`verify`] and [`verify_capture`] (pure, on a second snapshot). [`apply`] runs the whole sequence. A failure half-way is not rolled back: the
//! kernel state is whatever the completed steps made it (the error lists them), and the next apply
//! reconciles from there.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;

use serde_json::json;

use crate::addr::Ipv4Net;
use crate::netlink::{Netlink, NetlinkError};
use crate::protocol::{RpcError, APPLY_FAILED};
use crate::state::Snapshot;

/// The `ifalias` of every link the agent creates, and the only sign that a link is the agent's.
pub const MARKER: &str = "vmhost-agent";

/// Longest interface name the kernel accepts, in bytes.
pub const MAX_NAME: usize = 15;

/// Most interfaces one request may declare (keeps replies and verification bounded).
pub const MAX_INTERFACES: usize = 64;

/// Names never accepted, whatever the state: the loopback device and the two names the kernel uses
/// for per-protocol settings directories (`/proc/sys/net/ipv4/conf/{all,default}`).
const RESERVED_NAMES: [&str; 3] = ["lo", "all", "default"];

/// Parameters of `net.apply`, with the VLAN id parsed as any integer so that [`validate`] refuses
/// an id outside 1..=4094 with 5100 naming the field (the daemon sends `u16`; the JSON is the same).
pub type ApplyParams = vmhost_agent_protocol::ApplyParams<i64>;

/// One desired interface of [`ApplyParams`].
pub type DesiredInterface = vmhost_agent_protocol::DesiredInterface<i64>;

pub use vmhost_agent_protocol::ApplyReport;

/// The type of a desired interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// A dummy link.
    Dummy,
    /// An 802.1Q VLAN.
    Vlan {
        /// Name of the lower link.
        parent: String,
        /// Index of the lower link.
        parent_index: u32,
        /// VLAN id, 1 to 4094.
        vlan_id: u16,
    },
}

/// A desired interface, validated against the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// Interface name.
    pub name: String,
    /// Dummy or VLAN.
    pub kind: Kind,
    /// Its address.
    pub address: Ipv4Net,
}

/// One change, in execution order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Delete an owned link (no longer declared, or to be recreated with another kind).
    Delete {
        /// Its name.
        name: String,
        /// Its index.
        index: u32,
    },
    /// Create a link (down) and mark it with [`MARKER`].
    Create {
        /// Its name.
        name: String,
        /// Dummy or VLAN.
        kind: Kind,
    },
    /// Remove an address from an owned link.
    DeleteAddress {
        /// The link.
        name: String,
        /// The address.
        address: Ipv4Net,
    },
    /// Add an address to an owned link.
    AddAddress {
        /// The link.
        name: String,
        /// The address.
        address: Ipv4Net,
    },
    /// Set a link up: an owned one, or a capture NIC.
    SetUp {
        /// The link.
        name: String,
    },
    /// Set a capture NIC promiscuous.
    SetPromisc {
        /// The link.
        name: String,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Delete { name, .. } => write!(f, "delete {name}"),
            Step::Create { name, kind: Kind::Dummy } => write!(f, "create dummy {name}"),
            Step::Create { name, kind: Kind::Vlan { parent, vlan_id, .. } } => {
                write!(f, "create vlan {name} on {parent} id {vlan_id}")
            }
            Step::DeleteAddress { name, address } => write!(f, "remove {address} from {name}"),
            Step::AddAddress { name, address } => write!(f, "add {address} to {name}"),
            Step::SetUp { name } => write!(f, "set {name} up"),
            Step::SetPromisc { name } => write!(f, "set {name} promiscuous"),
        }
    }
}

impl Step {
    /// The interface the step changes.
    fn interface(&self) -> &str {
        match self {
            Step::Delete { name, .. }
            | Step::Create { name, .. }
            | Step::DeleteAddress { name, .. }
            | Step::AddAddress { name, .. }
            | Step::SetUp { name }
            | Step::SetPromisc { name } => name,
        }
    }
}

/// The steps from a snapshot to the desired state, and what they amount to.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// The changes, in order: deletions first (freeing names and VLAN ids), then each desired
    /// interface's creation, address removals, address additions and UP.
    pub steps: Vec<Step>,
    /// What the reply reports.
    pub report: ApplyReportLists,
}

/// The name lists of an [`ApplyReport`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ApplyReportLists {
    /// Created.
    pub created: Vec<String>,
    /// Updated or recreated.
    pub updated: Vec<String>,
    /// Deleted.
    pub deleted: Vec<String>,
}

/// True when `name` is acceptable to the kernel's `dev_valid_name` and to the agent: 1 to 15
/// bytes, not `.` or `..`, without `/`, `:`, `%` (a kernel-chosen name), NUL or whitespace.
fn name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_NAME {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is reserved")
    } else if name.contains(['/', ':', '%', '\0']) || name.chars().any(char::is_whitespace) {
        Some("contains '/', ':', '%', NUL or whitespace")
    } else if RESERVED_NAMES.contains(&name) {
        Some("is reserved")
    } else {
        None
    }
}

/// True when the two networks share an address.
fn overlaps(a: Ipv4Net, b: Ipv4Net) -> bool {
    let bits = a.prefix.min(b.prefix);
    let mask = if bits == 0 { 0 } else { u32::MAX << (32 - u32::from(bits)) };
    u32::from(a.addr) & mask == u32::from(b.addr) & mask
}

/// Why `address` cannot be an interface address, if it cannot.
fn address_problem(address: Ipv4Net) -> Option<&'static str> {
    let ip = address.addr;
    if address.prefix == 0 {
        Some("a /0 address would route everything through the interface")
    } else if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() || ip.is_broadcast() || ip.octets()[0] == 0 {
        Some("is not a unicast host address")
    } else {
        None
    }
}

/// Checks `params` against the naming rules and the current `state`.
///
/// # Errors
/// 5100 with `data.field` naming the member (`interfaces[2].vlan_id`, ...): an invalid or reserved
/// name; a name held by a link the agent does not own; a duplicate name, VLAN or address; `link`
/// without `vlan_id` or the reverse; a VLAN id outside 1..=4094; a `link` that does not exist, is
/// the agent's own or is `lo`; a VLAN that already exists under an unowned name; an address that is
/// malformed, not a unicast host address, or overlaps the network of an unowned link's address.
pub fn validate(params: &ApplyParams, state: &Snapshot) -> Result<Vec<Desired>, RpcError> {
    if params.interfaces.len() > MAX_INTERFACES {
        return Err(RpcError::invalid("interfaces", format!("at most {MAX_INTERFACES} interfaces per request")));
    }
    let unowned: Vec<_> = state.links.iter().filter(|l| l.alias != MARKER).collect();
    let unowned_networks: Vec<(Ipv4Net, String)> = state
        .addresses
        .iter()
        .filter(|a| unowned.iter().any(|l| l.index == a.index))
        .map(|a| (Ipv4Net { addr: a.addr, prefix: a.prefix }, state.name_of(a.index)))
        .collect();
    let mut out: Vec<Desired> = Vec::with_capacity(params.interfaces.len());
    for (i, want) in params.interfaces.iter().enumerate() {
        let field = |member: &str| format!("interfaces[{i}].{member}");
        let refuse = |member: &str, why: String| {
            let field = field(member);
            Err(RpcError::invalid(&field, format!("{field}: {why}")))
        };
        let name = &want.name;
        if let Some(problem) = name_problem(name) {
            return refuse("name", format!("interface name {name:?} {problem}"));
        }
        if out.iter().any(|d| &d.name == name) {
            return refuse("name", format!("{name} is declared twice"));
        }
        if unowned.iter().any(|l| &l.name == name) {
            return refuse("name", format!("{name} exists and is not the agent's (no {MARKER} alias)"));
        }
        let kind = match (&want.link, want.vlan_id) {
            (None, None) => Kind::Dummy,
            (Some(_), None) => return refuse("vlan_id", "a VLAN needs vlan_id along with link".into()),
            (None, Some(_)) => return refuse("link", "a VLAN needs link along with vlan_id".into()),
            (Some(parent), Some(vlan_id)) => {
                let Some(vlan_id) = u16::try_from(vlan_id).ok().filter(|v| (1..=4094).contains(v)) else {
                    return refuse("vlan_id", format!("VLAN id {vlan_id} is outside 1..=4094"));
                };
                let Some(lower) = state.link(parent) else {
                    return refuse("link", format!("no interface {parent:?}"));
                };
                if lower.alias == MARKER || parent == "lo" {
                    return refuse("link", format!("{parent} cannot carry VLANs (loopback or the agent's own)"));
                }
                let twin = out.iter().find(|d| {
                    matches!(&d.kind, Kind::Vlan { parent_index, vlan_id: v, .. } if *parent_index == lower.index && *v == vlan_id)
                });
                if let Some(twin) = twin {
                    return refuse("vlan_id", format!("VLAN {vlan_id} on {parent} is also declared as {}", twin.name));
                }
                let existing = unowned.iter().find(|l| l.parent == Some(lower.index) && l.vlan_id == Some(vlan_id));
                if let Some(existing) = existing {
                    return refuse(
                        "vlan_id",
                        format!(
                            "VLAN {vlan_id} on {parent} already exists as {}, which is not the agent's",
                            existing.name
                        ),
                    );
                }
                Kind::Vlan { parent: parent.clone(), parent_index: lower.index, vlan_id }
            }
        };
        let address = match want.address.parse::<Ipv4Net>() {
            Ok(address) => address,
            Err(e) => return refuse("address", format!("{:?}: {e}", want.address)),
        };
        if let Some(problem) = address_problem(address) {
            return refuse("address", format!("{address} {problem}"));
        }
        if let Some(other) = out.iter().find(|d| d.address.addr == address.addr) {
            return refuse("address", format!("{} is also declared on {}", address.addr, other.name));
        }
        if let Some((net, owner)) = unowned_networks.iter().find(|(net, _)| overlaps(*net, address)) {
            return refuse("address", format!("{address} overlaps {net} on {owner}, which is not the agent's"));
        }
        out.push(Desired { name: name.clone(), kind, address });
    }
    Ok(out)
}

/// The steps that take `state` to `desired` (validated against the same `state`).
pub fn plan(desired: &[Desired], state: &Snapshot) -> Plan {
    let mut out = Plan::default();
    let owned: Vec<_> = state.links.iter().filter(|l| l.alias == MARKER).collect();
    let matches = |link: &crate::netlink::Link, kind: &Kind| match kind {
        Kind::Dummy => link.kind == "dummy",
        Kind::Vlan { parent_index, vlan_id, .. } => {
            link.kind == "vlan" && link.parent == Some(*parent_index) && link.vlan_id == Some(*vlan_id)
        }
    };
    // Deletions first: they free names and VLAN ids the creations may need.
    for link in &owned {
        match desired.iter().find(|d| d.name == link.name) {
            None => {
                out.steps.push(Step::Delete { name: link.name.clone(), index: link.index });
                out.report.deleted.push(link.name.clone());
            }
            Some(want) if !matches(link, &want.kind) => {
                out.steps.push(Step::Delete { name: link.name.clone(), index: link.index });
            }
            Some(_) => {}
        }
    }
    for want in desired {
        let existing = owned.iter().find(|l| l.name == want.name);
        let mut steps = Vec::new();
        match existing {
            Some(link) if matches(link, &want.kind) => {
                for address in state.addresses_of(link.index) {
                    if address != want.address {
                        steps.push(Step::DeleteAddress { name: want.name.clone(), address });
                    }
                }
                if !state.addresses_of(link.index).contains(&want.address) {
                    steps.push(Step::AddAddress { name: want.name.clone(), address: want.address });
                }
                if !link.up {
                    steps.push(Step::SetUp { name: want.name.clone() });
                }
                if !steps.is_empty() {
                    out.report.updated.push(want.name.clone());
                }
            }
            _ => {
                steps.push(Step::Create { name: want.name.clone(), kind: want.kind.clone() });
                steps.push(Step::AddAddress { name: want.name.clone(), address: want.address });
                steps.push(Step::SetUp { name: want.name.clone() });
                if existing.is_some() {
                    out.report.updated.push(want.name.clone());
                } else {
                    out.report.created.push(want.name.clone());
                }
            }
        }
        out.steps.extend(steps);
    }
    out
}

/// A capture NIC of the request, as found in the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureNic {
    /// The guest's name for it.
    pub name: String,
    /// Its index.
    pub index: u32,
}

/// Finds the capture NICs `params.capture` names by MAC: the plain device (no link kind, as a
/// virtio NIC) with that MAC, else another link with it that is neither a VLAN (which shares its
/// parent's MAC) nor one of the agent's own.
///
/// # Errors
/// 5100 with `data.field` `capture[i]`: more than [`MAX_INTERFACES`], a malformed MAC, a MAC
/// listed twice, or no such link with that MAC.
pub fn validate_capture(params: &ApplyParams, state: &Snapshot) -> Result<Vec<CaptureNic>, RpcError> {
    if params.capture.len() > MAX_INTERFACES {
        return Err(RpcError::invalid("capture", format!("at most {MAX_INTERFACES} capture NICs per request")));
    }
    let mut out: Vec<CaptureNic> = Vec::with_capacity(params.capture.len());
    for (i, mac) in params.capture.iter().enumerate() {
        let field = format!("capture[{i}]");
        let mac = crate::addr::parse_mac(mac).map_err(|e| RpcError::invalid(&field, format!("{field}: {e}")))?;
        let text = crate::addr::format_mac(&mac);
        let candidates = || state.links.iter().filter(|l| l.mac == Some(mac) && l.name != "lo" && l.alias != MARKER);
        let nic = candidates().find(|l| l.kind.is_empty()).or_else(|| candidates().find(|l| l.kind != "vlan"));
        let Some(link) = nic else {
            return Err(RpcError::invalid(&field, format!("{field}: no NIC with MAC {text}")));
        };
        if out.iter().any(|c| c.index == link.index) {
            return Err(RpcError::invalid(&field, format!("{field}: {text} is listed twice")));
        }
        out.push(CaptureNic { name: link.name.clone(), index: link.index });
    }
    Ok(out)
}

/// The steps that make each capture NIC promiscuous and up, and the names of those that change.
pub fn plan_capture(capture: &[CaptureNic], state: &Snapshot) -> (Vec<Step>, Vec<String>) {
    let mut steps = Vec::new();
    let mut changed = Vec::new();
    for nic in capture {
        let Some(link) = state.links.iter().find(|l| l.index == nic.index) else { continue };
        let before = steps.len();
        if !link.promisc {
            steps.push(Step::SetPromisc { name: nic.name.clone() });
        }
        if !link.up {
            steps.push(Step::SetUp { name: nic.name.clone() });
        }
        if steps.len() > before {
            changed.push(nic.name.clone());
        }
    }
    (steps, changed)
}

/// One sentence per capture NIC that is not up and promiscuous in `after`.
pub fn verify_capture(capture: &[CaptureNic], after: &Snapshot) -> Vec<String> {
    let mut failures = Vec::new();
    for nic in capture {
        match after.links.iter().find(|l| l.index == nic.index) {
            None => failures.push(format!("capture {}: missing", nic.name)),
            Some(link) => {
                if !link.up {
                    failures.push(format!("capture {}: not up", nic.name));
                }
                if !link.promisc {
                    failures.push(format!("capture {}: not promiscuous", nic.name));
                }
            }
        }
    }
    failures
}

/// Saves `params` as the intent at `path` (atomically: a temporary file, fsync, rename), creating
/// its directory with mode 0700. An identical file is left alone.
///
/// # Errors
/// The I/O error of the first step that failed.
pub fn save_intent(path: &Path, params: &ApplyParams) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let mut text = serde_json::to_vec_pretty(params).map_err(std::io::Error::other)?;
    text.push(b'\n');
    if std::fs::read(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(&text)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// A step that failed during [`execute`].
#[derive(Debug, thiserror::Error)]
#[error("{step}: {source}")]
pub struct StepError {
    /// The step.
    pub step: Step,
    /// The steps completed before it.
    pub completed: Vec<String>,
    /// The kernel's answer.
    #[source]
    pub source: NetlinkError,
}

/// Runs `steps` through `netlink`, in order, starting from the link indices in `state`.
///
/// A created link is marked right away; if marking fails it is deleted again, so the agent never
/// leaves behind a link it could no longer recognise as its own.
///
/// # Errors
/// [`StepError`] for the first step the kernel refused.
pub fn execute(steps: &[Step], netlink: &mut Netlink, state: &Snapshot) -> Result<(), Box<StepError>> {
    let mut index: BTreeMap<String, u32> = state.links.iter().map(|l| (l.name.clone(), l.index)).collect();
    let mut completed = Vec::new();
    for step in steps {
        let lookup = |index: &BTreeMap<String, u32>, name: &str| {
            index.get(name).copied().ok_or(NetlinkError::Malformed { op: "look up link", what: "link not found" })
        };
        let result = match step {
            Step::Delete { name, index: i } => netlink.delete_link(*i).map(|()| {
                index.remove(name);
            }),
            Step::Create { name, kind } => create_marked(netlink, name, kind).map(|i| {
                index.insert(name.clone(), i);
            }),
            Step::DeleteAddress { name, address } => {
                lookup(&index, name).and_then(|i| netlink.delete_address(i, address.addr, address.prefix))
            }
            Step::AddAddress { name, address } => {
                lookup(&index, name).and_then(|i| netlink.add_address(i, address.addr, address.prefix))
            }
            Step::SetUp { name } => lookup(&index, name).and_then(|i| netlink.set_up(i, true)),
            Step::SetPromisc { name } => lookup(&index, name).and_then(|i| netlink.set_promisc(i, true)),
        };
        if let Err(source) = result {
            return Err(Box::new(StepError { step: step.clone(), completed, source }));
        }
        completed.push(step.to_string());
    }
    Ok(())
}

/// Creates a link, finds its index and marks it; deletes it again if marking fails.
///
/// One exception to "only links the agent created": loading the dummy driver (which the kernel
/// does on the first dummy request) makes the driver create `dummy0` by itself (its `numdummies`
/// parameter defaults to 1), so the agent's own request for `dummy0` then fails with `EEXIST`. A
/// dummy with the requested name that is down, unmarked and without addresses right after that
/// failure (and that the plan did not see, or it would have refused the name) is that side effect
/// of the agent's request: it is adopted, i.e. marked and used.
fn create_marked(netlink: &mut Netlink, name: &str, kind: &Kind) -> Result<u32, NetlinkError> {
    let created = match kind {
        Kind::Dummy => netlink.create_dummy(name),
        Kind::Vlan { parent_index, vlan_id, .. } => netlink.create_vlan(name, *parent_index, *vlan_id),
    };
    if let Err(e) = created {
        let adopted = match (&e, kind) {
            (NetlinkError::Kernel { errno: libc::EEXIST, .. }, Kind::Dummy) => driver_made_dummy(netlink, name)?,
            _ => None,
        };
        let Some(index) = adopted else { return Err(e) };
        netlink.set_alias(index, MARKER)?;
        return Ok(index);
    }
    let link = netlink
        .link_by_name(name)?
        .ok_or(NetlinkError::Malformed { op: "create link", what: "the new link is not there" })?;
    if let Err(e) = netlink.set_alias(link.index, MARKER) {
        // Best effort: the original error is the one to report.
        let _ = netlink.delete_link(link.index);
        return Err(e);
    }
    Ok(link.index)
}

/// The index of `name` if it is a pristine dummy (down, unmarked, no IPv4 address): what the dummy
/// driver creates by itself when it is loaded.
fn driver_made_dummy(netlink: &mut Netlink, name: &str) -> Result<Option<u32>, NetlinkError> {
    let Some(link) = netlink.link_by_name(name)? else { return Ok(None) };
    let pristine = link.kind == "dummy" && link.alias.is_empty() && !link.up;
    if !pristine || netlink.addresses()?.iter().any(|a| a.index == link.index) {
        return Ok(None);
    }
    Ok(Some(link.index))
}

/// Compares the state after an apply with the desired state and with the state before; returns
/// one sentence per difference (empty when everything verified).
pub fn verify(desired: &[Desired], before: &Snapshot, after: &Snapshot) -> Vec<String> {
    let mut failures = Vec::new();
    for want in desired {
        let Some(link) = after.link(&want.name) else {
            failures.push(format!("{}: missing", want.name));
            continue;
        };
        match &want.kind {
            Kind::Dummy if link.kind != "dummy" => {
                failures.push(format!("{}: kind is {:?}, expected dummy", want.name, link.kind));
            }
            Kind::Vlan { parent, parent_index, vlan_id } => {
                if link.kind != "vlan" || link.parent != Some(*parent_index) || link.vlan_id != Some(*vlan_id) {
                    failures.push(format!(
                        "{}: expected vlan {vlan_id} on {parent}, found kind {:?} id {:?} on {}",
                        want.name,
                        link.kind,
                        link.vlan_id,
                        link.parent.map_or_else(|| "none".to_string(), |p| after.name_of(p))
                    ));
                }
            }
            Kind::Dummy => {}
        }
        if link.alias != MARKER {
            failures.push(format!("{}: alias is {:?}, expected {MARKER:?}", want.name, link.alias));
        }
        let addresses = after.addresses_of(link.index);
        if addresses != [want.address] {
            let found: Vec<String> = addresses.iter().map(Ipv4Net::to_string).collect();
            failures.push(format!("{}: addresses are [{}], expected [{}]", want.name, found.join(", "), want.address));
        }
        if !link.up {
            failures.push(format!("{}: not up", want.name));
        }
    }
    for link in after.links.iter().filter(|l| l.alias == MARKER) {
        if !desired.iter().any(|d| d.name == link.name) {
            failures.push(format!("{}: still present though not declared", link.name));
        }
    }
    let defaults = |s: &Snapshot| -> BTreeSet<(Option<Ipv4Addr>, Option<String>, u32)> {
        s.default_routes().iter().map(|r| (r.gateway, r.oif.map(|i| s.name_of(i)), r.priority)).collect()
    };
    if defaults(before) != defaults(after) {
        failures.push(format!("default routes changed: {:?} -> {:?}", defaults(before), defaults(after)));
    }
    for link in before.links.iter().filter(|l| l.alias != MARKER) {
        let was = before.addresses_of(link.index);
        let now = after.link(&link.name).map(|l| after.addresses_of(l.index)).unwrap_or_default();
        if was != now {
            failures.push(format!("{}: addresses of an interface the agent does not own changed", link.name));
        }
    }
    failures
}

/// Validates, plans, saves the intent, executes and verifies; the whole of `net.apply`.
///
/// `snapshot` reads the kernel state (called before and after the changes).
///
/// # Errors
/// 5100 from [`validate`]; 5101 when the intent cannot be saved (`data.step` = `intent`), a step
/// fails (`data.step`, `data.interface`, `data.errno`, `data.completed`), or verification finds
/// differences (`data.step` = `verify`, `data.failures`); -32603 when the state cannot be read.
pub fn apply(params: &ApplyParams, netlink: &mut Netlink, intent: &Path) -> Result<ApplyReport, RpcError> {
    let read = |netlink: &mut Netlink| {
        Snapshot::take(netlink).map_err(|e| RpcError::internal(format!("cannot read the network state: {e}")))
    };
    let before = read(netlink)?;
    let desired = validate(params, &before)?;
    let capture = validate_capture(params, &before)?;
    let mut plan = plan(&desired, &before);
    let (capture_steps, capture_changed) = plan_capture(&capture, &before);
    plan.steps.extend(capture_steps);
    plan.report.updated.extend(capture_changed);
    save_intent(intent, params).map_err(|e| RpcError {
        code: APPLY_FAILED,
        message: format!("cannot save the intent to {}: {e}", intent.display()),
        data: Some(json!({ "step": "intent", "detail": e.to_string() })),
    })?;
    if let Err(e) = execute(&plan.steps, netlink, &before) {
        return Err(RpcError {
            code: APPLY_FAILED,
            message: format!("net.apply failed at {e}"),
            data: Some(json!({
                "step": e.step.to_string(),
                "interface": e.step.interface(),
                "errno": e.source.errno(),
                "detail": e.source.to_string(),
                "completed": e.completed,
            })),
        });
    }
    let after = read(netlink)?;
    let mut failures = verify(&desired, &before, &after);
    failures.extend(verify_capture(&capture, &after));
    if !failures.is_empty() {
        return Err(RpcError {
            code: APPLY_FAILED,
            message: format!("net.apply did not verify: {}", failures.join("; ")),
            data: Some(json!({ "step": "verify", "failures": failures })),
        });
    }
    let lists = plan.report;
    Ok(ApplyReport {
        changed: !plan.steps.is_empty(),
        created: lists.created,
        updated: lists.updated,
        deleted: lists.deleted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{Address, Link, Route};
    use crate::protocol::{parse_params, INVALID_SEMANTICS};
    use serde_json::Value;

    fn link(index: u32, name: &str, kind: &str, alias: &str) -> Link {
        Link {
            index,
            name: name.into(),
            kind: kind.into(),
            alias: alias.into(),
            up: true,
            mtu: 1500,
            ..Link::default()
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("test address")
    }

    fn address(index: u32, s: &str) -> Address {
        let n = net(s);
        Address { index, addr: n.addr, prefix: n.prefix }
    }

    /// lo, eth0 with 10.0.2.15/24 and a default route, and an operator's own dummy.
    fn base() -> Snapshot {
        Snapshot {
            links: vec![link(1, "lo", "", ""), link(2, "eth0", "", ""), link(3, "mine", "dummy", "operator")],
            addresses: vec![address(1, "127.0.0.1/8"), address(2, "10.0.2.15/24")],
            routes: vec![Route {
                dst: Ipv4Addr::UNSPECIFIED,
                dst_len: 0,
                gateway: Some(Ipv4Addr::new(10, 0, 2, 2)),
                oif: Some(2),
                priority: 0,
            }],
        }
    }

    /// `base()` plus what applying the standard request creates.
    fn applied() -> Snapshot {
        let mut s = base();
        let mut vlan = link(10, "eth0.20", "vlan", MARKER);
        vlan.parent = Some(2);
        vlan.vlan_id = Some(20);
        s.links.push(vlan);
        s.links.push(link(11, "dummy0", "dummy", MARKER));
        s.addresses.push(address(10, "10.20.0.5/24"));
        s.addresses.push(address(11, "192.168.50.1/32"));
        s
    }

    fn params(value: Value) -> ApplyParams {
        parse_params(Some(value)).expect("well-typed")
    }

    fn standard() -> ApplyParams {
        params(serde_json::json!({"interfaces": [
            {"name": "eth0.20", "link": "eth0", "vlan_id": 20, "address": "10.20.0.5/24"},
            {"name": "dummy0", "address": "192.168.50.1/32"}
        ]}))
    }

    fn steps(p: &Plan) -> Vec<String> {
        p.steps.iter().map(Step::to_string).collect()
    }

    #[test]
    fn first_apply_creates_marks_addresses_and_raises() {
        let state = base();
        let desired = validate(&standard(), &state).expect("valid");
        let p = plan(&desired, &state);
        assert_eq!(
            steps(&p),
            [
                "create vlan eth0.20 on eth0 id 20",
                "add 10.20.0.5/24 to eth0.20",
                "set eth0.20 up",
                "create dummy dummy0",
                "add 192.168.50.1/32 to dummy0",
                "set dummy0 up",
            ]
        );
        assert_eq!(p.report.created, ["eth0.20", "dummy0"]);
        assert!(p.report.updated.is_empty() && p.report.deleted.is_empty());
        // What it produces verifies.
        assert_eq!(verify(&desired, &state, &applied()), Vec::<String>::new());
    }

    #[test]
    fn second_apply_changes_nothing() {
        let state = applied();
        let desired = validate(&standard(), &state).expect("valid");
        assert_eq!(plan(&desired, &state), Plan::default());
    }

    #[test]
    fn undeclared_owned_links_are_deleted_and_foreign_ones_kept() {
        let state = applied();
        let p = plan(&validate(&params(serde_json::json!({"interfaces": []})), &state).expect("valid"), &state);
        assert_eq!(steps(&p), ["delete eth0.20", "delete dummy0"]);
        assert_eq!(p.report.deleted, ["eth0.20", "dummy0"]);
        // "mine" (alias "operator") and eth0 are never in a plan.
        assert!(p.steps.iter().all(|s| !matches!(s.interface(), "mine" | "eth0" | "lo")));
    }

    #[test]
    fn changes_in_place_and_recreations_are_updates() {
        let mut state = applied();
        // dummy0 is down and has a stray second address; eth0.20 must move to VLAN 21.
        state.links.iter_mut().filter(|l| l.name == "dummy0").for_each(|l| l.up = false);
        state.addresses.push(address(11, "192.168.50.2/32"));
        let request = params(serde_json::json!({"interfaces": [
            {"name": "eth0.20", "link": "eth0", "vlan_id": 21, "address": "10.20.0.5/24"},
            {"name": "dummy0", "address": "192.168.50.1/32"}
        ]}));
        let p = plan(&validate(&request, &state).expect("valid"), &state);
        assert_eq!(
            steps(&p),
            [
                "delete eth0.20",
                "create vlan eth0.20 on eth0 id 21",
                "add 10.20.0.5/24 to eth0.20",
                "set eth0.20 up",
                "remove 192.168.50.2/32 from dummy0",
                "set dummy0 up",
            ]
        );
        assert_eq!(p.report.updated, ["eth0.20", "dummy0"]);
        assert!(p.report.created.is_empty() && p.report.deleted.is_empty());
        // A new address: the old one goes first (deleting a primary address after adding a
        // secondary in the same subnet would take the secondary with it).
        let request = params(serde_json::json!({"interfaces": [{"name": "dummy0", "address": "192.168.50.9/32"}]}));
        let state = applied();
        let p = plan(&validate(&request, &state).expect("valid"), &state);
        assert_eq!(
            steps(&p),
            ["delete eth0.20", "remove 192.168.50.1/32 from dummy0", "add 192.168.50.9/32 to dummy0"]
        );
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let state = applied();
        let field = |value: Value| {
            let e = validate(&params(value), &state).expect_err("refused");
            assert_eq!(e.code, INVALID_SEMANTICS, "{e:?}");
            e.data.map(|d| d["field"].clone()).unwrap_or_default()
        };
        let one = |entry: Value| field(serde_json::json!({ "interfaces": [entry] }));
        use serde_json::json;
        assert_eq!(one(json!({"name": "", "address": "10.9.0.1/24"})), "interfaces[0].name");
        assert_eq!(one(json!({"name": "a-very-long-name", "address": "10.9.0.1/24"})), "interfaces[0].name");
        assert_eq!(one(json!({"name": "a/b", "address": "10.9.0.1/24"})), "interfaces[0].name");
        assert_eq!(one(json!({"name": "lo", "address": "10.9.0.1/24"})), "interfaces[0].name");
        assert_eq!(one(json!({"name": "eth0", "address": "10.9.0.1/24"})), "interfaces[0].name", "primary NIC");
        assert_eq!(one(json!({"name": "mine", "address": "10.9.0.1/24"})), "interfaces[0].name", "foreign marker");
        assert_eq!(one(json!({"name": "v", "link": "eth0", "address": "10.9.0.1/24"})), "interfaces[0].vlan_id");
        assert_eq!(one(json!({"name": "v", "vlan_id": 5, "address": "10.9.0.1/24"})), "interfaces[0].link");
        for bad in [0, 4095, -1, 70000] {
            let entry = json!({"name": "v", "link": "eth0", "vlan_id": bad, "address": "10.9.0.1/24"});
            assert_eq!(one(entry), "interfaces[0].vlan_id", "{bad}");
        }
        assert_eq!(
            one(json!({"name": "v", "link": "eth9", "vlan_id": 5, "address": "10.9.0.1/24"})),
            "interfaces[0].link"
        );
        assert_eq!(
            one(json!({"name": "v", "link": "lo", "vlan_id": 5, "address": "10.9.0.1/24"})),
            "interfaces[0].link"
        );
        assert_eq!(
            one(json!({"name": "v", "link": "dummy0", "vlan_id": 5, "address": "10.9.0.1/24"})),
            "interfaces[0].link"
        );
        for bad in [
            "10.9.0.1",
            "10.9.0.1/33",
            "0.0.0.0/8",
            "127.0.0.2/8",
            "224.0.0.1/4",
            "10.9.0.1/0",
            "10.0.2.99/24",
            "10.0.0.1/8",
        ] {
            assert_eq!(one(json!({"name": "d", "address": bad})), "interfaces[0].address", "{bad}");
        }
        let twice = |a: Value, b: Value| field(json!({ "interfaces": [a, b] }));
        assert_eq!(
            twice(json!({"name": "d", "address": "10.9.0.1/24"}), json!({"name": "d", "address": "10.9.1.1/24"})),
            "interfaces[1].name"
        );
        assert_eq!(
            twice(
                json!({"name": "a", "link": "eth0", "vlan_id": 7, "address": "10.9.0.1/24"}),
                json!({"name": "b", "link": "eth0", "vlan_id": 7, "address": "10.9.1.1/24"})
            ),
            "interfaces[1].vlan_id"
        );
        assert_eq!(
            twice(json!({"name": "a", "address": "10.9.0.1/24"}), json!({"name": "b", "address": "10.9.0.1/32"})),
            "interfaces[1].address"
        );
        // A VLAN that exists under a foreign name.
        let mut foreign = base();
        let mut vlan = link(9, "vlan7", "vlan", "");
        vlan.parent = Some(2);
        vlan.vlan_id = Some(7);
        foreign.links.push(vlan);
        let e = validate(
            &params(
                json!({"interfaces": [{"name": "eth0.7", "link": "eth0", "vlan_id": 7, "address": "10.9.0.1/24"}]}),
            ),
            &foreign,
        )
        .expect_err("taken");
        assert_eq!(e.data.map(|d| d["field"].clone()), Some(json!("interfaces[0].vlan_id")));
        // Too many.
        let many: Vec<Value> = (0..=MAX_INTERFACES)
            .map(|i| json!({"name": format!("d{i}"), "address": format!("10.9.{i}.1/24")}))
            .collect();
        assert_eq!(field(json!({ "interfaces": many })), "interfaces");
        // Closed types: unknown members are -32602.
        let e = parse_params::<ApplyParams>(Some(
            json!({"interfaces": [{"name": "d", "address": "10.9.0.1/24", "mtu": 9000}]}),
        ))
        .expect_err("unknown member");
        assert_eq!(e.data.map(|d| d["field"].clone()), Some(json!("interfaces[0].mtu")));
    }

    /// `base()` with a second NIC `eth1` (02:00:00:00:00:02), down, not promiscuous, no address,
    /// and a VLAN on it sharing its MAC.
    fn with_capture_nic() -> Snapshot {
        let mut s = base();
        s.links[1].mac = Some([2, 0, 0, 0, 0, 1]);
        let mut eth1 = link(4, "eth1", "", "");
        eth1.mac = Some([2, 0, 0, 0, 0, 2]);
        eth1.up = false;
        let mut vlan = link(5, "eth1.7", "vlan", "operator");
        vlan.mac = eth1.mac;
        vlan.parent = Some(4);
        vlan.vlan_id = Some(7);
        s.links.splice(3..3, [vlan, eth1]);
        s
    }

    #[test]
    fn capture_nics_are_set_promiscuous_and_up_and_never_addressed() {
        let state = with_capture_nic();
        let mut request = standard();
        request.capture = vec!["02:00:00:00:00:02".into()];
        let capture = validate_capture(&request, &state).expect("valid");
        // The NIC itself, not the VLAN sharing its MAC.
        assert_eq!(capture, [CaptureNic { name: "eth1".into(), index: 4 }]);
        let (steps, changed) = plan_capture(&capture, &state);
        let steps: Vec<String> = steps.iter().map(Step::to_string).collect();
        assert_eq!(steps, ["set eth1 promiscuous", "set eth1 up"]);
        assert_eq!(changed, ["eth1"]);
        assert_eq!(verify_capture(&capture, &state), ["capture eth1: not up", "capture eth1: not promiscuous"]);
        // Once done, nothing more to do, and it verifies; an address on it is not the agent's
        // business (net.check reports it).
        let mut done = state.clone();
        done.links[4].up = true;
        done.links[4].promisc = true;
        done.addresses.push(address(4, "192.168.9.9/24"));
        assert_eq!(plan_capture(&capture, &done), (vec![], vec![]));
        assert!(verify_capture(&capture, &done).is_empty());
        // Only the flag that is missing is set.
        done.links[4].up = false;
        let (steps, _) = plan_capture(&capture, &done);
        assert_eq!(steps, [Step::SetUp { name: "eth1".into() }]);
        // Gone afterwards.
        done.links.remove(4);
        assert_eq!(verify_capture(&capture, &done), ["capture eth1: missing"]);
        // No capture member: nothing (an older daemon's request).
        assert!(validate_capture(&standard(), &state).expect("valid").is_empty());
    }

    #[test]
    fn capture_requests_name_the_field() {
        let state = with_capture_nic();
        let refused = |capture: Value| {
            let p = params(serde_json::json!({"interfaces": [], "capture": capture}));
            let e = validate_capture(&p, &state).expect_err("refused");
            assert_eq!(e.code, INVALID_SEMANTICS);
            let field = e.data.and_then(|d| d["field"].as_str().map(str::to_string)).unwrap_or_default();
            (field, e.message)
        };
        let (field, message) = refused(serde_json::json!(["02:00:00:00:00:02", "02:00"]));
        assert_eq!(field, "capture[1]", "{message}");
        let (field, message) = refused(serde_json::json!(["02:00:00:00:00:09"]));
        assert_eq!((field.as_str(), message.as_str()), ("capture[0]", "capture[0]: no NIC with MAC 02:00:00:00:00:09"));
        let (field, message) = refused(serde_json::json!(["02:00:00:00:00:02", "02:00:00:00:00:02"]));
        assert_eq!(field, "capture[1]", "{message}");
        assert!(message.contains("listed twice"), "{message}");
        // A MAC only a stacked link has (the operator's VLAN alone) is not a NIC.
        let mut no_parent = state.clone();
        no_parent.links.remove(4);
        let p = params(serde_json::json!({"interfaces": [], "capture": ["02:00:00:00:00:02"]}));
        assert!(validate_capture(&p, &no_parent).is_err());
        let many: Vec<String> = (0..=MAX_INTERFACES).map(|i| format!("02:00:00:00:01:{:02x}", i % 256)).collect();
        let p = params(serde_json::json!({"interfaces": [], "capture": many}));
        assert_eq!(
            validate_capture(&p, &state).expect_err("too many").data.map(|d| d["field"].clone()),
            Some(serde_json::json!("capture"))
        );
    }

    #[test]
    fn verification_names_every_difference() {
        let state = base();
        let desired = validate(&standard(), &state).expect("valid");
        let mut after = applied();
        // eth0.20 lost its marker and is down, dummy0 has two addresses, a stale owned link stayed,
        // the default route moved and eth0's address changed.
        for l in after.links.iter_mut() {
            if l.name == "eth0.20" {
                l.alias.clear();
                l.up = false;
            }
        }
        after.addresses.push(address(11, "192.168.50.7/32"));
        after.links.push(link(12, "old0", "dummy", MARKER));
        after.routes[0].gateway = Some(Ipv4Addr::new(10, 0, 2, 3));
        after.addresses[1] = address(2, "10.0.2.16/24");
        let failures = verify(&desired, &state, &after);
        let expected = [
            "eth0.20: alias is \"\", expected \"vmhost-agent\"",
            "eth0.20: not up",
            "dummy0: addresses are [192.168.50.1/32, 192.168.50.7/32], expected [192.168.50.1/32]",
            "old0: still present though not declared",
        ];
        for (got, want) in failures.iter().zip(expected) {
            assert_eq!(got, want);
        }
        assert!(failures[4].starts_with("default routes changed"), "{failures:?}");
        assert_eq!(failures[5], "eth0: addresses of an interface the agent does not own changed");
        assert_eq!(failures.len(), 6);
        // A missing link and a wrong kind.
        let mut wrong = applied();
        wrong.links.retain(|l| l.name != "dummy0");
        wrong.links.iter_mut().filter(|l| l.name == "eth0.20").for_each(|l| l.vlan_id = Some(30));
        let failures = verify(&desired, &state, &wrong);
        assert_eq!(failures[0], "eth0.20: expected vlan 20 on eth0, found kind \"vlan\" id Some(30) on eth0");
        assert_eq!(failures[1], "dummy0: missing");
    }

    #[test]
    fn intent_is_saved_atomically_and_only_when_it_differs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("run/vmhost-agent/intent.json");
        save_intent(&path, &standard()).expect("saved");
        let saved: ApplyParams = serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("JSON");
        assert_eq!(saved, standard());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path.parent().expect("dir")).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
        std::thread::sleep(std::time::Duration::from_millis(20));
        save_intent(&path, &standard()).expect("saved again");
        assert_eq!(std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime"), modified);
        assert!(!path.with_extension("json.tmp").exists());
    }
}
