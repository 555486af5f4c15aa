//! `vmhostctl migrate-in` and `vmhostctl migrate`: a VM moved live to another vmhostd
//! (docs/moving.md).
//!
//! Why a module of its own: `migrate --to-socket` drives two daemons (the destination's
//! `vm.migrate_in` with the spec as this host runs it, then this host's `vm.migrate`), and
//! while the call runs a second connection follows the VM's `migration` events to draw the
//! progress line.
//!
//! Order of use: [`migrate_in`] alone prepares a destination; [`settle`] alone answers for a
//! move whose outcome the source could not learn; [`migrate`] runs
//! [`incoming_spec`] and `vm.migrate_in` on the destination when given `--to-socket`, then
//! starts [`watch`] and calls `vm.migrate`; [`render`] is the progress line (pure).

use super::Failure;
use serde_json::{json, Value};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use vmhost::api::migration::MigrationProgress;
use vmhost::client::Client;

/// Arguments of `vmhostctl migrate-in`.
#[derive(clap::Args, Debug)]
pub struct MigrateInArgs {
    /// The VM's spec as the source runs it (JSON file, `-` for stdin), each NIC with its MAC.
    pub file: PathBuf,
    /// Prepare for a cold move (`vm.move`) rather than a live migration.
    #[arg(long)]
    pub cold: bool,
}

/// Arguments of `vmhostctl migrate`.
#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// The VM.
    pub name: String,
    /// The destination's migration address (`vm.migrate_in`'s `address`); its secret comes
    /// with `--secret -` (standard input) or `--secret-file`.
    #[arg(long, required_unless_present = "to_socket", conflicts_with = "to_socket")]
    pub to: Option<String>,
    /// `-`: read the destination's secret (`vm.migrate_in`'s `secret`) from the first line of
    /// standard input. Nothing else: a secret on the command line is readable by every local
    /// user in `ps` and /proc/PID/cmdline.
    #[arg(long, value_name = "-", conflicts_with_all = ["to_socket", "secret_file"])]
    pub secret: Option<String>,
    /// Read the destination's secret from the first line of this file.
    #[arg(long, value_name = "PATH", conflicts_with = "to_socket")]
    pub secret_file: Option<PathBuf>,
    /// The destination vmhostd's API socket: vmhostctl prepares the destination itself.
    #[arg(long, value_name = "DEST_SOCKET")]
    pub to_socket: Option<PathBuf>,
    /// Longest pause of the guest at the switch-over, ms (default: vmhostd's, 300).
    #[arg(long)]
    pub max_downtime_ms: Option<u64>,
    /// Bandwidth cap of the memory stream, MiB/s.
    #[arg(long)]
    pub bandwidth: Option<u64>,
    /// Longest the whole migration may take, seconds.
    #[arg(long, default_value_t = 3600)]
    pub timeout: u64,
}

/// `vmhostctl migrate-in`: the `vm.migrate_in` result.
///
/// # Errors
/// The spec cannot be read, or the daemon refuses.
pub fn migrate_in(c: &mut Client, args: &MigrateInArgs) -> Result<Value, Failure> {
    let spec = super::read_json(&args.file)?;
    let mode = if args.cold { "cold" } else { "live" };
    // The destination makes the disks and NICs before it answers.
    c.set_timeout(Duration::from_secs(300))?;
    Ok(c.call("vm.migrate_in", json!({ "spec": spec, "mode": mode }))?)
}

/// The spec to prepare the destination with (pure): the VM's `vm.get` spec, each NIC with the
/// MAC its NIC view shows (the guest keeps its interfaces).
pub fn incoming_spec(view: &Value) -> Value {
    let mut spec = view["spec"].clone();
    if let Some(nics) = spec.get_mut("nics").and_then(Value::as_array_mut) {
        for (i, nic) in nics.iter_mut().enumerate() {
            if let Some(mac) = view["nics"][i].get("mac").filter(|m| m.is_string()) {
                nic["mac"] = mac.clone();
            }
        }
    }
    spec
}

/// Longest secret input read (a secret is 64 hex digits; anything longer is not one).
const MAX_SECRET_INPUT: u64 = 4096;

/// The secret of `migrate --to`: from standard input (`--secret -`) or `--secret-file`, never
/// from the command line itself.
///
/// # Errors
/// Neither given, a literal `--secret`, or the input cannot be read.
fn secret_of(args: &MigrateArgs) -> Result<String, Failure> {
    let text = match (args.secret.as_deref(), &args.secret_file) {
        (Some("-"), _) => read_secret(std::io::stdin().lock(), "standard input")?,
        (Some(_), _) => {
            return Err(Failure::Usage(
                "--secret takes only `-` (the secret on standard input): on the command line every local user \
                 could read it in ps; or use --secret-file PATH"
                    .into(),
            ))
        }
        (None, Some(path)) => {
            let f = std::fs::File::open(path).map_err(|e| Failure::Usage(format!("{}: {e}", path.display())))?;
            read_secret(f, &path.display().to_string())?
        }
        (None, None) => {
            return Err(Failure::Usage(
                "migrate --to needs the secret: --secret - (standard input) or --secret-file PATH".into(),
            ))
        }
    };
    Ok(text)
}

/// The first line of `input` (at most [`MAX_SECRET_INPUT`] bytes), trimmed.
///
/// # Errors
/// It cannot be read, or is empty.
fn read_secret(input: impl std::io::Read, what: &str) -> Result<String, Failure> {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(input.take(MAX_SECRET_INPUT))
        .read_line(&mut line)
        .map_err(|e| Failure::Usage(format!("the secret from {what}: {e}")))?;
    let secret = line.trim();
    if secret.is_empty() {
        return Err(Failure::Usage(format!("no secret in {what}")));
    }
    Ok(secret.to_string())
}

/// Arguments of `vmhostctl migrate-settle`.
#[derive(clap::Args, Debug)]
pub struct SettleArgs {
    /// The VM whose move's outcome is unknown here.
    pub name: String,
    /// What the destination shows: `committed` (it runs the VM) or `abandoned` (it does not).
    #[arg(long, value_parser = ["committed", "abandoned"])]
    pub outcome: String,
}

/// `vmhostctl migrate-settle`: the `vm.migrate_settle` result.
///
/// # Errors
/// The daemon refuses (the destination answered otherwise, the VM's outcome is not unknown).
pub fn settle(c: &mut Client, args: &SettleArgs) -> Result<Value, Failure> {
    // vmhostd asks the destination first (a few seconds when it cannot be reached).
    c.set_timeout(Duration::from_secs(120))?;
    Ok(c.call("vm.migrate_settle", json!({ "name": args.name, "outcome": args.outcome }))?)
}

/// `vmhostctl migrate`: the `vm.migrate` result.
///
/// # Errors
/// Either daemon refuses or cannot be reached.
pub fn migrate(c: &mut Client, socket: &Path, args: &MigrateArgs, quiet: bool) -> Result<Value, Failure> {
    let (destination, secret) = match &args.to_socket {
        Some(dest_socket) => {
            let view: Value = c.call("vm.get", json!({ "name": args.name }))?;
            let mut dest = Client::connect(dest_socket).map_err(|e| {
                Failure::Connect(format!("cannot reach the destination at {}: {e}", dest_socket.display()))
            })?;
            dest.set_timeout(Duration::from_secs(300))?;
            let prepared: Value =
                dest.call("vm.migrate_in", json!({ "spec": incoming_spec(&view), "mode": "live" }))?;
            let field = |k: &str| prepared[k].as_str().map(str::to_string);
            match (field("address"), field("secret")) {
                (Some(a), Some(s)) => (a, s),
                _ => {
                    return Err(Failure::Connect(format!(
                        "vm.migrate_in answered without address or secret: {prepared}"
                    )))
                }
            }
        }
        None => (args.to.clone().unwrap_or_default(), secret_of(args)?),
    };
    let done = Arc::new(AtomicBool::new(false));
    let watcher = (!quiet).then(|| watch(socket.to_path_buf(), args.name.clone(), Arc::clone(&done)));
    let mut params =
        json!({ "name": args.name, "destination": destination, "secret": secret, "timeout_s": args.timeout });
    if let Some(ms) = args.max_downtime_ms {
        params["max_downtime_ms"] = json!(ms);
    }
    if let Some(b) = args.bandwidth {
        params["bandwidth_mib_s"] = json!(b);
    }
    // The call may also wait up to a minute for the destination's answer to the commit.
    c.set_timeout(Duration::from_secs(args.timeout.saturating_add(180)))?;
    let result = c.call::<Value>("vm.migrate", params);
    done.store(true, Ordering::SeqCst);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    Ok(result?)
}

/// Follows VM `name`'s `migration` events on a connection of its own and draws the progress
/// line on standard error: redrawn in place on a terminal, one line per event otherwise. Ends
/// once `done` is set.
fn watch(socket: PathBuf, name: String, done: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let Ok(mut c) = Client::connect(&socket) else { return };
        if c.subscribe_events().is_err() {
            return;
        }
        let terminal = std::io::stderr().is_terminal();
        let mut drew = false;
        while !done.load(Ordering::SeqCst) {
            let Ok(event) = c.next_event(Duration::from_millis(200)) else { break };
            let Some(progress) = event.filter(|e| e.vm == name).and_then(|e| e.migration) else { continue };
            let line = vmhost::guest_text::escape(&render(&progress)).into_owned();
            let mut err = std::io::stderr().lock();
            let _ = if terminal { write!(err, "\r\x1b[2K{line}") } else { writeln!(err, "{line}") };
            let _ = err.flush();
            drew = true;
        }
        if terminal && drew {
            eprintln!();
        }
    })
}

/// `N` bytes in GiB (or MiB below 1 GiB), one decimal.
fn size(bytes: u64) -> (f64, &'static str) {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    const MIB: f64 = 1024.0 * 1024.0;
    let b = bytes as f64;
    if b >= GIB {
        (b / GIB, "GiB")
    } else {
        (b / MIB, "MiB")
    }
}

/// `done/total UNIT`, both in the unit of `total`.
fn fraction(done: u64, total: u64) -> String {
    let (t, unit) = size(total);
    let scale = if unit == "GiB" { 1024.0 * 1024.0 * 1024.0 } else { 1024.0 * 1024.0 };
    let d = done as f64 / scale;
    if unit == "GiB" {
        format!("{d:.1}/{t:.1} {unit}")
    } else {
        format!("{d:.0}/{t:.0} {unit}")
    }
}

/// The progress line (pure): `disks 1.2/2.0 GiB  memory 180/256 MiB  expected downtime
/// 120 ms`; parts without figures yet are left out, and a phase the figures do not show
/// (`preparing`, `committing`, `done`, ...) comes first.
pub fn render(p: &MigrationProgress) -> String {
    let mut parts = Vec::new();
    if !matches!(p.phase.as_str(), "disks" | "memory") {
        parts.push(p.phase.clone());
    }
    if p.disk_total > 0 {
        parts.push(format!("disks {}", fraction(p.disk_done.min(p.disk_total), p.disk_total)));
    }
    if p.ram_total > 0 {
        parts.push(format!("memory {}", fraction(p.ram_done, p.ram_total)));
    }
    if p.expected_downtime_ms > 0 {
        parts.push(format!("expected downtime {} ms", p.expected_downtime_ms));
    }
    parts.join("  ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_the_first_line_of_its_input_trimmed_and_never_empty() {
        let hex = "ab".repeat(32);
        let got = read_secret(format!("  {hex}\r\nsecond line\n").as_bytes(), "t").ok();
        assert_eq!(got.as_deref(), Some(hex.as_str()));
        assert!(read_secret("\n".as_bytes(), "t").is_err());
        assert!(read_secret("".as_bytes(), "t").is_err());
        // Bounded: an endless input is not read whole.
        let long = "a".repeat(10_000);
        assert_eq!(read_secret(long.as_bytes(), "t").ok().map(|s| s.len()), Some(MAX_SECRET_INPUT as usize));
    }

    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * MIB;

    #[test]
    fn the_line_shows_disks_memory_and_downtime_as_they_come() {
        let p = MigrationProgress {
            phase: "memory".into(),
            disk_done: GIB + GIB / 5,
            disk_total: 2 * GIB,
            ram_done: 180 * MIB,
            ram_total: 256 * MIB,
            ram_remaining: 76 * MIB,
            expected_downtime_ms: 120,
        };
        assert_eq!(render(&p), "disks 1.2/2.0 GiB  memory 180/256 MiB  expected downtime 120 ms");
        let p = MigrationProgress { phase: "committing".into(), ..p };
        assert!(render(&p).starts_with("committing  disks 1.2/2.0 GiB"));
        let early = MigrationProgress { phase: "preparing".into(), ..Default::default() };
        assert_eq!(render(&early), "preparing");
        let disks =
            MigrationProgress { phase: "disks".into(), disk_done: 3 * GIB, disk_total: 2 * GIB, ..Default::default() };
        assert_eq!(render(&disks), "disks 2.0/2.0 GiB", "a mirror's growing length never shows more than all");
    }

    #[test]
    fn the_destination_gets_the_spec_with_each_nics_mac() {
        let view = json!({
            "spec": {"name": "a", "nics": [{"network": "n1"}, {"network": "n2", "mac": "old"}]},
            "nics": [{"mac": "52:54:00:00:00:01"}, {"mac": "52:54:00:00:00:02"}]
        });
        let spec = incoming_spec(&view);
        assert_eq!(spec["nics"][0]["mac"], "52:54:00:00:00:01");
        assert_eq!(spec["nics"][1]["mac"], "52:54:00:00:00:02");
        assert_eq!(incoming_spec(&json!({"spec": {"name": "b"}})), json!({"name": "b"}));
    }
}
