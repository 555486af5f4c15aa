//! What `host.check` says about the sandbox: one item per layer, read from the live process
//! where the kernel shows it (/proc/self/status for capabilities, no_new_privs and seccomp).
//!
//! Items, in this order: `sandbox` (mode, no_new_privs, environment), `capabilities` (daemon and
//! spawner sets), `landlock` (kernel ABI, enforcement, rules), `seccomp` (mode, table size).
//! With `best-effort` a layer that is not in force is `missing`; with `off` every item is `ok`
//! and says the sandbox is off.

use super::caps::CapSets;
use super::State;
use crate::api::{CheckItem, CheckStatus};
use crate::config::{Config, SandboxMode};

fn item(name: &str, status: CheckStatus, detail: impl Into<String>) -> CheckItem {
    CheckItem { name: name.to_string(), status, detail: detail.into() }
}

/// The sandbox items for `config` and what [`super::enter`] recorded.
pub fn items(config: &Config, st: &State) -> Vec<CheckItem> {
    let mode = config.sandbox;
    if mode == SandboxMode::Off || st.mode.is_none() {
        let off = "sandbox = \"off\": not in force";
        return ["sandbox", "capabilities", "landlock", "seccomp"]
            .iter()
            .map(|n| item(n, CheckStatus::Ok, off))
            .collect();
    }
    let nnp = super::env::no_new_privs();
    let sandbox = item(
        "sandbox",
        if nnp { CheckStatus::Ok } else { CheckStatus::Missing },
        format!(
            "mode {}; no_new_privs {}; {} environment variables removed, {} descriptors closed at start; spawner pid {}",
            mode.as_str(),
            if nnp { "set" } else { "NOT set" },
            st.env_removed,
            st.fds_closed,
            st.spawner_pid.map_or("none".to_string(), |p| p.to_string()),
        ),
    );
    let own = CapSets::of_self();
    let spawner = st.spawner_pid.map(CapSets::of_pid);
    let caps_ok = matches!(st.caps, Some(Ok(())));
    let caps = item(
        "capabilities",
        if caps_ok { CheckStatus::Ok } else { CheckStatus::Missing },
        format!(
            "daemon: {}; spawner: {}{}",
            own.describe(),
            spawner.map_or("none".to_string(), |c| c.describe()),
            match &st.caps {
                Some(Err(e)) => format!("; not dropped: {e}"),
                _ => String::new(),
            }
        ),
    );
    let spawner_ll = st.spawner.as_ref().map_or("none".to_string(), |s| s.landlock.clone());
    let landlock = match &st.landlock {
        Some(Ok(o)) => item(
            "landlock",
            CheckStatus::Ok,
            format!(
                "daemon: {} with ABI {} rights (kernel ABI {}), {} rules{}; spawner: {}",
                o.status,
                super::landlock::TARGET_ABI,
                o.kernel_abi,
                o.rules,
                if o.skipped.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", absent paths skipped: {}",
                        o.skipped.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" ")
                    )
                },
                spawner_ll
            ),
        ),
        Some(Err(e)) => item("landlock", CheckStatus::Missing, format!("not in force: {e}; spawner: {spawner_ll}")),
        None => item("landlock", CheckStatus::Missing, "not in force"),
    };
    let filter_on = super::seccomp::status_of_self() == 2;
    let seccomp = match &st.seccomp {
        Some(Ok(n)) if filter_on => item(
            "seccomp",
            CheckStatus::Ok,
            format!(
                "{}: {n} syscalls allowed (daemon/src/sandbox/seccomp.rs), others {}; the spawner and QEMU have no filter",
                config.seccomp.as_str(),
                match config.seccomp {
                    crate::config::SeccompMode::Enforce => "fail with EPERM",
                    crate::config::SeccompMode::Log => "allowed and logged by the kernel",
                }
            ),
        ),
        Some(Err(e)) => item("seccomp", CheckStatus::Missing, format!("not in force: {e}")),
        _ => item("seccomp", CheckStatus::Missing, "not in force"),
    };
    vec![sandbox, caps, landlock, seccomp]
}
