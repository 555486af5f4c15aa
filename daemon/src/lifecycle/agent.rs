//! Guest agent use by the lifecycle: keeping a session per running VM, applying the spec's
//! `guest_interfaces` (and, through the exec server, its `ssh` keys:
//! [`super::housekeeping::authorize_ssh_soon`]) whenever a session (re)starts, and `vm.check` with expectations taken from
//! the spec and the VM record, never from the guest.
//!
//! All of it stays on [`Manager`], taking the VM's name: the session callback applies the
//! interfaces with no operation running (an operation's `vm.apply` calls the same
//! [`apply_guest_interfaces`]), and the `vm.guest_*`/`vm.check` calls are reads that
//! take no busy flag.

use super::Manager;
use crate::agent::supervisor::SessionEvent;
use crate::api::{ApiError, Ipv4Spec};
use crate::guest_text::GuestList;
use serde_json::json;
use std::sync::Arc;
use vmhost_agent_protocol::{
    AgentInfo, ApplyParams, ApplyReport, CheckParams, CheckReport, Expected, ExpectedNic, NetState,
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

/// Sends the spec's `guest_interfaces` to the agent (an empty list deletes what the agent
/// made before).
pub(super) async fn apply_guest_interfaces(mgr: &Manager, name: &str) -> Result<ApplyReport, ApiError> {
    let spec = mgr.record(name)?.spec;
    let report: ApplyReport =
        mgr.agents.call(name, "net.apply", json!(ApplyParams { interfaces: spec.guest_interfaces })).await?;
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
    mgr.agents.call(name, "net.state", json!({})).await
}

/// `vm.check`: is the guest's network what the spec declares?
///
/// # Errors
/// 4040, 5001, 5002.
pub(crate) async fn check_guest(mgr: &Manager, name: &str) -> Result<CheckReport, ApiError> {
    let rec = mgr.record(name)?;
    let expected = expected_network(&rec);
    mgr.agents.call(name, "net.check", json!(CheckParams { expected })).await
}

/// What `vm.check` expects, from the spec (addresses, gateway, DNS) and the record (MACs).
pub(super) fn expected_network(rec: &crate::state::VmRecord) -> Expected {
    let mut e = Expected::default();
    for (nic, alloc) in rec.spec.nics.iter().zip(&rec.nics) {
        let mut addresses = Vec::new();
        if let Some(Ipv4Spec::Static { address, gateway, dns, search }) = &nic.ipv4 {
            addresses.push(address.clone());
            if e.gateway.is_none() {
                e.gateway.clone_from(gateway);
            }
            e.dns.extend(dns.iter().cloned());
            e.search.extend(search.iter().cloned());
        }
        e.interfaces.push(ExpectedNic { mac: alloc.mac.clone(), addresses, up: true });
    }
    e.probe_gateway = e.gateway.is_some();
    e
}
