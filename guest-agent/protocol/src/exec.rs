//! The exec ports' message shapes: commands as root, files in and out, the clock, shutdown and
//! SSH keys (issue 29).
//!
//! These methods are served by `vmhost-agent --exec` on the virtio-serial ports
//! `org.vmhost.exec.0` to `org.vmhost.exec.{EXEC_SLOTS - 1}` ([`exec_port_name`]), one port per
//! slot, never on the agent port: they need root without the agent unit's sandbox. A session on
//! an exec port is `sync` (as on the agent port), `hello` (optional), then exactly one of these
//! requests; the host disconnects after its final reply, and a host hang-up while a command
//! runs kills the command's process group.
//!
//! Bulk bytes travel as [`Chunk`] lines of at most [`MAX_CHUNK`] bytes (base64), never inside a
//! request or a reply: `exec` stdin and `file.push` content follow their request (the host
//! sends exactly the announced byte count), `exec` output and `file.pull` content come before
//! the final reply as `exec.output` / `file.data` notifications carrying the request's id.
//! The framing limits of `guest-agent/README.md` (64 KiB lines) hold on these ports too.

use serde::{Deserialize, Serialize};

/// Exec ports (slots) in every VM: at most this many commands or transfers run at once.
pub const EXEC_SLOTS: usize = 8;

/// Raw bytes in one [`Chunk`] (base64 makes it 43,692 bytes, inside a 64 KiB line).
pub const MAX_CHUNK: usize = 32 * 1024;

/// Longest `exec` stdin, in bytes.
pub const MAX_STDIN: u64 = 1024 * 1024;

/// Longest output per stream the host asks for (`max_output` is capped to this).
pub const MAX_OUTPUT: u64 = 4 * 1024 * 1024;

/// Longest `exec` timeout, in seconds (a day).
pub const MAX_TIMEOUT_S: u32 = 86_400;

/// The name of exec port `slot` (0-based).
pub fn exec_port_name(slot: usize) -> String {
    format!("org.vmhost.exec.{slot}")
}

/// The methods `hello` lists on an exec port.
pub const EXEC_CAPABILITIES: [&str; 6] =
    ["exec", "file.push", "file.pull", "time.set", "guest.shutdown", "ssh.authorize"];

/// A line of bulk bytes: the host's stdin or file content after a request (`{"data": "..."}`),
/// and the `params` of the guest's `exec.output` and `file.data` notifications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chunk {
    /// The id of the request the bytes belong to (absent on the host's lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    /// `stdout` or `stderr` on `exec.output`; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<OutputStream>,
    /// Standard base64 (with padding) of at most [`MAX_CHUNK`] bytes.
    pub data: String,
}

/// Which output of a command a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Parameters of `exec`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecParams {
    /// The program (looked up in `PATH` when it has no `/`) and its arguments; no shell.
    pub argv: Vec<String>,
    /// Extra environment, `NAME=value` each, on top of a fixed base
    /// (`PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin`, `HOME=/root`,
    /// `LANG=C.UTF-8`); the agent's own environment is not passed on.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory; `/` when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Bytes of stdin the host sends after the request (as [`Chunk`] lines); 0 gives the
    /// command `/dev/null`. At most [`MAX_STDIN`].
    #[serde(default)]
    pub stdin_bytes: u64,
    /// Seconds the command may run; then its process group is killed (`SIGKILL`).
    pub timeout_s: u32,
    /// Bytes per stream sent back; the rest is read and dropped (counted in the reply).
    pub max_output: u64,
}

/// The final reply of `exec`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecReply {
    /// The exit status when the command exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it otherwise (9 after a timeout).
    pub signal: Option<i32>,
    /// The command was killed at its timeout.
    pub timed_out: bool,
    /// Milliseconds from the start to the end of the command.
    pub duration_ms: u64,
    /// Bytes the command wrote to stdout, sent or not.
    pub stdout_bytes: u64,
    /// Bytes the command wrote to stderr, sent or not.
    pub stderr_bytes: u64,
}

/// Parameters of `file.push`: [`FilePushParams::size`] bytes of content follow as [`Chunk`]
/// lines; the agent reads all of them before it answers, also when it refuses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePushParams {
    /// Absolute path of the file in the guest.
    pub path: String,
    /// Permission bits (`0o644`); at most `0o7777`.
    pub mode: u32,
    /// Owner: a user name or number, optionally `:group`; absent: root.
    #[serde(default)]
    pub owner: Option<String>,
    /// Content length.
    pub size: u64,
    /// Lowercase hex sha256 of the content, checked before the file is renamed into place.
    pub sha256: String,
    /// Create missing parent directories (mode 0755, root).
    #[serde(default)]
    pub mkdir: bool,
}

/// The reply of `file.push`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePushReply {
    /// Bytes written.
    pub size: u64,
    /// sha256 of what was written (equal to the request's).
    pub sha256: String,
}

/// Parameters of `file.pull`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePullParams {
    /// Absolute path of a regular file in the guest.
    pub path: String,
    /// Refuse a file larger than this.
    pub max_bytes: u64,
}

/// The final reply of `file.pull`, after its `file.data` notifications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePullReply {
    /// Bytes sent.
    pub size: u64,
    /// sha256 of the bytes sent, lowercase hex.
    pub sha256: String,
    /// The file's permission bits.
    pub mode: u32,
}

/// Parameters of `time.set`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeSetParams {
    /// The host's `CLOCK_REALTIME` in nanoseconds since the epoch when it sent the request.
    pub unix_ns: u64,
}

/// The reply of `time.set`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeSetReply {
    /// The guest's clock before it was set, nanoseconds since the epoch.
    pub before_ns: u64,
    /// The guest's clock right after, nanoseconds since the epoch.
    pub after_ns: u64,
}

/// The reply of `guest.shutdown` (params: `{}`), sent before the guest powers off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownReply {
    /// How: `systemctl poweroff` or `reboot(2)` (no systemd: file systems synced first).
    pub how: String,
}

/// Most keys `ssh.authorize` (and a spec's `ssh.keys`) may hold.
pub const MAX_SSH_KEYS: usize = 16;

/// Longest key line, in bytes: an RSA key of 16384 bits is about 2.8 KiB with a long comment.
pub const MAX_SSH_KEY_LINE: usize = 8 * 1024;

/// The key types accepted (what OpenSSH writes as a key line's first field): OpenSSH's public
/// key types minus DSA (removed from OpenSSH) and certificates (a CA is not what a per-VM key
/// list is for).
pub const SSH_KEY_TYPES: [&str; 7] = [
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
];

/// Why `user` cannot be the account of `ssh.authorize`, if it cannot: `[a-z_][a-z0-9_-]{0,31}`
/// (Debian's `adduser` default rule without its `$`, and what `useradd` takes everywhere). One
/// rule for vmhostd's spec check and the agent's own.
pub fn ssh_user_problem(user: &str) -> Option<&'static str> {
    let mut chars = user.chars();
    match chars.next() {
        None => Some("is empty"),
        Some(c) if !(c.is_ascii_lowercase() || c == '_') => Some("must start with a-z or _"),
        _ if user.len() > 32 => Some("is longer than 32 characters"),
        _ if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-') => {
            Some("may hold only a-z, 0-9, _ and -")
        }
        _ => None,
    }
}

/// Parameters of `ssh.authorize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshAuthorizeParams {
    /// The account; created (with a home directory and `/bin/sh`) when it does not exist.
    pub user: String,
    /// The complete `authorized_keys` content's lines: OpenSSH public keys.
    pub keys: Vec<String>,
}

/// The reply of `ssh.authorize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshAuthorizeReply {
    /// The account was created by this call.
    pub created: bool,
    /// The file written (`HOME/.ssh/authorized_keys`).
    pub path: String,
    /// The file changed (false when it already held exactly these keys).
    pub changed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_chunk_fits_in_a_frame() {
        let line = serde_json::to_string(&Chunk {
            id: Some(u64::MAX),
            stream: Some(OutputStream::Stderr),
            data: "A".repeat(MAX_CHUNK.div_ceil(3) * 4),
        })
        .unwrap_or_default();
        let notification = format!(r#"{{"jsonrpc":"2.0","method":"exec.output","params":{line}}}"#);
        assert!(notification.len() < 64 * 1024, "{}", notification.len());
    }

    #[test]
    fn slots_are_named_by_index() {
        assert_eq!(exec_port_name(0), "org.vmhost.exec.0");
        assert_eq!(exec_port_name(EXEC_SLOTS - 1), "org.vmhost.exec.7");
    }

    #[test]
    fn the_shapes_are_closed_and_host_lines_carry_no_id() {
        let host = serde_json::to_string(&Chunk { id: None, stream: None, data: "aGk=".into() }).unwrap_or_default();
        assert_eq!(host, r#"{"data":"aGk="}"#);
        assert!(serde_json::from_str::<ExecReply>(
            r#"{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":1,"stdout_bytes":0,"stderr_bytes":0,"x":1}"#
        )
        .is_err());
        let s: OutputStream = serde_json::from_str(r#""stdout""#).unwrap_or(OutputStream::Stderr);
        assert_eq!(s, OutputStream::Stdout);
    }
}
