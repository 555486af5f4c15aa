//! Guest agent use by the lifecycle: keeping a session per running VM, applying the spec's
//! `guest_interfaces` (and, through the exec server, its `ssh` keys:
//! [`super::housekeeping::authorize_ssh_soon`]) whenever a session (re)starts, and `vm.check` with expectations taken from
//! the spec and the VM record, never from the guest.
//!
//! Monitor NICs (issue 31) are capture NICs to the agent: `net.apply` names them (the agent sets
//! them up and promiscuous, since virtio-net hands the guest only its own unicast otherwise) and
//! `vm.check` expects them up, promiscuous and without an address. Both are sent only to an agent
//! whose `hello` lists [`CAPTURE_CAPABILITY`] (an older one refuses the members); `vm.check` of
//! a VM with monitor NICs under an older agent fails with a check saying so.
//!
//! All of it stays on [`Manager`], taking the VM's name: the session callback applies the
//! interfaces with no operation running (an operation's `vm.apply` calls the same
//! [`apply_guest_interfaces`]), and the `vm.guest_*`/`vm.check` calls are reads that
//! take no busy flag.

use super::Manager;
use crate::agent::supervisor::SessionEvent;
use crate::api::{ApiError, Ipv4Spec, NicMode};
use crate::guest_text::GuestList;
use serde_json::json;
use std::sync::Arc;
use vmhost_agent_protocol::{
    AgentInfo, ApplyParams, ApplyReport, Check, CheckParams, CheckReport, Expected, ExpectedNic, Hello, NetState,
    NetStateParams, CAPTURE_CAPABILITY,
};

/// Starts keeping an agent session for `name` (idempotent).
pub(super) fn watch_agent(mgr: &Arc<Manager>, name: &str) {
    let weak = Arc::downgrade(mgr);
    let vm = name.to_string();
    mgr.agents.start(name, mgr.paths(name).agent, move |event| {
        let mgr = weak.clone();
        let vm = vm.clone();
        async move {
            let Some(mgr) = mgr.upgrade() else { return };
            if event == SessionEvent::GuestRebooted {
                tracing::info!(vm = %vm, "guest rebooted; re-applying its interfaces");
            }
            if let Err(e) = apply_guest_interfaces(&mgr, &vm).await {
                tracing::warn!(vm = %vm, error = %e, "guest interfaces not applied");
            }
            // The spec's SSH keys go with the interfaces, through the exec server.
            super::housekeeping::authorize_ssh_soon(&mgr, &vm);
        }
    });
}

/// True when the agent that said `hello` understands capture NICs.
fn serves_capture(hello: &Hello) -> bool {
    hello.capabilities.iter().any(|c| c == CAPTURE_CAPABILITY)
}

/// The spec whose NICs the guest has: the one its QEMU runs (a NIC change waits for a restart).
fn booted_spec(rec: &crate::state::VmRecord) -> &crate::api::VmSpec {
    rec.running_spec.as_ref().unwrap_or(&rec.spec)
}

/// The MACs of the monitor NICs the guest has, in NIC order.
fn capture_macs(rec: &crate::state::VmRecord) -> Vec<String> {
    booted_spec(rec).monitor_nics().filter_map(|(i, _, _)| Some(rec.nics.get(i)?.mac.clone())).collect()
}

/// The `net.apply` request: the spec's guest interfaces, and the monitor NICs' MACs for an agent
/// that understands them; `true` when some were left out (an older agent refuses the member).
fn apply_params(rec: &crate::state::VmRecord, hello: &Hello) -> (ApplyParams<u16>, bool) {
    let capture = capture_macs(rec);
    let left_out = !capture.is_empty() && !serves_capture(hello);
    let capture = if left_out { Vec::new() } else { capture };
    (ApplyParams { interfaces: rec.spec.guest_interfaces.clone(), capture }, left_out)
}

/// Sends the spec's `guest_interfaces` to the agent (an empty list deletes what the agent
/// made before), and the monitor NICs to set up and promiscuous.
pub(super) async fn apply_guest_interfaces(mgr: &Manager, name: &str) -> Result<ApplyReport, ApiError> {
    let rec = mgr.record(name)?;
    let mut left_out = false;
    let report: ApplyReport = mgr
        .agents
        .call_with(name, "net.apply", |hello| {
            let (params, skipped) = apply_params(&rec, hello);
            left_out = skipped;
            json!(params)
        })
        .await?;
    if left_out {
        tracing::warn!(
            vm = name,
            "the guest agent does not know capture NICs (no {CAPTURE_CAPABILITY}): the monitor NICs are not \
             set up and promiscuous by it"
        );
    }
    if report.changed {
        let (created, deleted) = (GuestList(&report.created), GuestList(&report.deleted));
        tracing::info!(vm = name, %created, %deleted, "guest interfaces applied");
    }
    Ok(report)
}

/// `vm.guest_info`.
///
/// # Errors
/// 4040, 5001, 5002.
pub(crate) async fn guest_info(mgr: &Manager, name: &str) -> Result<AgentInfo, ApiError> {
    mgr.record(name)?;
    mgr.agents.call(name, "agent.info", json!({})).await
}

/// `vm.guest_network`: what the guest sees.
///
/// # Errors
/// 4040, 5001, 5002.
pub(crate) async fn guest_network(mgr: &Manager, name: &str) -> Result<NetState, ApiError> {
    mgr.record(name)?;
    mgr.agents.call_with(name, "net.state", |hello| json!(NetStateParams { promisc: serves_capture(hello) })).await
}

/// `vm.check`: is the guest's network what the spec declares?
///
/// # Errors
/// 4040, 5001, 5002.
pub(crate) async fn check_guest(mgr: &Manager, name: &str) -> Result<CheckReport, ApiError> {
    let rec = mgr.record(name)?;
    let mut agent: Option<Hello> = None;
    let report: CheckReport = mgr
        .agents
        .call_with(name, "net.check", |hello| {
            agent = Some(hello.clone());
            json!(CheckParams { expected: expected_network(&rec, serves_capture(hello)) })
        })
        .await?;
    Ok(match agent {
        Some(hello) => unchecked_capture(&rec, &hello, report),
        None => report,
    })
}

/// `report` with one failing check per monitor NIC an agent without [`CAPTURE_CAPABILITY`]
/// could not check (it checked only that the NIC is present and up): the guest may have an
/// address on it, or leave it filtering.
fn unchecked_capture(rec: &crate::state::VmRecord, hello: &Hello, mut report: CheckReport) -> CheckReport {
    if serves_capture(hello) {
        return report;
    }
    for mac in capture_macs(rec) {
        report.ok = false;
        report.checks.push(Check {
            name: format!("capture nic {mac} checked"),
            ok: false,
            expected: format!("an agent with {CAPTURE_CAPABILITY}"),
            observed: format!("agent {} without it", hello.agent_version),
        });
    }
    report
}

/// What `vm.check` expects, from the spec the guest booted (addresses, gateway, DNS) and the
/// record (MACs).
/// Monitor NICs are capture NICs (`capture`: up, promiscuous, no address) when the agent
/// understands them, else plain NICs expected up with no address checked.
pub(super) fn expected_network(rec: &crate::state::VmRecord, capture: bool) -> Expected {
    let mut e = Expected::default();
    for (nic, alloc) in booted_spec(rec).nics.iter().zip(&rec.nics) {
        if nic.mode == NicMode::Monitor {
            e.interfaces.push(ExpectedNic { mac: alloc.mac.clone(), addresses: Vec::new(), up: true, capture });
            continue;
        }
        let mut addresses = Vec::new();
        if let Some(Ipv4Spec::Static { address, gateway, dns, search }) = &nic.ipv4 {
            addresses.push(address.clone());
            if e.gateway.is_none() {
                e.gateway.clone_from(gateway);
            }
            e.dns.extend(dns.iter().cloned());
            e.search.extend(search.iter().cloned());
        }
        e.interfaces.push(ExpectedNic { mac: alloc.mac.clone(), addresses, up: true, capture: false });
    }
    e.probe_gateway = e.gateway.is_some();
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NicSpec;
    use crate::nic::NicAlloc;
    use crate::state::VmRecord;

    /// A VM with a bridged NIC (static address) and a monitor NIC of `eth1`.
    fn record() -> VmRecord {
        let mut spec = crate::validate::tests::spec("sensor");
        spec.nics = vec![
            NicSpec {
                network: "lan".into(),
                ipv4: Some(Ipv4Spec::Static {
                    address: "10.0.0.5/24".into(),
                    gateway: Some("10.0.0.1".into()),
                    dns: vec!["10.0.0.1".into()],
                    search: vec![],
                }),
                ..NicSpec::default()
            },
            NicSpec { mode: NicMode::Monitor, source: Some("eth1".into()), ..NicSpec::default() },
        ];
        let mut rec = VmRecord::new(spec);
        rec.nics = vec![
            NicAlloc { mac: "52:54:00:00:00:01".into(), tap: "vmh00000001n0".into(), vhost: false },
            NicAlloc { mac: "52:54:00:00:00:02".into(), tap: "vmh00000001n1".into(), vhost: false },
        ];
        rec
    }

    fn hello(capabilities: &[&str]) -> Hello {
        Hello {
            agent_version: "0.1.0".into(),
            protocol_version: 1,
            capabilities: capabilities.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn monitor_nics_are_expected_as_capture_nics_without_an_address() {
        let rec = record();
        let wire = serde_json::to_value(expected_network(&rec, true)).expect("serializes");
        assert_eq!(
            wire["interfaces"],
            json!([
                {"mac": "52:54:00:00:00:01", "addresses": ["10.0.0.5/24"], "up": true},
                {"mac": "52:54:00:00:00:02", "addresses": [], "up": true, "capture": true}
            ])
        );
        assert_eq!((wire["gateway"].clone(), wire["probe_gateway"].clone()), (json!("10.0.0.1"), json!(true)));
        // For an agent without the capability: no member it would refuse.
        let wire = serde_json::to_value(expected_network(&rec, false)).expect("serializes");
        assert_eq!(wire["interfaces"][1], json!({"mac": "52:54:00:00:00:02", "addresses": [], "up": true}));
        // A VM without monitor NICs sends what it always sent, whatever the agent.
        let mut plain = rec.clone();
        plain.spec.nics.truncate(1);
        plain.nics.truncate(1);
        assert_eq!(expected_network(&plain, true), expected_network(&plain, false));
    }

    #[test]
    fn net_apply_names_the_monitor_nics_only_to_an_agent_that_knows_them() {
        let rec = record();
        let new = hello(&["net.apply", CAPTURE_CAPABILITY]);
        let (params, left_out) = apply_params(&rec, &new);
        assert_eq!(json!(params), json!({"interfaces": [], "capture": ["52:54:00:00:00:02"]}));
        assert!(!left_out);
        let (params, left_out) = apply_params(&rec, &hello(&["net.apply"]));
        assert_eq!(json!(params), json!({"interfaces": []}));
        assert!(left_out, "an older agent: said so in the log");
        let mut plain = rec.clone();
        plain.spec.nics.truncate(1);
        plain.nics.truncate(1);
        assert_eq!(apply_params(&plain, &hello(&[])), (ApplyParams { interfaces: vec![], capture: vec![] }, false));
    }

    #[test]
    fn an_agent_that_cannot_check_capture_nics_fails_the_check_saying_so() {
        let rec = record();
        let passed = CheckReport { ok: true, checks: vec![] };
        assert_eq!(unchecked_capture(&rec, &hello(&[CAPTURE_CAPABILITY]), passed.clone()), passed);
        let report = unchecked_capture(&rec, &hello(&["net.check"]), passed.clone());
        assert!(!report.ok);
        assert_eq!(
            report.checks,
            [Check {
                name: "capture nic 52:54:00:00:00:02 checked".into(),
                ok: false,
                expected: "an agent with net.capture".into(),
                observed: "agent 0.1.0 without it".into(),
            }]
        );
        let mut plain = rec.clone();
        plain.spec.nics.truncate(1);
        plain.nics.truncate(1);
        assert_eq!(unchecked_capture(&plain, &hello(&[]), passed.clone()), passed);
    }
}
