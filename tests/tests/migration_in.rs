//! The destination of a live migration given up, end to end: a real vmhostd with a migration
//! port (short `prepare_timeout_s`), `vm.migrate_in` through its socket, and either no source
//! at all or a source played by this test through the migration port's own library (the
//! authenticated wire and control frames) that says `Hello`, waits for `Ready` and aborts.
//! Everything the destination made (record, QEMU, data disk, a `boot.disk` VM's root disk, run
//! dir) must go, and a tombstone
//! must stay that answers the source's later `Query` with `abandoned`. The whole migration with
//! two daemons is tests/tests/migration.rs.

use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;
use vmhost::migration::{connect, ChannelKind, Control, ControlMsg, Hello, HelloDisk, Outcome, Secret};
use vmhost_tests::{HostOptions, TestHost};

/// Longer than the test config's `prepare_timeout_s` plus the abandon itself.
const ABANDON: Duration = Duration::from_secs(60);

/// A loopback port nothing listens on now (the daemon binds it next).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A host with a migration port on loopback that waits `prepare_s` seconds for a source.
fn host(prepare_s: u64) -> (TestHost, String) {
    let port = free_port();
    let extra = format!("[migration]\nlisten = \"127.0.0.1:{port}\"\nprepare_timeout_s = {prepare_s}\n");
    (TestHost::start(HostOptions { extra, ..Default::default() }), format!("127.0.0.1:{port}"))
}

/// Waits until VM `name` has no record any more.
fn wait_gone(host: &TestHost, name: &str) {
    host.wait_vm(name, "gone", ABANDON, |v| v.get("vm.get error").is_some());
    let (code, _) = host.call_err("vm.get", json!({ "name": name }));
    assert_eq!(code, 4040);
}

/// The files left under `dir` (none when it does not exist).
fn files_under(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.flatten().map(|e| e.path().display().to_string()).collect()
}

/// The tombstones of `name` (`STATE/migrations/NAME.TAG.json`), as JSON.
fn tombstones(host: &TestHost, name: &str) -> Vec<(String, Value)> {
    let Ok(entries) = std::fs::read_dir(host.state().join("migrations")) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let tag = file.strip_prefix(&format!("{name}."))?.strip_suffix(".json")?;
            (!tag.contains('.')).then_some(())?;
            Some((file, serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok()?))
        })
        .collect()
}

/// The tombstone of `name`'s migration with `secret`, checked: outcome abandoned, the secret
/// inside and not in the file's name.
fn check_tombstone(host: &TestHost, name: &str, secret: &str) {
    let all = tombstones(host, name);
    let (file, stone) = all
        .iter()
        .find(|(_, stone)| stone["secret"] == secret)
        .unwrap_or_else(|| panic!("no tombstone of {name} with its secret: {all:?}"));
    assert_eq!(stone["outcome"], "abandoned");
    assert!(!file.contains(&secret[..16]), "the secret is in the file name {file}");
}

/// Asks the destination at `address` what became of `name`'s migration, as a source that
/// lost its control channel does.
async fn query(address: &str, name: &str, secret: &Secret) -> Outcome {
    let stream = connect(address, name, secret, &ChannelKind::Control).await.unwrap();
    let mut c = Control::new(stream, secret);
    c.send(&ControlMsg::Query).await.unwrap();
    match c.recv(Duration::from_secs(10)).await.unwrap() {
        ControlMsg::Outcome { outcome } => outcome,
        other => panic!("answer to a query: {other:?}"),
    }
}

/// Plays the source up to its `Hello` for `spec` (each data disk 1 GiB raw): the control
/// channel, authenticated with `secret`.
async fn send_hello(address: &str, secret: &Secret, spec: &vmhost::api::VmSpec) -> Control {
    let disks = vmhost::qemu::migration::disks_of(spec)
        .iter()
        .map(|d| HelloDisk { device: d.device.clone(), bytes: 1 << 30, format: "raw".into() })
        .collect();
    send_hello_of(address, secret, spec, disks).await
}

/// Plays the source up to its `Hello` for `spec` announcing `disks`, and the `Announce` of
/// its snapshots that follows it (none).
async fn send_hello_of(address: &str, secret: &Secret, spec: &vmhost::api::VmSpec, disks: Vec<HelloDisk>) -> Control {
    let stream = connect(address, &spec.name, secret, &ChannelKind::Control).await.unwrap();
    let mut c = Control::new(stream, secret);
    let hello =
        Hello { spec: spec.clone(), instance_id: Some("i-migrated".into()), macs: Vec::new(), disks, machine: None };
    c.send(&ControlMsg::Hello(Box::new(hello))).await.unwrap();
    c.send(&ControlMsg::Announce { files: Vec::new() }).await.unwrap();
    c
}

#[test]
fn migrate_in_without_a_source_is_abandoned_and_leaves_a_tombstone() {
    let (host, address) = host(3);
    let spec = host.kernel_spec("mig");
    let r = host.call("vm.migrate_in", json!({ "spec": spec }));
    assert_eq!(r["name"], "mig");
    assert_eq!(r["address"], address.as_str());
    assert_eq!(r["expires_in_s"], 3);
    let secret = r["secret"].as_str().unwrap().to_string();
    assert_eq!(secret.len(), 64);
    let v = host.call("vm.get", json!({ "name": "mig" }));
    assert_eq!(v["status"], "incoming");
    // A second migration of the name while one is expected: refused, nothing changes.
    let (code, _) = host.call_err("vm.migrate_in", json!({ "spec": host.kernel_spec("mig") }));
    assert_eq!(code, 3003);

    wait_gone(&host, "mig");
    check_tombstone(&host, "mig", &secret);
    assert!(host.qemu_pids().is_empty(), "no QEMU was ever started");
    assert!(!host.run().join("mig").exists(), "run dir left");
    assert!(files_under(&host.state().join("disks/mig")).is_empty());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let secret = Secret::parse(&secret).unwrap();
    assert_eq!(rt.block_on(query(&address, "mig", &secret)), Outcome::Abandoned);

    // The next migration of the name keeps the first's answer: a source that asks late still
    // learns its guest is its own, while the second is expected and after it was given up.
    let r2 = host.call("vm.migrate_in", json!({ "spec": host.kernel_spec("mig") }));
    assert_ne!(r2["secret"], r["secret"]);
    assert_eq!(rt.block_on(query(&address, "mig", &secret)), Outcome::Abandoned, "asked while the next is expected");
    wait_gone(&host, "mig");
    check_tombstone(&host, "mig", r2["secret"].as_str().unwrap());
    check_tombstone(&host, "mig", &secret.to_hex());
    assert_eq!(tombstones(&host, "mig").len(), 2);
    assert_eq!(rt.block_on(query(&address, "mig", &secret)), Outcome::Abandoned);
    let secret2 = Secret::parse(r2["secret"].as_str().unwrap()).unwrap();
    assert_eq!(rt.block_on(query(&address, "mig", &secret2)), Outcome::Abandoned);
}

#[test]
fn migrate_in_refuses_what_cannot_move_and_a_host_without_a_port() {
    let (host, _) = host(3);
    let mut spec = host.kernel_spec("pt");
    spec["pci"] = json!(["0000:00:05.0"]);
    let (code, e) = host.call_err("vm.migrate_in", json!({ "spec": spec }));
    assert_eq!(code, 4097);
    assert_eq!(e.details["reason"], "passthrough");
    let mut spec = host.kernel_spec("nomac");
    spec["nics"] = json!([{ "network": "lan" }]);
    let (code, e) = host.call_err("vm.migrate_in", json!({ "spec": spec }));
    assert_eq!((code, e.field.as_deref()), (2001, Some("spec.nics[0].mac")));
    let mut taken = host.kernel_spec("taken");
    taken["state"] = json!("stopped");
    host.call("vm.create", json!({ "spec": taken }));
    let (code, _) = host.call_err("vm.migrate_in", json!({ "spec": host.kernel_spec("taken") }));
    assert_eq!(code, 3003);
    assert!(!host.state().join("vms/pt.json").exists() && !host.state().join("vms/nomac.json").exists());

    let plain = TestHost::start(HostOptions::default());
    let (code, e) = plain.call_err("vm.migrate_in", json!({ "spec": plain.kernel_spec("x") }));
    assert_eq!((code, e.field.as_deref()), (3001, Some("migration.listen")));
}

#[test]
fn migrate_in_aborted_by_the_source_after_ready_removes_qemu_and_disks() {
    let (host, address) = host(30);
    let mut spec = host.kernel_spec("mig2");
    spec["disks"] = json!([{ "name": "d", "size_gib": 1 }]);
    let r = host.call("vm.migrate_in", json!({ "spec": spec.clone() }));
    let secret_hex = r["secret"].as_str().unwrap().to_string();
    let secret = Secret::parse(&secret_hex).unwrap();
    let typed: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    let disks = vmhost::qemu::migration::disks_of(&typed);
    assert_eq!(disks.len(), 1);

    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut control = rt.block_on(send_hello(&address, &secret, &typed));
    match rt.block_on(control.recv(Duration::from_secs(120))).unwrap() {
        ControlMsg::Ready { exports } => assert_eq!(exports, vec![disks[0].export.clone()]),
        other => panic!("expected ready: {other:?}"),
    }
    // Ready: QEMU waits paused for the state, the data disk exists, the record is incoming.
    let v = host.call("vm.get", json!({ "name": "mig2" }));
    assert_eq!(v["status"], "incoming");
    let pids = host.qemu_pids();
    assert_eq!(pids.len(), 1, "one QEMU waiting for the incoming state");
    let argv = vmhost_tests::argv_of(i64::from(pids[0]));
    assert!(argv.windows(2).any(|w| w[0] == "-incoming" && w[1] == "defer"), "{argv:?}");
    assert!(!files_under(&host.state().join("disks/mig2")).is_empty(), "the data disk was made");

    rt.block_on(async {
        let abort = ControlMsg::Abort { code: 4001, message: "the test's source gives up".into() };
        control.send(&abort).await.unwrap();
    });
    wait_gone(&host, "mig2");
    for pid in pids {
        assert!(!vmhost_tests::alive(pid), "QEMU {pid} still runs");
    }
    assert!(host.qemu_pids().is_empty());
    assert!(!host.run().join("mig2").exists(), "run dir left");
    assert!(
        files_under(&host.state().join("disks/mig2")).is_empty(),
        "disks left: {:?}",
        files_under(&host.state().join("disks/mig2"))
    );
    check_tombstone(&host, "mig2", &secret_hex);
    assert_eq!(rt.block_on(query(&address, "mig2", &secret)), Outcome::Abandoned);
    drop(control);
}

#[test]
fn a_restart_before_the_commit_abandons_the_migration() {
    let (mut host, address) = host(60);
    // Killed right after the record: nothing made yet but the record.
    host.crash_during("migrate_in:recorded", "vm.migrate_in", json!({ "spec": host.kernel_spec("c1") }));
    wait_gone(&host, "c1");
    assert_eq!(tombstones(&host, "c1").len(), 1, "no tombstone after the restart");
    assert!(!host.run().join("c1").exists());

    // Killed once QEMU runs for the incoming state (after the source's Hello).
    let mut spec = host.kernel_spec("c2");
    spec["disks"] = json!([{ "name": "d", "size_gib": 1 }]);
    let r = host.call("vm.migrate_in", json!({ "spec": spec.clone() }));
    let secret_hex = r["secret"].as_str().unwrap().to_string();
    let secret = Secret::parse(&secret_hex).unwrap();
    let typed: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    host.arm_crash("migrate_in:launched");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut control = rt.block_on(send_hello(&address, &secret, &typed));
    host.restart_after_crash("migrate_in:launched");
    assert!(rt.block_on(control.recv(Duration::from_secs(30))).is_err(), "the channel outlived the daemon");
    wait_gone(&host, "c2");
    assert!(host.qemu_pids().is_empty(), "the restart left the incoming QEMU running");
    assert!(!host.run().join("c2").exists(), "run dir left");
    assert!(files_under(&host.state().join("disks/c2")).is_empty(), "disks left");
    check_tombstone(&host, "c2", &secret_hex);
    assert_eq!(rt.block_on(query(&address, "c2", &secret)), Outcome::Abandoned);
}

/// The virtual size and format QEMU reads in disk image `disk` (held by a QEMU: `-U`).
fn image_info(disk: &Path) -> (u64, String) {
    let out = std::process::Command::new("qemu-img").args(["info", "-U", "--output=json"]).arg(disk).output().unwrap();
    assert!(out.status.success(), "qemu-img info {}: {}", disk.display(), String::from_utf8_lossy(&out.stderr));
    let info: Value = serde_json::from_slice(&out.stdout).unwrap();
    (info["virtual-size"].as_u64().unwrap(), info["format"].as_str().unwrap().to_string())
}

#[test]
fn a_boot_disk_vm_is_received_into_a_root_disk_of_the_sources_size_removed_when_given_up() {
    let (mut host, address) = host(60);
    let import = host.state().join("import");
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The spec names the file the VM was imported from on its first host: nothing of that name
    // is needed here.
    let spec = json!({ "name": "bd1", "cpu": 1, "memory_mib": 128, "boot": { "disk": "libvirt-vm.qcow2" } });
    let r = host.call("vm.migrate_in", json!({ "spec": spec.clone() }));
    let secret_hex = r["secret"].as_str().unwrap().to_string();
    let secret = Secret::parse(&secret_hex).unwrap();
    assert_eq!(host.call("vm.get", json!({ "name": "bd1" }))["status"], "incoming");
    let typed: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    // Not a GiB multiple: an imported disk keeps any size, and a mirror needs it exact.
    let bytes = (3 << 20) + 512;
    let disks = vec![HelloDisk { device: "virtio0".into(), bytes, format: "qcow2".into() }];
    let mut control = rt.block_on(send_hello_of(&address, &secret, &typed, disks));
    match rt.block_on(control.recv(Duration::from_secs(120))).unwrap() {
        ControlMsg::Ready { exports } => assert_eq!(exports, vec!["virtio0".to_string()]),
        other => panic!("expected ready: {other:?}"),
    }
    let root = host.state().join("disks/bd1/root.qcow2");
    assert_eq!(image_info(&root), (bytes, "qcow2".to_string()), "{}", root.display());
    let argv = vmhost_tests::argv_of(i64::from(host.qemu_pids()[0]));
    assert!(argv.iter().any(|a| a.contains("id=virtio0,format=qcow2")), "{argv:?}");
    rt.block_on(async {
        let abort = ControlMsg::Abort { code: 4001, message: "the test's source gives up".into() };
        control.send(&abort).await.unwrap();
    });
    wait_gone(&host, "bd1");
    assert!(host.qemu_pids().is_empty());
    assert!(
        files_under(&host.state().join("disks/bd1")).is_empty(),
        "{:?}",
        files_under(&host.state().join("disks/bd1"))
    );
    // Deleted, never given to the import directory: it was never an operator's file.
    assert!(files_under(&import).is_empty(), "{:?}", files_under(&import));
    check_tombstone(&host, "bd1", &secret_hex);

    // A raw one, and the daemon killed once QEMU runs: the restart removes it too.
    let spec = json!({ "name": "bd2", "cpu": 1, "memory_mib": 128, "boot": { "disk": "raw-vm.img" } });
    let r = host.call("vm.migrate_in", json!({ "spec": spec.clone() }));
    let secret = Secret::parse(r["secret"].as_str().unwrap()).unwrap();
    let typed: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    host.arm_crash("migrate_in:launched");
    let disks = vec![HelloDisk { device: "virtio0".into(), bytes: 5 << 20, format: "raw".into() }];
    let mut control = rt.block_on(send_hello_of(&address, &secret, &typed, disks));
    host.restart_after_crash("migrate_in:launched");
    assert!(rt.block_on(control.recv(Duration::from_secs(30))).is_err(), "the channel outlived the daemon");
    wait_gone(&host, "bd2");
    assert!(host.qemu_pids().is_empty(), "the restart left the incoming QEMU running");
    assert!(files_under(&host.state().join("disks/bd2")).is_empty(), "disks left");
    assert!(files_under(&import).is_empty(), "{:?}", files_under(&import));
    assert_eq!(rt.block_on(query(&address, "bd2", &secret)), Outcome::Abandoned);
}

#[test]
fn a_uefi_store_of_another_size_than_this_hosts_template_is_refused_at_hello() {
    let (host, address) = host(60);
    let mut spec = host.kernel_spec("efi");
    spec["boot"]["firmware"] = json!("uefi");
    let r = host.call("vm.migrate_in", json!({ "spec": spec.clone() }));
    let secret = Secret::parse(r["secret"].as_str().unwrap()).unwrap();
    let typed: vmhost::api::VmSpec = serde_json::from_value(spec).unwrap();
    // The store of OVMF's 2 MiB build; this host's template is the 4 MiB build's (540672 bytes).
    let disks = vec![HelloDisk { device: "uefi-vars".into(), bytes: 131_072, format: "raw".into() }];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut control = rt.block_on(send_hello_of(&address, &secret, &typed, disks));
    match rt.block_on(control.recv(Duration::from_secs(60))).unwrap() {
        ControlMsg::Abort { code, message } => {
            assert_eq!(code, 2001, "{message}");
            assert!(message.contains("131072") && message.contains("540672"), "{message}");
        }
        other => panic!("expected an abort: {other:?}"),
    }
    wait_gone(&host, "efi");
    assert!(host.qemu_pids().is_empty(), "no QEMU was started");
    assert!(files_under(&host.state().join("disks/efi")).is_empty(), "nothing made");
}
