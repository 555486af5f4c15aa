//! Bulk bytes on the exec ports: standard base64 (the [`Chunk`] lines' `data`), and the
//! notifications that carry output and file content back to the host.
//!
//! Order of use: a request that announces bytes (`exec` stdin, `file.push` content) is followed
//! by [`Chunk`] lines the session reads with [`decode_chunk`] (each at most [`MAX_CHUNK`] raw
//! bytes, never more than announced); bytes going back are cut into pieces of at most
//! [`MAX_CHUNK`] and sent as [`output_line`] (`exec.output`) or [`data_line`] (`file.data`).
//!
//! base64 is done here by hand (60 lines, tested against RFC 4648's vectors) instead of a crate:
//! the agent's static binary has a 2 MiB budget and needs only the one standard alphabet.

use serde_json::Value;
use vmhost_agent_protocol::exec::{Chunk, OutputStream, MAX_CHUNK};

use crate::protocol::{notification, parse_params, RpcError};

/// The standard alphabet (RFC 4648, section 4).
const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `data` as standard base64 with padding.
pub fn encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for group in data.chunks(3) {
        let b = [group[0], group.get(1).copied().unwrap_or(0), group.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= group.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The value of one base64 character, `None` for any other byte.
fn value(c: u8) -> Option<u32> {
    match c {
        b'A'..=b'Z' => Some(u32::from(c - b'A')),
        b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
        b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decodes standard base64 with padding (no line breaks, no other alphabet); `None` when `text`
/// is not exactly that, including non-zero bits after the last byte (one encoding per content).
pub fn decode(text: &str) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    if bytes.len() % 4 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(bytes.len() / 4 * 3);
    let groups = bytes.len() / 4;
    for (g, quad) in bytes.chunks(4).enumerate() {
        let pad = quad.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && g + 1 != groups) {
            return None;
        }
        let mut n = 0u32;
        for &c in &quad[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let three = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        let keep = 3 - pad;
        if three[keep..].iter().any(|&b| b != 0) {
            return None;
        }
        out.extend_from_slice(&three[..keep]);
    }
    Some(out)
}

/// Reads one host [`Chunk`] line: its raw bytes, at most [`MAX_CHUNK`] and at most `left`.
///
/// # Errors
/// -32602 (`data.field` `data`) for a line that is not a chunk, not base64, longer than
/// [`MAX_CHUNK`] or longer than what is left of the announced count.
pub fn decode_chunk(line: &[u8], left: u64) -> Result<Vec<u8>, RpcError> {
    let value: Value = std::str::from_utf8(line)
        .ok()
        .and_then(|text| serde_json::from_str(text).ok())
        .ok_or_else(|| RpcError::invalid_params("data", "expected a chunk line {\"data\": \"<base64>\"}"))?;
    let chunk: Chunk = parse_params(Some(value))?;
    if chunk.id.is_some() || chunk.stream.is_some() {
        return Err(RpcError::invalid_params("data", "a host chunk has only data"));
    }
    if chunk.data.len() > MAX_CHUNK.div_ceil(3) * 4 {
        return Err(RpcError::invalid_params("data", format!("a chunk holds at most {MAX_CHUNK} bytes")));
    }
    let bytes = decode(&chunk.data).ok_or_else(|| RpcError::invalid_params("data", "chunk data is not base64"))?;
    if bytes.len() > MAX_CHUNK {
        return Err(RpcError::invalid_params("data", format!("a chunk holds at most {MAX_CHUNK} bytes")));
    }
    if bytes.len() as u64 > left {
        return Err(RpcError::invalid_params("data", "more bytes than announced"));
    }
    if bytes.is_empty() {
        return Err(RpcError::invalid_params("data", "an empty chunk"));
    }
    Ok(bytes)
}

/// An `exec.output` notification line (no newline) for request `id`.
///
/// # Errors
/// -32603 when it cannot be serialized (never for at most [`MAX_CHUNK`] bytes).
pub fn output_line(id: u64, stream: OutputStream, data: &[u8]) -> Result<String, RpcError> {
    notification("exec.output", &Chunk { id: Some(id), stream: Some(stream), data: encode(data) })
}

/// A `file.data` notification line (no newline) for request `id`.
///
/// # Errors
/// As [`output_line`].
pub fn data_line(id: u64, data: &[u8]) -> Result<String, RpcError> {
    notification("file.data", &Chunk { id: Some(id), stream: None, data: encode(data) })
}

/// Lowercase hex of `bytes` (sha256 digests).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc_4648() {
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
            assert_eq!(decode(coded).as_deref(), Some(plain.as_bytes()));
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(decode(&encode(&all)), Some(all));
        for bad in ["Zg=", "Z===", "Zg==Zg==", "Zh==", "Zm9v\n", "Zm-v", "=Zm9"] {
            assert_eq!(decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn chunks_are_bounded_by_size_and_what_is_left() {
        assert_eq!(decode_chunk(br#"{"data":"aGk="}"#, 2).ok(), Some(b"hi".to_vec()));
        let field = |line: &[u8], left| decode_chunk(line, left).err().and_then(|e| e.data).map(|d| d["field"].clone());
        assert_eq!(field(br#"{"data":"aGk="}"#, 1), Some("data".into()), "more than announced");
        assert_eq!(field(br#"{"data":"a"}"#, 9), Some("data".into()));
        assert_eq!(field(br#"{"data":""}"#, 9), Some("data".into()));
        assert_eq!(field(br#"{"id":1,"data":"aGk="}"#, 9), Some("data".into()));
        assert_eq!(field(br#"{"data":"aGk=","x":1}"#, 9), Some("x".into()));
        assert_eq!(field(b"\xff", 9), Some("data".into()));
        let big = encode(&vec![7u8; MAX_CHUNK + 1]);
        assert_eq!(field(format!(r#"{{"data":"{big}"}}"#).as_bytes(), u64::MAX), Some("data".into()));
        let full = encode(&vec![7u8; MAX_CHUNK]);
        assert_eq!(
            decode_chunk(format!(r#"{{"data":"{full}"}}"#).as_bytes(), u64::MAX).map(|b| b.len()).ok(),
            Some(MAX_CHUNK)
        );
    }

    #[test]
    fn notifications_have_the_protocol_shape() {
        let line = output_line(7, OutputStream::Stderr, b"hi").unwrap_or_default();
        assert_eq!(
            line,
            r#"{"jsonrpc":"2.0","method":"exec.output","params":{"id":7,"stream":"stderr","data":"aGk="}}"#
        );
        let line = data_line(8, &vec![0u8; MAX_CHUNK]).unwrap_or_default();
        assert!(
            line.starts_with(r#"{"jsonrpc":"2.0","method":"file.data","params":{"id":8,"data":"AAAA"#),
            "{line:.80}"
        );
        assert_eq!(hex(&[0, 15, 255]), "000fff");
    }
}
