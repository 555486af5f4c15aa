//! `vm.export` and `vm.import` (docs/backup.md): a VM's spec and disks written to a directory
//! of `paths.backups`, and a VM made again from one, on this host or another.
//!
//! An export is an operation on the VM ([`VmOp`], begun with [`Manager::begin_op`]): it holds
//! the VM's busy flag for its whole length (nothing changes its disks meanwhile), and a failed
//! export records nothing on the VM (its copies go with the partial backup directory). A stopped VM's disks are copied by QEMU without a guest ([`crate::disk::export`]);
//! a running VM's by its own QEMU, every disk as it was at one instant, with the guest's file
//! systems frozen for that instant when its agent can ([`super::live_copy`]). The boot disk becomes a flat qcow2 (an image VM's
//! base flattened in, so the backup needs no image); data disks keep their format. Each copy
//! is hashed (a raw one made sparse again), then the manifest and `SHA256SUMS` are written and
//! the directory renamed into place ([`crate::backup`]).
//!
//! An import reads the manifest, checks the spec, then copies each disk out while hashing it
//! (2003 on a mismatch, nothing left): the boot disk into `paths.import` as `NAME-root.qcow2`,
//! data disks to where a destroy keeps them (`STATE/kept-disks/NAME/`); then an ordinary
//! `vm.create` takes them, the boot disk as `boot.disk` (so an image VM comes back as a
//! `boot.disk` VM). A create that fails removes the copies.

use super::copies::{copy_checked, copy_timeout, create_target, seal_copies, CheckedFrom, VmDisk};
mod chain;
mod incremental;
mod placing;
mod retention;

pub(super) use placing::recover_at_start as recover_imports_at_start;
pub(crate) use retention::prune_vm;

use super::errors::{DiskStepError, FileError, QemuStepError};
use super::op::VmOp;
use super::Manager;
use crate::api::backup::{BackupDisk, DiskChange, DiskRole, ExportParams, ExportResult, ImportVmParams, Manifest};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{CopyConsistency, Requirement};
use crate::api::{ApiError, BootSpec, Mutation, VmStatus};
use serde_json::json;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A disk's layers, bottom first, with their formats: its base image then its file, or its
/// file alone.
fn layers(disk: &VmDisk) -> Vec<(&Path, &str)> {
    disk.base
        .iter()
        .map(|(p, f)| (p.as_path(), f.as_str()))
        .chain(std::iter::once((disk.file.as_path(), disk.format.as_str())))
        .collect()
}

fn open_rw(path: &Path) -> Result<OwnedFd, ApiError> {
    crate::blocking::run(|| {
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(path)
    })
    .map(OwnedFd::from)
    .map_err(|e| FileError::file("export", "open", path)(e).into())
}

fn open_ro(path: &Path) -> Result<OwnedFd, ApiError> {
    crate::blocking::run(|| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path))
        .map(OwnedFd::from)
        .map_err(|e| FileError::file("export", "open", path)(e).into())
}

/// [`crate::state::VmRecord::unclean_end`] of a VM imported from `backup` with `manifest`: none
/// when its copy was `frozen` or `stopped`.
fn imported_unclean(backup: &str, manifest: &Manifest) -> Option<String> {
    super::copies::restored_unclean(&format!("imported from backup {backup:?}"), manifest.consistency)
}

/// `vm.export` (module doc).
///
/// # Errors
/// 2001 on `timeout_s`, `since` or `keep`, 4040, 4090 (another operation on the VM), 3002 on
/// `name`, 4001 `step: export`, 4094 on `requires` (a running VM's guest file systems not all
/// frozen); nothing is left in `paths.backups`.
pub(crate) async fn export_vm(mgr: &Arc<Manager>, p: ExportParams) -> Result<ExportResult, ApiError> {
    let within = copy_timeout(p.timeout_s)?;
    if p.keep == Some(0) {
        return Err(ApiError::invalid("keep", "keep at least 1 backup (the one being made)"));
    }
    let (op, rec) = mgr.begin_op(&p.name).await?;
    super::snapshots::check_not_reverting(&rec)?;
    let (live, spec, disks) = super::copies::copy_sources(mgr, &rec, "export").await?;
    let stopped = super::live_copy::check_requires(mgr, &rec, live, p.requires, "export")?;
    let parent = incremental::parent_of(&mgr.backups, &p)?;
    let id = crate::backup::new_id().map_err(FileError::unnamed("export", "draw a backup id"))?;
    let bitmap = crate::backup::bitmap_of(&id);
    // The boot disk becomes one flat qcow2; data disks keep their format.
    let mut entries: Vec<BackupDisk> = disks
        .iter()
        .map(|d| {
            let format = if d.role == DiskRole::Root { DiskFormat::Qcow2 } else { d.format };
            let mut e = d.entry(String::new(), format);
            e.file = crate::backup::file_of(&e);
            e
        })
        .collect();
    let files: Vec<&Path> = disks.iter().flat_map(|d| layers(d).into_iter().map(|(p, _)| p)).collect();
    let backups = mgr.config.paths.backups_dir();
    let _room = crate::disk::space::reserve_copy_room(&mgr.reservations, &backups, &files, "name")?;
    let partial = mgr.backups.begin(&p.name)?;
    op.crashpoint("export:begun");
    let targets: Vec<PathBuf> = entries.iter().map(|e| partial.dir().join(&e.file)).collect();
    let vars = (spec.boot.firmware == crate::api::Firmware::Uefi).then(|| partial.dir().join(crate::backup::VARS_FILE));
    let plan = Increment { id: &bitmap, parent: parent.as_ref(), incremental: p.incremental };
    let (made, changes) = if let Some(stopped) = stopped {
        let changes = op.export_stopped(&disks, &mut entries, &targets, within, &plan).await?;
        (stopped, changes)
    } else {
        op.export_live(&disks, &mut entries, &targets, within, p.requires, &plan, vars.as_deref()).await?
    };
    op.crashpoint("export:copied");
    seal_copies(partial.dir(), &mut entries, "export")?;
    let uefi_vars = match &vars {
        Some(path) => seal_vars(&mgr.paths(&spec.name).uefi_vars(), path, live)?,
        None => None,
    };
    // Whole in every backup (a few KiB); of a running VM crash-consistent, read just after the
    // disks' copies began (swtpm writes each file whole, renamed into place).
    let tpm = if spec.tpm {
        crate::tpm::copy_state_into(&mgr.paths(&spec.name), partial.dir())
            .await
            .map_err(|e| super::provisioning("export", format!("copying the TPM state: {e}")))?
    } else {
        None
    };
    let (kind, parent_ref) = incremental::kind_of(&changes, parent.as_ref());
    let manifest = Manifest {
        format: crate::backup::FORMAT.into(),
        version: crate::backup::VERSION,
        id: Some(id),
        kind: Some(kind),
        parent: parent_ref,
        merged_from: None,
        created_at: crate::api::now_rfc3339(),
        vmhost_version: super::VERSION.into(),
        vm: p.name.clone(),
        spec,
        live,
        consistency: Some(made.consistency),
        reason: made.reason,
        frozen: made.frozen,
        skipped: made.skipped,
        disks: entries,
        changes,
        uefi_vars,
        tpm,
    };
    let backup = partial.name().to_string();
    let path = partial.finish(&manifest)?;
    op.crashpoint("export:sealed");
    // Only the newest backup's bitmap is kept: the parent's (and any an interrupted export
    // left) goes now that this backup is whole. A failure leaves them tracking (harmless).
    op.drop_old_bitmaps(&disks, live, &bitmap).await;
    tracing::info!(vm = %p.name, backup = %backup, live, kind = ?kind, consistency = made.consistency.as_str(), "exported");
    // Still inside the export's operation: no other export (nor `vm.backups_prune`) of the VM
    // runs beside the prune.
    if let Some(keep) = p.keep {
        if let Err(e) = retention::prune(mgr, &p.name, keep).await {
            tracing::warn!(vm = %p.name, error = %e, "the backup is made but pruning older ones failed");
        }
    }
    drop(op);
    Ok(ExportResult { backup, path, manifest })
}

/// Puts an imported VM's TPM state (checked against the manifest before anything was written)
/// and its UEFI variables store in place, the VM created stopped and its operation `op` still
/// held (nothing starts it meanwhile); then ends the import's marker ([`placing`]) and starts
/// the VM when `wanted` says running. On a failure the VM goes again (the import leaves
/// nothing). A crash before the marker's end removes the VM at the next start; one after
/// leaves it whole.
///
/// # Errors
/// 2003 on `backup`, 4001 `step: import`, what `vm.start` returns.
async fn place_then_start(
    mut op: VmOp,
    tpm: Option<Vec<(String, OwnedFd)>>,
    vars: Option<(&Path, &crate::api::backup::VarsCopy)>,
    wanted: crate::api::DesiredState,
) -> Result<crate::api::Mutation, ApiError> {
    let mgr = Arc::clone(op.mgr());
    let name = op.name().to_string();
    let import_dir = mgr.config.paths.import_dir();
    op.crashpoint("import:created");
    let placed = async {
        if let Some(files) = tpm {
            crate::tpm::put_back_state(&mgr.paths(&name), files, mgr.config.qemu_user)
                .await
                .map_err(|e| super::provisioning("import", format!("putting back the TPM state: {e}")))?;
        }
        if let Some((dir, vars)) = vars {
            chain::place_vars(&mgr, &name, dir, vars)?;
        }
        // Before any start: a marker left behind would have a restart remove the VM.
        placing::end(&import_dir, &name).map_err(FileError::file("import", "end the import's marker", &import_dir))?;
        if wanted == crate::api::DesiredState::Running {
            op.start_steps("vm.import").await?;
        }
        Ok::<_, ApiError>(())
    }
    .await;
    match placed {
        Ok(()) => Ok(crate::api::Mutation::new(true, Some(mgr.get(&name)?))),
        Err(e) => {
            match op.destroy_steps("vm.import", "destroyed").await {
                Ok(_) => {
                    if let Err(end) = placing::end(&import_dir, &name) {
                        tracing::warn!(vm = %name, error = %end, "cannot remove an import's marker");
                    }
                }
                Err(gone) => tracing::warn!(vm = %name, error = %gone, "cannot remove the VM of a failed import"),
            }
            Err(e)
        }
    }
}

/// The UEFI variables store's copy at `copy` (a running VM's, made by its QEMU) or, for a
/// stopped VM, a copy of `store` made now; `None` when a stopped VM has none yet (never
/// started).
///
/// # Errors
/// 4001 `step: export`.
fn seal_vars(store: &Path, copy: &Path, live: bool) -> Result<Option<crate::api::backup::VarsCopy>, ApiError> {
    let failed = FileError::file("export", "copy the UEFI variables store", copy);
    let sealed = crate::blocking::run(|| {
        if !live {
            if !store.exists() {
                return Ok(None);
            }
            let mut from = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(store)?;
            let mut to = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(copy)?;
            std::io::copy(&mut from, &mut to)?;
            to.sync_all()?;
        }
        let f = std::fs::File::open(copy)?;
        let sha256 = crate::disk::export::seal(&f, false)?;
        Ok(Some(crate::api::backup::VarsCopy {
            file: crate::backup::VARS_FILE.into(),
            bytes: f.metadata()?.len(),
            sha256,
        }))
    });
    sealed.map_err(|e| failed(e).into())
}

/// What an export's copies build on: the new backup's bitmap, the parent, whether an
/// increment was asked.
pub(super) struct Increment<'a> {
    id: &'a str,
    parent: Option<&'a crate::backup::ReadBackup>,
    incremental: bool,
}

/// `vm.import` (module doc).
///
/// # Errors
/// 2001 on `backup` (a bad name or manifest; a disk's destination already taken) or as a
/// `vm.create` of the backup's spec would; 4040 (no such backup); 2003 on `backup` (a file
/// is not what the manifest says; nothing left); what `vm.create` returns.
pub(crate) async fn import_vm(mgr: &Arc<Manager>, p: ImportVmParams) -> Result<Mutation, ApiError> {
    let chain = mgr.backups.chain(&p.backup)?;
    let layers = chain::layers_of(&chain).map_err(|why| chain::broken(&p.backup, why))?;
    let Some(last) = chain.last() else { return Err(chain::broken(&p.backup, "no backup".into())) };
    let (dir, manifest) = (last.dir.clone(), last.manifest.clone());
    let mut spec = manifest.spec.clone();
    if let Some(name) = p.name {
        spec.name = name;
    }
    if let Some(state) = p.state {
        spec.state = state;
    }
    let root_file = format!("{}-root.qcow2", spec.name);
    if manifest.disks.iter().any(|d| d.role == DiskRole::Root) {
        spec.boot = BootSpec {
            disk: Some(root_file.clone()),
            disk_gib: spec.boot.disk_gib,
            firmware: spec.boot.firmware,
            secure_boot: spec.boot.secure_boot,
            ..BootSpec::default()
        };
    }
    crate::validate::validate_spec(&spec, &mgr.config)?;
    if mgr.lock().vms.contains_key(&spec.name) {
        return Err(ApiError::invalid("name", format!("a VM named {:?} already exists", spec.name)));
    }
    let import_dir = mgr.config.paths.import_dir();
    let paths = mgr.paths(&spec.name);
    let destinations: Vec<PathBuf> = manifest
        .disks
        .iter()
        .map(|d| match d.role {
            DiskRole::Root => import_dir.join(&root_file),
            DiskRole::Data => paths.kept_dir.join(&d.file),
        })
        .collect();
    if let Some(taken) = destinations.iter().find(|d| d.exists()) {
        return Err(ApiError::invalid(
            "backup",
            format!("{} exists: a disk of this backup would go there; move it away first", taken.display()),
        ));
    }
    let files: Vec<PathBuf> = layers.iter().flatten().map(|l| l.path()).collect();
    let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let room = crate::disk::space::reserve_copy_room(&mgr.reservations, &import_dir, &files, "backup")?;
    // Every file of the chain is what its manifest says before anything is written.
    chain::verify(&layers, manifest.uefi_vars.as_ref().map(|v| (dir.as_path(), v)))?;
    let tpm = match &manifest.tpm {
        Some(copy) => Some(crate::blocking::run(|| crate::tpm::open_checked_copy(&dir, copy)).map_err(|e| {
            ApiError::new(crate::api::Code::ChecksumMismatch, format!("{e}; nothing imported")).field("backup")
        })?),
        None => None,
    };
    let mut placed = Placed { files: Vec::new(), dirs: Vec::new() };
    // Every disk is made under a temp name in the import directory (removed at the next
    // start after a crash) and inspected; only then are they renamed into place.
    let mut made = Vec::new();
    for (disk, chain) in manifest.disks.iter().zip(&layers) {
        let temp = if chain.len() > 1 {
            chain::restore(mgr, chain, disk, &spec).await?
        } else {
            copy_out(mgr, &dir, disk, &spec.name)?
        };
        let fd = temp.reopen().map(OwnedFd::from).map_err(|source| FileError::InspectOut {
            step: "import".into(),
            file: disk.file.clone(),
            source,
        })?;
        inspect_copy(mgr, disk, fd, &spec).await?;
        made.push(temp);
    }
    for ((temp, disk), dest) in made.into_iter().zip(&manifest.disks).zip(&destinations) {
        ensure_parent(dest, &mut placed)?;
        temp.place(dest).map_err(|source| FileError::PlaceOut {
            step: "import".into(),
            file: disk.file.clone(),
            source,
        })?;
        placed.files.push(dest.to_path_buf());
    }
    let wanted = spec.state;
    let to_place = manifest.uefi_vars.is_some() || tpm.is_some();
    if to_place {
        // The store and the TPM state go in before the VM first starts (a start would copy the
        // template, or make a new TPM), after the create (which clears a new VM's directory).
        spec.state = crate::api::DesiredState::Stopped;
        placing::begin(&import_dir, &spec).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                ApiError::new(crate::api::Code::Busy, format!("another import of {:?} is in progress", spec.name))
                    .field("name")
            } else {
                FileError::file("import", "record the import", &import_dir)(e).into()
            }
        })?;
    }
    // The copies are on the file system now: the create's own admission sees them there.
    drop(room);
    let name = spec.name.clone();
    let ours = spec.clone();
    let result = if to_place {
        match super::ops::create_held(mgr, spec).await {
            Ok(op) => place_then_start(op, tpm, manifest.uefi_vars.as_ref().map(|v| (dir.as_path(), v)), wanted).await,
            Err(e) => {
                // This import made no VM (the name may be another client's now): nothing for a
                // restart to remove.
                if let Err(end) = placing::end(&import_dir, &name) {
                    tracing::warn!(vm = %name, error = %end, "cannot remove an import's marker");
                }
                Err(e)
            }
        }
    } else {
        super::ops::create(mgr, spec).await
    };
    match &result {
        Ok(_) => {
            // The create took them, and the kept-disks directory with its last disk
            // ([`VmOp::ensure_data_disk`]).
            placed.files.clear();
            placed.dirs.clear();
            if let Some(why) = imported_unclean(&p.backup, &manifest) {
                // Its disks are the backup's: a copy of it stopped is no better than they are.
                let marked = mgr.update_if(
                    &name,
                    "imported",
                    |r, busy| !busy && r.unclean_end.is_none(),
                    |r| r.unclean_end = Some(why),
                );
                if let Err(e) = marked {
                    tracing::warn!(vm = %name, error = %e, "cannot record that the imported disks are crash-consistent");
                }
            }
            tracing::info!(vm = %name, backup = %p.backup, "imported");
        }
        // A create that failed after recording the VM leaves it `failed`: an import that
        // failed leaves nothing (the name was free), so it goes too (only this import's:
        // its spec names this import's root disk).
        Err(_) if mgr.lock().vms.get(&name).is_some_and(|r| r.status == VmStatus::Failed && r.spec == ours) => {
            if let Err(e) = super::ops::destroy(mgr, &name).await {
                tracing::warn!(vm = %name, error = %e, "cannot remove the VM of a failed import");
            }
        }
        Err(_) => {}
    }
    result
}

/// Copies backup file `disk` from `dir` into a temp file in the import directory (the state
/// file system), checking its sha256; the caller places it.
fn copy_out(mgr: &Manager, dir: &Path, disk: &BackupDisk, vm: &str) -> Result<crate::images::Temp, ApiError> {
    let from =
        CheckedFrom { dir, field: "backup", place: "in the backup", undone: "imported", step: "import", until: None };
    copy_checked(&from, disk, &mgr.config.paths.import_dir(), &format!("{vm}-{}", disk.file))
}

/// Makes `dest`'s directory (a VM's kept-disks directory) unless it exists, named in `placed`.
///
/// # Errors
/// 4001 `step: import`.
fn ensure_parent(dest: &Path, placed: &mut Placed) -> Result<(), ApiError> {
    let Some(parent) = dest.parent() else { return Ok(()) };
    let failed = |source: std::io::Error| FileError::file("import", "create", parent)(source);
    if !placed.dirs.iter().any(|d| d == parent) && !crate::blocking::run(|| parent.try_exists()).map_err(failed)? {
        crate::blocking::run(|| crate::state::dirs::private_dir(parent)).map_err(failed)?;
        placed.dirs.push(parent.to_path_buf());
    }
    Ok(())
}

/// Inspects the copy open as `fd` of backup disk `disk` as a `boot.disk` is inspected (QEMU as
/// `qemu.user` on a read-only descriptor): it must be the format the manifest declares,
/// name no backing file and no external data file, and be no larger than `spec` says. A raw
/// disk is not probed: its bytes are the guest's (a guest may well have written a qcow2
/// header into it) and QEMU is always told it is raw; its length is its size.
///
/// # Errors
/// 2003 on `backup` naming the file; 4001 `step: import` when it cannot be read.
async fn inspect_copy(
    mgr: &Manager,
    disk: &BackupDisk,
    fd: OwnedFd,
    spec: &crate::api::VmSpec,
) -> Result<(), ApiError> {
    let limit_gib = match disk.role {
        DiskRole::Root => spec.boot.disk_gib,
        DiskRole::Data => spec.disks.iter().find(|d| d.name == disk.name).map(|d| d.size_gib),
    };
    let cannot =
        |source: std::io::Error| FileError::InspectOut { step: "import".into(), file: disk.file.clone(), source };
    let found = if disk.format == DiskFormat::Raw {
        let len = std::fs::File::from(fd).metadata().map_err(cannot)?.len();
        crate::disk::import::ImportInfo { format: "raw".into(), virtual_size: len, backing: None, data_file: None }
    } else {
        crate::disk::import::inspect(&mgr.disk_tool(), fd)
            .await
            .map_err(|source| DiskStepError::InspectCopy { file: disk.file.clone(), source })?
    };
    match check_copy(disk.format, limit_gib, &found) {
        Ok(()) => Ok(()),
        Err(why) => Err(refused_copy(disk, why)),
    }
}

impl VmOp {
    /// Copies the stopped VM's disks with QEMU without a guest, flattening each disk's layers;
    /// a qcow2 disk holding the parent's bitmap only what changed, and every qcow2 disk given
    /// the new bitmap ([`crate::disk::bitmaps::export_offline`]). Returns how each was copied.
    async fn export_stopped(
        &self,
        disks: &[VmDisk],
        entries: &mut [BackupDisk],
        targets: &[PathBuf],
        within: Duration,
        plan: &Increment<'_>,
    ) -> Result<Vec<DiskChange>, ApiError> {
        let mut flat = Vec::new();
        for ((disk, entry), target) in disks.iter().zip(entries.iter_mut()).zip(targets) {
            let info = crate::disk::import::inspect(&self.mgr().disk_tool(), open_ro(&disk.file)?)
                .await
                .map_err(|source| DiskStepError::ReadDisk { step: "export".into(), path: disk.file.clone(), source })?;
            entry.virtual_size = info.virtual_size;
            let len = if entry.format == DiskFormat::Raw { info.virtual_size } else { 0 };
            let track = incremental::trackable(disk.format);
            let mut opened = Vec::new();
            let all = layers(disk);
            for (k, (path, format)) in all.iter().enumerate() {
                // The disk's own qcow2 file is opened read-write: the new bitmap is stored in it.
                let fd = if track && k + 1 == all.len() { open_rw(path)? } else { open_ro(path)? };
                opened.push((fd, format.to_string()));
            }
            flat.push(crate::disk::bitmaps::OfflineDisk {
                layers: opened,
                track,
                target: create_target(target, len, "export")?,
                format: entry.format.as_str(),
                virtual_size: info.virtual_size,
            });
        }
        let parent_bitmap = incremental::parent_bitmap(plan.parent);
        let used = if plan.incremental { parent_bitmap.as_deref() } else { None };
        let found = crate::disk::bitmaps::export_offline(&self.mgr().disk_tool(), flat, plan.id, used, within)
            .await
            .map_err(|source| DiskStepError::Flatten { source })?;
        Ok(disks
            .iter()
            .zip(&found)
            .map(|(d, t)| incremental::change_of(&d.name, d.format, plan.incremental, plan.parent, t))
            .collect())
    }

    /// Copies the running VM's disks in its own QEMU, all at one instant
    /// ([`super::live_copy`]), with the new backup's bitmap added to every qcow2 disk at that
    /// instant and a disk holding the parent's bitmap copied incrementally; `vars`: where the
    /// UEFI variables store is copied at the same instant. Returns what the copy is and how
    /// each disk was copied.
    #[allow(clippy::too_many_arguments)]
    async fn export_live(
        &self,
        disks: &[VmDisk],
        entries: &mut [BackupDisk],
        targets: &[PathBuf],
        within: Duration,
        requires: Option<Requirement>,
        plan: &Increment<'_>,
        vars: Option<&Path>,
    ) -> Result<(CopyConsistency, Vec<DiskChange>), ApiError> {
        let parent_bitmap = incremental::parent_bitmap(plan.parent);
        let mut found = Vec::new();
        {
            let qmp = |what| move |source| QemuStepError::Qmp { step: "export".into(), what, source };
            let mut q = self.mgr().qmp(self.name(), Duration::from_secs(5)).await.map_err(qmp("QMP"))?;
            for d in disks {
                let state = if incremental::trackable(d.format) {
                    let bitmaps =
                        crate::disk::bitmaps::live_state(&mut q, &d.device).await.map_err(qmp("query-block"))?;
                    crate::disk::bitmaps::tracking(&bitmaps, parent_bitmap.as_deref())
                } else {
                    crate::disk::bitmaps::Tracking::Absent
                };
                found.push(state);
            }
        }
        let changes: Vec<DiskChange> = disks
            .iter()
            .zip(&found)
            .map(|(d, t)| incremental::change_of(&d.name, d.format, plan.incremental, plan.parent, t))
            .collect();
        let mut extras = crate::disk::export::Extras::default();
        let mut live: Vec<super::live_copy::Target> = Vec::new();
        for (((d, e), path), c) in disks.iter().zip(entries.iter()).zip(targets).zip(&changes) {
            live.push(super::live_copy::Target {
                device: d.device.clone(),
                path: path.clone(),
                format: e.format.as_str(),
                backing: None,
                sync: "full",
                virtual_size: 0,
            });
            let inc = c.kind == crate::api::backup::BackupKind::Incremental;
            extras.bitmaps.push(if inc { parent_bitmap.clone() } else { None });
            if incremental::trackable(d.format) {
                extras.actions.push(crate::disk::bitmaps::add_action(&d.device, plan.id));
            }
        }
        if let Some(path) = vars {
            live.push(super::live_copy::Target {
                device: crate::qemu::argv::UEFI_VARS_NODE.into(),
                path: path.to_path_buf(),
                format: "raw",
                backing: None,
                sync: "full",
                virtual_size: 0,
            });
            extras.bitmaps.push(None);
        }
        let made = self.copy_disks_live(&mut live, within, requires, "export", &extras).await?;
        for (e, t) in entries.iter_mut().zip(&live) {
            e.virtual_size = t.virtual_size;
        }
        Ok((made, changes))
    }

    /// Removes every `vmhost-backup-*` bitmap but `keep` from the VM's qcow2 disks (the
    /// running QEMU's, or an offline session's); failures are logged, never returned: the
    /// backup is made, and a bitmap left only tracks writes.
    async fn drop_old_bitmaps(&self, disks: &[VmDisk], live: bool, keep: &str) {
        let tracked: Vec<&VmDisk> = disks.iter().filter(|d| incremental::trackable(d.format)).collect();
        if live {
            let Ok(mut q) = self.mgr().qmp(self.name(), Duration::from_secs(5)).await else {
                tracing::warn!(vm = self.name(), "cannot remove the previous backup's bitmaps: no QMP");
                return;
            };
            for d in tracked {
                let found = crate::disk::bitmaps::live_state(&mut q, &d.device).await.unwrap_or_default();
                let stale = crate::disk::bitmaps::stale(&found, keep);
                if let Err(e) = crate::disk::bitmaps::remove_live(&mut q, &d.device, &stale).await {
                    tracing::warn!(vm = self.name(), disk = %d.name, error = %e, "cannot remove an old backup bitmap");
                }
            }
            return;
        }
        let mut fds = Vec::new();
        for d in tracked {
            match open_rw(&d.file) {
                Ok(fd) => fds.push(fd),
                Err(e) => tracing::warn!(vm = self.name(), disk = %d.name, error = %e.message, "cannot open a disk"),
            }
        }
        if let Err(e) = crate::disk::bitmaps::remove_offline(&self.mgr().disk_tool(), fds, keep).await {
            tracing::warn!(vm = self.name(), error = %e, "cannot remove the previous backup's bitmaps");
        }
    }
}

/// 2003 on `backup` for backup file `disk`, whose content is not what an import may take.
fn refused_copy(disk: &BackupDisk, why: String) -> ApiError {
    ApiError::new(
        crate::api::Code::ChecksumMismatch,
        format!("{} in the backup: {why}; nothing was imported", disk.file),
    )
    .field("backup")
    .details(json!({ "file": disk.file }))
}

/// What a disk copied out of a backup must be ([`inspect_copy`]): the `declared`
/// format, no backing file (QEMU would open the host file its header names), no external data
/// file (the same), and no larger than `limit_gib` (the spec's size) when the spec has one.
fn check_copy(
    declared: DiskFormat,
    limit_gib: Option<u64>,
    found: &crate::disk::import::ImportInfo,
) -> Result<(), String> {
    if found.format != declared.as_str() {
        return Err(format!("it is a {:?} image, not a {} as the manifest declares", found.format, declared.as_str()));
    }
    if let Some(backing) = &found.backing {
        return Err(format!("its header names the backing file {backing:?}"));
    }
    if let Some(data) = &found.data_file {
        return Err(format!("its header names the external data file {data:?}"));
    }
    if let Some(gib) = limit_gib {
        let limit = gib.saturating_mul(1 << 30);
        if found.virtual_size > limit {
            return Err(format!("its virtual size {} bytes is larger than the spec's {gib} GiB", found.virtual_size));
        }
    }
    Ok(())
}

/// What an import made, removed unless the create took it: the disk copies (`files`, cleared
/// once the create took them) and the directories made for them (`dirs`: a VM's kept-disks
/// directory; never one that was there before, such as `paths.import`), removed when empty.
struct Placed {
    files: Vec<PathBuf>,
    dirs: Vec<PathBuf>,
}

impl Drop for Placed {
    fn drop(&mut self) {
        for path in &self.files {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a disk copied for an import")
                }
            }
        }
        for dir in &self.dirs {
            // Anything else in it stays.
            match std::fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "left a directory an import made"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::import::ImportInfo;

    fn info(format: &str, virtual_size: u64) -> ImportInfo {
        ImportInfo { format: format.into(), virtual_size, backing: None, data_file: None }
    }

    #[test]
    fn a_copied_disk_is_its_declared_format_alone_and_no_larger_than_the_spec() {
        assert_eq!(check_copy(DiskFormat::Qcow2, Some(1), &info("qcow2", 1 << 30)), Ok(()));
        assert_eq!(check_copy(DiskFormat::Qcow2, None, &info("qcow2", 5 << 30)), Ok(()), "no size in the spec");
        assert_eq!(check_copy(DiskFormat::Raw, Some(2), &info("raw", 1 << 20)), Ok(()), "smaller grows later");
        let e = check_copy(DiskFormat::Qcow2, Some(1), &info("vmdk", 1 << 30)).unwrap_err();
        assert!(e.contains("\"vmdk\" image, not a qcow2"), "{e}");
        let e = check_copy(DiskFormat::Qcow2, Some(1), &info("qcow2", (1 << 30) + 1)).unwrap_err();
        assert!(e.contains("larger than the spec's 1 GiB"), "{e}");
        let e = check_copy(DiskFormat::Raw, Some(1), &info("raw", 2 << 30)).unwrap_err();
        assert!(e.contains("larger"), "{e}");
        let mut backed = info("qcow2", 1 << 20);
        backed.backing = Some("/etc/vmhost/vmhostd.toml".into());
        assert!(check_copy(DiskFormat::Qcow2, Some(1), &backed).unwrap_err().contains("/etc/vmhost/vmhostd.toml"));
        let mut data = info("qcow2", 1 << 20);
        data.data_file = Some("/dev/sda".into());
        assert!(check_copy(DiskFormat::Qcow2, Some(1), &data).unwrap_err().contains("external data file"));
    }
}
