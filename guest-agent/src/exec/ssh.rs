//! `ssh.authorize`: gives an account the host's SSH public keys, creating the account when it
//! is missing, so that a VM can be logged into without a password (the spec's `ssh`).
//!
//! Order of use: [`validate`] checks the user name and every key (nothing is touched before);
//! [`authorize`] finds the account in `/etc/passwd` or creates it ([`create_account`]: the
//! image's `useradd`, else busybox `adduser`, else, as the last resort for images without
//! either such as the test initramfs, lines appended to passwd, group and shadow), then writes
//! `HOME/.ssh/authorized_keys` atomically.
//!
//! The agent is root writing into a directory its user owns, so every step below the home
//! directory goes through descriptors: `.ssh` is opened `O_NOFOLLOW|O_DIRECTORY` and must belong
//! to the user or root (a symlink the user planted there cannot redirect the write to
//! `/etc`), and the file is written as a new `O_EXCL|O_NOFOLLOW` temporary file in it and renamed
//! over `authorized_keys` with `renameat`. Account tools run from an argv, never a shell string.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use vmhost_agent_protocol::exec::{
    ssh_user_problem, SshAuthorizeParams, SshAuthorizeReply, MAX_SSH_KEYS, MAX_SSH_KEY_LINE, SSH_KEY_TYPES,
};

use super::accounts::{find_user, read_groups, read_users, User};
use crate::protocol::RpcError;

/// Where accounts live and how they may be created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accounts {
    /// `/etc` (passwd, group, shadow).
    pub etc: PathBuf,
    /// Where the last-resort creation puts home directories (`/home`).
    pub home_root: PathBuf,
    /// Whether the image's account tools may be run (they write the real `/etc`: only when
    /// `etc` is `/etc`).
    pub tools: bool,
}

impl Default for Accounts {
    fn default() -> Accounts {
        Accounts { etc: PathBuf::from("/etc"), home_root: PathBuf::from("/home"), tools: true }
    }
}

/// Checks the user name and the keys.
///
/// # Errors
/// 5100 naming `user`, `keys` or `keys[i]`.
pub fn validate(p: &SshAuthorizeParams) -> Result<(), RpcError> {
    if ssh_user_problem(&p.user).is_some() {
        return Err(RpcError::invalid("user", "user must be [a-z_][a-z0-9_-]{0,31}"));
    }
    if p.keys.is_empty() || p.keys.len() > MAX_SSH_KEYS {
        return Err(RpcError::invalid("keys", format!("1 to {MAX_SSH_KEYS} keys")));
    }
    for (i, key) in p.keys.iter().enumerate() {
        let typed = SSH_KEY_TYPES.iter().any(|t| key.strip_prefix(t).is_some_and(|rest| rest.starts_with(' ')));
        if !typed || key.len() > MAX_SSH_KEY_LINE || key.chars().any(|c| c.is_control()) {
            return Err(RpcError::invalid(
                &format!("keys[{i}]"),
                format!(
                    "a key is one line of at most {MAX_SSH_KEY_LINE} bytes starting with a known type ({})",
                    SSH_KEY_TYPES.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// The first of `names` found as an executable in the usual system directories.
fn find_tool(names: &[&str]) -> Option<(PathBuf, &'static str)> {
    for name in names {
        for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
            let path = Path::new(dir).join(name);
            if path.is_file() {
                let kind = if *name == "useradd" { "useradd" } else { "adduser" };
                return Some((path, kind));
            }
        }
    }
    None
}

/// Whether `path` is busybox's applet (a link to busybox), not Debian's Perl `adduser`, whose
/// options differ.
fn is_busybox(path: &Path) -> bool {
    std::fs::canonicalize(path).is_ok_and(|p| p.file_name().is_some_and(|n| n.as_bytes().starts_with(b"busybox")))
}

/// Appends `line` to `file`, creating it with `mode` when missing.
fn append(file: &Path, line: &str, mode: u32) -> io::Result<()> {
    let mut f = OpenOptions::new().append(true).create(true).mode(mode).open(file)?;
    f.write_all(line.as_bytes())?;
    f.sync_all()
}

/// Creates `user` with a home directory and `/bin/sh` (see the module documentation for the
/// order of the ways tried).
///
/// # Errors
/// -32603 naming the tool and its output, or the file that could not be written.
pub fn create_account(user: &str, accounts: &Accounts) -> Result<(), RpcError> {
    if accounts.tools {
        let tool = find_tool(&["useradd"]).or_else(|| find_tool(&["adduser"]).filter(|(p, _)| is_busybox(p)));
        if let Some((path, kind)) = tool {
            let mut command = Command::new(&path);
            if kind == "useradd" {
                command.args(["-m", "-s", "/bin/sh", user]);
            } else {
                command.args(["-D", "-s", "/bin/sh", user]);
            }
            let out = command
                .env_clear()
                .env("PATH", super::command::BASE_ENV[0].1)
                .output()
                .map_err(|e| RpcError::internal(format!("cannot run {}: {e}", path.display())))?;
            if !out.status.success() {
                let text = String::from_utf8_lossy(&out.stderr);
                return Err(RpcError::internal(format!(
                    "{} {user} failed ({}): {}",
                    path.display(),
                    out.status,
                    text.chars().take(300).collect::<String>()
                )));
            }
            return Ok(());
        }
    }
    let users = read_users(&accounts.etc);
    let groups = read_groups(&accounts.etc);
    let taken = |id: u32| users.iter().any(|u| u.uid == id) || groups.iter().any(|g| g.gid == id);
    let id = (1000..60000).find(|&id| !taken(id)).ok_or_else(|| RpcError::internal("no free user id"))?;
    let gid = groups.iter().find(|g| g.name == user).map_or(id, |g| g.gid);
    let home = accounts.home_root.join(user);
    let fail = |what: &Path, e: io::Error| RpcError::internal(format!("cannot write {}: {e}", what.display()));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&accounts.home_root)
        .map_err(|e| fail(&accounts.home_root, e))?;
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(&home)
        .or_else(|e| if e.kind() == io::ErrorKind::AlreadyExists { Ok(()) } else { Err(e) })
        .map_err(|e| fail(&home, e))?;
    std::os::unix::fs::chown(&home, Some(id), Some(gid)).map_err(|e| fail(&home, e))?;
    if !groups.iter().any(|g| g.name == user) {
        let path = accounts.etc.join("group");
        append(&path, &format!("{user}:x:{gid}:\n"), 0o644).map_err(|e| fail(&path, e))?;
    }
    let shadow = accounts.etc.join("shadow");
    if shadow.exists() {
        // `*`: no password login, and not "locked" (`!`), which OpenSSH without PAM would take
        // as a reason to refuse the key too.
        append(&shadow, &format!("{user}:*:19000:0:99999:7:::\n"), 0o640).map_err(|e| fail(&shadow, e))?;
    }
    let passwd = accounts.etc.join("passwd");
    let entry_home = home.display().to_string();
    append(&passwd, &format!("{user}:x:{id}:{gid}::{entry_home}:/bin/sh\n"), 0o644).map_err(|e| fail(&passwd, e))
}

/// `openat(dir, name, flags, mode)`.
fn open_at(dir: &OwnedFd, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid directory descriptor and a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, libc::c_uint::from(mode)) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Writes `content` as `authorized_keys` in the user's `.ssh` (see the module documentation);
/// returns whether it changed.
fn write_keys(user: &User, content: &[u8]) -> Result<bool, RpcError> {
    let home_path = Path::new(&user.home);
    let fail = |what: &str, e: io::Error| RpcError::internal(format!("{what} in {}: {e}", user.home));
    if !home_path.is_absolute() {
        return Err(RpcError::invalid("user", format!("{}'s home {:?} is not absolute", user.name, user.home)));
    }
    let home = File::open(home_path)
        .map_err(|e| RpcError::invalid("user", format!("{}'s home {} cannot be opened: {e}", user.name, user.home)))?;
    let home = OwnedFd::from(home);
    let c_ssh = CString::new(".ssh").map_err(|_| RpcError::internal("name"))?;
    // SAFETY: a valid directory descriptor and a NUL-terminated name.
    if unsafe { libc::mkdirat(home.as_raw_fd(), c_ssh.as_ptr(), 0o700) } != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::AlreadyExists {
            return Err(fail("cannot create .ssh", e));
        }
    }
    let ssh = open_at(&home, ".ssh", libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)
        .map_err(|e| fail("cannot open .ssh (a symlink is refused)", e))?;
    let ssh_file = File::from(ssh);
    let meta = ssh_file.metadata().map_err(|e| fail("cannot stat .ssh", e))?;
    if meta.uid() != user.uid && meta.uid() != 0 {
        return Err(RpcError::invalid(
            "user",
            format!("{}/.ssh belongs to uid {}, not {}", user.home, meta.uid(), user.name),
        ));
    }
    std::os::unix::fs::fchown(&ssh_file, Some(user.uid), Some(user.gid)).map_err(|e| fail("cannot chown .ssh", e))?;
    ssh_file
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| fail("cannot chmod .ssh", e))?;
    let ssh = OwnedFd::from(ssh_file);
    if let Ok(existing) = open_at(&ssh, "authorized_keys", libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK, 0) {
        let mut existing = File::from(existing);
        let is_file = existing.metadata().is_ok_and(|m| m.is_file() && m.len() == content.len() as u64);
        let mut old = Vec::new();
        if is_file && existing.read_to_end(&mut old).is_ok() && old == content {
            let _ = std::os::unix::fs::fchown(&existing, Some(user.uid), Some(user.gid));
            let _ = existing.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600));
            return Ok(false);
        }
    }
    let temp = format!(".authorized_keys.vmhost-{}", std::process::id());
    let c_temp = CString::new(temp.as_str()).map_err(|_| RpcError::internal("name"))?;
    // A temporary file of an earlier, interrupted call.
    // SAFETY: a valid directory descriptor and a NUL-terminated name.
    unsafe { libc::unlinkat(ssh.as_raw_fd(), c_temp.as_ptr(), 0) };
    let file = open_at(&ssh, &temp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW, 0o600)
        .map_err(|e| fail("cannot create a temporary file", e))?;
    let mut file = File::from(file);
    let written = file
        .write_all(content)
        .and_then(|()| std::os::unix::fs::fchown(&file, Some(user.uid), Some(user.gid)))
        .and_then(|()| file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600)))
        .and_then(|()| file.sync_all());
    let c_keys = CString::new("authorized_keys").map_err(|_| RpcError::internal("name"))?;
    let renamed = written.and_then(|()| {
        // SAFETY: valid directory descriptors and NUL-terminated names.
        if unsafe { libc::renameat(ssh.as_raw_fd(), c_temp.as_ptr(), ssh.as_raw_fd(), c_keys.as_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    });
    if let Err(e) = renamed {
        // SAFETY: as above.
        unsafe { libc::unlinkat(ssh.as_raw_fd(), c_temp.as_ptr(), 0) };
        return Err(fail("cannot write authorized_keys", e));
    }
    let _ = File::from(ssh).sync_all();
    Ok(true)
}

/// `ssh.authorize` (the parameters already [`validate`]d).
///
/// # Errors
/// 5100 (`user`) when the account's home is unusable; -32603 when the account cannot be
/// created or the file cannot be written.
pub fn authorize(p: &SshAuthorizeParams, accounts: &Accounts) -> Result<SshAuthorizeReply, RpcError> {
    validate(p)?;
    let mut created = false;
    let user = match find_user(&read_users(&accounts.etc), &p.user) {
        Some(user) => user.clone(),
        None => {
            create_account(&p.user, accounts)?;
            created = true;
            find_user(&read_users(&accounts.etc), &p.user)
                .cloned()
                .ok_or_else(|| RpcError::internal(format!("{} was created but is not in passwd", p.user)))?
        }
    };
    let mut content = p.keys.join("\n");
    content.push('\n');
    let changed = write_keys(&user, content.as_bytes())?;
    Ok(SshAuthorizeReply {
        created,
        path: format!("{}/.ssh/authorized_keys", user.home.trim_end_matches('/')),
        changed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 test@host";

    fn params(user: &str, keys: &[&str]) -> SshAuthorizeParams {
        SshAuthorizeParams { user: user.into(), keys: keys.iter().map(|k| k.to_string()).collect() }
    }

    #[test]
    fn names_and_keys_are_validated() {
        let field = |p: SshAuthorizeParams| validate(&p).err().and_then(|e| e.data).map(|d| d["field"].clone());
        assert_eq!(field(params("vmhost", &[KEY])), None);
        assert_eq!(field(params("_a-1", &[KEY, "ecdsa-sha2-nistp521 AAAA"])), None);
        for bad in ["", "Root", "1abc", "a b", "a/b", &"a".repeat(33), "a\n"] {
            assert_eq!(field(params(bad, &[KEY])), Some("user".into()), "{bad:?}");
        }
        assert_eq!(field(params("u", &[])), Some("keys".into()));
        assert_eq!(field(params("u", &[KEY; 17])), Some("keys".into()));
        for bad in
            ["ssh-dss AAAA", "ssh-ed25519", "ssh-ed25519AAAA", "ssh-ed25519 A\nssh-rsa B", "x ssh-rsa A", "ssh-rsa A\r"]
        {
            assert_eq!(field(params("u", &[KEY, bad])), Some("keys[1]".into()), "{bad:?}");
        }
        let long = format!("ssh-rsa {}", "A".repeat(MAX_SSH_KEY_LINE));
        assert_eq!(field(params("u", &[&long])), Some("keys[0]".into()));
    }

    fn euid() -> u32 {
        // SAFETY: geteuid has no failure mode.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn an_account_is_created_when_missing_and_keys_written_once() {
        if euid() != 0 {
            return; // chown to another user needs root (the agent's case).
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let etc = dir.path().join("etc");
        std::fs::create_dir_all(&etc).expect("mkdir");
        std::fs::write(etc.join("passwd"), "root:x:0:0:root:/root:/bin/sh\nold:x:1000:1000::/home/old:/bin/sh\n")
            .expect("write");
        std::fs::write(etc.join("shadow"), "root:*:1::::::\n").expect("write");
        let accounts = Accounts { etc: etc.clone(), home_root: dir.path().join("home"), tools: false };
        let reply = authorize(&params("vmhost", &[KEY]), &accounts).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(reply.created && reply.changed, "{reply:?}");
        let home = dir.path().join("home/vmhost");
        assert_eq!(reply.path, format!("{}/.ssh/authorized_keys", home.display()));
        let passwd = std::fs::read_to_string(etc.join("passwd")).unwrap_or_default();
        assert!(passwd.ends_with(&format!("vmhost:x:1001:1001::{}:/bin/sh\n", home.display())), "{passwd}");
        assert_eq!(std::fs::read_to_string(etc.join("group")).unwrap_or_default(), "vmhost:x:1001:\n");
        assert!(std::fs::read_to_string(etc.join("shadow")).unwrap_or_default().contains("\nvmhost:*:"));
        let keys = home.join(".ssh/authorized_keys");
        assert_eq!(std::fs::read_to_string(&keys).unwrap_or_default(), format!("{KEY}\n"));
        let meta = std::fs::metadata(&keys).expect("stat");
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (1001, 1001, 0o600));
        let meta = std::fs::metadata(home.join(".ssh")).expect("stat");
        assert_eq!((meta.uid(), meta.mode() & 0o777), (1001, 0o700));
        // Again: nothing changes; other keys: replaced whole.
        let again = authorize(&params("vmhost", &[KEY]), &accounts).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(!again.created && !again.changed, "{again:?}");
        let other = "ssh-rsa AAAAB3 other";
        let changed = authorize(&params("vmhost", &[other, KEY]), &accounts).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(changed.changed);
        assert_eq!(std::fs::read_to_string(&keys).unwrap_or_default(), format!("{other}\n{KEY}\n"));
        let mut names: Vec<String> = std::fs::read_dir(home.join(".ssh"))
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        names.sort();
        assert_eq!(names, ["authorized_keys"]);
    }

    #[test]
    fn a_planted_ssh_symlink_is_refused() {
        if euid() != 0 {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let etc = dir.path().join("etc");
        let home = dir.path().join("home/eve");
        let target = dir.path().join("sensitive");
        std::fs::create_dir_all(&etc).expect("mkdir");
        std::fs::create_dir_all(&home).expect("mkdir");
        std::fs::create_dir_all(&target).expect("mkdir");
        std::fs::write(etc.join("passwd"), format!("eve:x:1005:1005::{}:/bin/sh\n", home.display())).expect("write");
        std::os::unix::fs::symlink(&target, home.join(".ssh")).expect("symlink");
        let accounts = Accounts { etc, home_root: dir.path().join("home"), tools: false };
        let e = authorize(&params("eve", &[KEY]), &accounts).err();
        assert!(e.is_some_and(|e| e.message.contains("symlink")));
        assert!(std::fs::read_dir(&target).map(|d| d.count()).unwrap_or(1) == 0, "nothing written through the link");
    }
}
