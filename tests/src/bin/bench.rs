//! vmhost-bench: read-path latency and daemon memory, printed as a table.
//!
//! Starts a real vmhostd in a temp dir, defines N stopped VMs (records only, no QEMU), then
//! measures `vm.list` and `vm.get` latency (p50, p99) and throughput with 1, 8 and 32 concurrent
//! clients, and the daemon's RSS idle and with the records. Not a test: it asserts nothing
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
//! Usage: `vmhost-bench [--vms N] [--get-calls N] [--list-calls N] [--nic-rounds N] [--boot-rounds N]
//! [--boot-kernel-mib N] [--boot-initrd-mib N] [--boot-guest DIR] [--check-rounds N]
//! [--reconfigure-rounds N] [--autostart-vms N] [--stats-vms N] [--stats-calls N] [--storage-rounds N]`; 0 VMs or 0 rounds skip that section. `--boot-guest DIR` takes the test guest's `vmlinuz` and `initramfs.cpio.gz`
//! from DIR instead of building it (the same files for two builds compared).

use serde_json::{json, Value};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
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

fn measure(host: &TestHost, method: &'static str, clients: usize, total: usize, vms: usize) -> Row {
    let per_client = (total / clients).max(1);
    let start = Instant::now();
    let mut lat: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..clients)
            .map(|c| {
                s.spawn(move || {
                    let mut client = Client::connect(&host.socket).expect("connect");
                    let mut out = Vec::with_capacity(per_client);
                    for i in 0..per_client {
                        let params = if method == "vm.get" {
                            json!({ "name": format!("bench-{:04}", (c * 7919 + i) % vms) })
                        } else {
                            json!({})
                        };
                        let t = Instant::now();
                        let _: Value = client.call(method, params).expect("call");
                        out.push(t.elapsed());
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("client thread")).collect()
    });
    let wall = start.elapsed();
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

/// `vm.get` and `vm.list` over `vms` stopped records, and the daemon's RSS.
fn read_bench(vms: usize, get_calls: usize, list_calls: usize) {
    if vms == 0 {
        return;
    }
    let host = TestHost::start(HostOptions {
        cpu: (vms as u32) + 2,
        memory_gib: (vms as u64 * 64 / 1024) + 2,
        ..HostOptions::default()
    });
    let pid = host.daemon_pid().expect("daemon pid");
    std::thread::sleep(Duration::from_millis(300));
    let rss_idle = rss_kib(pid);

    // Any existing file in a boot directory will do as a kernel: the VMs are defined stopped and
    // never launched.
    let kernel = host.images().join("bench-kernel");
    fs::write(&kernel, b"not a kernel").expect("write bench kernel");
    let t = Instant::now();
    let mut c = Client::connect(&host.socket).expect("connect");
    for i in 0..vms {
        let spec = json!({"name": format!("bench-{i:04}"), "cpu": 1, "memory_mib": 64, "state": "stopped",
            "role": "bench", "boot": {"kernel": kernel, "cmdline": "console=ttyS0"}});
        let _: Value = c.call("vm.create", json!({ "spec": spec })).expect("create");
    }
    let create_s = t.elapsed().as_secs_f64();
    let rss_loaded = rss_kib(pid);

    let mut rows = Vec::new();
    for clients in [1, 8, 32] {
        rows.push(measure(&host, "vm.get", clients, get_calls, vms));
        rows.push(measure(&host, "vm.list", clients, list_calls, vms));
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
    drop(host);
}

fn main() {
    read_bench(arg("--vms", 1000), arg("--get-calls", 8000), arg("--list-calls", 320));
    nic_bench(arg("--nic-rounds", 7));
    boot_bench(arg("--boot-rounds", 15), arg("--boot-kernel-mib", 7) as u64, arg("--boot-initrd-mib", 20) as u64);
    agent_bench(arg("--check-rounds", 200));
    vmhost_tests::bench_lifecycle::reconfigure(arg("--reconfigure-rounds", 7));
    vmhost_tests::bench_lifecycle::autostart(arg("--autostart-vms", 20), &[0, 4]);
    vmhost_tests::bench_stats::stats(arg("--stats-vms", 50), arg("--stats-calls", 200));
    vmhost_tests::bench_storage::storage(arg("--storage-rounds", 5));
}
