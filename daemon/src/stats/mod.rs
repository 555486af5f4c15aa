//! Per-VM and host figures: what `vm.stats` and `host.stats` report, and the two ways clients
//! show them (docs/metrics.md).
//!
//! Order of use: the lifecycle manager takes a snapshot of the running VMs under its table lock
//! and releases it ([`crate::lifecycle`]'s `stats`), then [`collect::vms`] reads, for every VM at
//! once, `/proc` ([`procfs`]), the taps' counters (one netlink dump) and the last QMP answers of
//! the VM's stats monitor, kept fresh in the background by [`sampler`]; [`procfs::host`] reads the host's own figures. Clients turn
//! reports into the Prometheus text format ([`prometheus`]) or rates between two reports
//! ([`top`]). Nothing here holds a lock a VM operation needs, and nothing blocks on another
//! VM: a VM whose monitor does not answer gets its other figures and a `missing` entry.

pub mod collect;
pub mod procfs;
pub mod prometheus;
pub mod sampler;
pub mod top;

/// Milliseconds since the Unix epoch and the RFC 3339 form of the same instant.
pub fn now() -> (u64, String) {
    let t = std::time::SystemTime::now();
    let ms = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    (ms, humantime::format_rfc3339_millis(t).to_string())
}
