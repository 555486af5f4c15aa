//! Standard base64 (RFC 4648, with padding): how bulk bytes travel in JSON, on the exec ports
//! ([`crate::exec::Chunk`]'s `data`) and in vmhostd's API (`stdin`, `content`, output). The one
//! piece of logic in this crate, because all three programs (vmhostd, vmhostctl, the agent)
//! need the same strict codec and should not each carry a copy.
//!
//! Here rather than a dependency: the two functions are all vmhost needs (the agent's static
//! binary has a 2 MiB budget), and [`decode`] is strict (no whitespace, canonical padding)
//! because its input comes from clients and guests.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// The text is not canonical standard base64.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotBase64;

impl std::fmt::Display for NotBase64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not base64 (standard alphabet, with padding)")
    }
}

impl std::error::Error for NotBase64 {}

/// Encodes `bytes`.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let b = [group[0], *group.get(1).unwrap_or(&0), *group.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= group.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Bytes that [`encode`] of `len` bytes decodes to at most: what a caller may check before
/// decoding an oversize text.
pub fn decoded_len(text_len: usize) -> usize {
    text_len / 4 * 3
}

fn value(c: u8) -> Option<u32> {
    Some(u32::from(match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    }))
}

/// Decodes `text`.
///
/// # Errors
/// [`NotBase64`] for a length that is not a multiple of 4, a character outside the alphabet,
/// padding anywhere but at the end, or unused bits that are not zero.
pub fn decode(text: &str) -> Result<Vec<u8>, NotBase64> {
    let bytes = text.as_bytes();
    if bytes.len() % 4 != 0 {
        return Err(NotBase64);
    }
    let mut out = Vec::with_capacity(decoded_len(bytes.len()));
    let groups = bytes.len() / 4;
    for (g, quad) in bytes.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 || (pad > 0 && g + 1 != groups) {
            return Err(NotBase64);
        }
        let mut n = 0u32;
        for c in &quad[..4 - pad] {
            n = (n << 6) | value(*c).ok_or(NotBase64)?;
        }
        n <<= 6 * pad as u32;
        let got = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        let keep = 3 - pad;
        // Canonical: the bits the padding stands for are zero.
        if got[keep..].iter().any(|b| *b != 0) {
            return Err(NotBase64);
        }
        out.extend_from_slice(&got[..keep]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_matches_rfc_4648_vectors() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(encode(plain.as_bytes()), coded);
            assert_eq!(decode(coded).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&all)).unwrap(), all);
    }

    #[test]
    fn anything_not_canonical_is_refused() {
        for bad in ["Zg=", "Zg", "Z===", "Zh==", "Zm9v\n", "Zm 9", "Zg==Zg==", "Zm9-", "====", "Zm8=Zm8="] {
            assert_eq!(decode(bad), Err(NotBase64), "{bad:?}");
        }
    }
}
