//! Socket activation and readiness notification of the real daemon: vmhostd serves a listening
//! socket passed as descriptor 3 (`LISTEN_FDS`/`LISTEN_PID`, as systemd's `vmhostd.socket` does),
//! leaves it in place for the next start, sends `READY=1`/`STOPPING=1` to `NOTIFY_SOCKET`, and
//! refuses descriptors it cannot serve.

use serde_json::{json, Value};
use std::fs;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use vmhost::client::Client;
use vmhost_tests::bin;

/// A temp dir with a config whose `paths.socket` is `DIR/vmhostd.sock`.
struct Setup {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::Builder::new().prefix("vmha").tempdir_in("/tmp").expect("tempdir");
        let d = dir.path();
        let config = d.join("vmhostd.toml");
        let text = format!(
            "[paths]\nstate = \"{0}/state\"\nrun = \"{0}/run\"\nimages = \"{0}/images\"\nsocket = \"{0}/vmhostd.sock\"\n\
             [qemu]\naccel = \"tcg\"\nuser = \"{1}\"\n[hardware]\ncpu = 2\nmemory_gib = 2\n",
            d.display(),
            vmhost_tests::QEMU_USER
        );
        fs::write(&config, text).expect("write config");
        Setup { dir, config }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `paths.socket` of the config.
    fn config_socket(&self) -> PathBuf {
        self.path("vmhostd.sock")
    }

    /// Starts vmhostd with `fd3` as descriptor 3, `LISTEN_FDS=fds` and `LISTEN_PID` set to the
    /// daemon's own pid (`pid: None`) or to `pid`. `sh` sets LISTEN_PID to `$$` and `exec`s, so
    /// the daemon has the shell's pid, as under systemd.
    fn spawn(&self, fd3: RawFd, fds: &str, pid: Option<u32>, env: &[(&str, &Path)]) -> Child {
        let log = fs::OpenOptions::new().create(true).append(true).open(self.path("vmhostd.log")).expect("log");
        let err = log.try_clone().expect("dup log");
        let listen_pid = pid.map_or_else(|| "$$".to_string(), |p| p.to_string());
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!("LISTEN_PID={listen_pid} LISTEN_FDS={fds} exec \"$0\" \"$@\""))
            .arg(bin("vmhostd"))
            .arg("--config")
            .arg(&self.config)
            .env("VMHOST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        for (k, v) in env {
            cmd.env(k, v);
        }
        // SAFETY: dup2 and fcntl are async-signal-safe; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if fd3 == 3 {
                    // std opened it close-on-exec; keep it across exec.
                    if libc::fcntl(3, libc::F_SETFD, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd3, 3) != 3 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().expect("spawn vmhostd")
    }

    fn log(&self) -> String {
        fs::read_to_string(self.path("vmhostd.log")).unwrap_or_default()
    }
}

/// Calls host.info on `socket`, retrying until the daemon answers.
fn wait_info(socket: &Path, daemon: &mut Child, setup: &Setup) -> Value {
    vmhost_tests::wait::daemon_answers(socket, daemon, || setup.log())
}

fn sigterm(child: &mut Child) -> std::process::ExitStatus {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    child.wait().expect("wait vmhostd")
}

/// Waits for the daemon to exit by itself and returns its status.
fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    vmhost_tests::wait::exited(child, "vmhostd", timeout)
}

fn recv(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = sock.recv(&mut buf).expect("notification");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn ctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(bin("vmhostctl")).arg("--socket").arg(socket).args(args).output().expect("run vmhostctl")
}

#[test]
fn serves_the_inherited_socket_and_leaves_it_for_the_next_start() {
    let setup = Setup::new();
    // Not paths.socket: the daemon must serve what it was given, not bind the configured path.
    let socket = setup.path("activated.sock");
    let listener = UnixListener::bind(&socket).expect("bind");
    let notify_path = setup.path("notify");
    let notify = UnixDatagram::bind(&notify_path).expect("bind notify socket");
    notify.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");

    let mut daemon = setup.spawn(listener.as_raw_fd(), "1", None, &[("NOTIFY_SOCKET", &notify_path)]);
    assert_eq!(recv(&notify), "READY=1", "log:\n{}", setup.log());
    // READY=1 comes once the socket serves: the first call needs no retry.
    let mut client = Client::connect(&socket).expect("connect");
    let info: Value = client.call("host.info", json!({})).expect("host.info");
    assert_eq!(info["cpu"]["total"], 2, "{info}");
    let out = ctl(&socket, &["info"]);
    assert!(out.status.success(), "vmhostctl info: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!setup.config_socket().exists(), "paths.socket must not be bound when activated");
    assert!(setup.log().contains("socket activation"), "log:\n{}", setup.log());

    // The inherited descriptor is close-on-exec in the daemon, so QEMU does not get it.
    let fdinfo = fs::read_to_string(format!("/proc/{}/fdinfo/3", daemon.id())).expect("fdinfo 3");
    let flags = fdinfo.lines().find_map(|l| l.strip_prefix("flags:")).expect("flags line").trim();
    let flags = u32::from_str_radix(flags, 8).expect("octal flags");
    assert_ne!(flags & 0o2_000_000, 0, "fd 3 must be O_CLOEXEC: {fdinfo}");
    // The spawner (the daemon's child) holds nothing but stdio and its control socket: not the
    // listening socket, which must not outlive the daemon in another process.
    let spawner = vmhost_tests::children_of(daemon.id() as i32).into_iter().next().expect("the spawner process");
    let mut fds: Vec<(i32, String)> = fs::read_dir(format!("/proc/{spawner}/fd"))
        .expect("spawner fds")
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse().ok()?;
            Some((n, fs::read_link(e.path()).ok()?.to_string_lossy().into_owned()))
        })
        .collect();
    fds.sort();
    let listening = fs::read_link(format!("/proc/{}/fd/3", daemon.id())).expect("daemon fd 3");
    assert!(fds.iter().all(|(_, t)| *t != listening.to_string_lossy()), "spawner holds the activated socket: {fds:?}");
    // Its control socket, and the Landlock ruleset every child but curl restricts itself to
    // (no TCP: docs/sandbox.md) where the kernel has Landlock's network rights.
    let extra: Vec<&str> = fds.iter().filter(|(n, _)| *n > 2).map(|(_, t)| t.as_str()).collect();
    let sockets = extra.iter().filter(|t| t.starts_with("socket:")).count();
    let rulesets = extra.iter().filter(|t| **t == "anon_inode:[landlock-ruleset]").count();
    assert_eq!((sockets, rulesets <= 1, extra.len()), (1, true, sockets + rulesets), "spawner fds: {fds:?}");

    drop(client);
    assert!(sigterm(&mut daemon).success(), "log:\n{}", setup.log());
    assert_eq!(recv(&notify), "STOPPING=1");
    assert!(socket.exists(), "the activated socket belongs to the service manager and must stay");

    // While no daemon runs, a client's request waits in the socket's backlog and is answered by
    // the next daemon started on the same socket: what makes restarts invisible to clients.
    let mut early = UnixStream::connect(&socket).expect("connect while the daemon is down");
    std::io::Write::write_all(&mut early, b"{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"host.info\"}\n").expect("write");
    early.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut daemon = setup.spawn(listener.as_raw_fd(), "1", None, &[]);
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&early), &mut line).expect("answer");
    let answer: Value = serde_json::from_str(&line).expect("JSON answer");
    assert_eq!(answer["id"], 7, "{answer}");
    assert!(answer["result"]["cpu"].is_object(), "{answer}");
    assert!(sigterm(&mut daemon).success());
}

#[test]
fn descriptors_for_another_process_are_ignored() {
    let setup = Setup::new();
    let listener = UnixListener::bind(setup.path("other.sock")).expect("bind");
    // LISTEN_PID names another process (these variables leaked from an activated parent): the
    // daemon binds paths.socket as usual.
    let mut daemon = setup.spawn(listener.as_raw_fd(), "1", Some(1), &[]);
    let info = wait_info(&setup.config_socket(), &mut daemon, &setup);
    assert!(info["cpu"].is_object(), "{info}");
    assert!(sigterm(&mut daemon).success());
    assert!(!setup.config_socket().exists(), "a socket the daemon bound itself is removed at exit");
}

#[test]
fn refuses_what_it_cannot_serve() {
    let setup = Setup::new();
    // A connected socket (what Accept=yes would pass).
    let (a, _b) = UnixStream::pair().expect("pair");
    let mut daemon = setup.spawn(a.as_raw_fd(), "1", None, &[]);
    assert_eq!(wait_exit(&mut daemon, Duration::from_secs(30)).code(), Some(1));
    assert!(setup.log().contains("socket activation: descriptor 3 is not listening"), "log:\n{}", setup.log());

    let dgram = UnixDatagram::unbound().expect("dgram");
    let mut daemon = setup.spawn(dgram.as_raw_fd(), "1", None, &[]);
    assert_eq!(wait_exit(&mut daemon, Duration::from_secs(30)).code(), Some(1));
    assert!(setup.log().contains("is not a stream socket"), "log:\n{}", setup.log());

    let listener = UnixListener::bind(setup.path("two.sock")).expect("bind");
    let mut daemon = setup.spawn(listener.as_raw_fd(), "2", None, &[]);
    assert_eq!(wait_exit(&mut daemon, Duration::from_secs(30)).code(), Some(1));
    assert!(setup.log().contains("2 sockets passed"), "log:\n{}", setup.log());

    let mut daemon = setup.spawn(listener.as_raw_fd(), "one", None, &[]);
    assert_eq!(wait_exit(&mut daemon, Duration::from_secs(30)).code(), Some(1));
    assert!(setup.log().contains("LISTEN_FDS=\"one\" is not a number"), "log:\n{}", setup.log());
    assert!(!setup.config_socket().exists(), "nothing may be bound after a refusal");
}

#[test]
fn systemd_socket_activate_starts_the_daemon_on_the_first_connection() {
    // systemd's own implementation of the protocol, as an independent check of ours.
    let tool = Path::new("/usr/bin/systemd-socket-activate");
    assert!(tool.exists(), "{} missing: apt-get install systemd", tool.display());
    let setup = Setup::new();
    let socket = setup.path("sd.sock");
    let log = fs::File::create(setup.path("vmhostd.log")).expect("log");
    let err = log.try_clone().expect("dup");
    let mut activator = Command::new(tool)
        .arg("-l")
        .arg(&socket)
        .arg(bin("vmhostd"))
        .arg("--config")
        .arg(&setup.config)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .expect("spawn systemd-socket-activate");
    // systemd-socket-activate execs vmhostd in place once a connection arrives.
    let info = wait_info(&socket, &mut activator, &setup);
    assert!(info["cpu"].is_object(), "{info}");
    let exe = fs::read_link(format!("/proc/{}/exe", activator.id())).expect("exe");
    assert!(exe.ends_with("vmhostd"), "{}", exe.display());
    assert!(!setup.config_socket().exists());
    assert!(sigterm(&mut activator).success(), "log:\n{}", setup.log());
}
