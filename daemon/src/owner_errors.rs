//! The one boundary where resource owners' errors become API errors.
//!
//! Owners (host networking, PCI passthrough, images, disk space, binary integrity, backups)
//! return their own `thiserror` enums: what went wrong, with the offending value as data and the
//! underlying error as `#[source]`. They know nothing of the wire. This module alone decides the
//! API code, the request `field` at fault and `details` of each variant, as `From` impls, so a
//! `?` in the lifecycle (whose steps return [`ApiError`]) converts at the edge and the owners'
//! texts reach the client unchanged as the message. Where the lifecycle adds context to an
//! owner's error (which disk, which step) or fails in file work of its own, it wraps it in a
//! type of [`crate::lifecycle::errors`], mapped here too, so its code is chosen here and
//! nowhere else.
//!
//! It lives beside the owners rather than in `api/`: `api` is the wire's vocabulary that the
//! owners themselves use (specs, NIC specs), so mapping there would make `api` import every
//! owner and close a cycle.
//!
//! The test at the bottom reads the code table of docs/api.md and fails when a documented code
//! has no producer here or elsewhere (named in [`tests`]), or when a mapping changes a code or a
//! field.

use serde_json::{json, Value};

use crate::agent::exec::files::SourceError;
use crate::agent::exec::session::ExecError;
use crate::api::{ApiError, Code};
use crate::backup::{BackupError, ManifestError};
use crate::disk::data::DataDiskError;
use crate::disk::space::SpaceError;
use crate::disk::{DiskError, GrowError, OverlayError};
use crate::images::download::DownloadError;
use crate::images::{ImageError, StoreError};
use crate::lifecycle::errors::{DiskStepError, FileError, IntentRefused, LaunchFileError, QemuStepError};
use crate::net::host::AttachError;
use crate::pci::bind::{BindError, StepFailure};
use crate::pci::check::{CheckError, HostUseKind};
use crate::pci::identity::{FoundMac, IdentityError, PinnedMismatch};
use crate::pci::PassthroughError;
use crate::placement::pin::PinError as CpuPinError;
use crate::placement::topology::TopologyError;
use crate::qemu::integrity::PinError;
use crate::seed::SeedError;

/// An error with `code`, the owner's text as the message and `field` when there is one.
fn api(code: Code, e: &impl std::fmt::Display, field: Option<&str>) -> ApiError {
    ApiError { code, message: e.to_string(), field: field.map(str::to_string), details: Value::Null }
}

impl From<ExecError> for ApiError {
    fn from(e: ExecError) -> ApiError {
        let message = e.to_string();
        match e {
            ExecError::Busy(_) => ApiError::new(Code::SlotsBusy, message)
                .field("name")
                .details(json!({"slots": crate::agent::exec::slots::EXEC_SLOTS})),
            ExecError::NoPorts | ExecError::NoServer { .. } | ExecError::NotServed(_) | ExecError::Session(_) => {
                ApiError::new(Code::AgentNotConnected, message).field("name")
            }
            ExecError::Timeout { .. } => ApiError::new(Code::AgentTimeout, message).field("name"),
            ExecError::Refused { code, message: guest, data, .. } => ApiError::new(Code::ProvisioningFailed, message)
                .details(json!({"agent_error": {"code": code, "message": guest, "data": data}})),
            ExecError::Checksum { what, expected, found, bytes } => {
                let field = (what == "the content").then_some("sha256");
                let e = ApiError::new(Code::ChecksumMismatch, message)
                    .details(json!({"expected": expected, "found": found, "bytes": bytes}));
                match field {
                    Some(f) => e.field(f),
                    None => e,
                }
            }
            ExecError::CallerGone => ApiError::internal(message),
            ExecError::Source { .. } => {
                ApiError::new(Code::ProvisioningFailed, message).field("source").details(json!({"step": "source"}))
            }
        }
    }
}

impl From<SourceError> for ApiError {
    fn from(e: SourceError) -> ApiError {
        ApiError::new(Code::InvalidParams, e.to_string()).field("source")
    }
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

impl From<CheckError> for ApiError {
    /// 2001 with `details.problems`, 3003 with `details.conflicts`, 3005 with `details.in_use`,
    /// 3004 with `details.blocking` (and `details.no_iommu_group`); `field` is the first
    /// offending request's.
    fn from(e: CheckError) -> ApiError {
        let (code, details) = match &e {
            CheckError::Shape(problems) => {
                let list: Vec<Value> = problems
                    .iter()
                    .map(|p| json!({"address": p.address.to_string(), "field": p.field, "problem": p.problem}))
                    .collect();
                (Code::InvalidSpec, json!({ "problems": list }))
            }
            CheckError::Held(conflicts) => {
                let list: Vec<Value> =
                    conflicts.iter().map(|c| json!({"address": c.address.to_string(), "holder": c.holder})).collect();
                (Code::HardwareInUse, json!({ "conflicts": list }))
            }
            CheckError::InUseByHost(uses) => {
                let list: Vec<Value> = uses
                    .iter()
                    .map(|u| {
                        let address = u.address.to_string();
                        match &u.kind {
                            HostUseKind::Mounted(dev) => {
                                json!({"address": address, "block_device": dev, "reason": u.kind.reason()})
                            }
                            HostUseKind::Address(i) | HostUseKind::DefaultRoute(i) | HostUseKind::Enslaved(i) => {
                                json!({"address": address, "interface": i, "reason": u.kind.reason()})
                            }
                        }
                    })
                    .collect();
                (Code::InUseByHost, json!({ "in_use": list }))
            }
            CheckError::NoIommuGroup(requested) => {
                let list: Vec<String> = requested.iter().map(|r| r.address.to_string()).collect();
                (Code::GroupNotViable, json!({"no_iommu_group": list, "blocking": []}))
            }
            CheckError::GroupNotViable(groups) => {
                let list: Vec<Value> = groups
                    .iter()
                    .flat_map(|g| {
                        g.blocking.iter().map(move |m| {
                            json!({
                                "address": m.address.to_string(),
                                "driver": m.driver,
                                "group": g.group,
                                "holder": m.holder,
                            })
                        })
                    })
                    .collect();
                (Code::GroupNotViable, json!({ "blocking": list }))
            }
        };
        api(code, &e, e.field()).details(details)
    }
}

/// One mismatch as `details`: `{class, index, pci, expected: {id, subsystem, mac}, found: {id,
/// subsystem, mac, mac_problem}}`; `found.mac` is `"unknown"` (with `mac_problem`) when the pin has
/// a MAC that could not be read, `null` when the pin has none.
fn mismatch_details(m: &PinnedMismatch) -> Value {
    let e = &m.mismatch.expected;
    let f = &m.mismatch.found;
    let (mac, problem) = match &f.mac {
        FoundMac::NotRead => (Value::Null, Value::Null),
        FoundMac::Address(a) => (json!(crate::hardware::mac_text(a)), Value::Null),
        FoundMac::Unknown(why) => (json!("unknown"), json!(why)),
    };
    json!({
        "class": m.class,
        "index": m.index,
        "pci": m.address.to_string(),
        "field": m.field,
        "expected": {"id": e.id_text(), "subsystem": e.subsystem_text(), "mac": e.mac_text()},
        "found": {"id": f.id_text(), "subsystem": f.subsystem_text(), "mac": mac, "mac_problem": problem},
    })
}

impl From<IdentityError> for ApiError {
    /// 3006 on the first mismatching request's field; `details` is the first mismatch
    /// ([`mismatch_details`]) plus `mismatches`, every one of them.
    fn from(e: IdentityError) -> ApiError {
        let IdentityError::Mismatch(list) = &e;
        let mut details = list.first().map(mismatch_details).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut details {
            map.insert("mismatches".into(), Value::Array(list.iter().map(mismatch_details).collect()));
        }
        api(Code::DeviceMismatch, &e, list.first().map(|m| m.field.as_str())).details(details)
    }
}

fn step_failure(f: &StepFailure) -> Value {
    json!({"address": f.address.to_string(), "step": f.step, "reason": f.reason})
}

impl From<&BindError> for ApiError {
    /// 4001 (a host step failed), with the failures in `details.failures` (and
    /// `details.restored`, `details.restore_failures` after a failed bind).
    fn from(e: &BindError) -> ApiError {
        let details = match e {
            BindError::NoVfioPci => json!({"failures": []}),
            BindError::Bind { failure, restored, restore_failures } => json!({
                "failures": [step_failure(failure)],
                "restored": restored.iter().map(ToString::to_string).collect::<Vec<_>>(),
                "restore_failures": restore_failures.iter().map(step_failure).collect::<Vec<_>>(),
            }),
            BindError::Release { failures } => {
                json!({"failures": failures.iter().map(step_failure).collect::<Vec<_>>()})
            }
        };
        api(Code::ProvisioningFailed, e, None).details(details)
    }
}

impl From<PassthroughError> for ApiError {
    /// 4001 with `details.step` `vfio.<step>` (`vfio_access` for a group node).
    fn from(e: PassthroughError) -> ApiError {
        api(Code::ProvisioningFailed, &e, None).details(json!({ "step": e.step() }))
    }
}

impl From<SeedError> for ApiError {
    /// 4001 with `details.step` `seed` (`instance_id` for a new instance id).
    fn from(e: SeedError) -> ApiError {
        api(Code::ProvisioningFailed, &e, None).details(json!({ "step": e.step() }))
    }
}

impl From<ImageError> for ApiError {
    /// 2001 on the request field at fault, 4090 on `name`, 2003 on `sha256` (`name` for a
    /// recorded image that changed) with `details: {expected, found, bytes}`.
    fn from(e: ImageError) -> ApiError {
        match &e {
            ImageError::NotAName(_) => api(Code::InvalidSpec, &e, Some("name")),
            ImageError::BadSha256 => api(Code::InvalidSpec, &e, Some("sha256")),
            ImageError::ZeroTimeout => api(Code::InvalidSpec, &e, Some("timeout_s")),
            ImageError::BadUrl(_) | ImageError::NotFetched | ImageError::NotImportable { .. } => {
                api(Code::InvalidSpec, &e, Some("source"))
            }
            ImageError::Busy(_) => api(Code::Busy, &e, Some("name")),
            ImageError::Mismatch { expected, found, bytes, .. } => api(Code::ChecksumMismatch, &e, Some("sha256"))
                .details(json!({ "expected": expected, "found": found, "bytes": bytes })),
            ImageError::Changed { expected, found, bytes, .. } => api(Code::ChecksumMismatch, &e, Some("name"))
                .details(json!({ "expected": expected, "found": found, "bytes": bytes })),
        }
    }
}

impl From<StoreError> for ApiError {
    /// 2001 on `source` for a file to import that is not one the store takes (`name` for a
    /// name holding something other than a file), 4093 on `name` for an image placed meanwhile,
    /// 4002 for a QEMU binary that is not the pinned one, else 4001 with `details.step`
    /// `image_list`, `image_delete` or `image_import`.
    fn from(e: StoreError) -> ApiError {
        let e = match e {
            StoreError::Inspect { source: DiskError::Pinned(refusal), .. } => return refusal.into(),
            e => e,
        };
        let step = |step: &str| api(Code::ProvisioningFailed, &e, None).details(json!({ "step": step }));
        match &e {
            StoreError::SourceUnreadable { .. }
            | StoreError::SourceLink { .. }
            | StoreError::NotAnImage { .. }
            | StoreError::NamesAnotherFile { .. } => api(Code::InvalidSpec, &e, Some("source")),
            StoreError::NotAFile { .. } => api(Code::InvalidSpec, &e, Some("name")),
            StoreError::Appeared { .. } => api(Code::ImageExists, &e, Some("name")),
            StoreError::List { .. } => step("image_list"),
            StoreError::Delete { .. } => step("image_delete"),
            StoreError::Create { .. }
            | StoreError::Copy { .. }
            | StoreError::Write(_)
            | StoreError::Reopen(_)
            | StoreError::Place { .. }
            | StoreError::Unreadable { .. }
            | StoreError::Inspect { .. }
            | StoreError::Record { .. } => step("image_import"),
        }
    }
}

impl From<DownloadError> for ApiError {
    /// Always on `source`: 2001 for a URL or address that is not fetched (`details: {address,
    /// host}` for an address), 3002 for a body too large (`details: {resource, available}`),
    /// else 4001 with `details.step` `download`.
    fn from(e: DownloadError) -> ApiError {
        let source = Some("source");
        match &e {
            DownloadError::Refused { host, addr, .. } => {
                api(Code::InvalidSpec, &e, source).details(json!({ "address": addr.to_string(), "host": host }))
            }
            DownloadError::RedirectNotFetched { .. } | DownloadError::NotForCurl => api(Code::InvalidSpec, &e, source),
            DownloadError::TooLarge { max_bytes, .. } => api(Code::CapacityExceeded, &e, source)
                .details(json!({ "resource": "image_bytes", "available": max_bytes })),
            DownloadError::Resolve { .. }
            | DownloadError::NoAddress { .. }
            | DownloadError::TimedOut(_)
            | DownloadError::TooManyRedirects(_)
            | DownloadError::Write(_)
            | DownloadError::Spawn { .. }
            | DownloadError::NoPipes
            | DownloadError::Wait(_)
            | DownloadError::Curl { .. }
            | DownloadError::Status { .. }
            | DownloadError::NoStatus { .. } => {
                api(Code::ProvisioningFailed, &e, source).details(json!({ "step": "download" }))
            }
        }
    }
}

impl From<SpaceError> for ApiError {
    /// 4001 when the free space cannot be read; 3002 on the field the room is for, with
    /// `details: {resource, requested, available, ...}`.
    fn from(e: SpaceError) -> ApiError {
        match &e {
            SpaceError::Unreadable { .. } => api(Code::ProvisioningFailed, &e, None),
            SpaceError::NoRoom { field, resource, refused, .. } => api(Code::CapacityExceeded, &e, Some(field))
                .details(json!({
                    "resource": resource,
                    "requested": refused.requested,
                    "available": refused.available,
                    "reserved": refused.reserved,
                })),
            SpaceError::Disks { requested_gib, available_gib, free_bytes, total_bytes, data_disks, .. } => {
                let field = if *data_disks { "spec.disks" } else { "spec.boot.disk_gib" };
                api(Code::CapacityExceeded, &e, Some(field)).details(json!({
                    "resource": "disk_gib",
                    "requested": requested_gib,
                    "available": available_gib,
                    "free_bytes": free_bytes,
                    "total_bytes": total_bytes,
                }))
            }
        }
    }
}

impl From<DataDiskError> for ApiError {
    /// 4002 when the QEMU binary is not the pinned one; else 4001 with `details.step`
    /// `data_disk` (and `details.disk`, `details.stderr` for a disk QEMU could not make or grow).
    fn from(e: DataDiskError) -> ApiError {
        let e = match e {
            DataDiskError::GrowTakenBack { source: DiskError::Pinned(refusal), .. }
            | DataDiskError::Create { source: DiskError::Pinned(refusal), .. }
            | DataDiskError::Grow { source: DiskError::Pinned(refusal), .. } => return refusal.into(),
            e => e,
        };
        let details = match &e {
            DataDiskError::Create { disk, source } | DataDiskError::Grow { disk, source, .. } => {
                json!({ "step": "data_disk", "disk": disk, "stderr": source.stderr_tail().unwrap_or_default() })
            }
            _ => json!({ "step": "data_disk" }),
        };
        api(Code::ProvisioningFailed, &e, None).details(details)
    }
}

impl From<OverlayError> for ApiError {
    /// 4002 when the QEMU binary is not the pinned one; else 4001 with `details.step` `disk`
    /// (and QEMU's `stderr`) or `qemu_files`, none for a removal (an orphan's, the VM's own).
    fn from(e: OverlayError) -> ApiError {
        let e = match e {
            OverlayError::Create(DiskError::Pinned(refusal)) | OverlayError::Base(DiskError::Pinned(refusal)) => {
                return refusal.into()
            }
            e => e,
        };
        let details = match &e {
            OverlayError::Create(d) => json!({ "step": "disk", "stderr": d.stderr_tail().unwrap_or_default() }),
            OverlayError::Place(_) => json!({ "step": "disk" }),
            OverlayError::Base(_) => json!({ "step": "qemu_files" }),
            OverlayError::RemoveOrphan(_) | OverlayError::Remove(_) => Value::Null,
        };
        api(Code::ProvisioningFailed, &e, None).details(details)
    }
}

impl From<GrowError> for ApiError {
    /// 4002 when the QEMU binary is not the pinned one; else 4001 with `details.step`
    /// `disk_grow` and QEMU's `stderr`.
    fn from(e: GrowError) -> ApiError {
        if let DiskError::Pinned(refusal) = e.source {
            return refusal.into();
        }
        let details = json!({ "step": "disk_grow", "stderr": e.source.stderr_tail().unwrap_or_default() });
        api(Code::ProvisioningFailed, &e, None).details(details)
    }
}

impl From<PinError> for ApiError {
    /// 4002 on the pin's key (`qemu.sha256`), `details: {path, expected, found}` (`found` null
    /// when the binary cannot be read).
    fn from(e: PinError) -> ApiError {
        api(Code::BinaryMismatch, &e, Some(e.key)).details(json!({
            "path": e.path,
            "expected": e.expected,
            "found": e.found(),
        }))
    }
}

impl From<CpuPinError> for ApiError {
    /// 4001 `details.step: "placement"`: QEMU's threads could not be put on the VM's CPUs
    /// (the launch fails and is undone; a pin that cannot be kept is not a VM that runs as
    /// asked).
    fn from(e: CpuPinError) -> ApiError {
        api(Code::ProvisioningFailed, &e, None).details(json!({"step": "placement"}))
    }
}

impl From<TopologyError> for ApiError {
    /// 4001 with `details: {step: "topology", path}`: the host's sysfs did not say where a VM
    /// could go, which is the host's fault, not the request's.
    fn from(e: TopologyError) -> ApiError {
        let path = match &e {
            TopologyError::Read { path, .. } | TopologyError::Parse { path, .. } => path.clone(),
        };
        api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "topology", "path": path }))
    }
}

impl From<BackupError> for ApiError {
    /// On `backup`: 2001 for a name or a manifest that is not a backup's, 4040 for none, 2003
    /// (`details.file`) for a `manifest.json` that is not a regular file or would take what is
    /// not the backup's; 4001 with `details.step` `export` when a backup cannot be written.
    fn from(e: BackupError) -> ApiError {
        let backup = Some("backup");
        let manifest = json!({ "file": "manifest.json" });
        match &e {
            BackupError::NotAName(_) | BackupError::Unreadable { .. } => api(Code::InvalidSpec, &e, backup),
            BackupError::NoSuchBackup { .. } => api(Code::NotFound, &e, backup),
            BackupError::NotAFile { .. } => api(Code::ChecksumMismatch, &e, backup).details(manifest),
            BackupError::Manifest { source: ManifestError::Invalid(_), .. } => {
                api(Code::InvalidSpec, &e, backup).details(manifest)
            }
            BackupError::Manifest { source: ManifestError::TakesOthers(_), .. } => {
                api(Code::ChecksumMismatch, &e, backup).details(manifest)
            }
            BackupError::Create { .. }
            | BackupError::NoFreeName { .. }
            | BackupError::Encode(_)
            | BackupError::Finish { .. } => {
                api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "export" }))
            }
        }
    }
}

impl From<FileError> for ApiError {
    /// 4001 with `details.step` the step the file belongs to; 2001 on `spec.boot.disk` for a
    /// file offered for import that cannot be opened.
    fn from(e: FileError) -> ApiError {
        match e.step() {
            Some(step) => api(Code::ProvisioningFailed, &e, None).details(json!({ "step": step })),
            None => api(Code::InvalidSpec, &e, Some("spec.boot.disk")),
        }
    }
}

impl From<DiskStepError> for ApiError {
    /// 4002 when the QEMU binary is not the pinned one. An import's file QEMU refused: 2001 on
    /// `spec.boot.disk` (`details.stderr`); a backup's copy it refused: 2003 on `backup`
    /// (`details.file`). Else 4001 with `details.step` (and QEMU's `stderr` for a grow of an
    /// imported disk and a stopped VM's export).
    fn from(e: DiskStepError) -> ApiError {
        let e = match e {
            DiskStepError::InspectImport { source: DiskError::Pinned(refusal), .. }
            | DiskStepError::GrowImport { source: DiskError::Pinned(refusal), .. }
            | DiskStepError::InspectCopy { source: DiskError::Pinned(refusal), .. }
            | DiskStepError::ReadDisk { source: DiskError::Pinned(refusal), .. }
            | DiskStepError::Flatten { source: DiskError::Pinned(refusal) }
            | DiskStepError::BaseImage { source: DiskError::Pinned(refusal), .. }
            | DiskStepError::MakeCopies { source: DiskError::Pinned(refusal), .. } => return refusal.into(),
            e => e,
        };
        let refused = e.disk_error().file_refused();
        let tail = e.disk_error().stderr_tail().unwrap_or_default().to_string();
        let step = |step: &str| api(Code::ProvisioningFailed, &e, None).details(json!({ "step": step }));
        match &e {
            DiskStepError::InspectImport { .. } if refused => {
                api(Code::InvalidSpec, &e, Some("spec.boot.disk")).details(json!({ "stderr": tail }))
            }
            DiskStepError::InspectImport { .. } => step("root_disk"),
            DiskStepError::GrowImport { .. } => {
                api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "root_disk", "stderr": tail }))
            }
            DiskStepError::InspectCopy { file, .. } if refused => {
                api(Code::ChecksumMismatch, &e, Some("backup")).details(json!({ "file": file }))
            }
            DiskStepError::InspectCopy { .. } => step("import"),
            DiskStepError::Flatten { .. } => {
                api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "export", "stderr": tail }))
            }
            DiskStepError::ReadDisk { step: s, .. }
            | DiskStepError::BaseImage { step: s, .. }
            | DiskStepError::MakeCopies { step: s, .. } => step(s),
        }
    }
}

impl From<LaunchFileError> for ApiError {
    /// 2001 on the kernel's or initrd's field; 2001 on `spec.boot.firmware` (the secure pair:
    /// `spec.boot.secure_boot`) with `details.path` and `details.config`; 4001 step `qemu_files` or `firmware`; 4001 for
    /// the variables store's removal.
    fn from(e: LaunchFileError) -> ApiError {
        match &e {
            LaunchFileError::BootFile { field, .. } => api(Code::InvalidSpec, &e, Some(field)),
            LaunchFileError::Firmware(f) => {
                // The secure pair is what boot.secure_boot asks for.
                let field = if f.key().starts_with("firmware.uefi_secure_") {
                    "spec.boot.secure_boot"
                } else {
                    "spec.boot.firmware"
                };
                api(Code::InvalidSpec, &e, Some(field)).details(json!({ "path": f.path(), "config": f.key() }))
            }
            LaunchFileError::OpenForQemu { .. } => {
                api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "qemu_files" }))
            }
            LaunchFileError::CopyVars { .. } => {
                api(Code::ProvisioningFailed, &e, None).details(json!({ "step": "firmware" }))
            }
            LaunchFileError::RemoveVars { .. } => api(Code::ProvisioningFailed, &e, None),
        }
    }
}

impl From<IntentRefused> for ApiError {
    /// 5000: an operation began disk work its own checks should have refused.
    fn from(e: IntentRefused) -> ApiError {
        api(Code::Internal, &e, None)
    }
}

impl From<QemuStepError> for ApiError {
    /// 4001 with `details.step`: `qemu` (and the log's `stderr`), `qemu_verify`, `kill`,
    /// `process`, `disk_grow`, `data_disk` (and `details.disk`), or the copy's step.
    fn from(e: QemuStepError) -> ApiError {
        let details = match &e {
            QemuStepError::Start(launch) => {
                json!({ "step": "qemu", "stderr": launch.stderr_tail().unwrap_or_default() })
            }
            QemuStepError::VerifyQmp(_) | QemuStepError::VerifyStatus(_) => json!({ "step": "qemu_verify" }),
            QemuStepError::MayStillRun { .. } => json!({ "step": "kill" }),
            QemuStepError::Liveness(_) => json!({ "step": "process" }),
            QemuStepError::Qmp { step, .. } | QemuStepError::LiveCopy { step, .. } => json!({ "step": step }),
            QemuStepError::GrowLive { .. } => json!({ "step": "disk_grow" }),
            QemuStepError::LiveDisk { disk, .. } => json!({ "step": "data_disk", "disk": disk }),
        };
        api(Code::ProvisioningFailed, &e, None).details(details)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::error::ALL_CODES;
    use crate::disk::reserve::Refused;
    use crate::hardware::PciAddress;
    use crate::images::address::Class;
    use crate::images::url::UrlError;
    use crate::net::NetError;
    use crate::pci::check::{BlockedGroup, Blocker, HeldConflict, HostUse, Requested, ShapeProblem};
    use crate::pci::{PassthroughStep, PciError};
    use crate::qemu::integrity::Verdict;
    use std::collections::BTreeSet;

    fn pci(text: &str) -> PciAddress {
        PciAddress::parse(text).unwrap()
    }

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
        let a = pci("0000:00:05.0");
        vec![
            case(
                "placement: a QEMU thread cannot be pinned",
                CpuPinError::SetAffinity { tid: 7, cpus: "1".into(), source: nix::errno::Errno::EPERM },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "exec: all slots busy",
                ExecError::Busy(crate::agent::exec::slots::SlotsBusy),
                Code::SlotsBusy,
                Some("name"),
            ),
            case("exec: no exec ports", ExecError::NoPorts, Code::AgentNotConnected, Some("name")),
            case(
                "exec: no reply in time",
                ExecError::Timeout { method: "exec".into(), after: std::time::Duration::from_secs(70) },
                Code::AgentTimeout,
                Some("name"),
            ),
            case(
                "exec: the guest refused",
                ExecError::Refused { method: "exec".into(), code: 5100, message: "no".into(), data: Value::Null },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "exec: pushed content is not what sha256 says",
                ExecError::Checksum { what: "the content", expected: "a".into(), found: "b".into(), bytes: 1 },
                Code::ChecksumMismatch,
                Some("sha256"),
            ),
            case(
                "exec: a pulled file is not what the guest says",
                ExecError::Checksum { what: "the file received", expected: "a".into(), found: "b".into(), bytes: 1 },
                Code::ChecksumMismatch,
                None,
            ),
            case(
                "exec: source escapes files_dir",
                SourceError::NotRelative("../x".into()),
                Code::InvalidParams,
                Some("source"),
            ),
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
            case(
                "pci: absent device",
                CheckError::Shape(vec![ShapeProblem { address: a, field: "spec.pci[0]".into(), problem: "x".into() }]),
                Code::InvalidSpec,
                Some("spec.pci[0]"),
            ),
            case(
                "pci: held by another VM",
                CheckError::Held(vec![HeldConflict {
                    address: a,
                    field: "spec.hardware.sfp[0]".into(),
                    holder: "b".into(),
                }]),
                Code::HardwareInUse,
                Some("spec.hardware.sfp[0]"),
            ),
            case(
                "pci: used by the host",
                CheckError::InUseByHost(vec![HostUse {
                    address: a,
                    field: "spec.pci[1]".into(),
                    kind: HostUseKind::Mounted("sda1".into()),
                }]),
                Code::InUseByHost,
                Some("spec.pci[1]"),
            ),
            case(
                "pci: no IOMMU group",
                CheckError::NoIommuGroup(vec![Requested::new(a, "spec.pci[0]")]),
                Code::GroupNotViable,
                Some("spec.pci[0]"),
            ),
            case(
                "pci: group not viable",
                CheckError::GroupNotViable(vec![BlockedGroup {
                    group: 3,
                    address: a,
                    field: "spec.pci[0]".into(),
                    blocking: vec![Blocker { address: pci("0000:00:05.1"), driver: Some("ahci".into()), holder: None }],
                }]),
                Code::GroupNotViable,
                Some("spec.pci[0]"),
            ),
            case(
                "pci: not the pinned device",
                IdentityError::Mismatch(vec![PinnedMismatch {
                    class: crate::api::HardwareClass::Sfp,
                    index: 5,
                    address: a,
                    field: "spec.hardware.sfp[0]".into(),
                    mismatch: crate::pci::identity::Mismatch {
                        expected: crate::hardware::DeviceIdentity {
                            vendor: 0x8086,
                            device: 0x1572,
                            subsystem: None,
                            mac: None,
                        },
                        found: crate::pci::identity::Found {
                            vendor: 0x8086,
                            device: 0x10d3,
                            subsystem: None,
                            mac: FoundMac::NotRead,
                        },
                    },
                }]),
                Code::DeviceMismatch,
                Some("spec.hardware.sfp[0]"),
            ),
            case("pci: vfio-pci missing", &BindError::NoVfioPci, Code::ProvisioningFailed, None),
            case(
                "pci: host usage unreadable",
                PassthroughError::HostUsage(NetError::Exists("x".into())),
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "pci: modprobe",
                PassthroughError::Pci { step: PassthroughStep::Modprobe, source: PciError::Modprobe("x".into()) },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "pci: group node",
                PassthroughError::Access { node: "/dev/vfio/3".into(), source: std::io::Error::other("x") },
                Code::ProvisioningFailed,
                None,
            ),
            case("seed: no instance id", SeedError::NoInstanceId { vm: "a".into() }, Code::ProvisioningFailed, None),
            case("seed: write", SeedError::Write(std::io::Error::other("x")), Code::ProvisioningFailed, None),
            case(
                "seed: instance id",
                SeedError::InstanceId(std::io::Error::other("x")),
                Code::ProvisioningFailed,
                None,
            ),
            case("images: name", ImageError::NotAName("a/b".into()), Code::InvalidSpec, Some("name")),
            case("images: sha256", ImageError::BadSha256, Code::InvalidSpec, Some("sha256")),
            case("images: timeout", ImageError::ZeroTimeout, Code::InvalidSpec, Some("timeout_s")),
            case("images: URL", ImageError::BadUrl(UrlError::UserInfo), Code::InvalidSpec, Some("source")),
            case("images: scheme", ImageError::NotFetched, Code::InvalidSpec, Some("source")),
            case(
                "images: path",
                ImageError::NotImportable { given: "/etc/shadow".into(), dir: "/x".into() },
                Code::InvalidSpec,
                Some("source"),
            ),
            case("images: busy", ImageError::Busy("a.raw".into()), Code::Busy, Some("name")),
            case("images: mismatch", crate::images::mismatch("a", "b", "c", 1), Code::ChecksumMismatch, Some("sha256")),
            case("images: changed", crate::images::changed("a", "b", "c", 1), Code::ChecksumMismatch, Some("name")),
            case(
                "images: unreadable source",
                StoreError::copying("/i/a".as_ref(), std::io::ErrorKind::NotFound.into()),
                Code::InvalidSpec,
                Some("source"),
            ),
            case(
                "images: linked source",
                StoreError::copying("/i/a".as_ref(), std::io::Error::from_raw_os_error(libc::ELOOP)),
                Code::InvalidSpec,
                Some("source"),
            ),
            case(
                "images: copy",
                StoreError::copying("/i/a".as_ref(), std::io::Error::other("x")),
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "images: placed meanwhile",
                StoreError::placing("a", "/s/a".as_ref(), std::io::ErrorKind::AlreadyExists.into()),
                Code::ImageExists,
                Some("name"),
            ),
            case(
                "images: place",
                StoreError::placing("a", "/s/a".as_ref(), std::io::Error::other("x")),
                Code::ProvisioningFailed,
                None,
            ),
            case("images: not a file", StoreError::NotAFile { path: "/s/a".into() }, Code::InvalidSpec, Some("name")),
            case("images: not an image", StoreError::inspecting("a", tool_error()), Code::InvalidSpec, Some("source")),
            case(
                "images: QEMU not run",
                StoreError::inspecting(
                    "a",
                    DiskError::Timeout { operation: "probe", after: std::time::Duration::ZERO },
                ),
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "images: QEMU not pinned",
                StoreError::inspecting("a", pinned()),
                Code::BinaryMismatch,
                Some("qemu.sha256"),
            ),
            case(
                "images: names a backing file",
                StoreError::NamesAnotherFile { what: "a".into(), other: "b".into() },
                Code::InvalidSpec,
                Some("source"),
            ),
            case(
                "images: list",
                StoreError::List { dir: "/s".into(), source: std::io::Error::other("x") },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "images: delete",
                StoreError::Delete { name: "a".into(), source: std::io::Error::other("x") },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "images: record",
                StoreError::Record { name: "a".into(), source: std::io::Error::other("x") },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "download: refused address",
                DownloadError::Refused {
                    what: "u".into(),
                    host: "h".into(),
                    addr: "10.0.0.1".parse().unwrap(),
                    class: Class::Private,
                },
                Code::InvalidSpec,
                Some("source"),
            ),
            case(
                "download: redirect",
                DownloadError::RedirectNotFetched { from: "u".into(), source: UrlError::UserInfo },
                Code::InvalidSpec,
                Some("source"),
            ),
            case("download: curl config", DownloadError::NotForCurl, Code::InvalidSpec, Some("source")),
            case(
                "download: too large",
                DownloadError::TooLarge { shown: "u".into(), max_bytes: 1 },
                Code::CapacityExceeded,
                Some("source"),
            ),
            case("download: timeout", DownloadError::TimedOut(3), Code::ProvisioningFailed, Some("source")),
            case(
                "download: redirects",
                DownloadError::TooManyRedirects(None),
                Code::ProvisioningFailed,
                Some("source"),
            ),
            case("download: pipes", DownloadError::NoPipes, Code::ProvisioningFailed, Some("source")),
            case(
                "download: status",
                DownloadError::Status { shown: "u".into(), code: 404 },
                Code::ProvisioningFailed,
                Some("source"),
            ),
            case(
                "disk space: unreadable",
                SpaceError::Unreadable { dir: "/s".into(), source: std::io::Error::other("x") },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "disk space: a copy's room",
                SpaceError::NoRoom {
                    what: "the copies".into(),
                    dir: "/s".into(),
                    field: "snapshot".into(),
                    resource: "disk_bytes",
                    refused: Refused { requested: 2, available: 1, free: 1, reserved: 0 },
                },
                Code::CapacityExceeded,
                Some("snapshot"),
            ),
            case(
                "disk space: new data disks",
                SpaceError::Disks {
                    requested_gib: 2,
                    available_gib: 1,
                    why: "do not fit",
                    free_bytes: 1,
                    total_bytes: 1,
                    data_disks: true,
                },
                Code::CapacityExceeded,
                Some("spec.disks"),
            ),
            case("overlay: make", OverlayError::Create(tool_error()), Code::ProvisioningFailed, None),
            case("overlay: remove", OverlayError::Remove(tool_error()), Code::ProvisioningFailed, None),
            case("disk: grow", GrowError { gib: 2, source: tool_error() }, Code::ProvisioningFailed, None),
            case(
                "disk: grow, QEMU not pinned",
                GrowError { gib: 2, source: pinned() },
                Code::BinaryMismatch,
                Some("qemu.sha256"),
            ),
            case("overlay: QEMU not pinned", OverlayError::Base(pinned()), Code::BinaryMismatch, Some("qemu.sha256")),
            case(
                "data disk: make",
                DataDiskError::Create { disk: "d".into(), source: tool_error() },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "data disk: QEMU not pinned",
                DataDiskError::Grow { disk: "d".into(), size_gib: 2, source: pinned() },
                Code::BinaryMismatch,
                Some("qemu.sha256"),
            ),
            case(
                "data disk: kept one there",
                DataDiskError::KeptTaken { disk: "d".into(), to: "/k/d.raw".into() },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "integrity: another binary",
                PinError {
                    key: "qemu.sha256",
                    path: "/usr/bin/qemu".into(),
                    expected: "a".into(),
                    verdict: Verdict::Mismatch { found: "b".into() },
                },
                Code::BinaryMismatch,
                Some("qemu.sha256"),
            ),
            case("backup: name", BackupError::NotAName("../x".into()), Code::InvalidSpec, Some("backup")),
            case(
                "backup: none",
                BackupError::NoSuchBackup { backup: "b".into(), dir: "/d".into() },
                Code::NotFound,
                Some("backup"),
            ),
            case(
                "backup: manifest not a file",
                BackupError::NotAFile { path: "/m".into(), what: "a FIFO" },
                Code::ChecksumMismatch,
                Some("backup"),
            ),
            case(
                "backup: unreadable manifest",
                BackupError::Unreadable { path: "/m".into(), source: std::io::Error::other("x") },
                Code::InvalidSpec,
                Some("backup"),
            ),
            case(
                "backup: not a manifest",
                BackupError::Manifest { path: "/m".into(), source: ManifestError::Invalid("x".into()) },
                Code::InvalidSpec,
                Some("backup"),
            ),
            case(
                "backup: a manifest taking others' files",
                BackupError::Manifest { path: "/m".into(), source: ManifestError::TakesOthers("x".into()) },
                Code::ChecksumMismatch,
                Some("backup"),
            ),
            case(
                "topology: unreadable",
                TopologyError::Read {
                    path: "/sys/devices/system/cpu/online".into(),
                    source: std::io::Error::other("x"),
                },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "topology: not what the kernel writes",
                TopologyError::Parse { path: "/sys/x".into(), problem: "x".into() },
                Code::ProvisioningFailed,
                None,
            ),
            case(
                "backup: export",
                BackupError::NoFreeName { vm: "v".into(), dir: "/d".into() },
                Code::ProvisioningFailed,
                None,
            ),
        ]
    }

    /// The lifecycle's own texts (message and `details.step`) of errors it used to format
    /// itself, which the owners now carry: clients and tests read them, so they stay exactly.
    fn texts() -> Vec<(ApiError, &'static str, &'static str)> {
        let io = || std::io::Error::other("boom");
        vec![
            (
                PassthroughError::HostUsage(NetError::Exists("t".into())).into(),
                "PCI passthrough failed at host_usage: t already exists",
                "vfio.host_usage",
            ),
            (
                PassthroughError::Pci { step: PassthroughStep::Read, source: PciError::Modprobe("x".into()) }.into(),
                "PCI passthrough failed at read: cannot load vfio-pci: x",
                "vfio.read",
            ),
            (
                PassthroughError::Pci { step: PassthroughStep::Plan, source: PciError::Modprobe("x".into()) }.into(),
                "PCI passthrough failed at plan: cannot load vfio-pci: x",
                "vfio.plan",
            ),
            (
                PassthroughError::Access { node: "/dev/vfio/3".into(), source: io() }.into(),
                "cannot give /dev/vfio/3 to the group of qemu.user: boom",
                "vfio_access",
            ),
            (
                SeedError::NoInstanceId { vm: "a".into() }.into(),
                "the record of VM \"a\" has no cloud-init instance id",
                "seed",
            ),
            (SeedError::Write(io()).into(), "cannot write the cloud-init seed: boom", "seed"),
            (
                SeedError::InstanceId(io()).into(),
                "cannot make a cloud-init instance id (/dev/urandom): boom",
                "instance_id",
            ),
            (OverlayError::Place(io()).into(), "cannot move the overlay into place: boom", "disk"),
            (
                OverlayError::Base(tool_error()).into(),
                "cannot read the base image: QEMU could not probe the image: not an image",
                "qemu_files",
            ),
            (DataDiskError::Dir { dir: "/d".into(), source: io() }.into(), "cannot create /d: boom", "data_disk"),
            (
                DataDiskError::Delete { path: "/d/a".into(), source: io() }.into(),
                "cannot delete /d/a: boom",
                "data_disk",
            ),
            (
                DataDiskError::Move { from: "/d/a".into(), to: "/k/a".into(), source: io() }.into(),
                "cannot move /d/a to /k/a: boom",
                "data_disk",
            ),
            (
                DataDiskError::Space { dir: "/s".into(), source: io() }.into(),
                "cannot read the free space of /s: boom",
                "data_disk",
            ),
            (
                DataDiskError::GrowTakenBack { disk: "d".into(), source: tool_error() }.into(),
                "cannot grow data disk \"d\": QEMU could not probe the image: not an image",
                "data_disk",
            ),
            (
                DataDiskError::Place { disk: "d".into(), source: io() }.into(),
                "cannot move data disk \"d\" into place: boom",
                "data_disk",
            ),
            (
                DataDiskError::KeptTaken { disk: "d".into(), to: "/k/d.raw".into() }.into(),
                "cannot keep data disk \"d\": /k/d.raw already holds a kept disk; purge it first",
                "data_disk",
            ),
            (DataDiskError::ReadKept { dir: "/k".into(), source: io() }.into(), "cannot read /k: boom", "data_disk"),
            (
                DataDiskError::Purge {
                    source: Box::new(DataDiskError::Delete { path: "/k/b".into(), source: io() }),
                    deleted: vec!["/k/a".into()],
                }
                .into(),
                "cannot delete /k/b: boom (deleted before: [\"/k/a\"])",
                "data_disk",
            ),
            (StoreError::List { dir: "/s".into(), source: io() }.into(), "cannot read /s: boom", "image_list"),
            (
                StoreError::Create { dir: "/s".into(), source: io() }.into(),
                "cannot create a file in /s: boom",
                "image_import",
            ),
            (StoreError::copying("/i/a".as_ref(), io()).into(), "cannot copy /i/a: boom", "image_import"),
            (StoreError::Write(io()).into(), "cannot write the image: boom", "image_import"),
            (StoreError::Reopen(io()).into(), "cannot reopen the image: boom", "image_import"),
            (
                StoreError::placing("a", "/s/a".as_ref(), io()).into(),
                "cannot move the image into place at /s/a: boom",
                "image_import",
            ),
            (
                StoreError::Unreadable { path: "/s/a".into(), source: io() }.into(),
                "cannot read /s/a: boom",
                "image_import",
            ),
            (
                StoreError::inspecting(
                    "a",
                    DiskError::Timeout { operation: "probe", after: std::time::Duration::from_secs(1) },
                )
                .into(),
                "cannot inspect a: QEMU did not probe the image within 1s",
                "image_import",
            ),
            (
                StoreError::Record { name: "a".into(), source: io() }.into(),
                "the image \"a\" is in place, but its record cannot be written (boom); import it again",
                "image_import",
            ),
            (
                StoreError::Delete { name: "a".into(), source: io() }.into(),
                "cannot delete image \"a\": boom",
                "image_delete",
            ),
        ]
    }

    /// The texts of refusals the lifecycle used to make itself (no `details`).
    fn refusal_texts() -> Vec<(ApiError, &'static str)> {
        vec![
            (
                StoreError::copying("/i/a".as_ref(), std::io::ErrorKind::NotFound.into()).into(),
                "cannot read /i/a: entity not found",
            ),
            (
                StoreError::copying("/i/a".as_ref(), std::io::Error::from_raw_os_error(libc::ELOOP)).into(),
                "/i/a is a symbolic link",
            ),
            (
                StoreError::placing("a", "/s/a".as_ref(), std::io::ErrorKind::AlreadyExists.into()).into(),
                "an image \"a\" appeared meanwhile",
            ),
            (StoreError::NotAFile { path: "/s/a".into() }.into(), "/s/a is not a regular file"),
            (
                StoreError::inspecting("a", tool_error()).into(),
                "QEMU cannot read a as a disk image: QEMU could not probe the image: not an image",
            ),
            (
                StoreError::NamesAnotherFile { what: "a".into(), other: "b".into() }.into(),
                "a names another file (\"b\") as its backing or data file: flatten it first (qemu-img convert)",
            ),
        ]
    }

    #[test]
    fn a_disk_qemu_could_not_make_or_grow_names_itself_and_qemu_s_words() {
        let made: ApiError = DataDiskError::Create { disk: "d".into(), source: tool_error() }.into();
        assert_eq!(made.message, "cannot make data disk \"d\": QEMU could not probe the image: not an image");
        assert_eq!(made.details, json!({ "step": "data_disk", "disk": "d", "stderr": "tail" }));
        let grown: ApiError = DataDiskError::Grow { disk: "d".into(), size_gib: 2, source: tool_error() }.into();
        assert_eq!(grown.message, "cannot grow data disk \"d\" to 2 GiB: QEMU could not probe the image: not an image");
        assert_eq!(grown.details, json!({ "step": "data_disk", "disk": "d", "stderr": "tail" }));
    }

    #[test]
    fn an_overlay_qemu_could_not_make_carries_qemu_s_words() {
        let e: ApiError = OverlayError::Create(tool_error()).into();
        assert_eq!(e.message, "cannot create the overlay disk: QEMU could not probe the image: not an image");
        assert_eq!(e.details, json!({ "step": "disk", "stderr": "tail" }));
        let orphan: ApiError = OverlayError::RemoveOrphan(tool_error()).into();
        assert_eq!(orphan.message, "cannot remove orphaned overlay: QEMU could not probe the image: not an image");
        assert_eq!(orphan.details, Value::Null);
        let busy = std::io::Error::from_raw_os_error(libc::EBUSY);
        let own: ApiError = OverlayError::Remove(DiskError::Io { path: "/s/o.qcow2".into(), source: busy }).into();
        assert_eq!((own.code, own.field.as_deref(), &own.details), (Code::ProvisioningFailed, None, &Value::Null));
        assert_eq!(
            own.message,
            format!("cannot remove the overlay: /s/o.qcow2: {}", std::io::Error::from_raw_os_error(libc::EBUSY))
        );
        let grown: ApiError = GrowError { gib: 20, source: tool_error() }.into();
        assert_eq!(grown.message, "cannot grow the disk to 20 GiB: QEMU could not probe the image: not an image");
        assert_eq!(grown.details, json!({ "step": "disk_grow", "stderr": "tail" }));
    }

    #[test]
    fn refusal_texts_are_unchanged() {
        for (e, message) in refusal_texts() {
            assert_eq!(e.message, message);
            assert_eq!(e.details, Value::Null, "{message}");
        }
    }

    #[test]
    fn texts_the_lifecycle_used_to_make_are_unchanged() {
        for (e, message, step) in texts() {
            assert_eq!(e.message, message);
            assert_eq!(e.details["step"], step, "{message}");
        }
    }

    /// One lifecycle wrapper through the mapping: code, field, the whole `details` and the
    /// message, each as the lifecycle used to make it with `format!` at the call site.
    struct Wrapped {
        error: ApiError,
        code: Code,
        field: Option<&'static str>,
        details: Value,
        message: String,
    }

    fn wrapped(
        error: impl Into<ApiError>,
        code: Code,
        field: Option<&'static str>,
        details: Value,
        message: &str,
    ) -> Wrapped {
        Wrapped { error: error.into(), code, field, details, message: message.to_string() }
    }

    /// Every variant of the lifecycle's wrappers ([`crate::lifecycle::errors`]).
    fn lifecycle_wrappers() -> Vec<Wrapped> {
        use crate::disk::export::LiveError;
        use crate::lifecycle::errors::LiveDiskCause;
        use crate::qemu::hotplug::HotplugError;
        use crate::qemu::launch::LaunchError;
        use crate::qemu::qmp::QmpError;
        let io = || std::io::Error::other("boom");
        let pf = Code::ProvisioningFailed;
        let step = |s: &str| json!({ "step": s });
        let exists = std::io::Error::from_raw_os_error(libc::EEXIST);
        let exdev = std::io::Error::from_raw_os_error(libc::EXDEV);
        vec![
            wrapped(
                LaunchFileError::BootFile {
                    field: "spec.boot.kernel",
                    path: "/b/k".into(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                },
                Code::InvalidSpec,
                Some("spec.boot.kernel"),
                Value::Null,
                "/b/k does not exist",
            ),
            wrapped(
                LaunchFileError::BootFile {
                    field: "spec.boot.initrd",
                    path: "/b/i".into(),
                    source: std::io::Error::from_raw_os_error(libc::EACCES),
                },
                Code::InvalidSpec,
                Some("spec.boot.initrd"),
                Value::Null,
                "vmhostd cannot read /b/i: Permission denied (os error 13)",
            ),
            wrapped(
                LaunchFileError::BootFile { field: "spec.boot.kernel", path: "/b/k".into(), source: io() },
                Code::InvalidSpec,
                Some("spec.boot.kernel"),
                Value::Null,
                "cannot use /b/k: boom",
            ),
            wrapped(
                LaunchFileError::Firmware(crate::qemu::firmware::FirmwareError::NotAFile {
                    key: "firmware.uefi_code",
                    path: "/f/code.fd".into(),
                }),
                Code::InvalidSpec,
                Some("spec.boot.firmware"),
                json!({ "path": "/f/code.fd", "config": "firmware.uefi_code" }),
                "boot.firmware uefi: /f/code.fd is not a regular file",
            ),
            wrapped(
                LaunchFileError::OpenForQemu { path: "/r/serial.log".into(), source: io() },
                pf,
                None,
                step("qemu_files"),
                "cannot open /r/serial.log for QEMU: boom",
            ),
            wrapped(
                LaunchFileError::CopyVars { from: "/f/vars.fd".into(), to: "/s/vars.fd".into(), source: io() },
                pf,
                None,
                step("firmware"),
                "cannot copy the UEFI variables store /f/vars.fd to /s/vars.fd: boom",
            ),
            wrapped(
                LaunchFileError::RemoveVars { path: "/s/vars.fd".into(), source: io() },
                pf,
                None,
                Value::Null,
                "cannot remove the UEFI variables store /s/vars.fd: boom",
            ),
            wrapped(
                IntentRefused { vm: "v".into(), source: crate::state::IntentError::Reverting("s1".into()) },
                Code::Internal,
                None,
                Value::Null,
                "VM \"v\": a revert to snapshot \"s1\" is unfinished: no disk work may begin",
            ),
            wrapped(
                FileError::File { step: "root_disk".into(), action: "stat", path: "/i/d".into(), source: io() },
                pf,
                None,
                step("root_disk"),
                "cannot stat /i/d: boom",
            ),
            wrapped(
                FileError::Unnamed { step: "snapshot".into(), action: "write a copy", source: io() },
                pf,
                None,
                step("snapshot"),
                "cannot write a copy: boom",
            ),
            wrapped(
                FileError::MakePrivate { step: "root_disk".into(), path: "/s/root.qcow2".into(), source: io() },
                pf,
                None,
                step("root_disk"),
                "cannot make /s/root.qcow2 private: boom",
            ),
            wrapped(
                FileError::Move { step: "root_disk".into(), from: "/i/d".into(), to: "/s/r".into(), source: io() },
                pf,
                None,
                step("root_disk"),
                "cannot move /i/d to /s/r: boom",
            ),
            wrapped(
                FileError::Move { step: "root_disk".into(), from: "/i/d".into(), to: "/s/r".into(), source: exists },
                pf,
                None,
                step("root_disk"),
                "cannot move /i/d to /s/r: /s/r exists",
            ),
            wrapped(
                FileError::Move { step: "root_disk".into(), from: "/i/d".into(), to: "/s/r".into(), source: exdev },
                pf,
                None,
                step("root_disk"),
                "cannot move /i/d to /s/r: it is on another file system (a disk is renamed, never copied)",
            ),
            wrapped(
                FileError::MoveBack { step: "root_disk".into(), from: "/s/r".into(), to: "/i/d".into(), source: io() },
                pf,
                None,
                step("root_disk"),
                "cannot move /s/r back to /i/d: boom",
            ),
            wrapped(
                FileError::PutBack { step: "snapshot".into(), path: "/s/o.qcow2".into(), source: io() },
                pf,
                None,
                step("snapshot"),
                "cannot put /s/o.qcow2 back: boom",
            ),
            wrapped(
                FileError::CopyOut {
                    step: "import".into(),
                    file: "root.qcow2".into(),
                    place: "in the backup".into(),
                    source: io(),
                },
                pf,
                None,
                step("import"),
                "cannot copy root.qcow2 in the backup: boom",
            ),
            wrapped(
                FileError::PlaceOut { step: "import".into(), file: "root.qcow2".into(), source: io() },
                pf,
                None,
                step("import"),
                "cannot place root.qcow2 from the backup: boom",
            ),
            wrapped(
                FileError::InspectOut { step: "import".into(), file: "root.qcow2".into(), source: io() },
                pf,
                None,
                step("import"),
                "cannot inspect root.qcow2 from the backup: boom",
            ),
            wrapped(
                FileError::Encode {
                    step: "snapshot".into(),
                    source: serde_json::from_str::<Value>("{").expect_err("not JSON"),
                },
                pf,
                None,
                step("snapshot"),
                "EOF while parsing an object at line 1 column 1",
            ),
            wrapped(
                FileError::OpenImport { path: "/i/d".into(), source: io() },
                Code::InvalidSpec,
                Some("spec.boot.disk"),
                Value::Null,
                "cannot open /i/d: boom",
            ),
            wrapped(
                DiskStepError::InspectImport { path: "/i/d".into(), source: tool_error() },
                Code::InvalidSpec,
                Some("spec.boot.disk"),
                json!({ "stderr": "tail" }),
                "QEMU cannot read /i/d as a disk image: QEMU could not probe the image: not an image",
            ),
            wrapped(
                DiskStepError::InspectImport { path: "/i/d".into(), source: timeout() },
                pf,
                None,
                step("root_disk"),
                "cannot inspect /i/d: QEMU did not probe the image within 1s",
            ),
            wrapped(
                DiskStepError::GrowImport { gib: 20, source: tool_error() },
                pf,
                None,
                json!({ "step": "root_disk", "stderr": "tail" }),
                "cannot grow the imported disk to 20 GiB: QEMU could not probe the image: not an image",
            ),
            wrapped(
                DiskStepError::InspectCopy { file: "root.qcow2".into(), source: tool_error() },
                Code::ChecksumMismatch,
                Some("backup"),
                json!({ "file": "root.qcow2" }),
                "root.qcow2 in the backup: QEMU cannot read it as a disk image: QEMU could not probe the image: \
                 not an image; nothing was imported",
            ),
            wrapped(
                DiskStepError::InspectCopy { file: "root.qcow2".into(), source: timeout() },
                pf,
                None,
                step("import"),
                "cannot inspect root.qcow2 from the backup: QEMU did not probe the image within 1s",
            ),
            wrapped(
                DiskStepError::ReadDisk { step: "export".into(), path: "/s/o.qcow2".into(), source: timeout() },
                pf,
                None,
                step("export"),
                "cannot read /s/o.qcow2: QEMU did not probe the image within 1s",
            ),
            wrapped(
                DiskStepError::Flatten { source: tool_error() },
                pf,
                None,
                json!({ "step": "export", "stderr": "tail" }),
                "cannot copy the disks: QEMU could not probe the image: not an image",
            ),
            wrapped(
                DiskStepError::Flatten { source: timeout() },
                pf,
                None,
                json!({ "step": "export", "stderr": "" }),
                "cannot copy the disks: QEMU did not probe the image within 1s",
            ),
            wrapped(
                DiskStepError::BaseImage { step: "snapshot".into(), path: "/i/base".into(), source: tool_error() },
                pf,
                None,
                step("snapshot"),
                "cannot read the base image /i/base: QEMU could not probe the image: not an image",
            ),
            wrapped(
                DiskStepError::MakeCopies { step: "export".into(), source: tool_error() },
                pf,
                None,
                step("export"),
                "cannot make the copies: QEMU could not probe the image: not an image",
            ),
            wrapped(
                QemuStepError::Start(LaunchError::Timeout {
                    after: std::time::Duration::from_secs(1),
                    stderr_tail: "t".into(),
                }),
                pf,
                None,
                json!({ "step": "qemu", "stderr": "t" }),
                "QEMU failed to start: QEMU did not start within 1s; stderr: t",
            ),
            wrapped(
                QemuStepError::VerifyQmp(QmpError::Closed),
                pf,
                None,
                step("qemu_verify"),
                "QEMU started but is not running: QMP check failed: QMP connection closed by QEMU",
            ),
            wrapped(
                QemuStepError::VerifyStatus("paused".into()),
                pf,
                None,
                step("qemu_verify"),
                "QEMU started but is not running: QEMU reports status \"paused\"",
            ),
            wrapped(
                QemuStepError::MayStillRun { pid: 7, source: Some(io()), after: std::time::Duration::from_secs(5) },
                pf,
                None,
                step("kill"),
                "QEMU (pid 7) may still run: cannot watch it exit: boom",
            ),
            wrapped(
                QemuStepError::MayStillRun { pid: 7, source: None, after: std::time::Duration::from_secs(5) },
                pf,
                None,
                step("kill"),
                "QEMU (pid 7) may still run: it did not exit within 5s of SIGKILL",
            ),
            wrapped(
                QemuStepError::Liveness(io()),
                pf,
                None,
                step("process"),
                "cannot tell whether the VM's QEMU still runs (boom); nothing was changed",
            ),
            wrapped(
                QemuStepError::Qmp { step: "backup".into(), what: "query-block", source: QmpError::Closed },
                pf,
                None,
                step("backup"),
                "query-block: QMP connection closed by QEMU",
            ),
            wrapped(
                QemuStepError::LiveCopy { step: "snapshot".into(), source: LiveError::Abandoned("x") },
                pf,
                None,
                step("snapshot"),
                "cannot copy the running VM's disks: the copy was given up: x",
            ),
            wrapped(
                QemuStepError::GrowLive { gib: 20, source: QmpError::Closed },
                pf,
                None,
                step("disk_grow"),
                "cannot grow the disk to 20 GiB while running: QMP connection closed by QEMU",
            ),
            wrapped(
                QemuStepError::LiveDisk {
                    disk: "d".into(),
                    what: "grow",
                    source: LiveDiskCause::Qmp(QmpError::Closed),
                },
                pf,
                None,
                json!({ "step": "data_disk", "disk": "d" }),
                "cannot grow data disk \"d\" while running: QMP connection closed by QEMU",
            ),
            wrapped(
                QemuStepError::LiveDisk { disk: "*".into(), what: "settle", source: LiveDiskCause::Io(io()) },
                pf,
                None,
                json!({ "step": "data_disk", "disk": "*" }),
                "cannot settle data disk \"*\" while running: boom",
            ),
            wrapped(
                QemuStepError::LiveDisk {
                    disk: "d".into(),
                    what: "hot-plug",
                    source: LiveDiskCause::Hotplug(HotplugError::Uncertain(QmpError::Closed)),
                },
                pf,
                None,
                json!({ "step": "data_disk", "disk": "d" }),
                "cannot hot-plug data disk \"d\" while running: device_add: no answer (QMP connection closed by \
                 QEMU); QEMU may have attached the disk",
            ),
        ]
    }

    #[test]
    fn the_lifecycle_s_wrappers_keep_code_field_details_and_text() {
        for w in lifecycle_wrappers() {
            let e = &w.error;
            assert_eq!(e.message, w.message);
            assert_eq!((e.code, e.field.as_deref()), (w.code, w.field), "{}", w.message);
            assert_eq!(e.details, w.details, "{}", w.message);
        }
    }

    #[test]
    fn a_pin_refusal_inside_a_lifecycle_wrapper_stays_4002() {
        let wrappers = [
            DiskStepError::InspectImport { path: "/i/d".into(), source: pinned() },
            DiskStepError::GrowImport { gib: 2, source: pinned() },
            DiskStepError::InspectCopy { file: "f".into(), source: pinned() },
            DiskStepError::ReadDisk { step: "export".into(), path: "/f".into(), source: pinned() },
            DiskStepError::Flatten { source: pinned() },
            DiskStepError::BaseImage { step: "export".into(), path: "/b".into(), source: pinned() },
            DiskStepError::MakeCopies { step: "export".into(), source: pinned() },
        ];
        for w in wrappers {
            let e: ApiError = w.into();
            assert_eq!((e.code, e.field.as_deref()), (Code::BinaryMismatch, Some("qemu.sha256")));
            assert_eq!(e.details["expected"], "a");
        }
    }

    fn timeout() -> DiskError {
        DiskError::Timeout { operation: "probe", after: std::time::Duration::from_secs(1) }
    }

    fn tool_error() -> DiskError {
        DiskError::Tool { operation: "probe", reason: "not an image".into(), stderr_tail: "tail".into() }
    }

    fn pinned() -> DiskError {
        DiskError::Pinned(PinError {
            key: "qemu.sha256",
            path: "/usr/bin/qemu".into(),
            expected: "a".into(),
            verdict: Verdict::Mismatch { found: "b".into() },
        })
    }

    /// Codes no owner produces, and where they come from instead (each has its own tests
    /// there).
    const PRODUCED_ELSEWHERE: &[(Code, &str)] = &[
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
        (Code::ExecDisabled, "lifecycle::exec (allow_exec, guest_exec)"),
        (Code::NotMovable, "lifecycle::migrate (vm.migrate_in, vm.migrate, vm.move)"),
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
