//! Test-only hook (compiled only with debug assertions, so never in a release build): after the
//! sandbox is in force, try what it must forbid and print each outcome on stderr, for
//! tests/tests/sandbox.rs to check.
//!
//! Asked for with the environment variable [`VAR`] set to a path outside the daemon's
//! directories; it is read before the environment is cleared. Lines look like
//! `sandbox-probe: read /etc/shadow: errno 13`.

use std::io::Write;
use std::path::Path;

/// The variable naming the path the probe tries to create.
pub const VAR: &str = "VMHOST_TEST_SANDBOX_PROBE";

/// Optional: comma-separated files the probe opens for writing (and closes without writing a
/// byte, so a sysfs `remove` it could open removes nothing): `open-for-write PATH: ...` lines.
pub const OPEN_VAR: &str = "VMHOST_TEST_SANDBOX_PROBE_OPEN";

/// The probe's target path and the files to open, when the variable is set.
pub fn requested() -> Option<(String, Vec<String>)> {
    let outside = std::env::var(VAR).ok().filter(|v| !v.is_empty())?;
    let opens = std::env::var(OPEN_VAR).unwrap_or_default();
    Some((outside, opens.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect()))
}

fn outcome(r: std::io::Result<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) => format!("errno {}", e.raw_os_error().unwrap_or(-1)),
    }
}

/// Runs every probe.
pub fn run(outside: &str, opens: &[String]) {
    let mut lines = Vec::new();
    for path in opens {
        let opened = std::fs::OpenOptions::new().write(true).open(path).map(|_| ());
        lines.push(format!("open-for-write {path}: {}", outcome(opened)));
    }
    let read_shadow = std::fs::File::open("/etc/shadow").map(|_| ());
    lines.push(format!("read /etc/shadow: {}", outcome(read_shadow)));
    let create = std::fs::write(outside, b"escaped\n");
    lines.push(format!("create {outside}: {}", outcome(create)));
    let exec = std::process::Command::new("/bin/true").status().map(|_| ());
    lines.push(format!("exec /bin/true: {}", outcome(exec)));
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").map(|_| ());
    lines.push(format!("tcp bind: {}", outcome(tcp)));
    let unshare = {
        // SAFETY: unshare with a flag; must be refused here.
        let r = unsafe { libc::unshare(libc::CLONE_NEWNS) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    lines.push(format!("unshare: {}", outcome(unshare)));
    let last = |r: libc::c_long| if r == -1 { Err(std::io::Error::last_os_error()) } else { Ok(()) };
    // SAFETY: unshare with a flag; must be refused here.
    lines.push(format!("unshare user: {}", outcome(last(unsafe { libc::unshare(libc::CLONE_NEWUSER) }.into()))));
    // Mode 0666 is /dev/null's own: harmless even if it were allowed.
    // SAFETY: chmod with a valid C string.
    lines.push(format!(
        "chmod /dev/null: {}",
        outcome(last(unsafe { libc::chmod(c"/dev/null".as_ptr(), 0o666) }.into()))
    ));
    // SAFETY: a raw fork-like clone; a child that exists leaves at once.
    let fork =
        unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
    if fork == 0 {
        // SAFETY: leave the child without running anything of the parent's.
        unsafe { libc::_exit(0) };
    }
    lines.push(format!("fork: {}", outcome(last(fork.min(0)))));
    let mut args = [0u64; 11];
    // SAFETY: clone3 with a valid (zeroed) struct of its size; answered before it is read.
    let clone3 = unsafe { libc::syscall(libc::SYS_clone3, args.as_mut_ptr(), std::mem::size_of_val(&args)) };
    if clone3 == 0 {
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    lines.push(format!("clone3: {}", outcome(last(clone3.min(0)))));
    let state_ok = Path::new("/proc/self/status").exists();
    lines.push(format!("proc visible: {state_ok}"));
    let mut err = std::io::stderr().lock();
    for l in lines {
        let _ = writeln!(err, "sandbox-probe: {l}");
    }
}
