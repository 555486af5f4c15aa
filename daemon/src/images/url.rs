//! The http(s) URLs `image.import` fetches.
//!
//! The daemon checks where a URL leads before curl fetches it ([`super::download`]), so what
//! the daemon parses must be what curl fetches: [`parse`] accepts a strict subset (ASCII
//! only, no user info, a host that is a DNS name or an IP address written one way) and curl
//! gets the URL as [`SourceUrl::for_curl`] writes it again, on stdin in its config syntax
//! ([`quote`]), never in argv. What is recorded, logged or put in an error message is
//! [`SourceUrl::redacted`]: the query string (a signed URL's token) is `?REDACTED` and the
//! fragment is dropped.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Longest URL accepted.
pub const MAX_URL: usize = 2048;

/// What a redacted query string reads.
pub const REDACTED: &str = "REDACTED";

/// The host of a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A DNS name, lower case.
    Name(String),
    /// An IP address literal.
    Ip(IpAddr),
}

/// A checked http(s) URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceUrl {
    https: bool,
    host: Host,
    /// Written in the URL (`None`: the scheme's).
    port: Option<u16>,
    /// Starts with `/`.
    path: String,
    /// Without the `?`; `None` when there is no `?`.
    query: Option<String>,
}

/// Why a URL is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UrlError {
    /// `user:password@` before the host.
    UserInfo,
    /// Anything else; the message never repeats the URL (it may hold a secret).
    Invalid(&'static str),
}

impl std::fmt::Display for UrlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UrlError::UserInfo => f.write_str(
                "a URL with user information (user:password@) is refused: a password in a URL ends up in logs \
                 and records; use a URL with a token in its query string, or a file in the import directory",
            ),
            UrlError::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for UrlError {}

/// Parses an `http://` or `https://` URL (module doc).
///
/// # Errors
/// [`UrlError::UserInfo`] for `user@host`; [`UrlError::Invalid`] for another scheme, more
/// than [`MAX_URL`] characters, a character that is not printable ASCII or is `"` or `\`
/// (percent-encode it), an empty or malformed host, a host that is a number but no
/// dotted-quad IPv4 address, an IPv6 zone, a port outside 1-65535.
pub fn parse(s: &str) -> Result<SourceUrl, UrlError> {
    if s.len() > MAX_URL {
        return Err(UrlError::Invalid("a URL of at most 2048 characters"));
    }
    if !s.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\') {
        return Err(UrlError::Invalid(
            "a URL of printable ASCII characters without spaces, quotes or backslashes (percent-encode others)",
        ));
    }
    let (https, rest) = if let Some(r) = s.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = s.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(UrlError::Invalid("only http:// and https:// URLs are fetched"));
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if authority.contains('@') {
        return Err(UrlError::UserInfo);
    }
    let (host, port) = host_and_port(authority)?;
    let tail = tail.split_once('#').map_or(tail, |(t, _)| t);
    let (path, query) = match tail.split_once('?') {
        Some((p, q)) => (p, Some(q.to_string())),
        None => (tail, None),
    };
    let path = if path.is_empty() { "/".to_string() } else { path.to_string() };
    Ok(SourceUrl { https, host, port, path, query })
}

fn host_and_port(authority: &str) -> Result<(Host, Option<u16>), UrlError> {
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (addr, after) = v6.split_once(']').ok_or(UrlError::Invalid("an IPv6 address without its ]"))?;
        let ip: Ipv6Addr = addr.parse().map_err(|_| UrlError::Invalid("a malformed IPv6 address (no zone ids)"))?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or(UrlError::Invalid("a malformed host"))?),
        };
        (Host::Ip(IpAddr::V6(ip)), port)
    } else {
        let (name, port) = match authority.split_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (authority, None),
        };
        (name_host(name)?, port)
    };
    let port = match port {
        None => None,
        Some(p) => {
            let ok = !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit());
            match p.parse::<u16>() {
                Ok(n) if ok && n > 0 => Some(n),
                _ => return Err(UrlError::Invalid("a port of 1-65535")),
            }
        }
    };
    Ok((host, port))
}

/// A host that is not in brackets: a dotted-quad IPv4 address, or a DNS name.
fn name_host(name: &str) -> Result<Host, UrlError> {
    if name.is_empty() {
        return Err(UrlError::Invalid("a URL without a host"));
    }
    if let Ok(v4) = name.parse::<Ipv4Addr>() {
        return Ok(Host::Ip(IpAddr::V4(v4)));
    }
    let labels: Vec<&str> = name.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if name.len() > 253 || !labels.iter().all(label_ok) {
        return Err(UrlError::Invalid(
            "a host that is a DNS name (letters, digits, - and _ between dots; an internationalised name in its \
             xn-- form) or an IP address",
        ));
    }
    // curl, browsers and inet_aton read `2130706433`, `0x7f.1` or `127.1` as IPv4 addresses:
    // a name is never numeric in its last label, so no reader takes it for an address.
    let last = labels.last().copied().unwrap_or_default().to_ascii_lowercase();
    if last.bytes().all(|b| b.is_ascii_digit())
        || (last.starts_with("0x") && last[2..].bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(UrlError::Invalid("an IPv4 address in dotted-quad form (a.b.c.d) only"));
    }
    Ok(Host::Name(name.to_ascii_lowercase()))
}

impl SourceUrl {
    /// The host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// The port connected to: the URL's, else 443 or 80.
    pub fn port(&self) -> u16 {
        self.port.unwrap_or(if self.https { 443 } else { 80 })
    }

    /// The host as a URL writes it (an IPv6 address in brackets).
    pub fn host_text(&self) -> String {
        match &self.host {
            Host::Name(n) => n.clone(),
            Host::Ip(IpAddr::V4(a)) => a.to_string(),
            Host::Ip(IpAddr::V6(a)) => format!("[{a}]"),
        }
    }

    fn origin(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        match self.port {
            Some(p) => format!("{scheme}://{}:{p}", self.host_text()),
            None => format!("{scheme}://{}", self.host_text()),
        }
    }

    /// The URL curl fetches: written again from its parts (no fragment: never sent anyway).
    pub fn for_curl(&self) -> String {
        match &self.query {
            Some(q) => format!("{}{}?{q}", self.origin(), self.path),
            None => format!("{}{}", self.origin(), self.path),
        }
    }

    /// The URL as it may be shown, logged and recorded: a query string is `?REDACTED`.
    pub fn redacted(&self) -> String {
        match &self.query {
            Some(q) if !q.is_empty() => format!("{}{}?{REDACTED}", self.origin(), self.path),
            _ => format!("{}{}", self.origin(), self.path),
        }
    }

    /// `text` with the query string replaced wherever it occurs (curl's messages may quote
    /// the URL).
    pub fn scrub(&self, text: &str) -> String {
        match &self.query {
            Some(q) if !q.is_empty() => text.replace(q.as_str(), REDACTED),
            _ => text.to_string(),
        }
    }
}

/// `source` as `image.list` shows it: a URL redacted as [`SourceUrl::redacted`] does (for
/// records written before redaction, and anything that does not parse: cut at `?` and `#`,
/// user information dropped), a path as it is.
pub fn redact_text(source: &str) -> String {
    if !(source.starts_with("http://") || source.starts_with("https://")) {
        return source.to_string();
    }
    if let Ok(u) = parse(source) {
        return u.redacted();
    }
    let (scheme, rest) = source.split_once("://").unwrap_or(("http", source));
    let rest = rest.rsplit_once('@').filter(|(auth, _)| !auth.contains('/')).map_or(rest, |(_, r)| r);
    let cut = rest.find(['?', '#']);
    match cut {
        Some(i) if rest[i..].starts_with('?') => format!("{scheme}://{}?{REDACTED}", &rest[..i]),
        Some(i) => format!("{scheme}://{}", &rest[..i]),
        None => format!("{scheme}://{rest}"),
    }
}

/// `value` as a double-quoted string of curl's config syntax: `\` and `"` escaped. Other
/// characters are taken literally by curl inside quotes; control characters (which curl would
/// read as the end of the line, or as escapes) are refused.
pub fn quote(value: &str) -> Option<String> {
    if value.chars().any(char::is_control) {
        return None;
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        if c == '\\' || c == '"' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Some(out)
}

/// The value a line written with [`quote`] holds, as curl reads it; `None` when the text is
/// not exactly such a string.
pub fn unquote(quoted: &str) -> Option<String> {
    let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                e @ ('\\' | '"') => out.push(e),
                _ => return None,
            },
            '"' => return None,
            c if c.is_control() => return None,
            c => out.push(c),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_parsed_strictly_and_written_again_the_same() {
        let u = parse("https://Images.Example.com:8443/a/b.qcow2?token=s3cr3t&x=1#frag").unwrap();
        assert_eq!(u.host(), &Host::Name("images.example.com".into()));
        assert_eq!(u.port(), 8443);
        assert_eq!(u.for_curl(), "https://images.example.com:8443/a/b.qcow2?token=s3cr3t&x=1");
        assert_eq!(u.redacted(), "https://images.example.com:8443/a/b.qcow2?REDACTED");
        assert_eq!(u.scrub("curl: (22) for /a/b.qcow2?token=s3cr3t&x=1"), "curl: (22) for /a/b.qcow2?REDACTED");
        let plain = parse("http://example.org").unwrap();
        assert_eq!(
            (plain.port(), plain.for_curl(), plain.redacted()),
            (80, "http://example.org/".into(), "http://example.org/".into())
        );
        assert_eq!(parse("https://x.org/?").unwrap().redacted(), "https://x.org/", "an empty query hides nothing");
        let v4 = parse("http://127.0.0.1:8080/i?a").unwrap();
        assert_eq!((v4.host(), v4.port()), (&Host::Ip("127.0.0.1".parse().unwrap()), 8080));
        let v6 = parse("http://[::1]/i").unwrap();
        assert_eq!(
            (v6.host(), v6.port(), v6.for_curl()),
            (&Host::Ip("::1".parse().unwrap()), 80, "http://[::1]/i".into())
        );
        assert_eq!(parse("https://a.b/c#x?y").unwrap().for_curl(), "https://a.b/c", "a ? after # is the fragment's");
    }

    #[test]
    fn user_info_and_anything_ambiguous_is_refused() {
        for s in ["http://u:p@example.org/", "http://u@example.org/", "https://a@b@c/", "http://:@h/"] {
            assert_eq!(parse(s), Err(UrlError::UserInfo), "{s}");
        }
        for s in [
            "ftp://example.org/",
            "file:///etc/passwd",
            "HTTP://example.org/",
            "http://",
            "http:///path",
            "http://exa mple.org/",
            "http://example.org/\u{e9}",
            "http://example.org/a\"b",
            "http://example.org\\@evil.org/",
            "http://example.org:/",
            "http://example.org:0/",
            "http://example.org:65536/",
            "http://example.org:+80/",
            "http://example.org:8a/",
            "http://[::1/",
            "http://[::1]x/",
            "http://[fe80::1%25eth0]/",
            "http://2130706433/",
            "http://0x7f.1/",
            "http://127.1/",
            "http://127.000.000.001/",
            "http://a..b/",
            "http://-a.b/",
            "http://a.b./",
            "http://a.b:1:2/",
            "http://xn--bcher-kva.example\u{0}/",
        ] {
            assert!(matches!(parse(s), Err(UrlError::Invalid(_))), "{s}");
        }
        let long = format!("https://example.org/{}", "a".repeat(MAX_URL));
        assert!(parse(&long).is_err());
        // No error message repeats the URL.
        let e = parse("http://h:99999/?token=s3cr3t").unwrap_err().to_string();
        assert!(!e.contains("s3cr3t"), "{e}");
    }

    #[test]
    fn recorded_sources_are_shown_redacted() {
        assert_eq!(redact_text("https://a.org/i.qcow2?sig=abc#f"), "https://a.org/i.qcow2?REDACTED");
        assert_eq!(redact_text("https://u:pw@a.org/i?sig=abc"), "https://a.org/i?REDACTED");
        assert_eq!(redact_text("https://a.org/i"), "https://a.org/i");
        assert_eq!(redact_text("/var/lib/vmhost/import/x.raw"), "/var/lib/vmhost/import/x.raw");
    }

    #[test]
    fn config_strings_are_quoted_as_curl_reads_them() {
        for v in ["http://a/b?c=d", "a\"b", "a\\b", "\\\"", "", "é"] {
            let q = quote(v).unwrap();
            assert_eq!(unquote(&q).as_deref(), Some(v), "{q}");
        }
        assert_eq!(quote("a\"b\\c").unwrap(), r#""a\"b\\c""#);
        assert_eq!(quote("a\nurl = \"file:///etc/shadow\""), None, "no second line");
        assert_eq!(quote("a\tb"), None);
        for bad in ["abc", "\"a", "\"a\"b\"", r#""a\nb""#, r#""a\""#, "\"a\nb\""] {
            assert_eq!(unquote(bad), None, "{bad}");
        }
    }
}
