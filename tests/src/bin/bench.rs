//! vmhost-bench: read-path latency and daemon memory, printed as a table.
//!
//! Starts a real vmhostd in a temp dir, defines N stopped VMs (records only, no QEMU), then
//! measures `vm.list` and `vm.get` latency (p50, p99) and throughput with 1, 8 and 32 concurrent
//! clients (each reads the answer line without building a JSON tree of it, [`RawClient`]: the
//! figures before 2026-12-04 included a `serde_json::Value` of every answer), and the daemon's
//! RSS idle and with the records. Not a test: it asserts nothing
//! about speed. Then, in a network namespace, it times `vm.create` (to QEMU running) with 0, 1, 4
//! and 8 NICs; the difference to 0 NICs is the networking share (taps made, attached, handed to
//! QEMU). Then the boot files: `vm.create` of a direct-kernel VM whose kernel and initrd are the
//! test guest's cut or zero-padded to 7 and 20 MiB (`--boot-kernel-mib`, `--boot-initrd-mib`)
//! against the files as built, all unchanged (the daemon's cached sealed copies reused) and the
//! large pair touched before each create (a new file version: copied), and the in-process cost
//! of their sealed copies (daemon/src/qemu/boot_files.rs).
//! Then the guest agent: binary size, RSS in the guest, `vm.check` round trips. Last, day-2
//! figures ([`vmhost_tests::bench_lifecycle`]): a running VM changed in place (`vm.apply`,
//! ACPI power-off and start) and autostart of `--autostart-vms` VMs after a simulated host
//! reboot, at the default `start_concurrency` and at 4. Then metrics
//! ([`vmhost_tests::bench_stats`]): `vm.stats` latency with `--stats-vms` running VMs. Last,
//! data disks ([`vmhost_tests::bench_storage`]): create with 0, 1, 4 data disks, live grow, hot-plug round trip.
//! Then capture NICs ([`vmhost_tests::bench_capture`]): frames per second a monitored source
//! delivers into 1 and 4 monitoring guests (`--capture-secs N` of sending per row, frames of
//! 14 + `--capture-payload N` bytes, 60 by default; `--capture-guests 0,1,4` the rows, 0 = the
//! sender alone).
//!
//! Scale (issue 18, docs/performance.md "Scale"): on the host with the `--vms` records, after the
//! read table, figures printed beside their goals (`GOAL | figure | goal | measured | met` lines
//! as they are measured, and a summary table): `vm.list` at 1 and 32 clients and the RSS after
//! that load (from the read table), `host.reconcile` dry runs of the records' own specs
//! (`--reconcile-calls N`), `vm.get` at 32 clients while `--churn-vms N` (8) kernel-boot VMs are
//! created and destroyed for `--churn-rounds N` rounds, vmhostd restarted with the records (spawn
//! to the first `vm.list` answered, `--restart-rounds N`) and again with `--running N` of them
//! running QEMUs (until all are re-adopted with their pids); on hosts of their own, `--parallel N`
//! `vm.create`s at once against one alone (`--parallel-rounds N`), and vmhostd's CPU over
//! `--idle-secs N` with `--idle-vms N` running VMs (`--idle-settle N` seconds after the last
//! create). The running VMs of the restart and idle figures halt in their boot sector (32 MiB,
//! no kernel, no agent): the cheapest QEMUs there are under TCG.
//!
//! Usage: `vmhost-bench [--only SECTION,...] [--quick] [--vms N] [--get-calls N] [--list-calls N]
//! [--reconcile-calls N] [--churn-vms N] [--churn-rounds N] [--restart-rounds N] [--running N]
//! [--parallel N] [--parallel-rounds N] [--idle-vms N] [--idle-secs N] [--idle-settle N]
//! [--nic-rounds N] [--boot-rounds N] [--boot-kernel-mib N] [--boot-initrd-mib N] [--boot-guest DIR]
//! [--check-rounds N] [--reconfigure-rounds N] [--autostart-vms N] [--stats-vms N] [--stats-calls N]
//! [--storage-rounds N] [--image-rounds N] [--image-mib N] [--create-rounds N] [--port-rounds N]
//! [--capture-secs N] [--capture-payload N] [--capture-guests N,...] [--migration-rounds N]`;
//! 0 VMs or 0 rounds skip that section. `--boot-guest DIR` takes the test
//! guest's `vmlinuz` and `initramfs.cpio.gz` from DIR instead of building it (the same files for
//! two builds compared). Sections (`--only`, comma-separated; all without it): `create`
//! (`vm.create` against raw QEMU with the same argv, and step by step) and `ports` (TCG boot with
//! 0 to 4 spare hot-plug root ports), both in `bench_create.rs`, `read`,
//! `reconcile`, `churn`, `restart`, `adopt`, `parallel`, `idle` (`scale` names these seven), `nic`,
//! `boot`, `agent`, `reconfigure`, `autostart`, `stats`, `storage`, `images`, `capture`, `migration` (a running guest moved between two vmhostds:
//! [`vmhost_tests::bench_migration`]), `backups` (a full vs an incremental `vm.export` after 1 MiB
//! written into a 4 GiB disk: [`vmhost_tests::bench_backups`]). `--quick` is a smoke test:
//! without `--only` it runs the scale sections only, at small defaults (200 records, 4 running,
//! 4 parallel, 10 idle VMs over 10 s, one round each); options given explicitly still win.

#[path = "../bench_create.rs"]
mod bench_create;

use serde_json::{json, Value};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use vmhost::client::Client;
use vmhost_tests::{percentile, rss_kib, HostOptions, TestHost};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).and_then(|w| w[1].parse().ok()).unwrap_or(default)
}

struct Row {
    method: &'static str,
    clients: usize,
    calls: usize,
    p50: Duration,
    p99: Duration,
    per_s: f64,
}

/// A client that writes a request line and reads the answer line without building a JSON tree
/// of it: the read table measures the daemon, and a `serde_json::Value` of a 450 KB `vm.list`
/// alone takes a client several ms. Every answer must start as a success for its id; the first
/// one of each client is parsed in full and checked.
struct RawClient {
    stream: std::os::unix::net::UnixStream,
    buf: Vec<u8>,
    next_id: u64,
}

impl RawClient {
    fn connect(path: &Path) -> RawClient {
        let stream = std::os::unix::net::UnixStream::connect(path).expect("connect");
        RawClient { stream, buf: Vec::with_capacity(1 << 20), next_id: 1 }
    }

    /// The answer line to `method` with `params` (a success, else this panics).
    fn call(&mut self, method: &str, params: &Value) -> &[u8] {
        let id = self.next_id;
        self.next_id += 1;
        let line = format!("{}\n", json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        self.stream.write_all(line.as_bytes()).expect("write");
        self.buf.clear();
        let mut chunk = [0u8; 65536];
        let end = loop {
            let n = self.stream.read(&mut chunk).expect("read");
            assert!(n > 0, "vmhostd closed the connection");
            let start = self.buf.len();
            self.buf.extend_from_slice(&chunk[..n]);
            // memchr: a byte-by-byte search of 450 KB answers cost the 32 clients more CPU
            // than vmhostd spent answering them.
            if let Some(i) = memchr::memchr(b'\n', &self.buf[start..]) {
                break start + i;
            }
        };
        let answer = &self.buf[..end];
        let head = format!(r#"{{"jsonrpc":"2.0","id":{id},"result":"#);
        assert!(
            answer.starts_with(head.as_bytes()),
            "{method}: {}",
            String::from_utf8_lossy(&answer[..answer.len().min(300)])
        );
        answer
    }
}

fn measure(host: &TestHost, method: &'static str, clients: usize, total: usize, vms: usize) -> Row {
    let per_client = (total / clients).max(1);
    let params = |c: usize, i: usize| {
        if method == "vm.get" {
            json!({ "name": format!("bench-{:04}", (c * 7919 + i) % vms) })
        } else {
            json!({})
        }
    };
    // Every client connects and checks one answer before any is timed: parsing a 450 KB answer
    // takes the client milliseconds of CPU, which the others' timed calls would pay for.
    let ready = std::sync::Barrier::new(clients + 1);
    let (mut lat, wall) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                let ready = &ready;
                s.spawn(move || {
                    let mut client = RawClient::connect(&host.socket);
                    let first = params(c, 0);
                    let v: Value = serde_json::from_slice(client.call(method, &first)).expect("an answer in JSON");
                    match method {
                        "vm.list" => assert_eq!(v["result"].as_array().map(Vec::len), Some(vms)),
                        _ => assert_eq!(v["result"]["name"], first["name"]),
                    }
                    let mut out = Vec::with_capacity(per_client);
                    ready.wait();
                    for i in 0..per_client {
                        let params = params(c, i);
                        let t = Instant::now();
                        client.call(method, &params);
                        out.push(t.elapsed());
                    }
                    out
                })
            })
            .collect();
        ready.wait();
        let start = Instant::now();
        let lat: Vec<Duration> = handles.into_iter().flat_map(|h| h.join().expect("client thread")).collect();
        (lat, start.elapsed())
    });
    lat.sort();
    Row {
        method,
        clients,
        calls: lat.len(),
        p50: percentile(&lat, 0.50),
        p99: percentile(&lat, 0.99),
        per_s: lat.len() as f64 / wall.as_secs_f64(),
    }
}

/// The payload of a minimal Ethernet frame: 60 bytes before the FCS.
fn frames_min_payload() -> usize {
    60 - vmhost_tests::frames::ETH_HLEN
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// `vm.create` latency (returns once QEMU runs and answers QMP) by number of NICs.
fn nic_bench(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: "[networks.lan]\nbridge = \"br-bench\"\ncreate = true\naddress = \"10.9.0.1/24\"\n".into(),
        ..HostOptions::default()
    });
    let g = vmhost_tests::guest();
    let mut rows = Vec::new();
    for nics in [0usize, 1, 4, 8] {
        let mut times = Vec::new();
        for r in 0..rounds {
            let name = format!("n{nics}-{r}");
            let spec = json!({"name": name, "cpu": 1, "memory_mib": 128,
                "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 quiet"},
                "nics": vec![json!({"network": "lan"}); nics]});
            let t = Instant::now();
            host.call("vm.create", json!({ "spec": spec }));
            times.push(t.elapsed());
            host.call("vm.destroy", json!({ "name": name }));
        }
        rows.push((nics, median(times)));
    }
    let base = rows.first().map(|r| r.1).unwrap_or_default();
    println!();
    println!("vm.create to QEMU running (median of {rounds}), TCG, direct kernel boot:");
    println!("| NICs | create (ms) | networking share (ms) |");
    println!("|------|-------------|-----------------------|");
    for (nics, t) in rows {
        println!(
            "| {nics:>4} | {:>11.1} | {:>21.1} |",
            t.as_secs_f64() * 1e3,
            t.saturating_sub(base).as_secs_f64() * 1e3
        );
    }
}

const MIB: u64 = 1 << 20;

/// Writes `dst`: the first `size` bytes of `src`, then zero bytes up to `size` (written, not
/// sparse), mode 0644. A bzImage cut short keeps its header, which is all QEMU reads of it
/// before it answers QMP; the guest would not boot, but `vm.create` returns before it tries.
fn sized_copy(src: &Path, dst: &Path, size: u64) {
    let mut from = fs::File::open(src).unwrap_or_else(|e| panic!("open {}: {e}", src.display()));
    let mut to = fs::File::create(dst).unwrap_or_else(|e| panic!("create {}: {e}", dst.display()));
    let copied = std::io::copy(&mut (&mut from).take(size), &mut to).expect("copy boot file");
    let zeros = vec![0u8; MIB as usize];
    let mut left = size - copied;
    while left > 0 {
        let n = left.min(MIB);
        to.write_all(&zeros[..n as usize]).expect("pad boot file");
        left -= n;
    }
    to.sync_all().expect("sync boot file");
    fs::set_permissions(dst, fs::Permissions::from_mode(0o644)).expect("chmod 0644");
}

/// The boot-file memfds (`/memfd:vmhost:...`) processes `pids` hold open: descriptors, distinct
/// memfds (by inode) and the total size of the distinct ones in bytes.
fn memfds(pids: &[i32]) -> (usize, usize, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut count, mut seen, mut bytes) = (0, std::collections::HashSet::new(), 0);
    for pid in pids {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { continue };
        for fd in fds.flatten() {
            let is_memfd = fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:vmhost"));
            let Some(meta) = is_memfd.then(|| fs::metadata(fd.path()).ok()).flatten() else { continue };
            count += 1;
            if seen.insert((meta.dev(), meta.ino())) {
                bytes += meta.len();
            }
        }
    }
    (count, seen.len(), bytes)
}

/// The daemon's process and all its descendants (its spawner, the spawner's QEMUs).
fn daemon_tree(host: &TestHost) -> Vec<i32> {
    let mut pids: Vec<i32> = host.daemon_pid().map(|p| p as i32).into_iter().collect();
    let mut i = 0;
    while i < pids.len() {
        pids.extend(vmhost_tests::children_of(pids[i]));
        i += 1;
    }
    pids
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// A string flag's value.
fn arg_str(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone())
}

/// Gives both files a new modification time (and so a new change time): a new version of each
/// file to a vmhostd that caches copies by (device, inode, size, mtime, ctime), same inode and
/// content (still in the page cache, as a file just written is).
fn touch(files: &(PathBuf, PathBuf)) {
    for p in [&files.0, &files.1] {
        let f = fs::File::options().write(true).open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
        f.set_modified(std::time::SystemTime::now()).unwrap_or_else(|e| panic!("touch {}: {e}", p.display()));
    }
}

/// `vm.create` (to QEMU running) of a direct-kernel VM by boot file size, and the in-process cost
/// of sealed copies of the large pair. The files sit in a 0755 dir as 0644 files, so a vmhostd
/// that lets QEMU open them by path (before sealed copies) runs the same section. The test guest's
/// files are built as usual, or taken from `--boot-guest DIR` (`DIR/vmlinuz`,
/// `DIR/initramfs.cpio.gz`: the same files for two builds of vmhost).
///
/// Rounds alternate three cases: the large pair unchanged and the test guest's files unchanged
/// (after the warm-up, a vmhostd that caches sealed copies reuses them: its steady state), and the
/// large pair touched just before the create (a new file version each round: the first create
/// of a new version, which copies).
fn boot_bench(rounds: usize, kernel_mib: u64, initrd_mib: u64) {
    if rounds == 0 {
        return;
    }
    let g = match arg_str("--boot-guest") {
        Some(d) => vmhost_tests::Guest {
            kernel: Path::new(&d).join("vmlinuz"),
            initrd: Path::new(&d).join("initramfs.cpio.gz"),
        },
        None => vmhost_tests::guest(),
    };
    let dir = tempfile::Builder::new().prefix("vmhboot").tempdir_in("/tmp").expect("tempdir");
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).expect("chmod 0755");
    let size = |p: &Path| fs::metadata(p).map(|m| m.len()).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let big = (dir.path().join("vmlinuz-big"), dir.path().join("initrd-big"));
    sized_copy(&g.kernel, &big.0, kernel_mib * MIB);
    sized_copy(&g.initrd, &big.1, initrd_mib * MIB);
    let built = (dir.path().join("vmlinuz-built"), dir.path().join("initrd-built"));
    sized_copy(&g.kernel, &built.0, size(&g.kernel));
    sized_copy(&g.initrd, &built.1, size(&g.initrd));
    // (label, files, touched before each create)
    let cases: [(String, (PathBuf, PathBuf), bool); 3] = [
        (format!("kernel {kernel_mib} MiB + initrd {initrd_mib} MiB, unchanged"), big.clone(), false),
        ("test guest as built, unchanged".to_string(), built.clone(), false),
        (format!("kernel {kernel_mib} MiB + initrd {initrd_mib} MiB, touched before each create"), big.clone(), true),
    ];

    let host = TestHost::start(HostOptions { boot_dirs: vec![dir.path().to_path_buf()], ..HostOptions::default() });
    let create = |name: &str, files: &(PathBuf, PathBuf)| {
        let spec = json!({"name": name, "cpu": 1, "memory_mib": 128,
            "boot": {"kernel": files.0, "initrd": files.1, "cmdline": "console=ttyS0 panic=-1 quiet"}});
        let t = Instant::now();
        host.call("vm.create", json!({ "spec": spec }));
        t.elapsed()
    };
    // Warm-up (page cache, QEMU's own files, the first copies) and what QEMU holds while it runs.
    let mut held = Vec::new();
    for (i, files) in [&big, &built].into_iter().enumerate() {
        let name = format!("boot-warm-{i}");
        create(&name, files);
        held.push(memfds(&host.qemu_pids()));
        host.call("vm.destroy", json!({ "name": name }));
    }
    // Two VMs booted from the same (unchanged) files at once: what their QEMUs hold together.
    create("boot-pair-0", &big);
    create("boot-pair-1", &big);
    let pair = memfds(&host.qemu_pids());
    host.call("vm.destroy", json!({ "name": "boot-pair-0" }));
    host.call("vm.destroy", json!({ "name": "boot-pair-1" }));
    // Rounds alternate the cases, so drift in the machine's load hits all alike.
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); cases.len()];
    for r in 0..rounds {
        for (i, (_, files, touched)) in cases.iter().enumerate() {
            if *touched {
                touch(files);
            }
            let name = format!("boot-{i}-{r}");
            times[i].push(create(&name, files));
            host.call("vm.destroy", json!({ "name": name }));
        }
    }
    // No VM runs now: the memfds left are the copies the daemon (its spawner) keeps.
    let kept = memfds(&daemon_tree(&host));
    drop(host);

    println!();
    println!("vm.create to QEMU running by boot file size ({rounds} rounds after a warm-up), TCG, 1 vCPU, 128 MiB:");
    println!("| boot files | kernel + initrd (bytes) | median (ms) | p90 (ms) | min (ms) | max (ms) | QEMU's memfds |");
    println!("|------------|-------------------------|-------------|----------|----------|----------|---------------|");
    for ((label, files, _), t) in cases.iter().zip(times.iter_mut()) {
        t.sort();
        let (n, _, bytes) = held[usize::from(files == &built)];
        println!(
            "| {label} | {} + {} | {:.1} | {:.1} | {:.1} | {:.1} | {n} ({:.1} MiB) |",
            size(&files.0),
            size(&files.1),
            ms(percentile(t, 0.5)),
            ms(percentile(t, 0.9)),
            ms(t[0]),
            ms(t[t.len() - 1]),
            mib(bytes)
        );
    }
    println!(
        "two VMs of the large pair at once: their QEMUs hold {} memfds, {} distinct ({:.1} MiB)",
        pair.0,
        pair.1,
        mib(pair.2)
    );
    println!("after the rounds, no VM running: the daemon keeps {} memfds ({:.1} MiB)", kept.1, mib(kept.2));
    copy_bench(rounds, &big.0, &big.1);
}

/// The sealed copies alone, in this process (no spawner round trip): open, copy into a memfd
/// and seal the kernel and the initrd, as the spawner does at a launch of a new file version;
/// and the launch of an unchanged one: open and take the cached copy
/// ([`vmhost::qemu::boot_files::CopyCache`]).
fn copy_bench(rounds: usize, kernel: &Path, initrd: &Path) {
    use vmhost::qemu::boot_files::{open_under, sealed_copy, CopyCache};
    // Both files sit in one directory, which is all the boot directories there are here.
    let dirs: Vec<PathBuf> = kernel.parent().into_iter().map(Path::to_path_buf).collect();
    let open = |p: &Path| open_under(&dirs, p);
    let once = || {
        let t = Instant::now();
        let k = sealed_copy(open(kernel).expect("open kernel"), kernel, "bench").expect("copy kernel");
        let i = sealed_copy(open(initrd).expect("open initrd"), initrd, "bench").expect("copy initrd");
        let took = t.elapsed();
        drop((k, i));
        took
    };
    once();
    let mut t: Vec<Duration> = (0..rounds).map(|_| once()).collect();
    t.sort();
    println!(
        "copy in-process (open + copy + seal, kernel {} + initrd {} bytes, {rounds} rounds): median {:.1} ms, p90 {:.1} ms, min {:.1} ms",
        fs::metadata(kernel).map(|m| m.len()).unwrap_or(0),
        fs::metadata(initrd).map(|m| m.len()).unwrap_or(0),
        ms(percentile(&t, 0.5)),
        ms(percentile(&t, 0.9)),
        ms(t[0])
    );
    let mut cache = CopyCache::new();
    let mut cached = || {
        let t = Instant::now();
        let k = cache.copy(open(kernel).expect("open kernel"), kernel).expect("copy kernel");
        let i = cache.copy(open(initrd).expect("open initrd"), initrd).expect("copy initrd");
        let took = t.elapsed();
        drop((k, i));
        took
    };
    cached();
    let mut t: Vec<Duration> = (0..rounds).map(|_| cached()).collect();
    t.sort();
    println!(
        "cached copy in-process (open + CopyCache hit, same files, {rounds} rounds): median {:.3} ms, p90 {:.3} ms",
        ms(percentile(&t, 0.5)),
        ms(percentile(&t, 0.9))
    );
}

/// Guest agent: binary size, RSS in the guest, and `vm.check` round trips under TCG.
fn agent_bench(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let host = TestHost::start(HostOptions {
        netns: true,
        extra: "[networks.lan]\nbridge = \"br-bench\"\ncreate = true\naddress = \"10.9.0.1/24\"\n".into(),
        ..HostOptions::default()
    });
    let g = vmhost_tests::agent_guest();
    let spec = json!({"name": "agent", "cpu": 1, "memory_mib": 256,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 quiet"},
        "nics": [{"network": "lan", "ipv4": {"mode": "static", "address": "10.9.0.5/24", "gateway": "10.9.0.1"}}]});
    let t = Instant::now();
    host.call("vm.create", json!({ "spec": spec }));
    while host.call("vm.get", json!({"name": "agent"}))["agent"]["connected"] != true {
        std::thread::sleep(Duration::from_millis(100));
    }
    let ready = t.elapsed();
    let mut c = Client::connect(&host.socket).expect("connect");
    let mut lat = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let _: Value = c.call("vm.check", json!({"name": "agent"})).expect("vm.check");
        lat.push(t.elapsed());
    }
    lat.sort();
    let info: Value = c.call("vm.guest_info", json!({"name": "agent"})).expect("guest_info");
    let size = std::fs::metadata(vmhost_tests::workspace().join("target/guest-agent/vmhost-agent"))
        .map(|m| m.len())
        .unwrap_or(0);
    println!();
    println!("guest agent (TCG guest, static binary):");
    println!("| figure | value |");
    println!("|--------|-------|");
    println!("| stripped binary size | {size} bytes ({:.2} MiB) |", size as f64 / 1048576.0);
    println!("| agent RSS in the guest | {} KiB |", info["rss_kib"]);
    println!("| vm.create to agent connected | {:.1} s |", ready.as_secs_f64());
    println!(
        "| vm.check round trip p50 ({} calls, gateway probed) | {:.1} ms |",
        lat.len(),
        percentile(&lat, 0.5).as_secs_f64() * 1e3
    );
    println!("| vm.check round trip p99 | {:.1} ms |", percentile(&lat, 0.99).as_secs_f64() * 1e3);
}

/// The host of the record sections: room (CPU, memory) for `vms` records of 1 vCPU and 64 MiB and
/// `more` VMs besides.
fn records_host(vms: usize, more: usize) -> TestHost {
    let all = vms + more;
    TestHost::start(HostOptions {
        cpu: u32::try_from(all).unwrap_or(u32::MAX).saturating_add(2),
        memory_gib: (all as u64 * 64 / 1024) + 2,
        ..HostOptions::default()
    })
}

/// Defines `vms` stopped VMs `bench-NNNN` (records only, no QEMU) over one connection; returns
/// the time it took.
fn define_records(host: &TestHost, vms: usize) -> Duration {
    // Any existing file in a boot directory will do as a kernel: the VMs are defined stopped and
    // never launched.
    let kernel = host.images().join("bench-kernel");
    fs::write(&kernel, b"not a kernel").expect("write bench kernel");
    let t = Instant::now();
    let mut c = Client::connect(&host.socket).expect("connect");
    for i in 0..vms {
        let spec = json!({"name": record_name(i), "cpu": 1, "memory_mib": 64, "state": "stopped",
            "role": "bench", "boot": {"kernel": kernel, "cmdline": "console=ttyS0"}});
        let _: Value = c.call("vm.create", json!({ "spec": spec })).expect("create");
    }
    t.elapsed()
}

/// The name of record `i`.
fn record_name(i: usize) -> String {
    format!("bench-{i:04}")
}

/// What the read section measured, for the goal rows.
struct ReadFigures {
    rows: Vec<Row>,
    rss_after: u64,
}

/// `vm.get` and `vm.list` over the `vms` stopped records on `host`, and the daemon's RSS
/// (`rss_idle`: before the records were defined, `create`: how long defining them took).
fn read_bench(
    host: &TestHost,
    vms: usize,
    get_calls: usize,
    list_calls: usize,
    rss_idle: u64,
    create: Duration,
) -> ReadFigures {
    let pid = host.daemon_pid().expect("daemon pid");
    let create_s = create.as_secs_f64();
    let rss_loaded = rss_kib(pid);

    let mut rows = Vec::new();
    for clients in [1, 8, 32] {
        rows.push(measure(host, "vm.get", clients, get_calls, vms));
        rows.push(measure(host, "vm.list", clients, list_calls, vms));
    }
    let rss_after = rss_kib(pid);

    println!("vmhost-bench: {vms} VM records, vmhostd pid {pid}");
    println!(
        "defining {vms} stopped VMs: {create_s:.2} s ({:.0} creates/s, each an fsynced record)",
        vms as f64 / create_s
    );
    println!();
    println!("| method  | clients | calls | p50 (ms) | p99 (ms) | calls/s |");
    println!("|---------|---------|-------|----------|----------|---------|");
    for r in &rows {
        println!(
            "| {:<7} | {:>7} | {:>5} | {:>8.3} | {:>8.3} | {:>7.0} |",
            r.method,
            r.clients,
            r.calls,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.per_s
        );
    }
    println!();
    println!("| daemon RSS                 | KiB    |");
    println!("|----------------------------|--------|");
    println!("| idle, no records           | {rss_idle:>6} |");
    println!("| {vms} records              | {rss_loaded:>6} |");
    println!("| {vms} records, after load  | {rss_after:>6} |");
    ReadFigures { rows, rss_after }
}

// ---- Scale (issue 18): figures printed beside their goals ----

/// The scale sections, in the order they run (`--only scale` selects them all).
const SCALE_SECTIONS: [&str; 7] = ["read", "reconcile", "churn", "restart", "adopt", "parallel", "idle"];

/// Every section `--only` accepts (and `scale` for all of [`SCALE_SECTIONS`]).
const SECTIONS: [&str; 20] = [
    "create",
    "ports",
    "read",
    "reconcile",
    "churn",
    "restart",
    "adopt",
    "parallel",
    "idle",
    "nic",
    "boot",
    "agent",
    "reconfigure",
    "autostart",
    "stats",
    "storage",
    "images",
    "capture",
    "migration",
    "backups",
];

/// True when the bare flag `name` is given.
fn flag(name: &str) -> bool {
    std::env::args().any(|a| a == name)
}

/// `--quick`: small sizes for a smoke test of the scale sections.
fn quick() -> bool {
    flag("--quick")
}

/// A numeric option: its value when given, else `full`, or `small` with `--quick`.
fn opt(name: &str, full: usize, small: usize) -> usize {
    arg(name, if quick() { small } else { full })
}

/// The sections `--only` names, checked; `None` without `--only`.
fn only() -> Option<Vec<String>> {
    let list = arg_str("--only")?;
    let names: Vec<String> = list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    for n in &names {
        assert!(
            n == "scale" || SECTIONS.contains(&n.as_str()),
            "--only: unknown section {n:?}; known: scale, {}",
            SECTIONS.join(", ")
        );
    }
    Some(names)
}

/// Whether `section` runs: named by `--only` (`scale` naming every scale section); without
/// `--only` every section runs, or with `--quick` the scale sections only.
fn selected(section: &str) -> bool {
    let scale = SCALE_SECTIONS.contains(&section);
    match only() {
        Some(names) => names.iter().any(|n| n == section || (n == "scale" && scale)),
        None => !quick() || scale,
    }
}

/// One figure beside its goal.
struct Goal {
    figure: String,
    goal: &'static str,
    measured: String,
    met: bool,
}

/// Prints a figure beside its goal at once and keeps it for the summary table.
fn goal(goals: &mut Vec<Goal>, figure: String, goal: &'static str, measured: String, met: bool) {
    println!("GOAL | {figure} | goal {goal} | measured {measured} | {}", if met { "met" } else { "NOT met" });
    goals.push(Goal { figure, goal, measured, met });
}

fn print_goals(goals: &[Goal]) {
    if goals.is_empty() {
        return;
    }
    println!();
    println!("Scale (issue 18): figures beside their goals");
    println!("| figure | goal | measured | met |");
    println!("|---|---|---|---|");
    for g in goals {
        println!("| {} | {} | {} | {} |", g.figure, g.goal, g.measured, if g.met { "yes" } else { "no" });
    }
}

/// Sets the flag when dropped: a panicking churn thread still ends the clients' loops.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The kernel-boot VM of the scale sections: the test guest, 1 vCPU, 64 MiB.
fn small_kernel_spec(host: &TestHost, name: &str) -> Value {
    let mut spec = host.kernel_spec(name);
    spec["memory_mib"] = json!(64);
    spec
}

/// The cheapest running VM: a 1 MiB raw base image whose boot sector halts
/// ([`vmhost_tests::boot_sector::HALT`]; written to the host's images dir by
/// [`halt_image`]), 32 MiB, 1 vCPU, no NIC, no agent in the guest.
fn halt_spec(name: &str) -> Value {
    json!({"name": name, "cpu": 1, "memory_mib": 32, "boot": {"image": "halt.raw", "disk_gib": 1}})
}

fn halt_image(host: &TestHost) {
    vmhost_tests::boot_sector::write_image(&host.images().join("halt.raw"), vmhost_tests::boot_sector::HALT);
}

/// `host.reconcile` dry runs of the `vms` records' own specs (taken from `vm.list`, so every
/// entry plans `none`): p50 and p99 of `calls` sequential calls after one checked warm-up.
fn reconcile_bench(host: &TestHost, vms: usize, calls: usize, goals: &mut Vec<Goal>) {
    if calls == 0 {
        return;
    }
    let list = host.call("vm.list", json!({}));
    let specs: Vec<Value> = list.as_array().map(|l| l.iter().map(|v| v["spec"].clone()).collect()).unwrap_or_default();
    assert_eq!(specs.len(), vms, "vm.list should hold the {vms} records only");
    let params = json!({ "vms": specs, "dry_run": true });
    let bytes = serde_json::to_string(&params).map(|t| t.len()).unwrap_or(0);
    let mut c = host.client();
    let r: Value = c.call("host.reconcile", params.clone()).expect("host.reconcile");
    let none = r["plan"].as_array().map_or(0, |p| p.iter().filter(|e| e["action"] == "none").count());
    assert!(r["ok"] == true && none == vms, "the dry run of the unchanged specs should plan {vms} x none: {r}");
    let mut took: Vec<Duration> = (0..calls)
        .map(|_| {
            let t = Instant::now();
            let _: Value = c.call("host.reconcile", params.clone()).expect("host.reconcile");
            t.elapsed()
        })
        .collect();
    took.sort();
    let (p50, p99) = (percentile(&took, 0.5), percentile(&took, 0.99));
    println!();
    println!(
        "host.reconcile dry run of {vms} unchanged specs ({bytes} bytes of request, every entry `none`), {calls} calls: \
         p50 {:.1} ms, p99 {:.1} ms, min {:.1} ms, max {:.1} ms",
        ms(p50),
        ms(p99),
        ms(took[0]),
        ms(took[took.len() - 1])
    );
    goal(
        goals,
        format!("`host.reconcile` dry run of {vms} unchanged specs, p50 of {calls}"),
        "<= 10 ms",
        format!("{:.1} ms (p99 {:.1} ms)", ms(p50), ms(p99)),
        p50 <= Duration::from_millis(10),
    );
}

/// `vm.get` latency at 32 clients (records picked as in [`measure`]) while one more client
/// creates `churn_vms` kernel-boot VMs (64 MiB) and destroys them again, `rounds` times; the
/// clients call until the churn is done.
fn churn_bench(host: &TestHost, vms: usize, churn_vms: usize, rounds: usize, goals: &mut Vec<Goal>) {
    if rounds == 0 || churn_vms == 0 {
        return;
    }
    const CLIENTS: usize = 32;
    let specs: Vec<Value> = (0..churn_vms).map(|i| small_kernel_spec(host, &format!("churn-{i}"))).collect();
    let done = AtomicBool::new(false);
    // The churn's creates: how long each took, and the errors of those that failed (a create
    // that fails, e.g. QEMU not up within the daemon's launch timeout on a starved machine, is
    // counted and its VM destroyed like the others).
    let (mut lat, (churn_took, mut creates, failed)) = std::thread::scope(|s| {
        let churn = s.spawn(|| {
            let _stop = SetOnDrop(&done);
            let mut c = host.client();
            let (mut creates, mut failed) = (Vec::new(), Vec::new());
            let t = Instant::now();
            for _ in 0..rounds {
                for spec in &specs {
                    let t = Instant::now();
                    match c.call::<Value>("vm.create", json!({ "spec": spec })) {
                        Ok(_) => creates.push(t.elapsed()),
                        Err(e) => failed.push(format!("{}: {e}", spec["name"])),
                    }
                }
                for spec in &specs {
                    match c.call::<Value>("vm.destroy", json!({ "name": spec["name"] })) {
                        Ok(_) => {}
                        Err(vmhost::client::ClientError::Api(e)) if e.code.as_i32() == 4040 => {}
                        Err(e) => panic!("churn destroy {}: {e}", spec["name"]),
                    }
                }
            }
            (t.elapsed(), creates, failed)
        });
        let clients: Vec<_> = (0..CLIENTS)
            .map(|k| {
                let done = &done;
                s.spawn(move || {
                    let mut c = Client::connect(&host.socket).expect("connect");
                    let mut out = Vec::new();
                    let mut i = 0;
                    while !done.load(Ordering::SeqCst) {
                        let name = record_name((k * 7919 + i) % vms);
                        let t = Instant::now();
                        let _: Value = c.call("vm.get", json!({ "name": name })).expect("vm.get");
                        out.push(t.elapsed());
                        i += 1;
                    }
                    out
                })
            })
            .collect();
        let lat: Vec<Duration> = clients.into_iter().flat_map(|h| h.join().expect("client thread")).collect();
        (lat, churn.join().expect("churn thread"))
    });
    lat.sort();
    creates.sort();
    let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
    let failures = if failed.is_empty() {
        String::new()
    } else {
        format!("; {} creates FAILED, first: {}", failed.len(), failed[0])
    };
    println!();
    println!(
        "vm.get at {CLIENTS} clients over {vms} records while {churn_vms} VMs (kernel boot, 64 MiB) are created and \
         destroyed, {rounds} rounds in {:.1} s: {} calls, p50 {:.3} ms, p99 {:.3} ms, max {:.1} ms; the churn's \
         creates meanwhile: median {:.0} ms, max {:.0} ms{failures}",
        churn_took.as_secs_f64(),
        lat.len(),
        ms(p50),
        ms(p99),
        ms(lat.last().copied().unwrap_or_default()),
        ms(percentile(&creates, 0.5)),
        ms(creates.last().copied().unwrap_or_default())
    );
    goal(
        goals,
        format!("`vm.get` p99 at {CLIENTS} clients while {churn_vms} VMs are created and destroyed in a loop"),
        "<= 2 ms",
        format!(
            "{:.3} ms (p50 {:.3} ms, {} calls, {rounds} rounds{})",
            ms(p99),
            ms(p50),
            lat.len(),
            if failed.is_empty() { String::new() } else { format!(", {} creates failed", failed.len()) }
        ),
        p99 <= Duration::from_millis(2),
    );
}

/// Stops vmhostd (SIGTERM: its VMs keep running), starts it again and polls its socket (connect
/// and `vm.list`, 1 ms apart) until `vm.list` answers. Returns the time from the spawn to that
/// answer, the answer, and the spawn's instant.
fn timed_restart(host: &mut TestHost) -> (Duration, Value, Instant) {
    host.stop_daemon();
    let t = Instant::now();
    host.launch_daemon();
    let pid = host.daemon_pid().expect("daemon pid") as i32;
    loop {
        if let Ok(mut c) = Client::connect(&host.socket) {
            if let Ok(list) = c.call::<Value>("vm.list", json!({})) {
                return (t.elapsed(), list, t);
            }
        }
        assert!(vmhost_tests::alive(pid), "vmhostd exited; log:\n{}", host.daemon_log());
        assert!(t.elapsed() < Duration::from_secs(300), "vmhostd did not answer vm.list within 300 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// vmhostd restarted with the `vms` records (none running): from its spawn to the first
/// `vm.list` answered (holding every record), `rounds` times.
fn restart_bench(host: &mut TestHost, vms: usize, rounds: usize, goals: &mut Vec<Goal>) {
    if rounds == 0 {
        return;
    }
    let mut took = Vec::new();
    for _ in 0..rounds {
        let (d, list, _) = timed_restart(host);
        let n = list.as_array().map_or(0, Vec::len);
        assert_eq!(n, vms, "the first vm.list after the restart should hold every record");
        took.push(d);
    }
    let all: Vec<String> = took.iter().map(|d| format!("{:.0}", ms(*d))).collect();
    let med = median(took.clone());
    println!();
    println!(
        "vmhostd start with {vms} records (none running) to the first vm.list answered: median {:.0} ms of {rounds} ({} ms)",
        ms(med),
        all.join(", ")
    );
    goal(
        goals,
        format!("vmhostd start with {vms} records (none running) to first `vm.list` answered, median of {rounds}"),
        "<= 200 ms",
        format!("{:.0} ms ({} ms)", ms(med), all.join(", ")),
        med <= Duration::from_millis(200),
    );
}

/// The pid `list` gives VM `name` when it is `running`.
fn running_pid(list: &Value, name: &str) -> Option<i64> {
    let vm = list.as_array()?.iter().find(|v| v["name"] == name)?;
    (vm["status"] == "running").then(|| vm["pid"].as_i64()).flatten()
}

/// vmhostd restarted with `vms` records of which `running` are running QEMUs (the last
/// `running` records replaced by running halt VMs, [`halt_spec`]): from its spawn to the first
/// `vm.list` answered and until `vm.list` shows every one of them `running` with its old pid,
/// `rounds` times.
fn adopt_bench(host: &mut TestHost, vms: usize, running: usize, rounds: usize, goals: &mut Vec<Goal>) {
    if rounds == 0 || running == 0 {
        return;
    }
    let running = running.min(vms);
    halt_image(host);
    let names: Vec<String> = (0..running).map(|i| format!("run-{i:02}")).collect();
    let t = Instant::now();
    for (i, name) in names.iter().enumerate() {
        host.call("vm.destroy", json!({ "name": record_name(vms - 1 - i) }));
        let r = host.call("vm.create", json!({ "spec": halt_spec(name) }));
        assert_eq!(r["vm"]["status"], "running", "{r}");
    }
    let started = t.elapsed();
    let list = host.call("vm.list", json!({}));
    let pids: Vec<i64> = names.iter().map(|n| running_pid(&list, n).expect("running with a pid")).collect();
    let (mut first, mut adopted) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (d, mut list, t) = timed_restart(host);
        assert_eq!(list.as_array().map_or(0, Vec::len), vms, "the first vm.list should hold every record");
        first.push(d);
        let mut c = host.client();
        loop {
            let now: Vec<Option<i64>> = names.iter().map(|n| running_pid(&list, n)).collect();
            if now.iter().zip(&pids).all(|(p, old)| *p == Some(*old)) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(300),
                "the running VMs were not re-adopted with their pids: {now:?} against {pids:?}"
            );
            std::thread::sleep(Duration::from_millis(1));
            list = c.call("vm.list", json!({})).expect("vm.list");
        }
        adopted.push(t.elapsed());
    }
    let fmt = |v: &[Duration]| v.iter().map(|d| format!("{:.0}", ms(*d))).collect::<Vec<_>>().join(", ");
    let med = median(adopted.clone());
    println!();
    println!(
        "vmhostd start with {vms} records, {running} of them running QEMUs (halting boot sector, 32 MiB; started in \
         {:.1} s): first vm.list answered after {} ms, all {running} re-adopted (running, same pids) after {} ms \
         ({rounds} rounds)",
        started.as_secs_f64(),
        fmt(&first),
        fmt(&adopted)
    );
    goal(
        goals,
        format!(
            "vmhostd start with {vms} records, {running} of them running QEMUs, all re-adopted, median of {rounds}"
        ),
        "<= 1 s",
        format!("{:.0} ms ({} ms; first `vm.list` {} ms)", ms(med), fmt(&adopted), fmt(&first)),
        med <= Duration::from_secs(1),
    );
    for name in &names {
        host.call("vm.destroy", json!({ "name": name }));
    }
}

/// A host whose hardware model fits `vms` VMs of 1 CPU and `mib` MiB each, with `spare` CPUs
/// and GiB beyond them.
fn host_for(vms: usize, mib: u64, spare: u32) -> TestHost {
    TestHost::start(HostOptions {
        cpu: u32::try_from(vms).unwrap_or(u32::MAX).saturating_add(spare),
        memory_gib: (vms as u64 * mib / 1024) + u64::from(spare),
        ..HostOptions::default()
    })
}

/// `parallel` `vm.create`s at once (kernel boot, 64 MiB; each on its own connection, released
/// together) against one alone, `rounds` alternating rounds after a warm-up; the parallel
/// total is from the release to the last answer.
fn parallel_bench(parallel: usize, rounds: usize, goals: &mut Vec<Goal>) {
    if parallel == 0 || rounds == 0 {
        return;
    }
    let host = host_for(parallel, 64, 4);
    let create = |c: &mut Client, name: &str| {
        let t = Instant::now();
        let r: Value = c.call("vm.create", json!({ "spec": small_kernel_spec(&host, name) })).expect("vm.create");
        assert_eq!(r["vm"]["status"], "running", "{r}");
        t.elapsed()
    };
    let mut c = host.client();
    create(&mut c, "par-warm");
    host.call("vm.destroy", json!({ "name": "par-warm" }));
    let (mut alone, mut totals, mut each) = (Vec::new(), Vec::new(), Vec::new());
    // CPU (ms) of vmhostd and its spawner during the creates, and of the QEMUs until the last
    // create answered: one alone, and all of a parallel round.
    let (mut cpu_one, mut cpu_all) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let d0 = ticks_ms(&daemon_procs(&host));
        alone.push(create(&mut c, "par-one"));
        cpu_one.push((ticks_ms(&daemon_procs(&host)) - d0, ticks_ms(&host.qemu_pids())));
        host.call("vm.destroy", json!({ "name": "par-one" }));
        let d0 = ticks_ms(&daemon_procs(&host));
        let names: Vec<String> = (0..parallel).map(|i| format!("par-{i:02}")).collect();
        let barrier = std::sync::Barrier::new(parallel + 1);
        let (total, took) = std::thread::scope(|s| {
            let handles: Vec<_> = names
                .iter()
                .map(|name| {
                    let (barrier, create, host) = (&barrier, &create, &host);
                    s.spawn(move || {
                        let mut c = host.client();
                        barrier.wait();
                        let took = create(&mut c, name);
                        (took, Instant::now())
                    })
                })
                .collect();
            barrier.wait();
            let t0 = Instant::now();
            let ends: Vec<(Duration, Instant)> =
                handles.into_iter().map(|h| h.join().expect("create thread")).collect();
            let last = ends.iter().map(|e| e.1).max().unwrap_or(t0);
            (last.saturating_duration_since(t0), ends.into_iter().map(|e| e.0).collect::<Vec<_>>())
        });
        cpu_all.push((ticks_ms(&daemon_procs(&host)) - d0, ticks_ms(&host.qemu_pids())));
        totals.push(total);
        each.extend(took);
        for name in &names {
            host.call("vm.destroy", json!({ "name": name }));
        }
    }
    each.sort();
    let fmt = |v: &[Duration]| v.iter().map(|d| format!("{:.0}", ms(*d))).collect::<Vec<_>>().join(", ");
    let (one, total) = (median(alone.clone()), median(totals.clone()));
    let ratio = total.as_secs_f64() / one.as_secs_f64();
    println!();
    println!(
        "{parallel} vm.create in parallel (kernel boot, 64 MiB, TCG): total {} ms, one alone {} ms ({rounds} rounds); \
         each create of the parallel ones: p50 {:.0} ms, max {:.0} ms; ratio of the medians {ratio:.1}x",
        fmt(&totals),
        fmt(&alone),
        ms(percentile(&each, 0.5)),
        ms(each.last().copied().unwrap_or_default())
    );
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let fmt_cpu = |v: &[(f64, f64)]| v.iter().map(|(d, q)| format!("{d:.0} + {q:.0}")).collect::<Vec<_>>().join(", ");
    println!(
        "CPU used (ms, vmhostd and its spawner during the creates + the QEMUs until the last create answered, their \
         guests already booting): one alone {}; {parallel} in parallel {}; on {cpus} CPUs the parallel CPU alone is \
         at least {} ms of wall",
        fmt_cpu(&cpu_one),
        fmt_cpu(&cpu_all),
        cpu_all.iter().map(|(d, q)| format!("{:.0}", (d + q) / cpus as f64)).collect::<Vec<_>>().join(", ")
    );
    goal(
        goals,
        format!("{parallel} `vm.create` in parallel (kernel boot, 64 MiB) total vs one alone, medians of {rounds}"),
        "<= 3x one alone",
        format!("{ratio:.1}x ({:.0} ms vs {:.0} ms)", ms(total), ms(one)),
        ratio <= 3.0,
    );
}

/// vmhostd and its non-QEMU children (its spawner).
fn daemon_procs(host: &TestHost) -> Vec<i32> {
    let daemon = host.daemon_pid().expect("daemon pid") as i32;
    let qemus = host.qemu_pids();
    let mut procs = vec![daemon];
    procs.extend(vmhost_tests::children_of(daemon).into_iter().filter(|p| !qemus.contains(p)));
    procs
}

/// Clock ticks per second of /proc's CPU times.
fn clock_hz() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

/// User + system CPU used so far by processes `pids` together, in ms.
fn ticks_ms(pids: &[i32]) -> f64 {
    pids.iter().map(|p| cpu_ticks(*p).0).sum::<u64>() as f64 * 1000.0 / clock_hz()
}

/// User + system CPU ticks used so far by process `pid` (all its threads), and its name.
fn cpu_ticks(pid: i32) -> (u64, String) {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let comm =
        stat.split_once('(').and_then(|(_, r)| r.rsplit_once(')')).map(|(c, _)| c.to_string()).unwrap_or_default();
    let rest: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    // Fields 14 and 15 (utime, stime); `rest` starts at field 3.
    let field = |n: usize| rest.get(n - 3).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    (field(14) + field(15), comm)
}

/// vmhostd's CPU use with `vms` running halt VMs ([`halt_spec`]: no agent in the guest) over a
/// `secs` window that starts `settle` seconds after the last create answered: the daemon and
/// its non-QEMU children (the spawner), in % of one core.
fn idle_bench(vms: usize, secs: u64, settle: u64, goals: &mut Vec<Goal>) {
    if vms == 0 || secs == 0 {
        return;
    }
    let host = host_for(vms, 32, 2);
    halt_image(&host);
    let t = Instant::now();
    let mut c = host.client();
    for i in 0..vms {
        let r: Value = c.call("vm.create", json!({ "spec": halt_spec(&format!("idle-{i:03}")) })).expect("vm.create");
        assert_eq!(r["vm"]["status"], "running", "{r}");
    }
    drop(c);
    let started = t.elapsed();
    std::thread::sleep(Duration::from_secs(settle));
    let qemus = host.qemu_pids();
    assert_eq!(qemus.len(), vms, "every idle VM should run its QEMU");
    let procs = daemon_procs(&host);
    let before: Vec<(u64, String)> = procs.iter().map(|p| cpu_ticks(*p)).collect();
    let qemu_before: u64 = qemus.iter().map(|p| cpu_ticks(*p).0).sum();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(secs));
    let window = t0.elapsed().as_secs_f64();
    let after: Vec<(u64, String)> = procs.iter().map(|p| cpu_ticks(*p)).collect();
    let qemu_after: u64 = qemus.iter().map(|p| cpu_ticks(*p).0).sum();
    assert!(procs.iter().all(|p| vmhost_tests::alive(*p)), "a daemon process ended during the window");
    let hz = clock_hz();
    let pct = |ticks: u64| ticks as f64 / hz / window * 100.0;
    let parts: Vec<String> = procs
        .iter()
        .zip(before.iter().zip(&after))
        .map(|(p, (b, a))| format!("{} (pid {p}) {:.2} %", a.1, pct(a.0.saturating_sub(b.0))))
        .collect();
    let total: u64 = before.iter().zip(&after).map(|(b, a)| a.0.saturating_sub(b.0)).sum();
    println!();
    println!(
        "idle CPU with {vms} running VMs (halting boot sector, 32 MiB, no NIC, no agent; created in {:.1} s), \
         {window:.1} s window {settle} s after the last create: {} = {:.2} % of a core ({total} ticks at {hz} Hz); \
         the {vms} QEMUs {:.1} % of a core",
        started.as_secs_f64(),
        parts.join(" + "),
        pct(total),
        pct(qemu_after.saturating_sub(qemu_before))
    );
    goal(
        goals,
        format!("idle CPU of vmhostd (and its spawner) with {vms} running VMs without agents, {window:.0} s window"),
        "<= 1 % of a core",
        format!("{:.2} % of a core", pct(total)),
        pct(total) <= 1.0,
    );
}

/// The sections on one host holding `vms` records: read (with its goal rows), reconcile, churn,
/// restart, adopt.
fn records_sections(vms: usize, goals: &mut Vec<Goal>) {
    let running = opt("--running", 20, 4);
    let churn_vms = arg("--churn-vms", 8);
    let mut host = records_host(vms, running + churn_vms);
    let pid = host.daemon_pid().expect("daemon pid");
    std::thread::sleep(Duration::from_millis(300));
    let rss_idle = rss_kib(pid);
    let create = define_records(&host, vms);
    if selected("read") {
        let f =
            read_bench(&host, vms, opt("--get-calls", 8000, 2000), opt("--list-calls", 3200, 320), rss_idle, create);
        let row = |clients: usize| f.rows.iter().find(|r| r.method == "vm.list" && r.clients == clients);
        if let Some(r) = row(1) {
            goal(
                goals,
                format!("`vm.list`, {vms} records, 1 client, p50 / p99 ({} calls)", r.calls),
                "<= 1 ms / 2 ms",
                format!("{:.2} / {:.2} ms", ms(r.p50), ms(r.p99)),
                r.p50 <= Duration::from_millis(1) && r.p99 <= Duration::from_millis(2),
            );
        }
        if let Some(r) = row(32) {
            goal(
                goals,
                format!("`vm.list`, {vms} records, 32 clients, p99 ({} calls)", r.calls),
                "<= 20 ms",
                format!("{:.1} ms (p50 {:.1} ms)", ms(r.p99), ms(r.p50)),
                r.p99 <= Duration::from_millis(20),
            );
        }
        goal(
            goals,
            format!("vmhostd RSS with {vms} records after the 32-client load"),
            "<= 20 MiB",
            format!("{:.1} MiB ({} KiB)", f.rss_after as f64 / 1024.0, f.rss_after),
            f.rss_after <= 20 * 1024,
        );
    }
    if selected("reconcile") {
        reconcile_bench(&host, vms, opt("--reconcile-calls", 20, 5), goals);
    }
    if selected("churn") {
        churn_bench(&host, vms, churn_vms, opt("--churn-rounds", 3, 1), goals);
    }
    let rounds = opt("--restart-rounds", 3, 1);
    if selected("restart") {
        restart_bench(&mut host, vms, rounds, goals);
    }
    if selected("adopt") {
        adopt_bench(&mut host, vms, running, rounds, goals);
    }
}

fn main() {
    let _ = only();
    let mut goals = Vec::new();
    let vms = opt("--vms", 1000, 200);
    if vms > 0 && ["read", "reconcile", "churn", "restart", "adopt"].iter().any(|s| selected(s)) {
        records_sections(vms, &mut goals);
    }
    if selected("parallel") {
        parallel_bench(opt("--parallel", 20, 4), opt("--parallel-rounds", 3, 1), &mut goals);
    }
    if selected("idle") {
        idle_bench(
            opt("--idle-vms", 100, 10),
            opt("--idle-secs", 30, 10) as u64,
            opt("--idle-settle", 5, 2) as u64,
            &mut goals,
        );
    }
    print_goals(&goals);
    if selected("create") {
        bench_create::create(arg("--create-rounds", 31));
    }
    if selected("ports") {
        bench_create::ports(arg("--port-rounds", 5));
    }
    if selected("nic") {
        nic_bench(arg("--nic-rounds", 7));
    }
    if selected("boot") {
        boot_bench(arg("--boot-rounds", 15), arg("--boot-kernel-mib", 7) as u64, arg("--boot-initrd-mib", 20) as u64);
    }
    if selected("agent") {
        agent_bench(arg("--check-rounds", 200));
    }
    if selected("reconfigure") {
        vmhost_tests::bench_lifecycle::reconfigure(arg("--reconfigure-rounds", 7));
    }
    if selected("autostart") {
        vmhost_tests::bench_lifecycle::autostart(arg("--autostart-vms", 20), &[0, 4]);
    }
    if selected("stats") {
        vmhost_tests::bench_stats::stats(arg("--stats-vms", 50), arg("--stats-calls", 200));
    }
    if selected("storage") {
        vmhost_tests::bench_storage::storage(arg("--storage-rounds", 5));
    }
    if selected("images") {
        vmhost_tests::bench_images::images(arg("--image-rounds", 3), arg("--image-mib", 1024));
    }
    if selected("capture") {
        vmhost_tests::bench_capture::capture(
            arg("--capture-secs", 10) as u64,
            &arg_str("--capture-guests")
                .map(|l| l.split(',').filter_map(|n| n.trim().parse().ok()).collect::<Vec<usize>>())
                .unwrap_or_else(|| vec![0, 1, 4]),
            arg("--capture-payload", frames_min_payload()),
        );
    }
    if selected("migration") {
        vmhost_tests::bench_migration::migration(arg("--migration-rounds", 1));
    }
    if selected("backups") {
        vmhost_tests::bench_backups::backups(arg("--backup-gib", 4));
    }
}
