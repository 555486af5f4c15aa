//! What `host.check` says about the sandbox: one item per layer, read from the live process
//! where the kernel shows it (/proc/self/status for capabilities, no_new_privs and seccomp).
//!
//! Items, in this order: `sandbox` (mode, no_new_privs, environment), `capabilities` (daemon and
//! spawner sets), `landlock` (kernel ABI, enforcement, rules), `seccomp` (mode, table size),
//! `qemu_user` (who QEMU runs as and whether its own `-sandbox` filter is on; `missing` when
//! it runs as root), which applies whatever the sandbox mode.
//! With `best-effort` a layer that is not in force is `missing`; with `off` every item is `ok`
//! and says the sandbox is off. `landlock` is `ok` only when both the daemon's and the spawner's
//! rulesets are in force.

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
        let mut v: Vec<CheckItem> =
            ["sandbox", "capabilities", "landlock", "seccomp"].iter().map(|n| item(n, CheckStatus::Ok, off)).collect();
        v.push(qemu_user(config));
        return v;
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
    let spawner_enforced = st.spawner.as_ref().is_some_and(|s| s.landlock_enforced);
    let landlock = match &st.landlock {
        Some(Ok(o)) => item(
            "landlock",
            if spawner_enforced { CheckStatus::Ok } else { CheckStatus::Missing },
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
                "{}: {n} syscalls allowed (daemon/src/sandbox/seccomp.rs), others {}; the spawner has no filter, QEMU its own (qemu_user)",
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
    vec![sandbox, caps, landlock, seccomp, qemu_user(config)]
}

/// Who QEMU runs as (`qemu.user`) and whether its own seccomp filter is on.
fn qemu_user(config: &Config) -> CheckItem {
    let filter = if config.qemu.sandbox {
        "-sandbox on (obsolete, elevateprivileges, spawn, resourcecontrol denied)"
    } else {
        "-sandbox off (qemu.sandbox = false)"
    };
    match config.qemu_user {
        Some(u) if u.uid != 0 => item(
            "qemu_user",
            CheckStatus::Ok,
            format!(
                "QEMU runs as {} (uid {}, gid {}, no other groups, no capabilities); {filter}",
                config.qemu.user, u.uid, u.gid
            ),
        ),
        Some(_) => item(
            "qemu_user",
            CheckStatus::Missing,
            format!("QEMU runs as root (qemu.user = {:?}); {filter}", config.qemu.user),
        ),
        None => item(
            "qemu_user",
            CheckStatus::Missing,
            format!("QEMU runs as the daemon's user (no config file loaded); {filter}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::landlock::Outcome;
    use crate::sandbox::SpawnerReport;
    use crate::validate::tests::config;

    fn status(items: &[CheckItem], name: &str) -> CheckStatus {
        items.iter().find(|i| i.name == name).map(|i| i.status).unwrap_or(CheckStatus::Error)
    }

    #[test]
    fn off_is_four_ok_items_and_the_qemu_user() {
        let mut c = config();
        c.sandbox = SandboxMode::Off;
        c.qemu_user = Some(crate::config::UserIds { uid: 103, gid: 109 });
        let items = items(&c, &State::default());
        let names: Vec<&str> = items.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["sandbox", "capabilities", "landlock", "seccomp", "qemu_user"]);
        assert!(items[..4].iter().all(|i| i.status == CheckStatus::Ok && i.detail.contains("\"off\"")));
        assert_eq!(items[4].status, CheckStatus::Ok);
        assert!(items[4].detail.contains("vmhost-qemu (uid 103, gid 109") && items[4].detail.contains("-sandbox on"));
    }

    #[test]
    fn qemu_as_root_is_missing() {
        let mut c = config();
        c.qemu.user = "root".into();
        c.qemu.sandbox = false;
        c.qemu_user = Some(crate::config::UserIds { uid: 0, gid: 0 });
        let item = qemu_user(&c);
        assert_eq!(item.status, CheckStatus::Missing);
        assert!(item.detail.contains("as root") && item.detail.contains("-sandbox off"), "{}", item.detail);
        c.qemu_user = None;
        assert_eq!(qemu_user(&c).status, CheckStatus::Missing);
    }

    #[test]
    fn layers_not_in_force_are_missing() {
        let mut c = config();
        c.sandbox = SandboxMode::BestEffort;
        let enforced = Outcome { kernel_abi: 7, status: "fully enforced", rules: 3, skipped: vec![] };
        let spawner =
            SpawnerReport { caps_error: String::new(), landlock: "fully enforced".into(), landlock_enforced: true };
        let mut st = State {
            mode: Some(SandboxMode::BestEffort),
            caps: Some(Err("no CAP_SETPCAP".into())),
            landlock: Some(Err("the kernel has no Landlock (ABI 0)".into())),
            seccomp: Some(Err("refused".into())),
            spawner: Some(spawner.clone()),
            ..State::default()
        };
        let i = items(&c, &st);
        assert_eq!(status(&i, "capabilities"), CheckStatus::Missing);
        assert_eq!(status(&i, "landlock"), CheckStatus::Missing);
        assert_eq!(status(&i, "seccomp"), CheckStatus::Missing);
        // The daemon's ruleset alone is not enough: the spawner's must be in force too.
        st.landlock = Some(Ok(enforced));
        assert_eq!(status(&items(&c, &st), "landlock"), CheckStatus::Ok);
        st.spawner = Some(SpawnerReport { landlock_enforced: false, ..spawner });
        assert_eq!(status(&items(&c, &st), "landlock"), CheckStatus::Missing);
        // This test process has no seccomp filter: a recorded success is not believed.
        st.seccomp = Some(Ok(125));
        assert_eq!(status(&items(&c, &st), "seccomp"), CheckStatus::Missing);
    }
}
