//! `vm.snapshot`, `vm.snapshots`, `vm.revert`, `vm.snapshot_delete` (docs/snapshots.md): copies of
//! a VM's disks kept with it, and the VM's disks put back as they were.
//!
//! A snapshot is a directory `STATE/snapshots/VM/NAME/` with one copy per disk and
//! `snapshot.json` (the spec then, each copy's sha256). Of a running VM, the copies are made by
//! its own QEMU, every disk as at one instant (one QMP transaction), with the guest's file
//! systems frozen for that instant when its agent can ([`super::live_copy`]); of a stopped VM,
//! by reading the files. An image VM's boot disk is copied as an overlay (only what
//! the VM wrote; its header names the same base image, which the image store keeps from
//! changing while VMs use it); a `boot.disk` root disk and data disks whole (raw ones sparse).
//! Like a backup, a snapshot is written into `.NAME.partial` and renamed once whole.
//!
//! A revert (stopped VM only) first checks the snapshot was of the same disks (names, formats,
//! sizes: 2001 otherwise), records the intent (`reverting`: no start until a revert completes),
//! copies every disk out of the snapshot next to the VM's own file checking its sha256, then
//! renames each over the VM's file and clears the intent. Only the VM's own disk files are
//! written; nothing outside the VM is touched. Newer snapshots stay. A destroy removes the
//! VM's snapshots with its disks.

use super::Manager;
use crate::api::backup::{BackupDisk, DiskRole};
use crate::api::disks::DiskFormat;
use crate::api::snapshots::{Snapshot, SnapshotDeleted, SnapshotParams};
use crate::api::{ApiError, Code, Mutation, VmSpec, VmStatus};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most snapshots a VM keeps.
pub const MAX_SNAPSHOTS: usize = 16;

fn failed(message: String) -> ApiError {
    super::provisioning("snapshot", message)
}

fn is_snapshot_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    if is_snapshot_name(name) {
        Ok(())
    } else {
        Err(ApiError::invalid("snapshot", format!("{name:?}: 1-64 of A-Z a-z 0-9 . _ -, not starting with a dot")))
    }
}

fn timeout(timeout_s: Option<u64>) -> Result<Duration, ApiError> {
    match timeout_s.unwrap_or(3600) {
        s @ 1..=86_400 => Ok(Duration::from_secs(s)),
        _ => Err(ApiError::invalid("timeout_s", "1-86400 seconds")),
    }
}

/// One disk of the VM: its file, its copy's entry, and the QEMU device.
struct Disk {
    entry: BackupDisk,
    file: PathBuf,
    /// Its base image, for an image VM's overlay.
    base: Option<(PathBuf, String)>,
    device: String,
}

/// What must be equal for a revert: each disk's name, format and size, and the boot source.
fn disks_of(spec: &VmSpec) -> (Vec<(String, DiskFormat, u64)>, crate::api::BootSpec) {
    let mut boot = spec.boot.clone();
    boot.cmdline = None;
    let disks = spec.disks.iter().map(|d| (d.name.clone(), d.format, d.size_gib)).collect();
    (disks, boot)
}

impl Manager {
    /// `STATE/snapshots/VM`.
    pub(super) fn snapshots_dir(&self, name: &str) -> PathBuf {
        self.config.paths.state.join("snapshots").join(name)
    }

    /// The VM's disks as files and devices (its copies' entries without sizes or sums).
    async fn snapshot_disks(&self, rec: &crate::state::VmRecord, spec: &VmSpec) -> Result<Vec<Disk>, ApiError> {
        let paths = self.paths(&spec.name);
        let entry = |role, name: &str, file: &str, format| BackupDisk {
            role,
            name: name.to_string(),
            file: file.to_string(),
            format,
            virtual_size: 0,
            bytes: 0,
            sha256: String::new(),
        };
        let mut out = Vec::new();
        if let Some(image) = &spec.boot.image {
            let base = self.config.paths.images.join(image);
            let format = crate::disk::base_format(&self.disk_tool(), &base)
                .await
                .map_err(|e| failed(format!("cannot read the base image {}: {e}", base.display())))?;
            out.push(Disk {
                entry: entry(DiskRole::Root, "root", "root.qcow2", DiskFormat::Qcow2),
                file: paths.overlay.clone(),
                base: Some((base, format)),
                device: "virtio0".into(),
            });
        } else if spec.boot.disk.is_some() {
            let root = rec.root_disk.as_ref().ok_or_else(|| failed("the VM's record names no root disk".into()))?;
            let file = format!("root.{}", root.format.as_str());
            out.push(Disk {
                entry: entry(DiskRole::Root, "root", &file, root.format),
                file: paths.root_disk(root.format),
                base: None,
                device: "virtio0".into(),
            });
        }
        for d in &spec.disks {
            out.push(Disk {
                entry: entry(DiskRole::Data, &d.name, &d.file_name(), d.format),
                file: paths.data_disk(d),
                base: None,
                device: crate::qemu::argv::data_drive(&d.name),
            });
        }
        Ok(out)
    }

    /// `vm.snapshot` (module doc).
    ///
    /// # Errors
    /// 2001 on `snapshot` (a bad or taken name, or [`MAX_SNAPSHOTS`] reached) or `timeout_s`,
    /// 4040, 4090, 4001 `step: snapshot` (nothing is kept).
    pub async fn snapshot(self: &Arc<Self>, p: SnapshotParams) -> Result<Snapshot, ApiError> {
        check_name(&p.snapshot)?;
        let within = timeout(p.timeout_s)?;
        let (_guard, rec) = self.begin(&p.name)?;
        Self::check_not_reverting(&rec)?;
        let existing = self.list_snapshots(&p.name)?;
        if existing.iter().any(|s| s.name == p.snapshot) {
            return Err(ApiError::invalid(
                "snapshot",
                format!("VM {:?} has a snapshot {:?} already", p.name, p.snapshot),
            ));
        }
        if existing.len() >= MAX_SNAPSHOTS {
            return Err(ApiError::invalid(
                "snapshot",
                format!("VM {:?} has {MAX_SNAPSHOTS} snapshots: delete one", p.name),
            ));
        }
        let live = rec.status == VmStatus::Running;
        let spec = if live { rec.running_spec.clone().unwrap_or_else(|| rec.spec.clone()) } else { rec.spec.clone() };
        let mut disks = self.snapshot_disks(&rec, &spec).await?;
        let files: Vec<&Path> = disks.iter().map(|d| d.file.as_path()).collect();
        crate::blocking::run(|| crate::disk::space::check_copy_room(&self.config.paths.state, &files, "snapshot"))?;
        let dir = self.snapshots_dir(&p.name);
        let partial = dir.join(format!(".{}.partial", p.snapshot));
        let done = dir.join(&p.snapshot);
        crate::blocking::run(|| {
            crate::state::dirs::private_dir(&self.config.paths.state.join("snapshots"))?;
            crate::state::dirs::private_dir(&dir)?;
            let _ = std::fs::remove_dir_all(&partial);
            crate::state::dirs::private_dir(&partial)
        })
        .map_err(|e| failed(format!("cannot create {}: {e}", partial.display())))?;
        let mut cleanup = RemoveDir(Some(partial.clone()));
        let frozen = if live {
            self.snapshot_live(&p.name, &mut disks, &partial, within).await?
        } else {
            for d in &mut disks {
                let mut temp = crate::images::Temp::create(&partial, &d.entry.file)
                    .map_err(|e| failed(format!("cannot create a copy in {}: {e}", partial.display())))?;
                crate::images::copy(&d.file, &mut temp)
                    .map_err(|e| failed(format!("cannot copy {}: {e}", d.file.display())))?;
                temp.finish().map_err(|e| failed(format!("cannot write a copy: {e}")))?;
                temp.place(&partial.join(&d.entry.file)).map_err(|e| failed(format!("cannot place a copy: {e}")))?;
            }
            Vec::new()
        };
        for d in &mut disks {
            let target = partial.join(&d.entry.file);
            let raw = d.entry.format == DiskFormat::Raw;
            let (sha, bytes) = crate::blocking::run(|| {
                let f = std::fs::OpenOptions::new().read(true).write(true).open(&target)?;
                let sha = crate::disk::export::seal(&f, raw)?;
                f.sync_all()?;
                Ok::<_, std::io::Error>((sha, f.metadata()?.len()))
            })
            .map_err(|e| failed(format!("cannot read back {}: {e}", target.display())))?;
            d.entry.sha256 = sha;
            d.entry.bytes = bytes;
        }
        let snapshot = Snapshot {
            name: p.snapshot.clone(),
            created_at: crate::api::now_rfc3339(),
            live,
            frozen,
            spec,
            disks: disks.into_iter().map(|d| d.entry).collect(),
        };
        let json = serde_json::to_vec_pretty(&snapshot).map_err(|e| failed(e.to_string()))?;
        crate::blocking::run(|| {
            crate::state::atomic::write_atomic(&partial.join("snapshot.json"), &json)?;
            std::fs::rename(&partial, &done)?;
            std::fs::File::open(&dir)?.sync_all()
        })
        .map_err(|e| failed(format!("cannot finish the snapshot in {}: {e}", partial.display())))?;
        cleanup.0 = None;
        tracing::info!(vm = %p.name, snapshot = %p.snapshot, live, "snapshot taken");
        Ok(snapshot)
    }

    /// Copies a running VM's disks in its QEMU, all at one instant ([`super::live_copy`]);
    /// returns the mount points the guest froze.
    async fn snapshot_live(
        &self,
        name: &str,
        disks: &mut [Disk],
        partial: &Path,
        within: Duration,
    ) -> Result<Vec<String>, ApiError> {
        let mut live: Vec<super::live_copy::Target> = disks
            .iter()
            .map(|d| super::live_copy::Target {
                device: d.device.clone(),
                path: partial.join(&d.entry.file),
                format: d.entry.format.as_str(),
                backing: d.base.clone(),
                // An overlay's copy holds what the VM wrote; its header names the same base.
                sync: if d.base.is_some() { "top" } else { "full" },
                virtual_size: 0,
            })
            .collect();
        let frozen = self.copy_disks_live(name, &mut live, within, "snapshot").await?;
        for (d, t) in disks.iter_mut().zip(&live) {
            d.entry.virtual_size = t.virtual_size;
        }
        Ok(frozen)
    }

    /// The VM's snapshots, oldest first.
    fn list_snapshots(&self, name: &str) -> Result<Vec<Snapshot>, ApiError> {
        let dir = self.snapshots_dir(name);
        let mut out: Vec<Snapshot> = crate::blocking::run(|| {
            let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
            entries
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(is_snapshot_name))
                .filter_map(|e| std::fs::read(e.path().join("snapshot.json")).ok())
                .filter_map(|b| serde_json::from_slice::<Snapshot>(&b).ok())
                .collect()
        });
        out.sort_by(|a, b| (&a.created_at, &a.name).cmp(&(&b.created_at, &b.name)));
        Ok(out)
    }

    /// `vm.snapshots`: the VM's snapshots, oldest first.
    ///
    /// # Errors
    /// 4040.
    pub fn snapshots(&self, name: &str) -> Result<Vec<Snapshot>, ApiError> {
        self.record(name)?;
        self.list_snapshots(name)
    }

    /// `vm.revert` (module doc).
    ///
    /// # Errors
    /// 2001 on `snapshot` (a bad name; the VM's disks are not the snapshot's), 4040 (no VM; no
    /// such snapshot, on `snapshot`), 4090 (running: stop it first; another operation), 2003
    /// on `snapshot` (a copy is not what the snapshot recorded; nothing replaced), 4001.
    pub async fn revert(self: &Arc<Self>, p: SnapshotParams) -> Result<Mutation, ApiError> {
        check_name(&p.snapshot)?;
        let (_guard, rec) = self.begin(&p.name)?;
        let snapshot = self.list_snapshots(&p.name)?.into_iter().find(|s| s.name == p.snapshot).ok_or_else(|| {
            ApiError::new(Code::NotFound, format!("VM {:?} has no snapshot {:?}", p.name, p.snapshot)).field("snapshot")
        })?;
        if matches!(rec.status, VmStatus::Running | VmStatus::Starting | VmStatus::Stopping) {
            return Err(ApiError::new(
                Code::Busy,
                format!("VM {:?} is {}: stop it before a revert", p.name, rec.status.as_str()),
            )
            .field("name"));
        }
        if disks_of(&snapshot.spec) != disks_of(&rec.spec) {
            return Err(ApiError::invalid(
                "snapshot",
                format!(
                    "VM {:?}'s boot disk or data disks (names, formats, sizes) changed since snapshot {:?}: a revert puts back \
                     disks as they were, so they must be the same",
                    p.name, p.snapshot
                ),
            ));
        }
        let disks = self.snapshot_disks(&rec, &rec.spec).await?;
        let same_files = disks.len() == snapshot.disks.len()
            && disks.iter().zip(&snapshot.disks).all(|(d, s)| d.entry.file == s.file && d.entry.format == s.format);
        if !same_files {
            return Err(ApiError::invalid(
                "snapshot",
                format!("snapshot {:?} does not hold the files of VM {:?}'s disks", p.snapshot, p.name),
            ));
        }
        let from = self.snapshots_dir(&p.name).join(&p.snapshot);
        let copies: Vec<PathBuf> = snapshot.disks.iter().map(|s| from.join(&s.file)).collect();
        let copies: Vec<&Path> = copies.iter().map(PathBuf::as_path).collect();
        crate::blocking::run(|| crate::disk::space::check_copy_room(&self.config.paths.state, &copies, "snapshot"))?;
        // Copies an interrupted revert left beside the disks (named after the disk's file, so
        // another VM's revert in the same directory keeps its own).
        for d in &disks {
            crate::blocking::run(|| crate::images::remove_leftovers_of(&d.file));
        }
        // Copied out first, next to each file (the same file system: the rename is atomic).
        let mut copies = Vec::new();
        for (disk, saved) in disks.iter().zip(&snapshot.disks) {
            let dir = disk.file.parent().ok_or_else(|| failed("a disk without a directory".into()))?;
            let own = disk.file.file_name().and_then(|n| n.to_str()).unwrap_or(&saved.file);
            let mut temp = crate::images::Temp::create(dir, own)
                .map_err(|e| failed(format!("cannot create a copy in {}: {e}", dir.display())))?;
            crate::images::copy(&from.join(&saved.file), &mut temp)
                .map_err(|e| failed(format!("cannot copy {} out of the snapshot: {e}", saved.file)))?;
            let found = temp.finish().map_err(|e| failed(format!("cannot write a copy: {e}")))?;
            if found != saved.sha256 {
                return Err(ApiError::new(
                    Code::ChecksumMismatch,
                    format!(
                        "{} of snapshot {:?} has sha256 {found}, not {}; nothing was reverted",
                        saved.file, p.snapshot, saved.sha256
                    ),
                )
                .field("snapshot")
                .details(
                    json!({ "file": saved.file, "expected": saved.sha256, "found": found, "bytes": temp.bytes() }),
                ));
            }
            copies.push((temp, disk.file.clone()));
        }
        let snap = p.snapshot.clone();
        self.update(&p.name, "vm.revert", |r| r.reverting = Some(snap))?;
        self.crashpoint("revert:recorded");
        for (temp, file) in copies {
            temp.replace(&file).map_err(|e| failed(format!("cannot put {} back: {e}", file.display())))?;
        }
        self.update(&p.name, "vm.revert", |r| r.reverting = None)?;
        tracing::info!(vm = %p.name, snapshot = %p.snapshot, "reverted");
        Ok(Mutation::new(true, Some(self.get(&p.name)?)))
    }

    /// `vm.snapshot_delete`.
    ///
    /// # Errors
    /// 2001 on `snapshot`, 4040, 4090, 4001.
    pub async fn snapshot_delete(self: &Arc<Self>, p: SnapshotParams) -> Result<SnapshotDeleted, ApiError> {
        check_name(&p.snapshot)?;
        let (_guard, rec) = self.begin(&p.name)?;
        if rec.reverting.as_deref() == Some(p.snapshot.as_str()) {
            return Err(ApiError::new(
                Code::Busy,
                format!(
                    "a revert of VM {:?} to snapshot {:?} was interrupted: run it again before deleting it",
                    p.name, p.snapshot
                ),
            )
            .field("snapshot"));
        }
        let dir = self.snapshots_dir(&p.name).join(&p.snapshot);
        let changed = crate::blocking::run(|| match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        })
        .map_err(|e| failed(format!("cannot delete {}: {e}", dir.display())))?;
        Ok(SnapshotDeleted { changed, snapshot: p.snapshot })
    }

    /// Removes the `.NAME.partial` directories of snapshots a crash interrupted (at start).
    pub(super) fn remove_partial_snapshots(&self) {
        let root = self.config.paths.state.join("snapshots");
        let Ok(vms) = std::fs::read_dir(&root) else { return };
        for vm in vms.flatten() {
            let Ok(entries) = std::fs::read_dir(vm.path()) else { continue };
            for e in entries.flatten() {
                let partial = e.file_name().to_str().is_some_and(|n| n.starts_with('.') && n.ends_with(".partial"));
                if partial {
                    match std::fs::remove_dir_all(e.path()) {
                        Ok(()) => tracing::info!(dir = %e.path().display(), "removed an interrupted snapshot"),
                        Err(err) => {
                            tracing::warn!(dir = %e.path().display(), error = %err, "cannot remove an interrupted snapshot")
                        }
                    }
                }
            }
        }
    }

    /// Removes every snapshot of VM `name` (its destroy).
    ///
    /// # Errors
    /// 4001 when the directory cannot be removed.
    pub(super) fn dispose_snapshots(&self, name: &str) -> Result<(), ApiError> {
        let dir = self.snapshots_dir(name);
        crate::blocking::run(|| match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        })
        .map_err(|e| failed(format!("cannot delete the snapshots in {}: {e}", dir.display())))
    }

    /// 4090 when a revert of VM `rec` was interrupted: its disks may be part reverted.
    pub(super) fn check_not_reverting(rec: &crate::state::VmRecord) -> Result<(), ApiError> {
        match &rec.reverting {
            Some(s) => Err(ApiError::new(
                Code::Busy,
                format!("a revert of VM {:?} to snapshot {s:?} was interrupted: run vm.revert again", rec.spec.name),
            )
            .field("name")),
            None => Ok(()),
        }
    }
}

/// Removes a directory when dropped unless cleared.
struct RemoveDir(Option<PathBuf>);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        if let Some(dir) = &self.0 {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an unfinished snapshot");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_are_plain() {
        for ok in ["s1", "before-upgrade", "2026.12.04_a"] {
            assert!(is_snapshot_name(ok), "{ok}");
        }
        for bad in ["", ".x", "a/b", "a b", &"x".repeat(65), "..", "ü"] {
            assert!(!is_snapshot_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_revert_needs_the_same_disks_but_not_the_same_kernel_arguments() {
        let mut spec = crate::validate::tests::spec("v");
        spec.disks = vec![crate::api::disks::DataDiskSpec {
            name: "nsm".into(),
            size_gib: 2,
            format: DiskFormat::Raw,
            preallocate: false,
            cache: Default::default(),
            aio: None,
            keep_on_destroy: false,
        }];
        let mut other = spec.clone();
        other.boot.cmdline = Some("quiet".into());
        other.memory_mib += 64;
        assert_eq!(disks_of(&spec), disks_of(&other));
        other.disks[0].size_gib = 3;
        assert_ne!(disks_of(&spec), disks_of(&other), "grown since");
        let mut other = spec.clone();
        other.disks[0].format = DiskFormat::Qcow2;
        assert_ne!(disks_of(&spec), disks_of(&other));
        let mut other = spec.clone();
        other.disks.clear();
        assert_ne!(disks_of(&spec), disks_of(&other));
    }
}
