//! Records written by vmhostd 0.1 (record version 1, before the transition table) load and
//! write back unchanged.
//!
//! `fixtures/state-v1/vms/` holds one record per kind of state the daemon of that release
//! leaves on disk: a running VM, a stopped one, a create interrupted while it made and took
//! back data disks and imported a root disk, a revert in progress, a VM holding passthrough
//! devices, one running an older spec than its record's, and a failed one. They were written
//! by that release's own `Store::save`; they are never regenerated (a record format change that
//! breaks them breaks every host's state directory).

use super::{DiskWork, Intent, Store, VmRecord, QEMU_RUNNING};
use crate::api::{DesiredState, DiskFormat, VmStatus};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/state/fixtures/state-v1")
}

/// Every fixture, loaded through [`Store::load_all`] from a copy of the state directory.
fn load() -> (tempfile::TempDir, Vec<VmRecord>) {
    let d = tempfile::tempdir().unwrap();
    let vms = d.path().join("vms");
    std::fs::create_dir(&vms).unwrap();
    for e in std::fs::read_dir(fixtures().join("vms")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), vms.join(e.file_name())).unwrap();
    }
    let (recs, broken) = Store::open(d.path()).unwrap().load_all().unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    (d, recs)
}

fn get<'a>(recs: &'a [VmRecord], name: &str) -> &'a VmRecord {
    recs.iter().find(|r| r.name() == name).unwrap_or_else(|| panic!("fixture {name} missing"))
}

#[test]
fn every_v1_record_loads_with_what_it_recorded() {
    let (_d, recs) = load();
    let names: Vec<&str> = recs.iter().map(VmRecord::name).collect();
    assert_eq!(
        names,
        ["create-interrupted", "failed", "lingering", "pending", "reverting", "running", "stopped", "vfio"]
    );

    let r = get(&recs, "running");
    assert_eq!(r.status, VmStatus::Running);
    assert_eq!(r.process.as_ref().map(|p| (p.pid, p.start_ticks)), Some((4242, 987_654)));
    assert_eq!(r.nics.len(), 1);
    assert_eq!(r.unclean_end.as_deref(), Some(QEMU_RUNNING));
    assert_eq!((r.restarts, r.failures.len()), (2, 1));

    let r = get(&recs, "stopped");
    assert_eq!((r.status, r.spec.state, r.process.is_none()), (VmStatus::Stopped, DesiredState::Stopped, true));
    assert!(r.overlay.is_some());

    let r = get(&recs, "create-interrupted");
    assert_eq!(r.status, VmStatus::Creating);
    let work = DiskWork { new: vec!["data".into()], reclaimed: vec!["kept".into()], importing_root: true };
    assert_eq!(r.intent, Some(Intent::Disks(work)));
    let root = r.root_disk.as_ref().unwrap();
    assert_eq!((root.format, root.imported_bytes, root.source_mode), (DiskFormat::Qcow2, 1 << 30, 0o640));

    let r = get(&recs, "reverting");
    assert_eq!((r.status, r.reverting()), (VmStatus::Stopped, Some("s1")));
    assert_eq!(r.intent, Some(Intent::Revert { snapshot: "s1".into(), root_import: false }));

    let r = get(&recs, "vfio");
    assert_eq!(r.vfio.len(), 1);
    assert_eq!(r.vfio[0].original_driver.as_deref(), Some("ixgbe"));
    assert_eq!(r.vfio[0].node_before.as_ref().map(|n| (n.group, n.mode)), Some((12, 0o600)));

    let r = get(&recs, "pending");
    assert_eq!(r.running_spec.as_ref().map(|s| s.memory_mib), Some(256));
    assert_eq!(r.spec.memory_mib, 512);

    // Two operations in progress as today's code could leave them: a revert, and a data disk a
    // hot-plug cut short tracked while its QEMU died. The revert is kept; the disk is the VM's
    // (its guest may have written it), as the next start would have made it.
    let r = get(&recs, "lingering");
    assert_eq!(
        (r.status, &r.intent),
        (VmStatus::Dead, &Some(Intent::Revert { snapshot: "s1".into(), root_import: false }))
    );
    assert!(r.running_spec.as_ref().is_some_and(|s| s.disks.len() == 1));
    assert_eq!(r.spec.disks.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), ["data", "extra"]);

    let r = get(&recs, "failed");
    assert_eq!((r.status, r.reserved), (VmStatus::Failed, false));
    assert_eq!(r.last_error.as_ref().map(|e| e.code), Some(4001));
}

/// What the code writes for a loaded record is byte for byte the file it read, and a save
/// through the store changes only `updated_at`; except `lingering`, whose leftover disk
/// tracking is dropped (its revert holds the record's one intent) and nothing else changes.
#[test]
fn every_v1_record_writes_back_unchanged() {
    let (d, recs) = load();
    let store = Store::open(d.path()).unwrap();
    for rec in recs {
        let file = fixtures().join("vms").join(format!("{}.json", rec.name()));
        let mut original = String::from_utf8(std::fs::read(&file).unwrap()).unwrap();
        if rec.name() == "lingering" {
            let tracking = "  \"new_disks\": [\n    \"extra\"\n  ],\n";
            assert!(original.contains(tracking), "{original}");
            original = original.replacen(tracking, "", 1);
        }
        assert_eq!(
            String::from_utf8(serde_json::to_vec_pretty(&rec).unwrap()).unwrap(),
            original,
            "{} does not write back as it was read",
            file.display()
        );
        let mut expected: serde_json::Value = serde_json::from_str(&original).unwrap();
        let mut saved = rec.clone();
        store.save(&mut saved).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join("vms").join(file.file_name().unwrap())).unwrap())
                .unwrap();
        expected["updated_at"] = written["updated_at"].clone();
        assert_eq!(written, expected, "{}", file.display());
    }
}
