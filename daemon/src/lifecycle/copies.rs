//! Copies of a VM's disks, what snapshots ([`super::snapshots`]) and backups
//! ([`super::backup`]) share: which files a VM's disks are and what a copy of them reads
//! ([`copy_sources`]), the empty targets ([`create_target`]), each copy's sha256 once
//! made ([`seal_copies`]), and a copy taken back out, checked against its sha256
//! ([`copy_checked`]).

use super::errors::{DiskStepError, FileError};
use super::Manager;
use crate::api::backup::{BackupDisk, DiskRole};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{Consistency, CopyConsistency};
use crate::api::{ApiError, Code, VmSpec, VmStatus};
use crate::state::VmRecord;
use serde_json::json;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default and largest `timeout_s` of a copy.
const DEFAULT_TIMEOUT_S: u64 = 3600;

/// The bound of copy work no request asked for (recovery of an interrupted operation): the
/// default `timeout_s`.
pub(super) const DEFAULT_COPY_TIMEOUT: Duration = Duration::from_secs(DEFAULT_TIMEOUT_S);
const MAX_TIMEOUT_S: u64 = 86_400;

/// One disk of a VM as a copy reads it.
#[derive(Debug)]
pub(super) struct VmDisk {
    /// Boot disk or data disk.
    pub role: DiskRole,
    /// `root`, or the data disk's name.
    pub name: String,
    /// The format of its file.
    pub format: DiskFormat,
    /// Its file: an image VM's overlay, a `boot.disk` root disk, a data disk.
    pub file: PathBuf,
    /// The overlay's base image and its format.
    pub base: Option<(PathBuf, String)>,
    /// The QEMU block device (or node) of a running VM.
    pub device: String,
}

impl VmDisk {
    /// The entry of its copy named `file`, in `format` (sizes and sum filled in later).
    pub(super) fn entry(&self, file: String, format: DiskFormat) -> BackupDisk {
        BackupDisk {
            role: self.role,
            name: self.name.clone(),
            file,
            format,
            virtual_size: 0,
            bytes: 0,
            sha256: String::new(),
        }
    }
}

/// The `timeout_s` of a copy (default 3600).
///
/// # Errors
/// 2001 on `timeout_s` outside 1-86400.
pub(super) fn copy_timeout(timeout_s: Option<u64>) -> Result<Duration, ApiError> {
    match timeout_s.unwrap_or(DEFAULT_TIMEOUT_S) {
        s @ 1..=MAX_TIMEOUT_S => Ok(Duration::from_secs(s)),
        _ => Err(ApiError::invalid("timeout_s", format!("1-{MAX_TIMEOUT_S} seconds"))),
    }
}

/// What a copy of stopped VM `rec` is: `stopped` when its disks were left by a clean power-off
/// (nothing writes them meanwhile), otherwise `crash` with why: the cause its record keeps
/// ([`VmRecord::unclean_end`]: a stop or replace that had to kill QEMU, a QEMU that crashed or
/// was killed, a revert to a crash-consistent snapshot), or for a VM `dead` or `failed` without
/// one (a record from before vmhostd kept it) its status.
pub(super) fn stopped_copy(rec: &VmRecord) -> CopyConsistency {
    let reason = match (&rec.unclean_end, rec.status) {
        (Some(why), _) => Some(why.clone()),
        (None, VmStatus::Dead) => Some(match &rec.last_exit {
            Some(exit) => format!("the VM's QEMU ended without vmhostd stopping it ({exit}): the VM is dead"),
            None => "the VM's QEMU ended without vmhostd stopping it: the VM is dead".to_string(),
        }),
        (None, VmStatus::Failed) => {
            Some("the VM is failed: vmhostd cannot tell that its disks were left by a clean power-off".to_string())
        }
        (None, _) => None,
    };
    reason.map_or_else(CopyConsistency::stopped, CopyConsistency::crash)
}

/// [`VmRecord::unclean_end`] of a VM whose disks were just put back from a copy, `from` (e.g.
/// `reverted to snapshot "s1"`), that was `consistency` when made: none when it was `frozen` or
/// `stopped`, else why its disks may be as a power cut leaves them.
pub(super) fn restored_unclean(from: &str, consistency: Option<Consistency>) -> Option<String> {
    match consistency {
        Some(Consistency::Frozen | Consistency::Stopped) => None,
        Some(Consistency::Crash) => Some(format!("the VM's disks were {from}, which is crash-consistent")),
        None => Some(format!("the VM's disks were {from}, which does not record its consistency")),
    }
}

/// Creates the empty target `path` (0600, never an existing file), `len` long.
///
/// # Errors
/// 4001 with `step`.
pub(super) fn create_target(path: &Path, len: u64, step: &str) -> Result<OwnedFd, ApiError> {
    crate::blocking::run(|| {
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        f.set_len(len)?;
        Ok::<_, std::io::Error>(f)
    })
    .map(OwnedFd::from)
    .map_err(|e| FileError::file(step, "create", path)(e).into())
}

/// Reads each copy of `entries` in `dir` back once: its sha256 and size into its entry, a raw
/// one's zero MiBs punched into holes ([`crate::disk::export::seal`]), synced.
///
/// # Errors
/// 4001 with `step`.
pub(super) fn seal_copies(dir: &Path, entries: &mut [BackupDisk], step: &str) -> Result<(), ApiError> {
    for entry in entries {
        let target = dir.join(&entry.file);
        let raw = entry.format == DiskFormat::Raw;
        let (sha256, bytes) = crate::blocking::run(|| {
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&target)?;
            let sha = crate::disk::export::seal(&f, raw)?;
            f.sync_all()?;
            Ok::<_, std::io::Error>((sha, f.metadata()?.len()))
        })
        .map_err(FileError::file(step, "read back", &target))?;
        entry.sha256 = sha256;
        entry.bytes = bytes;
    }
    Ok(())
}

/// Where a copy is taken back out of: its directory, the request field that named it, how an
/// error says where it is (`in the backup`) and what did not happen (`imported`).
pub(super) struct CheckedFrom<'a> {
    pub dir: &'a Path,
    pub field: &'a str,
    pub place: &'a str,
    pub undone: &'a str,
    pub step: &'a str,
    /// When the copy is given up (the operation's `timeout_s`); `None`: never.
    pub until: Option<std::time::Instant>,
}

/// Copies `disk` out of `from` into a temp file in `temp_dir` named after `temp_name`, hashed as
/// it is written; returns it, to be placed or renamed over a disk.
///
/// # Errors
/// 2003 on `from.field` when the copy is not the sha256 `disk` recorded (`details: {file,
/// expected, found, bytes}`; the temp file is removed); 4001 with `from.step`.
pub(super) fn copy_checked(
    from: &CheckedFrom<'_>,
    disk: &BackupDisk,
    temp_dir: &Path,
    temp_name: &str,
) -> Result<crate::images::Temp, ApiError> {
    let failed = |source: std::io::Error| FileError::CopyOut {
        step: from.step.into(),
        file: disk.file.clone(),
        place: from.place.into(),
        source,
    };
    let mut temp = crate::images::Temp::create(temp_dir, temp_name).map_err(failed)?;
    crate::images::copy_until(&from.dir.join(&disk.file), &mut temp, from.until).map_err(failed)?;
    let found = temp.finish().map_err(failed)?;
    if found != disk.sha256 {
        return Err(ApiError::new(
            Code::ChecksumMismatch,
            format!(
                "{} {} has sha256 {found}, not {} as recorded; nothing was {}",
                disk.file, from.place, disk.sha256, from.undone
            ),
        )
        .field(from.field)
        .details(json!({ "file": disk.file, "expected": disk.sha256, "found": found, "bytes": temp.bytes() })));
    }
    Ok(temp)
}

/// What a copy of VM `rec` reads: whether it runs (then its QEMU copies, and the disks are
/// those of the spec it runs with), that spec, and each disk: the boot disk (an image VM's
/// overlay over its base, or a `boot.disk` root disk; none for a direct-kernel VM), then the
/// data disks in spec order.
///
/// # Errors
/// 4001 with `step` when the base image's format cannot be read or the record names no
/// root disk.
pub(super) async fn copy_sources(
    mgr: &Manager,
    rec: &VmRecord,
    step: &str,
) -> Result<(bool, VmSpec, Vec<VmDisk>), ApiError> {
    let live = rec.status == VmStatus::Running;
    let spec = if live { rec.running_spec.clone().unwrap_or_else(|| rec.spec.clone()) } else { rec.spec.clone() };
    let paths = mgr.paths(&spec.name);
    let root = |format, file, base| VmDisk {
        role: DiskRole::Root,
        name: "root".into(),
        format,
        file,
        base,
        device: "virtio0".into(),
    };
    let mut out = Vec::new();
    if let Some(image) = &spec.boot.image {
        let base = mgr.config.paths.images.join(image);
        let format = crate::disk::base_format(&mgr.disk_tool(), &base)
            .await
            .map_err(|source| DiskStepError::BaseImage { step: step.into(), path: base.clone(), source })?;
        out.push(root(DiskFormat::Qcow2, paths.overlay.clone(), Some((base, format))));
    } else if spec.boot.disk.is_some() {
        let disk = rec
            .root_disk
            .as_ref()
            .ok_or_else(|| super::provisioning(step, "the VM's record names no root disk".into()))?;
        out.push(root(disk.format, paths.root_disk(disk.format), None));
    }
    for d in &spec.disks {
        out.push(VmDisk {
            role: DiskRole::Data,
            name: d.name.clone(),
            format: d.format,
            file: paths.data_disk(d),
            base: None,
            device: crate::qemu::argv::data_drive(&d.name),
        });
    }
    Ok((live, spec, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::snapshots::Requirement;

    fn stopped_vm(status: VmStatus, unclean_end: Option<&str>) -> VmRecord {
        let mut rec = VmRecord::new(crate::validate::tests::spec("v"));
        rec.status = status;
        rec.unclean_end = unclean_end.map(str::to_string);
        rec
    }

    #[test]
    fn a_stopped_copy_is_stopped_only_after_a_clean_power_off() {
        // Never started, or powered off cleanly: nothing wrote the disks since they were clean.
        let clean = stopped_copy(&stopped_vm(VmStatus::Stopped, None));
        assert_eq!(clean, CopyConsistency::stopped());
        assert!(clean.meets(Some(Requirement::Frozen)));

        // A vm.stop that had to kill QEMU: as a power cut left them.
        let why = crate::lifecycle::ops::killed_by("vm.stop", "asked to force it");
        let killed = stopped_copy(&stopped_vm(VmStatus::Stopped, Some(&why)));
        assert_eq!((killed.consistency, killed.reason.as_deref()), (Consistency::Crash, Some(why.as_str())));
        assert!(!killed.meets(Some(Requirement::Frozen)));

        // Killed with restart_policy never: dead, with the cause the exit recorded.
        let cause = super::super::exits::unclean_end_after(&super::super::exits::ExitCause::Failure(
            "QEMU exited unexpectedly (crashed or killed)".into(),
        ));
        let dead = stopped_copy(&stopped_vm(VmStatus::Dead, cause.as_deref()));
        assert_eq!(dead.consistency, Consistency::Crash);
        let reason = dead.reason.clone().unwrap_or_default();
        assert!(reason.contains("ended without a clean power-off") && reason.contains("crashed or killed"), "{reason}");
        assert!(!dead.meets(Some(Requirement::Frozen)));

        // A record from before the cause was kept: dead or failed is crash all the same.
        let mut old = stopped_vm(VmStatus::Dead, None);
        old.last_exit = Some("QEMU exited unexpectedly (crashed or killed)".into());
        let c = stopped_copy(&old);
        assert!(c.reason.as_deref().is_some_and(|r| r.contains("crashed or killed")), "{c:?}");
        let c = stopped_copy(&stopped_vm(VmStatus::Failed, None));
        assert_eq!(c.consistency, Consistency::Crash);
        assert!(!c.meets(Some(Requirement::Frozen)));
    }

    #[test]
    fn a_qemu_started_marks_the_disks_until_it_ends_and_keeps_an_earlier_cause() {
        let mut rec = stopped_vm(VmStatus::Stopped, None);
        rec.qemu_started();
        assert_eq!(rec.unclean_end.as_deref(), Some(crate::state::QEMU_RUNNING));
        rec.unclean_end = Some("killed".into());
        rec.qemu_started();
        assert_eq!(rec.unclean_end.as_deref(), Some("killed"), "the disks still carry the kill");
        // Older records read without it; the field is left out while clean.
        let text = serde_json::to_string(&stopped_vm(VmStatus::Stopped, None)).unwrap_or_default();
        assert!(!text.contains("unclean_end"), "{text}");
    }
}
