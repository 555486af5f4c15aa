//! Users and groups, read from `/etc/passwd` and `/etc/group` directly.
//!
//! The agent is a static binary: glibc's NSS (`getpwnam`) would need shared modules it cannot
//! load, so it parses the files itself. Accounts that exist only in a directory service (LDAP,
//! sssd) are therefore not found by name; numbers always work. Order of use: [`read_users`] /
//! [`read_groups`], then [`resolve_owner`] for `file.push`'s `owner`, [`find_user`] for
//! `ssh.authorize`.

use std::path::Path;

use crate::protocol::RpcError;

/// One `/etc/passwd` entry (the fields the agent uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory.
    pub home: String,
}

/// One `/etc/group` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Group name.
    pub name: String,
    /// Group id.
    pub gid: u32,
}

/// The users of a passwd file's text; malformed lines (and NIS `+`/`-` lines) are skipped.
pub fn parse_users(text: &str) -> Vec<User> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 7 || f[0].is_empty() || f[0].starts_with(['+', '-', '#']) {
                return None;
            }
            Some(User {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect()
}

/// The groups of a group file's text; malformed lines are skipped.
pub fn parse_groups(text: &str) -> Vec<Group> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 3 || f[0].is_empty() || f[0].starts_with(['+', '-', '#']) {
                return None;
            }
            Some(Group { name: f[0].to_string(), gid: f[2].parse().ok()? })
        })
        .collect()
}

/// The users of `etc/passwd` (none when it cannot be read: an initramfs may have none).
pub fn read_users(etc: &Path) -> Vec<User> {
    std::fs::read_to_string(etc.join("passwd")).map(|t| parse_users(&t)).unwrap_or_default()
}

/// The groups of `etc/group`.
pub fn read_groups(etc: &Path) -> Vec<Group> {
    std::fs::read_to_string(etc.join("group")).map(|t| parse_groups(&t)).unwrap_or_default()
}

/// The user called `name`.
pub fn find_user<'a>(users: &'a [User], name: &str) -> Option<&'a User> {
    users.iter().find(|u| u.name == name)
}

/// A number, or the id of the named entry.
fn id_of(text: &str, by_name: impl Fn(&str) -> Option<u32>) -> Option<u32> {
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().ok();
    }
    by_name(text)
}

/// Resolves `file.push`'s `owner`: `user` or `user:group`, each a name or a number. Without a
/// group: the user's primary group when the user is in passwd, else 0 (a new file's group is
/// root's, as `chown USER` would leave it).
///
/// # Errors
/// 5100 (`owner`) for an unknown name or an empty part.
pub fn resolve_owner(owner: &str, users: &[User], groups: &[Group]) -> Result<(u32, u32), RpcError> {
    let (user, group) = match owner.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (owner, None),
    };
    let uid = id_of(user, |n| find_user(users, n).map(|u| u.uid))
        .ok_or_else(|| RpcError::invalid("owner", format!("no user {user:?} in /etc/passwd")))?;
    let gid = match group {
        Some(g) => id_of(g, |n| groups.iter().find(|x| x.name == n).map(|x| x.gid))
            .ok_or_else(|| RpcError::invalid("owner", format!("no group {g:?} in /etc/group")))?,
        None => users.iter().find(|u| u.uid == uid).map_or(0, |u| u.gid),
    };
    Ok((uid, gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # comment\n\
        +nis::::::\n\
        broken:x:notanumber:1:::\n\
        short:x:1\n\
        alice:x:1000:1000:Alice,,,:/home/alice:/bin/sh\n\
        bob:x:1001:100::/home/bob:/usr/sbin/nologin";
    const GROUP: &str = "root:x:0:\nusers:x:100:alice,bob\nalice:x:1000:\nbad:x:y:\n";

    #[test]
    fn passwd_and_group_are_parsed_and_junk_is_skipped() {
        let users = parse_users(PASSWD);
        assert_eq!(users.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["root", "alice", "bob"]);
        assert_eq!(users[1], User { name: "alice".into(), uid: 1000, gid: 1000, home: "/home/alice".into() });
        let groups = parse_groups(GROUP);
        assert_eq!(
            groups.iter().map(|g| (g.name.as_str(), g.gid)).collect::<Vec<_>>(),
            [("root", 0), ("users", 100), ("alice", 1000)]
        );
    }

    #[test]
    fn owners_resolve_by_name_or_number() {
        let (users, groups) = (parse_users(PASSWD), parse_groups(GROUP));
        let r = |o: &str| resolve_owner(o, &users, &groups).map_err(|e| e.message);
        assert_eq!(r("alice"), Ok((1000, 1000)));
        assert_eq!(r("bob"), Ok((1001, 100)));
        assert_eq!(r("bob:alice"), Ok((1001, 1000)));
        assert_eq!(r("1001:0"), Ok((1001, 0)));
        assert_eq!(r("4242"), Ok((4242, 0)));
        assert_eq!(r("1000"), Ok((1000, 1000)));
        assert_eq!(r("alice:7"), Ok((1000, 7)));
        assert!(r("mallory").is_err_and(|m| m.contains("mallory")));
        assert!(r("alice:nogroup").is_err());
        assert!(r("").is_err());
        assert!(r("alice:").is_err());
        assert!(r(":users").is_err());
    }
}
