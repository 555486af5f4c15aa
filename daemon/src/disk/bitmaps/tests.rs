use super::*;
use crate::disk::tests::tool;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

fn run(args: &[&str]) -> String {
    let out = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn rw(path: &Path) -> OwnedFd {
    OwnedFd::from(std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap())
}

fn ro(path: &Path) -> OwnedFd {
    OwnedFd::from(std::fs::File::open(path).unwrap())
}

fn empty(path: &Path) -> OwnedFd {
    OwnedFd::from(std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path).unwrap())
}

fn bitmaps_of(path: &Path) -> Vec<String> {
    let info: Value =
        serde_json::from_str(&run(&["/usr/bin/qemu-img", "info", "-U", "--output=json", path.to_str().unwrap()]))
            .unwrap();
    info.pointer("/format-specific/data/bitmaps")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| b["name"].as_str().map(str::to_string))
        .collect()
}

fn io(path: &Path, cmd: &str) {
    run(&["/usr/bin/qemu-io", "-f", "qcow2", "-c", cmd, path.to_str().unwrap()]);
}

fn disk(path: &Path, track: bool, target: &Path) -> OfflineDisk {
    OfflineDisk {
        layers: vec![(if track { rw(path) } else { ro(path) }, "qcow2".into())],
        track,
        target: empty(target),
        format: "qcow2",
        virtual_size: 64 << 20,
    }
}

/// A full backup leaves its bitmap; writes (data, and zeros over data) after it are all an
/// increment holds; the full copy with the increment over it reads as the disk; the parent's
/// bitmap then goes and the new one stays. QEMU runs as its user on descriptors only.
#[tokio::test]
async fn an_increment_over_its_full_copy_reads_as_the_disk() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let p = |n: &str| dir.path().join(n);
    run(&["/usr/bin/qemu-img", "create", "-q", "-f", "qcow2", p("vm.qcow2").to_str().unwrap(), "64M"]);
    io(&p("vm.qcow2"), "write -P 0x11 0 2M");
    io(&p("vm.qcow2"), "write -P 0x22 8M 1M");
    std::fs::set_permissions(p("vm.qcow2"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let within = Duration::from_secs(60);

    let found =
        export_offline(&tool(), vec![disk(&p("vm.qcow2"), true, &p("full.qcow2"))], "vmhost-backup-a", None, within)
            .await
            .unwrap();
    assert_eq!(found, [Tracking::Absent]);
    assert_eq!(bitmaps_of(&p("vm.qcow2")), ["vmhost-backup-a"]);
    run(&["/usr/bin/qemu-img", "compare", "-q", p("vm.qcow2").to_str().unwrap(), p("full.qcow2").to_str().unwrap()]);

    io(&p("vm.qcow2"), "write -P 0x33 1M 64k");
    io(&p("vm.qcow2"), "write -P 0 8M 64k");
    io(&p("vm.qcow2"), "write -z 8M 128k");
    let found = export_offline(
        &tool(),
        vec![disk(&p("vm.qcow2"), true, &p("inc.qcow2"))],
        "vmhost-backup-b",
        Some("vmhost-backup-a"),
        within,
    )
    .await
    .unwrap();
    assert_eq!(found, [Tracking::Tracked]);
    let inc = std::fs::metadata(p("inc.qcow2")).unwrap().len();
    assert!(inc < 2 << 20, "the increment holds only what changed: {inc} bytes");

    let restored = crate::disk::export::FlatDisk {
        layers: vec![(ro(&p("full.qcow2")), "qcow2".into()), (ro(&p("inc.qcow2")), "qcow2".into())],
        target: empty(&p("restored.qcow2")),
        format: "qcow2",
        virtual_size: 64 << 20,
    };
    crate::disk::export::flatten(&tool(), vec![restored], within).await.unwrap();
    run(&[
        "/usr/bin/qemu-img",
        "compare",
        "-q",
        p("vm.qcow2").to_str().unwrap(),
        p("restored.qcow2").to_str().unwrap(),
    ]);

    assert_eq!(bitmaps_of(&p("vm.qcow2")), ["vmhost-backup-a", "vmhost-backup-b"]);
    remove_offline(&tool(), vec![rw(&p("vm.qcow2"))], "vmhost-backup-b").await.unwrap();
    assert_eq!(bitmaps_of(&p("vm.qcow2")), ["vmhost-backup-b"]);
}

#[test]
fn a_bitmap_is_used_only_when_there_and_consistent() {
    let list = json!([{"name": "vmhost-backup-a", "count": 0, "granularity": 65536, "recording": true,
                       "busy": false, "persistent": true},
                      {"name": "vmhost-backup-b", "inconsistent": true, "persistent": true},
                      {"name": "theirs", "persistent": true}]);
    let b = parse(Some(&list));
    assert_eq!(tracking(&b, Some("vmhost-backup-a")), Tracking::Tracked);
    assert_eq!(tracking(&b, Some("vmhost-backup-b")), Tracking::Inconsistent);
    assert_eq!(tracking(&b, Some("vmhost-backup-c")), Tracking::Absent);
    assert_eq!(tracking(&b, None), Tracking::Absent);
    assert_eq!(stale(&b, "vmhost-backup-a"), ["vmhost-backup-b"], "only ours, never the kept one");
    assert!(parse(None).is_empty());
}

#[test]
fn an_incremental_copy_names_its_bitmap_and_leaves_it_as_it_is() {
    assert_eq!(
        backup_action("j", "virtio0", "t", Some("vmhost-backup-a")),
        json!({"type": "blockdev-backup", "data": {"job-id": "j", "device": "virtio0", "target": "t",
               "sync": "bitmap", "bitmap": "vmhost-backup-a", "bitmap-mode": "never"}})
    );
    assert_eq!(backup_action("j", "d", "t", None)["data"]["sync"], "full");
    assert_eq!(
        add_action("data-x", "vmhost-backup-b"),
        json!({"type": "block-dirty-bitmap-add", "data": {"node": "data-x", "name": "vmhost-backup-b", "persistent": true}})
    );
}
