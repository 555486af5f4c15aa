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

use std::path::Path;

use serde_json::json;

pub use super::reserve::FsSpace;
use super::reserve::{Ledger, Reservation, Shortfall};
use super::GIB;
use crate::api::{ApiError, Code, VmSpec};

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
/// 3002 naming `field`, `resource: disk_bytes`; 4001 when the free space cannot be read.
pub fn reserve_copy_room(ledger: &Ledger, dir: &Path, files: &[&Path], field: &str) -> Result<Reservation, ApiError> {
    use std::os::unix::fs::MetadataExt;
    // stat of each file, off the runtime's worker as the check it replaced ran (the ledger's
    // free-space read is too).
    let needed: u64 = crate::blocking::run(|| {
        files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.blocks().saturating_mul(512)).sum()
    });
    ledger.reserve(dir, needed, PREALLOCATE_PERCENT).map_err(|e| refusal(e, dir, "the copies", field, "disk_bytes"))
}

/// The error of a reservation `what` could not get in `dir`: 3002 naming `field` with
/// `resource`, the bytes requested and available and what others hold (`reserved`), or 4001
/// when the free space could not be read.
pub fn refusal(short: Shortfall, dir: &Path, what: &str, field: &str, resource: &str) -> ApiError {
    match short {
        Shortfall::Io(e) => {
            ApiError::new(Code::ProvisioningFailed, format!("cannot read the free space of {}: {e}", dir.display()))
        }
        Shortfall::Refused(r) => ApiError::new(
            Code::CapacityExceeded,
            format!(
                "{what} would take {} bytes; {} has {} free, of which at most {} may be taken ({} held by \
                 other imports, snapshots and exports)",
                r.requested,
                dir.display(),
                r.free,
                r.available,
                r.reserved
            ),
        )
        .field(field)
        .details(json!({
            "resource": resource,
            "requested": r.requested,
            "available": r.available,
            "reserved": r.reserved,
        })),
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
/// 3002 with `resource: "disk_gib"`, the requested and available GiB, naming `spec.disks` (or
/// `spec.boot.disk_gib` when only the overlay grows).
pub fn admit(request: Provision, space: FsSpace, overcommit_percent: u64) -> Result<(), ApiError> {
    let share = |percent: u64| (u128::from(space.free) * u128::from(percent) / 100).min(u128::from(u64::MAX)) as u64;
    let field = if request.data_disks { "spec.disks" } else { "spec.boot.disk_gib" };
    let refuse = |requested: u64, available: u64, why: &str| {
        let (req_gib, avail_gib) = (requested.div_ceil(GIB), available / GIB);
        Err(ApiError::new(
            Code::CapacityExceeded,
            format!("{req_gib} GiB of new disks {why}: {avail_gib} GiB available on the state file system"),
        )
        .field(field)
        .details(json!({
            "resource": "disk_gib",
            "requested": req_gib,
            "available": avail_gib,
            "free_bytes": space.free,
            "total_bytes": space.total,
        })))
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
    use crate::api::{BootSpec, DataDiskSpec, DiskCache, DiskFormat};

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
