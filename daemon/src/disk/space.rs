//! Disk-space admission: may a change provision these new disk bytes on the state file system?
//!
//! Disks are counted at their full size (a sparse overlay or data disk can fill up to it), so a
//! host never promises more than it has (times `storage.overcommit`). Pure functions of (specs,
//! free space, config), used in this order by the lifecycle, right before anything is made:
//!
//! 1. [`new_provision`] says what a create (no old spec), a change in place or a replace adds;
//! 2. [`FsSpace::of`] reads the state file system's size and free space (`statvfs`);
//! 3. [`admit`] refuses (3002) what does not fit: all new bytes against the free space times
//!    the overcommit ratio, and the preallocated ones against the free space less a 10 % margin
//!    (as Security Onion keeps for its preallocated NSM volumes), whatever the ratio.
//!
//! A create's check is not a reservation (its sparse disks fill up over months, not now), but it
//! counts what running imports, snapshots and exports hold ([`super::reserve`]): those reserve
//! what they will write ([`reserve_copy_room`]), so two of them at once cannot both be admitted
//! against the same free space. Anything else writing to the file system still changes it; a
//! write that finds it full fails cleanly (4001), and the operation is undone.

use std::path::{Path, PathBuf};

pub use super::reserve::FsSpace;
use super::reserve::{Ledger, Refused, Reservation, Shortfall};
use super::GIB;
use crate::api::VmSpec;

/// Why new bytes may not go on a file system. The API codes are given at the boundary
/// (`crate::owner_errors`): 4001 for [`SpaceError::Unreadable`], 3002 for the others.
#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    /// The free space of `dir` could not be read.
    #[error("cannot read the free space of {}: {source}", .dir.display())]
    Unreadable {
        /// The directory asked about.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A reservation for `what` does not fit in `dir`'s file system.
    #[error(
        "{what} would take {} bytes; {} has {} free, of which at most {} may be taken ({} held by \
         other imports, snapshots and exports)",
        .refused.requested,
        .dir.display(),
        .refused.free,
        .refused.available,
        .refused.reserved
    )]
    NoRoom {
        /// What wanted the room (`the copies`, `the download`, a file name).
        what: String,
        /// The directory.
        dir: PathBuf,
        /// The request field the room is for.
        field: String,
        /// The resource as `details.resource` names it (`disk_bytes`, `image_bytes`).
        resource: &'static str,
        /// The ledger's answer.
        refused: Refused,
    },
    /// New disks do not fit on the state file system.
    #[error("{requested_gib} GiB of new disks {why}: {available_gib} GiB available on the state file system")]
    Disks {
        /// GiB asked for (rounded up).
        requested_gib: u64,
        /// GiB they may take (rounded down).
        available_gib: u64,
        /// Which rule refused them.
        why: &'static str,
        /// The file system's free bytes.
        free_bytes: u64,
        /// Its size in bytes.
        total_bytes: u64,
        /// Whether data disks are part of the request (then `spec.disks` is at fault, else
        /// `spec.boot.disk_gib`).
        data_disks: bool,
    },
}

/// Share of the free space preallocated disks may take, in percent.
pub const PREALLOCATE_PERCENT: u64 = 90;

/// Disk bytes a spec provisions, or a change adds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Provision {
    /// Every byte at full size (boot overlay and data disks).
    pub bytes: u64,
    /// The part that is preallocated (allocated at creation).
    pub preallocated: u64,
    /// Whether data disks are part of it (for the field an error names).
    pub data_disks: bool,
}

/// Reserves room for copies of `files` (the bytes they hold: their allocated blocks, not their
/// holes) in `dir`'s file system, with [`PREALLOCATE_PERCENT`] of its free space the most
/// they may take together with what other operations hold there ([`super::reserve`]): a
/// snapshot, an export, a revert, the disks of a backup imported. The copies are made while
/// the returned reservation lives.
///
/// # Errors
/// [`SpaceError::NoRoom`] naming `field`, `resource: disk_bytes`; [`SpaceError::Unreadable`]
/// when the free space cannot be read.
pub fn reserve_copy_room(ledger: &Ledger, dir: &Path, files: &[&Path], field: &str) -> Result<Reservation, SpaceError> {
    use std::os::unix::fs::MetadataExt;
    // stat of each file, off the runtime's worker as the check it replaced ran (the ledger's
    // free-space read is too).
    let needed: u64 = crate::blocking::run(|| {
        files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.blocks().saturating_mul(512)).sum()
    });
    reserve_bytes(ledger, dir, needed, field)
}

/// Reserves `bytes` for copies in `dir`'s file system, as [`reserve_copy_room`] does for the
/// bytes files hold (for copies that take more than that, e.g. a file copied whole).
///
/// # Errors
/// As [`reserve_copy_room`].
pub fn reserve_bytes(ledger: &Ledger, dir: &Path, bytes: u64, field: &str) -> Result<Reservation, SpaceError> {
    ledger.reserve(dir, bytes, PREALLOCATE_PERCENT).map_err(|e| refusal(e, dir, "the copies", field, "disk_bytes"))
}

/// The error of a reservation `what` could not get in `dir`: [`SpaceError::NoRoom`] naming
/// `field` with `resource`, or [`SpaceError::Unreadable`] when the free space could not be read.
pub fn refusal(short: Shortfall, dir: &Path, what: &str, field: &str, resource: &'static str) -> SpaceError {
    match short {
        Shortfall::Io(source) => SpaceError::Unreadable { dir: dir.to_path_buf(), source },
        Shortfall::Refused(refused) => SpaceError::NoRoom {
            what: what.to_string(),
            dir: dir.to_path_buf(),
            field: field.to_string(),
            resource,
            refused,
        },
    }
}

/// Every disk byte `spec` provisions at full size, but an imported root disk's (`boot.disk`: its
/// size is in the VM's record, not the spec).
pub fn provisioned(spec: &VmSpec) -> u64 {
    new_provision(None, spec).bytes
}

/// What turning `old` (none for a create) into `new` adds: a larger or new overlay, larger or
/// new data disks. Shrinking or dropping frees nothing here (a dropped disk may be kept).
///
/// An imported root disk (`boot.disk`) is on the file system already: a create counts none of
/// it here (what it grows by is admitted at import, once its size is known), a change what its
/// `disk_gib` grows by (all of a first `disk_gib`: the spec does not know the file's size).
pub fn new_provision(old: Option<&VmSpec>, new: &VmSpec) -> Provision {
    let gib = |g: u64| g.saturating_mul(GIB);
    let old_overlay = old.and_then(|o| o.boot.disk_gib).unwrap_or(0);
    let boot = match old {
        None if new.boot.disk.is_some() => 0,
        _ => gib(new.boot.disk_gib.unwrap_or(0).saturating_sub(old_overlay)),
    };
    let mut p = Provision { bytes: boot, ..Provision::default() };
    for disk in &new.disks {
        let before = old
            .and_then(|o| o.disks.iter().find(|d| d.name == disk.name && d.format == disk.format))
            .map_or(0, |d| d.size_gib);
        let added = gib(disk.size_gib.saturating_sub(before));
        if added == 0 {
            continue;
        }
        p.bytes = p.bytes.saturating_add(added);
        p.data_disks = true;
        if disk.preallocate {
            p.preallocated = p.preallocated.saturating_add(added);
        }
    }
    p
}

/// Whether `request` fits in `space` with `overcommit_percent`.
///
/// # Errors
/// [`SpaceError::Disks`] (3002, `resource: "disk_gib"`) with the requested and available GiB,
/// naming `spec.disks` (or `spec.boot.disk_gib` when only the overlay grows).
pub fn admit(request: Provision, space: FsSpace, overcommit_percent: u64) -> Result<(), SpaceError> {
    let share = |percent: u64| (u128::from(space.free) * u128::from(percent) / 100).min(u128::from(u64::MAX)) as u64;
    let refuse = |requested: u64, available: u64, why: &'static str| {
        Err(SpaceError::Disks {
            requested_gib: requested.div_ceil(GIB),
            available_gib: available / GIB,
            why,
            free_bytes: space.free,
            total_bytes: space.total,
            data_disks: request.data_disks,
        })
    };
    let allowed = share(overcommit_percent);
    if request.bytes > allowed {
        return refuse(request.bytes, allowed, "do not fit");
    }
    let prealloc_allowed = share(PREALLOCATE_PERCENT);
    if request.preallocated > prealloc_allowed {
        return refuse(request.preallocated, prealloc_allowed, "preallocated would leave less than 10 % free");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ApiError, BootSpec, Code, DataDiskSpec, DiskCache, DiskFormat};

    /// Admission as a client sees it: through the boundary's mapping.
    fn admit(request: Provision, space: FsSpace, overcommit_percent: u64) -> Result<(), ApiError> {
        super::admit(request, space, overcommit_percent).map_err(ApiError::from)
    }

    fn spec(overlay: Option<u64>, disks: &[(&str, u64, bool)]) -> VmSpec {
        let mut s = crate::validate::tests::spec("v");
        if let Some(g) = overlay {
            s.boot = BootSpec { image: Some("b".into()), disk_gib: Some(g), ..BootSpec::default() };
        }
        s.disks = disks
            .iter()
            .map(|(n, g, pre)| DataDiskSpec {
                name: (*n).into(),
                size_gib: *g,
                format: DiskFormat::Raw,
                preallocate: *pre,
                cache: DiskCache::None,
                aio: None,
                keep_on_destroy: false,
                snapshot: true,
            })
            .collect();
        s
    }

    #[test]
    fn a_create_counts_everything_and_a_change_only_what_grows_or_comes() {
        let a = spec(Some(10), &[("nsm", 100, true), ("logs", 5, false)]);
        assert_eq!(new_provision(None, &a), Provision { bytes: 115 * GIB, preallocated: 100 * GIB, data_disks: true });
        assert_eq!(provisioned(&a), 115 * GIB);
        let grown = spec(Some(12), &[("nsm", 150, true), ("logs", 5, false), ("x", 1, false)]);
        assert_eq!(
            new_provision(Some(&a), &grown),
            Provision { bytes: (2 + 50 + 1) * GIB, preallocated: 50 * GIB, data_disks: true }
        );
        let overlay_only = spec(Some(20), &[("nsm", 100, true), ("logs", 5, false)]);
        assert_eq!(new_provision(Some(&a), &overlay_only), Provision { bytes: 10 * GIB, ..Provision::default() });
        let dropped = spec(Some(10), &[("nsm", 100, true)]);
        assert_eq!(new_provision(Some(&a), &dropped), Provision::default());
        assert_eq!(new_provision(Some(&a), &a), Provision::default());
    }

    #[test]
    fn an_imported_root_disk_costs_nothing_at_create_and_its_growth_after() {
        let mut a = spec(None, &[("nsm", 10, false)]);
        a.boot = BootSpec { disk: Some("old.qcow2".into()), disk_gib: Some(40), ..BootSpec::default() };
        assert_eq!(new_provision(None, &a), Provision { bytes: 10 * GIB, preallocated: 0, data_disks: true });
        let mut grown = a.clone();
        grown.boot.disk_gib = Some(50);
        assert_eq!(new_provision(Some(&a), &grown), Provision { bytes: 10 * GIB, ..Provision::default() });
    }

    #[test]
    fn admission_refuses_what_exceeds_free_space_times_overcommit_and_the_preallocation_margin() {
        let space = FsSpace { total: 1000 * GIB, free: 100 * GIB };
        let sparse = |g: u64| Provision { bytes: g * GIB, preallocated: 0, data_disks: true };
        assert!(admit(sparse(100), space, 100).is_ok());
        let e = admit(sparse(101), space, 100).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::CapacityExceeded, Some("spec.disks")));
        assert_eq!((e.details["resource"].as_str(), e.details["requested"].as_u64()), (Some("disk_gib"), Some(101)));
        assert_eq!(e.details["available"], 100);
        assert!(admit(sparse(250), space, 250).is_ok(), "overcommit 2.5");
        assert!(admit(sparse(251), space, 250).is_err());
        let pre = |g: u64| Provision { bytes: g * GIB, preallocated: g * GIB, data_disks: true };
        assert!(admit(pre(90), space, 1000).is_ok());
        let e = admit(pre(91), space, 1000).unwrap_err();
        assert_eq!(e.details["available"], 90, "a 10 % margin whatever the overcommit: {e:?}");
        let overlay = Provision { bytes: 101 * GIB, preallocated: 0, data_disks: false };
        assert_eq!(admit(overlay, space, 100).unwrap_err().field.as_deref(), Some("spec.boot.disk_gib"));
        assert!(admit(Provision::default(), FsSpace { total: 0, free: 0 }, 100).is_ok(), "nothing new always fits");
    }
}
