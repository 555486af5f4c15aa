//! Why the destination of a migration refused or gave it up, each with its stable API code
//! (docs/api.md): the refusals `vm.migrate_in` answers before anything is made, and the
//! reasons its task abandons a migration (sent to the source as `Abort` too).

use crate::api::{ApiError, Code};

/// Why `vm.migrate_in` refused, or its task gave the migration up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IncomingError {
    /// 3001 on `migration.listen`: the host has no migration port (`[migration] listen`).
    #[error("this host has no migration port")]
    NoPort,
    /// 4097 reason `passthrough`: a live migration cannot carry passthrough devices.
    #[error("a VM with passthrough devices cannot migrate live (move it cold: vm.move)")]
    Passthrough,
    /// 2001 on `spec.nics[i].mac`: a bridge NIC without the source's MAC.
    #[error("required to migrate: the source's MAC")]
    MacRequired {
        /// The NIC's index.
        index: usize,
    },
    /// 3003: a VM of that name exists here.
    #[error("a VM named {0:?} already exists on this host")]
    Exists(String),
    /// 3003: data disks kept from a destroyed VM of that name would be overwritten.
    #[error("data disks kept from a VM named {vm:?} are on this host ({}); purge or move them first", .disks.join(", "))]
    KeptDisks {
        /// The VM name.
        vm: String,
        /// The kept disks' names.
        disks: Vec<String>,
    },
    /// 2001 on `spec`: the source's `Hello` does not match what was admitted.
    #[error("{0}")]
    HelloMismatch(String),
    /// 4001 step `migrate_in`: the source did not connect within the prepare timeout.
    #[error("no source connected within {0} s")]
    PrepareTimeout(u64),
    /// 4001 step `migrate_in`: the control channel failed or closed before the commit.
    #[error("the control channel with the source failed before the commit: {0}")]
    Control(String),
    /// 4001 step `migrate_in`: the source's first message was not `Hello`.
    #[error("the source's first message was not hello")]
    NoHello,
    /// The source gave up (its code and message).
    #[error("the source aborted: {message}")]
    SourceAborted {
        /// The source's code.
        code: i32,
        /// The source's message.
        message: String,
    },
    /// 4001 step `migrate_in`: QEMU's side refused a step.
    #[error("QEMU: {0}")]
    Qemu(#[from] crate::qemu::migration::MigrationQemuError),
    /// 4001 step `migrate_in`: the source asked to commit but the memory stream had not
    /// completed here.
    #[error("the memory stream is {0:?} here, not completed: nothing to commit")]
    NotCompleted(String),
    /// 4097 reason `machine` or `cpu`: this host's QEMU would not give the guest the machine
    /// it runs on the source.
    #[error("{0}")]
    Machine(super::super::machine::Mismatch),
    /// 4001 step `migrate_in`: a local file or socket of the migration.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
}

impl From<IncomingError> for ApiError {
    fn from(e: IncomingError) -> ApiError {
        let message = e.to_string();
        match e {
            IncomingError::NoPort => ApiError::new(Code::NotInModel, message).field("migration.listen"),
            IncomingError::Passthrough => ApiError::new(Code::NotMovable, message)
                .field("spec")
                .details(serde_json::json!({ "reason": "passthrough" })),
            IncomingError::Machine(m) => {
                ApiError::new(Code::NotMovable, message).details(serde_json::json!({ "reason": m.reason() }))
            }
            IncomingError::MacRequired { index } => ApiError::invalid(format!("spec.nics[{index}].mac"), message),
            IncomingError::Exists(name) => {
                ApiError::in_use(vec![(message, serde_json::json!({ "vm": name }))], Some("spec.name".to_string()))
            }
            IncomingError::KeptDisks { vm, disks } => ApiError::in_use(
                vec![(message, serde_json::json!({ "vm": vm, "kept_disks": disks }))],
                Some("spec.name".to_string()),
            ),
            IncomingError::HelloMismatch(_) => ApiError::invalid("spec", message),
            IncomingError::SourceAborted { code, .. } => match Code::from_i32(code) {
                Some(code) => ApiError::new(code, message),
                None => super::super::super::provisioning("migrate_in", message),
            },
            IncomingError::PrepareTimeout(_)
            | IncomingError::Control(_)
            | IncomingError::NoHello
            | IncomingError::Qemu(_)
            | IncomingError::NotCompleted(_)
            | IncomingError::Io { .. } => super::super::super::provisioning("migrate_in", message),
        }
    }
}
