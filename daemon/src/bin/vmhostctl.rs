//! vmhostctl: the command-line client of vmhostd.
//!
//! Prints tables by default and the daemon's JSON with `--json`; exits non-zero with the
//! daemon's code and message when a call fails (1 for an API error, 3 when the daemon cannot be
//! reached).
//!
//! Text in the output may come from a guest (agent versions, errors, `vm.check` cells) or any
//! client: every human-readable line goes through [`say!`]/[`tell!`], which escape control, C1 and
//! reordering characters ([`vmhost::guest_text::escape`]), and JSON through [`json_line`], which
//! also escapes the C1 characters serde leaves as they are. Nothing a guest sends can forge a line,
//! overwrite one or drive the terminal. The one exception is `console`, which is the guest's
//! serial console on the terminal, as it printed it (docs/console.md).

use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use vmhost::api::stats::{HostStats, VmStatsReport};
use vmhost::api::{HostCheck, HostInfo, Mutation, ReconcileReport, VmView};
use vmhost::client::{Client, ClientError};

/// `println!` for human-readable output, escaped as a whole (a `\n` inside a value stays on its
/// line as `\n`).
macro_rules! say {
    () => { println!() };
    ($($arg:tt)*) => { println!("{}", vmhost::guest_text::escape(&format!($($arg)*))) };
}

/// `eprintln!`, escaped as [`say!`] is.
macro_rules! tell {
    ($($arg:tt)*) => { eprintln!("{}", vmhost::guest_text::escape(&format!($($arg)*))) };
}

// The guest access commands, one file each beside this one (a crate root's `mod` looks in
// its own directory, hence the paths).
#[path = "vmhostctl/exec.rs"]
mod exec;
#[path = "vmhostctl/files.rs"]
mod files;
#[path = "vmhostctl/migrate.rs"]
mod migrate;
#[path = "vmhostctl/moves.rs"]
mod moves;
#[path = "vmhostctl/ssh.rs"]
mod ssh;

/// JSON for output: serde escapes the C0 controls in strings; C1 ones are escaped here too.
fn json_line(text: &str) -> String {
    vmhost::guest_text::escape_json_c1(text).into_owned()
}

#[derive(Parser)]
#[command(name = "vmhostctl", version, about = "Control vmhostd over its socket")]
struct Cli {
    /// The daemon's socket.
    #[arg(long, global = true, env = "VMHOST_SOCKET", default_value = "/run/vmhost/vmhostd.sock")]
    socket: PathBuf,
    /// Print the daemon's JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Host capacity, accelerator and hardware holders.
    Info,
    /// Preflight report of the host, or with NAME the guest agent's network check of that VM.
    Check { name: Option<String> },
    /// What the guest agent reports about the guest (version, hostname, kernel, uptime).
    GuestInfo { name: String },
    /// The guest's interfaces, routes and DNS, as its agent sees them.
    GuestNetwork { name: String },
    /// All VMs.
    List,
    /// One VM.
    Get { name: String },
    /// Create a VM from a JSON spec file (`-` for stdin).
    Create { file: PathBuf },
    /// Create or converge a VM from a JSON spec file; a changed VM is changed in place, its
    /// disk kept.
    Apply {
        file: PathBuf,
        /// Allow a boot.image change: a new disk, the old one deleted.
        #[arg(long)]
        replace: bool,
        /// Record a change that needs a restart for the VM's next start instead of restarting it.
        #[arg(long)]
        no_restart: bool,
        /// Seconds the guest has to power off for a restart before QEMU is killed.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Start a VM.
    Start { name: String },
    /// Stop a VM (ACPI, then kill after the timeout).
    Stop {
        name: String,
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[arg(long)]
        force: bool,
    },
    /// Stop then start a VM.
    Restart {
        name: String,
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[arg(long)]
        force: bool,
    },
    /// Destroy a VM and its disks (data disks with keep_on_destroy are kept).
    Destroy { name: String },
    /// Converge to a desired set: a JSON file with an array of specs (or `{"vms": [...]}`).
    Reconcile {
        file: PathBuf,
        #[arg(long)]
        prune: bool,
        #[arg(long)]
        dry_run: bool,
        /// Allow replace entries (a boot.image change: a new disk, the old one deleted).
        #[arg(long)]
        replace: bool,
    },
    /// Power off every running VM (ACPI, killed after the timeout), keeping them desired
    /// running so autostart brings them back: what vmhost-guests.service runs at host shutdown.
    ShutdownVms {
        #[arg(long, default_value_t = 30)]
        timeout: u64,
    },
    /// Delete the data disks kept after VM NAME was destroyed (`keep_on_destroy`).
    PurgeKeptDisks { name: String },
    /// Print VM events as they happen.
    Events,
    /// Attach the terminal to a VM's serial console; Ctrl-] detaches (docs/console.md).
    Console {
        name: String,
        /// Only watch: nothing typed reaches the guest (what a read-only peer may do).
        #[arg(long)]
        read_only: bool,
        /// Take the console over from its current writer, which is detached.
        #[arg(long)]
        force: bool,
    },
    /// Counters of one VM or every VM (CPU, memory, disks, NICs), or with `--prometheus` the
    /// Prometheus text format (host figures too when no NAME is given).
    Stats {
        name: Option<String>,
        #[arg(long)]
        prometheus: bool,
    },
    /// A refreshing table of every VM's CPU %, memory, disk and network rates.
    Top {
        /// Seconds between samples (disk rates need at least vmhostd's 2 s disk sampling
        /// interval; a shorter one shows `-` when no new disk sample came in between).
        #[arg(long, default_value_t = 2.0)]
        interval: f64,
        /// Print this many tables and exit (each after a new sample), instead of refreshing
        /// the screen until interrupted.
        #[arg(long)]
        iterations: Option<u64>,
    },
    /// Write a VM's spec and disks to a new directory in paths.backups (a running VM is copied
    /// live, all disks at one instant).
    Export {
        name: String,
        /// Seconds the copy may take.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
        /// Fail (error 4094) rather than copy a running VM whose guest file systems cannot all
        /// be frozen (no agent, a failed freeze, a file system it cannot freeze).
        #[arg(long)]
        require_frozen: bool,
        /// Copy only what changed since the parent backup (per disk; a disk that cannot is
        /// copied whole and the manifest says why).
        #[arg(long)]
        incremental: bool,
        /// The parent backup (a directory name; default: the VM's newest backup).
        #[arg(long, requires = "incremental")]
        since: Option<String>,
        /// Keep only the VM's newest N backups afterwards.
        #[arg(long)]
        keep: Option<u32>,
    },
    /// Keep only a VM's newest N backups in paths.backups (an increment whose parent goes is
    /// merged into a full backup first).
    BackupsPrune {
        name: String,
        /// How many of its newest backups stay.
        #[arg(long)]
        keep: u32,
    },
    /// Make a VM from a backup in paths.backups (by its directory name).
    Import {
        backup: String,
        /// The new VM's name (default: the exported one's).
        #[arg(long)]
        name: Option<String>,
        /// Define it stopped (default: the state its spec had).
        #[arg(long)]
        stopped: bool,
    },
    /// Copy a VM's disks into a snapshot kept with it (a running VM's all at one instant).
    Snapshot {
        name: String,
        snapshot: String,
        /// Seconds the copy may take.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
        /// Fail (error 4094) rather than snapshot a running VM whose guest file systems cannot
        /// all be frozen (no agent, a failed freeze, a file system it cannot freeze).
        #[arg(long)]
        require_frozen: bool,
    },
    /// A VM's snapshots, oldest first.
    Snapshots { name: String },
    /// Put a stopped VM's disks back as they were in a snapshot.
    Revert { name: String, snapshot: String },
    /// Delete a snapshot of a VM.
    SnapshotDelete { name: String, snapshot: String },
    /// The image store: import (verified by sha256), list, delete.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Run a command as root in the guest and exit with its exit code (128 + signal, 124 at
    /// its timeout, 255 when vmhostd fails); its output is printed as it comes. Needs
    /// `[agent] allow_exec` (docs/guest-exec.md).
    Exec(exec::ExecArgs),
    /// Copy a local file (or one in vmhostd's `[agent] files_dir`, `--source`) into the guest,
    /// atomically, checked by sha256.
    Push(files::PushArgs),
    /// Copy a file out of the guest to LOCAL, atomically, checked by sha256.
    Pull(files::PullArgs),
    /// ssh to the VM: its spec's static address, else the guest agent's; user from `-l`, the
    /// spec's `ssh.user`, else root.
    Ssh(ssh::SshArgs),
    /// Prepare this host to receive a VM (`vm.migrate_in`) from its spec as the source runs it
    /// (each NIC with its MAC); prints the address and one-time secret for `migrate`.
    MigrateIn(migrate::MigrateInArgs),
    /// Move a running VM live to another vmhostd: prepared with `migrate-in` (`--to`, and
    /// `--secret -` on standard input or `--secret-file`), or with `--to-socket` the destination's API socket, which vmhostctl
    /// prepares itself. Draws the progress as it goes.
    Migrate(migrate::MigrateArgs),
    /// Move a stopped VM (with `--stop` a running one, started again there) cold to the
    /// vmhostd at `--to-socket`: its spec and disk files, each checked by sha256.
    Move(moves::MoveArgs),
    /// Say what became of a move whose outcome this host could not learn (the VM `failed`,
    /// its migration `committing`), after looking at the destination: `committed` ends it
    /// here, `abandoned` keeps it here. Refused when the destination answers otherwise.
    MigrateSettle(migrate::SettleArgs),
    /// Call any method with JSON params.
    Call { method: String, params: Option<String> },
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Copy an image into the images directory (from an http(s) URL or a file in the import
    /// directory) and record it, refused unless it has SHA256; without --source, check and
    /// record a file already there.
    Import {
        name: String,
        sha256: String,
        /// The URL or file name; `-` reads it from the first line of standard input, so that a
        /// signed URL's token is not in this command's argv for every local user's `ps`.
        #[arg(long)]
        source: Option<String>,
        /// Seconds a download may take.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// Every image: size, format, sha256 (`-` when put there by hand) and the VMs using it.
    List,
    /// Delete an image no VM uses.
    Delete { name: String },
}

fn main() -> ExitCode {
    // A closed output pipe (`vmhostctl --json list | head -1`) ends the CLI quietly, as it does any
    // Unix filter, instead of a panic from println!. Rust sets SIGPIPE to ignored by default.
    // SAFETY: no other thread exists yet, and SIG_DFL installs no handler code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    if let Cmd::Exec(args) = &cli.cmd {
        // The guest command's exit code is vmhostctl's: vmhostd's own failures take 255, which
        // no other meaning of vmhostctl's codes (1, 2, 3) can be confused with.
        return match connect(&cli).and_then(|c| exec::run(c, args, cli.json)) {
            Ok(code) => ExitCode::from(code),
            Err(failure) => {
                report(&cli, failure);
                ExitCode::from(exec::DAEMON_FAILURE)
            }
        };
    }
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => report(&cli, failure),
    }
}

/// Prints a failure (its JSON too with `--json`) and returns vmhostctl's exit code for it.
fn report(cli: &Cli, failure: Failure) -> ExitCode {
    match failure {
        Failure::Api(e) => {
            if cli.json {
                println!("{}", json_line(&json!({"error": e.to_json()}).to_string()));
            }
            let field = e.field.as_deref().map(|f| format!(" [{f}]")).unwrap_or_default();
            tell!("vmhostctl: error {} ({}){field}: {}", e.code.as_i32(), e.code.kind(), e.message);
            if !e.details.is_null() {
                tell!("  details: {}", e.details);
            }
            ExitCode::from(1)
        }
        Failure::Connect(m) => {
            tell!("vmhostctl: {m}");
            ExitCode::from(3)
        }
        Failure::Usage(m) => {
            tell!("vmhostctl: {m}");
            ExitCode::from(2)
        }
        Failure::Console(m) => {
            eprintln!();
            tell!("vmhostctl: {m}");
            ExitCode::from(4)
        }
    }
}

#[derive(Debug)]
enum Failure {
    Api(vmhost::api::ApiError),
    Connect(String),
    Usage(String),
    /// A console closed by the daemon, or its terminal failing.
    Console(String),
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Api(a) => Failure::Api(a),
            other => Failure::Connect(other.to_string()),
        }
    }
}

/// `image import --source -`: the first line of standard input, without its line end.
fn source_from_stdin() -> Result<String, Failure> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| Failure::Usage(format!("stdin: {e}")))?;
    let source = line.trim_end_matches(['\r', '\n']);
    if source.is_empty() {
        return Err(Failure::Usage("--source -: standard input has no source on its first line".into()));
    }
    Ok(source.to_string())
}

fn read_json(file: &PathBuf) -> Result<Value, Failure> {
    let mut text = String::new();
    if file.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text).map_err(|e| Failure::Usage(format!("stdin: {e}")))?;
    } else {
        text = std::fs::read_to_string(file).map_err(|e| Failure::Usage(format!("{}: {e}", file.display())))?;
    }
    serde_json::from_str(&text).map_err(|e| Failure::Usage(format!("{}: invalid JSON: {e}", file.display())))
}

fn connect(cli: &Cli) -> Result<Client, Failure> {
    Client::connect(&cli.socket)
        .map_err(|e| Failure::Connect(format!("cannot reach vmhostd at {}: {e}", cli.socket.display())))
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let mut c = connect(cli)?;
    if let Cmd::Console { name, read_only, force } = &cli.cmd {
        return console(c, name, *read_only, *force);
    }
    let out = |v: &Value| println!("{}", json_line(&serde_json::to_string_pretty(v).unwrap_or_default()));
    match &cli.cmd {
        Cmd::Info => {
            let v: Value = c.call("host.info", json!({}))?;
            if cli.json {
                out(&v);
            } else {
                print_info(&serde_json::from_value(v).map_err(|e| Failure::Connect(e.to_string()))?);
            }
        }
        Cmd::Check { name: Some(name) } => {
            let v: Value = c.call("vm.check", json!({ "name": name }))?;
            let r: vmhost_agent_protocol::CheckReport =
                serde_json::from_value(v.clone()).map_err(|e| Failure::Connect(e.to_string()))?;
            if cli.json {
                out(&v);
            } else {
                let rows = r
                    .checks
                    .iter()
                    .map(|k| {
                        vec![
                            if k.ok { "ok" } else { "FAIL" }.to_string(),
                            k.name.clone(),
                            k.expected.clone(),
                            k.observed.clone(),
                        ]
                    })
                    .collect();
                print_table(&["RESULT", "CHECK", "EXPECTED", "OBSERVED"], rows);
                say!("{name}: network {}", if r.ok { "as declared" } else { "NOT as declared" });
            }
            if !r.ok {
                return Err(Failure::Usage("the guest's network is not as declared".into()));
            }
        }
        Cmd::GuestInfo { name } => out(&c.call::<Value>("vm.guest_info", json!({ "name": name }))?),
        Cmd::GuestNetwork { name } => out(&c.call::<Value>("vm.guest_network", json!({ "name": name }))?),
        Cmd::Check { name: None } => {
            let v: Value = c.call("host.check", json!({}))?;
            let r: HostCheck = serde_json::from_value(v.clone()).map_err(|e| Failure::Connect(e.to_string()))?;
            if cli.json {
                out(&v);
            } else {
                let rows = r
                    .items
                    .iter()
                    .map(|i| vec![i.name.clone(), format!("{:?}", i.status).to_lowercase(), i.detail.clone()]);
                print_table(&["ITEM", "STATUS", "DETAIL"], rows.collect());
                say!("overall: {}", if r.ok { "ok" } else { "NOT OK" });
            }
            if !r.ok {
                return Err(Failure::Usage("host check found problems".into()));
            }
        }
        Cmd::List => {
            let v: Value = c.call("vm.list", json!({}))?;
            if cli.json {
                out(&v);
            } else {
                let vms: Vec<VmView> = serde_json::from_value(v).map_err(|e| Failure::Connect(e.to_string()))?;
                print_list(&vms);
            }
        }
        Cmd::Get { name } => {
            let v: Value = c.call("vm.get", json!({ "name": name }))?;
            if cli.json {
                out(&v);
            } else {
                let vm: VmView = serde_json::from_value(v).map_err(|e| Failure::Connect(e.to_string()))?;
                print_vm(&vm);
            }
        }
        Cmd::Create { file } => mutation(cli, &mut c, "vm.create", json!({ "spec": read_json(file)? }))?,
        Cmd::Apply { file, replace, no_restart, timeout } => {
            c.set_timeout(Duration::from_secs(timeout.saturating_add(180)))?;
            let params =
                json!({ "spec": read_json(file)?, "replace": replace, "restart": !no_restart, "timeout_s": timeout });
            mutation(cli, &mut c, "vm.apply", params)?
        }
        Cmd::Start { name } => mutation(cli, &mut c, "vm.start", json!({ "name": name }))?,
        Cmd::Stop { name, timeout, force } => {
            // The daemon may wait `timeout` for the guest, then kill it: wait longer than that.
            c.set_timeout(Duration::from_secs(timeout.saturating_add(120)))?;
            mutation(cli, &mut c, "vm.stop", json!({ "name": name, "timeout_s": timeout, "force": force }))?
        }
        Cmd::Restart { name, timeout, force } => {
            c.set_timeout(Duration::from_secs(timeout.saturating_add(180)))?;
            mutation(cli, &mut c, "vm.restart", json!({ "name": name, "timeout_s": timeout, "force": force }))?
        }
        Cmd::ShutdownVms { timeout } => {
            c.set_timeout(Duration::from_secs(timeout.saturating_add(180)))?;
            let v: Value = c.call("host.shutdown_vms", json!({ "timeout_s": timeout }))?;
            if cli.json {
                out(&v);
            } else {
                for r in v["vms"].as_array().into_iter().flatten() {
                    let outcome =
                        if r["ok"] == true { "off".to_string() } else { format!("FAILED {}", r["error"]["message"]) };
                    say!("{:<24} {outcome}", r["vm"].as_str().unwrap_or(""));
                }
            }
            if v["ok"] != true {
                return Err(Failure::Usage("some VMs could not be powered off".into()));
            }
        }
        Cmd::Destroy { name } => mutation(cli, &mut c, "vm.destroy", json!({ "name": name }))?,
        Cmd::PurgeKeptDisks { name } => {
            let v: Value = c.call("host.purge_kept_disks", json!({ "vm": name }))?;
            if cli.json {
                out(&v);
            } else {
                for path in v.get("deleted").and_then(Value::as_array).into_iter().flatten() {
                    say!("deleted {}", path.as_str().unwrap_or_default());
                }
            }
        }
        Cmd::Reconcile { file, prune, dry_run, replace } => {
            let doc = read_json(file)?;
            let vms = if doc.is_array() { doc } else { doc.get("vms").cloned().unwrap_or(Value::Null) };
            let v: Value = c.call(
                "host.reconcile",
                json!({ "vms": vms, "prune": prune, "dry_run": dry_run, "replace": replace }),
            )?;
            let r: ReconcileReport = serde_json::from_value(v.clone()).map_err(|e| Failure::Connect(e.to_string()))?;
            if cli.json {
                out(&v);
            } else {
                print_reconcile(&r);
            }
            // A reconcile with failing entries is a failed command for scripts.
            if !r.ok {
                return Err(Failure::Usage("some reconcile entries failed".into()));
            }
        }
        Cmd::Events => {
            c.subscribe_events()?;
            loop {
                match c.next_event(Duration::from_secs(3600))? {
                    Some(e) if cli.json => println!("{}", json_line(&serde_json::to_string(&e).unwrap_or_default())),
                    Some(e) => say!(
                        "{} {} {} -> {} ({})",
                        e.time,
                        e.vm,
                        e.from.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                        e.to.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                        e.reason
                    ),
                    None => {}
                }
            }
        }
        Cmd::Console { .. } => {}
        Cmd::Stats { name, prometheus } => stats_cmd(cli, &mut c, name.as_deref(), *prometheus)?,
        Cmd::Top { interval, iterations } => top_cmd(&mut c, *interval, *iterations)?,
        Cmd::Snapshot { name, snapshot, timeout, require_frozen } => {
            c.set_timeout(Duration::from_secs(timeout.saturating_add(120)))?;
            let mut params = json!({ "name": name, "snapshot": snapshot, "timeout_s": timeout });
            if *require_frozen {
                params["requires"] = json!("frozen");
            }
            let v: Value = c.call("vm.snapshot", params)?;
            if cli.json {
                out(&v);
            } else {
                say!("{name}: snapshot {snapshot} taken ({})", copy_consistency(&v));
            }
        }
        Cmd::Snapshots { name } => {
            let v: Value = c.call("vm.snapshots", json!({ "name": name }))?;
            if cli.json {
                out(&v);
            } else {
                let rows = elements(&v)
                    .map(|s| {
                        let bytes: u64 = elements(&s["disks"]).filter_map(|d| d["bytes"].as_u64()).sum();
                        vec![
                            cell(&s["name"]),
                            cell(&s["created_at"]),
                            s["live"].to_string(),
                            cell(&s["consistency"]),
                            bytes.to_string(),
                        ]
                    })
                    .collect();
                print_table(&["SNAPSHOT", "TAKEN", "LIVE", "CONSISTENCY", "BYTES"], rows);
            }
        }
        Cmd::Revert { name, snapshot } => {
            c.set_timeout(Duration::from_secs(3600))?;
            mutation(cli, &mut c, "vm.revert", json!({ "name": name, "snapshot": snapshot }))?
        }
        Cmd::SnapshotDelete { name, snapshot } => {
            let v: Value = c.call("vm.snapshot_delete", json!({ "name": name, "snapshot": snapshot }))?;
            if cli.json {
                out(&v);
            } else {
                say!("{name}: snapshot {snapshot} {}", if v["changed"] == true { "deleted" } else { "absent" });
            }
        }
        Cmd::Export { name, timeout, require_frozen, incremental, since, keep } => {
            c.set_timeout(Duration::from_secs(timeout.saturating_add(120)))?;
            let mut params = json!({ "name": name, "timeout_s": timeout });
            if *require_frozen {
                params["requires"] = json!("frozen");
            }
            if *incremental {
                params["incremental"] = json!(true);
            }
            if let Some(since) = since {
                params["since"] = json!(since);
            }
            if let Some(keep) = keep {
                params["keep"] = json!(keep);
            }
            let v: Value = c.call("vm.export", params)?;
            if cli.json {
                out(&v);
            } else {
                let m = &v["manifest"];
                // A full backup's line is as before incremental backups were.
                let kind = match m["parent"]["dir"].as_str() {
                    Some(parent) => format!(", incremental over {parent}"),
                    None => String::new(),
                };
                say!("{name}: exported to {} ({}){kind}", v["path"].as_str().unwrap_or_default(), copy_consistency(m));
                for change in elements(&m["changes"]) {
                    if let Some(why) = change["full_reason"].as_str() {
                        say!("  {}: copied whole: {why}", change["name"].as_str().unwrap_or_default());
                    }
                }
            }
        }
        Cmd::BackupsPrune { name, keep } => {
            c.set_timeout(Duration::from_secs(3600))?;
            let v: Value = c.call("vm.backups_prune", json!({ "name": name, "keep": keep }))?;
            if cli.json {
                out(&v);
            } else {
                for (old, _) in elements(&v["merged"]).filter_map(|m| Some((m[0].as_str()?, ()))) {
                    say!("{name}: merged {old} into a full backup");
                }
                for gone in elements(&v["removed"]).filter_map(Value::as_str) {
                    say!("{name}: removed {gone}");
                }
                say!("{name}: {} backup(s) kept", elements(&v["kept"]).count());
            }
        }
        Cmd::Import { backup, name, stopped } => {
            c.set_timeout(Duration::from_secs(3600))?;
            let mut params = json!({ "backup": backup, "name": name });
            if *stopped {
                params["state"] = json!("stopped");
            }
            mutation(cli, &mut c, "vm.import", params)?
        }
        Cmd::Image(ImageCmd::Import { name, sha256, source, timeout }) => {
            let source = match source.as_deref() {
                Some("-") => Some(source_from_stdin()?),
                _ => source.clone(),
            };
            c.set_timeout(Duration::from_secs(timeout.saturating_add(120)))?;
            let params = json!({ "name": name, "sha256": sha256, "source": source, "timeout_s": timeout });
            let v: Value = c.call("image.import", params)?;
            if cli.json {
                out(&v);
            } else {
                let what = if v["changed"] == true { "imported" } else { "unchanged" };
                say!("{name}: {what}, {} bytes, {}", v["image"]["bytes"], v["image"]["format"].as_str().unwrap_or("-"));
            }
        }
        Cmd::Image(ImageCmd::List) => {
            let v: Value = c.call("image.list", json!({}))?;
            if cli.json {
                out(&v);
            } else {
                let rows = elements(&v)
                    .map(|i| {
                        let users: Vec<String> = elements(&i["used_by"]).map(cell).collect();
                        vec![
                            cell(&i["name"]),
                            i["bytes"].to_string(),
                            cell(&i["format"]),
                            cell(&i["sha256"]),
                            users.join(","),
                        ]
                    })
                    .collect();
                print_table(&["NAME", "BYTES", "FORMAT", "SHA256", "USED BY"], rows);
            }
        }
        Cmd::Image(ImageCmd::Delete { name }) => {
            let v: Value = c.call("image.delete", json!({ "name": name }))?;
            if cli.json {
                out(&v);
            } else {
                say!("{name}: {}", if v["changed"] == true { "deleted" } else { "absent" });
            }
        }
        Cmd::Exec(_) => {}
        Cmd::MigrateIn(args) => out(&migrate::migrate_in(&mut c, args)?),
        Cmd::MigrateSettle(args) => {
            let v = migrate::settle(&mut c, args)?;
            if cli.json {
                out(&v);
            } else {
                say!(
                    "{}: settled {} (the destination: {}); now {}",
                    args.name,
                    v["outcome"].as_str().unwrap_or_default(),
                    v["destination"].as_str().unwrap_or_default(),
                    v["status"].as_str().unwrap_or("gone from this host")
                );
            }
        }
        Cmd::Move(args) => {
            let v = moves::move_vm(&mut c, args)?;
            if cli.json {
                out(&v);
            } else {
                say!(
                    "{}: moved to {} in {} ms ({} bytes of disks)",
                    args.name,
                    v["destination"].as_str().unwrap_or_default(),
                    v["total_ms"],
                    v["disk_bytes"]
                );
            }
        }
        Cmd::Migrate(args) => {
            let v = migrate::migrate(&mut c, &cli.socket, args, cli.json)?;
            if cli.json {
                out(&v);
            } else {
                say!(
                    "{}: migrated to {} in {} ms (downtime {} ms, memory {} bytes, disks {} bytes)",
                    args.name,
                    v["destination"].as_str().unwrap_or_default(),
                    v["total_ms"],
                    v["downtime_ms"],
                    v["ram_bytes"],
                    v["disk_bytes"]
                );
            }
        }
        Cmd::Push(args) => {
            let v = files::push(&mut c, args)?;
            if cli.json {
                out(&v);
            } else {
                say!(
                    "{}: {} bytes written to {} (sha256 {})",
                    args.name,
                    v["size"],
                    v["path"].as_str().unwrap_or_default(),
                    v["sha256"].as_str().unwrap_or_default()
                );
            }
        }
        Cmd::Pull(args) => {
            let mut v = files::pull(&mut c, args)?;
            if cli.json {
                // The content is in LOCAL; the answer without it says what was written.
                if let Some(o) = v.as_object_mut() {
                    o.remove("content");
                }
                out(&v);
            } else if args.local.as_os_str() != "-" {
                say!(
                    "{}: {} bytes of {} written to {} (sha256 {})",
                    args.name,
                    v["size"],
                    args.guest_path,
                    args.local.display(),
                    v["sha256"].as_str().unwrap_or_default()
                );
            }
        }
        Cmd::Ssh(args) => {
            let vm: Value = c.call("vm.get", json!({ "name": args.name }))?;
            let addr = ssh::find_address(&mut c, &args.name, &vm)?;
            let user = ssh::user_of(args.user.as_deref(), &vm);
            let argv = ssh::ssh_argv(&user, addr, &args.extra)?;
            drop(c);
            return Err(ssh::exec_ssh(&argv));
        }
        Cmd::Call { method, params } => {
            let p: Value = match params {
                Some(t) => serde_json::from_str(t).map_err(|e| Failure::Usage(format!("params: invalid JSON: {e}")))?,
                None => json!({}),
            };
            let v: Value = c.call(method, p)?;
            out(&v);
        }
    }
    Ok(())
}

/// `vmhostctl console`: attaches, then hands the terminal to the console until Ctrl-] (exit 0)
/// or the daemon closes it (exit 4: taken over, the VM stopped, the daemon stopping).
fn console(c: Client, name: &str, read_only: bool, force: bool) -> Result<(), Failure> {
    let (stream, early, attached) = c.console(name, read_only, force)?;
    let mode = if attached.read_only { ", read-only" } else { "" };
    tell!("Connected to the console of {name}{mode} (escape character is ^])");
    let outcome = vmhost::console::terminal::run(stream, &early)
        .map_err(|e| Failure::Console(format!("console of {name}: {e}")))?;
    match outcome {
        vmhost::console::terminal::Outcome::Detached => {
            eprintln!();
            tell!("Detached from the console of {name}");
            Ok(())
        }
        vmhost::console::terminal::Outcome::Closed => {
            Err(Failure::Console(format!("the console of {name} was closed by vmhostd")))
        }
    }
}

fn mutation(cli: &Cli, c: &mut Client, method: &str, params: Value) -> Result<(), Failure> {
    let v: Value = c.call(method, params)?;
    if cli.json {
        println!("{}", json_line(&serde_json::to_string_pretty(&v).unwrap_or_default()));
        return Ok(());
    }
    let m: Mutation = serde_json::from_value(v).map_err(|e| Failure::Connect(e.to_string()))?;
    let what = if m.changed { "changed" } else { "unchanged" };
    match m.vm {
        Some(vm) => say!("{}: {what}, {}", vm.name, vm.status),
        None => say!("{what}: destroyed"),
    }
    for kept in &m.kept_disks {
        say!("kept data disk {}", kept.display());
    }
    Ok(())
}

/// A JSON string as a table cell, `-` for anything else (null).
fn cell(x: &Value) -> String {
    x.as_str().map_or_else(|| "-".to_string(), str::to_string)
}

/// The elements of a JSON array (none for anything else).
fn elements(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

/// What a snapshot or a backup manifest says of its copy: `live, frozen: /, /nsm`, `live,
/// crash-consistent: REASON`, `stopped`.
fn copy_consistency(v: &Value) -> String {
    let live = if v["live"] == true { "live" } else { "stopped" };
    match v["consistency"].as_str() {
        Some("frozen") => {
            let mounts: Vec<&str> = elements(&v["frozen"]).filter_map(Value::as_str).collect();
            format!("{live}, frozen: {}", mounts.join(", "))
        }
        Some("crash") => format!("{live}, crash-consistent: {}", v["reason"].as_str().unwrap_or("no reason given")),
        Some("stopped") | None => live.to_string(),
        Some(other) => format!("{live}, {other}"),
    }
}

fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    for line in table(headers, rows) {
        say!("{line}");
    }
}

/// The lines of a table: cells escaped ([`vmhost::guest_text::escape`]) before the columns are
/// measured, so they line up with what is shown and no cell can break its row.
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> Vec<String> {
    let rows: Vec<Vec<String>> =
        rows.into_iter().map(|r| r.iter().map(|c| vmhost::guest_text::escape(c).into_owned()).collect()).collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, cell) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.len());
            }
        }
    }
    let line = |cells: &[String]| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{:<w$}", c, w = widths.get(i).copied().unwrap_or(0)))
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = vec![line(&headers.iter().map(|h| h.to_string()).collect::<Vec<_>>())];
    out.extend(rows.iter().map(|r| line(r)));
    out
}

fn print_list(vms: &[VmView]) {
    let rows = vms
        .iter()
        .map(|v| {
            vec![
                v.name.clone(),
                v.status.to_string(),
                format!("{:?}", v.desired_state).to_lowercase(),
                v.spec.cpu.to_string(),
                v.spec.memory_mib.to_string(),
                v.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                v.spec.role.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    print_table(&["NAME", "STATUS", "DESIRED", "CPU", "MEM_MIB", "PID", "ROLE"], rows);
}

fn print_vm(v: &VmView) {
    say!("name:        {}", v.name);
    say!("status:      {}", v.status);
    say!("desired:     {}", format!("{:?}", v.desired_state).to_lowercase());
    if v.pending_restart {
        say!("pending:     a changed spec waits for the next start (vm.apply without --no-restart applies it)");
    }
    say!("pid:         {}", v.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()));
    say!("cpu:         {}", v.spec.cpu);
    say!("memory_mib:  {}", v.spec.memory_mib);
    say!("created_at:  {}", v.created_at);
    say!("started_at:  {}", v.started_at.clone().unwrap_or_else(|| "-".into()));
    if let Some(id) = &v.instance_id {
        say!("instance_id: {id}");
    }
    say!("serial_log:  {}", v.serial_log.display());
    if let Some(e) = &v.last_error {
        say!("last_error:  {} {}", e.code, e.message);
    }
    say!("spec:        {}", serde_json::to_string(&v.spec).unwrap_or_default());
}

fn print_info(i: &HostInfo) {
    say!("vmhostd {} (API v{}), accel {}, {} VMs", i.version, i.api_version, i.accel, i.vm_count);
    print_table(
        &["RESOURCE", "TOTAL", "RESERVED", "ALLOCATED", "AVAILABLE"],
        [("cpu", &i.cpu), ("memory_mib", &i.memory_mib)]
            .iter()
            .map(|(n, u)| {
                vec![
                    n.to_string(),
                    u.total.to_string(),
                    u.reserved.to_string(),
                    u.allocated.to_string(),
                    u.available.to_string(),
                ]
            })
            .collect(),
    );
    if !i.hardware.is_empty() {
        say!();
        let rows = i
            .hardware
            .iter()
            .map(|h| {
                vec![
                    h.class.to_string(),
                    h.index.to_string(),
                    h.pci.clone(),
                    h.holder.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        print_table(&["CLASS", "INDEX", "PCI", "HOLDER"], rows);
    }
    if !i.kept_disks.is_empty() {
        say!();
        let rows = i
            .kept_disks
            .iter()
            .map(|k| vec![k.vm.clone(), k.name.clone(), k.format.as_str().to_string(), k.path.display().to_string()])
            .collect();
        print_table(&["KEPT FOR VM", "DISK", "FORMAT", "PATH"], rows);
    }
}

fn print_reconcile(r: &ReconcileReport) {
    let rows = r
        .plan
        .iter()
        .map(|p| {
            let result = r.results.iter().find(|x| x.vm == p.vm);
            let outcome = match (result, &p.error) {
                (Some(x), _) if x.ok => {
                    if x.changed {
                        "done".to_string()
                    } else {
                        "ok".to_string()
                    }
                }
                (Some(x), _) => {
                    format!("FAILED {}", x.error.as_ref().map(|e| e["message"].to_string()).unwrap_or_default())
                }
                (None, Some(e)) => format!("would fail: {}", e["message"]),
                (None, None) => "planned".to_string(),
            };
            vec![p.vm.clone(), format!("{:?}", p.action).to_lowercase(), p.reason.clone(), outcome]
        })
        .collect();
    print_table(&["VM", "ACTION", "REASON", "OUTCOME"], rows);
    say!("{}{}", if r.dry_run { "dry run: " } else { "" }, if r.ok { "ok" } else { "FAILED" });
}

/// `vmhostctl stats`: JSON, the Prometheus text format, or a table of the raw counters.
fn stats_cmd(cli: &Cli, c: &mut Client, name: Option<&str>, prometheus: bool) -> Result<(), Failure> {
    let params = name.map_or_else(|| json!({}), |n| json!({ "name": n }));
    let v: Value = c.call("vm.stats", params)?;
    let report: VmStatsReport = serde_json::from_value(v.clone()).map_err(|e| Failure::Connect(e.to_string()))?;
    if prometheus {
        let host: Option<HostStats> = match name {
            Some(_) => None,
            None => Some(c.call("host.stats", json!({}))?),
        };
        // Label values are escaped for the format; VM names cannot hold control characters.
        print!("{}", vmhost::stats::prometheus::render(&report, host.as_ref()));
    } else if cli.json {
        println!("{}", json_line(&serde_json::to_string_pretty(&v).unwrap_or_default()));
    } else {
        let bytes = |b: Option<u64>| vmhost::stats::top::human_bytes(b.map(|x| x as f64));
        let rows = report
            .vms
            .iter()
            .map(|v| {
                vec![
                    v.name.clone(),
                    v.status.to_string(),
                    v.cpu_seconds.map_or_else(|| "-".into(), |s| format!("{s:.2}")),
                    bytes(v.rss_bytes),
                    bytes(Some(v.disks.iter().map(|d| d.read_bytes).sum())),
                    bytes(Some(v.disks.iter().map(|d| d.write_bytes).sum())),
                    bytes(Some(v.nics.iter().map(|n| n.rx_bytes).sum())),
                    bytes(Some(v.nics.iter().map(|n| n.tx_bytes).sum())),
                    v.missing.keys().cloned().collect::<Vec<_>>().join(","),
                ]
            })
            .collect();
        print_table(&["NAME", "STATUS", "CPU_S", "RSS", "DISK_RD", "DISK_WR", "NET_RX", "NET_TX", "MISSING"], rows);
    }
    Ok(())
}

/// `vmhostctl top`: samples `vm.stats` every `interval` and prints rates between the last two.
fn top_cmd(c: &mut Client, interval: f64, iterations: Option<u64>) -> Result<(), Failure> {
    use std::io::IsTerminal;
    if !(interval.is_finite() && interval > 0.0) {
        return Err(Failure::Usage("--interval must be a positive number of seconds".into()));
    }
    let refresh = iterations.is_none() && std::io::stdout().is_terminal();
    let mut prev: VmStatsReport = c.call("vm.stats", json!({}))?;
    let mut shown = 0u64;
    while iterations.is_none_or(|n| shown < n) {
        std::thread::sleep(Duration::from_secs_f64(interval));
        let cur: VmStatsReport = c.call("vm.stats", json!({}))?;
        let pct = |p: Option<f64>| p.map_or_else(|| "-".into(), |p| format!("{p:.1}"));
        let rate = |r: Option<f64>| format!("{}/s", vmhost::stats::top::human_bytes(r));
        let rows = vmhost::stats::top::rows(&prev, &cur)
            .into_iter()
            .map(|r| {
                vec![
                    r.name,
                    r.status,
                    pct(r.cpu_percent),
                    vmhost::stats::top::human_bytes(r.rss_bytes.map(|b| b as f64)),
                    rate(r.disk_read_per_s),
                    rate(r.disk_write_per_s),
                    rate(r.net_rx_per_s),
                    rate(r.net_tx_per_s),
                ]
            })
            .collect();
        if refresh {
            // Clear the screen and home the cursor: a fixed sequence, never guest text.
            print!("\x1b[H\x1b[2J");
        }
        say!("{}  {} VMs, every {interval}s", cur.time, cur.vms.len());
        print_table(&["NAME", "STATUS", "CPU%", "RSS", "DISK_RD", "DISK_WR", "NET_RX", "NET_TX"], rows);
        prev = cur;
        shown += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_cells_are_escaped_and_stay_in_their_row() {
        let rows = vec![
            vec!["FAIL".into(), "eth0\nFORGED ok".into(), "\u{1b}[32mok\u{1b}[0m".into(), "x\rY\u{9b}2J".into()],
            vec!["ok".into(), "dns".into(), "10.0.0.1".into(), "10.0.0.1".into()],
        ];
        let lines = table(&["RESULT", "CHECK", "EXPECTED", "OBSERVED"], rows);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[1], r"FAIL    eth0\nFORGED ok  \x1b[32mok\x1b[0m  x\rY\u{9b}2J");
        assert!(lines.iter().all(|l| !l.chars().any(|c| c.is_control())), "{lines:?}");
        // Columns line up with the escaped text.
        assert_eq!(lines[2].find("dns"), lines[1].find("eth0"));
        assert_eq!(lines[2].find("10.0.0.1"), lines[1].find(r"\x1b"));
    }

    #[test]
    fn a_copy_says_how_consistent_it_is() {
        let frozen = json!({"live": true, "consistency": "frozen", "frozen": ["/", "/nsm"]});
        assert_eq!(copy_consistency(&frozen), "live, frozen: /, /nsm");
        let crash = json!({"live": true, "consistency": "crash", "reason": "no agent", "frozen": []});
        assert_eq!(copy_consistency(&crash), "live, crash-consistent: no agent");
        assert_eq!(copy_consistency(&json!({"live": false, "consistency": "stopped"})), "stopped");
        let killed = json!({"live": false, "consistency": "crash", "reason": "vm.stop had to kill the VM's QEMU"});
        assert_eq!(copy_consistency(&killed), "stopped, crash-consistent: vm.stop had to kill the VM's QEMU");
        assert_eq!(copy_consistency(&json!({"live": true, "frozen": []})), "live", "recorded before consistency was");
    }

    #[test]
    fn json_output_keeps_its_value_without_raw_c1() {
        let v = json!({"hostname": "liar\u{9b}31m\u{1b}]0;t\u{7}"});
        let text = json_line(&serde_json::to_string_pretty(&v).unwrap());
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), v);
    }
}
