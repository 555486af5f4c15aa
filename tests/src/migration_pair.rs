//! Two vmhostds that can move VMs between them (issue 32, docs/moving.md): the harness of
//! tests/tests/migration.rs and of `vmhost-bench --only migration`.
//!
//! Each host is a [`TestHost`] in its own network namespace with its own state directory; a
//! veth pair joins the two namespaces (`10.77.0.1/24` on the first, `10.77.0.2/24` on the
//! second) and each daemon has `[migration] listen` on its veth address. Both have the `lan`
//! network ([`crate::LAN_NETWORK`], a bridge of their own in their own namespace), so a VM with
//! a NIC there can move. The guest is the test guest with [`counter_guest`]'s program: its
//! console carries a counter every 100 ms with its boot id, which [`CounterWatch`] follows on
//! both hosts' serial logs at once, timestamping each line as it arrives.
//!
//! The daemons run with `sandbox = "require"` as every test host does; `VMHOST_TEST_SANDBOX`
//! (e.g. `off`) overrides it, to tell a sandbox refusal from a migration defect.
//!
//! Order of use: [`Pair::start`], [`Pair::create`] (a VM on the first host), then a migration
//! ([`Pair::migrate_ctl`] through `vmhostctl --to-socket`, or [`Pair::migrate_in`] and
//! [`Pair::migrate`] as two API calls), then [`Pair::settled`] to find where the VM runs and
//! [`Pair::assert_clean`] on the other host.
//!
//! [`Fleet`] is the same for N hosts (tests/tests/salt_fleet.rs: three hypervisors under a
//! real salt-master): a bridge `migbr` in host 0's namespace with a veth to each other host,
//! host `i` at [`fleet_addr`]`(i)`, each daemon listening there. Order of use:
//! [`Fleet::start`], [`create_counter`] on a host, moves (by whatever drives them), then
//! [`settled_among`] to find where a VM runs and [`assert_clean_of`] on the hosts it left.

use crate::{guest, wait, Guest, HostOptions, TestHost, GUEST_READY};
use serde_json::{json, Value};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The migration port each daemon listens on (in its own namespace).
pub const PORT: u16 = 7300;

/// Each host's veth address: host 0, host 1.
pub const ADDRS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];

/// The test guest whose /bin/vmhost-agent is tests/guest/migration-counter.sh (built once per
/// process into `target/guest/initramfs-counter.cpio.gz`).
pub fn counter_guest() -> Guest {
    static GUEST: std::sync::OnceLock<Guest> = std::sync::OnceLock::new();
    GUEST
        .get_or_init(|| {
            let base = guest();
            let root = crate::workspace();
            let out = root.join("target/guest");
            let st = Command::new(root.join("tests/guest/build.sh"))
                .env(
                    "EXTRA_FILES",
                    format!("{}:/bin/vmhost-agent", root.join("tests/guest/migration-counter.sh").display()),
                )
                .env("INITRAMFS_NAME", "initramfs-counter.cpio.gz")
                .arg(&out)
                .status()
                .expect("run tests/guest/build.sh");
            assert!(st.success(), "tests/guest/build.sh (counter guest): {st}");
            Guest { kernel: base.kernel, initrd: out.join("initramfs-counter.cpio.gz") }
        })
        .clone()
}

/// Two hosts joined by a veth, each with a migration port.
pub struct Pair {
    /// Host 0 (`10.77.0.1`) and host 1 (`10.77.0.2`).
    pub hosts: [TestHost; 2],
}

/// Options of [`Pair::start`] beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct PairOptions {
    /// Give host 1 no `lan` network (a destination without the VM's network).
    pub second_without_lan: bool,
    /// Give host 1 no `[migration]` table (a destination without a migration port).
    pub second_without_port: bool,
    /// `hardware.memory_gib` of both (default 8).
    pub memory_gib: Option<u64>,
    /// Host 1's `qemu.machine` (default both `q35`).
    pub second_machine: Option<String>,
}

impl Pair {
    /// Starts both daemons in their namespaces, joined by the veth, each listening on its
    /// migration port.
    ///
    /// # Panics
    /// When a daemon does not start or the veth cannot be made.
    pub fn start(opts: PairOptions) -> Pair {
        let host = |lan: bool, machine: Option<&String>| {
            TestHost::start(HostOptions {
                netns: true,
                machine: machine.cloned().unwrap_or_else(|| HostOptions::default().machine),
                extra: if lan { crate::LAN_NETWORK.to_string() } else { String::new() },
                memory_gib: opts.memory_gib.unwrap_or(8),
                sandbox: std::env::var("VMHOST_TEST_SANDBOX").unwrap_or_else(|_| "require".into()),
                ..HostOptions::default()
            })
        };
        let mut hosts = [host(true, None), host(!opts.second_without_lan, opts.second_machine.as_ref())];
        // The veth first (the daemons bind their veth address when they start), then the
        // `[migration]` table and a restart: the daemon that wrote the config did not have it.
        let ns1 = hosts[1].netns.clone().expect("netns");
        hosts[0].ip(&["link", "add", "mig0", "type", "veth", "peer", "name", "mig0", "netns", &ns1]);
        for (i, h) in hosts.iter_mut().enumerate() {
            h.ip(&["link", "set", "lo", "up"]);
            h.ip(&["addr", "add", &format!("{}/24", ADDRS[i]), "dev", "mig0"]);
            h.ip(&["link", "set", "mig0", "up"]);
            if i == 1 && opts.second_without_port {
                continue;
            }
            enable_port(h, ADDRS[i]);
        }
        Pair { hosts }
    }

    /// The spec of a counter guest named `name` ([`counter_spec`]).
    pub fn spec(&self, name: &str, memory_mib: u64, mark: &str, keep: bool) -> Value {
        counter_spec(name, memory_mib, mark, keep)
    }

    /// Creates `spec` on host `on` and waits until its guest wrote its marker and counts.
    ///
    /// # Panics
    /// When the guest does not come up within two minutes.
    pub fn create(&self, on: usize, spec: &Value) {
        create_counter(&self.hosts[on], spec);
    }

    /// The `vm.migrate_in` params for moving `name` from host `from` ([`incoming_spec_of`]).
    pub fn incoming_spec(&self, from: usize, name: &str) -> Value {
        incoming_spec_of(&self.hosts[from], name)
    }

    /// `vm.migrate_in` on host `to` for `name` as host `from` runs it; its result.
    pub fn migrate_in(&self, from: usize, to: usize, name: &str) -> Value {
        let spec = self.incoming_spec(from, name);
        self.hosts[to].call("vm.migrate_in", json!({ "spec": spec }))
    }

    /// `vm.migrate` of `name` on host `from` to a prepared destination (`prepared`, the
    /// `vm.migrate_in` result): the call's answer, an API error or a transport error (a daemon
    /// killed under it) as `Err` text.
    pub fn migrate(&self, from: usize, name: &str, prepared: &Value) -> Result<Value, String> {
        let mut c = self.hosts[from].client();
        c.call::<Value>(
            "vm.migrate",
            json!({ "name": name, "destination": prepared["address"], "secret": prepared["secret"] }),
        )
        .map_err(|e| e.to_string())
    }

    /// `vmhostctl migrate NAME --to-socket` (host `to`'s API socket) run against host `from`:
    /// its exit status, stdout and stderr.
    pub fn migrate_ctl(&self, from: usize, to: usize, name: &str) -> std::process::Output {
        let to_socket = self.hosts[to].socket.display().to_string();
        self.hosts[from].ctl(&["migrate", name, "--to-socket", &to_socket])
    }

    /// [`Pair::migrate_ctl`], which must succeed.
    ///
    /// # Panics
    /// When it fails, with its output and both daemons' logs' tails.
    pub fn migrate_ctl_ok(&self, from: usize, to: usize, name: &str) -> std::process::Output {
        let out = self.migrate_ctl(from, to, name);
        assert!(
            out.status.success(),
            "vmhostctl migrate --to-socket failed: {}\nstdout: {}\nstderr: {}\n--- source log:\n{}\n--- destination log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            tail(&self.hosts[from].daemon_log(), 60),
            tail(&self.hosts[to].daemon_log(), 60)
        );
        out
    }

    /// `vmhostctl VERB NAME --to-socket` (`migrate` or `move`, from host 0 to host 1) while host
    /// 1's vmhostd is killed at crash point `step` and started again: the command's output.
    pub fn ctl_while_destination_dies(&mut self, verb: &str, name: &str, step: &str) -> std::process::Output {
        self.hosts[1].arm_crash(step);
        let (from, to) = (self.hosts[0].socket.clone(), self.hosts[1].socket.display().to_string());
        let args = [verb.to_string(), name.to_string(), "--to-socket".into(), to];
        let call = std::thread::spawn(move || {
            std::process::Command::new(crate::bin("vmhostctl"))
                .arg("--socket")
                .arg(from)
                .args(&args)
                .output()
                .expect("run vmhostctl")
        });
        self.hosts[1].restart_after_crash(step);
        call.join().expect("the move's thread")
    }

    /// Waits until `name` runs on exactly one host with exactly one QEMU across both
    /// ([`settled_among`]); returns the host it runs on.
    ///
    /// # Panics
    /// When that is not so within `timeout`, with both hosts' views and logs' tails.
    pub fn settled(&self, name: &str, timeout: Duration) -> usize {
        settled_among(&self.hosts, name, timeout)
    }

    /// Asserts host `on` holds nothing of `name` ([`assert_clean_of`]).
    ///
    /// # Panics
    /// When something is left.
    pub fn assert_clean(&self, on: usize, name: &str, taps: &[String]) {
        assert_clean_of(&self.hosts[on], name, taps);
    }

    /// The tap names `name` has on host `on`.
    pub fn taps(&self, on: usize, name: &str) -> Vec<String> {
        taps_of(&self.hosts[on], name)
    }
}

/// Stops `h`'s daemon, gives it `[migration] listen = "ADDR:PORT"` and starts it again: the
/// daemon that wrote the config did not have the address yet (it binds it at start).
fn enable_port(h: &mut TestHost, addr: &str) {
    h.stop_daemon();
    let mut cfg = fs::read_to_string(&h.config).expect("read config");
    cfg.push_str(&format!("\n[migration]\nlisten = \"{addr}:{PORT}\"\n"));
    fs::write(&h.config, cfg).expect("write config");
    h.spawn_daemon();
}

/// Host `i`'s address on a [`Fleet`]'s bridge (`10.78.0.{i+1}`).
pub fn fleet_addr(i: usize) -> String {
    format!("10.78.0.{}", i + 1)
}

/// N hosts on one migration bridge, each with a migration port and the `lan` network.
pub struct Fleet {
    /// Host `i` is at [`fleet_addr`]`(i)`.
    pub hosts: Vec<TestHost>,
}

impl Fleet {
    /// Starts one daemon per `memory_gib` entry (its `hardware.memory_gib`), each in its
    /// namespace, joined by a bridge `migbr` in host 0's namespace (a veth `migpI` there for
    /// host I, named `mig0` on its side), each listening on its migration port.
    ///
    /// # Panics
    /// When a daemon does not start or a link cannot be made.
    pub fn start(memory_gib: &[u64]) -> Fleet {
        let mut hosts: Vec<TestHost> = memory_gib
            .iter()
            .map(|&mem| {
                TestHost::start(HostOptions {
                    netns: true,
                    extra: crate::LAN_NETWORK.to_string(),
                    memory_gib: mem,
                    sandbox: std::env::var("VMHOST_TEST_SANDBOX").unwrap_or_else(|_| "require".into()),
                    ..HostOptions::default()
                })
            })
            .collect();
        let h0 = &hosts[0];
        h0.ip(&["link", "add", "migbr", "type", "bridge"]);
        h0.ip(&["addr", "add", &format!("{}/24", fleet_addr(0)), "dev", "migbr"]);
        h0.ip(&["link", "set", "migbr", "up"]);
        for (i, h) in hosts.iter().enumerate().skip(1) {
            let ns = h.netns.clone().expect("netns");
            let port = format!("migp{i}");
            h0.ip(&["link", "add", &port, "type", "veth", "peer", "name", "mig0", "netns", &ns]);
            h0.ip(&["link", "set", &port, "master", "migbr"]);
            h0.ip(&["link", "set", &port, "up"]);
            h.ip(&["addr", "add", &format!("{}/24", fleet_addr(i)), "dev", "mig0"]);
            h.ip(&["link", "set", "mig0", "up"]);
        }
        for (i, h) in hosts.iter_mut().enumerate() {
            h.ip(&["link", "set", "lo", "up"]);
            enable_port(h, &fleet_addr(i));
        }
        Fleet { hosts }
    }
}

/// The spec of a counter guest named `name`: 256 MiB (or `memory_mib`), a NIC on `lan`,
/// a raw data disk `data` of 1 GiB (kept on destroy when `keep`) on which the guest writes
/// `VMHOSTMARK:{mark}` at boot.
pub fn counter_spec(name: &str, memory_mib: u64, mark: &str, keep: bool) -> Value {
    let g = counter_guest();
    json!({
        "name": name,
        "cpu": 1,
        "memory_mib": memory_mib,
        "boot": {
            "kernel": g.kernel,
            "initrd": g.initrd,
            "cmdline": format!("console=ttyS0 panic=-1 quiet vmhost.skipip vmhost.writemark=data:{mark}"),
        },
        "nics": [{ "network": "lan" }],
        "disks": [{ "name": "data", "size_gib": 1, "format": "raw", "keep_on_destroy": keep }],
    })
}

/// Creates the counter guest `spec` on `h` and waits until it wrote its marker and counts.
///
/// # Panics
/// When the guest does not come up within two minutes.
pub fn create_counter(h: &TestHost, spec: &Value) {
    let name = spec["name"].as_str().expect("spec name");
    h.call("vm.create", json!({ "spec": spec }));
    h.wait_serial_count(name, GUEST_READY, 1, Duration::from_secs(120));
    h.wait_serial_count(name, "VMHOST-WROTE data", 1, Duration::from_secs(60));
    h.wait_serial_count(name, "VMHOST-COUNT ", 3, Duration::from_secs(60));
}

/// The `vm.migrate_in` spec for moving `name` from `h`: its `vm.get` spec with each NIC's MAC
/// from its NIC view (what `vmhostctl migrate --to-socket` sends).
pub fn incoming_spec_of(h: &TestHost, name: &str) -> Value {
    let v = h.call("vm.get", json!({ "name": name }));
    let mut spec = v["spec"].clone();
    if let Some(nics) = spec["nics"].as_array_mut() {
        for (i, n) in nics.iter_mut().enumerate() {
            n["mac"] = v["nics"][i]["mac"].clone();
        }
    }
    spec
}

/// Waits until `name` runs on exactly one of `hosts` with exactly one QEMU across them all
/// (the others run none), and the others have no record of it; returns the host it runs on.
///
/// # Panics
/// When that is not so within `timeout`, with every host's view and log tail.
pub fn settled_among(hosts: &[TestHost], name: &str, timeout: Duration) -> usize {
    let mut last = String::new();
    let found = wait::poll(timeout, || {
        let views: Vec<Result<Value, String>> = hosts
            .iter()
            .map(|h| h.client().call::<Value>("vm.get", json!({ "name": name })).map_err(|e| e.to_string()))
            .collect();
        let qemus: Vec<usize> = hosts.iter().map(|h| h.qemu_pids().len()).collect();
        last = format!("views {views:?}; QEMUs {qemus:?}");
        let running: Vec<usize> =
            (0..hosts.len()).filter(|&i| views[i].as_ref().is_ok_and(|v| v["status"] == "running")).collect();
        let absent = (0..hosts.len()).filter(|&i| views[i].is_err()).count();
        match running.as_slice() {
            [on] if absent == hosts.len() - 1 && qemus[*on] == 1 && qemus.iter().sum::<usize>() == 1 => Ok(*on),
            _ => Err(last.clone()),
        }
    });
    match found {
        Ok(on) => on,
        Err(_) => {
            let logs: String = hosts
                .iter()
                .enumerate()
                .map(|(i, h)| format!("\n--- host {i} log tail:\n{}", tail(&h.daemon_log(), 40)))
                .collect();
            panic!("{name} did not settle on exactly one host within {timeout:?}: {last}{logs}")
        }
    }
}

/// Asserts `h` holds nothing of `name`: no record, no QEMU, no run dir, no disk directory
/// (kept disks aside: a destroy keeps them), no tap left in its namespace (`taps`: the tap
/// names the VM had there).
///
/// # Panics
/// When something is left.
pub fn assert_clean_of(h: &TestHost, name: &str, taps: &[String]) {
    let err = h.client().call::<Value>("vm.get", json!({ "name": name })).err().map(|e| e.to_string());
    assert!(err.is_some(), "{} still has a record of {name}", h.socket.display());
    assert_eq!(h.qemu_pids(), Vec::<i32>::new(), "{} still runs a QEMU", h.socket.display());
    assert!(!h.run().join(name).exists(), "{} kept {name}'s run dir", h.socket.display());
    let disks = h.state().join("disks").join(name);
    let left: Vec<String> = fs::read_dir(&disks)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "kept {name}'s disks dir {}: {left:?}", disks.display());
    let links: Vec<String> = h.links().iter().filter_map(|l| l["ifname"].as_str().map(str::to_string)).collect();
    for t in taps {
        assert!(!links.contains(t), "{} kept the tap {t}: {links:?}", h.socket.display());
    }
}

/// The tap names `name` has on `h`.
pub fn taps_of(h: &TestHost, name: &str) -> Vec<String> {
    let v = h.call("vm.get", json!({ "name": name }));
    v["nics"]
        .as_array()
        .map(|n| n.iter().filter_map(|n| n["tap"].as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// `spec` with its NIC's MAC set in the spec itself (`02:76:6d:00:00:01`), as an operator may
/// declare it: the spec the source runs is then the very spec the destination admits.
pub fn with_mac(mut spec: Value) -> Value {
    spec["nics"][0]["mac"] = json!("02:76:6d:00:00:01");
    spec
}

/// The first line of the raw data disk `data` of `name` on `host` (`STATE/disks/NAME/data.raw`
/// or, kept, `STATE/kept-disks/NAME/data.raw`): `VMHOSTMARK:WORD` after the guest wrote it.
pub fn disk_mark(path: &Path) -> String {
    let mut buf = [0u8; 64];
    let n = fs::File::open(path).and_then(|mut f| f.read(&mut buf)).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).lines().next().unwrap_or_default().trim_end_matches('\0').to_string()
}

/// Writes `VMHOSTMARK:{word}` over the first 64 bytes of the raw data disk at `path`, as the
/// guest writes its marker.
///
/// # Panics
/// When the file cannot be written.
pub fn set_mark(path: &Path, word: &str) {
    use std::io::Write;
    let mut line = format!("VMHOSTMARK:{word}\n").into_bytes();
    line.resize(64, 0);
    let mut f = fs::OpenOptions::new().write(true).open(path).expect("open the data disk");
    f.write_all(&line).expect("write the marker");
    f.sync_all().expect("sync");
}

/// Host `h`'s data disk `data` of `name`.
pub fn data_disk(h: &TestHost, name: &str) -> PathBuf {
    h.state().join("disks").join(name).join("data.raw")
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One counter line as it arrived: when, on which host, the boot id and the count.
#[derive(Debug, Clone)]
pub struct Tick {
    /// When the watcher read it.
    pub at: Instant,
    /// Host index.
    pub host: usize,
    /// The guest's boot id.
    pub boot: String,
    /// The count.
    pub n: u64,
}

/// Follows `name`'s serial log on both hosts from now on, timestamping each counter line as
/// it arrives (looking every 5 ms: the gap is measured to that).
pub struct CounterWatch {
    stop: Arc<AtomicBool>,
    ticks: Arc<Mutex<Vec<Tick>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CounterWatch {
    /// Starts following both logs of `name` in `pair` (each from its current end).
    pub fn start(pair: &Pair, name: &str) -> CounterWatch {
        let logs: Vec<PathBuf> =
            pair.hosts.iter().map(|h| h.state().join("logs").join(format!("{name}.serial.log"))).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let ticks = Arc::new(Mutex::new(Vec::new()));
        let (s, t) = (stop.clone(), ticks.clone());
        let thread = std::thread::spawn(move || {
            let mut offsets: Vec<u64> = logs.iter().map(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0)).collect();
            let mut partial = [String::new(), String::new()];
            while !s.load(Ordering::Relaxed) {
                for (i, p) in logs.iter().enumerate() {
                    let Ok(mut f) = fs::File::open(p) else { continue };
                    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                    if len < offsets[i] {
                        offsets[i] = 0; // a new log (the destination's) or one trimmed
                    }
                    if len == offsets[i] || f.seek(SeekFrom::Start(offsets[i])).is_err() {
                        continue;
                    }
                    let mut buf = Vec::new();
                    let Ok(n) = f.take(len - offsets[i]).read_to_end(&mut buf) else { continue };
                    offsets[i] += n as u64;
                    let now = Instant::now();
                    partial[i].push_str(&String::from_utf8_lossy(&buf));
                    while let Some(pos) = partial[i].find('\n') {
                        let line: String = partial[i].drain(..=pos).collect();
                        if let Some((boot, n)) = parse_tick(&line) {
                            t.lock().unwrap_or_else(|e| e.into_inner()).push(Tick { at: now, host: i, boot, n });
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        CounterWatch { stop, ticks, thread: Some(thread) }
    }

    /// Every tick seen so far.
    pub fn ticks(&self) -> Vec<Tick> {
        self.ticks.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops following; every tick seen.
    pub fn finish(mut self) -> Vec<Tick> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.ticks()
    }
}

impl Drop for CounterWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `VMHOST-COUNT <boot> <n>` anywhere in a console line (the kernel's messages may precede it).
pub fn parse_tick(line: &str) -> Option<(String, u64)> {
    let rest = &line[line.find("VMHOST-COUNT ")? + "VMHOST-COUNT ".len()..];
    let mut parts = rest.split_whitespace();
    let boot = parts.next()?.to_string();
    let n = parts.next()?.parse().ok()?;
    Some((boot, n))
}

/// What a migration did to the counter: the last count on the source, the first on the
/// destination, and the longest time between two consecutive counts (across the switch).
#[derive(Debug, Clone)]
pub struct Continuity {
    /// Boot ids seen (one if the guest never restarted).
    pub boots: Vec<String>,
    /// The last count the source's log showed.
    pub last_on_source: Option<u64>,
    /// The first count the destination's log showed.
    pub first_on_destination: Option<u64>,
    /// The longest interval between two ticks in arrival order.
    pub largest_gap: Duration,
    /// Ticks on the destination.
    pub on_destination: usize,
}

/// Reads `ticks` of a move from host `from` to host `to`.
pub fn continuity(ticks: &[Tick], from: usize, to: usize) -> Continuity {
    let mut boots: Vec<String> = Vec::new();
    for t in ticks {
        if !boots.contains(&t.boot) {
            boots.push(t.boot.clone());
        }
    }
    let last_on_source = ticks.iter().filter(|t| t.host == from).map(|t| t.n).max();
    let first_on_destination = ticks.iter().find(|t| t.host == to).map(|t| t.n);
    let largest_gap = ticks.windows(2).map(|w| w[1].at.saturating_duration_since(w[0].at)).max().unwrap_or_default();
    Continuity {
        boots,
        last_on_source,
        first_on_destination,
        largest_gap,
        on_destination: ticks.iter().filter(|t| t.host == to).count(),
    }
}

impl Continuity {
    /// Asserts the guest went on across the move: one boot id, the destination's first count
    /// right after the source's last (a line cut by the switch is split over both logs, so the
    /// next whole one may be one later), no stand-still of 10 s.
    ///
    /// # Panics
    /// When it did not.
    pub fn assert_went_on(&self) {
        assert_eq!(self.boots.len(), 1, "the guest restarted: boot ids {:?}", self.boots);
        let last = self.last_on_source.expect("ticks on the source");
        let first = self.first_on_destination.expect("ticks on the destination");
        assert!(
            first > last && first <= last + 2,
            "the counter did not go on from where it was: last {last} on the source, first {first} on the destination"
        );
        assert!(self.largest_gap < Duration::from_secs(10), "the guest stood still {:?}", self.largest_gap);
    }
}
