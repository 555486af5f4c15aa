//! What the tests that run a real salt-master and salt-minions share (tests/tests/salt_master.rs,
//! tests/tests/salt_fleet.rs): the Salt venv tests/setup.sh makes, free TCP ports for the
//! master, and [`Group`], which starts a Salt process in its own process group and ends the
//! whole group when dropped.

use crate::{wait, workspace};
use std::fs;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a dropped [`Group`]'s leader gets to end its workers after SIGTERM.
pub const GRACE: Duration = Duration::from_secs(3);

/// A program of the Salt venv (`target/salt-venv/bin/BIN`).
///
/// # Panics
/// When tests/setup.sh has not made the venv.
pub fn venv(bin: &str) -> PathBuf {
    let p = workspace().join("target/salt-venv/bin").join(bin);
    assert!(p.exists(), "{} missing: run tests/setup.sh first", p.display());
    p
}

/// A TCP port on 127.0.0.1 free a moment ago (for the master's publish and return ports).
///
/// # Panics
/// When nothing can be bound.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A process started in its own process group; dropping it ends the whole group (salt's
/// masters and minions fork worker processes): SIGTERM, up to 3 s, then SIGKILL.
pub struct Group {
    name: &'static str,
    /// The group's leader (its pid is the group's id).
    pub child: Child,
}

impl Group {
    /// Starts `cmd` with stdout and stderr into `log`.
    ///
    /// # Panics
    /// When the log cannot be made or the program not started.
    pub fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> Group {
        let out = fs::File::create(log).expect("create log");
        let err = out.try_clone().expect("dup log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Group { name, child }
    }

    /// # Panics
    /// When the process has exited (with its log in the message).
    pub fn assert_running(&mut self, log: &Path) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited with {status}:\n{}", self.name, fs::read_to_string(log).unwrap_or_default());
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        let pgid = nix::unistd::Pid::from_raw(-(self.child.id() as i32));
        let _ = nix::sys::signal::kill(pgid, nix::sys::signal::Signal::SIGTERM);
        // Give the group leader 3 s to shut down its workers, then SIGKILL whatever of the
        // group is left. A salt-minion's graceful shutdown takes 6-8 s here and can hang for
        // good when its process manager restarts an engine that the same SIGTERM ended.
        // (A grace period, not a wait for a fact: SIGKILL follows either way.)
        let _ = wait::poll(GRACE, || match self.child.try_wait() {
            Ok(None) => Err(String::new()),
            Ok(Some(_)) | Err(_) => Ok(()),
        });
        let _ = nix::sys::signal::kill(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
