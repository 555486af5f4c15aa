//! `vmhost-agent`: the guest side of vmhost's agent channel.
//!
//! Finds the virtio-serial port `org.vmhost.agent.0`, serves JSON-RPC on it, and when the port
//! itself fails (unplugged, not there yet) looks for it again every [`RETRY`]. Options exist for
//! tests and unusual images; see `--help`.
//!
//! With `--exec` it serves the exec ports `org.vmhost.exec.0..7` instead, one thread per port
//! (the same find-open-serve-retry loop each), as root and unsandboxed under its own unit
//! (`vmhost-agent-exec.service`; see `vmhost_agent::exec`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use vmhost_agent::agent::{Agent, Paths};
use vmhost_agent::exec::server::{ExecServer, System};
use vmhost_agent::log;
use vmhost_agent::port::{find_port, Port, Server, PORT_NAME};
use vmhost_agent_protocol::exec::{exec_port_name, EXEC_SLOTS};

/// Pause between attempts to find or open the port.
const RETRY: Duration = Duration::from_secs(1);

const USAGE: &str = "usage: vmhost-agent [--port PATH] [--name NAME] [--intent PATH] [--resolv-conf PATH]
                    [--resolved-conf PATH]
       vmhost-agent --exec
  --exec                serve the exec ports org.vmhost.exec.0..7 (commands, files, clock,
                        shutdown, SSH keys: run as root, see vmhost-agent-exec.service)
  --port PATH           serve on this device instead of looking the port up by name
  --name NAME           virtio-serial port name (default org.vmhost.agent.0)
  --intent PATH         where net.apply saves its intent (default /run/vmhost-agent/intent.json)
  --resolv-conf PATH    resolver configuration to report (default /etc/resolv.conf)
  --resolved-conf PATH  systemd-resolved's upstream servers, reported when the resolver
                        configuration names only its stub 127.0.0.53/54
                        (default /run/systemd/resolve/resolv.conf)
  --version             print the version and exit";

/// Command-line settings.
struct Options {
    exec: bool,
    port: Option<PathBuf>,
    name: String,
    paths: Paths,
}

/// Parses the command line; `Err` carries the text to print and the exit code.
fn parse_args(args: impl Iterator<Item = String>) -> Result<Options, (String, u8)> {
    let mut options = Options { exec: false, port: None, name: PORT_NAME.to_string(), paths: Paths::default() };
    let mut args = args;
    while let Some(arg) = args.next() {
        let mut value = |flag: &str| args.next().ok_or_else(|| (format!("{flag} needs a value\n{USAGE}"), 2));
        match arg.as_str() {
            "--exec" => options.exec = true,
            "--port" => options.port = Some(PathBuf::from(value("--port")?)),
            "--name" => options.name = value("--name")?,
            "--intent" => options.paths.intent = PathBuf::from(value("--intent")?),
            "--resolv-conf" => options.paths.resolv_conf = PathBuf::from(value("--resolv-conf")?),
            "--resolved-conf" => options.paths.resolved_conf = PathBuf::from(value("--resolved-conf")?),
            "--version" => return Err((format!("vmhost-agent {}", vmhost_agent::info::AGENT_VERSION), 0)),
            "--help" | "-h" => return Err((USAGE.to_string(), 0)),
            other => return Err((format!("unknown argument {other:?}\n{USAGE}"), 2)),
        }
    }
    Ok(options)
}

/// Logs `problem` unless it is the one logged last: a missing port is retried every second and
/// should not fill the console.
fn report(last: &mut String, problem: String) {
    if problem != *last {
        log(&problem);
        *last = problem;
    }
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(options) => options,
        Err((text, 0)) => {
            println!("{text}");
            return ExitCode::SUCCESS;
        }
        Err((text, code)) => {
            eprintln!("{text}");
            return ExitCode::from(code);
        }
    };
    if options.exec {
        if options.port.is_some() || options.name != PORT_NAME {
            eprintln!("--exec serves the exec ports by their names; --port and --name do not apply\n{USAGE}");
            return ExitCode::from(2);
        }
        serve_exec();
    }
    log(&format!("version {} starting, port {}", vmhost_agent::info::AGENT_VERSION, options.name));
    let mut last_problem = String::new();
    loop {
        let path = options
            .port
            .clone()
            .or_else(|| find_port(&options.name, Path::new("/dev"), Path::new("/sys/class/virtio-ports")));
        let Some(path) = path else {
            report(&mut last_problem, format!("port {} not found; waiting", options.name));
            std::thread::sleep(RETRY);
            continue;
        };
        match Port::open(&path) {
            Ok(port) => {
                log(&format!("serving on {}", path.display()));
                last_problem.clear();
                let error = Server::new(port, Agent::new(options.paths.clone())).run(|port| port.is_at(&path));
                report(&mut last_problem, format!("port {} failed: {error}; reopening", path.display()));
            }
            Err(e) => report(&mut last_problem, format!("cannot open {}: {e}", path.display())),
        }
        std::thread::sleep(RETRY);
    }
}

/// `--exec`: one thread per exec port, each finding, opening and serving its port for ever.
fn serve_exec() -> ! {
    log(&format!(
        "version {} starting, exec ports {} to {}",
        vmhost_agent::info::AGENT_VERSION,
        exec_port_name(0),
        exec_port_name(EXEC_SLOTS - 1)
    ));
    for slot in 0..EXEC_SLOTS {
        let spawned = std::thread::Builder::new().name(format!("exec.{slot}")).spawn(move || serve_exec_slot(slot));
        if let Err(e) = spawned {
            log(&format!("cannot start the thread of exec port {slot}: {e}"));
        }
    }
    loop {
        std::thread::park();
    }
}

/// Serves exec port `slot`: finds it, opens it, serves until it fails, and again.
fn serve_exec_slot(slot: usize) {
    let name = exec_port_name(slot);
    let mut last_problem = String::new();
    loop {
        let Some(path) = find_port(&name, Path::new("/dev"), Path::new("/sys/class/virtio-ports")) else {
            report(&mut last_problem, format!("port {name} not found; waiting"));
            std::thread::sleep(RETRY);
            continue;
        };
        match Port::open(&path) {
            Ok(port) => {
                log(&format!("exec.{slot}: serving on {}", path.display()));
                last_problem.clear();
                let error = ExecServer::new(port, System::default(), slot).run(|port| port.is_at(&path));
                report(&mut last_problem, format!("port {} failed: {error}; reopening", path.display()));
            }
            Err(e) => report(&mut last_problem, format!("cannot open {}: {e}", path.display())),
        }
        std::thread::sleep(RETRY);
    }
}
