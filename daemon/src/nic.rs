//! NIC planning: checking a spec's `nics` and choosing each NIC's MAC and tap name.
//!
//! Pure functions of (spec, host config, what other VMs hold). [`validate_nics`] runs inside spec
//! validation (2001/3001): a bridge NIC needs a network and may carry tagged `vlans` or a
//! `trunk`; a monitor NIC needs a `source` from `[capture] interfaces` and has no network,
//! VLAN, MAC or address (its derived MAC is an identifier inside the guest only); [`allocate`] runs under the lifecycle's allocation lock, reports
//! conflicts with other VMs (3003), and returns the [`NicAlloc`]s that the VM record keeps for
//! the VM's whole life, so MACs and tap names stay stable across restarts and host changes.
//! [`kernel_ip_params`] renders the guest addresses for direct-kernel VMs.

use crate::api::{ApiError, Code, Ipv4Spec, NicMode, NicSpec, VmSpec};
use crate::config::{Config, Network};
use crate::ipv4::Ipv4Cidr;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::HashSet;
use std::net::Ipv4Addr;

/// Most NICs a VM may have.
pub const MAX_NICS: usize = 8;
/// Most queue pairs one NIC may have (`spec.nics[i].queues`).
pub const MAX_QUEUES: u8 = 16;
/// Most queue pairs over all of a VM's NICs: each queue is a tap descriptor and, with
/// vhost-net, a vhost descriptor QEMU is handed, and one launch passes at most
/// [`crate::sandbox::spawn::MAX_PASSED_FDS`] descriptors.
pub const MAX_VM_QUEUES: u32 = 64;
/// Tap names start with this, so vmhostd's links are recognisable at a glance.
pub const TAP_PREFIX: &str = "vmh";

/// What one NIC was given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicAlloc {
    /// MAC, lowercase `xx:xx:xx:xx:xx:xx`.
    pub mac: String,
    /// Host tap name (at most 15 bytes).
    pub tap: String,
    /// The QEMU that runs now got vhost-net descriptors for this NIC (set at each launch,
    /// [`crate::net::vhost`]). Left out when false, so older records load and write back as
    /// they were.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vhost: bool,
}

/// Another VM's NICs as allocation sees them.
#[derive(Debug, Clone, Copy)]
pub struct NicHolding<'a> {
    /// VM name.
    pub vm: &'a str,
    /// Its spec.
    pub spec: &'a VmSpec,
    /// What its NICs were given.
    pub allocs: &'a [NicAlloc],
}

/// Parses `xx:xx:xx:xx:xx:xx` (either case).
///
/// # Errors
/// A message when the text is not a MAC.
pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = text.split(':').collect();
    let bad = || format!("{text:?} is not a MAC address (xx:xx:xx:xx:xx:xx)");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(bad());
        }
        mac[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    Ok(mac)
}

/// Formats a MAC in lowercase.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn is_domain(d: &str) -> bool {
    !d.is_empty()
        && d.len() <= 253
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// The static address of a NIC, parsed (validation has accepted it).
fn static_addr(nic: &NicSpec) -> Option<Ipv4Cidr> {
    match &nic.ipv4 {
        Some(Ipv4Spec::Static { address, .. }) => Ipv4Cidr::parse(address).ok(),
        _ => None,
    }
}

/// Checks the `nics` of a spec against the host's networks.
///
/// # Errors
/// 2001 for malformed values, 3001 for a network the host does not have; the field is named
/// (`spec.nics[1].ipv4.gateway`).
pub fn validate_nics(spec: &VmSpec, config: &Config) -> Result<(), ApiError> {
    if spec.nics.len() > MAX_NICS {
        return Err(ApiError::invalid("spec.nics", format!("at most {MAX_NICS} NICs per VM")));
    }
    let mut macs = HashSet::new();
    let mut queues = 0u32;
    for (i, nic) in spec.nics.iter().enumerate() {
        let f = |k: &str| format!("spec.nics[{i}].{k}");
        if !(1..=MAX_QUEUES).contains(&nic.queues) {
            return Err(ApiError::invalid(f("queues"), format!("{} queues: must be 1-{MAX_QUEUES}", nic.queues)));
        }
        queues += u32::from(nic.queues);
        if queues > MAX_VM_QUEUES {
            return Err(ApiError::invalid(
                f("queues"),
                format!("at most {MAX_VM_QUEUES} queues over all of a VM's NICs ({queues} up to this one)"),
            ));
        }
        if nic.mode == NicMode::Monitor {
            validate_monitor(nic, config, &f)?;
            continue;
        }
        validate_bridge_only(nic, &f)?;
        let net = config.networks.get(&nic.network).ok_or_else(|| {
            ApiError::new(Code::NotInModel, format!("no network {:?} on this host", nic.network)).field(f("network"))
        })?;
        validate_tagged(nic, net, &f)?;
        if let Some(v) = nic.vlan {
            if !(1..=4094).contains(&v) {
                return Err(ApiError::invalid(f("vlan"), format!("VLAN {v} is outside 1-4094")));
            }
            if !net.vlan_filtering {
                return Err(ApiError::invalid(
                    f("vlan"),
                    format!("network {:?} has no VLAN filtering; a NIC on it cannot have a vlan", net.name),
                ));
            }
        }
        if let Some(text) = &nic.mac {
            let mac = parse_mac(text).map_err(|m| ApiError::invalid(f("mac"), m))?;
            if mac[0] & 1 == 1 {
                return Err(ApiError::invalid(f("mac"), format!("{text} is a multicast address")));
            }
            if mac == [0; 6] {
                return Err(ApiError::invalid(f("mac"), "the all-zero MAC is not usable"));
            }
            if mac[0] == 0xfe {
                return Err(ApiError::invalid(f("mac"), format!("{text} starts with fe, which host taps use")));
            }
            if !macs.insert(mac) {
                return Err(ApiError::invalid(f("mac"), format!("{text} is used twice in this spec")));
            }
        }
        if let Some(Ipv4Spec::Static { address, gateway, dns, search }) = &nic.ipv4 {
            validate_static(net, address, gateway.as_deref(), dns, search, &f)?;
        }
    }
    Ok(())
}

/// What a bridge NIC must have and must not: a `network`, and none of a monitor NIC's keys.
fn validate_bridge_only(nic: &NicSpec, f: &dyn Fn(&str) -> String) -> Result<(), ApiError> {
    if nic.network.is_empty() {
        return Err(ApiError::invalid(f("network"), "a bridge NIC needs a network"));
    }
    if nic.source.is_some() {
        return Err(ApiError::invalid(f("source"), "only a monitor NIC (mode \"monitor\") has a source"));
    }
    if nic.direction.is_some() {
        return Err(ApiError::invalid(f("direction"), "only a monitor NIC (mode \"monitor\") has a direction"));
    }
    Ok(())
}

/// A bridge NIC's tagged VLANs: `vlans` each 1-4094, no repeats, not the access `vlan`, not
/// with `trunk`; either one only on a network with VLAN filtering (as `vlan`, 2001).
fn validate_tagged(nic: &NicSpec, net: &Network, f: &dyn Fn(&str) -> String) -> Result<(), ApiError> {
    if nic.trunk && !nic.vlans.is_empty() {
        return Err(ApiError::invalid(f("vlans"), "a trunk carries every VLAN: give vlans or trunk, not both"));
    }
    let mut seen = HashSet::new();
    for (j, &v) in nic.vlans.iter().enumerate() {
        let field = f(&format!("vlans[{j}]"));
        if !(1..=4094).contains(&v) {
            return Err(ApiError::invalid(field, format!("VLAN {v} is outside 1-4094")));
        }
        if nic.vlan == Some(v) {
            return Err(ApiError::invalid(field, format!("VLAN {v} is the NIC's access vlan")));
        }
        if v == 1 && nic.vlan.is_none() {
            // Without an access vlan the port keeps the bridge's default: VLAN 1 untagged.
            return Err(ApiError::invalid(
                field,
                "VLAN 1 is this port's untagged native VLAN; set an access vlan to carry it tagged",
            ));
        }
        if !seen.insert(v) {
            return Err(ApiError::invalid(field, format!("VLAN {v} is listed twice")));
        }
    }
    if !net.vlan_filtering {
        let key = if nic.trunk {
            "trunk"
        } else if !nic.vlans.is_empty() {
            "vlans"
        } else {
            return Ok(());
        };
        return Err(ApiError::invalid(
            f(key),
            format!("network {:?} has no VLAN filtering; a NIC on it cannot carry tagged VLANs", net.name),
        ));
    }
    Ok(())
}

/// A monitor NIC: a `source` the host config lists under `[capture] interfaces`, and none of a
/// bridge NIC's keys (it has no network, sends nothing, and its MAC is derived: an identifier
/// inside the guest only, never seen on a wire).
fn validate_monitor(nic: &NicSpec, config: &Config, f: &dyn Fn(&str) -> String) -> Result<(), ApiError> {
    let refused: [(&str, bool); 6] = [
        ("network", !nic.network.is_empty()),
        ("vlan", nic.vlan.is_some()),
        ("vlans", !nic.vlans.is_empty()),
        ("trunk", nic.trunk),
        ("mac", nic.mac.is_some()),
        ("ipv4", nic.ipv4.is_some()),
    ];
    if let Some((key, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(ApiError::invalid(
            f(key),
            format!("a monitor NIC has no {key}: it only receives copies of its source's frames"),
        ));
    }
    let Some(source) = &nic.source else {
        return Err(ApiError::invalid(f("source"), "a monitor NIC needs a source (a host interface)"));
    };
    if !crate::config::is_valid_ifname(source) {
        return Err(ApiError::invalid(f("source"), format!("{source:?} is not an interface name")));
    }
    if !config.capture.interfaces.iter().any(|i| i == source) {
        return Err(ApiError::new(Code::NotInModel, format!("the host config lists no capture interface {source:?}"))
            .field(f("source")));
    }
    Ok(())
}

fn validate_static(
    net: &Network,
    address: &str,
    gateway: Option<&str>,
    dns: &[String],
    search: &[String],
    f: &dyn Fn(&str) -> String,
) -> Result<(), ApiError> {
    let field = f("ipv4.address");
    let a = Ipv4Cidr::parse(address).map_err(|m| ApiError::invalid(&field, m))?;
    if a.is_network_or_broadcast() {
        return Err(ApiError::invalid(&field, format!("{a} is the network or broadcast address")));
    }
    if let Some(s) = net.subnet {
        if !s.contains(a.addr) || a.prefix != s.prefix {
            return Err(ApiError::invalid(&field, format!("{a} is outside network {:?}'s subnet {s}", net.name)));
        }
    }
    if let Some(g) = gateway {
        let gf = f("ipv4.gateway");
        let gw: Ipv4Addr = g.parse().map_err(|_| ApiError::invalid(&gf, format!("{g:?} is not an IPv4 address")))?;
        if !a.contains(gw) || gw == a.addr || gw == a.network() || gw == a.broadcast() {
            return Err(ApiError::invalid(
                gf,
                format!("gateway {gw} is not another host of {}/{}", a.network(), a.prefix),
            ));
        }
    }
    for (j, d) in dns.iter().enumerate() {
        if d.parse::<Ipv4Addr>().is_err() {
            return Err(ApiError::invalid(f(&format!("ipv4.dns[{j}]")), format!("{d:?} is not an IPv4 address")));
        }
    }
    for (j, d) in search.iter().enumerate() {
        if !is_domain(d) {
            return Err(ApiError::invalid(f(&format!("ipv4.search[{j}]")), format!("{d:?} is not a domain name")));
        }
    }
    Ok(())
}

/// FNV-1a, 64 bit: a stable hash (std's hasher may change between releases, and allocations
/// must not).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter().chain(&[0xff]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn derived_mac(vm: &str, nic: usize, attempt: u32) -> [u8; 6] {
    let h = fnv(&[vm.as_bytes(), &nic.to_le_bytes(), &attempt.to_le_bytes()]).to_be_bytes();
    // Locally administered (bit 1), unicast (bit 0 clear); never 0xfe, which taps use.
    let first = (h[0] & 0xfc) | 0x02;
    [if first == 0xfe { 0x02 } else { first }, h[1], h[2], h[3], h[4], h[5]]
}

fn tap_stem(vm: &str, attempt: u32) -> String {
    let h = fnv(&[vm.as_bytes(), &attempt.to_le_bytes()]);
    format!("{TAP_PREFIX}{:08x}", h as u32)
}

/// The conflicts of `spec`'s NICs with other VMs' and the networks' own addresses, without
/// allocating anything: what [`allocate`] refuses, for a plan that only needs the verdict.
///
/// # Errors
/// As [`allocate`].
pub fn check_conflicts(spec: &VmSpec, config: &Config, others: &[NicHolding<'_>]) -> Result<(), ApiError> {
    if spec.nics.is_empty() {
        return Ok(());
    }
    let others: Vec<&NicHolding<'_>> = others.iter().filter(|o| o.vm != spec.name).collect();
    let mut conflicts = Vec::new();
    let mut first_field = None;
    for (i, nic) in spec.nics.iter().enumerate() {
        if let Some(m) = nic.mac.as_deref().and_then(|t| parse_mac(t).ok()) {
            if let Some(o) = others.iter().find(|o| o.allocs.iter().any(|a| parse_mac(&a.mac).ok() == Some(m))) {
                first_field.get_or_insert_with(|| format!("spec.nics[{i}].mac"));
                conflicts.push(json!({"kind": "mac", "nic": i, "value": format_mac(m), "holder": o.vm}));
            }
        }
        if let Some(a) = static_addr(nic) {
            let net = config.networks.get(&nic.network);
            if net.and_then(|n| n.address).is_some_and(|h| h.addr == a.addr) {
                first_field.get_or_insert_with(|| format!("spec.nics[{i}].ipv4.address"));
                conflicts.push(json!({"kind": "address", "nic": i, "value": a.addr.to_string(), "holder": "host"}));
            }
            for o in &others {
                let held = o
                    .spec
                    .nics
                    .iter()
                    .any(|n| n.network == nic.network && static_addr(n).map(|x| x.addr) == Some(a.addr));
                if held {
                    first_field.get_or_insert_with(|| format!("spec.nics[{i}].ipv4.address"));
                    conflicts.push(json!({"kind": "address", "nic": i, "value": a.addr.to_string(), "holder": o.vm}));
                }
            }
        }
    }
    if !conflicts.is_empty() {
        let described = conflicts
            .into_iter()
            .map(|c| {
                let text = |k: &str| c[k].as_str().unwrap_or("?").to_string();
                (format!("NIC {} {} {} in use by {}", c["nic"], text("kind"), text("value"), text("holder")), c)
            })
            .collect();
        return Err(ApiError::in_use(described, first_field));
    }
    Ok(())
}

/// Checks `spec`'s NICs against other VMs and allocates each NIC's MAC and tap name.
///
/// `previous` are the allocations the VM already has (kept when still valid, so a restart or a
/// re-reservation changes nothing).
///
/// # Errors
/// 3003 listing every conflict (a MAC or a static address held by another VM, or the network's
/// own host address).
pub fn allocate(
    spec: &VmSpec,
    config: &Config,
    others: &[NicHolding<'_>],
    previous: &[NicAlloc],
) -> Result<Vec<NicAlloc>, ApiError> {
    check_conflicts(spec, config, others)?;
    // Nothing to allocate (reconcile calls this for each of 1000 VMs).
    if spec.nics.is_empty() {
        return Ok(Vec::new());
    }
    let others: Vec<&NicHolding<'_>> = others.iter().filter(|o| o.vm != spec.name).collect();
    let mut taken_macs: HashSet<[u8; 6]> = HashSet::new();
    let mut taken_stems: HashSet<String> = HashSet::new();
    for o in &others {
        for a in o.allocs {
            if let Ok(m) = parse_mac(&a.mac) {
                taken_macs.insert(m);
            }
            taken_stems.insert(a.tap.chars().take(TAP_PREFIX.len() + 8).collect());
        }
    }

    // Tap names: one stem per VM, the NIC index appended. Keep the previous stem if it is free.
    let stem = match previous.first().map(|a| a.tap.chars().take(TAP_PREFIX.len() + 8).collect::<String>()) {
        Some(s) if !taken_stems.contains(&s) => s,
        _ => (0u32..).map(|n| tap_stem(&spec.name, n)).find(|s| !taken_stems.contains(s)).unwrap_or_default(),
    };
    let mut out = Vec::with_capacity(spec.nics.len());
    let mut mine: HashSet<[u8; 6]> =
        spec.nics.iter().filter_map(|n| n.mac.as_deref().and_then(|t| parse_mac(t).ok())).collect();
    for (i, nic) in spec.nics.iter().enumerate() {
        let mac = match nic.mac.as_deref().and_then(|t| parse_mac(t).ok()) {
            Some(m) => m,
            None => {
                let kept = previous.get(i).and_then(|a| parse_mac(&a.mac).ok()).filter(|m| !taken_macs.contains(m));
                let m = kept.unwrap_or_else(|| {
                    (0u32..)
                        .map(|n| derived_mac(&spec.name, i, n))
                        .find(|m| !taken_macs.contains(m) && !mine.contains(m))
                        .unwrap_or([0x02, 0, 0, 0, 0, 1])
                });
                mine.insert(m);
                m
            }
        };
        // What the running QEMU got stays recorded through a change that waits for a restart.
        let vhost = previous.get(i).is_some_and(|p| p.vhost);
        out.push(NicAlloc { mac: format_mac(mac), tap: format!("{stem}n{i}"), vhost });
    }
    Ok(out)
}

/// The tap of a VM's NIC `index`, from any of its allocations: every tap of a VM is its one
/// stem + `n` + the NIC's index ([`allocate`]), so a NIC the running QEMU has keeps its tap
/// name even after a change waiting for a restart re-allocated the record's NICs. `None`
/// when the VM has no allocation to take the stem from.
pub fn tap_for(allocs: &[NicAlloc], index: usize) -> Option<String> {
    let stem: String = allocs.first()?.tap.chars().take(TAP_PREFIX.len() + 8).collect();
    Some(format!("{stem}n{index}"))
}

/// The guest hostname of VM `name`: `_` becomes `-`, since a hostname label is letters, digits
/// and hyphens only (RFC 1123) and cloud-init, klibc and most resolvers refuse an underscore.
/// A valid name ([`crate::validate::is_valid_name`]) has 1-63 bytes and starts with a letter
/// or digit, so the result is a valid label unless it ends with `-`, which RFC 1123 also
/// forbids but every Linux guest accepts. Here, with the `ip=` host name it makes, rather
/// than in [`crate::validate`], which calls into this module to check NICs.
pub fn hostname_of(name: &str) -> String {
    name.replace('_', "-")
}

/// Kernel `ip=` parameters (dracut/klibc syntax) for a direct-kernel VM: one per NIC with IPv4
/// configuration, naming the guest interfaces `eth0`, `eth1`, ... in NIC order. The hostname
/// field is the VM name with `_` as `-` ([`hostname_of`]): a hostname cannot
/// hold `_`.
pub fn kernel_ip_params(spec: &VmSpec) -> Vec<String> {
    let mut out = Vec::new();
    for (i, nic) in spec.nics.iter().enumerate() {
        let dev = format!("eth{i}");
        match &nic.ipv4 {
            Some(Ipv4Spec::Dhcp {}) => out.push(format!("ip={dev}:dhcp")),
            Some(Ipv4Spec::Static { address, gateway, dns, .. }) => {
                let Ok(a) = Ipv4Cidr::parse(address) else { continue };
                let gw = gateway.clone().unwrap_or_default();
                let dns0 = dns.first().cloned().unwrap_or_default();
                let dns1 = dns.get(1).cloned().unwrap_or_default();
                let host = hostname_of(&spec.name);
                out.push(format!("ip={}::{gw}:{}:{host}:{dev}:off:{dns0}:{dns1}", a.addr, a.mask()));
            }
            None => {}
        }
    }
    // klibc's ip= has no field for search domains; the guest's init (or agent) reads these.
    let search: Vec<&str> = spec
        .nics
        .iter()
        .filter_map(|n| match &n.ipv4 {
            Some(Ipv4Spec::Static { search, .. }) => Some(search.iter().map(String::as_str)),
            _ => None,
        })
        .flatten()
        .collect();
    if !search.is_empty() {
        out.push(format!("vmhost.dns_search={}", search.join(",")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::spec;
    use std::path::Path;

    fn config() -> Config {
        Config::parse(
            r#"
[hardware]
cpu = 8
memory_gib = 16
[networks.lan]
bridge = "br-lan"
create = true
address = "10.0.0.1/24"
subnet = "10.0.0.0/24"
[networks.open]
bridge = "br-open"
[networks.vl]
bridge = "br-vl"
vlan_filtering = true
[capture]
interfaces = ["eth1", "bond0.100"]
"#,
            Path::new("t.toml"),
        )
        .unwrap()
    }

    fn nic(network: &str, addr: Option<&str>) -> NicSpec {
        NicSpec {
            network: network.into(),
            vlan: None,
            mac: None,
            ipv4: addr.map(|a| Ipv4Spec::Static {
                address: a.into(),
                gateway: Some("10.0.0.1".into()),
                dns: vec!["10.0.0.1".into()],
                search: vec!["example.org".into()],
            }),
            queues: 1,
            ..Default::default()
        }
    }

    fn with(nics: Vec<NicSpec>) -> VmSpec {
        let mut s = spec("a");
        s.nics = nics;
        s
    }

    fn verr(s: &VmSpec) -> (i32, String) {
        let e = validate_nics(s, &config()).unwrap_err();
        (e.code.as_i32(), e.field.unwrap_or_default())
    }

    #[test]
    fn good_nics_pass() {
        let mut n = nic("vl", None);
        n.vlan = Some(10);
        n.mac = Some("02:AB:00:00:00:01".into());
        let mut open = nic("open", None);
        open.ipv4 = Some(Ipv4Spec::Static {
            address: "192.168.1.9/16".into(),
            gateway: Some("192.168.0.1".into()),
            dns: vec![],
            search: vec![],
        });
        let s = with(vec![nic("lan", Some("10.0.0.5/24")), open, n]);
        assert!(validate_nics(&s, &config()).is_ok());
        let mut d = nic("lan", None);
        d.ipv4 = Some(Ipv4Spec::Dhcp {});
        assert!(validate_nics(&with(vec![d]), &config()).is_ok());
    }

    #[test]
    fn queues_are_1_to_16_per_nic_and_64_per_vm() {
        let q = |n: u8| {
            let mut x = nic("open", None);
            x.queues = n;
            x
        };
        for good in [1, 2, 8, MAX_QUEUES] {
            assert!(validate_nics(&with(vec![q(good)]), &config()).is_ok(), "{good}");
        }
        for bad in [0, MAX_QUEUES + 1, 255] {
            assert_eq!(verr(&with(vec![q(1), q(bad)])), (2001, "spec.nics[1].queues".into()), "{bad}");
        }
        // Four NICs of 16 fill the VM's 64; a fifth queue anywhere is one too many.
        assert!(validate_nics(&with(vec![q(16); 4]), &config()).is_ok());
        assert_eq!(verr(&with(vec![q(16), q(16), q(16), q(16), q(1)])), (2001, "spec.nics[4].queues".into()));
        // 1 is the default and is left out, so older specs serialize byte for byte.
        let json = serde_json::to_string(&q(1)).unwrap();
        assert_eq!(json, r#"{"network":"open"}"#);
        let back: NicSpec = serde_json::from_str(&json).unwrap();
        assert_eq!(back.queues, 1);
        assert_eq!(serde_json::to_value(q(4)).unwrap()["queues"], 4);
    }

    #[test]
    fn bad_input_names_the_field() {
        assert_eq!(verr(&with(vec![nic("wan", None)])), (3001, "spec.nics[0].network".into()));
        assert_eq!(verr(&with(vec![nic("lan", None); MAX_NICS + 1])), (2001, "spec.nics".into()));
        for v in [0u16, 4095] {
            let mut n = nic("vl", None);
            n.vlan = Some(v);
            assert_eq!(verr(&with(vec![n])), (2001, "spec.nics[0].vlan".into()), "{v}");
        }
        let mut n = nic("lan", None);
        n.vlan = Some(10);
        assert_eq!(verr(&with(vec![n])), (2001, "spec.nics[0].vlan".into()), "no filtering on lan");
        for mac in [
            "02:00:00:00:00",
            "zz:00:00:00:00:01",
            "01:00:5e:00:00:01",
            "00:00:00:00:00:00",
            "fe:00:00:00:00:01",
            "2:0:0:0:0:1",
        ] {
            let mut n = nic("lan", None);
            n.mac = Some(mac.into());
            assert_eq!(verr(&with(vec![n])), (2001, "spec.nics[0].mac".into()), "{mac}");
        }
        let mut n = nic("lan", None);
        n.mac = Some("02:00:00:00:00:01".into());
        assert_eq!(verr(&with(vec![n.clone(), n])), (2001, "spec.nics[1].mac".into()));
        for (addr, why) in [
            ("10.0.1.5/24", "outside"),
            ("10.0.0.0/24", "network"),
            ("10.0.0.255/24", "broadcast"),
            ("10.0.0.5/16", "prefix"),
            ("10.0.0.5", "form"),
        ] {
            assert_eq!(verr(&with(vec![nic("lan", Some(addr))])), (2001, "spec.nics[0].ipv4.address".into()), "{why}");
        }
        let mut n = nic("lan", Some("10.0.0.5/24"));
        if let Some(Ipv4Spec::Static { gateway, .. }) = &mut n.ipv4 {
            *gateway = Some("10.0.1.1".into());
        }
        assert_eq!(verr(&with(vec![n])), (2001, "spec.nics[0].ipv4.gateway".into()));
        let mut n = nic("lan", Some("10.0.0.5/24"));
        if let Some(Ipv4Spec::Static { dns, search, .. }) = &mut n.ipv4 {
            dns.push("x".into());
            search.push("-bad.example".into());
        }
        assert_eq!(verr(&with(vec![n.clone()])), (2001, "spec.nics[0].ipv4.dns[1]".into()));
        if let Some(Ipv4Spec::Static { dns, .. }) = &mut n.ipv4 {
            dns.pop();
        }
        assert_eq!(verr(&with(vec![n])), (2001, "spec.nics[0].ipv4.search[1]".into()));
    }

    #[test]
    fn allocation_is_stable_local_unicast_and_unique() {
        let c = config();
        let s = with(vec![nic("lan", None), nic("open", None)]);
        let a = allocate(&s, &c, &[], &[]).unwrap();
        assert_eq!(a, allocate(&s, &c, &[], &[]).unwrap(), "deterministic");
        for x in &a {
            let m = parse_mac(&x.mac).unwrap();
            assert_eq!(m[0] & 0x03, 0x02, "locally administered unicast: {}", x.mac);
            assert_ne!(m[0], 0xfe);
            assert!(x.tap.len() <= 15 && x.tap.starts_with(TAP_PREFIX), "{}", x.tap);
        }
        assert_ne!(a[0].mac, a[1].mac);
        assert_eq!(a[0].tap[..11], a[1].tap[..11]);
        assert!(a[0].tap.ends_with("n0") && a[1].tap.ends_with("n1"));

        // Another VM already holding the MAC and tap stem we would derive: both are bumped.
        let mut clash = spec("other");
        clash.nics = vec![nic("lan", None)];
        let held = vec![NicAlloc { mac: a[0].mac.clone(), tap: a[0].tap.clone(), vhost: false }];
        let b = allocate(&s, &c, &[NicHolding { vm: "other", spec: &clash, allocs: &held }], &[]).unwrap();
        assert_ne!(b[0].mac, a[0].mac);
        assert_ne!(b[0].tap[..11], a[0].tap[..11]);
        // Previous allocations are kept.
        let kept = allocate(&s, &c, &[], &b).unwrap();
        assert_eq!(kept, b);
    }

    #[test]
    fn conflicts_with_other_vms_and_the_host_are_listed() {
        let c = config();
        let mut o = spec("web");
        let mut n = nic("lan", Some("10.0.0.5/24"));
        n.mac = Some("02:00:00:00:00:09".into());
        o.nics = vec![n];
        let oa = vec![NicAlloc { mac: "02:00:00:00:00:09".into(), tap: "vmh00000000n0".into(), vhost: false }];
        let others = [NicHolding { vm: "web", spec: &o, allocs: &oa }];
        let mut mine = nic("lan", Some("10.0.0.5/24"));
        mine.mac = Some("02:00:00:00:00:09".into());
        let s = with(vec![nic("lan", Some("10.0.0.1/24")), mine]);
        let e = allocate(&s, &c, &others, &[]).unwrap_err();
        assert_eq!(e.code, Code::HardwareInUse);
        assert_eq!(e.field.as_deref(), Some("spec.nics[0].ipv4.address"));
        let list = e.details["conflicts"].as_array().unwrap();
        assert_eq!(list.len(), 3, "{list:?}");
        assert_eq!(list[0]["holder"], "host");
        assert!(list.iter().any(|x| x["kind"] == "mac" && x["holder"] == "web"));
        assert!(e.message.contains("NIC 0 address 10.0.0.1 in use by host"), "{}", e.message);
        // The same address on another network is fine.
        let s = with(vec![nic("open", Some("10.0.0.5/24"))]);
        assert!(allocate(&s, &c, &others, &[]).is_ok());
    }

    #[test]
    fn kernel_ip_params_follow_dracut_syntax() {
        let mut d = nic("open", None);
        d.ipv4 = Some(Ipv4Spec::Dhcp {});
        let mut s = with(vec![nic("lan", Some("10.0.0.5/24")), nic("open", None), d]);
        s.name = "web1".into();
        assert_eq!(
            kernel_ip_params(&s),
            vec![
                "ip=10.0.0.5::10.0.0.1:255.255.255.0:web1:eth0:off:10.0.0.1:".to_string(),
                "ip=eth2:dhcp".to_string(),
                "vmhost.dns_search=example.org".to_string()
            ]
        );
    }

    #[test]
    fn ip_hostnames_have_no_underscore() {
        let mut s = with(vec![nic("lan", Some("10.0.0.5/24"))]);
        s.name = "sensor1_sensor".into();
        assert_eq!(kernel_ip_params(&s)[0], "ip=10.0.0.5::10.0.0.1:255.255.255.0:sensor1-sensor:eth0:off:10.0.0.1:");
    }

    /// Tap names are a hash of the VM name, not the name: a 63-byte name with underscores and
    /// the most NICs still gives kernel-valid names (at most 15 bytes, no `_` needed).
    #[test]
    fn tap_names_of_long_underscored_names_fit_ifnamsiz() {
        let c = config();
        let mut s = with((0..MAX_NICS).map(|_| nic("open", None)).collect());
        s.name = format!("sensor1_{}", "x_".repeat(27));
        assert_eq!(s.name.len(), 62);
        assert!(crate::validate::is_valid_name(&s.name));
        let a = allocate(&s, &c, &[], &[]).unwrap();
        assert_eq!(a.len(), MAX_NICS);
        for x in &a {
            assert!(x.tap.len() <= crate::net::MAX_LINK_NAME, "{}", x.tap);
            assert!(x.tap.starts_with(TAP_PREFIX), "{}", x.tap);
            assert!(x.tap.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{}", x.tap);
        }
        let mut other = s.clone();
        other.name = format!("sensor1-{}", "x-".repeat(27));
        assert_ne!(allocate(&other, &c, &[], &[]).unwrap()[0].tap, a[0].tap, "`_` and `-` give different taps");
    }

    fn monitor(source: Option<&str>) -> NicSpec {
        NicSpec { mode: NicMode::Monitor, source: source.map(Into::into), ..Default::default() }
    }

    /// Every rule of bridge vs monitor NICs, tagged VLANs and capture sources, one row each:
    /// the NIC, the code and the field the refusal names.
    #[test]
    fn monitor_and_trunk_rules_name_the_field() {
        type Edit = fn(&mut NicSpec);
        type Row = (&'static str, fn() -> NicSpec, Edit, Option<(i32, &'static str)>);
        let rows: &[Row] = &[
            ("monitor ok", || monitor(Some("eth1")), |_| {}, None),
            (
                "monitor ingress, 4 queues",
                || monitor(Some("bond0.100")),
                |n| {
                    n.direction = Some(crate::api::CaptureDirection::Ingress);
                    n.queues = 4;
                },
                None,
            ),
            ("monitor without source", || monitor(None), |_| {}, Some((2001, "source"))),
            ("monitor bad source name", || monitor(Some("a/b")), |_| {}, Some((2001, "source"))),
            ("monitor source not listed", || monitor(Some("eth0")), |_| {}, Some((3001, "source"))),
            ("monitor with network", || monitor(Some("eth1")), |n| n.network = "lan".into(), Some((2001, "network"))),
            ("monitor with vlan", || monitor(Some("eth1")), |n| n.vlan = Some(10), Some((2001, "vlan"))),
            ("monitor with vlans", || monitor(Some("eth1")), |n| n.vlans = vec![10], Some((2001, "vlans"))),
            ("monitor with trunk", || monitor(Some("eth1")), |n| n.trunk = true, Some((2001, "trunk"))),
            (
                "monitor with mac",
                || monitor(Some("eth1")),
                |n| n.mac = Some("02:00:00:00:00:01".into()),
                Some((2001, "mac")),
            ),
            ("monitor with ipv4", || monitor(Some("eth1")), |n| n.ipv4 = Some(Ipv4Spec::Dhcp {}), Some((2001, "ipv4"))),
            ("bridge without network", || nic("", None), |_| {}, Some((2001, "network"))),
            ("bridge with source", || nic("lan", None), |n| n.source = Some("eth1".into()), Some((2001, "source"))),
            (
                "bridge with direction",
                || nic("lan", None),
                |n| n.direction = Some(crate::api::CaptureDirection::Both),
                Some((2001, "direction")),
            ),
            (
                "vlans ok",
                || nic("vl", None),
                |n| {
                    n.vlan = Some(5);
                    n.vlans = vec![10, 20, 4094, 1];
                },
                None,
            ),
            ("trunk ok", || nic("vl", None), |n| n.trunk = true, None),
            (
                "trunk with access vlan ok",
                || nic("vl", None),
                |n| {
                    n.trunk = true;
                    n.vlan = Some(7);
                },
                None,
            ),
            ("vlan 0", || nic("vl", None), |n| n.vlans = vec![10, 0], Some((2001, "vlans[1]"))),
            ("vlan 4095", || nic("vl", None), |n| n.vlans = vec![4095], Some((2001, "vlans[0]"))),
            ("vlans repeat", || nic("vl", None), |n| n.vlans = vec![10, 20, 10], Some((2001, "vlans[2]"))),
            (
                "vlan 1 tagged without an access vlan",
                || nic("vl", None),
                |n| n.vlans = vec![7, 1],
                Some((2001, "vlans[1]")),
            ),
            (
                "vlans has the access vlan",
                || nic("vl", None),
                |n| {
                    n.vlan = Some(20);
                    n.vlans = vec![10, 20];
                },
                Some((2001, "vlans[1]")),
            ),
            (
                "vlans and trunk",
                || nic("vl", None),
                |n| {
                    n.vlans = vec![10];
                    n.trunk = true;
                },
                Some((2001, "vlans")),
            ),
            ("vlans without filtering", || nic("lan", None), |n| n.vlans = vec![10], Some((2001, "vlans"))),
            ("trunk without filtering", || nic("lan", None), |n| n.trunk = true, Some((2001, "trunk"))),
        ];
        for (what, make, edit, want) in rows {
            let mut n = make();
            edit(&mut n);
            // Second NIC, so the index in the field is checked too.
            let s = with(vec![nic("lan", None), n]);
            let got = validate_nics(&s, &config()).err().map(|e| (e.code.as_i32(), e.field.unwrap_or_default()));
            let want = want.map(|(c, k)| (c, format!("spec.nics[1].{k}")));
            assert_eq!(got, want, "{what}");
        }
    }

    /// A monitor NIC's MAC is derived as a bridge NIC's (an identifier inside the guest only),
    /// its tap named as any other; it gets no `ip=` even beside addressed NICs.
    #[test]
    fn monitor_nics_get_a_mac_and_tap_and_no_ip_param() {
        let c = config();
        let s = with(vec![monitor(Some("eth1")), nic("lan", Some("10.0.0.5/24"))]);
        assert!(validate_nics(&s, &c).is_ok());
        let a = allocate(&s, &c, &[], &[]).unwrap();
        assert_eq!(parse_mac(&a[0].mac).unwrap()[0] & 0x03, 0x02);
        assert!(a[0].tap.ends_with("n0"));
        let params = kernel_ip_params(&s);
        assert_eq!(params.len(), 2, "{params:?}");
        assert!(params[0].contains(":eth1:"), "{params:?}");
        assert!(params.iter().all(|p| !p.contains("eth0")), "{params:?}");
    }
}
