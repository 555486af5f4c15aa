//! The lab host: a QEMU/TCG VM running Debian's cloud kernel, vmhostd and nested TCG VMs.
//!
//! This machine's kernel lacks 802.1Q VLANs, bridge VLAN filtering, VFIO and dummy links, so
//! tests that need them run a *scenario* (a busybox `sh` script using `tests/lab/lib.sh`) inside
//! the lab. [`run_lab`] builds the lab image once per process (`tests/lab/build-lab.sh
//! target/lab`, cached and flock-safe), boots it with the scenario passed through fw_cfg, waits
//! for the `LAB-RESULT` line on the serial console and returns the whole console log. The
//! protocol and the scenario helpers are described in `tests/lab/README.md`.
//!
//! Labs are slow (TCG in TCG) and each uses two vCPUs, so runs are serialized across threads and
//! processes with a lock file (`target/lab/.run.lock`); a lab's timeout starts once it holds the
//! lock.

use crate::{target_dir, workspace};
use std::fs;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Line the lab prints when its scenario starts (after kernel boot and module loading).
pub const LAB_SCENARIO_START: &str = "LAB-SCENARIO-START";
/// Prefix of the lab's last line: `LAB-RESULT PASS` or `LAB-RESULT FAIL <reason>`.
pub const LAB_RESULT: &str = "LAB-RESULT ";

/// How long QEMU may take to end after the lab printed its result (the lab powers off by
/// itself) before it is killed: a failure bound, the result is known already.
const POWER_OFF: Duration = Duration::from_secs(60);

/// How a lab is booted.
#[derive(Debug, Clone)]
pub struct LabOptions {
    /// Lab RAM, MiB. Nested VMs come out of this (the test guest needs 256 MiB each, plus
    /// QEMU's own overhead and the ~100 MiB initramfs held in RAM).
    pub memory_mib: u32,
    /// Lab vCPUs (`-smp`). Two lets vmhostd and a nested QEMU run side by side (MTTCG).
    pub cpus: u32,
    /// Appended to the lab QEMU's argv, e.g. for the VFIO lab:
    /// `["-M", "kernel-irqchip=split", "-device", "intel-iommu,intremap=on,caching-mode=on",
    /// "-device", "e1000e,addr=05.0"]` (`-M` options merge with the default `-M q35`).
    pub extra_qemu_args: Vec<String>,
    /// Appended to the lab kernel's command line, e.g. `intel_iommu=on`, or
    /// `lab.modules=a,b` to load extra modules (built in with `LAB_EXTRA_MODULES`).
    pub extra_cmdline: String,
    /// Whole-run bound, from boot to power-off. The lab's own watchdog fires 30 s earlier
    /// (`lab.timeout=`) so a hung scenario still reports; past this QEMU is killed.
    pub timeout: Duration,
    /// Extra files for the scenario: `(NAME, host path)` appears in the lab as
    /// `/lab/files/NAME` (fw_cfg `opt/vmhost/files/NAME`; NAME without `/` or `,`).
    pub files: Vec<(String, PathBuf)>,
}

impl Default for LabOptions {
    fn default() -> Self {
        LabOptions {
            memory_mib: 2048,
            cpus: 2,
            extra_qemu_args: Vec::new(),
            extra_cmdline: String::new(),
            timeout: Duration::from_secs(20 * 60),
            files: Vec::new(),
        }
    }
}

/// What a lab run gave.
#[derive(Debug, Clone)]
pub struct LabOutcome {
    /// True when the lab printed `LAB-RESULT PASS`.
    pub passed: bool,
    /// The text after `LAB-RESULT ` (`PASS`, `FAIL <reason>`), or what went wrong when the lab
    /// printed no result (timeout, QEMU exit).
    pub result: String,
    /// The lab's serial console (kernel messages, scenario output, dumps on failure), followed
    /// by QEMU's stderr if it wrote any.
    pub log: String,
    /// True when the host-side timeout killed QEMU.
    pub timed_out: bool,
    /// Wall time from starting QEMU to `LAB-SCENARIO-START` (lab boot), if it got there.
    pub boot_time: Option<Duration>,
    /// Wall time from starting QEMU to its exit (or kill).
    pub elapsed: Duration,
}

impl LabOutcome {
    /// Lines of the log that start with `CHECK ` (one per `check` in the scenario).
    pub fn checks(&self) -> Vec<&str> {
        self.log.lines().filter(|l| l.starts_with("CHECK ")).collect()
    }
}

/// The built lab: kernel and initramfs.
#[derive(Debug, Clone)]
pub struct LabImage {
    /// `target/lab/vmlinuz`.
    pub kernel: PathBuf,
    /// `target/lab/initramfs-lab.cpio`.
    pub initrd: PathBuf,
    /// `target/lab`.
    pub dir: PathBuf,
}

/// Builds the lab once per process (`tests/lab/build-lab.sh target/lab`, with the binaries of
/// this test run's target dir). Panics with the script's output when the build fails.
pub fn lab_image() -> LabImage {
    static IMAGE: OnceLock<LabImage> = OnceLock::new();
    IMAGE
        .get_or_init(|| {
            let dir = workspace().join("target/lab");
            let out = Command::new(workspace().join("tests/lab/build-lab.sh"))
                .arg(&dir)
                .env("VMHOST_BIN_DIR", target_dir())
                .env("GUEST_DIR", workspace().join("target/guest"))
                .stdin(Stdio::null())
                .output()
                .expect("run tests/lab/build-lab.sh");
            assert!(
                out.status.success(),
                "tests/lab/build-lab.sh failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            LabImage { kernel: dir.join("vmlinuz"), initrd: dir.join("initramfs-lab.cpio"), dir }
        })
        .clone()
}

/// Kills and reaps the lab QEMU if the run ends early (panic included).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// An exclusive flock held for one lab run.
struct RunLock(fs::File);

impl RunLock {
    fn acquire(path: &Path) -> RunLock {
        let f = fs::OpenOptions::new().create(true).append(true).open(path).expect("open lab run lock");
        // SAFETY: flock on a descriptor we own; it stays open as long as the lock is needed.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock {}: {}", path.display(), std::io::Error::last_os_error());
        RunLock(f)
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // SAFETY: unlocking our own descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// QEMU option-list escaping: commas are doubled.
fn opt_escape(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

/// The complete `LAB-RESULT` line's text, once the line is complete.
fn find_result(log: &str) -> Option<String> {
    let at = log.find(LAB_RESULT)?;
    let rest = &log[at + LAB_RESULT.len()..];
    let end = rest.find('\n')?;
    Some(rest[..end].trim_end_matches('\r').trim().to_string())
}

/// Boots the lab with `scenario` (a busybox sh script; start it with `. /lab/lib.sh` and end
/// with `finish`) and returns its outcome. Never panics on a failing scenario: the caller
/// asserts on [`LabOutcome::passed`] and prints [`LabOutcome::log`].
///
/// Set `VMHOST_LAB_ECHO=1` to copy the console to stderr as it arrives, and
/// `VMHOST_LAB_KEEP=1` to keep the run directory (scenario, console log) in /tmp.
pub fn run_lab(scenario: &str, opts: &LabOptions) -> LabOutcome {
    let image = lab_image();
    let dir = tempfile::Builder::new().prefix("vmlab").tempdir_in("/tmp").expect("lab tempdir");
    let scenario_path = dir.path().join("scenario.sh");
    fs::write(&scenario_path, scenario).expect("write scenario");
    let console = dir.path().join("console.log");
    let qemu_err = dir.path().join("qemu.stderr");
    fs::write(&console, b"").expect("create console log");

    let _lock = RunLock::acquire(&image.dir.join(".run.lock"));
    let lab_timeout = opts.timeout.saturating_sub(Duration::from_secs(30)).max(Duration::from_secs(10));
    // no_timer_check: on a loaded host, TCG can be slow enough at boot that the kernel's IO-APIC
    // timer check fails and it panics ("timer doesn't work through Interrupt-remapped IO-APIC",
    // seen with intel_iommu=on while other suites ran); the timer works, only the check is
    // timing-sensitive.
    let mut cmdline = format!("console=ttyS0 panic=-1 quiet no_timer_check lab.timeout={}", lab_timeout.as_secs());
    if !opts.extra_cmdline.trim().is_empty() {
        cmdline.push(' ');
        cmdline.push_str(opts.extra_cmdline.trim());
    }
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", "tcg", "-M", "q35"])
        .args(["-m", &opts.memory_mib.to_string(), "-smp", &opts.cpus.to_string()])
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-chardev", &format!("file,id=con0,path={}", opt_escape(&console))])
        .args(["-serial", "chardev:con0"])
        .arg("-kernel")
        .arg(&image.kernel)
        .arg("-initrd")
        .arg(&image.initrd)
        .args(["-append", &cmdline])
        .args(["-fw_cfg", &format!("name=opt/vmhost/scenario,file={}", opt_escape(&scenario_path))]);
    for (name, path) in &opts.files {
        assert!(!name.is_empty() && !name.contains(['/', ',']), "bad lab file name {name:?}");
        cmd.args(["-fw_cfg", &format!("name=opt/vmhost/files/{name},file={}", opt_escape(path))]);
    }
    cmd.args(&opts.extra_qemu_args);
    // QEMU's own stdout and stderr share one file (opened once, so writes stay in order).
    let err_file = fs::File::create(&qemu_err).expect("qemu stderr file");
    cmd.stdin(Stdio::null()).stdout(err_file.try_clone().expect("dup qemu stderr file")).stderr(err_file);

    let started = Instant::now();
    let mut qemu = KillOnDrop(cmd.spawn().expect("spawn qemu-system-x86_64 for the lab"));
    let echo = std::env::var_os("VMHOST_LAB_ECHO").is_some_and(|v| v == "1");
    let mut echoed = 0usize;
    let mut boot_time = None;
    let mut result = None;
    let mut exit_status = None;
    // Until the lab printed its result or QEMU ended, whichever comes first; `opts.timeout` is
    // the failure bound. Each look also echoes the new console output and notes the boot.
    let finished = crate::wait::poll(opts.timeout, || {
        let log = String::from_utf8_lossy(&fs::read(&console).unwrap_or_default()).into_owned();
        if echo && log.len() > echoed {
            let _ = std::io::stderr().write_all(&log.as_bytes()[echoed..]);
            echoed = log.len();
        }
        if boot_time.is_none() && log.contains(LAB_SCENARIO_START) {
            boot_time = Some(started.elapsed());
        }
        if let Ok(Some(status)) = qemu.0.try_wait() {
            exit_status = Some(status);
        }
        result = find_result(&log);
        if result.is_some() || exit_status.is_some() {
            Ok(())
        } else {
            Err(String::new())
        }
    });
    let timed_out = finished.is_err();
    // After its result the lab powers off by itself; QEMU is killed if it has not within
    // POWER_OFF (a failure bound of the power-off, which the result does not depend on).
    if exit_status.is_none() && !timed_out {
        exit_status = crate::wait::poll(POWER_OFF, || qemu.0.try_wait().ok().flatten().ok_or_else(String::new)).ok();
    }
    if exit_status.is_none() {
        let _ = qemu.0.kill();
    }
    let _ = qemu.0.wait();
    let elapsed = started.elapsed();

    let mut log = String::from_utf8_lossy(&fs::read(&console).unwrap_or_default()).into_owned();
    if echo && log.len() > echoed {
        let _ = std::io::stderr().write_all(&log.as_bytes()[echoed..]);
    }
    if result.is_none() {
        result = find_result(&log);
    }
    let stderr = fs::read_to_string(&qemu_err).unwrap_or_default();
    if !stderr.trim().is_empty() {
        log.push_str("\n----- lab QEMU stderr -----\n");
        log.push_str(&stderr);
    }
    let result = result.unwrap_or_else(|| match (timed_out, exit_status) {
        (true, _) => format!("FAIL host timeout: no LAB-RESULT within {:?}; lab QEMU killed", opts.timeout),
        (false, Some(s)) => format!("FAIL lab QEMU exited ({s}) without a LAB-RESULT line"),
        (false, None) => "FAIL no LAB-RESULT line".to_string(),
    });
    if std::env::var_os("VMHOST_LAB_KEEP").is_some_and(|v| v == "1") {
        let kept = dir.keep();
        eprintln!("lab run kept in {}", kept.display());
    }
    LabOutcome { passed: result == "PASS", result, log, timed_out, boot_time, elapsed }
}
