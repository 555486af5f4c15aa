use super::*;

/// The bound the tests give each operation.
const T: std::time::Duration = std::time::Duration::from_secs(60);

fn tool() -> Tool {
    Tool { binary: "/usr/bin/qemu-system-x86_64".into(), user: None, pin: None }
}

fn open_rw(path: &std::path::Path) -> OwnedFd {
    OwnedFd::from(std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap())
}

/// Runs `qemu-io` command `io` on the qcow2 at `path` in a session (its output goes to QEMU's
/// stdout: [`first_bytes`] checks what it did).
async fn qemu_io(path: &std::path::Path, io: &str) {
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(path))], "test").await.unwrap();
    let node = s.open_qcow2(0).await.unwrap();
    s.execute("human-monitor-command", Some(json!({ "command-line": format!("qemu-io {node} \"{io}\"") })))
        .await
        .unwrap();
    s.finish().await.unwrap();
}

/// The first byte of each of the first 16 64 KiB blocks the qcow2 at `path` reads, copied out
/// into a raw file by QEMU.
async fn first_bytes(path: &std::path::Path) -> u8 {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.raw");
    let f = std::fs::File::create(&out).unwrap();
    f.set_len(64 << 20).unwrap();
    let layer = OwnedFd::from(std::fs::File::open(path).unwrap());
    let target = open_rw(&out);
    let mut s = Session::start(&tool(), vec![Input::Layer(layer), Input::Image(target)], "test").await.unwrap();
    let top = s.add_chain(&[(0, "qcow2")]).await.unwrap();
    s.backup(&top, 1, "raw", 64 << 20, std::time::Duration::from_secs(30)).await.unwrap();
    s.finish().await.unwrap();
    let bytes = std::fs::read(&out).unwrap();
    assert!(bytes[..64 << 10].iter().all(|b| *b == bytes[0]), "one pattern");
    bytes[0]
}

/// The persistent bitmaps of the qcow2 at `path`, sorted.
async fn bitmaps(path: &std::path::Path) -> Vec<String> {
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(path))], "test").await.unwrap();
    let node = s.open_qcow2(0).await.unwrap();
    let listed = s.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await.unwrap();
    s.finish().await.unwrap();
    let node = listed.as_array().unwrap().iter().find(|n| n["node-name"] == node.as_str()).unwrap().clone();
    let mut names: Vec<String> = node["dirty-bitmaps"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// Snapshot names of the qcow2 at `path`.
async fn names(path: &std::path::Path) -> Vec<String> {
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(path))], "test").await.unwrap();
    let node = s.open_qcow2(0).await.unwrap();
    let listed = s.execute("query-named-block-nodes", Some(json!({ "flat": true }))).await.unwrap();
    s.finish().await.unwrap();
    snapshot_names(&listed, &node)
}

/// A disk taken at A, written, taken at B, written again: a revert to A reads A's data, to B
/// B's; deleting A leaves B loadable; a missing tag is refused and deleting it is no error.
#[tokio::test]
async fn take_revert_and_delete_in_any_order() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("d.qcow2");
    std::fs::File::create(&disk).unwrap();
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(&disk))], "create").await.unwrap();
    s.create_qcow2(0, 64 << 20, None, false).await.unwrap();
    s.finish().await.unwrap();
    let write = |p: u8| format!("write -P {p} 0 64k");
    qemu_io(&disk, &write(0x11)).await;
    assert_eq!(first_bytes(&disk).await, 0x11);
    // An incremental backup's change tracking: a persistent bitmap, which a revert removes.
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(&disk))], "test").await.unwrap();
    let node = s.open_qcow2(0).await.unwrap();
    for name in ["vmhost-backup-1", "vmhost-backup-2"] {
        let add = json!({ "node": node, "name": name, "persistent": true });
        s.execute("block-dirty-bitmap-add", Some(add)).await.unwrap();
    }
    s.finish().await.unwrap();
    take(&tool(), vec![open_rw(&disk)], "vmhost-a-00000001", T).await.unwrap();
    qemu_io(&disk, &write(0x22)).await;
    take(&tool(), vec![open_rw(&disk)], "vmhost-b-00000002", T).await.unwrap();
    qemu_io(&disk, &write(0x33)).await;
    assert_eq!(first_bytes(&disk).await, 0x33);
    assert_eq!(names(&disk).await, ["vmhost-a-00000001", "vmhost-b-00000002"]);

    let aux = |n: &str| {
        let p = dir.path().join(n);
        OwnedFd::from(std::fs::File::options().read(true).write(true).create_new(true).open(p).unwrap())
    };
    assert_eq!(bitmaps(&disk).await, ["vmhost-backup-1", "vmhost-backup-2"], "a snapshot is taken with bitmaps");
    revert(&tool(), vec![open_rw(&disk)], aux("aux1"), "vmhost-a-00000001", T).await.unwrap();
    assert!(
        bitmaps(&disk).await.is_empty(),
        "vmhost's bitmaps removed (QEMU loads no snapshot into a disk with bitmaps)"
    );
    assert_eq!(first_bytes(&disk).await, 0x11);
    revert(&tool(), vec![open_rw(&disk)], aux("aux2"), "vmhost-b-00000002", T).await.unwrap();
    assert_eq!(first_bytes(&disk).await, 0x22);

    assert!(missing(&tool(), vec![open_rw(&disk)], "vmhost-a-00000001", T).await.unwrap().is_empty());
    delete(&tool(), vec![open_rw(&disk)], &["vmhost-a-00000001".to_string(), "vmhost-x-0".to_string()], T)
        .await
        .unwrap();
    assert_eq!(names(&disk).await, ["vmhost-b-00000002"]);
    revert(&tool(), vec![open_rw(&disk)], aux("aux3"), "vmhost-b-00000002", T).await.unwrap();
    assert_eq!(first_bytes(&disk).await, 0x22);
    assert!(revert(&tool(), vec![open_rw(&disk)], aux("aux4"), "vmhost-a-00000001", T).await.is_err());
    assert_eq!(missing(&tool(), vec![open_rw(&disk)], "vmhost-a-00000001", T).await.unwrap(), [0]);
}

/// The caller's bound is the operation's: one too short to start QEMU ends it with
/// [`DiskError::Timeout`] naming that bound (not a fixed one), the disk untouched.
#[tokio::test]
async fn each_step_is_bounded_by_the_callers_time() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("d.qcow2");
    std::fs::File::create(&disk).unwrap();
    let mut s = Session::start(&tool(), vec![Input::Image(open_rw(&disk))], "create").await.unwrap();
    s.create_qcow2(0, 64 << 20, None, false).await.unwrap();
    s.finish().await.unwrap();
    let short = std::time::Duration::from_millis(1);
    match take(&tool(), vec![open_rw(&disk)], "vmhost-a-00000001", short).await {
        Err(DiskError::Timeout { after, .. }) => assert_eq!(after, short),
        other => panic!("{other:?}"),
    }
    match delete(&tool(), vec![open_rw(&disk)], &["vmhost-a-00000001".to_string()], short).await {
        Err(DiskError::Timeout { after, .. }) => assert_eq!(after, short),
        other => panic!("{other:?}"),
    }
    assert!(names(&disk).await.is_empty());
    take(&tool(), vec![open_rw(&disk)], "vmhost-a-00000001", T).await.unwrap();
    assert_eq!(names(&disk).await, ["vmhost-a-00000001"]);
}

#[test]
fn actions_name_each_device_and_the_tag() {
    let a = take_actions(&["virtio0", "data-logs"], "vmhost-s-0a0b0c0d");
    assert_eq!(a.len(), 2);
    assert_eq!(a[1]["type"], "blockdev-snapshot-internal-sync");
    assert_eq!(a[1]["data"], json!({"device": "data-logs", "name": "vmhost-s-0a0b0c0d"}));
    let nodes = json!([{"node-name": "image0", "image": {"snapshots": [{"name": "t"}]},
                        "dirty-bitmaps": [{"name": "vmhost-backup-1"}, {"name": "other"}]}]);
    assert_eq!(snapshot_names(&nodes, "image0"), ["t"]);
    assert_eq!(vmhost_bitmaps(&nodes, "image0"), ["vmhost-backup-1"]);
    assert!(snapshot_names(&nodes, "image1").is_empty());
}
