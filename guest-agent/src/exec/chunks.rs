//! Bulk bytes on the exec ports: standard base64 (the [`Chunk`] lines' `data`), and the
//! notifications that carry output and file content back to the host.
//!
//! Order of use: a request that announces bytes (`exec` stdin, `file.push` content) is followed
//! by [`Chunk`] lines the session reads with [`decode_chunk`] (each at most [`MAX_CHUNK`] raw
//! bytes, never more than announced); bytes going back are cut into pieces of at most
//! [`MAX_CHUNK`] and sent as [`output_line`] (`exec.output`) or [`data_line`] (`file.data`).
//!
//! base64 is the protocol crate's ([`vmhost_agent_protocol::base64`]), shared with vmhostd.

use serde_json::Value;
use vmhost_agent_protocol::base64::{decode, encode};
use vmhost_agent_protocol::exec::{Chunk, OutputStream, MAX_CHUNK};

use crate::protocol::{notification, parse_params, RpcError};

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
    let bytes = decode(&chunk.data).map_err(|_| RpcError::invalid_params("data", "chunk data is not base64"))?;
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
