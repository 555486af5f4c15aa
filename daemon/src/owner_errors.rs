//! The one boundary where resource owners' errors become API errors.
//!
//! Owners (host networking, PCI passthrough, images, disk space, binary integrity, backups)
//! return their own `thiserror` enums: what went wrong, with the offending value as data and the
//! underlying error as `#[source]`. They know nothing of the wire. This module alone decides the
//! API code, the request `field` at fault and `details` of each variant, as `From` impls, so a
//! `?` in the lifecycle (whose steps return [`ApiError`]) converts at the edge and the owners'
//! texts reach the client unchanged as the message.
//!
//! It lives beside the owners rather than in `api/`: `api` is the wire's vocabulary that the
//! owners themselves use (specs, NIC specs), so mapping there would make `api` import every
//! owner and close a cycle.
//!
//! The test at the bottom reads the code table of docs/api.md and fails when a documented code
//! has no producer here or elsewhere (named in [`tests`]), or when a mapping changes a code or a
//! field.

use serde_json::{json, Value};

use crate::api::{ApiError, Code};
use crate::net::host::AttachError;

/// An error with `code`, the owner's text as the message and `field` when there is one.
fn api(code: Code, e: &impl std::fmt::Display, field: Option<&str>) -> ApiError {
    ApiError { code, message: e.to_string(), field: field.map(str::to_string), details: Value::Null }
}

impl From<AttachError> for ApiError {
    /// A network the config lacks is 3001 on `spec.nics[i].network`; a failed host step is 4001
    /// on `spec.nics[i]` with `details.step` `network.<step>`.
    fn from(e: AttachError) -> ApiError {
        match &e {
            AttachError::NoNetwork { nic, .. } => api(Code::NotInModel, &e, Some(&format!("spec.nics[{nic}].network"))),
            AttachError::Step { nic, step, .. } => {
                api(Code::ProvisioningFailed, &e, Some(&format!("spec.nics[{nic}]")))
                    .details(json!({ "step": format!("network.{step}") }))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::error::ALL_CODES;
    use crate::net::NetError;
    use std::collections::BTreeSet;

    /// One owner error through the mapping, with the code and field it must give.
    struct Case {
        what: &'static str,
        error: ApiError,
        code: Code,
        field: Option<&'static str>,
    }

    fn case(what: &'static str, error: impl Into<ApiError>, code: Code, field: Option<&'static str>) -> Case {
        Case { what, error: error.into(), code, field }
    }

    /// Every variant of every owner error, mapped.
    fn cases() -> Vec<Case> {
        vec![
            case(
                "net: NIC on an unknown network",
                AttachError::NoNetwork { nic: 1, network: "lan".into() },
                Code::NotInModel,
                Some("spec.nics[1].network"),
            ),
            case(
                "net: a host step",
                AttachError::Step { nic: 0, step: "tap", source: NetError::Exists("vm-a-0".into()) },
                Code::ProvisioningFailed,
                Some("spec.nics[0]"),
            ),
        ]
    }

    /// Codes no owner produces, and where they come from instead (each has its own tests
    /// there).
    const PRODUCED_ELSEWHERE: &[(Code, &str)] = &[
        (Code::BinaryMismatch, "qemu::integrity (pinned binaries)"),
        (Code::GroupNotViable, "pci::check (passthrough host checks)"),
        (Code::InUseByHost, "pci::check (passthrough host checks)"),
        (Code::ParseError, "rpc::request (the line)"),
        (Code::InvalidRequest, "rpc::request (the envelope)"),
        (Code::MethodNotFound, "rpc::methods (the method table)"),
        (Code::InvalidParams, "rpc::methods (params decoding)"),
        (Code::Internal, "rpc::server (a failed task), lifecycle (unreadable record)"),
        (Code::Unauthorized, "rpc::auth"),
        (Code::ReadOnly, "rpc::auth"),
        (Code::LimitExceeded, "rpc::limits, console"),
        (Code::RateLimited, "rpc::agent_rate"),
        (Code::InvalidSpec, "validate (spec rules)"),
        (Code::SpecDrift, "lifecycle::reconfigure (vm.apply)"),
        (Code::ChecksumMismatch, "lifecycle::snapshots (vm.revert)"),
        (Code::NotInModel, "validate (hardware indexes)"),
        (Code::CapacityExceeded, "capacity (CPU and memory admission)"),
        (Code::HardwareInUse, "capacity, nic (device and NIC conflicts)"),
        (Code::NotFound, "lifecycle::registry"),
        (Code::Busy, "lifecycle::registry, console"),
        (Code::AgentNotConnected, "agent::supervisor"),
        (Code::AgentTimeout, "agent::supervisor"),
        (Code::ConsoleUnavailable, "console"),
        (Code::ImageInUse, "lifecycle::images (image.delete)"),
        (Code::ImageExists, "lifecycle::images (image.import)"),
        (Code::NotFrozen, "lifecycle::snapshots (requires frozen)"),
    ];

    /// The codes of docs/api.md's error table, in its order.
    fn documented_codes() -> Vec<i32> {
        let doc = include_str!("../../docs/api.md");
        let start = doc.find("| Code | `kind` | Meaning | When |").expect("api.md has the error code table");
        doc[start..]
            .lines()
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let cell = l.split('|').nth(1).unwrap_or_default().trim();
                cell.parse().unwrap_or_else(|_| panic!("not a code in api.md's table: {l}"))
            })
            .collect()
    }

    #[test]
    fn every_mapping_keeps_its_code_and_field() {
        for c in cases() {
            assert_eq!((c.error.code, c.error.field.as_deref()), (c.code, c.field), "{}", c.what);
            assert!(!c.error.message.is_empty(), "{}: the owner's text is the message", c.what);
        }
    }

    #[test]
    fn every_code_documented_in_api_md_is_still_produced() {
        let documented = documented_codes();
        assert_eq!(documented.len(), ALL_CODES.len(), "api.md's table and api::Code differ: {documented:?}");
        let mapped: BTreeSet<i32> = cases().iter().map(|c| c.error.code.as_i32()).collect();
        let elsewhere: BTreeSet<i32> = PRODUCED_ELSEWHERE.iter().map(|(c, _)| c.as_i32()).collect();
        for n in documented {
            let code = Code::from_i32(n).unwrap_or_else(|| panic!("api.md documents {n}, which api::Code lacks"));
            assert!(
                mapped.contains(&n) || elsewhere.contains(&n),
                "api.md documents {n} ({}) but nothing produces it any more",
                code.kind()
            );
        }
    }
}
