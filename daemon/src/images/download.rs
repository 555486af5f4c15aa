//! Fetching an image from an `http(s)` URL without HTTP or TLS in the daemon: curl, run by the
//! spawner as `qemu.user` (never root), writes the body to a pipe the daemon hashes into the
//! import's temp file ([`super::Temp`]).
//!
//! **Where a download may go** is the daemon's decision, not curl's: the daemon resolves the
//! URL's host itself ([`Resolve`]), checks every address against `[images] allow_private`
//! ([`super::address`]: no loopback, private, link-local, unique-local, ... address by
//! default) and pins curl's connection to the checked address (`resolve` and a catch-all
//! `connect-to` in curl's config, so even a URL curl read differently could reach no other
//! address). curl follows no redirect: it reports the status and the `Location` it got, and
//! the daemon checks that URL the same way before it runs curl again for it, at most
//! [`MAX_REDIRECTS`] times. A refused address is 2001 on `source` before anything is fetched
//! from it.
//!
//! **The URL is a secret** (a signed URL's token): it reaches curl on stdin as its config
//! (`-K -`), never in argv where `ps` shows it, and the daemon records, logs and reports only
//! [`super::url::SourceUrl::redacted`]. The spawner runs curl with exactly the arguments
//! [`curl_args`] makes and a config [`curl_config`] makes ([`permits`]): no config file but
//! stdin (`-q` first, `-K -`; the fixed options after it override anything a config could
//! set), no URL globbing, http and https only, no redirects, a size limit (90 % of the images
//! directory's free space; the daemon also stops reading there), a time limit. Its Landlock
//! domain lets curl, and only curl, connect to the TCP ports of `images.download_ports`
//! (docs/sandbox.md).

use super::address::{self, AllowPrivate};
use super::url::{self as source_url, Host, SourceUrl};
use super::Temp;
use crate::sandbox::spawn::Command;
use std::future::Future;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Why a download failed. The API codes are given at the boundary (`crate::owner_errors`):
/// 2001 on `source` for a URL or address that is not fetched, 3002 for a body too large, 4001
/// step `download` for the rest; the texts here are the messages users read, and never hold a
/// URL's query string.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The URL's host name does not resolve.
    #[error("{what}: cannot resolve {name}: {source}")]
    Resolve {
        /// The URL (and the one that redirected to it), redacted.
        what: String,
        /// The host name.
        name: String,
        /// The resolver's error.
        #[source]
        source: std::io::Error,
    },
    /// The host name resolves to no address.
    #[error("{what}: {host} has no address")]
    NoAddress {
        /// The URL, redacted.
        what: String,
        /// The host.
        host: String,
    },
    /// The host's address is one `[images] allow_private` refuses; nothing was fetched from it.
    #[error(
        "{what}: {host} is {addr}, {}; a download may not reach it ([images] allow_private); nothing was fetched",
        .class.why()
    )]
    Refused {
        /// The URL, redacted.
        what: String,
        /// The host.
        host: String,
        /// The refused address.
        addr: IpAddr,
        /// Why it is refused.
        class: address::Class,
    },
    /// A redirect leads to a URL that is not fetched.
    #[error("{from} redirects to a URL that is not fetched: {source}")]
    RedirectNotFetched {
        /// The redirecting URL, redacted.
        from: String,
        /// Why the new URL is refused.
        #[source]
        source: source_url::UrlError,
    },
    /// The URL cannot be written into curl's config.
    #[error("the URL cannot be passed to curl")]
    NotForCurl,
    /// The body is larger than the images directory can take.
    #[error("the image at {shown} is larger than the {max_bytes} bytes the images directory can take")]
    TooLarge {
        /// The URL, redacted.
        shown: String,
        /// The most it could take.
        max_bytes: u64,
    },
    /// The download ran out of time.
    #[error("the download took longer than {0} s")]
    TimedOut(u64),
    /// More than [`MAX_REDIRECTS`] redirects (the last URL, redacted, when known).
    #[error("{}more than {MAX_REDIRECTS} redirects", .0.as_ref().map(|u| format!("{u}: ")).unwrap_or_default())]
    TooManyRedirects(Option<String>),
    /// The temp file cannot be written.
    #[error("cannot write the downloaded image: {0}")]
    Write(#[source] std::io::Error),
    /// curl cannot be started.
    #[error("cannot run {} to fetch the image: {source} (install curl)", .curl.display())]
    Spawn {
        /// The curl binary.
        curl: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// curl started without the pipes it was asked for.
    #[error("curl started without its pipes")]
    NoPipes,
    /// Waiting for curl failed.
    #[error("cannot wait for curl: {0}")]
    Wait(#[source] std::io::Error),
    /// curl failed (an HTTP error, no connection).
    #[error("curl could not fetch {shown}: {message} ({status})")]
    Curl {
        /// The URL, redacted.
        shown: String,
        /// curl's message, redacted.
        message: String,
        /// curl's exit status.
        status: std::process::ExitStatus,
    },
    /// The server answered neither a body nor a redirect.
    #[error("{shown} answered HTTP {code}, neither an image nor a redirect")]
    Status {
        /// The URL, redacted.
        shown: String,
        /// The HTTP status.
        code: u16,
    },
    /// curl's report has no HTTP status.
    #[error("curl reported no HTTP status for {shown}: {message}")]
    NoStatus {
        /// The URL, redacted.
        shown: String,
        /// curl's message, redacted.
        message: String,
    },
}

/// Most redirects followed (each checked as the first URL was).
pub const MAX_REDIRECTS: usize = 5;

/// What starts the line curl's `--write-out` adds to its stderr: the status and redirect.
const REPORT: &str = "vmhost-response ";

/// `--write-out`: after the transfer, one line on stderr (stdout is the body).
const WRITE_OUT: &str = "%{stderr}\nvmhost-response %{response_code} %{redirect_url}\n";

/// curl's arguments before the size and time limits: no config file but stdin (`-q` must come
/// first), then options that override whatever a config set: no URL globbing (`[1-9]` in a URL
/// is not a list of URLs), http(s) only, no redirect followed, the status on stderr.
const FIXED: [&str; 15] = [
    "-q",
    "-K",
    "-",
    "--silent",
    "--show-error",
    "--fail",
    "--globoff",
    "--no-location",
    "--max-redirs",
    "0",
    "--proto",
    "=http,https",
    "--no-progress-meter",
    "--write-out",
    WRITE_OUT,
];

/// The arguments curl runs with to fetch within `timeout`, refusing a body larger than
/// `max_bytes` (when the server announces its length; the daemon counts too). The URL is not
/// among them: it is in [`curl_config`], on stdin.
pub fn curl_args(timeout: Duration, max_bytes: u64) -> Vec<String> {
    let mut args: Vec<String> = FIXED.iter().map(|a| a.to_string()).collect();
    args.extend(["--max-filesize".into(), max_bytes.max(1).to_string()]);
    args.extend(["--max-time".into(), timeout.as_secs().max(1).to_string()]);
    args
}

/// Where one request of a download goes: a checked URL and the checked address its
/// connection is pinned to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    /// The URL.
    pub url: SourceUrl,
    /// The address curl connects to.
    pub addr: IpAddr,
}

/// curl's config for `hop` (read from stdin): the URL, its name pinned to the checked address
/// (`resolve`), and every connection of the run sent there (`connect-to` with any host and
/// port). `None` when a value cannot be quoted (never for a parsed URL).
pub fn curl_config(hop: &Hop) -> Option<String> {
    let addr = match hop.addr {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    };
    let port = hop.url.port();
    let mut lines = vec![format!("url = {}", source_url::quote(&hop.url.for_curl())?)];
    if let Host::Name(name) = hop.url.host() {
        lines.push(format!("resolve = {}", source_url::quote(&format!("{name}:{port}:{addr}"))?));
    }
    lines.push(format!("connect-to = {}", source_url::quote(&format!("::{addr}:{port}"))?));
    Some(lines.join("\n") + "\n")
}

/// Whether `args` and `stdin` are what [`curl_args`] and [`curl_config`] make: the fixed
/// arguments, a number of bytes and of seconds; a config of one http(s) `url`, at most one
/// `resolve` and one `connect-to` to an address, nothing else.
pub fn permits(args: &[String], stdin: Option<&str>) -> bool {
    let n = FIXED.len();
    let number = |a: &String| !a.is_empty() && a.len() <= 20 && a.bytes().all(|b| b.is_ascii_digit());
    let args_ok = args.len() == n + 4
        && args[..n].iter().zip(FIXED).all(|(a, f)| a == f)
        && args[n] == "--max-filesize"
        && number(&args[n + 1])
        && args[n + 2] == "--max-time"
        && number(&args[n + 3]);
    args_ok && stdin.is_some_and(config_permitted)
}

/// The config check of [`permits`].
fn config_permitted(config: &str) -> bool {
    let Some(body) = config.strip_suffix('\n') else { return false };
    let mut seen = (0, 0, 0);
    for line in body.split('\n') {
        let Some((key, value)) = line.split_once(" = ") else { return false };
        let Some(value) = source_url::unquote(value) else { return false };
        let ok = match key {
            "url" => {
                seen.0 += 1;
                source_url::parse(&value).is_ok_and(|u| u.for_curl() == value)
            }
            "resolve" => {
                seen.1 += 1;
                value.split_once(':').and_then(|(_, r)| r.split_once(':')).is_some_and(|(_, a)| pinned_addr(a))
            }
            "connect-to" => {
                seen.2 += 1;
                value.strip_prefix("::").and_then(|r| r.rsplit_once(':')).is_some_and(|(a, _)| pinned_addr(a))
            }
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    seen.0 == 1 && seen.1 <= 1 && seen.2 == 1
}

/// An address as [`curl_config`] writes it (IPv6 in brackets).
fn pinned_addr(a: &str) -> bool {
    a.parse::<std::net::Ipv4Addr>().is_ok()
        || a.strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .is_some_and(|v6| v6.parse::<std::net::Ipv6Addr>().is_ok())
}

/// Name resolution, the one thing of a download's check that is not pure.
pub trait Resolve: Sync {
    /// The addresses of `host` (a name) for `port`.
    fn lookup(&self, host: &str, port: u16) -> impl Future<Output = std::io::Result<Vec<IpAddr>>> + Send;
}

/// The host's resolver (getaddrinfo: `/etc/hosts`, DNS as `/etc/nsswitch.conf` says).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemResolver;

impl Resolve for SystemResolver {
    async fn lookup(&self, host: &str, port: u16) -> std::io::Result<Vec<IpAddr>> {
        Ok(tokio::net::lookup_host((host, port)).await?.map(|a| a.ip()).collect())
    }
}

/// The address `addrs` pins a download to: the first, when every one is allowed under
/// `policy`. A name with any address it may not reach is refused as a whole: it points into a
/// network it should not.
///
/// # Errors
/// The first refused address and its class.
pub fn pin(addrs: &[IpAddr], policy: &AllowPrivate) -> Result<Option<IpAddr>, (IpAddr, address::Class)> {
    for a in addrs {
        address::check(*a, policy).map_err(|class| (*a, class))?;
    }
    Ok(addrs.first().copied())
}

/// Resolves and checks `url` (reached by a redirect from `from`, when given).
///
/// # Errors
/// [`DownloadError::Refused`] naming the address and why when an address is refused;
/// [`DownloadError::Resolve`] or [`DownloadError::NoAddress`] when the name does not resolve.
pub async fn check_hop<R: Resolve>(
    url: SourceUrl,
    policy: &AllowPrivate,
    resolver: &R,
    from: Option<&SourceUrl>,
) -> Result<Hop, DownloadError> {
    let what = match from {
        Some(f) => format!("{} redirects to {}", f.redacted(), url.redacted()),
        None => url.redacted(),
    };
    let addrs = match url.host() {
        Host::Ip(ip) => vec![*ip],
        Host::Name(name) => resolver.lookup(name, url.port()).await.map_err(|source| DownloadError::Resolve {
            what: what.clone(),
            name: name.clone(),
            source,
        })?,
    };
    match pin(&addrs, policy) {
        Ok(Some(addr)) => Ok(Hop { url, addr }),
        Ok(None) => Err(DownloadError::NoAddress { what, host: url.host_text() }),
        Err((addr, class)) => Err(DownloadError::Refused { what, host: url.host_text(), addr, class }),
    }
}

/// What one curl run got.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// A 2xx body, in the temp file.
    Body,
    /// A redirect to this URL (not followed).
    Redirect(String),
}

/// Splits curl's stderr into its message and the `--write-out` report (status, redirect URL).
fn split_report(stderr: &str) -> (String, Option<(u16, String)>) {
    let mut report = None;
    let mut message = Vec::new();
    for line in stderr.lines() {
        match line.strip_prefix(REPORT) {
            Some(r) => {
                let (code, url) = r.split_once(' ').unwrap_or((r, ""));
                report = code.parse().ok().map(|c| (c, url.trim().to_string()));
            }
            None if !line.trim().is_empty() => message.push(line.trim()),
            None => {}
        }
    }
    (message.join(" "), report)
}

/// Downloads `first` (checked by [`check_hop`]) into `temp` with `curl` as `user` within
/// `timeout`, at most `max_bytes`, following at most [`MAX_REDIRECTS`] redirects, each checked
/// by [`check_hop`] under `policy` before it is fetched.
///
/// # Errors
/// [`DownloadError::RedirectNotFetched`] when a redirect leads to a URL that is not fetched
/// (another scheme, user information), [`DownloadError::Refused`] to an address `policy`
/// refuses (both 2001); [`DownloadError::TooLarge`] (3002) when the body is larger than
/// `max_bytes`; the other variants (4001) with curl's message (the query string redacted) when
/// it cannot be started, fails (an HTTP error, no connection), there are too many redirects,
/// or it runs out of time, or when the temp file cannot be written.
#[allow(clippy::too_many_arguments)]
pub async fn fetch<R: Resolve>(
    curl: &Path,
    user: Option<crate::config::UserIds>,
    first: Hop,
    policy: &AllowPrivate,
    resolver: &R,
    timeout: Duration,
    max_bytes: u64,
    temp: &mut Temp,
) -> Result<(), DownloadError> {
    let deadline = Instant::now() + timeout;
    let mut hop = first;
    for redirects in 0..=MAX_REDIRECTS {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(DownloadError::TimedOut(timeout.as_secs()));
        }
        // A redirect's body (the first hop's, say) is not the image.
        crate::blocking::run(|| temp.reset()).map_err(DownloadError::Write)?;
        match run_curl(curl, user, &hop, left, max_bytes, temp).await? {
            Outcome::Body => return Ok(()),
            Outcome::Redirect(next) => {
                if redirects == MAX_REDIRECTS {
                    return Err(DownloadError::TooManyRedirects(Some(hop.url.redacted())));
                }
                let url = source_url::parse(&next)
                    .map_err(|source| DownloadError::RedirectNotFetched { from: hop.url.redacted(), source })?;
                tracing::debug!(from = %hop.url.redacted(), to = %url.redacted(), "download redirected");
                hop = check_hop(url, policy, resolver, Some(&hop.url)).await?;
            }
        }
    }
    Err(DownloadError::TooManyRedirects(None))
}

/// One curl run for `hop`: the body into `temp`, or the redirect it got.
async fn run_curl(
    curl: &Path,
    user: Option<crate::config::UserIds>,
    hop: &Hop,
    timeout: Duration,
    max_bytes: u64,
    temp: &mut Temp,
) -> Result<Outcome, DownloadError> {
    let shown = hop.url.redacted();
    let too_large = || DownloadError::TooLarge { shown: shown.clone(), max_bytes };
    let config = curl_config(hop).ok_or(DownloadError::NotForCurl)?;
    let mut child = Command::new(curl)
        .args(curl_args(timeout, max_bytes))
        .stdin_data(config)
        .user(user)
        .capture_stdout()
        .capture_stderr()
        .spawn()
        .await
        .map_err(|source| DownloadError::Spawn { curl: curl.to_path_buf(), source })?;
    let (Some(mut out), Some(mut err)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(DownloadError::NoPipes);
    };
    let stderr = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = (&mut err).take(64 * 1024).read_to_end(&mut text).await;
        String::from_utf8_lossy(&text).to_string()
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
        Ok(Ok(true)) => child.wait().await.map_err(DownloadError::Wait)?,
        // curl is killed when `child` drops.
        Ok(Ok(false)) => return Err(too_large()),
        Ok(Err(e)) => return Err(DownloadError::Write(e)),
        Err(_) => return Err(DownloadError::TimedOut(timeout.as_secs())),
    };
    let (message, report) = split_report(&stderr.await.unwrap_or_default());
    let message = hop.url.scrub(&message);
    if status.code() == Some(63) {
        // CURLE_FILESIZE_EXCEEDED: the announced length is over --max-filesize.
        return Err(too_large());
    }
    if !status.success() {
        return Err(DownloadError::Curl { shown, message, status });
    }
    match report {
        Some((200..=299, _)) => Ok(Outcome::Body),
        Some((300..=399, next)) if !next.is_empty() => Ok(Outcome::Redirect(next)),
        Some((code, _)) => Err(DownloadError::Status { shown, code }),
        None => Err(DownloadError::NoStatus { shown, message }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ApiError;

    /// The hop check as a client sees it: through the boundary's mapping.
    async fn check_hop<R: Resolve>(
        url: SourceUrl,
        policy: &AllowPrivate,
        resolver: &R,
        from: Option<&SourceUrl>,
    ) -> Result<Hop, ApiError> {
        super::check_hop(url, policy, resolver, from).await.map_err(ApiError::from)
    }

    fn hop(url: &str, addr: &str) -> Hop {
        Hop { url: source_url::parse(url).unwrap(), addr: addr.parse().unwrap() }
    }

    #[test]
    fn only_the_arguments_and_config_it_makes_are_permitted() {
        let args = curl_args(Duration::from_secs(30), 1 << 30);
        let h = hop("https://example.org/a.qcow2?token=s3cr3t", "93.184.216.34");
        let config = curl_config(&h).unwrap();
        assert_eq!(
            config,
            "url = \"https://example.org/a.qcow2?token=s3cr3t\"\nresolve = \"example.org:443:93.184.216.34\"\n\
             connect-to = \"::93.184.216.34:443\"\n"
        );
        assert!(permits(&args, Some(&config)));
        assert!(!args.iter().any(|a| a.contains("example.org") || a.contains("s3cr3t")), "no URL in argv");
        let v6 = curl_config(&hop("http://[2001:db8::1]:8080/x", "2001:db8::1")).unwrap();
        assert_eq!(v6, "url = \"http://[2001:db8::1]:8080/x\"\nconnect-to = \"::[2001:db8::1]:8080\"\n");
        assert!(permits(&curl_args(Duration::from_secs(1), 5), Some(&v6)));
        assert!(args.contains(&"--globoff".to_string()), "a URL is one URL");
        assert_eq!(&args[..3], ["-q", "-K", "-"], "no config file but stdin, read before the fixed options");

        assert!(!permits(&args, None), "a config is needed");
        let mut option = args.clone();
        option.insert(3, "-K".into());
        option.insert(4, "/etc/shadow".into());
        assert!(!permits(&option, Some(&config)), "-K reads stdin only");
        let mut file = args.clone();
        file[2] = "/etc/vmhost/vmhostd.toml".into();
        assert!(!permits(&file, Some(&config)));
        let mut output = args.clone();
        output[3] = "--output".into();
        assert!(!permits(&output, Some(&config)), "the fixed arguments are fixed");
        let mut url = args.clone();
        url.push("https://example.org/b".into());
        assert!(!permits(&url, Some(&config)), "no URL in argv");
        let mut time = args.clone();
        time[FIXED.len() + 3] = "-1".into();
        assert!(!permits(&time, Some(&config)));
        let mut size = args.clone();
        size[FIXED.len() + 1] = "1e9".into();
        assert!(!permits(&size, Some(&config)));

        let pin = "connect-to = \"::1.2.3.4:80\"\n";
        for bad in [
            String::new(),
            "url = \"https://example.org/\"".into(),
            format!("url = \"file:///etc/shadow\"\n{pin}"),
            format!("url = \"https://u:p@example.org/\"\n{pin}"),
            format!("url = \"https://example.org/\"\nurl = \"https://example.org/\"\n{pin}"),
            format!("url = \"https://example.org/\"\noutput = \"/tmp/x\"\n{pin}"),
            format!("url = \"https://example.org/\"\nupload-file = \"/etc/shadow\"\n{pin}"),
            format!("url = \"https://example.org/\"\nlocation\n{pin}"),
            "url = \"https://example.org/\"\nconnect-to = \"::example.org:80\"\n".into(),
            "url = \"https://example.org/\"\nconnect-to = \"evil:80:1.2.3.4:80\"\n".into(),
            format!("url = \"https://example.org/\"\nresolve = \"a:80:evil.org\"\n{pin}"),
            format!("url = \"https://example.org/\" \n{pin}"),
            format!("url = https://example.org/\n{pin}"),
            format!("url = \"https://example.org/#f\"\n{pin}"),
            format!("{pin}{pin}url = \"https://example.org/\"\n"),
        ] {
            assert!(!permits(&args, Some(&bad)), "{bad:?}");
        }
        assert!(permits(&args, Some(&format!("url = \"https://example.org/\"\n{pin}"))));
    }

    #[test]
    fn a_name_is_pinned_only_when_every_address_is_allowed() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let no = AllowPrivate::No;
        assert_eq!(pin(&[ip("93.184.216.34"), ip("2606:2800::1")], &no), Ok(Some(ip("93.184.216.34"))));
        assert_eq!(pin(&[], &no), Ok(None));
        assert_eq!(pin(&[ip("93.184.216.34"), ip("127.0.0.1")], &no), Err((ip("127.0.0.1"), address::Class::Loopback)));
        assert_eq!(pin(&[ip("127.0.0.1")], &AllowPrivate::All), Ok(Some(ip("127.0.0.1"))));
    }

    /// A resolver answering from a table.
    struct Table(Vec<(&'static str, &'static str)>);

    impl Resolve for Table {
        async fn lookup(&self, host: &str, _port: u16) -> std::io::Result<Vec<IpAddr>> {
            let found: Vec<IpAddr> =
                self.0.iter().filter(|(h, _)| *h == host).map(|(_, a)| a.parse().unwrap()).collect();
            if found.is_empty() {
                Err(std::io::Error::new(std::io::ErrorKind::NotFound, "no such name"))
            } else {
                Ok(found)
            }
        }
    }

    #[tokio::test]
    async fn a_hop_is_checked_by_the_addresses_its_host_resolves_to() {
        let dns = Table(vec![("images.example.com", "93.184.216.34"), ("internal.example.com", "10.1.2.3")]);
        let url = |s: &str| source_url::parse(s).unwrap();
        let h = check_hop(url("https://images.example.com/i?t=s3cr3t"), &AllowPrivate::No, &dns, None).await.unwrap();
        assert_eq!(h.addr, "93.184.216.34".parse::<IpAddr>().unwrap());
        let e =
            check_hop(url("https://internal.example.com/i?t=s3cr3t"), &AllowPrivate::No, &dns, None).await.unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (crate::api::Code::InvalidSpec, Some("source")));
        assert!(e.message.contains("10.1.2.3") && e.message.contains("private"), "{}", e.message);
        assert!(!e.message.contains("s3cr3t"), "{}", e.message);
        let from = url("https://images.example.com/i?t=s3cr3t");
        let e = check_hop(url("http://127.0.0.1:8080/x?k=v"), &AllowPrivate::No, &dns, Some(&from)).await.unwrap_err();
        assert!(
            e.message.contains("redirects to http://127.0.0.1:8080/x?REDACTED") && e.message.contains("loopback"),
            "{}",
            e.message
        );
        let e = check_hop(url("https://nowhere.example.com/"), &AllowPrivate::No, &dns, None).await.unwrap_err();
        assert_eq!((e.code, e.details["step"].as_str()), (crate::api::Code::ProvisioningFailed, Some("download")));
        let ok = check_hop(url("https://internal.example.com/i"), &AllowPrivate::All, &dns, None).await.unwrap();
        assert_eq!(ok.addr, "10.1.2.3".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn curls_report_is_split_from_its_message() {
        let (m, r) = split_report("curl: (22) The requested URL returned error: 404\n\nvmhost-response 404 \n");
        assert_eq!((m.as_str(), r), ("curl: (22) The requested URL returned error: 404", Some((404, String::new()))));
        let (m, r) = split_report("\nvmhost-response 301 http://a.org/b/?x=1\n");
        assert_eq!((m.as_str(), r), ("", Some((301, "http://a.org/b/?x=1".into()))));
        assert_eq!(split_report("curl: (7) Failed to connect\n").1, None);
    }
}
