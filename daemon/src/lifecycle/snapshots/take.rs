//! `vm.snapshot`: the record first, then the tags and copies, then the record sealed and the
//! snapshot renamed into place.
//!
//! Order (each step a crash point): checks; what a crash left of this VM's snapshots finished
//! ([`super::recover`]); `.NAME.partial/snapshot.json` written and synced with the tags it is
//! about to make (`snapshot:recorded`), so a crash from here on leaves a record naming every
//! tag that may exist; the internal snapshots and the copies made (a running VM: one
//! transaction in its QEMU, [`super::super::live_copy`]; a stopped VM: the raw files and the
//! variables store read, then the qcow2 files tagged in an offline session) (`snapshot:tagged`);
//! the copies' sha256 into the record, a `tpm: true` VM's TPM state copied through the spawner
//! ([`crate::tpm::copy_state_into`]), the record rewritten; the directory renamed to `NAME`. A failure
//! after the record deletes the tags again and removes the directory; when even that fails the
//! directory stays for [`super::recover`].

use super::super::copies::{copy_timeout, seal_copies, VmDisk};
use super::super::errors::FileError;
use super::super::op::VmOp;
use super::super::Manager;
use super::{
    check_name, check_not_reverting, drop_tags, excluded_of, failed, kept_disks, list_snapshots, new_id, open_rw,
    snapshot_entry, snapshots_dir, tag_of, write_record, MAX_SNAPSHOTS, STEP, VARS_COPY,
};
use crate::api::backup::{BackupDisk, DiskRole};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{
    CopyConsistency, InternalDisk, Requirement, Snapshot, SnapshotKind, TakeSnapshotParams, VarsCopy,
};
use crate::api::{ApiError, Firmware};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// `vm.snapshot` (module doc).
///
/// # Errors
/// 2001 on `snapshot` (a bad or taken name, or [`MAX_SNAPSHOTS`] reached) or `timeout_s`,
/// 4040, 4090 (also while the VM is being moved), 4001 `step: snapshot`, 4094 on `requires` (a
/// running VM's guest file systems not all frozen); nothing is kept.
pub(crate) async fn snapshot(mgr: &Arc<Manager>, p: TakeSnapshotParams) -> Result<Snapshot, ApiError> {
    check_name(&p.snapshot)?;
    let within = copy_timeout(p.timeout_s)?;
    let (op, rec) = mgr.begin_op(&p.name).await?;
    check_not_reverting(&rec)?;
    // A snapshot taken while a move's outcome is unknown would not be on the destination, and
    // the source's copy (snapshots included) goes when the destination answers `committed`.
    rec.check_not_moving()?;
    super::recover::recover_vm(mgr, &rec, within).await;
    let existing = list_snapshots(mgr, &p.name)?;
    if existing.iter().any(|s| s.name == p.snapshot) {
        return Err(ApiError::invalid("snapshot", format!("VM {:?} has a snapshot {:?} already", p.name, p.snapshot)));
    }
    if existing.len() >= MAX_SNAPSHOTS {
        return Err(ApiError::invalid(
            "snapshot",
            format!("VM {:?} has {MAX_SNAPSHOTS} snapshots: delete one", p.name),
        ));
    }
    let (live, spec, disks) = super::super::copies::copy_sources(mgr, &rec, STEP).await?;
    let stopped = super::super::live_copy::check_requires(mgr, &rec, live, p.requires, STEP)?;
    let excluded = excluded_of(&rec.spec);
    let (internal, copied) = kept_disks(&disks, &excluded);
    let vars = uefi_vars(mgr, &spec, live);
    let id = new_id()?;
    let tag = tag_of(&p.snapshot, &id);
    let mut files: Vec<&Path> = copied.iter().map(|d| d.file.as_path()).collect();
    if let Some(v) = &vars {
        files.push(v);
    }
    let _room = crate::disk::space::reserve_copy_room(&mgr.reservations, &mgr.config.paths.state, &files, STEP)?;
    let dir = snapshots_dir(mgr, &p.name);
    let partial = dir.join(format!(".{}.partial", p.snapshot));
    crate::blocking::run(|| {
        crate::state::dirs::private_dir(&mgr.config.paths.state.join("snapshots"))?;
        crate::state::dirs::private_dir(&dir)?;
        let _ = std::fs::remove_dir_all(&partial);
        crate::state::dirs::private_dir(&partial)
    })
    .map_err(FileError::file(STEP, "create", &partial))?;
    let mut snapshot = Snapshot {
        name: p.snapshot.clone(),
        created_at: crate::api::now_rfc3339(),
        live,
        consistency: None,
        reason: None,
        frozen: Vec::new(),
        skipped: Vec::new(),
        instance_id: rec.instance_id.clone(),
        spec,
        disks: copied.iter().map(|d| snapshot_entry(d)).collect(),
        id: Some(id),
        internal: internal
            .iter()
            .map(|d| InternalDisk {
                role: d.role,
                name: d.name.clone(),
                kind: SnapshotKind::Internal,
                tag: tag.clone(),
            })
            .collect(),
        excluded,
        uefi_vars: None,
        tpm: None,
    };
    // Before any tag exists: a crash from here on leaves the tags named.
    if let Err(e) = write_record(&partial, &snapshot) {
        remove_dir(&partial);
        return Err(e);
    }
    mgr.crashpoint("snapshot:recorded");
    let job = Job { op: &op, internal: &internal, copied: &copied, vars: vars.as_deref(), within };
    match job.run(&mut snapshot, &partial, &tag, stopped, p.requires).await {
        Ok(()) => {}
        Err(e) => {
            let names: Vec<String> = internal.iter().map(|d| d.name.clone()).collect();
            match drop_tags(mgr, &rec, &names, &[tag], within).await {
                Ok(()) => remove_dir(&partial),
                Err(ee) => tracing::warn!(vm = %p.name, error = %ee.message,
                    "the tags of a failed snapshot stay until the next snapshot operation or start"),
            }
            return Err(e);
        }
    }
    let done = dir.join(&p.snapshot);
    crate::blocking::run(|| {
        std::fs::rename(&partial, &done)?;
        std::fs::File::open(&dir)?.sync_all()
    })
    .map_err(FileError::file(STEP, "finish the snapshot in", &partial))?;
    let consistency = snapshot.consistency.map_or("-", |c| c.as_str());
    tracing::info!(vm = %p.name, snapshot = %p.snapshot, live, consistency, internal = snapshot.internal.len(),
        copies = snapshot.disks.len(), "snapshot taken");
    Ok(snapshot)
}

/// A UEFI VM's variables store to copy: a running VM's always (its QEMU has it), a stopped one's
/// when it exists (made at the first start).
fn uefi_vars(mgr: &Manager, spec: &crate::api::VmSpec, live: bool) -> Option<PathBuf> {
    if spec.boot.firmware != Firmware::Uefi {
        return None;
    }
    let path = mgr.paths(&spec.name).uefi_vars();
    (live || path.exists()).then_some(path)
}

/// The entry the variables store's copy is sealed as.
fn vars_entry() -> BackupDisk {
    BackupDisk {
        role: DiskRole::Data,
        name: "uefi-vars".into(),
        file: VARS_COPY.into(),
        format: DiskFormat::Raw,
        virtual_size: 0,
        bytes: 0,
        sha256: String::new(),
    }
}

/// Removes a directory, saying so when it cannot.
fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an unfinished snapshot");
    }
}

/// What a snapshot's tags and copies are made of.
struct Job<'a> {
    op: &'a VmOp,
    internal: &'a [&'a VmDisk],
    copied: &'a [&'a VmDisk],
    vars: Option<&'a Path>,
    within: Duration,
}

impl Job<'_> {
    /// Makes the tags and copies into `partial`, seals the copies and rewrites the record.
    async fn run(
        &self,
        snapshot: &mut Snapshot,
        partial: &Path,
        tag: &str,
        stopped: Option<CopyConsistency>,
        requires: Option<Requirement>,
    ) -> Result<(), ApiError> {
        let mgr = self.op.mgr();
        let mut vars = self.vars.map(|_| vars_entry());
        let made = match stopped {
            Some(made) => {
                for (d, e) in self.copied.iter().zip(&snapshot.disks) {
                    copy_file(&d.file, partial, &e.file)?;
                }
                if let Some(v) = self.vars {
                    copy_file(v, partial, VARS_COPY)?;
                }
                let files: Vec<PathBuf> = self.internal.iter().map(|d| d.file.clone()).collect();
                let fds = open_rw(&files)?;
                crate::disk::internal_snapshots::take(&mgr.disk_tool(), fds, tag, self.within)
                    .await
                    .map_err(|e| failed(format!("tagging the qcow2 disks: {e}")))?;
                made
            }
            None => self.live(snapshot, vars.is_some(), partial, tag, requires).await?,
        };
        mgr.crashpoint("snapshot:tagged");
        seal_copies(partial, &mut snapshot.disks, STEP)?;
        if let Some(v) = vars.as_mut() {
            seal_copies(partial, std::slice::from_mut(v), STEP)?;
            snapshot.uefi_vars = Some(VarsCopy { file: v.file.clone(), bytes: v.bytes, sha256: v.sha256.clone() });
        }
        // After the disks: of a running VM a crash-consistent copy (swtpm writes each file
        // whole and renames it into place, so each file read is one whole version of it).
        if snapshot.spec.tpm {
            snapshot.tpm = crate::tpm::copy_state_into(&mgr.paths(&snapshot.spec.name), partial)
                .await
                .map_err(|e| failed(format!("copying the TPM state: {e}")))?;
        }
        snapshot.consistency = Some(made.consistency);
        snapshot.reason = made.reason;
        snapshot.frozen = made.frozen;
        snapshot.skipped = made.skipped;
        write_record(partial, snapshot)
    }

    /// A running VM's tags and copies in one transaction of its QEMU.
    async fn live(
        &self,
        snapshot: &mut Snapshot,
        vars: bool,
        partial: &Path,
        tag: &str,
        requires: Option<Requirement>,
    ) -> Result<CopyConsistency, ApiError> {
        let mut targets: Vec<super::super::live_copy::Target> = self
            .copied
            .iter()
            .zip(snapshot.disks.iter())
            .map(|(d, e)| super::super::live_copy::Target {
                device: d.device.clone(),
                path: partial.join(&e.file),
                format: e.format.as_str(),
                backing: d.base.clone(),
                // An overlay's copy holds what the VM wrote; its header names the same base.
                sync: if d.base.is_some() { "top" } else { "full" },
                virtual_size: 0,
            })
            .collect();
        if vars {
            targets.push(super::super::live_copy::Target {
                device: crate::qemu::argv::UEFI_VARS_NODE.into(),
                path: partial.join(VARS_COPY),
                format: "raw",
                backing: None,
                sync: "full",
                virtual_size: 0,
            });
        }
        let devices: Vec<&str> = self.internal.iter().map(|d| d.device.as_str()).collect();
        let extras = crate::disk::export::Extras {
            bitmaps: Vec::new(),
            actions: crate::disk::internal_snapshots::take_actions(&devices, tag),
        };
        let made = self.op.copy_disks_live(&mut targets, self.within, requires, STEP, &extras).await?;
        for (e, t) in snapshot.disks.iter_mut().zip(&targets) {
            e.virtual_size = t.virtual_size;
        }
        Ok(made)
    }
}

/// Copies a stopped VM's file `from` into `dir/name`.
fn copy_file(from: &Path, dir: &Path, name: &str) -> Result<(), ApiError> {
    let mut temp = crate::images::Temp::create(dir, name).map_err(FileError::file(STEP, "create a copy in", dir))?;
    crate::images::copy(from, &mut temp).map_err(FileError::file(STEP, "copy", from))?;
    temp.finish().map_err(FileError::unnamed(STEP, "write a copy"))?;
    temp.place(&dir.join(name)).map_err(FileError::unnamed(STEP, "place a copy"))?;
    Ok(())
}
