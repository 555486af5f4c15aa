//! vmhostd: the vmhost host daemon.
//!
//! Start-up order matters: config (refuse to start on any error), logging, the sandbox (before
//! any other thread exists; see `vmhost::sandbox`), the manager (records
//! loaded and running VMs re-adopted *before* the socket accepts calls), then the socket. On
//! SIGTERM/SIGINT the socket closes and the daemon exits; VMs keep running.

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use vmhost::config::{Config, DEFAULT_CONFIG_PATH};
use vmhost::events::EventBus;
use vmhost::lifecycle::Manager;
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
    // Before the runtime: capabilities, Landlock and seccomp bind the calling thread and the
    // threads it creates afterwards (docs/sandbox.md).
    if let Err(e) = vmhost::sandbox::enter(&config) {
        tracing::error!("{e}");
        eprintln!("vmhostd: refusing to start: {e}");
        return ExitCode::FAILURE;
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmhostd: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
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

async fn run(config: Config) -> Result<(), String> {
    let config = Arc::new(config);
    tracing::info!(config = %config.file.display(), accel = config.qemu.accel.as_str(), "vmhostd starting");
    let manager = Manager::open(config.clone(), EventBus::default()).await?;
    let module = methods::build(manager).map_err(|e| format!("method table: {e}"))?;
    let listener = server::bind(&config.paths.socket, config.socket_mode)
        .map_err(|e| format!("cannot listen on {}: {e}", config.paths.socket.display()))?;
    let policy = Arc::new(AccessPolicy::from_group_names(&config.access.admin_group, &config.access.readonly_group));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::info!("shutting down; VMs keep running");
        let _ = stop_tx.send(true);
    });
    tracing::info!(socket = %config.paths.socket.display(), "serving");
    let served = server::serve(listener, module.into(), policy, stop_rx).await;
    let _ = std::fs::remove_file(&config.paths.socket);
    served.map_err(|e| format!("socket server: {e}"))
}
