//! vmhost-compare interrupted: SIGINT while a guest boots under its vmhostd must stop everything
//! it started, remove its temp dirs and exit with 130 after one line on stderr.
//!
//! `--vmhost-boot-only` keeps libvirt out of it (nothing to install); the interrupt comes in the
//! first measured round, when vmhostd, a QEMU and possibly a `vmhostctl` are running. The test
//! process makes itself a child subreaper, so whatever vmhost-compare started stays this
//! process's descendant even after its parent is gone, and "nothing left" is checked on the
//! whole tree, not only on what the test knew to look for. This file holds one test on purpose:
//! the subreaper setting and the descendant check cover the whole test process.
//!
//! Needs `cargo build --workspace --bins` first (vmhostd and vmhostctl), like the other
//! end-to-end tests; vmhost-compare itself is built by cargo for this test.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vmhost_tests::wait;

/// How long vmhost-compare, and then what it started, may take to be gone after SIGINT (a
/// failure bound: the test goes on as soon as they are).
const EXIT: Duration = Duration::from_secs(120);

/// A live process: parent pid and command line.
struct Proc {
    ppid: u32,
    cmdline: String,
}

/// Every process that is not a zombie (or already dead), by pid.
fn live_processes() -> BTreeMap<u32, Proc> {
    let mut out = BTreeMap::new();
    let Ok(entries) = fs::read_dir("/proc") else { return out };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("X");
        let ppid = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if state == "Z" || state == "X" {
            continue;
        }
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ").trim().to_string();
        out.insert(pid, Proc { ppid, cmdline });
    }
    out
}

/// Live processes below `root` (not `root` itself).
fn descendants(root: u32) -> BTreeMap<u32, String> {
    let all = live_processes();
    let mut out = BTreeMap::new();
    for (&pid, p) in &all {
        let mut up = p.ppid;
        for _ in 0..64 {
            if up == root {
                out.insert(pid, p.cmdline.clone());
                break;
            }
            match all.get(&up) {
                Some(parent) if up > 1 => up = parent.ppid,
                _ => break,
            }
        }
    }
    out
}

#[test]
fn sigint_stops_everything_vmhost_compare_started() {
    // Orphans of vmhost-compare's children (a QEMU whose vmhostd is gone) re-parent to this
    // process instead of PID 1, so they remain visible as descendants.
    nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
    let me = std::process::id();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmhost-compare"))
        .args(["--vmhost-boot-only", "--rounds", "50"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vmhost-compare");
    let pid = child.id();
    let stderr = Arc::new(Mutex::new(String::new()));
    let mut pipe = child.stderr.take().expect("stderr");
    let sink = Arc::clone(&stderr);
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().expect("stderr lock").push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    let text = || stderr.lock().expect("stderr lock").clone();

    // The known point: the first measured round, with its QEMU running.
    let round1 = wait::poll(Duration::from_secs(300), || {
        if let Some(st) = child.try_wait().expect("try_wait") {
            panic!("vmhost-compare exited with {st} before the first round; stderr:\n{}", text());
        }
        let tree = descendants(me);
        if text().contains("round 1 of") && tree.values().any(|c| c.contains("qemu-system")) {
            Ok(tree)
        } else {
            Err(format!("its tree: {tree:#?}"))
        }
    });
    let before = round1.unwrap_or_else(|last| {
        let _ = child.kill();
        panic!("no QEMU in round 1 within 300 s ({last}); stderr:\n{}", text());
    });
    assert!(before.values().any(|c| c.contains("vmhostd")), "no vmhostd running: {before:#?}");
    let dirs: Vec<PathBuf> =
        text().lines().filter_map(|l| l.strip_prefix("vmhost-compare: temp dir ")).map(PathBuf::from).collect();
    assert!(dirs.len() >= 2, "expected the work dir and vmhostd's dir on stderr:\n{}", text());
    for d in &dirs {
        assert!(d.is_dir(), "{} named but missing", d.display());
    }

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGINT)
        .expect("send SIGINT");
    let t = Instant::now();
    let status = wait::poll(EXIT, || child.try_wait().expect("try_wait").ok_or_else(String::new)).ok();
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = reader.join();
    let took = t.elapsed();

    // A SIGKILLed process needs a moment to finish exiting after vmhost-compare returns (the
    // QEMUs are not its children, so it does not wait for them): the tree is waited on until
    // it is empty; what is still there after a generous bound (a failure bound, not a speed)
    // is a leak.
    let mut left = descendants(me);
    if let Err(still) = wait::poll(EXIT, || {
        left = descendants(me);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:#?}"))
        }
    }) {
        eprintln!("descendants still there {EXIT:?} after vmhost-compare exited: {still}");
    }
    // Also anything anywhere naming one of its dirs (e.g. a process that changed its parent).
    for (pid, p) in live_processes() {
        if dirs.iter().any(|d| p.cmdline.contains(&*d.to_string_lossy())) && pid != me {
            left.insert(pid, p.cmdline);
        }
    }
    let dirs_left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
    // Clean up after a failure before asserting, so a broken cleanup does not leak into the
    // machine's next test run.
    for &pid in left.keys() {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL);
    }
    for d in &dirs_left {
        let _ = fs::remove_dir_all(d);
    }
    // Reap the orphans this subreaper inherited.
    while let Ok(nix::sys::wait::WaitStatus::Exited(..) | nix::sys::wait::WaitStatus::Signaled(..)) =
        nix::sys::wait::waitpid(None, Some(nix::sys::wait::WaitPidFlag::WNOHANG))
    {}

    let text = text();
    let status =
        status.unwrap_or_else(|| panic!("vmhost-compare still running {EXIT:?} after SIGINT; stderr:\n{text}"));
    eprintln!("vmhost-compare exited {took:?} after SIGINT; before it, its tree was {before:#?}");
    assert_eq!(status.code(), Some(130), "exit status {status}; stderr:\n{text}");
    let last = text.lines().last().unwrap_or_default();
    assert!(last.starts_with("vmhost-compare: interrupted by SIGINT"), "last stderr line {last:?}; stderr:\n{text}");
    assert!(!text.contains("panicked"), "a panic message after the interrupt:\n{text}");
    assert!(left.is_empty(), "processes left after vmhost-compare exited: {left:#?}");
    assert!(dirs_left.is_empty(), "temp dirs left: {dirs_left:?}");
}
