//! Who may talk to the daemon: the peer-credential gate of the RPC socket.
//!
//! The socket file's mode only decides who can `connect()`; the real gate is the kernel's record
//! of the peer (`SO_PEERCRED`), checked once at accept before a single byte of the connection is
//! parsed. Used in this order:
//!
//! 1. at start-up, [`AccessPolicy::from_group_names`] resolves the configured admin and
//!    read-only group names to gids (a missing group disables that role, with a warning);
//! 2. at each accept, [`peer_identity`] turns the peer's credential into a [`PeerIdentity`] by
//!    doing every lookup (proc file, user and group databases);
//! 3. [`classify`], a pure function of policy and identity, says which [`Role`] the peer gets,
//!    or none (the connection is then refused with error 1001).
//!
//! Splitting lookups from the rule keeps the rule exhaustively unit-testable without real users.

use nix::unistd::{Gid, Group, Uid, User};
use tracing::warn;

/// The gids that grant access, resolved once at start-up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessPolicy {
    /// Members may call every method (root always may).
    pub admin_gid: Option<u32>,
    /// Members may call only the methods for which access is `Read` in [`crate::rpc::methods::METHODS`].
    pub readonly_gid: Option<u32>,
}

impl AccessPolicy {
    /// Resolves group names through the group database.
    ///
    /// A group that does not exist (or cannot be looked up) yields `None` for its role and a
    /// warning: the daemon still starts, and root keeps full access. An empty name means the
    /// role is deliberately disabled and is not warned about.
    pub fn from_group_names(admin: &str, readonly: &str) -> AccessPolicy {
        AccessPolicy { admin_gid: resolve_group(admin, "admin"), readonly_gid: resolve_group(readonly, "read-only") }
    }
}

/// Looks one group name up; `role` only words the warning.
fn resolve_group(name: &str, role: &str) -> Option<u32> {
    if name.is_empty() {
        return None;
    }
    match Group::from_name(name) {
        Ok(Some(group)) => Some(group.gid.as_raw()),
        Ok(None) => {
            warn!(group = name, "{role} group does not exist; that role is disabled");
            None
        }
        Err(e) => {
            warn!(group = name, error = %e, "cannot look up the {role} group; that role is disabled");
            None
        }
    }
}

/// What an accepted peer may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Every method.
    Admin,
    /// Only read methods (access `Read` in [`crate::rpc::methods::METHODS`]); mutating calls get error 1002.
    ReadOnly,
}

/// Everything [`classify`] needs to know about a peer, gathered by [`peer_identity`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerIdentity {
    /// Effective uid of the peer when it connected (from `SO_PEERCRED`).
    pub uid: u32,
    /// Effective (primary) gid of the peer when it connected (from `SO_PEERCRED`).
    pub gid: u32,
    /// Supplementary groups of the peer process, from `/proc/PID/status`; empty when unknown.
    pub supplementary: Vec<u32>,
    /// Policy groups whose member list in the group database names the peer uid's user.
    pub user_name_groups: Vec<u32>,
}

impl PeerIdentity {
    /// True when `gid` is the peer's primary group, one of its supplementary groups, or a group
    /// whose database entry lists the peer's user.
    fn is_member(&self, gid: u32) -> bool {
        self.gid == gid || self.supplementary.contains(&gid) || self.user_name_groups.contains(&gid)
    }
}

/// The access rule: root and admin-group members are [`Role::Admin`], read-only-group members
/// are [`Role::ReadOnly`], anyone else gets `None`. Membership of both groups means admin.
pub fn classify(policy: &AccessPolicy, peer: &PeerIdentity) -> Option<Role> {
    if peer.uid == 0 {
        return Some(Role::Admin);
    }
    if policy.admin_gid.is_some_and(|g| peer.is_member(g)) {
        return Some(Role::Admin);
    }
    if policy.readonly_gid.is_some_and(|g| peer.is_member(g)) {
        return Some(Role::ReadOnly);
    }
    None
}

/// Gathers a peer's identity from its socket credential.
///
/// Lookups that fail only shrink the identity (fewer groups), never widen it, so a failure can
/// cost a peer access but never grant it. Blocking: it reads `/proc` and may query NSS, so call
/// it from `spawn_blocking` in async code.
pub fn peer_identity(cred: &tokio::net::unix::UCred, policy: &AccessPolicy) -> PeerIdentity {
    lookup_identity(cred.uid(), cred.gid(), cred.pid(), policy)
}

/// [`peer_identity`] from the credential's parts, for callers that do not hold a tokio `UCred`.
///
/// The supplementary groups are read from `/proc/PID/status`, which is racy: the peer may have
/// exited and its pid been reused between `connect()` and this read. That is acceptable because
/// the check runs once, right at accept (a window of microseconds in which the pid space would
/// have to wrap), and because the file is only trusted when its effective uid equals the
/// credential's uid, so a reused pid can only lend groups of a process of the same user.
pub fn lookup_identity(uid: u32, gid: u32, pid: Option<i32>, policy: &AccessPolicy) -> PeerIdentity {
    let supplementary = pid
        .filter(|p| *p > 0)
        .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .map(|status| parse_proc_status(&status))
        .and_then(|s| {
            if s.effective_uid == Some(uid) {
                Some(s.groups)
            } else {
                // The process behind the pid is not the one that connected (pid reuse) or the
                // file is unreadable in a way we do not understand: trust only SO_PEERCRED.
                warn!(uid, pid, "peer process changed identity since connect; ignoring its groups");
                None
            }
        })
        .unwrap_or_default();
    PeerIdentity { uid, gid, supplementary, user_name_groups: listed_groups(uid, policy) }
}

/// Policy groups whose database member list contains the user name of `uid`.
///
/// Only the (at most two) policy groups are looked up, not every group of the system.
fn listed_groups(uid: u32, policy: &AccessPolicy) -> Vec<u32> {
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return Vec::new();
    };
    [policy.admin_gid, policy.readonly_gid]
        .into_iter()
        .flatten()
        .filter(|gid| {
            matches!(Group::from_gid(Gid::from_raw(*gid)),
                Ok(Some(group)) if group.mem.contains(&user.name))
        })
        .collect()
}

/// The parts of `/proc/PID/status` the identity uses.
#[derive(Debug, Default, PartialEq, Eq)]
struct ProcStatus {
    /// Second field of `Uid:` (real, effective, saved, filesystem).
    effective_uid: Option<u32>,
    /// The `Groups:` line.
    groups: Vec<u32>,
}

/// Parses the `Uid:` and `Groups:` lines; unparsable numbers are skipped.
fn parse_proc_status(text: &str) -> ProcStatus {
    let mut status = ProcStatus::default();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Uid:") {
            status.effective_uid = rest.split_whitespace().nth(1).and_then(|n| n.parse().ok());
        } else if let Some(rest) = line.strip_prefix("Groups:") {
            status.groups = rest.split_whitespace().filter_map(|n| n.parse().ok()).collect();
        }
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADMIN: u32 = 900;
    const READONLY: u32 = 901;
    const OTHER: u32 = 1234;

    fn policy() -> AccessPolicy {
        AccessPolicy { admin_gid: Some(ADMIN), readonly_gid: Some(READONLY) }
    }

    fn peer(uid: u32, gid: u32, supplementary: &[u32], listed: &[u32]) -> PeerIdentity {
        PeerIdentity { uid, gid, supplementary: supplementary.to_vec(), user_name_groups: listed.to_vec() }
    }

    #[test]
    fn root_is_admin_whatever_the_groups() {
        assert_eq!(classify(&policy(), &peer(0, 0, &[], &[])), Some(Role::Admin));
        assert_eq!(classify(&policy(), &peer(0, OTHER, &[READONLY], &[])), Some(Role::Admin));
        assert_eq!(classify(&AccessPolicy::default(), &peer(0, 0, &[], &[])), Some(Role::Admin));
    }

    #[test]
    fn admin_by_primary_supplementary_or_listed_group() {
        assert_eq!(classify(&policy(), &peer(1000, ADMIN, &[], &[])), Some(Role::Admin));
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[5, ADMIN], &[])), Some(Role::Admin));
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[], &[ADMIN])), Some(Role::Admin));
    }

    #[test]
    fn readonly_by_primary_supplementary_or_listed_group() {
        assert_eq!(classify(&policy(), &peer(1000, READONLY, &[], &[])), Some(Role::ReadOnly));
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[READONLY], &[])), Some(Role::ReadOnly));
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[], &[READONLY])), Some(Role::ReadOnly));
    }

    #[test]
    fn both_groups_means_admin() {
        assert_eq!(classify(&policy(), &peer(1000, READONLY, &[ADMIN], &[])), Some(Role::Admin));
        assert_eq!(classify(&policy(), &peer(1000, ADMIN, &[READONLY], &[])), Some(Role::Admin));
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[READONLY], &[ADMIN])), Some(Role::Admin));
    }

    #[test]
    fn neither_group_is_refused() {
        assert_eq!(classify(&policy(), &peer(1000, OTHER, &[1, 2, 3], &[])), None);
        assert_eq!(classify(&policy(), &peer(65534, 65534, &[], &[])), None);
    }

    #[test]
    fn missing_groups_leave_only_root() {
        let none = AccessPolicy::default();
        // A peer whose gid happens to equal what a group would have had gains nothing.
        assert_eq!(classify(&none, &peer(1000, ADMIN, &[READONLY], &[ADMIN])), None);
        assert_eq!(classify(&none, &peer(0, 0, &[], &[])), Some(Role::Admin));
        let readonly_only = AccessPolicy { admin_gid: None, readonly_gid: Some(READONLY) };
        assert_eq!(classify(&readonly_only, &peer(1000, ADMIN, &[], &[])), None);
        assert_eq!(classify(&readonly_only, &peer(1000, READONLY, &[], &[])), Some(Role::ReadOnly));
        let admin_only = AccessPolicy { admin_gid: Some(ADMIN), readonly_gid: None };
        assert_eq!(classify(&admin_only, &peer(1000, READONLY, &[], &[])), None);
        assert_eq!(classify(&admin_only, &peer(1000, ADMIN, &[], &[])), Some(Role::Admin));
    }

    #[test]
    fn from_group_names_resolves_existing_and_drops_missing() {
        let p = AccessPolicy::from_group_names("root", "no-such-group-vmhost-test");
        assert_eq!(p, AccessPolicy { admin_gid: Some(0), readonly_gid: None });
        assert_eq!(AccessPolicy::from_group_names("", ""), AccessPolicy::default());
    }

    #[test]
    fn parses_proc_status() {
        let text = "Name:\tbash\nUid:\t1000\t1001\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\n\
                    Groups:\t4 24 27 1000 \n";
        let s = parse_proc_status(text);
        assert_eq!(s.effective_uid, Some(1001));
        assert_eq!(s.groups, vec![4, 24, 27, 1000]);
        assert_eq!(parse_proc_status("Groups:\t\n").groups, Vec::<u32>::new());
        assert_eq!(parse_proc_status(""), ProcStatus::default());
    }

    #[test]
    fn finds_groups_listing_the_user_by_name() {
        // Needs a group with a member list; take the first one /etc/group has, if any.
        let groups = std::fs::read_to_string("/etc/group").unwrap_or_default();
        let found = groups.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let member = fields.get(3)?.split(',').find(|m| !m.is_empty())?;
            let user = User::from_name(member).ok()??;
            Some((fields.get(2)?.parse::<u32>().ok()?, user.uid.as_raw()))
        });
        let Some((gid, uid)) = found else {
            eprintln!("no group with a member list in /etc/group; skipping");
            return;
        };
        let policy = AccessPolicy { admin_gid: None, readonly_gid: Some(gid) };
        assert_eq!(listed_groups(uid, &policy), vec![gid]);
        let unrelated = AccessPolicy { admin_gid: Some(gid), readonly_gid: None };
        assert!(listed_groups(uid.wrapping_add(777_777), &unrelated).is_empty());
    }

    #[test]
    fn looks_up_own_process() {
        let me = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        let pid = i32::try_from(std::process::id()).ok();
        let id = lookup_identity(me, gid, pid, &AccessPolicy::default());
        let expected: Vec<u32> =
            nix::unistd::getgroups().map(|g| g.into_iter().map(Gid::as_raw).collect()).unwrap_or_default();
        assert_eq!(id.supplementary, expected);
        // A credential whose uid does not match the process must not borrow its groups.
        let stranger = lookup_identity(me.wrapping_add(4242), gid, pid, &AccessPolicy::default());
        assert!(stranger.supplementary.is_empty());
    }
}
