//! The API's error model: one stable numeric code per failure kind, the offending field, details.
//!
//! Every error a client can see is an [`ApiError`]. The code is part of the API contract (plugins
//! branch on it); the message is for humans. `data` always carries `{kind, field, details}` so a
//! client can point at the exact field of its request without parsing the message.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Stable error codes of API v1 (see docs/api.md). Never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    /// JSON-RPC: the line is not valid JSON.
    ParseError,
    /// JSON-RPC: not a request object, or the line is too long.
    InvalidRequest,
    /// JSON-RPC: no such method.
    MethodNotFound,
    /// JSON-RPC: params do not match the method's schema.
    InvalidParams,
    /// JSON-RPC: a daemon fault that is not the caller's doing.
    Internal,
    /// The socket peer is neither root nor in an allowed group.
    Unauthorized,
    /// The peer is read-only and called a mutating method.
    ReadOnly,
    /// A request would exceed a limit of the connection or of the peer's uid (batch length,
    /// subscriptions); `details` names the limit and its value.
    LimitExceeded,
    /// Too many guest-agent calls for this VM and role in a short time; retry after
    /// `details.retry_after_ms`.
    RateLimited,
    /// The VM spec is malformed or violates a rule.
    InvalidSpec,
    /// `vm.apply` found an existing VM whose spec differs.
    SpecDrift,
    /// A file does not have the sha256 the request names (`image.import`); `details:
    /// {expected, found, bytes}`. Nothing was kept.
    ChecksumMismatch,
    /// The request names hardware or sizes the host model does not have.
    NotInModel,
    /// Existing VMs plus the request exceed the host's allocatable capacity.
    CapacityExceeded,
    /// A hardware index is held by another VM.
    HardwareInUse,
    /// A passthrough device's IOMMU group has a member that is still used by the host or another
    /// VM, so the group cannot be handed to the VM as a whole.
    GroupNotViable,
    /// A passthrough device is in use by the host itself (an addressed or routed network
    /// interface, a bridge or bond member, a mounted file system).
    InUseByHost,
    /// A passthrough device is not the device its model entry pins (`[hardware.CLASS]` with
    /// `id`, `subsystem`, `mac`): `details: {class, index, pci, expected, found}`. Nothing was
    /// bound.
    DeviceMismatch,
    /// QEMU or another host step failed.
    ProvisioningFailed,
    /// A binary vmhostd would run does not have the sha256 the config pins (`qemu.sha256`);
    /// `details: {path, expected, found}`. Nothing was started.
    BinaryMismatch,
    /// No VM with that name.
    NotFound,
    /// Another operation on this VM is in progress.
    Busy,
    /// The VM's guest agent has no open session.
    AgentNotConnected,
    /// The VM's guest agent did not answer in time.
    AgentTimeout,
    /// `vm.console`: the VM has no serial console to attach to now (it is not running, or its
    /// QEMU was started by a vmhostd without console sockets).
    ConsoleUnavailable,
    /// `image.delete`: VMs boot from the image (`details.vms`); it goes when they do.
    ImageInUse,
    /// `image.import`: an image of that name with another sha256 is there; `details.sha256`
    /// is its recorded (or computed) sha256. Delete it first.
    ImageExists,
    /// `vm.snapshot` or `vm.export` with `requires: "frozen"` of a running VM whose guest file
    /// systems cannot all be frozen (no agent session, its freeze failed, a file system it
    /// skipped); `details: {consistency, reason, frozen, skipped}`. Nothing was copied or kept.
    NotFrozen,
    /// `vm.exec`, `vm.file_push`, `vm.file_pull` are not allowed: by the host's config
    /// (`[agent] allow_exec = false`, `details.reason: "host"`) or by the VM's spec
    /// (`guest_exec: false`, `details.reason: "spec"`).
    ExecDisabled,
    /// All exec slots of the VM are in use (`details.slots`); retry when one ends.
    SlotsBusy,
    /// `vm.migrate` or `vm.move` cannot move this VM (`details.reason`: `passthrough` devices
    /// cannot move live, `status` it is not running or stopped as the call needs,
    /// `firmware` ...); nothing was sent and nothing changed on either host.
    NotMovable,
}

impl Code {
    /// The numeric code on the wire.
    pub fn as_i32(self) -> i32 {
        match self {
            Code::ParseError => -32700,
            Code::InvalidRequest => -32600,
            Code::MethodNotFound => -32601,
            Code::InvalidParams => -32602,
            Code::Internal => -32603,
            Code::Unauthorized => 1001,
            Code::ReadOnly => 1002,
            Code::LimitExceeded => 1003,
            Code::RateLimited => 1004,
            Code::InvalidSpec => 2001,
            Code::SpecDrift => 2002,
            Code::ChecksumMismatch => 2003,
            Code::NotInModel => 3001,
            Code::CapacityExceeded => 3002,
            Code::HardwareInUse => 3003,
            Code::GroupNotViable => 3004,
            Code::InUseByHost => 3005,
            Code::DeviceMismatch => 3006,
            Code::ProvisioningFailed => 4001,
            Code::BinaryMismatch => 4002,
            Code::NotFound => 4040,
            Code::Busy => 4090,
            Code::AgentNotConnected => 5001,
            Code::AgentTimeout => 5002,
            Code::ConsoleUnavailable => 4091,
            Code::ImageInUse => 4092,
            Code::ImageExists => 4093,
            Code::NotFrozen => 4094,
            Code::ExecDisabled => 4095,
            Code::SlotsBusy => 4096,
            Code::NotMovable => 4097,
        }
    }

    /// The machine-readable kind carried in `error.data.kind`.
    pub fn kind(self) -> &'static str {
        match self {
            Code::ParseError => "parse_error",
            Code::InvalidRequest => "invalid_request",
            Code::MethodNotFound => "method_not_found",
            Code::InvalidParams => "invalid_params",
            Code::Internal => "internal",
            Code::Unauthorized => "unauthorized",
            Code::ReadOnly => "read_only",
            Code::LimitExceeded => "limit_exceeded",
            Code::RateLimited => "rate_limited",
            Code::InvalidSpec => "invalid_spec",
            Code::SpecDrift => "spec_drift",
            Code::ChecksumMismatch => "checksum_mismatch",
            Code::NotInModel => "not_in_model",
            Code::CapacityExceeded => "capacity_exceeded",
            Code::HardwareInUse => "hardware_in_use",
            Code::GroupNotViable => "group_not_viable",
            Code::InUseByHost => "in_use_by_host",
            Code::DeviceMismatch => "device_mismatch",
            Code::ProvisioningFailed => "provisioning_failed",
            Code::BinaryMismatch => "binary_mismatch",
            Code::NotFound => "not_found",
            Code::Busy => "busy",
            Code::AgentNotConnected => "agent_not_connected",
            Code::AgentTimeout => "agent_timeout",
            Code::ConsoleUnavailable => "console_unavailable",
            Code::ImageInUse => "image_in_use",
            Code::ImageExists => "image_exists",
            Code::NotFrozen => "not_frozen",
            Code::ExecDisabled => "exec_disabled",
            Code::SlotsBusy => "slots_busy",
            Code::NotMovable => "not_movable",
        }
    }

    /// The code for a numeric wire value, if it is one of ours.
    pub fn from_i32(n: i32) -> Option<Code> {
        ALL_CODES.iter().copied().find(|c| c.as_i32() == n)
    }
}

/// Every code, for lookups and documentation tests.
pub const ALL_CODES: [Code; 31] = [
    Code::ParseError,
    Code::InvalidRequest,
    Code::MethodNotFound,
    Code::InvalidParams,
    Code::Internal,
    Code::Unauthorized,
    Code::ReadOnly,
    Code::LimitExceeded,
    Code::RateLimited,
    Code::InvalidSpec,
    Code::SpecDrift,
    Code::ChecksumMismatch,
    Code::NotInModel,
    Code::CapacityExceeded,
    Code::HardwareInUse,
    Code::GroupNotViable,
    Code::InUseByHost,
    Code::DeviceMismatch,
    Code::ProvisioningFailed,
    Code::BinaryMismatch,
    Code::NotFound,
    Code::Busy,
    Code::AgentNotConnected,
    Code::AgentTimeout,
    Code::ConsoleUnavailable,
    Code::ImageInUse,
    Code::ImageExists,
    Code::NotFrozen,
    Code::ExecDisabled,
    Code::SlotsBusy,
    Code::NotMovable,
];

/// `error.data` of every vmhost error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorData {
    /// Same as the code, as a word (`invalid_spec`, `hardware_in_use`, ...).
    pub kind: String,
    /// The request field at fault (`spec.hardware.sfp[0]`), when there is one.
    pub field: Option<String>,
    /// Structured details: conflicts, stderr tails, differing fields.
    pub details: Value,
}

/// A typed API error: what the client receives as the JSON-RPC `error` member.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message} (code {})", .code.as_i32())]
pub struct ApiError {
    /// The stable code.
    pub code: Code,
    /// Human-readable message.
    pub message: String,
    /// Offending field, if any.
    pub field: Option<String>,
    /// Structured details (`null` when there are none).
    pub details: Value,
}

impl ApiError {
    /// An error with a code and message and no field.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), field: None, details: Value::Null }
    }

    /// Names the request field at fault.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// Attaches structured details.
    pub fn details(mut self, details: Value) -> Self {
        self.details = details;
        self
    }

    /// Shorthand for a 2001 invalid-spec error on `field`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::new(Code::InvalidSpec, message).field(field)
    }

    /// A 3003 `hardware_in_use`: each conflict's sentence joined with `; ` as the message, the
    /// conflicts' objects as `details.conflicts`, `field` the first conflict's field.
    pub fn in_use(conflicts: Vec<(String, Value)>, field: Option<String>) -> Self {
        let message = conflicts.iter().map(|(sentence, _)| sentence.as_str()).collect::<Vec<_>>().join("; ");
        let list: Vec<Value> = conflicts.into_iter().map(|(_, c)| c).collect();
        let details = serde_json::json!({ "conflicts": list });
        ApiError { code: Code::HardwareInUse, message, field, details }
    }

    /// Shorthand for 4040.
    pub fn not_found(name: &str) -> Self {
        ApiError::new(Code::NotFound, format!("no VM named {name:?}")).field("name")
    }

    /// Shorthand for an internal error.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError::new(Code::Internal, message)
    }

    /// The `error.data` member.
    pub fn data(&self) -> ErrorData {
        ErrorData { kind: self.code.kind().to_string(), field: self.field.clone(), details: self.details.clone() }
    }

    /// The full JSON-RPC error object.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "code": self.code.as_i32(),
            "message": self.message,
            "data": self.data(),
        })
    }

    /// Rebuilds an error from a JSON-RPC error object (client side).
    pub fn from_json(v: &Value) -> ApiError {
        let num = v.get("code").and_then(Value::as_i64).unwrap_or(-32603);
        let code = i32::try_from(num).ok().and_then(Code::from_i32).unwrap_or(Code::Internal);
        let message = v.get("message").and_then(Value::as_str).unwrap_or("unknown error").to_string();
        let data = v.get("data");
        let field = data.and_then(|d| d.get("field")).and_then(Value::as_str).map(str::to_string);
        let details = data.and_then(|d| d.get("details")).cloned().unwrap_or(Value::Null);
        ApiError { code, message, field, details }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        let mut seen = std::collections::HashSet::new();
        for c in ALL_CODES {
            assert!(seen.insert(c.as_i32()), "duplicate code {}", c.as_i32());
            assert_eq!(Code::from_i32(c.as_i32()), Some(c));
        }
        assert_eq!(Code::from_i32(7), None);
    }

    #[test]
    fn passthrough_codes_have_their_numbers_and_kinds() {
        assert_eq!(Code::GroupNotViable.as_i32(), 3004);
        assert_eq!(Code::GroupNotViable.kind(), "group_not_viable");
        assert_eq!(Code::InUseByHost.as_i32(), 3005);
        assert_eq!(Code::InUseByHost.kind(), "in_use_by_host");
        // The serde name is the kind.
        assert_eq!(serde_json::to_value(Code::GroupNotViable).unwrap(), "group_not_viable");
        assert_eq!(serde_json::to_value(Code::InUseByHost).unwrap(), "in_use_by_host");
        assert_eq!((Code::DeviceMismatch.as_i32(), Code::DeviceMismatch.kind()), (3006, "device_mismatch"));
        assert_eq!(serde_json::to_value(Code::DeviceMismatch).unwrap(), "device_mismatch");
    }

    #[test]
    fn not_frozen_is_4094() {
        assert_eq!((Code::NotFrozen.as_i32(), Code::NotFrozen.kind()), (4094, "not_frozen"));
        assert_eq!(serde_json::to_value(Code::NotFrozen).unwrap(), "not_frozen");
        assert_eq!(Code::from_i32(4094), Some(Code::NotFrozen));
    }

    #[test]
    fn exec_codes_are_4095_and_4096() {
        assert_eq!((Code::ExecDisabled.as_i32(), Code::ExecDisabled.kind()), (4095, "exec_disabled"));
        assert_eq!((Code::SlotsBusy.as_i32(), Code::SlotsBusy.kind()), (4096, "slots_busy"));
        assert_eq!(serde_json::to_value(Code::SlotsBusy).unwrap(), "slots_busy");
    }

    #[test]
    fn json_round_trip_keeps_field_and_details() {
        let e = ApiError::new(Code::HardwareInUse, "sfp index 5 in use by sensor1")
            .field("spec.hardware.sfp[0]")
            .details(serde_json::json!({"conflicts": [{"class": "sfp", "index": 5, "holder": "sensor1"}]}));
        let j = e.to_json();
        assert_eq!(j["code"], 3003);
        assert_eq!(j["data"]["kind"], "hardware_in_use");
        assert_eq!(ApiError::from_json(&j), e);
    }
}
