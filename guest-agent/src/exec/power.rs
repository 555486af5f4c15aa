//! `guest.shutdown`: powers the guest off after the reply has gone out, for guests that ignore
//! ACPI (`vm.stop {method: "agent"}`).
//!
//! Order of use: [`plan`] chooses how (systemd when it runs the guest, else the kernel directly)
//! and the reply names it; once the reply is written, the session calls [`power_off`] (tests
//! pass another function so that they never power the machine off).

use std::path::Path;
use std::process::Command;

/// How the guest is powered off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// `systemctl poweroff`: an orderly shutdown of every service.
    Systemd,
    /// `sync()` then `reboot(RB_POWER_OFF)`: no init system that could shut down in order.
    Kernel,
}

impl How {
    /// The reply's `how`.
    pub fn describe(self) -> &'static str {
        match self {
            How::Systemd => "systemctl poweroff",
            How::Kernel => "reboot(2)",
        }
    }
}

/// systemd runs the guest when `run_systemd` (`/run/systemd/system`) exists.
pub fn plan(run_systemd: &Path) -> How {
    if run_systemd.is_dir() {
        How::Systemd
    } else {
        How::Kernel
    }
}

/// Powers the guest off `how`; returns only when that failed.
pub fn power_off(how: How) {
    match how {
        How::Systemd => match Command::new("systemctl")
            .arg("poweroff")
            .env_clear()
            .env("PATH", super::command::BASE_ENV[0].1)
            .status()
        {
            Ok(status) if status.success() => {}
            other => {
                crate::log(&format!("systemctl poweroff failed ({other:?}); powering off directly"));
                power_off(How::Kernel);
            }
        },
        How::Kernel => {
            // SAFETY: sync(2) and reboot(2) take no pointers.
            unsafe {
                libc::sync();
                libc::reboot(libc::RB_POWER_OFF);
            }
            crate::log(&format!("reboot(RB_POWER_OFF) failed: {}", std::io::Error::last_os_error()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemd_is_used_only_when_it_runs_the_guest() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = dir.path().join("systemd/system");
        assert_eq!(plan(&run), How::Kernel);
        std::fs::create_dir_all(&run).expect("mkdir");
        assert_eq!(plan(&run), How::Systemd);
        assert_eq!(How::Systemd.describe(), "systemctl poweroff");
        assert_eq!(How::Kernel.describe(), "reboot(2)");
    }
}
