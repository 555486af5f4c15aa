//! `net.check`: compares what the host expects with what the guest has, item by item.
//!
//! The expected values always come from the host (from the VM's spec); the agent only reports what
//! it observes next to them. Order of use: [`validate`] turns the host's [`Expected`] into typed
//! [`Expectations`] (refusing bad values with 5100 naming the field); the caller takes a
//! [`NetState`](crate::state::NetState) (the same view `net.state` returns); [`evaluate`] produces
//! the [`CheckReport`], calling the gateway probe only when asked to. `evaluate` is pure apart from
//! that probe callback, so every rule is unit-tested on made-up states.
//!
//! Check names are stable strings the host can show and match on:
//! `nic MAC present`, `nic MAC up` (or `down`), `address A/P on NAME`, `default route via GW`,
//! `gateway GW reachable`, `dns server S`, `search DOMAIN`; for a capture NIC (a monitor NIC on
//! the host, [`ExpectedNic::capture`]) `nic MAC present`, `capture NAME up`,
//! `capture NAME promiscuous` and `capture NAME no address` (IPv4: the view has no other) take
//! the place of the `up` and address checks, NAME being the guest's name for it (`nic MAC` when
//! it is absent).

use std::net::{IpAddr, Ipv4Addr};

pub use vmhost_agent_protocol::{Check, CheckParams, CheckReport, Expected, ExpectedNic};

use crate::addr::{format_mac, parse_ipv4, parse_mac, Ipv4Net};
use crate::probe::ProbeOutcome;
use crate::protocol::RpcError;
use crate::state::{Interface, NetState};

/// One expected NIC with its values parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicExpectation {
    /// Its MAC.
    pub mac: [u8; 6],
    /// The addresses it must have (none for a capture NIC).
    pub addresses: Vec<Ipv4Net>,
    /// Whether it must be up (always for a capture NIC).
    pub up: bool,
    /// A capture NIC: up, promiscuous, no IPv4 address.
    pub capture: bool,
}

/// The host's expectations with every value parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectations {
    /// NICs.
    pub nics: Vec<NicExpectation>,
    /// Default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// DNS servers.
    pub dns: Vec<IpAddr>,
    /// Search domains.
    pub search: Vec<String>,
    /// Probe the gateway.
    pub probe_gateway: bool,
}

/// Parses and checks the values of `expected`.
///
/// # Errors
/// 5100 with `data.field` (e.g. `expected.interfaces[0].addresses[1]`) for a malformed MAC,
/// address, gateway, DNS server or search domain, a MAC listed twice, or a capture NIC with
/// addresses or expected down.
pub fn validate(expected: &Expected) -> Result<Expectations, RpcError> {
    let mut nics = Vec::with_capacity(expected.interfaces.len());
    for (i, nic) in expected.interfaces.iter().enumerate() {
        let field = format!("expected.interfaces[{i}].mac");
        let mac = parse_mac(&nic.mac).map_err(|e| RpcError::invalid(&field, format!("{field}: {e}")))?;
        if nics.iter().any(|n: &NicExpectation| n.mac == mac) {
            return Err(RpcError::invalid(&field, format!("{field}: {} is listed twice", format_mac(&mac))));
        }
        if nic.capture && !nic.addresses.is_empty() {
            let field = format!("expected.interfaces[{i}].addresses");
            return Err(RpcError::invalid(&field, format!("{field}: a capture NIC has no address")));
        }
        if nic.capture && !nic.up {
            let field = format!("expected.interfaces[{i}].up");
            return Err(RpcError::invalid(&field, format!("{field}: a capture NIC is always up")));
        }
        let mut addresses = Vec::with_capacity(nic.addresses.len());
        for (j, address) in nic.addresses.iter().enumerate() {
            let field = format!("expected.interfaces[{i}].addresses[{j}]");
            addresses.push(address.parse::<Ipv4Net>().map_err(|e| RpcError::invalid(&field, format!("{field}: {e}")))?);
        }
        nics.push(NicExpectation { mac, addresses, up: nic.up, capture: nic.capture });
    }
    let gateway = match &expected.gateway {
        Some(gw) => {
            Some(parse_ipv4(gw).map_err(|e| RpcError::invalid("expected.gateway", format!("expected.gateway: {e}")))?)
        }
        None => None,
    };
    let mut dns = Vec::with_capacity(expected.dns.len());
    for (i, server) in expected.dns.iter().enumerate() {
        let field = format!("expected.dns[{i}]");
        dns.push(
            server.parse::<IpAddr>().map_err(|_| RpcError::invalid(&field, format!("{field}: not an IP address")))?,
        );
    }
    for (i, domain) in expected.search.iter().enumerate() {
        let trimmed = domain.strip_suffix('.').unwrap_or(domain);
        if trimmed.is_empty() || trimmed.len() > 253 || !trimmed.bytes().all(|b| b.is_ascii_graphic()) {
            let field = format!("expected.search[{i}]");
            return Err(RpcError::invalid(&field, format!("{field}: not a domain name")));
        }
    }
    Ok(Expectations { nics, gateway, dns, search: expected.search.clone(), probe_gateway: expected.probe_gateway })
}

/// The interface that is the NIC with `mac`: a plain device (no link kind) first, because VLANs
/// and other stacked links share their parent's MAC; otherwise the first link with that MAC.
fn nic_with_mac<'a>(state: &'a NetState, mac: &str) -> Option<&'a Interface> {
    let mut with_mac = state.interfaces.iter().filter(|i| i.mac == mac);
    let first = with_mac.clone().next();
    with_mac.find(|i| i.kind.is_empty()).or(first)
}

/// `a, b, c`, or `none` for an empty list.
fn list_or_none(items: &[String], separator: &str) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(separator)
    }
}

/// Compares `state` with `expected` and returns every check. `probe` is called at most once, for
/// the gateway, when `probe_gateway` is set and a gateway is expected.
pub fn evaluate(
    expected: &Expectations,
    state: &NetState,
    probe: &mut dyn FnMut(Ipv4Addr) -> ProbeOutcome,
) -> CheckReport {
    let mut checks = Vec::new();
    let mut push = |name: String, ok: bool, expected: String, observed: String| {
        checks.push(Check { name, ok, expected, observed });
    };
    for want in &expected.nics {
        let (addresses, up) = (&want.addresses, &want.up);
        let mac = format_mac(&want.mac);
        let nic = nic_with_mac(state, &mac);
        push(
            format!("nic {mac} present"),
            nic.is_some(),
            "present".into(),
            nic.map_or_else(|| "absent".into(), |n| n.name.clone()),
        );
        if want.capture {
            let name = nic.map_or_else(|| format!("nic {mac}"), |n| n.name.clone());
            let flag = |on: bool, yes: &str, no: &str| if on { yes.to_string() } else { no.to_string() };
            let absent = || "absent".to_string();
            push(
                format!("capture {name} up"),
                nic.is_some_and(|n| n.up),
                "up".into(),
                nic.map_or_else(absent, |n| flag(n.up, "up", "down")),
            );
            // A view without the flag (it cannot happen here: net.check asks for it) fails.
            push(
                format!("capture {name} promiscuous"),
                nic.is_some_and(|n| n.promisc == Some(true)),
                "promiscuous".into(),
                nic.map_or_else(absent, |n| flag(n.promisc == Some(true), "promiscuous", "not promiscuous")),
            );
            push(
                format!("capture {name} no address"),
                nic.is_some_and(|n| n.addresses.is_empty()),
                "none".into(),
                nic.map_or_else(absent, |n| list_or_none(&n.addresses, ", ")),
            );
            continue;
        }
        let word = |up: bool| if up { "up" } else { "down" };
        push(
            format!("nic {mac} {}", word(*up)),
            nic.is_some_and(|n| n.up == *up),
            word(*up).into(),
            nic.map_or_else(|| "absent".into(), |n| word(n.up).into()),
        );
        for address in addresses {
            let (name, observed, ok) = match nic {
                Some(n) => {
                    let have: Vec<Ipv4Net> = n.addresses.iter().filter_map(|a| a.parse().ok()).collect();
                    (n.name.clone(), list_or_none(&n.addresses, ", "), have.contains(address))
                }
                None => (format!("nic {mac}"), "nic absent".into(), false),
            };
            push(format!("address {address} on {name}"), ok, address.to_string(), observed);
        }
    }
    if let Some(gateway) = expected.gateway {
        let defaults: Vec<_> = state.routes.iter().filter(|r| r.dst == "default").collect();
        let ok =
            defaults.iter().any(|r| r.gateway.as_deref().and_then(|g| g.parse::<Ipv4Addr>().ok()) == Some(gateway));
        let observed: Vec<String> = defaults
            .iter()
            .map(|r| match &r.gateway {
                Some(g) => format!("via {g} dev {}", r.dev),
                None => format!("dev {}", r.dev),
            })
            .collect();
        push(format!("default route via {gateway}"), ok, format!("via {gateway}"), list_or_none(&observed, "; "));
        if expected.probe_gateway {
            let outcome = probe(gateway);
            push(
                format!("gateway {gateway} reachable"),
                outcome.is_reply(),
                outcome.expectation(),
                outcome.to_string(),
            );
        }
    }
    for server in &expected.dns {
        let ok = state.dns.servers.iter().any(|s| s.parse::<IpAddr>().ok() == Some(*server));
        push(format!("dns server {server}"), ok, server.to_string(), list_or_none(&state.dns.servers, ", "));
    }
    for domain in &expected.search {
        let norm = |d: &str| d.strip_suffix('.').unwrap_or(d).to_ascii_lowercase();
        let ok = state.dns.search.iter().any(|s| norm(s) == norm(domain));
        push(format!("search {domain}"), ok, domain.clone(), list_or_none(&state.dns.search, " "));
    }
    CheckReport { ok: checks.iter().all(|c| c.ok), checks }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{parse_params, INVALID_PARAMS, INVALID_SEMANTICS};
    use crate::state::{Dns, RouteView};
    use serde_json::json;
    use std::time::Duration;

    fn iface(name: &str, mac: &str, kind: &str, up: bool, addresses: &[&str]) -> Interface {
        Interface {
            name: name.into(),
            mac: mac.into(),
            up,
            mtu: 1500,
            kind: kind.into(),
            alias: String::new(),
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            promisc: Some(false),
        }
    }

    /// A guest with eth0 (10.0.0.5/24 via 10.0.0.1), a VLAN on it sharing its MAC, and a second NIC
    /// that is down.
    fn guest() -> NetState {
        NetState {
            interfaces: vec![
                iface("lo", "00:00:00:00:00:00", "", true, &["127.0.0.1/8"]),
                iface("eth0.20", "02:00:00:00:00:01", "vlan", true, &["10.20.0.5/24"]),
                iface("eth0", "02:00:00:00:00:01", "", true, &["10.0.0.5/24"]),
                iface("eth1", "02:00:00:00:00:02", "", false, &[]),
            ],
            routes: vec![
                RouteView { dst: "default".into(), gateway: Some("10.0.0.1".into()), dev: "eth0".into() },
                RouteView { dst: "10.0.0.0/24".into(), gateway: None, dev: "eth0".into() },
            ],
            dns: Dns { servers: vec!["10.0.0.1".into()], search: vec!["example.org".into()] },
        }
    }

    fn expectations(value: serde_json::Value) -> Expectations {
        let params: CheckParams = parse_params(Some(json!({ "expected": value }))).expect("parses");
        validate(&params.expected).expect("valid")
    }

    fn no_probe(_: Ipv4Addr) -> ProbeOutcome {
        panic!("the probe must not run")
    }

    #[test]
    fn a_matching_guest_passes_every_check() {
        let expected = expectations(json!({
            "interfaces": [{"mac": "02:00:00:00:00:01", "addresses": ["10.0.0.5/24"], "up": true}],
            "gateway": "10.0.0.1", "dns": ["10.0.0.1"], "search": ["Example.org."], "probe_gateway": true
        }));
        let mut probed = Vec::new();
        let report = evaluate(&expected, &guest(), &mut |gw| {
            probed.push(gw);
            ProbeOutcome::Reply(Duration::from_micros(800))
        });
        let names: Vec<&str> = report.checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "nic 02:00:00:00:00:01 present",
                "nic 02:00:00:00:00:01 up",
                "address 10.0.0.5/24 on eth0",
                "default route via 10.0.0.1",
                "gateway 10.0.0.1 reachable",
                "dns server 10.0.0.1",
                "search Example.org.",
            ]
        );
        assert!(report.ok, "{report:?}");
        assert_eq!(probed, [Ipv4Addr::new(10, 0, 0, 1)]);
        // The NIC is eth0, not the VLAN sharing its MAC.
        assert_eq!(report.checks[0].observed, "eth0");
    }

    #[test]
    fn wrong_items_fail_by_name_with_both_values() {
        let expected = expectations(json!({
            "interfaces": [
                {"mac": "02:00:00:00:00:01", "addresses": ["10.0.0.6/24", "10.0.0.5/24"]},
                {"mac": "02:00:00:00:00:02"},
                {"mac": "02:00:00:00:00:09", "addresses": ["10.9.0.1/24"]}
            ],
            "gateway": "10.0.0.254", "dns": ["1.1.1.1"], "search": ["lab.example"], "probe_gateway": true
        }));
        let report = evaluate(&expected, &guest(), &mut |_| ProbeOutcome::NoReply(Duration::from_millis(1000)));
        assert!(!report.ok);
        let failed: Vec<(&str, &str, &str)> = report
            .checks
            .iter()
            .filter(|c| !c.ok)
            .map(|c| (c.name.as_str(), c.expected.as_str(), c.observed.as_str()))
            .collect();
        assert_eq!(
            failed,
            [
                ("address 10.0.0.6/24 on eth0", "10.0.0.6/24", "10.0.0.5/24"),
                ("nic 02:00:00:00:00:02 up", "up", "down"),
                ("nic 02:00:00:00:00:09 present", "present", "absent"),
                ("nic 02:00:00:00:00:09 up", "up", "absent"),
                ("address 10.9.0.1/24 on nic 02:00:00:00:00:09", "10.9.0.1/24", "nic absent"),
                ("default route via 10.0.0.254", "via 10.0.0.254", "via 10.0.0.1 dev eth0"),
                ("gateway 10.0.0.254 reachable", "echo reply within 1000 ms", "no reply within 1000 ms"),
                ("dns server 1.1.1.1", "1.1.1.1", "10.0.0.1"),
                ("search lab.example", "lab.example", "example.org"),
            ]
        );
    }

    #[test]
    fn a_capture_nic_is_checked_up_promiscuous_and_without_an_address() {
        let expected = expectations(json!({"interfaces": [
            {"mac": "02:00:00:00:00:01", "addresses": ["10.0.0.5/24"]},
            {"mac": "02:00:00:00:00:02", "addresses": [], "up": true, "capture": true}
        ]}));
        let names = |report: &CheckReport| -> Vec<(String, bool, String)> {
            report.checks.iter().map(|c| (c.name.clone(), c.ok, c.observed.clone())).collect()
        };
        // eth1 of the made-up guest is down, not promiscuous, unaddressed.
        let report = evaluate(&expected, &guest(), &mut no_probe);
        assert!(!report.ok);
        let row = |name: &str, ok: bool, observed: &str| (name.to_string(), ok, observed.to_string());
        assert_eq!(
            names(&report)[3..],
            [
                row("nic 02:00:00:00:00:02 present", true, "eth1"),
                row("capture eth1 up", false, "down"),
                row("capture eth1 promiscuous", false, "not promiscuous"),
                row("capture eth1 no address", true, "none"),
            ]
        );
        assert_eq!(report.checks[4].expected, "up");
        assert_eq!(report.checks[5].expected, "promiscuous");
        assert_eq!(report.checks[6].expected, "none");
        // Set up as the agent sets it: every check passes.
        let mut ready = guest();
        ready.interfaces[3].up = true;
        ready.interfaces[3].promisc = Some(true);
        let report = evaluate(&expected, &ready, &mut no_probe);
        assert!(report.ok, "{report:?}");
        // An address someone else gave it fails the check, naming it.
        ready.interfaces[3].addresses = vec!["192.168.9.9/24".into()];
        let report = evaluate(&expected, &ready, &mut no_probe);
        assert_eq!(names(&report)[6], row("capture eth1 no address", false, "192.168.9.9/24"));
        // A view without the flag (an agent not asked for it) is not taken for promiscuous.
        ready.interfaces[3].promisc = None;
        assert!(!evaluate(&expected, &ready, &mut no_probe).checks[5].ok);
        // An absent capture NIC: every check fails, naming the MAC.
        let gone = expectations(json!({"interfaces": [{"mac": "02:00:00:00:00:09", "capture": true}]}));
        let report = evaluate(&gone, &guest(), &mut no_probe);
        assert_eq!(
            names(&report),
            [
                row("nic 02:00:00:00:00:09 present", false, "absent"),
                row("capture nic 02:00:00:00:00:09 up", false, "absent"),
                row("capture nic 02:00:00:00:00:09 promiscuous", false, "absent"),
                row("capture nic 02:00:00:00:00:09 no address", false, "absent"),
            ]
        );
    }

    #[test]
    fn absent_members_are_not_checked() {
        let report = evaluate(&expectations(json!({})), &guest(), &mut no_probe);
        assert_eq!(report, CheckReport { ok: true, checks: vec![] });
        // A probe without a gateway is skipped, and a down NIC can be expected down.
        let expected =
            expectations(json!({"probe_gateway": true, "interfaces": [{"mac": "02:00:00:00:00:02", "up": false}]}));
        let report = evaluate(&expected, &guest(), &mut no_probe);
        assert!(report.ok, "{report:?}");
        assert_eq!(report.checks[1].name, "nic 02:00:00:00:00:02 down");
        // No default route at all.
        let mut bare = guest();
        bare.routes.clear();
        let report = evaluate(&expectations(json!({"gateway": "10.0.0.1"})), &bare, &mut no_probe);
        assert_eq!(report.checks[0].observed, "none");
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        let field = |value: serde_json::Value| {
            let params: CheckParams = parse_params(Some(json!({ "expected": value }))).expect("well-typed");
            let e = validate(&params.expected).expect_err("refused");
            assert_eq!(e.code, INVALID_SEMANTICS);
            e.data.map(|d| d["field"].clone()).unwrap_or_default()
        };
        assert_eq!(field(json!({"interfaces": [{"mac": "02:00"}]})), "expected.interfaces[0].mac");
        assert_eq!(
            field(json!({"interfaces": [{"mac": "02:00:00:00:00:01", "addresses": ["10.0.0.5/24", "10.0.0.5"]}]})),
            "expected.interfaces[0].addresses[1]"
        );
        assert_eq!(
            field(json!({"interfaces": [{"mac": "02:00:00:00:00:01"}, {"mac": "02:00:00:00:00:01"}]})),
            "expected.interfaces[1].mac"
        );
        assert_eq!(field(json!({"gateway": "10.0.0"})), "expected.gateway");
        assert_eq!(field(json!({"dns": ["1.1.1.1", "dns.example"]})), "expected.dns[1]");
        assert_eq!(field(json!({"search": ["a b"]})), "expected.search[0]");
        assert_eq!(
            field(json!({"interfaces": [{"mac": "02:00:00:00:00:01", "capture": true, "addresses": ["10.0.0.5/24"]}]})),
            "expected.interfaces[0].addresses"
        );
        assert_eq!(
            field(json!({"interfaces": [{"mac": "02:00:00:00:00:01", "capture": true, "up": false}]})),
            "expected.interfaces[0].up"
        );
        // Wrong types and unknown members are -32602 from the closed types.
        let e = parse_params::<CheckParams>(Some(json!({"expected": {"gateway": 5}}))).expect_err("type");
        assert_eq!((e.code, e.data.map(|d| d["field"].clone())), (INVALID_PARAMS, Some(json!("expected.gateway"))));
        let e = parse_params::<CheckParams>(Some(json!({"expected": {"interfaces": [{"mac": "x", "mtu": 1}]}})))
            .expect_err("unknown");
        assert_eq!(e.data.map(|d| d["field"].clone()), Some(json!("expected.interfaces[0].mtu")));
    }
}
