//! `vmhostctl push` and `vmhostctl pull`: a file into a guest (`vm.file_push`) and out of it
//! (`vm.file_pull`).
//!
//! Why a module of its own: both move bytes between a local file and the guest and check them
//! by sha256 on each side, and `pull` writes a local file from what a guest sent, which must
//! never choose where it lands, what it is named, or its permissions.
//!
//! Order of use: `push` reads LOCAL ([`read_local`], at most [`MAX_INLINE`] bytes, sent inline
//! with its sha256 so vmhostd and the guest both check it) or names `--source REL`, a file in
//! vmhostd's `[agent] files_dir` that vmhostd opens itself ([`push_params`]); `pull` calls,
//! checks the content against the answer's size and sha256 ([`check_pulled`]) and writes LOCAL
//! atomically ([`write_atomically`]: a temp file beside it, fsync, rename, fsync of the
//! directory), with the mode a new file gets from the umask, never the guest's.

use super::Failure;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{self, IsTerminal, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use vmhost_agent_protocol::base64;

/// Longest file pushed inline (`vm.file_push`'s `content` limit, decoded); larger files go
/// through `--source`.
pub const MAX_INLINE: usize = 768 * 1024;

/// Arguments of `vmhostctl push`.
#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The VM.
    pub name: String,
    /// `LOCAL GUEST_PATH` (LOCAL `-` reads standard input), or only `GUEST_PATH` with
    /// `--source`.
    #[arg(num_args = 1..=2, required = true, value_name = "LOCAL GUEST_PATH")]
    pub paths: Vec<String>,
    /// Permission bits in octal (`0644`, the default; at most `7777`).
    #[arg(long)]
    pub mode: Option<String>,
    /// Owner in the guest: `user[:group]`, names or numbers (default root).
    #[arg(long, value_name = "U[:G]")]
    pub owner: Option<String>,
    /// Create missing parent directories in the guest.
    #[arg(long)]
    pub mkdir: bool,
    /// Push a file vmhostd reads itself: a path relative to its `[agent] files_dir` (for files
    /// above the inline limit of 768 KiB).
    #[arg(long, value_name = "REL")]
    pub source: Option<String>,
}

/// Arguments of `vmhostctl pull`.
#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// The VM.
    pub name: String,
    /// The file in the guest (absolute).
    pub guest_path: String,
    /// Where to write it (`-` for standard output).
    pub local: PathBuf,
    /// Refuse a guest file larger than this (daemon default 1 MiB, at most 2 MiB).
    #[arg(long)]
    pub max_bytes: Option<u64>,
}

/// `--mode` in octal (`0644`, `644`, `0o644`), at most `0o7777`.
pub fn parse_mode(text: &str) -> Result<u32, Failure> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o7777 && !digits.is_empty() => Ok(mode),
        _ => Err(Failure::Usage(format!("--mode {text:?}: not octal permission bits up to 7777"))),
    }
}

/// LOCAL's bytes (`-`: standard input), refused beyond [`MAX_INLINE`].
pub fn read_local(local: &str) -> Result<Vec<u8>, Failure> {
    let fail = |e: io::Error| Failure::Usage(format!("{local}: {e}"));
    let reader: Box<dyn Read> =
        if local == "-" { Box::new(io::stdin()) } else { Box::new(File::open(local).map_err(fail)?) };
    let mut bytes = Vec::new();
    reader.take(MAX_INLINE as u64 + 1).read_to_end(&mut bytes).map_err(fail)?;
    if bytes.len() > MAX_INLINE {
        return Err(Failure::Usage(format!(
            "{local}: larger than {MAX_INLINE} bytes, the most vm.file_push takes inline: put it in vmhostd's \
             [agent] files_dir and push it with --source"
        )));
    }
    Ok(bytes)
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The `vm.file_push` params for `args`, with LOCAL's `content` when it was read.
///
/// # Errors
///
/// [`Failure::Usage`] for a bad `--mode`, or LOCAL given with `--source` (or neither).
pub fn push_params(args: &PushArgs, content: Option<&[u8]>) -> Result<Value, Failure> {
    let guest_path = match (args.paths.as_slice(), &args.source, content) {
        ([_, guest], None, Some(_)) => guest,
        ([guest], Some(_), None) => guest,
        ([_, _], Some(_), _) => return Err(Failure::Usage("give LOCAL or --source, not both".into())),
        _ => {
            return Err(Failure::Usage(
                "usage: push NAME LOCAL GUEST_PATH, or push NAME GUEST_PATH --source REL".into(),
            ))
        }
    };
    let mut p = json!({"name": args.name, "path": guest_path, "mkdir": args.mkdir});
    if let Some(mode) = &args.mode {
        p["mode"] = json!(parse_mode(mode)?);
    }
    if let Some(owner) = &args.owner {
        p["owner"] = json!(owner);
    }
    match (content, &args.source) {
        (Some(bytes), _) => {
            p["content"] = json!(base64::encode(bytes));
            p["sha256"] = json!(sha256_hex(bytes));
        }
        (None, Some(rel)) => p["source"] = json!(rel),
        (None, None) => {}
    }
    Ok(p)
}

/// The bytes of a `vm.file_pull` answer, checked against its `size` and `sha256` (what
/// vmhostd computed over what the guest sent).
///
/// # Errors
///
/// [`Failure::Connect`] when the content is not base64 or differs from its size or sha256.
pub fn check_pulled(answer: &Value) -> Result<Vec<u8>, Failure> {
    let bytes = answer["content"]
        .as_str()
        .and_then(|text| base64::decode(text).ok())
        .ok_or_else(|| Failure::Connect("vm.file_pull answered without base64 content".into()))?;
    if answer["size"].as_u64() != Some(bytes.len() as u64) {
        return Err(Failure::Connect(format!(
            "vm.file_pull sent {} bytes but says size {}: nothing written",
            bytes.len(),
            answer["size"]
        )));
    }
    let got = sha256_hex(&bytes);
    if answer["sha256"].as_str() != Some(got.as_str()) {
        return Err(Failure::Connect(format!(
            "vm.file_pull's content has sha256 {got}, the answer says {}: nothing written",
            answer["sha256"]
        )));
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` so that a reader sees the old file or the new one, never part: a
/// new temp file in the same directory (mode 0666 less the umask, as any new file), written and
/// fsynced, renamed over `path`, then the directory fsynced. The temp file is removed when a
/// step fails.
///
/// # Errors
///
/// The I/O error, naming the path; `path` a directory is refused.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), Failure> {
    let fail = |e: io::Error| Failure::Usage(format!("{}: {e}", path.display()));
    if path.is_dir() {
        return Err(Failure::Usage(format!("{}: is a directory (name the file to write)", path.display())));
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| Failure::Usage(format!("{}: not a file name", path.display())))?
        .to_string_lossy()
        .into_owned();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let nonce =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let tmp = dir.join(format!(".{file_name}.vmhostctl-{}-{nonce:08x}", std::process::id()));
    let result = (|| {
        let mut f =
            OpenOptions::new().write(true).create_new(true).mode(0o666).custom_flags(libc::O_NOFOLLOW).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(fail)
}

/// Runs `vmhostctl push`; the answer (`{path, size, sha256}`).
///
/// # Errors
///
/// [`Failure`] for a bad argument, an unreadable LOCAL, or vmhostd's refusal.
pub fn push(client: &mut vmhost::client::Client, args: &PushArgs) -> Result<Value, Failure> {
    let content = match (args.paths.as_slice(), &args.source) {
        ([local, _], None) => Some(read_local(local)?),
        _ => None,
    };
    let params = push_params(args, content.as_deref())?;
    Ok(client.call("vm.file_push", params)?)
}

/// Runs `vmhostctl pull`: the answer, whose content was checked and written to LOCAL (or to
/// standard output for `-`, escaped on a terminal like `exec`'s output).
///
/// # Errors
///
/// [`Failure`] for vmhostd's refusal, content that does not match its sha256, or a failed
/// write (LOCAL is then unchanged).
pub fn pull(client: &mut vmhost::client::Client, args: &PullArgs) -> Result<Value, Failure> {
    let mut params = json!({"name": args.name, "path": args.guest_path});
    if let Some(n) = args.max_bytes {
        params["max_bytes"] = json!(n);
    }
    let answer: Value = client.call("vm.file_pull", params)?;
    let bytes = check_pulled(&answer)?;
    if args.local.as_os_str() == "-" {
        let mut out = super::exec::Output::new(io::stdout(), io::stdout().is_terminal());
        out.write(&bytes).and_then(|()| out.finish()).map_err(|e| Failure::Usage(format!("stdout: {e}")))?;
    } else {
        write_atomically(&args.local, &bytes)?;
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Push {
        #[command(flatten)]
        args: PushArgs,
    }

    fn push_args(argv: &[&str]) -> PushArgs {
        Push::try_parse_from(std::iter::once("push").chain(argv.iter().copied())).unwrap().args
    }

    #[test]
    fn push_sends_content_with_its_sha256_or_names_a_source() {
        let args = push_args(&["vm1", "local.txt", "/etc/motd", "--mode", "0600", "--owner", "app:app", "--mkdir"]);
        let p = push_params(&args, Some(b"hello")).unwrap();
        assert_eq!(
            p,
            json!({"name": "vm1", "path": "/etc/motd", "mkdir": true, "mode": 0o600, "owner": "app:app",
                   "content": "aGVsbG8=",
                   "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"})
        );
        let args = push_args(&["vm1", "/opt/big.iso", "--source", "isos/big.iso"]);
        let p = push_params(&args, None).unwrap();
        assert_eq!(p, json!({"name": "vm1", "path": "/opt/big.iso", "mkdir": false, "source": "isos/big.iso"}));
        let both = push_args(&["vm1", "a", "/b", "--source", "c"]);
        assert!(matches!(push_params(&both, None), Err(Failure::Usage(_))));
        let neither = push_args(&["vm1", "/b"]);
        assert!(matches!(push_params(&neither, None), Err(Failure::Usage(_))));
    }

    #[test]
    fn modes_are_octal_and_bounded() {
        assert_eq!(parse_mode("0644").ok(), Some(0o644));
        assert_eq!(parse_mode("755").ok(), Some(0o755));
        assert_eq!(parse_mode("0o4755").ok(), Some(0o4755));
        for bad in ["", "0o", "888", "17777", "-1", "rw-r--r--"] {
            assert!(parse_mode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_inline_push_is_refused_above_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big");
        std::fs::write(&path, vec![0u8; MAX_INLINE + 1]).unwrap();
        match read_local(path.to_str().unwrap()) {
            Err(Failure::Usage(m)) => assert!(m.contains("--source"), "{m}"),
            _ => panic!("accepted"),
        }
        std::fs::write(&path, vec![7u8; MAX_INLINE]).unwrap();
        assert_eq!(read_local(path.to_str().unwrap()).ok().map(|b| b.len()), Some(MAX_INLINE));
    }

    #[test]
    fn pulled_content_must_match_its_size_and_sha256() {
        let good =
            json!({"path": "/x", "size": 5, "sha256": sha256_hex(b"hello"), "mode": 0o4755, "content": "aGVsbG8="});
        assert_eq!(check_pulled(&good).ok().as_deref(), Some(&b"hello"[..]));
        let mut lying = good.clone();
        lying["sha256"] = json!(sha256_hex(b"other"));
        assert!(check_pulled(&lying).is_err());
        let mut short = good.clone();
        short["size"] = json!(6);
        assert!(check_pulled(&short).is_err());
        let mut garbled = good;
        garbled["content"] = json!("aGVsbG8");
        assert!(check_pulled(&garbled).is_err());
    }

    #[test]
    fn a_pulled_file_replaces_local_whole_with_a_local_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        std::fs::write(&path, b"old").unwrap();
        write_atomically(&path, b"new content").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new content");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode & 0o7000, 0, "no set-id or sticky bit, whatever the guest's mode: {mode:o}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "no temp file left: {names:?}");
        assert!(write_atomically(dir.path(), b"x").is_err(), "a directory is refused");
    }
}
