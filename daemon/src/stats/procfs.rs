//! The `/proc` figures of a QEMU process, its vCPU threads, and the host.
//!
//! Use: [`Ticks::system`] once for the clock-tick and page sizes; per VM [`read_process`]
//! (through an open `/proc/PID` directory, so a pid reused after QEMU exited reads as gone, and
//! checked against the recorded start time) and [`read_thread`] per vCPU; [`host`] for the host.
//! The parsers take text so they are tested on fabricated files; the `_in` readers take the proc
//! root.

use crate::api::stats::{HostCpu, HostMemory};
use crate::process::ProcessIdentity;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;

/// The kernel's units: clock ticks per second and the page size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ticks {
    /// `sysconf(_SC_CLK_TCK)`.
    pub per_second: f64,
    /// `sysconf(_SC_PAGESIZE)`, in bytes.
    pub page_bytes: u64,
}

impl Ticks {
    /// This system's units (100 Hz and 4 KiB when sysconf does not say).
    pub fn system() -> Ticks {
        use nix::unistd::{sysconf, SysconfVar};
        let per_second = sysconf(SysconfVar::CLK_TCK).ok().flatten().filter(|t| *t > 0).unwrap_or(100);
        let page = sysconf(SysconfVar::PAGE_SIZE).ok().flatten().filter(|p| *p > 0).unwrap_or(4096);
        Ticks { per_second: per_second as f64, page_bytes: u64::try_from(page).unwrap_or(4096) }
    }
}

/// What `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) says about CPU time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTicks {
    /// Field 14 plus field 15: user and system time, in clock ticks.
    pub used: u64,
    /// Field 22: start time after boot, in clock ticks.
    pub start: u64,
}

/// Why a process's figures could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// The recorded process is gone (exited, or its pid now names another process).
    #[error("the recorded QEMU process is gone")]
    Gone,
    /// A file could not be read or parsed.
    #[error("cannot read {what}: {source}")]
    Read {
        /// Which file.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// Parses the CPU fields of a `stat` file. The command name is in parentheses and may hold
/// spaces and `)`: fields are counted from after the last `)`.
///
/// # Errors
/// `InvalidData` when a field is missing or not a number.
pub fn parse_stat(text: &str) -> io::Result<CpuTicks> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("bad stat: {what}"));
    let close = text.rfind(')').ok_or_else(|| bad("no ')' after comm"))?;
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    // Field N is at index N - 3 after the command name.
    let field = |n: usize| -> io::Result<u64> {
        rest.get(n - 3).and_then(|s| s.parse::<u64>().ok()).ok_or_else(|| bad(&format!("field {n}")))
    };
    Ok(CpuTicks { used: field(14)?.saturating_add(field(15)?), start: field(22)? })
}

/// Parses `/proc/PID/statm` into resident pages (its second field).
///
/// # Errors
/// `InvalidData` when the field is missing or not a number.
pub fn parse_statm_resident(text: &str) -> io::Result<u64> {
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad statm"))
}

/// A QEMU process's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessFigures {
    /// User plus system seconds.
    pub cpu_seconds: f64,
    /// Resident bytes.
    pub rss_bytes: u64,
    /// Seconds since it started.
    pub uptime_s: f64,
}

/// An open `/proc/PID` of the recorded process, checked to be that very process.
pub struct ProcessDir {
    dir: OwnedFd,
    stat: CpuTicks,
}

/// Opens `proc_root/PID` for `expected` and reads its stat; [`ProcError::Gone`] when the pid
/// is free or names a process started at another time.
///
/// # Errors
/// As described; [`ProcError::Read`] when the stat cannot be read or parsed.
pub fn open_process_in(proc_root: &Path, expected: &ProcessIdentity) -> Result<ProcessDir, ProcError> {
    let dir = crate::process::open_pid_dir(proc_root, expected.pid).map_err(|e| gone_or(e, "stat"))?;
    let stat = read_parsed(&dir, "stat", parse_stat)?;
    if stat.start != expected.start_ticks {
        return Err(ProcError::Gone);
    }
    Ok(ProcessDir { dir, stat })
}

/// The process's CPU time, RSS and uptime (`uptime_text` is `/proc/uptime`).
///
/// # Errors
/// [`ProcError::Gone`] if it exited meanwhile; [`ProcError::Read`] otherwise.
pub fn read_process(p: &ProcessDir, ticks: Ticks, uptime_text: &str) -> Result<ProcessFigures, ProcError> {
    let pages = read_parsed(&p.dir, "statm", parse_statm_resident)?;
    let host_up = uptime_text.split_whitespace().next().and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    Ok(ProcessFigures {
        cpu_seconds: p.stat.used as f64 / ticks.per_second,
        rss_bytes: pages.saturating_mul(ticks.page_bytes),
        uptime_s: (host_up - p.stat.start as f64 / ticks.per_second).max(0.0),
    })
}

/// The CPU seconds of thread `tid` of the process.
///
/// # Errors
/// [`ProcError::Gone`] when there is no such thread; [`ProcError::Read`] otherwise.
pub fn read_thread(p: &ProcessDir, tid: i32, ticks: Ticks) -> Result<f64, ProcError> {
    if tid <= 0 {
        return Err(ProcError::Gone);
    }
    let stat = read_parsed(&p.dir, &format!("task/{tid}/stat"), parse_stat)?;
    Ok(stat.used as f64 / ticks.per_second)
}

fn gone_or(e: io::Error, what: &str) -> ProcError {
    if crate::process::is_gone(&e) {
        ProcError::Gone
    } else {
        ProcError::Read { what: what.to_string(), source: e }
    }
}

fn read_parsed<T>(dir: &OwnedFd, name: &str, parse: impl Fn(&str) -> io::Result<T>) -> Result<T, ProcError> {
    let bytes = crate::process::read_at(dir, name).map_err(|e| gone_or(e, name))?;
    parse(&String::from_utf8_lossy(&bytes)).map_err(|source| ProcError::Read { what: name.to_string(), source })
}

/// Parses the `cpu` lines of `/proc/stat`: the aggregate line and the count of per-CPU ones.
///
/// # Errors
/// `InvalidData` when there is no aggregate line.
pub fn parse_host_cpu(text: &str, ticks: Ticks) -> io::Result<HostCpu> {
    let mut total: Option<Vec<u64>> = None;
    let mut count = 0u32;
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("cpu") => total = Some(words.map(|w| w.parse().unwrap_or(0)).collect()),
            Some(w) if w.starts_with("cpu") => count += 1,
            _ => {}
        }
    }
    let f = total.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no cpu line in /proc/stat"))?;
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    let s = |t: u64| t as f64 / ticks.per_second;
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    Ok(HostCpu {
        count,
        user_seconds: s(at(0) + at(1)),
        system_seconds: s(at(2) + at(5) + at(6)),
        idle_seconds: s(at(3)),
        iowait_seconds: s(at(4)),
        other_seconds: s(at(7)),
    })
}

/// Parses `MemTotal` and `MemAvailable` of `/proc/meminfo`.
///
/// # Errors
/// `InvalidData` when either is absent.
pub fn parse_meminfo(text: &str) -> io::Result<HostMemory> {
    let kib = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':')?.split_whitespace().next()?.parse::<u64>().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no {key} in /proc/meminfo")))
    };
    Ok(HostMemory { total_bytes: kib("MemTotal")? * 1024, available_bytes: kib("MemAvailable")? * 1024 })
}

/// The host's CPU and memory from `proc_root`, each with the error that kept it from being read.
pub fn host_in(proc_root: &Path, ticks: Ticks) -> (Result<HostCpu, String>, Result<HostMemory, String>) {
    let read = |name: &str| {
        std::fs::read_to_string(proc_root.join(name)).map_err(|e| format!("cannot read /proc/{name}: {e}"))
    };
    let cpu = read("stat").and_then(|t| parse_host_cpu(&t, ticks).map_err(|e| e.to_string()));
    let mem = read("meminfo").and_then(|t| parse_meminfo(&t).map_err(|e| e.to_string()));
    (cpu, mem)
}

/// [`host_in`] on the real `/proc`.
pub fn host(ticks: Ticks) -> (Result<HostCpu, String>, Result<HostMemory, String>) {
    host_in(Path::new(crate::process::PROC_ROOT), ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICKS: Ticks = Ticks { per_second: 100.0, page_bytes: 4096 };

    fn stat_line(comm: &str, utime: u64, stime: u64, start: u64) -> String {
        // Fields 3..=21 then start time (22) and a few more.
        let mut f: Vec<String> = (3..=21).map(|_| "0".to_string()).collect();
        f[0] = "S".into();
        f[14 - 3] = utime.to_string();
        f[15 - 3] = stime.to_string();
        format!("1234 ({comm}) {} {start} 0 0\n", f.join(" "))
    }

    #[test]
    fn stat_fields_are_counted_after_the_last_paren() {
        let t = parse_stat(&stat_line("qemu) 1 2 (x", 250, 50, 777)).unwrap();
        assert_eq!(t, CpuTicks { used: 300, start: 777 });
        assert!(parse_stat("1 (x) S 1").is_err());
        assert_eq!(parse_statm_resident("100 25 3 1 0 20 0\n").unwrap(), 25);
        assert!(parse_statm_resident("100").is_err());
    }

    #[test]
    fn host_cpu_and_memory() {
        let stat =
            "cpu  100 20 30 400 5 6 7 8 0 0\ncpu0 50 10 15 200 2 3 3 4 0 0\ncpu1 50 10 15 200 3 3 4 4 0 0\nintr 1\n";
        let c = parse_host_cpu(stat, TICKS).unwrap();
        assert_eq!(c.count, 2);
        assert_eq!((c.user_seconds, c.system_seconds, c.idle_seconds), (1.2, 0.43, 4.0));
        assert_eq!((c.iowait_seconds, c.other_seconds), (0.05, 0.08));
        assert!(parse_host_cpu("intr 1\n", TICKS).is_err());
        let m = parse_meminfo("MemTotal:       2048 kB\nMemFree: 1 kB\nMemAvailable:   1024 kB\n").unwrap();
        assert_eq!((m.total_bytes, m.available_bytes), (2048 * 1024, 1024 * 1024));
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_err());
    }

    #[test]
    fn a_process_is_read_through_its_dir_and_a_reused_pid_is_gone() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("1234");
        std::fs::create_dir_all(dir.join("task/1240")).unwrap();
        std::fs::write(dir.join("stat"), stat_line("qemu-system-x86", 150, 50, 1000)).unwrap();
        std::fs::write(dir.join("statm"), "5000 256 10 1 0 100 0\n").unwrap();
        std::fs::write(dir.join("task/1240/stat"), stat_line("CPU 0/TCG", 120, 5, 1001)).unwrap();
        let id = ProcessIdentity { pid: 1234, start_ticks: 1000 };
        let p = open_process_in(root.path(), &id).unwrap();
        let f = read_process(&p, TICKS, "25.00 40.00\n").unwrap();
        assert_eq!(f, ProcessFigures { cpu_seconds: 2.0, rss_bytes: 256 * 4096, uptime_s: 15.0 });
        assert_eq!(read_thread(&p, 1240, TICKS).unwrap(), 1.25);
        assert!(matches!(read_thread(&p, 999, TICKS), Err(ProcError::Gone)));
        assert!(matches!(read_thread(&p, 0, TICKS), Err(ProcError::Gone)));
        let reused = ProcessIdentity { pid: 1234, start_ticks: 5 };
        assert!(matches!(open_process_in(root.path(), &reused), Err(ProcError::Gone)));
        let absent = ProcessIdentity { pid: 4321, start_ticks: 1000 };
        assert!(matches!(open_process_in(root.path(), &absent), Err(ProcError::Gone)));
    }
}
