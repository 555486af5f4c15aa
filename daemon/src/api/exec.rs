//! Wire types of `vm.exec`, `vm.file_push` and `vm.file_pull` (docs/api.md, docs/guest-exec.md),
//! and the guest action an [`super::Event`] may carry.
//!
//! Each params type is closed and bounded: [`ExecParams::check`], [`FilePushParams::check`] and
//! [`FilePullParams::check`] apply the limits serde cannot express and answer -32602 naming the
//! field, before anything reaches a guest.

use super::{ApiError, Code};
use serde::{Deserialize, Serialize};

/// Name of the notification that carries streamed `vm.exec` output.
pub const EXEC_OUTPUT_NOTIFICATION: &str = "vm.exec.output";

/// Most arguments of a command.
pub const MAX_ARGS: usize = 256;
/// Longest argument, in bytes.
pub const MAX_ARG: usize = 4096;
/// Longest argv in all, in bytes.
pub const MAX_ARGV_TOTAL: usize = 64 * 1024;
/// Most environment entries.
pub const MAX_ENV: usize = 64;
/// Longest guest path, in bytes.
pub const MAX_PATH: usize = 4096;
/// Longest stdin, decoded.
pub const MAX_STDIN: u64 = vmhost_agent_protocol::exec::MAX_STDIN;
/// Largest `max_output`.
pub const MAX_OUTPUT: u64 = vmhost_agent_protocol::exec::MAX_OUTPUT;
/// Default `max_output`.
pub const DEFAULT_MAX_OUTPUT: u64 = 1024 * 1024;
/// Longest `timeout_s`.
pub const MAX_TIMEOUT_S: u32 = vmhost_agent_protocol::exec::MAX_TIMEOUT_S;
/// Largest inline `content` of a push, decoded (its base64 fits a request line).
pub const MAX_PUSH_CONTENT: u64 = 768 * 1024;
/// Default and largest `max_bytes` of a pull.
pub const DEFAULT_PULL_BYTES: u64 = 1024 * 1024;
/// Largest `max_bytes` of a pull.
pub const MAX_PULL_BYTES: u64 = 2 * 1024 * 1024;

/// How output and file content are written in answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text; bytes that are not UTF-8 become U+FFFD.
    #[default]
    Text,
    /// Standard base64 of the bytes.
    Base64,
}

fn default_timeout() -> u32 {
    60
}

fn default_max_output() -> u64 {
    DEFAULT_MAX_OUTPUT
}

fn default_mode() -> u32 {
    0o644
}

fn default_pull_bytes() -> u64 {
    DEFAULT_PULL_BYTES
}

/// Params of `vm.exec`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecParams {
    /// VM name.
    pub name: String,
    /// The program (looked up in the guest's `PATH` without a `/`) and its arguments; no shell.
    pub argv: Vec<String>,
    /// Extra environment, `NAME=value` each.
    #[serde(default)]
    pub env: Vec<String>,
    /// Working directory (absolute); `/` when absent.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Standard input, base64; none gives the command `/dev/null`.
    #[serde(default)]
    pub stdin: Option<String>,
    /// Seconds the command may run before its process group is killed (1 to 86400).
    #[serde(default = "default_timeout")]
    pub timeout_s: u32,
    /// Bytes kept per output stream (at most 4 MiB); the rest is counted, not sent.
    #[serde(default = "default_max_output")]
    pub max_output: u64,
    /// How `stdout` and `stderr` are written in the answer.
    #[serde(default)]
    pub encoding: Encoding,
    /// Send output as `vm.exec.output` notifications before the answer.
    #[serde(default)]
    pub stream: bool,
}

/// The answer of `vm.exec`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecResult {
    /// The exit status, when the command exited.
    pub exit_code: Option<i32>,
    /// The signal that ended it otherwise (9 after a timeout).
    pub signal: Option<i32>,
    /// Killed at `timeout_s`.
    pub timed_out: bool,
    /// Milliseconds the command ran.
    pub duration_ms: u64,
    /// Standard output as `encoding` says (empty when streamed).
    pub stdout: String,
    /// Standard error as `encoding` says (empty when streamed).
    pub stderr: String,
    /// Bytes the command wrote to stdout, kept or not.
    pub stdout_bytes: u64,
    /// Bytes the command wrote to stderr, kept or not.
    pub stderr_bytes: u64,
    /// More stdout was written than `max_output`.
    pub stdout_truncated: bool,
    /// More stderr was written than `max_output`.
    pub stderr_truncated: bool,
    /// The encoding of `stdout` and `stderr`.
    pub encoding: Encoding,
    /// The exec slot (0 to 7) the command ran on.
    pub slot: usize,
}

/// The params of a `vm.exec.output` notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecOutput {
    /// VM name.
    pub name: String,
    /// `stdout` or `stderr`.
    pub stream: vmhost_agent_protocol::exec::OutputStream,
    /// The bytes, base64.
    pub data: String,
}

/// Params of `vm.file_push`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePushParams {
    /// VM name.
    pub name: String,
    /// Absolute path of the file in the guest.
    pub path: String,
    /// Permission bits (default 0o644, at most 0o7777).
    #[serde(default = "default_mode")]
    pub mode: u32,
    /// `user[:group]`, names or numbers; root when absent.
    #[serde(default)]
    pub owner: Option<String>,
    /// The content, base64 (at most 768 KiB decoded); or `source`.
    #[serde(default)]
    pub content: Option<String>,
    /// A file relative to the host's `[agent] files_dir`; or `content`.
    #[serde(default)]
    pub source: Option<String>,
    /// The sha256 the content must have (hex), checked on the host before sending (2003).
    #[serde(default)]
    pub sha256: Option<String>,
    /// Create missing parent directories.
    #[serde(default)]
    pub mkdir: bool,
}

/// The answer of `vm.file_push`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePushResult {
    /// The guest path.
    pub path: String,
    /// Bytes written.
    pub size: u64,
    /// Their sha256.
    pub sha256: String,
}

/// Params of `vm.file_pull`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePullParams {
    /// VM name.
    pub name: String,
    /// Absolute path of a regular file in the guest.
    pub path: String,
    /// Refuse a larger file (default 1 MiB, at most 2 MiB).
    #[serde(default = "default_pull_bytes")]
    pub max_bytes: u64,
}

/// The answer of `vm.file_pull`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePullResult {
    /// The guest path.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Their sha256, computed by the host (equal to the guest's).
    pub sha256: String,
    /// The file's permission bits.
    pub mode: u32,
    /// The bytes, base64.
    pub content: String,
}

/// What a guest action an [`super::Event`] reports was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuestActionKind {
    /// `vm.exec`.
    Exec,
    /// `vm.file_push`.
    FilePush,
    /// `vm.file_pull`.
    FilePull,
    /// `vm.sync_time`.
    SyncTime,
    /// `vm.stop` with `method: "agent"`.
    Shutdown,
}

/// A command, transfer or housekeeping call made in a guest: who asked, what, how it ended.
/// Never content, stdin or environment values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestAction {
    /// What it was.
    pub action: GuestActionKind,
    /// The uid of the API peer that asked.
    pub peer_uid: u32,
    /// The command (`exec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// The guest path (`file_push`, `file_pull`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The sha256 of what was moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The exit status (`exec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The ending signal (`exec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Killed at its timeout (`exec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timed_out: Option<bool>,
}

impl GuestAction {
    /// `action` asked by `peer_uid`, with nothing known yet about what it touched or how it ended.
    pub fn new(action: GuestActionKind, peer_uid: u32) -> GuestAction {
        GuestAction {
            action,
            peer_uid,
            argv: None,
            path: None,
            sha256: None,
            exit_code: None,
            signal: None,
            timed_out: None,
        }
    }
}

fn bad(field: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::new(Code::InvalidParams, message).field(field)
}

/// An absolute guest path of at most [`MAX_PATH`] bytes without NUL.
fn check_guest_path(field: &str, path: &str) -> Result<(), ApiError> {
    if !path.starts_with('/') || path.len() > MAX_PATH || path.contains('\0') {
        return Err(bad(field, format!("{field} must be an absolute path of at most {MAX_PATH} bytes without NUL")));
    }
    Ok(())
}

/// Decodes base64 `text` of at most `max` decoded bytes.
fn decode_bounded(field: &str, text: &str, max: u64) -> Result<Vec<u8>, ApiError> {
    if crate::agent::exec::base64::decoded_len(text.len()) as u64 > max + 2 {
        return Err(bad(field, format!("{field} is more than {max} bytes")));
    }
    let bytes = crate::agent::exec::base64::decode(text).map_err(|e| bad(field, format!("{field}: {e}")))?;
    if bytes.len() as u64 > max {
        return Err(bad(field, format!("{field} is more than {max} bytes")));
    }
    Ok(bytes)
}

/// `NAME=value` with a portable name.
fn env_ok(entry: &str) -> bool {
    let Some((name, _)) = entry.split_once('=') else { return false };
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !entry.contains('\0')
}

impl ExecParams {
    /// Applies the limits serde cannot: argv 1 to 256 entries of at most 4096 bytes, 64 KiB in
    /// all, no NUL; env at most 64 `NAME=value`; an absolute `cwd`; `stdin` base64 of at most
    /// 1 MiB; `timeout_s` 1 to 86400; `max_output` at most 4 MiB. Returns stdin decoded.
    ///
    /// # Errors
    /// -32602 naming the field.
    pub fn check(&self) -> Result<Vec<u8>, ApiError> {
        if self.argv.is_empty() || self.argv.len() > MAX_ARGS {
            return Err(bad("argv", format!("argv must have 1 to {MAX_ARGS} entries")));
        }
        let mut total = 0usize;
        for (i, arg) in self.argv.iter().enumerate() {
            if arg.len() > MAX_ARG || arg.contains('\0') {
                return Err(bad(format!("argv[{i}]"), format!("an argument is at most {MAX_ARG} bytes, without NUL")));
            }
            total += arg.len();
        }
        if total > MAX_ARGV_TOTAL {
            return Err(bad("argv", format!("argv is {total} bytes; at most {MAX_ARGV_TOTAL}")));
        }
        if self.argv.first().is_some_and(String::is_empty) {
            return Err(bad("argv[0]", "the program name is empty"));
        }
        if self.env.len() > MAX_ENV {
            return Err(bad("env", format!("at most {MAX_ENV} environment entries")));
        }
        for (i, entry) in self.env.iter().enumerate() {
            if !env_ok(entry) || entry.len() > MAX_ARG {
                return Err(bad(
                    format!("env[{i}]"),
                    "an environment entry is NAME=value, NAME of [A-Za-z_][A-Za-z0-9_]*, at most 4096 bytes",
                ));
            }
        }
        if let Some(cwd) = &self.cwd {
            check_guest_path("cwd", cwd)?;
        }
        if !(1..=MAX_TIMEOUT_S).contains(&self.timeout_s) {
            return Err(bad("timeout_s", format!("timeout_s must be 1 to {MAX_TIMEOUT_S}")));
        }
        if self.max_output > MAX_OUTPUT {
            return Err(bad("max_output", format!("max_output is at most {MAX_OUTPUT}")));
        }
        match &self.stdin {
            Some(text) => decode_bounded("stdin", text, MAX_STDIN),
            None => Ok(Vec::new()),
        }
    }

    /// The names of the environment entries (what the audit log shows of them).
    pub fn env_names(&self) -> Vec<&str> {
        self.env.iter().map(|e| e.split_once('=').map_or(e.as_str(), |(n, _)| n)).collect()
    }
}

/// `user[:group]`: names or numbers.
fn owner_ok(owner: &str) -> bool {
    let part =
        |p: &str| !p.is_empty() && p.len() <= 32 && p.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    match owner.split_once(':') {
        Some((user, group)) => part(user) && part(group),
        None => part(owner),
    }
}

impl FilePushParams {
    /// Applies the limits: an absolute `path`, `mode` at most 0o7777, a well-formed `owner`,
    /// exactly one of `content` (base64, at most 768 KiB) and `source`, a `sha256` of 64 hex
    /// digits. Returns the inline content decoded, if any.
    ///
    /// # Errors
    /// -32602 naming the field.
    pub fn check(&self) -> Result<Option<Vec<u8>>, ApiError> {
        check_guest_path("path", &self.path)?;
        if self.mode > 0o7777 {
            return Err(bad("mode", "mode is at most 0o7777 (4095)"));
        }
        if let Some(owner) = &self.owner {
            if !owner_ok(owner) {
                return Err(bad("owner", "owner is user[:group], names or numbers"));
            }
        }
        if let Some(sha) = &self.sha256 {
            if sha.len() != 64 || !sha.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad("sha256", "sha256 is 64 hex digits"));
            }
        }
        match (&self.content, &self.source) {
            (Some(text), None) => decode_bounded("content", text, MAX_PUSH_CONTENT).map(Some),
            (None, Some(_)) => Ok(None),
            (Some(_), Some(_)) => Err(bad("source", "give content or source, not both")),
            (None, None) => Err(bad("content", "give content (base64) or source (a file under [agent] files_dir)")),
        }
    }
}

impl FilePullParams {
    /// Applies the limits: an absolute `path`, `max_bytes` 1 to 2 MiB.
    ///
    /// # Errors
    /// -32602 naming the field.
    pub fn check(&self) -> Result<(), ApiError> {
        check_guest_path("path", &self.path)?;
        if !(1..=MAX_PULL_BYTES).contains(&self.max_bytes) {
            return Err(bad("max_bytes", format!("max_bytes must be 1 to {MAX_PULL_BYTES}")));
        }
        Ok(())
    }
}

/// Writes output bytes as `encoding` says.
pub fn encode_output(bytes: &[u8], encoding: Encoding) -> String {
    match encoding {
        Encoding::Text => String::from_utf8_lossy(bytes).into_owned(),
        Encoding::Base64 => crate::agent::exec::base64::encode(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn exec(v: serde_json::Value) -> Result<Vec<u8>, ApiError> {
        serde_json::from_value::<ExecParams>(v).map_err(|e| ApiError::internal(e.to_string()))?.check()
    }

    fn field(r: Result<impl std::fmt::Debug, ApiError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.code, Code::InvalidParams, "{e:?}");
        e.field.unwrap_or_default()
    }

    #[test]
    fn exec_params_default_and_are_bounded_with_field_names() {
        let p: ExecParams = serde_json::from_value(json!({"name": "a", "argv": ["true"]})).unwrap();
        assert_eq!((p.timeout_s, p.max_output, p.encoding, p.stream), (60, 1 << 20, Encoding::Text, false));
        assert_eq!(p.check().unwrap(), Vec::<u8>::new());
        assert_eq!(field(exec(json!({"name": "a", "argv": []}))), "argv");
        assert_eq!(field(exec(json!({"name": "a", "argv": vec!["x"; 257]}))), "argv");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x", "a\u{0}b"]}))), "argv[1]");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x", "y".repeat(4097)]}))), "argv[1]");
        assert_eq!(field(exec(json!({"name": "a", "argv": vec!["y".repeat(4000); 17]}))), "argv");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "env": ["1A=b"]}))), "env[0]");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "env": ["A_1=b", "noequals"]}))), "env[1]");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "env": vec!["A=b"; 65]}))), "env");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "cwd": "tmp"}))), "cwd");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "timeout_s": 0}))), "timeout_s");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "timeout_s": 86401}))), "timeout_s");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "max_output": MAX_OUTPUT + 1}))), "max_output");
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "stdin": "not base64!"}))), "stdin");
        let big = crate::agent::exec::base64::encode(&vec![0u8; MAX_STDIN as usize + 1]);
        assert_eq!(field(exec(json!({"name": "a", "argv": ["x"], "stdin": big}))), "stdin");
        assert_eq!(exec(json!({"name": "a", "argv": ["x"], "stdin": "aGk="})).unwrap(), b"hi");
        assert!(serde_json::from_value::<ExecParams>(json!({"name": "a", "argv": ["x"], "shell": true})).is_err());
        let p: ExecParams =
            serde_json::from_value(json!({"name": "a", "argv": ["x"], "env": ["A=secret", "B_2=x=y"]})).unwrap();
        assert_eq!(p.env_names(), ["A", "B_2"]);
    }

    fn push(v: serde_json::Value) -> Result<Option<Vec<u8>>, ApiError> {
        serde_json::from_value::<FilePushParams>(v).map_err(|e| ApiError::internal(e.to_string()))?.check()
    }

    #[test]
    fn push_and_pull_params_are_bounded_with_field_names() {
        assert_eq!(push(json!({"name": "a", "path": "/x", "content": "aGk="})).unwrap(), Some(b"hi".to_vec()));
        assert_eq!(push(json!({"name": "a", "path": "/x", "source": "f"})).unwrap(), None);
        assert_eq!(field(push(json!({"name": "a", "path": "x", "content": ""}))), "path");
        assert_eq!(field(push(json!({"name": "a", "path": "/x", "content": "", "mode": 0o10000}))), "mode");
        assert_eq!(field(push(json!({"name": "a", "path": "/x", "content": "", "owner": "a b"}))), "owner");
        assert!(push(json!({"name": "a", "path": "/x", "content": "", "owner": "0:adm"})).is_ok());
        assert_eq!(field(push(json!({"name": "a", "path": "/x"}))), "content");
        assert_eq!(field(push(json!({"name": "a", "path": "/x", "content": "", "source": "f"}))), "source");
        assert_eq!(field(push(json!({"name": "a", "path": "/x", "content": "", "sha256": "abc"}))), "sha256");
        let big = crate::agent::exec::base64::encode(&vec![0u8; MAX_PUSH_CONTENT as usize + 1]);
        assert_eq!(field(push(json!({"name": "a", "path": "/x", "content": big}))), "content");
        let pull = |v| serde_json::from_value::<FilePullParams>(v).unwrap().check();
        assert!(pull(json!({"name": "a", "path": "/x"})).is_ok());
        assert_eq!(field(pull(json!({"name": "a", "path": "/x", "max_bytes": MAX_PULL_BYTES + 1}))), "max_bytes");
        assert_eq!(field(pull(json!({"name": "a", "path": "/x", "max_bytes": 0}))), "max_bytes");
    }

    #[test]
    fn output_is_text_with_replacements_or_base64() {
        assert_eq!(encode_output(b"a\xffb", Encoding::Text), "a\u{fffd}b");
        assert_eq!(encode_output(b"a\xffb", Encoding::Base64), "Yf9i");
    }
}
