//! QEMU's side of a live migration (`vmhost::qemu::migration`) against two real QEMUs (TCG), no
//! vmhostd: the test starts both, joins them with socket pairs and a Unix listener (the
//! daemon's relay is not part of this), and drives the module's functions in the order the
//! lifecycle does. A boot overlay on a shared base and a raw data disk of random bytes travel
//! with the guest's memory, TLS-PSK end to end; a second case cancels on the source once the
//! mirrors are ready and checks that nothing of the migration is left in QEMU.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vmhost::qemu::migration::{self as mig, Endpoint, MigDisk};
use vmhost::qemu::qmp::Qmp;

const DATA_BYTES: usize = 16 << 20;
const BASE_BYTES: &str = "64M";
const WAIT: Duration = Duration::from_secs(120);

/// A QEMU the test started; killed when dropped.
struct Vm {
    child: Child,
    qmp: Qmp,
    overlay: PathBuf,
    data: PathBuf,
    run_dir: PathBuf,
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn random_bytes(n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom").unwrap().read_exact(&mut buf).unwrap();
    buf
}

/// The shared base (a pattern in its first 8 MiB), the source's overlay (another pattern over
/// part of it, only in the top layer) and its data disk of random bytes.
struct Disks {
    dir: tempfile::TempDir,
    base: PathBuf,
    data: Vec<u8>,
}

fn disks() -> Disks {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", base.to_str().unwrap(), BASE_BYTES]);
    run("qemu-io", &["-f", "qcow2", "-c", "write -q -P 0x11 0 8M", base.to_str().unwrap()]);
    Disks { dir, base, data: random_bytes(DATA_BYTES) }
}

fn overlay(d: &Disks, name: &str) -> PathBuf {
    let path = d.dir.path().join(name);
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", d.base.to_str().unwrap(), path.to_str().unwrap()],
    );
    path
}

/// Starts QEMU over `overlay` and the raw disk `data` (node `data-d`); `incoming`: as a
/// destination (the launch's `-incoming defer -S`).
async fn start(d: &Disks, name: &str, overlay: PathBuf, data: PathBuf, incoming: bool) -> Vm {
    let run_dir = d.dir.path().join(format!("run-{name}"));
    std::fs::create_dir(&run_dir).unwrap();
    let qmp = run_dir.join("qmp.sock");
    let guest = vmhost_tests::guest();
    let blockdev = json!({"driver": "raw", "node-name": "data-d",
        "file": {"driver": "file", "filename": data}});
    let mut args: Vec<String> = [
        "-name",
        name,
        "-machine",
        "q35",
        "-accel",
        "tcg",
        "-m",
        "256",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-kernel",
        guest.kernel.to_str().unwrap(),
        "-initrd",
        guest.initrd.to_str().unwrap(),
        "-append",
        "console=ttyS0 panic=-1 vmhost.shell",
        // QEMU's own seccomp filter, as the daemon starts it.
        "-sandbox",
        vmhost::qemu::argv::QEMU_SANDBOX,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "-chardev".into(),
        format!("socket,id=qmp,path={},server=on,wait=off", qmp.display()),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
        "-chardev".into(),
        format!("socket,id=ser,path={},server=on,wait=off", run_dir.join("serial.sock").display()),
        "-serial".into(),
        "chardev:ser".into(),
        "-drive".into(),
        format!("file={},if=none,id=virtio0,format=qcow2", overlay.display()),
        "-device".into(),
        "virtio-blk-pci,drive=virtio0,id=boot-disk".into(),
        "-blockdev".into(),
        blockdev.to_string(),
        "-device".into(),
        "virtio-blk-pci,drive=data-d,id=data-d".into(),
    ]);
    if incoming {
        args.extend(vmhost::qemu::argv::INCOMING_ARGS.iter().map(|s| s.to_string()));
    }
    let child = Command::new("/usr/bin/qemu-system-x86_64")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(run_dir.join("qemu.log")).unwrap())
        .spawn()
        .unwrap();
    let qmp = Qmp::connect(&qmp, Duration::from_secs(30)).await.unwrap_or_else(|e| {
        panic!("{name}: {e}: {}", std::fs::read_to_string(run_dir.join("qemu.log")).unwrap_or_default())
    });
    Vm { child, qmp, overlay, data, run_dir }
}

/// Source (running, its disks filled) and destination (waiting, fresh overlay on the same
/// base, a zeroed data disk of the same size).
async fn pair(d: &Disks) -> (Vm, Vm) {
    let src_overlay = overlay(d, "src.qcow2");
    run("qemu-io", &["-f", "qcow2", "-c", "write -q -P 0x5a 4M 2M", src_overlay.to_str().unwrap()]);
    let src_data = d.dir.path().join("src-data.raw");
    std::fs::write(&src_data, &d.data).unwrap();
    let dst_data = d.dir.path().join("dst-data.raw");
    std::fs::write(&dst_data, vec![0u8; DATA_BYTES]).unwrap();
    let src = start(d, "src", src_overlay, src_data, false).await;
    let dst = start(d, "dst", overlay(d, "dst.qcow2"), dst_data, true).await;
    (src, dst)
}

fn migrated_disks() -> Vec<MigDisk> {
    vec![
        MigDisk { device: "virtio0".into(), export: "virtio0".into(), top_only: true },
        MigDisk { device: "data-d".into(), export: "data-d".into(), top_only: false },
    ]
}

fn identical(a: &Path, b: &Path) -> bool {
    Command::new("qemu-img")
        .args(["compare", "-q", "-U", "-f", "qcow2", "-F", "qcow2"])
        .args([a, b])
        .status()
        .unwrap()
        .success()
}

async fn until<T>(what: &str, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what} did not happen within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Both sides up to the point where the source's mirrors are ready: TLS on both, the
/// destination's NBD server with the exports, one NBD stream per disk. Returns the
/// destination's listener (kept open for QEMU as the daemon keeps it).
async fn mirror_until_ready(src: &mut Vm, dst: &mut Vm, key: &str) -> UnixListener {
    let disks = migrated_disks();
    let dst_dir = mig::psk_dir(&dst.run_dir, key, None).unwrap();
    mig::add_tls(&mut dst.qmp, dst_dir.as_fd(), Endpoint::Server).await.unwrap();
    let nbd_path = dst.run_dir.join("nbd.sock");
    let listener = UnixListener::bind(&nbd_path).unwrap();
    mig::start_nbd_server(&mut dst.qmp, listener.as_fd()).await.unwrap();
    mig::export_disks(&mut dst.qmp, &disks).await.unwrap();

    let src_dir = mig::psk_dir(&src.run_dir, key, None).unwrap();
    mig::add_tls(&mut src.qmp, src_dir.as_fd(), Endpoint::Client).await.unwrap();
    for disk in &disks {
        // The daemon's TCP stream through the relay in the real thing; QEMU's NBD client
        // cannot tell.
        let stream = UnixStream::connect(&nbd_path).unwrap();
        mig::start_mirror(&mut src.qmp, disk, stream.as_fd()).await.unwrap();
    }
    let qmp = &mut src.qmp;
    let ready = until("mirrors ready", async || {
        let m = mig::mirrors(qmp).await.unwrap();
        (m.len() == 2 && m.iter().all(|m| m.ready)).then_some(m)
    })
    .await;
    let mut devices: Vec<&str> = ready.iter().map(|m| m.device.as_str()).collect();
    devices.sort();
    assert_eq!(devices, ["data-d", "virtio0"]);
    listener
}

#[tokio::test(flavor = "current_thread")]
async fn live_migration_moves_memory_and_disks_with_tls() {
    let d = disks();
    let (mut src, mut dst) = pair(&d).await;
    assert_eq!(src.qmp.query_status().await.unwrap(), "running");
    assert_eq!(dst.qmp.query_status().await.unwrap(), "inmigrate");
    // What the test checks is what the migration did: the destination starts different.
    assert!(!identical(&src.overlay, &dst.overlay));
    assert_ne!(std::fs::read(&dst.data).unwrap(), d.data);

    let key = "5f".repeat(32);
    let _listener = mirror_until_ready(&mut src, &mut dst, &key).await;

    let (src_ram, dst_ram) = UnixStream::pair().unwrap();
    mig::start_incoming(&mut dst.qmp, dst_ram.as_fd()).await.unwrap();
    mig::start_memory(&mut src.qmp, src_ram.as_fd(), 300, None).await.unwrap();
    drop((src_ram, dst_ram));
    let qmp = &mut src.qmp;
    let done = until("the memory stream to end", async || {
        let p = mig::progress(qmp).await.unwrap();
        (!mig::memory_running(&p.status)).then_some(p)
    })
    .await;
    assert_eq!(done.status, "completed", "{done:?}");
    assert!(done.total >= 256 << 20, "{done:?}");
    assert!(done.transferred > 0, "{done:?}");
    println!("memory: {} bytes sent, downtime {} ms", done.transferred, done.downtime_ms);
    let qmp = &mut dst.qmp;
    let incoming = until("the destination to have the state", async || {
        let p = mig::incoming_status(qmp).await.unwrap();
        (!mig::memory_running(&p.status)).then_some(p)
    })
    .await;
    assert_eq!(incoming.status, "completed", "{incoming:?}");
    assert_eq!(src.qmp.query_status().await.unwrap(), "postmigrate");
    assert_eq!(dst.qmp.query_status().await.unwrap(), "paused");

    mig::finish_source(&mut src.qmp, &migrated_disks()).await.unwrap();
    assert!(mig::mirrors(&mut src.qmp).await.unwrap().is_empty());
    assert_eq!(src.qmp.query_status().await.unwrap(), "postmigrate", "the source stays paused");
    mig::finish_incoming(&mut dst.qmp).await.unwrap();
    let exports = dst.qmp.execute("query-block-exports", None).await.unwrap();
    assert_eq!(exports, json!([]));
    mig::resume(&mut dst.qmp).await.unwrap();
    assert_eq!(dst.qmp.query_status().await.unwrap(), "running");
    for vm in [&mut src, &mut dst] {
        assert_no_migration_left(&mut vm.qmp).await;
        mig::remove_psk_dir(&vm.run_dir).unwrap();
        assert!(!mig::psk_dir_path(&vm.run_dir).exists());
    }

    // The disks, once both QEMUs are gone (nothing writes behind the comparison).
    for vm in [&mut src, &mut dst] {
        let _ = vm.qmp.quit().await;
        vm.child.wait().unwrap();
    }
    assert!(identical(&src.overlay, &dst.overlay), "the overlays differ");
    assert!(std::fs::read(&dst.data).unwrap() == d.data, "the data disk differs");
}

/// Nothing named by the migration is left: no job, node, TLS object, fd set of the key (for a
/// running guest).
async fn assert_no_migration_left(qmp: &mut Qmp) {
    assert_eq!(qmp.execute("query-block-jobs", None).await.unwrap(), json!([]));
    let nodes = qmp.execute("query-named-block-nodes", Some(json!({"flat": true}))).await.unwrap();
    assert!(mig::our_nodes(&nodes).is_empty(), "{nodes}");
    let objects = qmp.execute("qom-list", Some(json!({"path": "/objects"}))).await.unwrap();
    let names: Vec<&str> = objects.as_array().unwrap().iter().filter_map(|o| o["name"].as_str()).collect();
    assert!(!names.contains(&mig::TLS_ID), "{names:?}");
    // QEMU closes a removed descriptor only while the guest runs (a paused source keeps the
    // set, marked removed, until it is ended).
    if qmp.query_status().await.unwrap() == "running" {
        let sets = qmp.execute("query-fdsets", None).await.unwrap();
        assert!(!sets.to_string().contains(mig::TLS_FDSET_OPAQUE), "{sets}");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn cancel_after_the_mirrors_leaves_the_source_running_and_clean() {
    let d = disks();
    let (mut src, mut dst) = pair(&d).await;
    let _listener = mirror_until_ready(&mut src, &mut dst, &"a1".repeat(32)).await;
    // Before any memory: the source still runs, and must afterwards.
    mig::cancel_source(&mut src.qmp).await.unwrap();
    assert_eq!(src.qmp.query_status().await.unwrap(), "running");
    assert_no_migration_left(&mut src.qmp).await;
    // Idempotent (recovery may run it again).
    mig::cancel_source(&mut src.qmp).await.unwrap();
    assert_eq!(src.qmp.query_status().await.unwrap(), "running");

    // The destination side is removed as an abandon would before killing QEMU.
    mig::finish_incoming(&mut dst.qmp).await.unwrap();
    assert_eq!(dst.qmp.execute("query-block-exports", None).await.unwrap(), json!([]));
    assert_no_migration_left(&mut dst.qmp).await;
}

#[tokio::test(flavor = "current_thread")]
async fn cancel_after_the_memory_went_runs_the_source_again() {
    let d = disks();
    let (mut src, mut dst) = pair(&d).await;
    let _listener = mirror_until_ready(&mut src, &mut dst, &"c3".repeat(32)).await;
    let (src_ram, dst_ram) = UnixStream::pair().unwrap();
    mig::start_incoming(&mut dst.qmp, dst_ram.as_fd()).await.unwrap();
    mig::start_memory(&mut src.qmp, src_ram.as_fd(), 300, None).await.unwrap();
    drop((src_ram, dst_ram));
    let qmp = &mut src.qmp;
    until("the memory stream to end", async || {
        let p = mig::progress(qmp).await.unwrap();
        (p.status == "completed").then_some(())
    })
    .await;
    assert_eq!(src.qmp.query_status().await.unwrap(), "postmigrate");
    // The mirrors are synced and ended before the commit is sent; then the destination abandons
    // (its QEMU killed): the source takes the guest back.
    mig::finish_source(&mut src.qmp, &migrated_disks()).await.unwrap();
    drop(dst);
    mig::cancel_source(&mut src.qmp).await.unwrap();
    assert_eq!(src.qmp.query_status().await.unwrap(), "running");
    assert_no_migration_left(&mut src.qmp).await;
}

#[tokio::test(flavor = "current_thread")]
async fn cancel_leaves_a_guest_the_operator_paused_paused() {
    let d = disks();
    let (mut src, _dst) = pair(&d).await;
    src.qmp.execute("stop", None).await.unwrap();
    mig::cancel_source(&mut src.qmp).await.unwrap();
    assert_eq!(src.qmp.query_status().await.unwrap(), "paused");
    let _: Value = src.qmp.execute("cont", None).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_source_with_another_key_gets_no_disk() {
    let d = disks();
    let (mut src, mut dst) = pair(&d).await;
    let dst_dir = mig::psk_dir(&dst.run_dir, &"11".repeat(32), None).unwrap();
    mig::add_tls(&mut dst.qmp, dst_dir.as_fd(), Endpoint::Server).await.unwrap();
    let nbd_path = dst.run_dir.join("nbd.sock");
    let listener = UnixListener::bind(&nbd_path).unwrap();
    mig::start_nbd_server(&mut dst.qmp, listener.as_fd()).await.unwrap();
    mig::export_disks(&mut dst.qmp, &migrated_disks()).await.unwrap();
    let src_dir = mig::psk_dir(&src.run_dir, &"22".repeat(32), None).unwrap();
    mig::add_tls(&mut src.qmp, src_dir.as_fd(), Endpoint::Client).await.unwrap();
    let stream = UnixStream::connect(&nbd_path).unwrap();
    let refused = mig::start_mirror(&mut src.qmp, &migrated_disks()[1], stream.as_fd()).await;
    assert!(refused.is_err(), "the NBD handshake with a wrong key succeeded");
    // The refused attempt left nothing behind.
    mig::cancel_source(&mut src.qmp).await.unwrap();
    assert_eq!(src.qmp.query_status().await.unwrap(), "running");
    assert_no_migration_left(&mut src.qmp).await;
    assert_ne!(std::fs::read(&dst.data).unwrap(), d.data);
}

/// The guest's serial console: what it printed so far, and a way to type.
struct Console {
    out: std::sync::Arc<std::sync::Mutex<String>>,
    input: tokio::net::unix::OwnedWriteHalf,
}

async fn console(vm: &Vm) -> Console {
    let stream = tokio::net::UnixStream::connect(vm.run_dir.join("serial.sock")).await.unwrap();
    let (mut read, input) = stream.into_split();
    let out = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let sink = out.clone();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 4096];
        while let Ok(n) = read.read(&mut buf).await {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    Console { out, input }
}

impl Console {
    fn count(&self, needle: &str) -> usize {
        self.out.lock().unwrap().matches(needle).count()
    }
}

/// The guest writes to its data disk all through the migration (source side): the mirror
/// carries every write made after its first pass, up to the switch-over, and `finish_source`
/// ends it after copying what was still dirty: the destination's disk is the source's, block
/// for block, before the destination runs the guest. (The test cannot make the last dirty
/// blocks lag behind on purpose: with the guest stopped the mirror catches up in milliseconds;
/// that `finish_source` comes before the commit is the lifecycle's order to keep.)
#[tokio::test(flavor = "current_thread")]
async fn a_disk_the_guest_writes_during_the_migration_arrives_whole() {
    use tokio::io::AsyncWriteExt;
    let d = disks();
    let (mut src, mut dst) = pair(&d).await;
    let mut con = console(&src).await;
    until("the guest's shell", async || (con.count("# ") > 0).then_some(())).await;
    // vdb is the data disk (the boot disk's device comes first).
    let writer = "while :; do dd if=/dev/urandom of=/dev/vdb bs=4k count=64 seek=$((RANDOM % 4000)) \\
        conv=notrunc,fsync 2>/dev/null && echo WROTE-BLOCKS; done\n";
    con.input.write_all(writer.as_bytes()).await.unwrap();
    until("the guest writing", async || (con.count("WROTE-BLOCKS") >= 3).then_some(())).await;

    let _listener = mirror_until_ready(&mut src, &mut dst, &"d4".repeat(32)).await;
    let writes_before_memory = con.count("WROTE-BLOCKS");
    let (src_ram, dst_ram) = UnixStream::pair().unwrap();
    mig::start_incoming(&mut dst.qmp, dst_ram.as_fd()).await.unwrap();
    mig::start_memory(&mut src.qmp, src_ram.as_fd(), 300, None).await.unwrap();
    drop((src_ram, dst_ram));
    let qmp = &mut src.qmp;
    let done = until("the memory stream to end", async || {
        let p = mig::progress(qmp).await.unwrap();
        (!mig::memory_running(&p.status)).then_some(p)
    })
    .await;
    assert_eq!(done.status, "completed", "{done:?}");
    assert!(con.count("WROTE-BLOCKS") > writes_before_memory, "the guest did not write while its memory went");
    let qmp = &mut dst.qmp;
    until("the destination to have the state", async || {
        (mig::incoming_status(qmp).await.unwrap().status == "completed").then_some(())
    })
    .await;
    mig::finish_source(&mut src.qmp, &migrated_disks()).await.unwrap();

    // Compared before the destination's guest runs (it would go on writing).
    for vm in [&mut src, &mut dst] {
        let _ = vm.qmp.quit().await;
        vm.child.wait().unwrap();
    }
    let written = std::fs::read(&src.data).unwrap();
    assert!(written != d.data, "the guest wrote nothing");
    assert!(std::fs::read(&dst.data).unwrap() == written, "the destination's data disk differs from the source's");
    assert!(identical(&src.overlay, &dst.overlay), "the overlays differ");
}
