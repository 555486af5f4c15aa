//! A record as it is on disk: exactly the layout vmhostd 0.1 writes (record version 1), field for
//! field in the same order with the same serde attributes, so every state directory loads and is
//! written back as it was.
//!
//! [`VmRecord`] is (de)serialised through [`RecordFile`] (`serde(from, into)`): loading converts
//! the loose operation logs into one [`Intent`], saving spreads it back over them. The one thing
//! that does not survive is a record naming both a revert and data disks tracked by an earlier
//! operation (`lingering` in the fixtures): the revert is kept and the disks are the VM's, as
//! the next start would have made them, so such a file is written back without `new_disks` and
//! `reclaimed_disks`.

use super::intent::{DiskWork, Intent};
use super::{RootDisk, VmRecord};
use crate::api::{LastError, VmSpec, VmStatus};
use crate::nic::NicAlloc;
use crate::process::ProcessIdentity;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// [`VmRecord`] on disk (see the fields there for what each means).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RecordFile {
    /// [`VmRecord::version`].
    version: u32,
    /// [`VmRecord::spec`].
    spec: VmSpec,
    /// [`VmRecord::status`].
    status: VmStatus,
    /// [`VmRecord::reserved`].
    reserved: bool,
    /// [`VmRecord::overlay`].
    overlay: Option<PathBuf>,
    /// [`VmRecord::process`].
    process: Option<ProcessIdentity>,
    /// [`VmRecord::created_at`].
    created_at: String,
    /// [`VmRecord::updated_at`].
    updated_at: String,
    /// [`VmRecord::started_at`].
    started_at: Option<String>,
    /// [`VmRecord::last_error`].
    last_error: Option<LastError>,
    /// [`VmRecord::nics`].
    #[serde(default)]
    nics: Vec<NicAlloc>,
    /// [`VmRecord::vfio`].
    #[serde(default)]
    vfio: Vec<crate::pci::bind::Binding>,
    /// [`VmRecord::running_spec`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    running_spec: Option<VmSpec>,
    /// [`VmRecord::restarts`].
    #[serde(default)]
    restarts: u32,
    /// [`VmRecord::failures`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    failures: Vec<u64>,
    /// [`VmRecord::last_exit`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    last_exit: Option<String>,
    /// [`DiskWork::new`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    new_disks: Vec<String>,
    /// [`DiskWork::reclaimed`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    reclaimed_disks: Vec<String>,
    /// [`VmRecord::root_disk`], with [`DiskWork::importing_root`] in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    root_disk: Option<RootDiskFile>,
    /// [`Intent::Revert`]'s snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reverting: Option<String>,
    /// [`VmRecord::instance_id`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    instance_id: Option<String>,
    /// [`VmRecord::unclean_end`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    unclean_end: Option<String>,
    /// [`VmRecord::placement`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    placement: Option<crate::placement::Placement>,
    /// [`VmRecord::migration`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    migration: Option<super::migration::MigrationRecord>,
    /// [`VmRecord::tpm_process`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tpm_process: Option<ProcessIdentity>,
}

/// [`RootDisk`] on disk, where the import in progress is its `importing`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RootDiskFile {
    /// [`RootDisk::format`].
    format: crate::api::DiskFormat,
    /// [`RootDisk::imported_bytes`].
    imported_bytes: u64,
    /// [`RootDisk::source`].
    source: PathBuf,
    /// [`RootDisk::source_mode`].
    source_mode: u32,
    /// [`VmRecord::importing_root`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    importing: bool,
}

impl From<RecordFile> for VmRecord {
    fn from(f: RecordFile) -> VmRecord {
        let importing = f.root_disk.as_ref().is_some_and(|r| r.importing);
        let intent = match f.reverting {
            Some(snapshot) => {
                if !f.new_disks.is_empty() || !f.reclaimed_disks.is_empty() {
                    tracing::info!(
                        vm = %f.spec.name,
                        new = ?f.new_disks,
                        reclaimed = ?f.reclaimed_disks,
                        "a record with an unfinished revert still tracks data disks of an earlier operation: they are the VM's"
                    );
                }
                Some(Intent::Revert { snapshot, root_import: importing })
            }
            None if importing || !f.new_disks.is_empty() || !f.reclaimed_disks.is_empty() => {
                Some(Intent::Disks(DiskWork {
                    new: f.new_disks,
                    reclaimed: f.reclaimed_disks,
                    importing_root: importing,
                }))
            }
            None => None,
        };
        let root_disk = f.root_disk.map(|r| RootDisk {
            format: r.format,
            imported_bytes: r.imported_bytes,
            source: r.source,
            source_mode: r.source_mode,
        });
        VmRecord {
            version: f.version,
            spec: f.spec,
            status: f.status,
            reserved: f.reserved,
            overlay: f.overlay,
            process: f.process,
            created_at: f.created_at,
            updated_at: f.updated_at,
            started_at: f.started_at,
            last_error: f.last_error,
            nics: f.nics,
            vfio: f.vfio,
            running_spec: f.running_spec,
            restarts: f.restarts,
            failures: f.failures,
            last_exit: f.last_exit,
            root_disk,
            intent,
            instance_id: f.instance_id,
            unclean_end: f.unclean_end,
            placement: f.placement,
            migration: f.migration,
            tpm_process: f.tpm_process,
        }
    }
}

impl From<VmRecord> for RecordFile {
    fn from(r: VmRecord) -> RecordFile {
        let importing = r.importing_root();
        let (work, reverting) = match r.intent {
            Some(Intent::Disks(w)) => (w, None),
            Some(Intent::Revert { snapshot, .. }) => (DiskWork::default(), Some(snapshot)),
            None => (DiskWork::default(), None),
        };
        let root_disk = r.root_disk.map(|d| RootDiskFile {
            format: d.format,
            imported_bytes: d.imported_bytes,
            source: d.source,
            source_mode: d.source_mode,
            importing,
        });
        RecordFile {
            version: r.version,
            spec: r.spec,
            status: r.status,
            reserved: r.reserved,
            overlay: r.overlay,
            process: r.process,
            created_at: r.created_at,
            updated_at: r.updated_at,
            started_at: r.started_at,
            last_error: r.last_error,
            nics: r.nics,
            vfio: r.vfio,
            running_spec: r.running_spec,
            restarts: r.restarts,
            failures: r.failures,
            last_exit: r.last_exit,
            new_disks: work.new,
            reclaimed_disks: work.reclaimed,
            root_disk,
            reverting,
            instance_id: r.instance_id,
            unclean_end: r.unclean_end,
            placement: r.placement,
            migration: r.migration,
            tpm_process: r.tpm_process,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::tests::spec;

    fn root() -> RootDisk {
        RootDisk {
            format: crate::api::DiskFormat::Raw,
            imported_bytes: 1 << 30,
            source: "/var/lib/vmhost/import/d.raw".into(),
            source_mode: 0o600,
        }
    }

    fn reread(r: &VmRecord) -> (VmRecord, serde_json::Value) {
        let text = serde_json::to_string_pretty(r).unwrap();
        (serde_json::from_str(&text).unwrap(), serde_json::from_str(&text).unwrap())
    }

    /// Every shape an intent can take is written as today's fields and read back as itself.
    #[test]
    fn every_intent_reads_back_as_it_was_written() {
        let work = |new: &[&str], reclaimed: &[&str], importing_root| {
            let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
            Some(Intent::Disks(DiskWork { new: owned(new), reclaimed: owned(reclaimed), importing_root }))
        };
        let revert = |root_import| Some(Intent::Revert { snapshot: "s1".into(), root_import });
        let shapes = [
            (None, false, serde_json::json!({})),
            (None, true, serde_json::json!({ "root": false })),
            (work(&["a", "b"], &[], false), false, serde_json::json!({ "new_disks": ["a", "b"] })),
            (work(&[], &["k"], false), false, serde_json::json!({ "reclaimed_disks": ["k"] })),
            (work(&[], &[], true), true, serde_json::json!({ "root": true })),
            (
                work(&["a"], &["k"], true),
                true,
                serde_json::json!({ "new_disks": ["a"], "reclaimed_disks": ["k"], "root": true }),
            ),
            (revert(false), false, serde_json::json!({ "reverting": "s1" })),
            (revert(false), true, serde_json::json!({ "reverting": "s1", "root": false })),
            (revert(true), true, serde_json::json!({ "reverting": "s1", "root": true })),
        ];
        for (intent, with_root, expected) in shapes {
            let mut r = VmRecord::new(spec("v"));
            r.root_disk = with_root.then(root);
            r.intent = intent;
            let (back, json) = reread(&r);
            assert_eq!(back, r);
            let keys = ["new_disks", "reclaimed_disks", "reverting"];
            for key in keys {
                assert_eq!(json.get(key), expected.get(key), "{key} of {:?}", r.intent);
            }
            let importing = json.get("root_disk").map(|d| d.get("importing").is_some_and(|i| i == true));
            assert_eq!(importing, expected.get("root").and_then(serde_json::Value::as_bool), "{:?}", r.intent);
        }
    }

    /// A placement is kept while the QEMU runs and left out when there is none, so a record
    /// without one is written as before.
    #[test]
    fn a_placement_is_recorded_and_left_out_when_none() {
        let r = VmRecord::new(spec("v"));
        assert_eq!(reread(&r).1.get("placement"), None);
        let mut placed = r.clone();
        placed.placement = Some(crate::placement::Placement {
            policy: crate::api::CpuPolicy::Dedicated,
            vcpus: vec![2, 3],
            cpus: crate::placement::CpuSet::parse("2-4").unwrap(),
            emulator: crate::placement::CpuSet::parse("4").unwrap(),
            nodes: vec![1],
            hugepages: Some(crate::api::HugePageSize::M2),
            hugepages_per_node: [(1, 128)].into(),
            memory_mib: 256,
        });
        let (back, json) = reread(&placed);
        assert_eq!(back, placed);
        assert_eq!(
            json["placement"],
            serde_json::json!({"policy": "dedicated", "vcpus": [2, 3], "cpus": "2-4", "emulator": "4",
                "nodes": [1], "hugepages": "2M", "hugepages_per_node": {"1": 128}, "memory_mib": 256})
        );
    }

    /// A revert recorded with data disks an earlier operation left tracked (today's code could
    /// write that): the revert stays, with an unfinished import; the disks are the VM's.
    #[test]
    fn a_revert_over_leftover_disk_tracking_keeps_the_revert_only() {
        let mut json = serde_json::to_value(VmRecord::new(spec("v"))).unwrap();
        json["new_disks"] = serde_json::json!(["extra"]);
        json["reclaimed_disks"] = serde_json::json!(["kept"]);
        json["reverting"] = serde_json::json!("s1");
        json["root_disk"] = serde_json::to_value(RecordFile::from({
            let mut r = VmRecord::new(spec("v"));
            r.start_root_import(root()).unwrap();
            r
        }))
        .unwrap()["root_disk"]
            .clone();
        let r: VmRecord = serde_json::from_value(json).unwrap();
        assert_eq!(r.intent, Some(Intent::Revert { snapshot: "s1".into(), root_import: true }));
        let again = serde_json::to_value(&r).unwrap();
        assert_eq!((again.get("new_disks"), again.get("reclaimed_disks")), (None, None));
        assert_eq!((&again["reverting"], &again["root_disk"]["importing"]), (&serde_json::json!("s1"), &true.into()));
    }
}
