//! Fetching an image from an `http(s)` URL without HTTP or TLS in the daemon: curl, run by the
//! spawner as `qemu.user` (never root), writes the body to a pipe the daemon hashes into the
//! import's temp file ([`super::Temp`]).
//!
//! The spawner runs curl with exactly the arguments [`curl_args`] makes and nothing else
//! ([`permits`]): no config file (`-q`), no URL globbing, http and https only, also after a
//! redirect, at most 5 redirects, a size limit (90 % of the images directory's free space; the
//! daemon also stops reading there), a total time limit, the URL after `--`. Its Landlock domain lets curl, and only
//! curl, connect to the TCP ports of `images.download_ports` (docs/sandbox.md).

use super::Temp;
use crate::api::ApiError;
use crate::sandbox::spawn::Command;
use serde_json::json;
use std::path::Path;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// curl's arguments before the size and time limits: no config file, no URL globbing (`[1-9]`
/// in a URL is not a list of URLs), http(s) only, also after a redirect.
const FIXED: [&str; 13] = [
    "-q",
    "--silent",
    "--show-error",
    "--fail",
    "--globoff",
    "--location",
    "--max-redirs",
    "5",
    "--proto",
    "=http,https",
    "--proto-redir",
    "=http,https",
    "--no-progress-meter",
];

/// The arguments curl runs with to fetch `url` within `timeout`, refusing a body larger than
/// `max_bytes` (when the server announces its length; the daemon counts too).
pub fn curl_args(url: &str, timeout: Duration, max_bytes: u64) -> Vec<String> {
    let mut args: Vec<String> = FIXED.iter().map(|a| a.to_string()).collect();
    args.extend(["--max-filesize".into(), max_bytes.max(1).to_string()]);
    args.extend(["--max-time".into(), timeout.as_secs().max(1).to_string()]);
    args.push("--".into());
    args.push(url.into());
    args
}

/// Whether `args` are arguments [`curl_args`] makes: the fixed ones, a number of bytes and of
/// seconds, `--` and one http(s) URL.
pub fn permits(args: &[String]) -> bool {
    let n = FIXED.len();
    let number = |a: &String| !a.is_empty() && a.len() <= 20 && a.bytes().all(|b| b.is_ascii_digit());
    args.len() == n + 6
        && args[..n].iter().zip(FIXED).all(|(a, f)| a == f)
        && args[n] == "--max-filesize"
        && number(&args[n + 1])
        && args[n + 2] == "--max-time"
        && number(&args[n + 3])
        && args[n + 4] == "--"
        && (args[n + 5].starts_with("http://") || args[n + 5].starts_with("https://"))
}

fn failed(message: String) -> ApiError {
    ApiError::new(crate::api::Code::ProvisioningFailed, message).field("source").details(json!({ "step": "download" }))
}

/// Downloads `url` into `temp` with `curl` as `user` within `timeout`, at most `max_bytes`.
///
/// # Errors
/// 4001 step `download` with curl's message when it cannot be started, fails (an HTTP error,
/// no connection, a refused redirect) or runs out of time, or when the temp file cannot be
/// written; 3002 on `source` when the body is larger than `max_bytes`.
pub async fn fetch(
    curl: &Path,
    user: Option<crate::config::UserIds>,
    url: &str,
    timeout: Duration,
    max_bytes: u64,
    temp: &mut Temp,
) -> Result<(), ApiError> {
    let too_large = || {
        ApiError::new(
            crate::api::Code::CapacityExceeded,
            format!("the image at {url} is larger than the {max_bytes} bytes the images directory can take"),
        )
        .field("source")
        .details(json!({ "resource": "image_bytes", "available": max_bytes }))
    };
    let mut child = Command::new(curl)
        .args(curl_args(url, timeout, max_bytes))
        .user(user)
        .capture_stdout()
        .capture_stderr()
        .spawn()
        .await
        .map_err(|e| failed(format!("cannot run {} to fetch the image: {e} (install curl)", curl.display())))?;
    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(failed("curl started without its pipes".into()));
    };
    let stderr = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = (&mut err).take(64 * 1024).read_to_end(&mut text).await;
        String::from_utf8_lossy(&text).trim().to_string()
    });
    // curl's own --max-time ends it; this bound is for a curl that hangs anyway.
    let body = tokio::time::timeout(timeout + Duration::from_secs(10), async {
        let mut buf = vec![0u8; super::temp::BLOCK];
        loop {
            let mut n = 0;
            while n < buf.len() {
                match out.read(&mut buf[n..]).await? {
                    0 => break,
                    k => n += k,
                }
            }
            if n == 0 {
                return Ok::<bool, std::io::Error>(true);
            }
            if temp.bytes() + n as u64 > max_bytes {
                return Ok(false);
            }
            crate::blocking::run(|| temp.write(&buf[..n]))?;
        }
    })
    .await;
    let status = match body {
        Ok(Ok(true)) => child.wait().await.map_err(|e| failed(format!("cannot wait for curl: {e}")))?,
        // curl is killed when `child` drops.
        Ok(Ok(false)) => return Err(too_large()),
        Ok(Err(e)) => return Err(failed(format!("cannot write the downloaded image: {e}"))),
        Err(_) => return Err(failed(format!("the download took longer than {} s", timeout.as_secs()))),
    };
    let message = stderr.await.unwrap_or_default();
    if status.code() == Some(63) {
        // CURLE_FILESIZE_EXCEEDED: the announced length is over --max-filesize.
        return Err(too_large());
    }
    if !status.success() {
        return Err(failed(format!("curl could not fetch {url}: {message} ({status})")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_arguments_it_makes_are_permitted() {
        let args = curl_args("https://example.org/a.qcow2", Duration::from_secs(30), 1 << 30);
        assert!(permits(&args));
        assert!(permits(&curl_args("http://127.0.0.1:8080/x", Duration::from_secs(1), 5)));
        assert!(args.contains(&"--globoff".to_string()), "a URL is one URL");
        let mut file = args.clone();
        file[FIXED.len() + 5] = "file:///etc/shadow".into();
        assert!(!permits(&file), "only http(s)");
        let mut option = args.clone();
        option.insert(0, "-K".into());
        assert!(!permits(&option), "no extra option");
        let mut output = args.clone();
        output[3] = "--output".into();
        assert!(!permits(&output), "the fixed arguments are fixed");
        let mut two = args.clone();
        two.push("https://example.org/b".into());
        assert!(!permits(&two), "one URL");
        let mut time = args.clone();
        time[FIXED.len() + 3] = "-1".into();
        assert!(!permits(&time));
        let mut size = args;
        size[FIXED.len() + 1] = "1e9".into();
        assert!(!permits(&size));
    }
}
