//! vmhostd: the vmhost host daemon.
//!
//! Start-up order matters: config (refuse to start on any error), logging, the sandbox (before
//! any other thread exists; see `vmhost::sandbox`), the manager (records
//! loaded and running VMs re-adopted *before* the socket accepts calls), then the socket. On
//! SIGTERM/SIGINT the socket closes and the daemon exits; VMs keep running. Under systemd the socket
//! may be inherited instead of bound (`rpc::activation`), and readiness is notified.

use clap::Parser;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use vmhost::config::{Config, DEFAULT_CONFIG_PATH};
use vmhost::events::EventBus;
use vmhost::lifecycle::Manager;
use vmhost::rpc::activation::{self, Activation};
use vmhost::rpc::{auth::AccessPolicy, methods, server};

#[derive(Parser)]
#[command(name = "vmhostd", version, about = "vmhost host daemon: VMs over JSON-RPC on a Unix socket")]
struct Args {
    /// Host configuration file.
    #[arg(long, default_value = DEFAULT_CONFIG_PATH)]
    config: PathBuf,
    /// Validate the configuration and exit.
    #[arg(long)]
    check_config: bool,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vmhostd: refusing to start: {e}");
            return ExitCode::from(2);
        }
    };
    if args.check_config {
        println!("{}: OK", args.config.display());
        return ExitCode::SUCCESS;
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("VMHOST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if args.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
    raise_fd_limit();
    // First: the socket systemd passed becomes close-on-exec before anything could fork (the
    // sandbox forks its spawner).
    let activation = match Activation::from_env() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vmhostd: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Before the sandbox creates the state directory's subdirectories (with its umask): they
    // are private (vmhost::state::dirs).
    match vmhost::state::dirs::prepare(&config.paths.state) {
        Ok(tightened) => {
            for dir in tightened {
                tracing::warn!(dir = %dir.display(), "tightened a state directory to mode 0700");
            }
        }
        Err(e) => {
            eprintln!("vmhostd: refusing to start: {e}");
            return ExitCode::FAILURE;
        }
    }
    // The import directory (boot.disk) exists before the sandbox, whose Landlock rule needs an
    // existing path; private when vmhostd makes it. One that exists is left as it is.
    // The backups directory likewise (vm.export, vm.import).
    for dir in [config.paths.import_dir(), config.paths.backups_dir()] {
        if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot create a directory vmhostd works in");
        }
    }
    // Before the sandbox, which takes away reading other users' /proc/PID/exe: the executables
    // of the QEMUs that outlived the previous daemon, so that only real ones are re-adopted
    // (vmhost::qemu::identity).
    let qemu_user = config.qemu_user.unwrap_or_else(|| vmhost::config::UserIds {
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
    });
    match vmhost::qemu::identity::remember_executables(qemu_user) {
        Ok(n) => {
            tracing::debug!(processes = n, uid = qemu_user.uid, "remembered the executables of qemu.user's processes")
        }
        Err(e) => tracing::warn!(error = %e, "cannot list /proc: no QEMU of a previous vmhostd will be re-adopted"),
    }
    // Before the runtime: capabilities, Landlock and seccomp bind the calling thread and the
    // threads it creates afterwards (docs/sandbox.md). It keeps LISTEN_* and the inherited fds.
    if let Err(e) = vmhost::sandbox::enter(&config) {
        tracing::error!("{e}");
        eprintln!("vmhostd: refusing to start: {e}");
        return ExitCode::FAILURE;
    }
    // Before the runtime starts threads (this edits the environment): no child inherits them.
    activation::remove_env();
    // A `vm.list` of 1000 VMs is about 450 KB, and 32 clients at once hold 30 MB of answers.
    // glibc raises its mmap threshold after the first large free and keeps later large buffers
    // in up to 8 arenas per core for good; a fixed threshold and two arenas give them back.
    // SAFETY: mallopt is thread-safe and only sets allocator parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmhostd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, activation)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("vmhostd: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft open-file limit to the hard one: every connection, QMP session and pidfd is a
/// descriptor, and running out would leave the daemon unable to read /proc.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                eprintln!("vmhostd: cannot raise the open-file limit: {e}");
            }
        }
    }
}

async fn run(config: Config, mut activation: Activation) -> Result<(), String> {
    let config = Arc::new(config);
    tracing::info!(config = %config.file.display(), accel = config.qemu.accel.as_str(), "vmhostd starting");
    let manager = Manager::open(config.clone(), EventBus::default()).await?;
    manager.start_migration_port()?;
    let consoles = vmhost::console::Consoles::new(manager.clone());
    let dispatcher =
        Arc::new(methods::dispatcher(manager.clone(), consoles).map_err(|e| format!("method table: {e}"))?);
    let inherited = activation.listener.take();
    let activated = inherited.is_some();
    let listener = match inherited {
        Some(inherited) => {
            let addr = inherited.local_addr().ok().and_then(|a| a.as_pathname().map(|p| p.display().to_string()));
            let addr = addr.as_deref().unwrap_or("?");
            tracing::info!(
                socket = addr,
                "serving the socket systemd passed (socket activation); paths.socket is not used"
            );
            server::from_inherited(inherited).map_err(|e| format!("cannot serve the inherited socket: {e}"))?
        }
        None => server::bind(&config.paths.socket, config.socket_mode)
            .map_err(|e| format!("cannot listen on {}: {e}", config.paths.socket.display()))?,
    };
    let policy = Arc::new(AccessPolicy::from_group_names(&config.access.admin_group, &config.access.readonly_group));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Installed here, before anything is served: a task that installs them could run after the
    // first request was answered, and a SIGTERM in between would kill the daemon outright
    // (seen under socket activation, where the first connection is already waiting).
    use tokio::signal::unix::{signal, SignalKind};
    let (term, int) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    let (Ok(mut term), Ok(mut int)) = (term, int) else {
        return Err("cannot install the SIGTERM and SIGINT handlers".to_string());
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::info!("shutting down; VMs keep running");
        let _ = stop_tx.send(true);
    });
    if !activated {
        tracing::info!(socket = %config.paths.socket.display(), "serving");
    }
    // In the background: the socket is served while VMs desired running come back.
    let _autostart = vmhost::lifecycle::autostart::autostart(&manager);
    // QEMU writes each VM's logs itself; they are capped from the side (module doc of logcap).
    let _logcap = vmhost::logcap::spawn(config.paths.state.join("logs"), config.logs.max_bytes);
    if let Err(e) = activation.notify("READY=1") {
        tracing::warn!(error = %e, "cannot notify the service manager");
    }
    let options = server::Options { idle_timeout: std::time::Duration::from_secs(config.access.idle_timeout_s) };
    let served = server::serve_with(listener, dispatcher, policy, options, stop_rx).await;
    let _ = activation.notify("STOPPING=1");
    // An inherited socket stays: systemd keeps listening on it and starts vmhostd again on demand.
    if !activated {
        let _ = std::fs::remove_file(&config.paths.socket);
    }
    served.map_err(|e| format!("socket server: {e}"))
}
