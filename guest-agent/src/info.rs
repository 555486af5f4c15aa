//! `hello` and `agent.info`: who the agent is and what the guest is, from `/proc`.
//!
//! Every reading is from a `/proc` file so the parsing can be tested on fabricated text; a file that
//! cannot be read becomes an empty or zero value rather than an error, because `agent.info` is a
//! liveness probe and should answer whatever the guest's state.

use std::path::Path;

pub use vmhost_agent_protocol::{AgentInfo, Hello, PROTOCOL_VERSION};

/// The agent's version (the crate version).
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The method groups `hello` announces, and `net.capture`: capture NICs in `net.check` and
/// `net.apply`, the promiscuous flag in `net.state` ([`vmhost_agent_protocol::CAPTURE_CAPABILITY`]).
pub const CAPABILITIES: [&str; 6] =
    ["agent.info", "net.state", "net.check", "net.apply", "fs.freeze", vmhost_agent_protocol::CAPTURE_CAPABILITY];

/// The `hello` reply.
pub fn hello() -> Hello {
    Hello {
        agent_version: AGENT_VERSION.to_string(),
        protocol_version: PROTOCOL_VERSION,
        capabilities: CAPABILITIES.iter().map(|c| c.to_string()).collect(),
    }
}

/// Reads a small text file, empty when it cannot be read.
fn read(path: &Path) -> String {
    std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

/// The first field of `/proc/uptime`, in whole seconds.
fn parse_uptime(text: &str) -> u64 {
    text.split_whitespace().next().and_then(|s| s.parse::<f64>().ok()).map_or(0, |s| s as u64)
}

/// The value in KiB of the `key:` line (`Rss:` of `smaps_rollup`, `VmRSS:` of `status`), 0 when
/// there is none.
fn parse_kib(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The agent's resident set size in KiB.
///
/// `smaps_rollup` first: it walks the page tables and is exact. `VmRSS` of `status` is the
/// fallback only, because kernels before 6.2 keep per-thread RSS counters that reach the reported
/// total only every 64 page faults, and a process as small as the agent then shows a few KiB.
fn rss_kib(proc_root: &Path) -> u64 {
    match parse_kib(&read(&proc_root.join("self/smaps_rollup")), "Rss:") {
        0 => parse_kib(&read(&proc_root.join("self/status")), "VmRSS:"),
        kib => kib,
    }
}

/// `PRETTY_NAME` of an os-release file's text (os-release(5): shell-like `KEY=value`, the value
/// optionally in double or single quotes), cut to 128 bytes; `None` when absent or empty.
pub fn pretty_name(os_release: &str) -> Option<String> {
    let value = os_release.lines().find_map(|l| l.trim().strip_prefix("PRETTY_NAME="))?;
    let value = value.trim();
    let unquoted =
        ['"', '\''].iter().find_map(|q| value.strip_prefix(*q).and_then(|v| v.strip_suffix(*q))).unwrap_or(value);
    let text: String = unquoted.replace("\\\"", "\"").chars().take(128).collect();
    (!text.is_empty()).then_some(text)
}

/// The guest's operating system name: `/etc/os-release`, else `/usr/lib/os-release`.
fn os_name() -> Option<String> {
    ["/etc/os-release", "/usr/lib/os-release"].iter().find_map(|p| pretty_name(&read(Path::new(p))))
}

/// The `agent.info` reply, read below `proc_root` (`/proc` outside tests).
pub fn agent_info(proc_root: &Path) -> AgentInfo {
    AgentInfo {
        version: AGENT_VERSION.to_string(),
        hostname: read(&proc_root.join("sys/kernel/hostname")).trim().to_string(),
        kernel: read(&proc_root.join("sys/kernel/osrelease")).trim().to_string(),
        uptime_s: parse_uptime(&read(&proc_root.join("uptime"))),
        boot_id: read(&proc_root.join("sys/kernel/random/boot_id")).trim().to_string(),
        rss_kib: rss_kib(proc_root),
        os: os_name(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_os_is_os_release_s_pretty_name() {
        let debian = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\n";
        assert_eq!(pretty_name(debian).as_deref(), Some("Debian GNU/Linux 12 (bookworm)"));
        assert_eq!(pretty_name("PRETTY_NAME='Alpine Linux v3.20'\n").as_deref(), Some("Alpine Linux v3.20"));
        assert_eq!(pretty_name("PRETTY_NAME=Buildroot\n").as_deref(), Some("Buildroot"));
        assert_eq!(pretty_name("NAME=x\nPRETTY_NAME=\"\"\n"), None);
        assert_eq!(pretty_name(""), None);
        assert_eq!(pretty_name(&format!("PRETTY_NAME={}", "x".repeat(500))).map(|s| s.len()), Some(128));
    }

    #[test]
    fn proc_files_are_parsed() {
        assert_eq!(parse_uptime("1234.56 789.00\n"), 1234);
        assert_eq!(parse_uptime(""), 0);
        assert_eq!(parse_kib("Name:\tvmhost-agent\nVmPeak:\t 9000 kB\nVmRSS:\t    1532 kB\n", "VmRSS:"), 1532);
        assert_eq!(parse_kib("Name: x\n", "VmRSS:"), 0);
        let rollup = "55d5c5a5a000-7ffd [rollup]\nRss:                1340 kB\nPss:                 1200 kB\n";
        assert_eq!(parse_kib(rollup, "Rss:"), 1340);
    }

    #[test]
    fn info_from_a_fabricated_proc() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("sys/kernel/random")).expect("mkdir");
        std::fs::create_dir_all(dir.path().join("self")).expect("mkdir");
        std::fs::write(dir.path().join("sys/kernel/hostname"), "guest-1\n").expect("write");
        std::fs::write(dir.path().join("sys/kernel/osrelease"), "6.1.0-57-cloud-amd64\n").expect("write");
        std::fs::write(dir.path().join("uptime"), "12.50 3.00\n").expect("write");
        std::fs::write(dir.path().join("sys/kernel/random/boot_id"), "0f7c2a9e-1b2c-4d3e-8f90-123456789abc\n")
            .expect("write");
        std::fs::write(dir.path().join("self/status"), "VmRSS:\t 1200 kB\n").expect("write");
        // Without smaps_rollup, VmRSS counts.
        assert_eq!(agent_info(dir.path()).rss_kib, 1200);
        std::fs::write(dir.path().join("self/smaps_rollup"), "Rss: 1300 kB\n").expect("write");
        let info = agent_info(dir.path());
        assert_eq!(
            info,
            AgentInfo {
                version: AGENT_VERSION.into(),
                hostname: "guest-1".into(),
                kernel: "6.1.0-57-cloud-amd64".into(),
                uptime_s: 12,
                boot_id: "0f7c2a9e-1b2c-4d3e-8f90-123456789abc".into(),
                rss_kib: 1300,
                os: info.os.clone(),
            }
        );
        // The real /proc works too.
        assert!(agent_info(Path::new("/proc")).rss_kib > 0);
        assert_eq!(hello().capabilities, CAPABILITIES);
    }
}
