//! The pure half of reading requests: what one line is (blank, a request, a batch, or an error
//! to answer with id `null`) and whether a JSON value has the JSON-RPC 2.0 request shape.
//!
//! [`super::server`] reads a bounded line, hands it to [`classify`], and runs [`Request::parse`]
//! on every single request or batch element before dispatch; nothing here does I/O, so the
//! cargo fuzz target `request` (`crate::fuzz::request`) drives exactly these functions.

use crate::api::{ApiError, Code};
use crate::rpc::limits::MAX_BATCH;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// What one request line is.
#[derive(Debug)]
pub enum Line {
    /// Whitespace only: not a request, ignored (keeps interactive use with socat pleasant).
    Blank,
    /// One JSON value (not yet shape-checked), as UTF-8 text.
    Single(String),
    /// A non-empty batch: its elements, each to be shape-checked on its own.
    Batch(Vec<Box<RawValue>>),
    /// Not UTF-8 or not JSON (-32700), an empty batch (-32600), or a batch of more than
    /// [`MAX_BATCH`] elements (1003, refused as a whole): answered with id `null`.
    Error(ApiError),
}

/// Classifies one line (without its newline).
pub fn classify(line: Vec<u8>) -> Line {
    let Ok(text) = String::from_utf8(line) else {
        return Line::Error(ApiError::new(Code::ParseError, "request line is not valid UTF-8"));
    };
    let start = text.trim_start_matches([' ', '\t', '\r']);
    if start.trim_end_matches([' ', '\t', '\r']).is_empty() {
        return Line::Blank;
    }
    if start.starts_with('[') {
        return match serde_json::from_str::<Bounded>(&text) {
            Ok(Bounded { elements, .. }) if elements.is_empty() => {
                Line::Error(ApiError::new(Code::InvalidRequest, "empty batch"))
            }
            Ok(Bounded { total, .. }) if total > MAX_BATCH => Line::Error(
                ApiError::new(
                    Code::LimitExceeded,
                    format!("batch of {total} requests refused: a batch may hold at most {MAX_BATCH}"),
                )
                .details(serde_json::json!({"limit": "batch_length", "max": MAX_BATCH, "got": total})),
            ),
            Ok(Bounded { elements, .. }) => Line::Batch(elements),
            Err(e) => Line::Error(parse_error(&e)),
        };
    }
    match serde_json::from_str::<&RawValue>(&text) {
        Ok(_) => Line::Single(text),
        Err(e) => Line::Error(parse_error(&e)),
    }
}

/// A batch read without holding more than [`MAX_BATCH`] elements: the rest are only counted
/// (skipped without allocating), so a 1 MiB line of tiny elements costs no memory per element.
struct Bounded {
    /// The first [`MAX_BATCH`] elements.
    elements: Vec<Box<RawValue>>,
    /// How many elements the batch has.
    total: usize,
}

impl<'de> serde::Deserialize<'de> for Bounded {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Bounded;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bounded, A::Error> {
                let mut elements = Vec::new();
                let mut total = 0usize;
                loop {
                    if elements.len() < MAX_BATCH {
                        match seq.next_element::<Box<RawValue>>()? {
                            Some(element) => elements.push(element),
                            None => break,
                        }
                    } else if seq.next_element::<serde::de::IgnoredAny>()?.is_none() {
                        break;
                    }
                    total += 1;
                }
                Ok(Bounded { elements, total })
            }
        }
        d.deserialize_seq(Visitor)
    }
}

/// The -32700 error for a line that is not JSON.
fn parse_error(e: &serde_json::Error) -> ApiError {
    ApiError::new(Code::ParseError, format!("invalid JSON: {e}"))
}

/// A request that passed the shape checks, borrowing from its text.
pub struct Request<'a> {
    /// The id to answer with; `None` for a notification.
    pub id: Option<&'a RawValue>,
    /// The method name.
    pub method: String,
    /// The params, an array or object, if given.
    pub params: Option<&'a RawValue>,
}

/// Why a JSON value is not a request, and the id to answer with.
pub struct Invalid<'a> {
    /// The request's id when it had a valid one, else `null`.
    pub id: &'a RawValue,
    /// For the error message.
    pub message: String,
}

impl<'a> Request<'a> {
    /// Checks the JSON-RPC 2.0 request shape: an object with `"jsonrpc": "2.0"`, a string
    /// `method`, optional array/object `params`, optional string/number/null `id`, nothing else.
    pub fn parse(text: &'a str) -> Result<Request<'a>, Invalid<'a>> {
        let invalid = |id, message: &str| Invalid { id, message: message.to_string() };
        let members: BTreeMap<Cow<'a, str>, &'a RawValue> =
            serde_json::from_str(text).map_err(|_| invalid(RawValue::NULL, "a request must be a JSON object"))?;
        let id = match members.get("id") {
            None => None,
            Some(id) if is_valid_id(id) => Some(*id),
            Some(_) => return Err(invalid(RawValue::NULL, "id must be a string, a number or null")),
        };
        let answer_id = id.unwrap_or(RawValue::NULL);
        if let Some(unknown) = members.keys().find(|k| !matches!(k.as_ref(), "jsonrpc" | "id" | "method" | "params")) {
            return Err(Invalid { id: answer_id, message: format!("unknown request member {unknown:?}") });
        }
        let version = members.get("jsonrpc").and_then(|v| serde_json::from_str::<String>(v.get()).ok());
        if version.as_deref() != Some("2.0") {
            return Err(invalid(answer_id, "jsonrpc must be \"2.0\""));
        }
        let method = members
            .get("method")
            .and_then(|m| serde_json::from_str::<String>(m.get()).ok())
            .ok_or_else(|| invalid(answer_id, "method must be a string"))?;
        let params = members.get("params").copied();
        if params.is_some_and(|p| !p.get().starts_with(['[', '{'])) {
            return Err(invalid(answer_id, "params must be an array or an object"));
        }
        Ok(Request { id, method, params })
    }
}

/// JSON-RPC ids are strings, numbers or null.
pub fn is_valid_id(id: &RawValue) -> bool {
    let text = id.get();
    text == "null" || text.starts_with(['"', '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9'])
}
