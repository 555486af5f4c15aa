//! Wire types of guest housekeeping (issue 29): the spec's `ssh` access, `vm.sync_time`, and
//! how `vm.stop` asks a guest to power off.
//!
//! These are shapes only; the rules (user name syntax, key types and sizes) are
//! [`crate::validate`]'s, and what runs them is `lifecycle::housekeeping`.

use serde::{Deserialize, Serialize};

/// The account `ssh.user` names when the spec leaves it out.
pub const DEFAULT_SSH_USER: &str = "vmhost";

fn default_ssh_user() -> String {
    DEFAULT_SSH_USER.to_string()
}

/// `spec.ssh`: an account in the guest that these OpenSSH public keys may log in to. Written
/// through the cloud-init seed (when the VM has one) and by the guest's exec server at every
/// agent session start, so direct-kernel VMs get it too; changed live by `vm.apply`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshSpec {
    /// The account (`[a-z_][a-z0-9_-]{0,31}`, default `vmhost`), created when missing; no sudo
    /// is granted.
    #[serde(default = "default_ssh_user")]
    pub user: String,
    /// The whole `authorized_keys` of the account: 1 to 16 OpenSSH public key lines.
    pub keys: Vec<String>,
}

/// How `vm.stop` (and `vm.restart`) asks the guest to power off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StopMethod {
    /// The ACPI power button (QMP `system_powerdown`), as always.
    #[default]
    Acpi,
    /// `guest.shutdown` through the guest's exec server; ACPI at once when that cannot be
    /// asked (no exec server, every slot busy, an error).
    Agent,
}

impl StopMethod {
    /// True for the default (`acpi`).
    pub fn is_default(&self) -> bool {
        *self == StopMethod::Acpi
    }
}

/// The result of `vm.sync_time`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncTimeReply {
    /// The guest's clock before it was set (RFC 3339, UTC, milliseconds).
    pub before: String,
    /// The guest's clock right after (RFC 3339, UTC, milliseconds).
    pub after: String,
    /// The host's clock minus the guest's before, in milliseconds (positive: the guest was
    /// behind).
    pub offset_ms: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_user_defaults_and_the_shape_is_closed() {
        let s: SshSpec = serde_json::from_value(serde_json::json!({"keys": ["ssh-ed25519 AAAA x"]})).unwrap();
        assert_eq!(s.user, "vmhost");
        assert!(serde_json::from_value::<SshSpec>(serde_json::json!({"keys": [], "sudo": true})).is_err());
        assert!(serde_json::from_value::<SshSpec>(serde_json::json!({"user": "a"})).is_err(), "keys are required");
    }

    #[test]
    fn stop_methods_are_lowercase_and_acpi_by_default() {
        assert_eq!(StopMethod::default(), StopMethod::Acpi);
        let m: StopMethod = serde_json::from_str(r#""agent""#).unwrap();
        assert_eq!(m, StopMethod::Agent);
        assert!(serde_json::from_str::<StopMethod>(r#""reboot""#).is_err());
    }
}
