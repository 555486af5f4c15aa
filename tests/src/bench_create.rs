//! vmhost-bench's `create` and `ports` sections (docs/performance.md, "vm.create, step by step").
//!
//! `create`: in each round, alternating which goes first, `vm.create` of a direct-kernel VM (the
//! test guest, 1 vCPU, 128 MiB, no NIC) until its answer (QEMU running and answering QMP), and
//! raw QEMU started by the bench with the argv and descriptors vmhostd gave its QEMU, timed to
//! its first QMP answer (`query-status` after the greeting and `qmp_capabilities`, as vmhostd's
//! own check). Prints both medians, their ratio, and the cost of each step of the create: the
//! time between the step events vmhostd logs at debug level (`vmhost::step`, one at every crash
//! point and around QEMU's spawn, `daemon/src/crashpoint.rs`) and its status changes (info
//! events, so a build without step events still splits the create in three), from the client's
//! send to its answer, medians over the rounds.
//!
//! `ports`: the TCG boot of the test guest to its `VMHOST-GUEST-READY` serial line, raw QEMU with
//! vmhostd's argv and 0, 1, 2 and 4 spare hot-plug root ports, alternating in each round.
//!
//! The raw QEMU gets what vmhostd's got, made anew: a listening socket of its own for each
//! socket, a sealed-like memfd with the same bytes for each memfd (the kernel and initrd), a new
//! file in a temp dir for each file it writes, the same file for each it only reads; the same
//! descriptor numbers, user and group. Prints figures; asserts nothing about time.
//!
//! A module of the bench binary (`#[path]` in bench.rs), not of the tests library.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use vmhost_tests::{argv_of, percentile, plain_log, HostOptions, TestHost};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    percentile(&v, 0.5)
}

/// What one descriptor of vmhostd's QEMU is, so the raw QEMU can get its own of the same kind.
#[derive(Debug, Clone)]
enum Passed {
    /// A listening Unix socket (a monitor, the console, the agent's port).
    Socket,
    /// A memfd (a sealed copy of the kernel or initrd), with its bytes.
    Memfd(Vec<u8>),
    /// A file QEMU only reads.
    ReadOnly(PathBuf),
    /// A file QEMU writes (the serial log): a new one in the raw QEMU's dir.
    Written,
}

/// vmhostd's QEMU, as the raw QEMU repeats it.
#[derive(Debug, Clone)]
pub struct RawTemplate {
    binary: String,
    args: Vec<String>,
    fds: Vec<(i32, Passed)>,
    /// The descriptor of the control monitor (`-mon ...,mode=control` on `-chardev socket,...,fd=N`).
    qmp_fd: i32,
    /// The descriptor the serial console goes to, when it is a passed socket or file.
    serial_fd: Option<i32>,
    uid: u32,
    gid: u32,
}

/// The numbers after `fd=`, `/dev/fd/` and `/proc/self/fd/` in `arg`.
fn fd_numbers(arg: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for marker in ["fd=", "/dev/fd/", "/proc/self/fd/"] {
        for piece in arg.split(marker).skip(1) {
            let digits: String = piece.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(n) = digits.parse() {
                out.push(n);
            }
        }
    }
    out
}

/// The value of `key=` in a QEMU option string (`socket,id=qmp,fd=3`).
fn option<'a>(opts: &'a str, key: &str) -> Option<&'a str> {
    opts.split(',').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// The `fd=` of the `-chardev` with id `id`.
fn chardev_fd(args: &[String], id: &str) -> Option<i32> {
    args.windows(2)
        .filter(|w| w[0] == "-chardev")
        .find(|w| option(&w[1], "id") == Some(id))
        .and_then(|w| option(&w[1], "fd")?.parse().ok())
}

impl RawTemplate {
    /// Reads QEMU `pid`'s argv, passed descriptors and user.
    pub fn capture(pid: i32) -> RawTemplate {
        let mut argv = argv_of(i64::from(pid));
        while argv.last().is_some_and(String::is_empty) {
            argv.pop();
        }
        let binary = argv.remove(0);
        let mut numbers: Vec<i32> = argv.iter().flat_map(|a| fd_numbers(a)).filter(|n| *n > 2).collect();
        numbers.sort_unstable();
        numbers.dedup();
        let fds = numbers
            .into_iter()
            .map(|n| {
                let link = fs::read_link(format!("/proc/{pid}/fd/{n}")).expect("a descriptor the argv names");
                let link = link.to_string_lossy().into_owned();
                let passed = if link.starts_with("socket:") {
                    Passed::Socket
                } else if link.starts_with("/memfd:") {
                    let mut bytes = Vec::new();
                    fs::File::open(format!("/proc/{pid}/fd/{n}"))
                        .and_then(|mut f| f.read_to_end(&mut bytes))
                        .expect("memfd");
                    Passed::Memfd(bytes)
                } else if !link.starts_with('/') {
                    // An `-add-fd` descriptor QEMU moved into its fd set and closed (the number
                    // is reused): the serial log, the only one a direct-kernel VM without disks
                    // has.
                    Passed::Written
                } else {
                    let info = fs::read_to_string(format!("/proc/{pid}/fdinfo/{n}")).unwrap_or_default();
                    let flags = info
                        .lines()
                        .find_map(|l| l.strip_prefix("flags:"))
                        .and_then(|f| i32::from_str_radix(f.trim(), 8).ok())
                        .unwrap_or(0);
                    if flags & libc::O_ACCMODE == libc::O_RDONLY {
                        Passed::ReadOnly(PathBuf::from(link))
                    } else {
                        Passed::Written
                    }
                };
                (n, passed)
            })
            .collect();
        let mon = argv
            .windows(2)
            .filter(|w| w[0] == "-mon" && option(&w[1], "mode") == Some("control"))
            .filter_map(|w| option(&w[1], "chardev").map(str::to_string))
            .collect::<Vec<_>>();
        let qmp_id = mon.iter().find(|id| *id == "qmp").or(mon.first()).expect("a control monitor");
        let qmp_fd = chardev_fd(&argv, qmp_id).expect("the control monitor's descriptor");
        let serial_id = argv
            .windows(2)
            .find(|w| w[0] == "-serial" && w[1].starts_with("chardev:"))
            .map(|w| w[1]["chardev:".len()..].to_string());
        let serial_fd = serial_id.as_deref().and_then(|id| chardev_fd(&argv, id));
        let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("QEMU's status");
        let id_of = |field: &str| -> u32 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .expect("uid and gid")
        };
        RawTemplate { binary, args: argv, fds, qmp_fd, serial_fd, uid: id_of("Uid:"), gid: id_of("Gid:") }
    }

    /// The argv with only the first `spare` of the hot-plug root ports (`pcie-root-port,id=hpN`;
    /// a VM without data disks has only spare ones).
    fn with_spare_ports(&self, spare: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.args.len() {
            let a = &self.args[i];
            let port = self.args.get(i + 1).and_then(|v| v.strip_prefix("pcie-root-port,id=hp"));
            if a == "-device" {
                if let Some(n) = port.and_then(|p| p.split(',').next()?.parse::<usize>().ok()) {
                    if n >= spare {
                        i += 2;
                        continue;
                    }
                }
            }
            out.push(a.clone());
            i += 1;
        }
        out
    }

    /// How many hot-plug root ports the argv has.
    fn ports(&self) -> usize {
        self.args.iter().filter(|a| a.starts_with("pcie-root-port,id=hp")).count()
    }

    /// Starts QEMU with `args` in `dir`, each descriptor made anew (see the module doc).
    fn spawn(&self, dir: &Path, args: &[String]) -> RawQemu {
        let mut keep = Vec::new();
        let mut high = Vec::new();
        let mut socket_of = BTreeMap::new();
        let mut file_of = BTreeMap::new();
        for (n, passed) in &self.fds {
            let fd: OwnedFd = match passed {
                Passed::Socket => {
                    let path = dir.join(format!("s{n}"));
                    let _ = fs::remove_file(&path);
                    socket_of.insert(*n, path.clone());
                    UnixListener::bind(&path).expect("bind").into()
                }
                Passed::Memfd(bytes) => {
                    let name = std::ffi::CString::new("raw-boot-file").expect("name");
                    // SAFETY: memfd_create with a valid C string; the fd is owned at once.
                    let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
                    assert!(raw >= 0, "memfd_create");
                    // SAFETY: a descriptor just made and owned by nothing else.
                    let mut f = unsafe { fs::File::from_raw_fd(raw) };
                    f.write_all(bytes).expect("fill memfd");
                    f.into()
                }
                Passed::ReadOnly(path) => fs::File::open(path).expect("open read-only file").into(),
                Passed::Written => {
                    let path = dir.join(format!("f{n}"));
                    file_of.insert(*n, path.clone());
                    fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).expect("file").into()
                }
            };
            // Above every target number, so the dup2s in the child cannot overwrite a source.
            // SAFETY: fcntl on a descriptor we own.
            let moved = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 1000) };
            assert!(moved >= 0, "F_DUPFD_CLOEXEC");
            // SAFETY: a descriptor just made and owned by nothing else.
            high.push((*n, unsafe { OwnedFd::from_raw_fd(moved) }));
            keep.push(fd);
        }
        drop(keep);
        let log = fs::File::create(dir.join("stderr")).expect("stderr file");
        let mut cmd = Command::new(&self.binary);
        cmd.args(args).stdin(Stdio::null()).stdout(log.try_clone().expect("dup")).stderr(log);
        let pairs: Vec<(i32, i32)> = high.iter().map(|(n, fd)| (*n, fd.as_raw_fd())).collect();
        let (uid, gid) = (self.uid, self.gid);
        // SAFETY: only async-signal-safe calls between fork and exec, nothing allocated.
        unsafe {
            cmd.pre_exec(move || {
                for (target, source) in &pairs {
                    if libc::dup2(*source, *target) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        // Timed from here: vmhostd keeps its sealed copies, so making ours is not QEMU's start.
        let started = Instant::now();
        let child = cmd.spawn().expect("spawn raw QEMU");
        // QEMU has its copies: ours go, as vmhostd's do after a launch.
        drop(high);
        let qmp = socket_of.get(&self.qmp_fd).cloned().expect("the monitor's socket");
        let serial = self.serial_fd.map(|n| match (socket_of.get(&n), file_of.get(&n)) {
            (Some(s), _) => Serial::Socket(s.clone()),
            (_, Some(f)) => Serial::File(f.clone()),
            _ => panic!("the serial console's descriptor {n} is neither a socket nor a written file"),
        });
        RawQemu { child, qmp, serial, started }
    }
}

/// Where the raw QEMU's serial console goes.
enum Serial {
    Socket(PathBuf),
    File(PathBuf),
}

/// A raw QEMU the bench started.
struct RawQemu {
    child: Child,
    qmp: PathBuf,
    serial: Option<Serial>,
    /// When QEMU was spawned (after its descriptors were made).
    started: Instant,
}

impl RawQemu {
    /// Connects to the control monitor and returns once `query-status` is answered.
    fn first_answer(&self) -> UnixStream {
        let stream = UnixStream::connect(&self.qmp).expect("connect to QMP");
        stream.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let mut reader = BufReader::new(stream.try_clone().expect("dup"));
        let mut line = String::new();
        reader.read_line(&mut line).expect("greeting");
        assert!(line.contains("\"QMP\""), "not a QMP greeting: {line}");
        let mut w = stream.try_clone().expect("dup");
        for cmd in [json!({"execute": "qmp_capabilities"}), json!({"execute": "query-status"})] {
            writeln!(w, "{cmd}").expect("write QMP");
            loop {
                line.clear();
                assert!(reader.read_line(&mut line).expect("QMP answer") > 0, "QEMU closed QMP");
                let v: Value = serde_json::from_str(&line).expect("QMP JSON");
                if v.get("return").is_some() {
                    break;
                }
                assert!(v.get("error").is_none(), "{cmd}: {v}");
            }
        }
        stream
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Seconds since midnight (UTC) of a log line's RFC 3339 timestamp.
fn log_time(line: &str) -> Option<f64> {
    let time = line.split_whitespace().next()?.split('T').nth(1)?.trim_end_matches('Z');
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Seconds since midnight (UTC) now, on the clock the daemon's log uses.
fn now_of_day() -> f64 {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) / 1e9
}

/// The step events of VM `vm` in `log`, and its status changes (`status creating`): (seconds
/// of day, step).
fn steps_of(log: &str, vm: &str) -> Vec<(f64, String)> {
    let (alone, first) = (format!("{{vm={vm}}}"), format!("{{vm={vm} "));
    plain_log(log)
        .lines()
        .filter(|l| l.contains(&alone) || l.contains(&first))
        .filter_map(|l| {
            let step = if l.contains("vmhost::step:") {
                l.split("step=").nth(1)?.trim_matches('"').split('"').next()?.to_string()
            } else if l.contains("vmhost::events: vm event") {
                // Status changes are logged by every build, also one without step events.
                format!("status {}", l.split("to=Some(").nth(1)?.split(')').next()?.to_lowercase())
            } else {
                return None;
            };
            Some((log_time(l)?, step))
        })
        .collect()
}

/// The intervals of one create: client send → first step → ... → last step → answer.
fn intervals(sent: f64, answered: f64, steps: &[(f64, String)]) -> Vec<(String, Duration)> {
    let mut out = Vec::new();
    let mut prev = (sent, "request sent".to_string());
    for (t, step) in steps.iter().cloned().chain(std::iter::once((answered, "answer read".to_string()))) {
        // Midnight between the two: a day later.
        let dt = if t < prev.0 { t + 86_400.0 - prev.0 } else { t - prev.0 };
        out.push((format!("{} → {}", prev.1, step), Duration::from_secs_f64(dt.max(0.0))));
        prev = (t, step);
    }
    out
}

/// A direct-kernel spec of the test guest: 1 vCPU, 128 MiB, no NIC.
fn spec(name: &str) -> Value {
    let g = vmhost_tests::guest();
    json!({"name": name, "cpu": 1, "memory_mib": 128,
        "boot": {"kernel": g.kernel, "initrd": g.initrd, "cmdline": "console=ttyS0 panic=-1 quiet"}})
}

/// One `vm.create` on `client`: its time and its intervals.
fn vmhost_create(
    host: &TestHost,
    client: &mut vmhost::client::Client,
    name: &str,
) -> (Duration, Vec<(String, Duration)>) {
    let from = fs::metadata(host.dir.path().join("vmhostd.log")).map(|m| m.len()).unwrap_or(0) as usize;
    let sent = now_of_day();
    let t = Instant::now();
    let v: Value = client.call("vm.create", json!({ "spec": spec(name) })).expect("vm.create");
    let took = t.elapsed();
    let answered = now_of_day();
    assert_eq!(v["vm"]["status"], "running", "{v}");
    let log = host.daemon_log();
    let steps = steps_of(log.get(from..).unwrap_or(&log), name);
    (took, intervals(sent, answered, &steps))
}

/// The `create` section (see the module doc): `rounds` alternating pairs after one warm-up each.
pub fn create(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let host = TestHost::start(HostOptions::default());
    let mut client = host.client();
    let dir = tempfile::Builder::new().prefix("raw").tempdir_in("/tmp").expect("tempdir");
    // Warm-up: the copies of the boot files made, the page cache filled; its QEMU is the template.
    let _ = vmhost_create(&host, &mut client, "warm");
    let pid = *host.qemu_pids().first().expect("the warm-up VM's QEMU");
    let template = RawTemplate::capture(pid);
    let _: Value = client.call("vm.destroy", json!({"name": "warm"})).expect("destroy");
    let raw_once = || {
        let q = template.spawn(dir.path(), &template.args);
        let _qmp = q.first_answer();
        let took = q.started.elapsed();
        q.stop();
        took
    };
    let _ = raw_once();
    let (mut vm_times, mut raw_times) = (Vec::new(), Vec::new());
    let mut steps: Vec<(String, Vec<Duration>)> = Vec::new();
    for r in 0..rounds {
        let name = format!("c{r}");
        let mut vmhost_round = || {
            let (took, iv) = vmhost_create(&host, &mut client, &name);
            vm_times.push(took);
            for (label, d) in iv {
                match steps.iter_mut().find(|(l, _)| *l == label) {
                    Some((_, v)) => v.push(d),
                    None => steps.push((label, vec![d])),
                }
            }
        };
        if r % 2 == 0 {
            vmhost_round();
            raw_times.push(raw_once());
        } else {
            raw_times.push(raw_once());
            vmhost_round();
        }
        let _: Value = client.call("vm.destroy", json!({"name": name})).expect("destroy");
    }
    let (vm, raw) = (median(&vm_times), median(&raw_times));
    println!();
    println!(
        "vm.create of a direct-kernel VM (1 vCPU, 128 MiB, no NIC, TCG) to its answer, against raw QEMU with the \
         same argv ({} args, {} hot-plug root ports) to its first QMP answer; {rounds} alternating rounds",
        template.args.len(),
        template.ports()
    );
    println!("| | median (ms) | p90 (ms) | min (ms) |");
    println!("|---|---:|---:|---:|");
    for (what, v) in [("vmhost `vm.create`", &vm_times), ("raw QEMU to first QMP answer", &raw_times)] {
        let mut s = v.clone();
        s.sort();
        println!("| {what} | {:.1} | {:.1} | {:.1} |", ms(percentile(&s, 0.5)), ms(percentile(&s, 0.9)), ms(s[0]));
    }
    println!("| ratio vmhost / raw (medians) | {:.2} | | |", vm.as_secs_f64() / raw.as_secs_f64().max(1e-9));
    println!();
    println!("vm.create step by step (vmhostd's `vmhost::step` debug events; medians of {rounds} rounds)");
    println!("| step | median (ms) | p90 (ms) | rounds |");
    println!("|---|---:|---:|---:|");
    let mut sum = Duration::ZERO;
    for (label, v) in &steps {
        let mut s = v.clone();
        s.sort();
        sum += percentile(&s, 0.5);
        println!("| {label} | {:.2} | {:.2} | {} |", ms(percentile(&s, 0.5)), ms(percentile(&s, 0.9)), s.len());
    }
    println!("| sum of the medians | {:.1} | | |", ms(sum));
}

/// How long the raw QEMU's guest takes to print [`vmhost_tests::GUEST_READY`] on its serial console.
fn boot_to_ready(template: &RawTemplate, dir: &Path, args: &[String]) -> Duration {
    let q = template.spawn(dir, args);
    let t = q.started;
    let deadline = t + Duration::from_secs(300);
    let found = match &q.serial {
        Some(Serial::Socket(path)) => {
            let mut s = UnixStream::connect(path).expect("connect to the console");
            s.set_read_timeout(Some(Duration::from_secs(300))).expect("timeout");
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break false,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
                if memchr::memmem::find(&seen, vmhost_tests::GUEST_READY.as_bytes()).is_some() {
                    break true;
                }
            }
        }
        Some(Serial::File(path)) => loop {
            if fs::read(path).is_ok_and(|b| memchr::memmem::find(&b, vmhost_tests::GUEST_READY.as_bytes()).is_some()) {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            // A benchmark's poll of a file (no event for a write to it): 10 ms of resolution.
            std::thread::sleep(Duration::from_millis(10));
        },
        None => panic!("the serial console goes to no passed descriptor"),
    };
    let took = t.elapsed();
    q.stop();
    assert!(found, "the guest did not print {}", vmhost_tests::GUEST_READY);
    took
}

/// The `ports` section (see the module doc): `rounds` rounds of 0, 1, 2 and 4 spare ports,
/// the order rotated in each round.
pub fn ports(rounds: usize) {
    if rounds == 0 {
        return;
    }
    let template = {
        let host = TestHost::start(HostOptions::default());
        let mut client = host.client();
        let _: Value = client.call("vm.create", json!({ "spec": spec("ports") })).expect("vm.create");
        let pid = *host.qemu_pids().first().expect("the VM's QEMU");
        let t = RawTemplate::capture(pid);
        let _: Value = client.call("vm.destroy", json!({"name": "ports"})).expect("destroy");
        t
    };
    assert!(template.ports() >= 4 || template.ports() == 0, "expected vmhostd's QEMU to have spare ports");
    let dir = tempfile::Builder::new().prefix("raw").tempdir_in("/tmp").expect("tempdir");
    let counts = [0usize, 1, 2, 4];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); counts.len()];
    for r in 0..rounds {
        for k in 0..counts.len() {
            let i = (r + k) % counts.len();
            let args = template.with_spare_ports(counts[i]);
            times[i].push(boot_to_ready(&template, dir.path(), &args));
        }
    }
    println!();
    println!(
        "TCG boot of the test guest (1 vCPU, 128 MiB) to its {} serial line, raw QEMU with vmhostd's argv and N spare \
         hot-plug root ports; {rounds} rounds, order rotated",
        vmhost_tests::GUEST_READY
    );
    println!("| spare ports | median (s) | min (s) | max (s) | median / 0 ports |");
    println!("|---:|---:|---:|---:|---:|");
    let base = median(&times[0]).as_secs_f64();
    for (i, n) in counts.iter().enumerate() {
        let mut s = times[i].clone();
        s.sort();
        let m = percentile(&s, 0.5).as_secs_f64();
        println!(
            "| {n} | {m:.3} | {:.3} | {:.3} | {:.3} |",
            s[0].as_secs_f64(),
            s[s.len() - 1].as_secs_f64(),
            m / base.max(1e-9)
        );
    }
}
