use super::*;
use crate::disk::tests::tool;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

const QEMU_IMG: &str = "/usr/bin/qemu-img";

fn run(args: &[&str]) {
    let out = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
}

fn ro(path: &Path) -> OwnedFd {
    OwnedFd::from(std::fs::File::open(path).unwrap())
}

fn empty_target(path: &Path, len: u64) -> OwnedFd {
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path).unwrap();
    f.set_len(len).unwrap();
    OwnedFd::from(f)
}

/// A root-only directory with a raw base (a pattern in its first MiB), a qcow2 overlay over it
/// that overwrites 64 KiB at 512 KiB, and a sparse raw data disk of 64 MiB with 4 KiB written
/// at 32 MiB; all 0600.
fn disks() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let base: Vec<u8> = (0..(8u32 << 20)).map(|i| if i < (1 << 20) { (i % 251) as u8 + 1 } else { 0 }).collect();
    std::fs::write(p("base.raw"), base).unwrap();
    run(&[QEMU_IMG, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", &p("base.raw"), &p("vm.qcow2")]);
    run(&["/usr/bin/qemu-io", "-f", "qcow2", "-c", "write -P 0xab 512k 64k", &p("vm.qcow2")]);
    run(&[QEMU_IMG, "create", "-q", "-f", "raw", &p("data.raw"), "64M"]);
    run(&["/usr/bin/qemu-io", "-f", "raw", "-c", "write -P 0xcd 32M 4k", &p("data.raw")]);
    for f in ["base.raw", "vm.qcow2", "data.raw"] {
        std::fs::set_permissions(p(f), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    dir
}

#[tokio::test]
async fn a_stopped_vms_overlay_and_data_disk_are_copied_flat_by_qemu_as_its_user() {
    let dir = disks();
    let p = |n: &str| dir.path().join(n);
    let overlay = FlatDisk {
        layers: vec![(ro(&p("base.raw")), "raw".into()), (ro(&p("vm.qcow2")), "qcow2".into())],
        target: empty_target(&p("root.qcow2"), 0),
        format: "qcow2",
        virtual_size: 8 << 20,
    };
    let data = FlatDisk {
        layers: vec![(ro(&p("data.raw")), "raw".into())],
        target: empty_target(&p("data-copy.raw"), 64 << 20),
        format: "raw",
        virtual_size: 64 << 20,
    };
    flatten(&tool(), vec![overlay, data], Duration::from_secs(60)).await.unwrap();

    // The flat root reads as the overlay over its base, and names no backing file.
    run(&[QEMU_IMG, "compare", "-q", p("vm.qcow2").to_str().unwrap(), p("root.qcow2").to_str().unwrap()]);
    let info =
        std::process::Command::new(QEMU_IMG).args(["info", "--output=json"]).arg(p("root.qcow2")).output().unwrap();
    let info: Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!((info["format"].as_str(), info.get("backing-filename")), (Some("qcow2"), None), "{info}");
    // The data disk is equal, and sparse once sealed; the seal is its sha256.
    let data = std::fs::read(p("data.raw")).unwrap();
    assert_eq!(data, std::fs::read(p("data-copy.raw")).unwrap());
    let copy = std::fs::OpenOptions::new().read(true).write(true).open(p("data-copy.raw")).unwrap();
    let sha = seal(&copy, true).unwrap();
    assert_eq!(sha, crate::qemu::integrity::sha256_of(&mut &data[..]).unwrap());
    assert_eq!(data, std::fs::read(p("data-copy.raw")).unwrap(), "holes read as the zeros they were");
    let meta = std::fs::metadata(p("data-copy.raw")).unwrap();
    assert!(meta.blocks() * 512 < 2 << 20, "{} blocks: zeros became holes", meta.blocks());
}

#[tokio::test]
async fn a_layer_qemu_cannot_read_fails_the_copy() {
    let dir = disks();
    let p = |n: &str| dir.path().join(n);
    let bad = FlatDisk {
        layers: vec![(ro(&p("data.raw")), "qcow2".into())],
        target: empty_target(&p("t.qcow2"), 0),
        format: "qcow2",
        virtual_size: 64 << 20,
    };
    let e = flatten(&tool(), vec![bad], Duration::from_secs(60)).await.unwrap_err();
    assert!(matches!(e, DiskError::Tool { .. }), "{e:?}");
}

#[test]
fn one_transaction_starts_every_copy() {
    let t = transaction(7, &[("virtio0", "top"), ("data-nsm", "full")]);
    assert_eq!(
        t,
        json!({"actions": [
            {"type": "blockdev-backup", "data": {"job-id": "vmhost-copy7-job0", "device": "virtio0",
             "target": "vmhost-copy7-0", "sync": "top"}},
            {"type": "blockdev-backup", "data": {"job-id": "vmhost-copy7-job1", "device": "data-nsm",
             "target": "vmhost-copy7-1", "sync": "full"}}
        ]})
    );
}
