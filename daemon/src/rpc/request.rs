//! The pure half of reading requests: one pass over a line makes what it is (blank, one request,
//! a batch, or an error to answer with id `null`) and, for every request in it, its envelope
//! ([`Envelope`]: id, method, params still as raw JSON) or the reason it is not one ([`Invalid`]).
//!
//! [`super::server`] reads a bounded line and hands it to [`classify`]; that is the only parse
//! of the request's envelope. The params stay raw text until the method's own closed type is
//! parsed from them ([`super::methods::parse_params`]), once. Nothing here does I/O, so the
//! cargo fuzz target `request` (`crate::fuzz::request`) drives exactly this function.

use crate::api::{ApiError, Code};
use crate::rpc::limits::MAX_BATCH;
use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;

/// What one request line is.
#[derive(Debug)]
pub enum Line {
    /// Whitespace only: not a request, ignored (keeps interactive use with socat pleasant).
    Blank,
    /// One request, or why it is not one.
    Single(Parsed),
    /// A non-empty batch: each element a request, or why it is not one.
    Batch(Vec<Parsed>),
    /// Not UTF-8 or not JSON (-32700), an empty batch (-32600), or a batch of more than
    /// [`MAX_BATCH`] elements (1003, refused as a whole): answered with id `null`.
    Error(ApiError),
}

/// One request of a line, or why it is not one (answered with -32600).
pub type Parsed = Result<Envelope, Invalid>;

/// A request that passed the JSON-RPC 2.0 shape checks.
#[derive(Debug)]
pub struct Envelope {
    /// The id to answer with, as the client wrote it; `None` for a notification.
    pub id: Option<Box<RawValue>>,
    /// The method name (JSON escapes resolved).
    pub method: String,
    /// The params, an array or object, if given; parsed once by the method into its own type.
    pub params: Option<Box<RawValue>>,
}

/// Why a JSON value is not a request, and the id to answer with.
#[derive(Debug)]
pub struct Invalid {
    /// The request's id when it had a valid one, else `null`.
    pub id: Box<RawValue>,
    /// For the error message.
    pub message: String,
}

/// Classifies one line (without its newline), parsing every request in it once.
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
            Ok(Bounded { elements, .. }) => Line::Batch(elements.into_iter().map(Members::check).collect()),
            Err(e) => Line::Error(parse_error(&e)),
        };
    }
    match serde_json::from_str::<Members<'_>>(&text) {
        Ok(members) => Line::Single(members.check()),
        Err(e) => Line::Error(parse_error(&e)),
    }
}

/// A batch read without holding more than [`MAX_BATCH`] elements: the rest are only counted
/// (skipped without allocating), so a 1 MiB line of tiny elements costs no memory per element.
struct Bounded<'a> {
    /// The first [`MAX_BATCH`] elements.
    elements: Vec<Members<'a>>,
    /// How many elements the batch has.
    total: usize,
}

impl<'de> serde::Deserialize<'de> for Bounded<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct BatchVisitor;
        impl<'de> Visitor<'de> for BatchVisitor {
            type Value = Bounded<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Bounded<'de>, A::Error> {
                let mut elements = Vec::new();
                let mut total = 0usize;
                loop {
                    if elements.len() < MAX_BATCH {
                        match seq.next_element::<Members<'de>>()? {
                            Some(element) => elements.push(element),
                            None => break,
                        }
                    } else if seq.next_element::<IgnoredAny>()?.is_none() {
                        break;
                    }
                    total += 1;
                }
                Ok(Bounded { elements, total })
            }
        }
        d.deserialize_seq(BatchVisitor)
    }
}

/// The -32700 error for a line that is not JSON.
fn parse_error(e: &serde_json::Error) -> ApiError {
    ApiError::new(Code::ParseError, format!("invalid JSON: {e}"))
}

/// What one JSON value held, read in one pass without judging it: the shape checks come after
/// the whole line has parsed, so a line that is not JSON is -32700 however its members look.
/// A member given twice counts as its last value.
#[derive(Debug, Default)]
struct Members<'a> {
    /// Not an object at all.
    not_object: bool,
    /// `id`, as written.
    id: Option<&'a RawValue>,
    /// `jsonrpc`: `Some(None)` when present but not a string.
    jsonrpc: Option<Option<Cow<'a, str>>>,
    /// `method`: `Some(None)` when present but not a string.
    method: Option<Option<Cow<'a, str>>>,
    /// `params`, as written.
    params: Option<&'a RawValue>,
    /// The first unknown member name, in sorted order (the one the error names).
    unknown: Option<Cow<'a, str>>,
}

impl<'a> Members<'a> {
    /// The JSON-RPC 2.0 request shape: an object with `"jsonrpc": "2.0"`, a string `method`,
    /// optional array/object `params`, optional string/number/null `id`, nothing else.
    fn check(self) -> Parsed {
        let invalid = |id: &RawValue, message: String| Invalid { id: id.to_owned(), message };
        if self.not_object {
            return Err(invalid(RawValue::NULL, "a request must be a JSON object".into()));
        }
        let id = match self.id {
            None => None,
            Some(id) if is_valid_id(id) => Some(id),
            Some(_) => return Err(invalid(RawValue::NULL, "id must be a string, a number or null".into())),
        };
        let answer_id = id.unwrap_or(RawValue::NULL);
        if let Some(unknown) = self.unknown {
            return Err(invalid(answer_id, format!("unknown request member {unknown:?}")));
        }
        if self.jsonrpc.flatten().as_deref() != Some("2.0") {
            return Err(invalid(answer_id, "jsonrpc must be \"2.0\"".into()));
        }
        let Some(method) = self.method.flatten() else {
            return Err(invalid(answer_id, "method must be a string".into()));
        };
        if self.params.is_some_and(|p| !p.get().starts_with(['[', '{'])) {
            return Err(invalid(answer_id, "params must be an array or an object".into()));
        }
        Ok(Envelope {
            id: id.map(RawValue::to_owned),
            method: method.into_owned(),
            params: self.params.map(RawValue::to_owned),
        })
    }
}

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MembersVisitor)
    }
}

/// Reads any JSON value: an object member by member, anything else as "not an object".
struct MembersVisitor;

impl<'de> Visitor<'de> for MembersVisitor {
    type Value = Members<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
        let mut m = Members::default();
        // Keys borrow from the line unless they hold escapes.
        while let Some(MaybeStr(key)) = map.next_key::<MaybeStr<'de>>()? {
            let key = key.unwrap_or_default();
            match key.as_ref() {
                "id" => m.id = Some(map.next_value()?),
                "jsonrpc" => m.jsonrpc = Some(map.next_value::<MaybeStr<'de>>()?.0),
                "method" => m.method = Some(map.next_value::<MaybeStr<'de>>()?.0),
                "params" => m.params = Some(map.next_value()?),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    if m.unknown.as_ref().is_none_or(|first| key < *first) {
                        m.unknown = Some(key);
                    }
                }
            }
        }
        Ok(m)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Members<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_bool<E>(self, _: bool) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_i64<E>(self, _: i64) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_u64<E>(self, _: u64) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_f64<E>(self, _: f64) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_str<E>(self, _: &str) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }

    fn visit_unit<E>(self) -> Result<Members<'de>, E> {
        Ok(Members { not_object: true, ..Members::default() })
    }
}

/// A member that should be a string: the string, or `None` for any other JSON value.
struct MaybeStr<'a>(Option<Cow<'a, str>>);

impl<'de> serde::Deserialize<'de> for MaybeStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct StrVisitor;
        impl<'de> Visitor<'de> for StrVisitor {
            type Value = MaybeStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(Some(Cow::Borrowed(s))))
            }
            fn visit_str<E>(self, s: &str) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(Some(Cow::Owned(s.to_owned()))))
            }
            fn visit_string<E>(self, s: String) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(Some(Cow::Owned(s))))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MaybeStr<'de>, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MaybeStr<'de>, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MaybeStr(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(None))
            }
            fn visit_unit<E>(self) -> Result<MaybeStr<'de>, E> {
                Ok(MaybeStr(None))
            }
        }
        d.deserialize_any(StrVisitor)
    }
}

/// JSON-RPC ids are strings, numbers or null.
pub fn is_valid_id(id: &RawValue) -> bool {
    let text = id.get();
    text == "null" || text.starts_with(['"', '-', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single(text: &str) -> Parsed {
        match classify(text.as_bytes().to_vec()) {
            Line::Single(parsed) => parsed,
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn parses_valid_requests() {
        let r = single(r#"{"jsonrpc":"2.0","id":"a","method":"vm.get","params":{"name":"x"}}"#).unwrap();
        assert_eq!(r.id.as_deref().map(RawValue::get), Some(r#""a""#));
        assert_eq!(r.method, "vm.get");
        assert_eq!(r.params.as_deref().map(RawValue::get), Some(r#"{"name":"x"}"#));
        let n = single(r#"{"jsonrpc":"2.0","method":"vm.list"}"#).unwrap();
        assert!(n.id.is_none() && n.params.is_none());
        let null_id = single(r#"{"jsonrpc":"2.0","method":"m","id":null}"#).unwrap();
        assert_eq!(null_id.id.as_deref().map(RawValue::get), Some("null"));
        let negative = single(r#"{"jsonrpc":"2.0","method":"m","id":-1.5}"#).unwrap();
        assert_eq!(negative.id.as_deref().map(RawValue::get), Some("-1.5"));
        // Escapes in member names and in the method are resolved; the last of a repeated member counts.
        let escaped = single(r#"{"jsonr\u0070c":"2.0","method":"vm.\u0067et","id":{},"id":3}"#).unwrap();
        assert_eq!((escaped.method.as_str(), escaped.id.as_deref().map(RawValue::get)), ("vm.get", Some("3")));
    }

    #[test]
    fn rejects_malformed_requests_keeping_a_valid_id() {
        let cases = [
            (r#"1"#, "null", "a request must be a JSON object"),
            (r#""x""#, "null", "a request must be a JSON object"),
            (r#"{"jsonrpc":"2.0","method":"m","id":{}}"#, "null", "id must be a string, a number or null"),
            (r#"{"jsonrpc":"2.0","method":"m","id":true}"#, "null", "id must be a string, a number or null"),
            (r#"{"jsonrpc":"1.0","method":"m","id":7}"#, "7", "jsonrpc must be \"2.0\""),
            (r#"{"jsonrpc":2,"method":"m","id":7}"#, "7", "jsonrpc must be \"2.0\""),
            (r#"{"method":"m","id":7}"#, "7", "jsonrpc must be \"2.0\""),
            (r#"{"jsonrpc":"2.0","id":"x"}"#, r#""x""#, "method must be a string"),
            (r#"{"jsonrpc":"2.0","method":5,"id":7}"#, "7", "method must be a string"),
            (r#"{"jsonrpc":"2.0","method":{"a":[1]},"id":7}"#, "7", "method must be a string"),
            (r#"{"jsonrpc":"2.0","method":"m","params":3,"id":7}"#, "7", "params must be an array or an object"),
            (r#"{"jsonrpc":"2.0","method":"m","zz":1,"extra":1,"id":7}"#, "7", "unknown request member \"extra\""),
        ];
        for (text, id, message) in cases {
            match single(text) {
                Ok(_) => panic!("{text} accepted"),
                Err(invalid) => assert_eq!((invalid.id.get(), invalid.message.as_str()), (id, message), "{text}"),
            }
        }
        // A batch element that is itself an array is not a request.
        match classify(b"[[1]]".to_vec()) {
            Line::Batch(elements) => {
                assert!(matches!(&elements[..], [Err(i)] if i.message == "a request must be a JSON object"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_line_that_is_not_json_is_a_parse_error_whatever_its_members() {
        for text in [r#"{"id":{},"jsonrpc":"2.0","#, r#"{"jsonrpc":"2.0","method":"m"} x"#, r#"[{"a":1},"#, "\u{1}"] {
            assert!(
                matches!(classify(text.as_bytes().to_vec()), Line::Error(e) if e.code == Code::ParseError),
                "{text}"
            );
        }
        assert!(matches!(classify(vec![0xff, b'{']), Line::Error(e) if e.code == Code::ParseError));
        assert!(matches!(classify(b" \t\r".to_vec()), Line::Blank));
        assert!(matches!(classify(b"[]".to_vec()), Line::Error(e) if e.code == Code::InvalidRequest));
    }
}
