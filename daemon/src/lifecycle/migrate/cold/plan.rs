//! The rules of a cold move that need no host, kept apart from the steps that act on them so
//! each is unit-tested on its own: which statuses may move ([`admit`]), which files a VM's move
//! carries and under which wire names ([`source_files`]), where the destination puts each of
//! them ([`placement`]) and which paths it removes when it gives a move up ([`received_paths`]),
//! and what a restart does with a cold move's record on the destination
//! ([`destination_action`]; the source's is the live migration's rule,
//! `source_outcome::decide`).
//!
//! Order of use: [`admit`] first in `vm.move`; [`source_files`] to build `Hello` and the files
//! channel; [`placement`] for each file header the destination reads; [`received_paths`] when
//! the destination abandons; the two recovery decisions once per cold record at daemon start.

use crate::api::{BootSpec, DataDiskSpec, DiskFormat, VmSpec, VmStatus};
use crate::migration::HelloDisk;
use crate::qemu::argv::VmPaths;
use crate::state::migration::MigrationPhase;
use std::path::{Path, PathBuf};

/// The wire name of the boot disk's file (an image VM's overlay, a `boot.disk` VM's root disk).
pub(crate) const BOOT: &str = "boot";
/// The wire name of a UEFI VM's variables store.
pub(crate) const UEFI_VARS: &str = "uefi-vars";
/// The prefix of a data disk's wire name (`data:NAME`).
const DATA: &str = "data:";

/// Why a VM may not be moved now ([`admit`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// 4097 reason `status`: neither stopped, nor running with `stop`.
    #[error("VM is {0:?}: only a stopped VM moves (or a running one with stop: true)")]
    Status(VmStatus),
}

/// Whether a VM in `status` (`live`: its QEMU found running) may move, and whether the move
/// stops it first (`Ok(true)`).
///
/// # Errors
/// [`Refusal::Status`] for any other status, and for a running VM without `stop`.
pub(crate) fn admit(status: VmStatus, live: bool, stop: bool) -> Result<bool, Refusal> {
    match (status, live) {
        (VmStatus::Stopped | VmStatus::Dead, false) => Ok(false),
        (VmStatus::Running, true) if stop => Ok(true),
        _ => Err(Refusal::Status(status)),
    }
}

/// One file a move sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceFile {
    /// Its wire name ([`BOOT`], `data:NAME`, [`UEFI_VARS`]).
    pub name: String,
    /// Where it is on the source.
    pub path: PathBuf,
    /// What `Hello` says of it.
    pub hello: HelloDisk,
}

/// The files a stopped VM's move carries, in order, from its record: the boot disk's own file
/// (an image VM's overlay, or a `boot.disk` VM's root disk of `root_format`), each data disk,
/// the UEFI variables store. Only those `exists` says are there: a disk never made yet (a VM
/// created stopped, a data disk added while stopped) is made at its first start on the
/// destination, as here. Never the seed (rebuilt at every start) nor a base image (the
/// destination has its own copy under the same name). `bytes` is the file's length, or for a
/// `boot.disk` root disk the size it was imported with (`root_bytes`), which the destination
/// records.
pub(crate) fn source_files(
    spec: &VmSpec,
    paths: &VmPaths,
    root: Option<(DiskFormat, u64)>,
    exists: impl Fn(&Path) -> Option<u64>,
) -> Vec<SourceFile> {
    let mut out = Vec::new();
    let mut push = |name: String, device: &str, path: PathBuf, format: &str, bytes: Option<u64>| {
        if let Some(len) = exists(&path) {
            let bytes = bytes.unwrap_or(len);
            out.push(SourceFile {
                name,
                path,
                hello: HelloDisk { device: device.to_string(), bytes, format: format.to_string() },
            });
        }
    };
    if spec.boot.image.is_some() {
        push(BOOT.into(), "virtio0", paths.overlay.clone(), "qcow2", None);
    } else if let Some((format, imported)) = root.filter(|_| spec.boot.disk.is_some()) {
        push(BOOT.into(), "virtio0", paths.root_disk(format), format.as_str(), Some(imported));
    }
    for d in &spec.disks {
        push(format!("{DATA}{}", d.name), &format!("data-{}", d.name), paths.data_disk(d), d.format.as_str(), None);
    }
    push(UEFI_VARS.into(), "uefi-vars", paths.uefi_vars(), "raw", None);
    out
}

/// Where the destination writes a received file and renames it once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The file as a create would have it.
    pub target: PathBuf,
    /// Where its bytes arrive first (removed on a failure; renamed to `target` when checked).
    pub partial: PathBuf,
}

fn partial_of(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

/// The format `Hello` gave the boot disk (`virtio0`), for a `boot.disk` VM's root disk.
fn boot_format(hello: &[HelloDisk]) -> Option<DiskFormat> {
    match hello.iter().find(|d| d.device == "virtio0")?.format.as_str() {
        "qcow2" => Some(DiskFormat::Qcow2),
        "raw" => Some(DiskFormat::Raw),
        _ => None,
    }
}

/// Where file `name` of a move of `spec` goes on the destination (paths from the admitted spec,
/// never from the wire): an image VM's overlay where a create makes it, a `boot.disk` VM's root
/// disk where a create moves the import to, data disks and the UEFI variables store where
/// data_disks.rs and a first start put them. `None` for a name the spec has no place for.
pub(crate) fn placement(spec: &VmSpec, paths: &VmPaths, hello: &[HelloDisk], name: &str) -> Option<Placement> {
    let target = match name {
        BOOT if spec.boot.image.is_some() => paths.overlay.clone(),
        BOOT if spec.boot.disk.is_some() => paths.root_disk(boot_format(hello)?),
        UEFI_VARS if spec.boot.firmware == crate::api::Firmware::Uefi => paths.uefi_vars(),
        _ => {
            let disk = name.strip_prefix(DATA)?;
            paths.data_disk(spec.disks.iter().find(|d| d.name == disk)?)
        }
    };
    let partial = if target == paths.overlay {
        super::super::super::teardown::partial_overlay(paths)
    } else if spec.disks.iter().any(|d| paths.data_disk(d) == target) {
        let d: &DataDiskSpec = spec.disks.iter().find(|d| paths.data_disk(d) == target)?;
        paths.partial_data_disk(d)
    } else if target == paths.uefi_vars() {
        paths.partial_uefi_vars()
    } else {
        partial_of(&target)
    };
    Some(Placement { target, partial })
}

/// Every path a cold receive of `spec` may have written (both forms of a root disk, each with
/// its partial): what the destination removes when it gives the move up. The name was free
/// and its disk directory cleared before anything arrived, so each is this move's.
pub(crate) fn received_paths(spec: &VmSpec, paths: &VmPaths) -> Vec<PathBuf> {
    let mut out = vec![paths.overlay.clone(), super::super::super::teardown::partial_overlay(paths)];
    if spec.boot.disk.is_some() {
        for f in [DiskFormat::Qcow2, DiskFormat::Raw] {
            out.push(paths.root_disk(f));
            out.push(partial_of(&paths.root_disk(f)));
        }
    }
    for d in &spec.disks {
        out.push(paths.data_disk(d));
        out.push(paths.partial_data_disk(d));
    }
    out.push(paths.uefi_vars());
    out.push(paths.partial_uefi_vars());
    out
}

/// The admitted spec and the source's `Hello` spec describe the same VM (`state` aside: a
/// desired state, which the orchestrator's spec gives and a stop changes).
pub(crate) fn same_vm(admitted: &VmSpec, theirs: &VmSpec) -> bool {
    let mut theirs = theirs.clone();
    theirs.state = admitted.state;
    &theirs == admitted
}

/// The root disk a destination records for a `boot.disk` VM it received: the format and the
/// imported size the source sent; `source` is where a create would have imported it from (a
/// destroy deletes a root disk whose import completed, so it is never moved back there).
pub(crate) fn boot_disk_root(
    boot: &BootSpec,
    hello: &[HelloDisk],
    import_dir: &Path,
) -> Option<crate::state::RootDisk> {
    let file = boot.disk.as_ref()?;
    let bytes = hello.iter().find(|d| d.device == "virtio0")?.bytes;
    Some(crate::state::RootDisk {
        format: boot_format(hello)?,
        imported_bytes: bytes,
        source: import_dir.join(file),
        source_mode: 0o600,
    })
}

/// What a restart does with the destination's record of a cold move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DestinationAction {
    /// Before the commit: the files received go, then the migration is abandoned as a live
    /// one is (tombstone, record removed).
    Abandon,
    /// Committed: an ordinary stopped (or since started) VM.
    Ordinary,
}

/// The destination's decision (pure): only the commit point (phase `committed`, written with
/// status `stopped`) makes the VM this host's.
pub(crate) fn destination_action(phase: Option<MigrationPhase>) -> DestinationAction {
    match phase {
        Some(MigrationPhase::Committed) => DestinationAction::Ordinary,
        _ => DestinationAction::Abandon,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn config() -> crate::config::Config {
        crate::validate::tests::config()
    }

    fn data(name: &str, format: DiskFormat) -> DataDiskSpec {
        DataDiskSpec {
            name: name.into(),
            size_gib: 1,
            format,
            preallocate: false,
            cache: Default::default(),
            aio: None,
            keep_on_destroy: false,
        }
    }

    fn image_spec() -> VmSpec {
        let mut spec = crate::validate::tests::spec("vm-1");
        spec.boot = BootSpec { image: Some("debian.qcow2".into()), ..Default::default() };
        spec.disks = vec![data("logs", DiskFormat::Raw), data("db", DiskFormat::Qcow2)];
        spec
    }

    #[test]
    fn only_a_stopped_vm_moves_or_a_running_one_told_to_stop() {
        assert_eq!(admit(VmStatus::Stopped, false, false), Ok(false));
        assert_eq!(admit(VmStatus::Stopped, false, true), Ok(false), "nothing to stop");
        assert_eq!(admit(VmStatus::Dead, false, false), Ok(false));
        assert_eq!(admit(VmStatus::Running, true, true), Ok(true));
        assert_eq!(admit(VmStatus::Running, true, false), Err(Refusal::Status(VmStatus::Running)));
        for s in [VmStatus::Failed, VmStatus::Creating, VmStatus::Migrating, VmStatus::Incoming, VmStatus::Stopping] {
            assert!(admit(s, false, true).is_err(), "{s:?}");
        }
        // A record saying stopped while a QEMU runs is not a stopped VM.
        assert!(admit(VmStatus::Stopped, true, true).is_err());
    }

    #[test]
    fn an_image_vm_sends_its_overlay_and_existing_disks_and_each_lands_where_a_create_puts_it() {
        let cfg = config();
        let spec = image_spec();
        let paths = VmPaths::for_vm(&cfg, "vm-1");
        let sizes: BTreeMap<PathBuf, u64> =
            [(paths.overlay.clone(), 7), (paths.data_disk(&spec.disks[0]), 9)].into_iter().collect();
        let files = source_files(&spec, &paths, None, |p| sizes.get(p).copied());
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["boot", "data:logs"], "db was never made: not sent");
        assert_eq!(files[0].hello, HelloDisk { device: "virtio0".into(), bytes: 7, format: "qcow2".into() });
        assert_eq!(files[1].hello.device, "data-logs");
        let hello: Vec<HelloDisk> = files.iter().map(|f| f.hello.clone()).collect();
        for f in &files {
            let p = placement(&spec, &paths, &hello, &f.name).unwrap();
            assert_eq!(p.target, f.path, "{}: the same place as on the source", f.name);
            assert_ne!(p.partial, p.target);
            assert!(received_paths(&spec, &paths).contains(&p.target));
            assert!(received_paths(&spec, &paths).contains(&p.partial));
        }
        assert_eq!(placement(&spec, &paths, &hello, "data:db").unwrap().target, paths.data_disk(&spec.disks[1]));
        for unknown in ["data:nope", "uefi-vars", "../etc/passwd", "data:../x", ""] {
            assert_eq!(placement(&spec, &paths, &hello, unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn a_boot_disk_vm_sends_its_root_disk_with_its_imported_size() {
        let cfg = config();
        let mut spec = image_spec();
        spec.boot = BootSpec { disk: Some("d.qcow2".into()), disk_gib: Some(4), ..Default::default() };
        spec.boot.firmware = crate::api::Firmware::Uefi;
        let paths = VmPaths::for_vm(&cfg, "vm-1");
        let root = paths.root_disk(DiskFormat::Raw);
        let present = [root.clone(), paths.uefi_vars()];
        let files = source_files(&spec, &paths, Some((DiskFormat::Raw, 1234)), |p| {
            present.contains(&p.to_path_buf()).then_some(5)
        });
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["boot", "uefi-vars"]);
        assert_eq!(files[0].hello, HelloDisk { device: "virtio0".into(), bytes: 1234, format: "raw".into() });
        let hello: Vec<HelloDisk> = files.iter().map(|f| f.hello.clone()).collect();
        assert_eq!(placement(&spec, &paths, &hello, BOOT).unwrap().target, root);
        assert_eq!(placement(&spec, &paths, &hello, UEFI_VARS).unwrap().target, paths.uefi_vars());
        let r = boot_disk_root(&spec.boot, &hello, Path::new("/imp")).unwrap();
        assert_eq!((r.format, r.imported_bytes, r.source), (DiskFormat::Raw, 1234, PathBuf::from("/imp/d.qcow2")));
        // A kernel-booted VM has no boot file at all.
        let mut kernel = image_spec();
        kernel.boot = BootSpec { kernel: Some("k".into()), ..Default::default() };
        let everything = |_: &Path| Some(1);
        assert!(source_files(&kernel, &paths, None, everything).iter().all(|f| f.name != BOOT));
        assert_eq!(placement(&kernel, &paths, &hello, BOOT), None);
    }

    #[test]
    fn the_state_alone_may_differ_between_the_admitted_spec_and_hello() {
        let a = image_spec();
        let mut b = a.clone();
        b.state = crate::api::DesiredState::Stopped;
        assert!(same_vm(&a, &b));
        b.memory_mib += 1;
        assert!(!same_vm(&a, &b));
    }

    #[test]
    fn the_destination_keeps_the_vm_only_from_the_commit_point() {
        assert_eq!(destination_action(Some(MigrationPhase::Committed)), DestinationAction::Ordinary);
        assert_eq!(destination_action(Some(MigrationPhase::Sending)), DestinationAction::Abandon);
        assert_eq!(destination_action(None), DestinationAction::Abandon);
    }
}
