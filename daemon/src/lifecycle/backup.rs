//! `vm.export` and `vm.import` (docs/backup.md): a VM's spec and disks written to a directory
//! of `paths.backups`, and a VM made again from one, on this host or another.
//!
//! An export holds the VM's busy flag for its whole length (nothing changes its disks
//! meanwhile). A stopped VM's disks are copied by QEMU without a guest ([`crate::disk::export`]);
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

use super::Manager;
use crate::api::backup::{BackupDisk, DiskRole, ExportParams, ExportResult, ImportVmParams, Manifest};
use crate::api::disks::DiskFormat;
use crate::api::{ApiError, BootSpec, Code, Mutation, VmSpec, VmStatus};
use crate::disk::export::FlatDisk;
use serde_json::json;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Default and largest `timeout_s` of an export.
const DEFAULT_TIMEOUT_S: u64 = 3600;
const MAX_TIMEOUT_S: u64 = 86_400;

fn failed(message: String) -> ApiError {
    super::provisioning("export", message)
}

/// A disk to export: where it is now and what it becomes.
struct Source {
    entry: BackupDisk,
    /// Its layers, bottom first, with their formats (a base image then the overlay, or one
    /// file).
    layers: Vec<(PathBuf, String)>,
    /// The QEMU block device of a running VM.
    device: String,
}

fn open_ro(path: &Path) -> Result<OwnedFd, ApiError> {
    crate::blocking::run(|| std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path))
        .map(OwnedFd::from)
        .map_err(|e| failed(format!("cannot open {}: {e}", path.display())))
}

/// Creates the empty target `path` (0600, never an existing file), `len` long.
fn create_target(path: &Path, len: u64) -> Result<OwnedFd, ApiError> {
    crate::blocking::run(|| {
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        f.set_len(len)?;
        Ok::<_, std::io::Error>(f)
    })
    .map(OwnedFd::from)
    .map_err(|e| failed(format!("cannot create {}: {e}", path.display())))
}

impl Manager {
    /// The disks of `spec` to export, with their sources (sizes filled in later).
    async fn export_sources(&self, spec: &VmSpec) -> Result<Vec<Source>, ApiError> {
        let paths = self.paths(&spec.name);
        let entry = |role, name: &str, format| {
            let mut e = BackupDisk {
                role,
                name: name.to_string(),
                file: String::new(),
                format,
                virtual_size: 0,
                bytes: 0,
                sha256: String::new(),
            };
            e.file = crate::backup::file_of(&e);
            e
        };
        let mut out = Vec::new();
        let boot_layers = if let Some(image) = &spec.boot.image {
            let base = self.config.paths.images.join(image);
            let format = crate::disk::base_format(&self.disk_tool(), &base)
                .await
                .map_err(|e| failed(format!("cannot read the base image {}: {e}", base.display())))?;
            Some(vec![(base, format), (paths.overlay.clone(), "qcow2".to_string())])
        } else if spec.boot.disk.is_some() {
            let rec = self.record(&spec.name)?;
            let root = rec.root_disk.ok_or_else(|| failed("the VM's record names no root disk".into()))?;
            Some(vec![(paths.root_disk(root.format), root.format.as_str().to_string())])
        } else {
            None
        };
        if let Some(layers) = boot_layers {
            out.push(Source {
                entry: entry(DiskRole::Root, "root", DiskFormat::Qcow2),
                layers,
                device: "virtio0".into(),
            });
        }
        for disk in &spec.disks {
            out.push(Source {
                entry: entry(DiskRole::Data, &disk.name, disk.format),
                layers: vec![(paths.data_disk(disk), disk.format.as_str().to_string())],
                device: crate::qemu::argv::data_drive(&disk.name),
            });
        }
        Ok(out)
    }

    /// `vm.export` (module doc).
    ///
    /// # Errors
    /// 2001 on `timeout_s`, 4040, 4090 (another operation on the VM), 4001 `step: export`
    /// (nothing is left in `paths.backups`).
    pub async fn export_vm(self: &Arc<Self>, p: ExportParams) -> Result<ExportResult, ApiError> {
        let timeout_s = p.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S);
        if timeout_s == 0 || timeout_s > MAX_TIMEOUT_S {
            return Err(ApiError::invalid("timeout_s", format!("1-{MAX_TIMEOUT_S} seconds")));
        }
        let within = Duration::from_secs(timeout_s);
        let (_guard, rec) = self.begin(&p.name)?;
        Self::check_not_reverting(&rec)?;
        let live = rec.status == VmStatus::Running;
        let spec = if live { rec.running_spec.clone().unwrap_or_else(|| rec.spec.clone()) } else { rec.spec.clone() };
        let mut sources = self.export_sources(&spec).await?;
        let files: Vec<&Path> = sources.iter().flat_map(|s| s.layers.iter().map(|(p, _)| p.as_path())).collect();
        let backups = self.config.paths.backups_dir();
        crate::blocking::run(|| crate::disk::space::check_copy_room(&backups, &files, "name"))?;
        let partial = self.backups.begin(&p.name)?;
        let targets: Vec<PathBuf> = sources.iter().map(|s| partial.dir().join(&s.entry.file)).collect();
        let frozen = if live {
            self.export_live(&p.name, &mut sources, &targets, within).await?
        } else {
            self.export_stopped(&mut sources, &targets, within).await?;
            Vec::new()
        };
        for (source, target) in sources.iter_mut().zip(&targets) {
            let raw = source.entry.format == DiskFormat::Raw;
            let (sha256, bytes) = crate::blocking::run(|| {
                let f = std::fs::OpenOptions::new().read(true).write(true).open(target)?;
                let sha = crate::disk::export::seal(&f, raw)?;
                Ok::<_, std::io::Error>((sha, f.metadata()?.len()))
            })
            .map_err(|e| failed(format!("cannot read back {}: {e}", target.display())))?;
            source.entry.sha256 = sha256;
            source.entry.bytes = bytes;
        }
        let manifest = Manifest {
            format: crate::backup::FORMAT.into(),
            version: 1,
            created_at: crate::api::now_rfc3339(),
            vmhost_version: super::VERSION.into(),
            vm: p.name.clone(),
            spec,
            live,
            frozen,
            disks: sources.into_iter().map(|s| s.entry).collect(),
        };
        let backup = partial.name().to_string();
        let path = partial.finish(&manifest)?;
        tracing::info!(vm = %p.name, backup = %backup, live, "exported");
        Ok(ExportResult { backup, path, manifest })
    }

    /// Copies a stopped VM's disks with QEMU without a guest.
    async fn export_stopped(
        &self,
        sources: &mut [Source],
        targets: &[PathBuf],
        within: Duration,
    ) -> Result<(), ApiError> {
        let mut disks = Vec::new();
        for (source, target) in sources.iter_mut().zip(targets) {
            let (top, _) = source.layers.last().ok_or_else(|| failed("a disk without a file".into()))?;
            let info = crate::disk::import::inspect(&self.disk_tool(), open_ro(top)?)
                .await
                .map_err(|e| failed(format!("cannot read {}: {e}", top.display())))?;
            source.entry.virtual_size = info.virtual_size;
            let len = if source.entry.format == DiskFormat::Raw { info.virtual_size } else { 0 };
            let mut layers = Vec::new();
            for (path, format) in &source.layers {
                layers.push((open_ro(path)?, format.clone()));
            }
            disks.push(FlatDisk {
                layers,
                target: create_target(target, len)?,
                format: source.entry.format.as_str(),
                virtual_size: info.virtual_size,
            });
        }
        crate::disk::export::flatten(&self.disk_tool(), disks, within).await.map_err(|e| {
            let tail = e.stderr_tail().unwrap_or_default().to_string();
            failed(format!("cannot copy the disks: {e}")).details(json!({ "step": "export", "stderr": tail }))
        })
    }

    /// Copies a running VM's disks in its own QEMU, all at one instant
    /// ([`super::live_copy`]); returns the mount points the guest froze.
    async fn export_live(
        &self,
        name: &str,
        sources: &mut [Source],
        targets: &[PathBuf],
        within: Duration,
    ) -> Result<Vec<String>, ApiError> {
        let mut live: Vec<super::live_copy::Target> = sources
            .iter()
            .zip(targets)
            .map(|(s, path)| super::live_copy::Target {
                device: s.device.clone(),
                path: path.clone(),
                format: s.entry.format.as_str(),
                backing: None,
                sync: "full",
                virtual_size: 0,
            })
            .collect();
        let frozen = self.copy_disks_live(name, &mut live, within, "export").await?;
        for (s, t) in sources.iter_mut().zip(&live) {
            s.entry.virtual_size = t.virtual_size;
        }
        Ok(frozen)
    }

    /// `vm.import` (module doc).
    ///
    /// # Errors
    /// 2001 on `backup` (a bad name or manifest; a disk's destination already taken) or as a
    /// `vm.create` of the backup's spec would; 4040 (no such backup); 2003 on `backup` (a file
    /// is not what the manifest says; nothing left); what `vm.create` returns.
    pub async fn import_vm(self: &Arc<Self>, p: ImportVmParams) -> Result<Mutation, ApiError> {
        let (dir, manifest) = self.backups.read(&p.backup)?;
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
                ..BootSpec::default()
            };
        }
        crate::validate::validate_spec(&spec, &self.config)?;
        if self.lock().vms.contains_key(&spec.name) {
            return Err(ApiError::invalid("name", format!("a VM named {:?} already exists", spec.name)));
        }
        let import_dir = self.config.paths.import_dir();
        let paths = self.paths(&spec.name);
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
        let files: Vec<PathBuf> = manifest.disks.iter().map(|d| dir.join(&d.file)).collect();
        let files: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
        crate::blocking::run(|| crate::disk::space::check_copy_room(&import_dir, &files, "backup"))?;
        let mut placed = Placed(Vec::new());
        for (disk, dest) in manifest.disks.iter().zip(&destinations) {
            self.copy_out(&dir, disk, dest, &spec.name).await?;
            placed.0.push(dest.clone());
        }
        let name = spec.name.clone();
        let ours = spec.clone();
        let result = self.create(spec).await;
        match &result {
            Ok(_) => {
                placed.0.clear();
                tracing::info!(vm = %name, backup = %p.backup, "imported");
            }
            // A create that failed after recording the VM leaves it `failed`: an import that
            // failed leaves nothing (the name was free), so it goes too (only this import's:
            // its spec names this import's root disk).
            Err(_) if self.lock().vms.get(&name).is_some_and(|r| r.status == VmStatus::Failed && r.spec == ours) => {
                if let Err(e) = self.destroy(&name).await {
                    tracing::warn!(vm = %name, error = %e, "cannot remove the VM of a failed import");
                }
            }
            Err(_) => {}
        }
        result
    }

    /// Copies backup file `disk` from `dir` to `dest` through a temp file beside it, checking
    /// its sha256.
    async fn copy_out(&self, dir: &Path, disk: &BackupDisk, dest: &Path, vm: &str) -> Result<(), ApiError> {
        let import_dir = self.config.paths.import_dir();
        let copy_failed = |e: std::io::Error| {
            super::provisioning("import", format!("cannot copy {} out of the backup: {e}", disk.file))
        };
        let mut temp = crate::images::Temp::create(&import_dir, &format!("{vm}-{}", disk.file)).map_err(copy_failed)?;
        crate::images::copy(&dir.join(&disk.file), &mut temp).map_err(copy_failed)?;
        let found = temp.finish().map_err(copy_failed)?;
        if found != disk.sha256 {
            return Err(ApiError::new(
                Code::ChecksumMismatch,
                format!(
                    "{} in the backup has sha256 {found}, not {} as its manifest says; nothing was imported",
                    disk.file, disk.sha256
                ),
            )
            .field("backup")
            .details(json!({ "file": disk.file, "expected": disk.sha256, "found": found, "bytes": temp.bytes() })));
        }
        if let Some(parent) = dest.parent() {
            crate::blocking::run(|| crate::state::dirs::private_dir(parent)).map_err(copy_failed)?;
        }
        temp.place(dest).map_err(copy_failed)?;
        Ok(())
    }
}

/// Copies an import made, removed unless the create took them (cleared).
struct Placed(Vec<PathBuf>);

impl Drop for Placed {
    fn drop(&mut self) {
        for path in &self.0 {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a disk copied for an import")
                }
            }
            if let Some(parent) = path.parent() {
                // The kept-disks directory made for it; anything else there stays.
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}
