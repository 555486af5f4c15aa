//! The wire protocol: newline-delimited JSON-RPC 2.0 frames, the resync rule, and the dispatch of
//! one request line to a [`Methods`] implementation.
//!
//! Order of use: the port loop feeds every byte it reads to [`LineBuffer::push`], which cuts the
//! stream into [`Frame`]s of at most [`MAX_FRAME`] bytes; each frame goes to [`handle_frame`] (a
//! complete line to [`handle_line`]), whose answer, if any, is written back followed by a newline.
//! Everything here is pure: no port, no kernel, so framing and envelope rules are unit-tested
//! directly (see the tests below and README.md for the rules and why they are what they are).
//!
//! Error codes: the JSON-RPC ones ([`PARSE_ERROR`], [`INVALID_REQUEST`], [`METHOD_NOT_FOUND`],
//! [`INVALID_PARAMS`], [`INTERNAL_ERROR`]) for the envelope and parameter types, and the agent's
//! [`INVALID_SEMANTICS`] (5100, a well-typed value the agent refuses, `data.field` names it) and
//! [`APPLY_FAILED`] (5101, the kernel refused a change or the result did not verify).

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};

/// Longest frame in either direction, in bytes, not counting the newline.
pub const MAX_FRAME: usize = 64 * 1024;

/// JSON-RPC: the line is not UTF-8 JSON.
pub const PARSE_ERROR: i64 = -32700;
/// JSON-RPC: valid JSON but not a request object (or a line longer than [`MAX_FRAME`]).
pub const INVALID_REQUEST: i64 = -32600;
/// JSON-RPC: no such method.
pub const METHOD_NOT_FOUND: i64 = -32601;
/// JSON-RPC: parameters of the wrong shape or type; `data.field` names the member.
pub const INVALID_PARAMS: i64 = -32602;
/// JSON-RPC: the agent failed without the request being at fault (e.g. netlink unavailable).
pub const INTERNAL_ERROR: i64 = -32603;
/// Agent: well-typed parameters with a value the agent refuses; `data.field` names it.
pub const INVALID_SEMANTICS: i64 = 5100;
/// Agent: applying or verifying a change failed; `data` says which step and interface.
pub const APPLY_FAILED: i64 = 5101;

/// A JSON-RPC error object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RpcError {
    /// The error code (see the constants of this module).
    pub code: i64,
    /// A sentence for humans.
    pub message: String,
    /// Details for programs; omitted when there are none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
}

impl RpcError {
    /// An error with a code and message and no data.
    pub fn new(code: i64, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into(), data: None }
    }

    /// -32602 naming the parameter `field` (a path such as `expected.interfaces[0].mac`).
    pub fn invalid_params(field: &str, message: impl Into<String>) -> RpcError {
        RpcError { code: INVALID_PARAMS, message: message.into(), data: Some(json!({ "field": field })) }
    }

    /// 5100 naming the parameter `field` whose value is refused.
    pub fn invalid(field: &str, message: impl Into<String>) -> RpcError {
        RpcError { code: INVALID_SEMANTICS, message: message.into(), data: Some(json!({ "field": field })) }
    }

    /// -32603 for a failure that is not the request's fault.
    pub fn internal(message: impl Into<String>) -> RpcError {
        RpcError::new(INTERNAL_ERROR, message)
    }
}

/// What the request handlers provide: one call per method name.
pub trait Methods {
    /// Runs `method` with `params` (`None` when the request had none, or `null`).
    ///
    /// # Errors
    /// An [`RpcError`] to send back; [`METHOD_NOT_FOUND`] for an unknown method.
    fn call(&mut self, method: &str, params: Option<Value>) -> Result<Value, RpcError>;
}

/// One unit of the input stream, as [`LineBuffer`] cuts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// A complete line, without its newline.
    Line(Vec<u8>),
    /// A line longer than [`MAX_FRAME`]: reported once, as soon as it is too long; its remaining
    /// bytes up to the next newline are discarded.
    Oversize,
}

/// Cuts a byte stream into newline-terminated frames, holding at most [`MAX_FRAME`] bytes of an
/// unfinished line.
#[derive(Debug, Default)]
pub struct LineBuffer {
    /// The unfinished line so far.
    partial: Vec<u8>,
    /// Inside an oversize line: drop bytes until the next newline.
    discarding: bool,
}

impl LineBuffer {
    /// An empty buffer.
    pub fn new() -> LineBuffer {
        LineBuffer::default()
    }

    /// Bytes of an unfinished line currently held.
    pub fn pending(&self) -> usize {
        self.partial.len()
    }

    /// Adds `data` read from the stream and calls `emit` for every frame it completes, in order.
    pub fn push(&mut self, mut data: &[u8], mut emit: impl FnMut(Frame)) {
        while !data.is_empty() {
            let newline = data.iter().position(|&b| b == b'\n');
            let chunk = &data[..newline.unwrap_or(data.len())];
            if self.discarding {
                // The tail of an oversize line: nothing to keep.
            } else if self.partial.len() + chunk.len() > MAX_FRAME {
                self.partial = Vec::new();
                self.discarding = true;
                emit(Frame::Oversize);
            } else {
                self.partial.extend_from_slice(chunk);
            }
            match newline {
                Some(at) => {
                    if !std::mem::take(&mut self.discarding) {
                        emit(Frame::Line(std::mem::take(&mut self.partial)));
                    }
                    data = &data[at + 1..];
                }
                None => data = &[],
            }
        }
        // Do not keep a large allocation alive between sessions for a small partial line.
        if self.partial.is_empty() && self.partial.capacity() > 4096 {
            self.partial = Vec::new();
        }
    }
}

/// A response object; field order as in the JSON-RPC specification's examples.
#[derive(Serialize)]
struct Response<'a> {
    jsonrpc: &'static str,
    id: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<RpcError>,
}

/// Serializes a response, replacing one longer than [`MAX_FRAME`] by an [`INTERNAL_ERROR`].
fn respond(id: &Value, outcome: Result<Value, RpcError>) -> String {
    let (result, error) = match outcome {
        Ok(value) => (Some(value), None),
        Err(e) => (None, Some(e)),
    };
    let text = serde_json::to_string(&Response { jsonrpc: "2.0", id, result, error });
    match text {
        Ok(text) if text.len() <= MAX_FRAME => text,
        Ok(text) => {
            let error = RpcError {
                code: INTERNAL_ERROR,
                message: format!("reply of {} bytes exceeds the {MAX_FRAME}-byte frame limit", text.len()),
                data: None,
            };
            serde_json::to_string(&Response { jsonrpc: "2.0", id, result: None, error: Some(error) })
                .unwrap_or_default()
        }
        Err(e) => format!(
            r#"{{"jsonrpc":"2.0","id":null,"error":{{"code":{INTERNAL_ERROR},"message":{}}}}}"#,
            Value::String(format!("cannot serialize reply: {e}"))
        ),
    }
}

/// An error response with `id: null`, for lines whose id cannot be known.
fn error_null(code: i64, message: impl Into<String>) -> String {
    respond(&Value::Null, Err(RpcError::new(code, message)))
}

/// The members a request object may have.
const REQUEST_MEMBERS: [&str; 4] = ["jsonrpc", "id", "method", "params"];

/// Handles one frame: a line goes to [`handle_line`]; an oversize frame is answered with
/// [`INVALID_REQUEST`] and `id: null`.
pub fn handle_frame(frame: &Frame, methods: &mut dyn Methods) -> Option<String> {
    match frame {
        Frame::Line(line) => handle_line(line, methods),
        Frame::Oversize => Some(error_null(INVALID_REQUEST, format!("frame longer than {MAX_FRAME} bytes discarded"))),
    }
}

/// Handles one complete line (without its newline) and returns the text to send back, without the
/// terminating newline, or `None` when nothing is to be sent.
///
/// - A blank line (whitespace only, e.g. the host's resync `\n` when nothing was pending) is
///   ignored.
/// - Invalid UTF-8 or JSON: [`PARSE_ERROR`], `id: null`.
/// - Not a request object (a batch array, another JSON value, a missing or wrong `jsonrpc`, an
///   unknown member, an id that is not a string, number or null): [`INVALID_REQUEST`], with the id
///   when it could be read.
/// - A valid request without `id` (a notification) is dropped: the agent has no method worth
///   running unanswered. An invalid one is answered with `id: null`.
/// - The answer to `sync` starts with a newline, which ends any partial line an earlier session
///   left in the agent-to-host direction; the host discards everything up to the sync answer.
pub fn handle_line(line: &[u8], methods: &mut dyn Methods) -> Option<String> {
    match parse_line(line) {
        Parsed::Nothing => None,
        Parsed::Answer(text) => Some(text),
        Parsed::Request { id, method, params } => {
            let outcome = methods.call(&method, params);
            Some(reply(&id, &method, outcome))
        }
    }
}

/// What one input line is, as [`parse_line`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// Nothing to do: a blank line or a valid notification.
    Nothing,
    /// The line was no valid request: send this error back (no newline).
    Answer(String),
    /// A valid request to run, then answer with [`reply`].
    Request {
        /// Its id.
        id: Value,
        /// Its method.
        method: String,
        /// Its parameters (`None` when absent or `null`).
        params: Option<Value>,
    },
}

/// Reads one complete line (without its newline) under the rules of [`handle_line`], without
/// running anything: the exec ports' server runs some requests itself (they read and write more
/// than one line), and all of them go through the same envelope checks.
pub fn parse_line(line: &[u8]) -> Parsed {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) {
        return Parsed::Nothing;
    }
    let Ok(text) = std::str::from_utf8(line) else {
        return Parsed::Answer(error_null(PARSE_ERROR, "invalid UTF-8"));
    };
    let value: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(e) => return Parsed::Answer(error_null(PARSE_ERROR, format!("invalid JSON: {e}"))),
    };
    let mut object = match value {
        Value::Object(object) => object,
        Value::Array(_) => return Parsed::Answer(error_null(INVALID_REQUEST, "batch requests are not supported")),
        _ => return Parsed::Answer(error_null(INVALID_REQUEST, "a request must be a JSON object")),
    };
    let id = match object.remove("id") {
        None => None,
        Some(id @ (Value::String(_) | Value::Number(_) | Value::Null)) => Some(id),
        Some(_) => return Parsed::Answer(error_null(INVALID_REQUEST, "id must be a string, a number or null")),
    };
    match (id, check_envelope(object)) {
        (Some(id), Ok((method, params))) => Parsed::Request { id, method, params },
        (Some(id), Err(e)) => Parsed::Answer(respond(&id, Err(e))),
        // A valid notification: never answered, so not run either.
        (None, Ok(_)) => Parsed::Nothing,
        // An invalid request is answered even without an id (JSON-RPC 2.0, section 5).
        (None, Err(e)) => Parsed::Answer(respond(&Value::Null, Err(e))),
    }
}

/// The answer (no newline) to request `id` of `method`: a success starts with a newline when the
/// method is `sync` (see [`handle_line`]); an answer over [`MAX_FRAME`] becomes [`INTERNAL_ERROR`].
pub fn reply(id: &Value, method: &str, outcome: Result<Value, RpcError>) -> String {
    match outcome {
        Ok(result) if method == "sync" => format!("\n{}", respond(id, Ok(result))),
        outcome => respond(id, outcome),
    }
}

/// A notification line (no newline): `{"jsonrpc":"2.0","method":METHOD,"params":PARAMS}`.
///
/// # Errors
/// When `params` cannot be serialized or the line would exceed [`MAX_FRAME`].
pub fn notification<T: Serialize>(method: &str, params: &T) -> Result<String, RpcError> {
    #[derive(Serialize)]
    struct Notification<'a, T> {
        jsonrpc: &'static str,
        method: &'a str,
        params: &'a T,
    }
    let text = serde_json::to_string(&Notification { jsonrpc: "2.0", method, params })
        .map_err(|e| RpcError::internal(format!("cannot serialize a notification: {e}")))?;
    if text.len() > MAX_FRAME {
        return Err(RpcError::internal(format!("notification of {} bytes exceeds the frame limit", text.len())));
    }
    Ok(text)
}

/// Checks `jsonrpc`, `method`, `params` and that no other member is present (the id is already
/// removed); returns the method and its parameters (`null` counts as none).
fn check_envelope(mut object: Map<String, Value>) -> Result<(String, Option<Value>), RpcError> {
    if let Some(unknown) = object.keys().find(|k| !REQUEST_MEMBERS.contains(&k.as_str())) {
        return Err(RpcError {
            code: INVALID_REQUEST,
            message: format!("unknown request member {unknown:?}"),
            data: Some(json!({ "field": unknown })),
        });
    }
    if object.get("jsonrpc") != Some(&Value::String("2.0".into())) {
        return Err(RpcError::new(INVALID_REQUEST, r#"jsonrpc must be "2.0""#));
    }
    let method = match object.remove("method") {
        Some(Value::String(method)) => method,
        _ => return Err(RpcError::new(INVALID_REQUEST, "method must be a string")),
    };
    let params = match object.remove("params") {
        None | Some(Value::Null) => None,
        Some(params @ (Value::Object(_) | Value::Array(_))) => Some(params),
        Some(_) => return Err(RpcError::invalid_params("params", "params must be an object")),
    };
    Ok((method, params))
}

/// Deserializes a method's parameters into its closed type `T` (absent parameters count as `{}`).
///
/// # Errors
/// [`INVALID_PARAMS`] with `data.field` set to the path of the offending member, e.g.
/// `expected.interfaces[0].mac` for a wrong type, or the path of the missing or unknown member.
pub fn parse_params<T: DeserializeOwned>(params: Option<Value>) -> Result<T, RpcError> {
    let params = params.unwrap_or_else(|| Value::Object(Map::new()));
    serde_path_to_error::deserialize(params).map_err(|e| {
        let mut field = e.path().to_string();
        let message = e.inner().to_string();
        // serde names a missing member only in the message ("missing field `mac`"), with the path
        // pointing at the enclosing object: name the member itself. (For an unknown member the
        // path already ends with it.)
        if message.starts_with("missing field") {
            if let Some(name) = message.split('`').nth(1) {
                field = if field == "." { name.to_string() } else { format!("{field}.{name}") };
            }
        }
        if field == "." {
            field = "params".to_string();
        }
        RpcError::invalid_params(&field, format!("invalid params: {field}: {message}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// Methods for protocol tests: `sync` echoes its nonce, `echo` its params, `big` returns more
    /// than a frame.
    struct Fake;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct SyncParams {
        nonce: String,
    }

    impl Methods for Fake {
        fn call(&mut self, method: &str, params: Option<Value>) -> Result<Value, RpcError> {
            match method {
                "sync" => {
                    let p: SyncParams = parse_params(params)?;
                    Ok(json!({ "nonce": p.nonce }))
                }
                "echo" => Ok(params.unwrap_or(Value::Null)),
                "big" => Ok(Value::String("x".repeat(MAX_FRAME))),
                _ => Err(RpcError::new(METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
            }
        }
    }

    fn reply(line: &str) -> Value {
        let text = handle_line(line.as_bytes(), &mut Fake).expect("a reply");
        serde_json::from_str(&text).expect("reply is JSON")
    }

    fn frames(chunks: &[&[u8]]) -> Vec<Frame> {
        let mut buffer = LineBuffer::new();
        let mut out = Vec::new();
        for chunk in chunks {
            buffer.push(chunk, |f| out.push(f));
        }
        out
    }

    #[test]
    fn lines_are_cut_at_newlines_across_reads() {
        let out = frames(&[b"{\"a\":", b"1}\n{\"b\"", b":2}\n\n", b"tail"]);
        assert_eq!(
            out,
            [Frame::Line(b"{\"a\":1}".to_vec()), Frame::Line(b"{\"b\":2}".to_vec()), Frame::Line(Vec::new())]
        );
    }

    #[test]
    fn oversize_lines_are_reported_once_and_dropped() {
        let big = vec![b'x'; MAX_FRAME + 1];
        let mut buffer = LineBuffer::new();
        let mut out = Vec::new();
        // Fed in pieces: reported as soon as it is too long, and only once.
        for piece in big.chunks(10_000) {
            buffer.push(piece, |f| out.push(f));
        }
        assert_eq!(out, [Frame::Oversize]);
        assert_eq!(buffer.pending(), 0);
        buffer.push(b"more of it\nok\n", |f| out.push(f));
        assert_eq!(out, [Frame::Oversize, Frame::Line(b"ok".to_vec())]);
        // Exactly MAX_FRAME bytes is still a frame.
        let mut edge = vec![b' '; MAX_FRAME];
        edge.push(b'\n');
        assert_eq!(frames(&[&edge]), [Frame::Line(vec![b' '; MAX_FRAME])]);
        let answer = handle_frame(&Frame::Oversize, &mut Fake).expect("answered");
        let answer: Value = serde_json::from_str(&answer).expect("JSON");
        assert_eq!(answer["error"]["code"], INVALID_REQUEST);
        assert_eq!(answer["id"], Value::Null);
    }

    #[test]
    fn invalid_utf8_and_json_are_parse_errors_with_null_id() {
        for line in [&b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xff\"}"[..], b"{\"jsonrpc\":", b"garbage"] {
            let text = handle_line(line, &mut Fake).expect("a reply");
            let v: Value = serde_json::from_str(&text).expect("JSON");
            assert_eq!(v["error"]["code"], PARSE_ERROR, "{text}");
            assert_eq!(v["id"], Value::Null);
        }
    }

    #[test]
    fn envelope_rules() {
        let v = reply(r#"[{"jsonrpc":"2.0","id":1,"method":"echo"}]"#);
        assert_eq!(v["error"]["code"], INVALID_REQUEST);
        assert_eq!(reply("42")["error"]["code"], INVALID_REQUEST);
        let v = reply(r#"{"jsonrpc":"1.0","id":7,"method":"echo"}"#);
        assert_eq!((v["error"]["code"].clone(), v["id"].clone()), (json!(INVALID_REQUEST), json!(7)));
        let v = reply(r#"{"jsonrpc":"2.0","id":"a","method":"echo","extra":1}"#);
        assert_eq!((v["error"]["data"]["field"].clone(), v["id"].clone()), (json!("extra"), json!("a")));
        assert_eq!(reply(r#"{"jsonrpc":"2.0","id":{},"method":"echo"}"#)["id"], Value::Null);
        assert_eq!(reply(r#"{"jsonrpc":"2.0","id":1,"method":5}"#)["error"]["code"], INVALID_REQUEST);
        assert_eq!(reply(r#"{"jsonrpc":"2.0","id":1,"method":"echo","params":3}"#)["error"]["code"], INVALID_PARAMS);
        assert_eq!(reply(r#"{"jsonrpc":"2.0","id":1,"method":"nope"}"#)["error"]["code"], METHOD_NOT_FOUND);
        // Notifications and blank lines get no answer; an invalid request without id does.
        assert_eq!(handle_line(br#"{"jsonrpc":"2.0","method":"echo"}"#, &mut Fake), None);
        let v = reply(r#"{"method":"echo"}"#);
        assert_eq!((v["error"]["code"].clone(), v["id"].clone()), (json!(INVALID_REQUEST), Value::Null));
        assert_eq!(handle_line(b"", &mut Fake), None);
        assert_eq!(handle_line(b" \r", &mut Fake), None);
        // A CRLF line end is accepted.
        let v = reply("{\"jsonrpc\":\"2.0\",\"id\":null,\"method\":\"echo\",\"params\":[1]}\r");
        assert_eq!((v["result"].clone(), v["id"].clone()), (json!([1]), Value::Null));
    }

    #[test]
    fn replies_have_the_documented_shape_and_size() {
        let text =
            handle_line(br#"{"jsonrpc":"2.0","id":3,"method":"echo","params":{"k":"v"}}"#, &mut Fake).expect("a reply");
        assert_eq!(text, r#"{"jsonrpc":"2.0","id":3,"result":{"k":"v"}}"#);
        let text = handle_line(br#"{"jsonrpc":"2.0","id":4,"method":"big"}"#, &mut Fake).expect("a reply");
        assert!(text.len() <= MAX_FRAME);
        let v: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(v["error"]["code"], INTERNAL_ERROR);
    }

    /// The resync of a new host session: stale partial input is ended by the host's bare newline
    /// and answered as garbage, then the sync request is answered with a leading newline.
    #[test]
    fn resync_after_stale_partial_input() {
        fn feed(buffer: &mut LineBuffer, answers: &mut Vec<String>, bytes: &[u8]) {
            buffer.push(bytes, |frame| answers.extend(handle_frame(&frame, &mut Fake)));
        }
        let mut buffer = LineBuffer::new();
        let mut answers = Vec::new();
        // The previous host session died in the middle of a request.
        feed(&mut buffer, &mut answers, br#"{"jsonrpc":"2.0","id":1,"meth"#);
        // The new session: a bare newline, then sync.
        feed(&mut buffer, &mut answers, b"\n");
        feed(
            &mut buffer,
            &mut answers,
            br#"{"jsonrpc":"2.0","id":"sync-abc","method":"sync","params":{"nonce":"abc"}}"#,
        );
        feed(&mut buffer, &mut answers, b"\n");
        assert_eq!(answers.len(), 2, "{answers:?}");
        let garbage: Value = serde_json::from_str(&answers[0]).expect("JSON");
        assert_eq!(garbage["error"]["code"], PARSE_ERROR);
        assert_eq!(answers[1], "\n{\"jsonrpc\":\"2.0\",\"id\":\"sync-abc\",\"result\":{\"nonce\":\"abc\"}}");

        // Stale input in the middle of an oversize line: the newline ends the discarding too.
        let mut buffer = LineBuffer::new();
        let mut answers = Vec::new();
        feed(&mut buffer, &mut answers, &vec![b'x'; MAX_FRAME + 10]);
        feed(
            &mut buffer,
            &mut answers,
            b"\n{\"jsonrpc\":\"2.0\",\"id\":\"sync-1\",\"method\":\"sync\",\"params\":{\"nonce\":\"1\"}}\n",
        );
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert!(answers[1].starts_with("\n{"), "{}", answers[1]);
    }

    /// Random streams made of request fragments, garbage, invalid UTF-8, long runs and newlines, cut
    /// into random reads: the parser never panics, every answer is one well-formed JSON-RPC
    /// response within the frame limit, and nothing is answered that was not a frame.
    #[test]
    fn random_streams_get_well_formed_answers() {
        let fragments: [&[u8]; 12] = [
            br#"{"jsonrpc":"2.0","id":1,"method":"echo","params":{"a":[1,2]}}"#,
            br#"{"jsonrpc":"2.0","id":"sync-x","method":"sync","params":{"nonce":"x"}}"#,
            br#"{"jsonrpc":"2.0","id":2,"method":"sync","params":{"nonce":7}}"#,
            br#"{"jsonrpc":"2.0","method":"echo"}"#,
            br#"[1,2,3]"#,
            br#"{"id":"#,
            b"\xff\xfe\x00",
            b"\n",
            b"\r\n",
            b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"big\"}",
            b"   ",
            b"\"\\u0000\"",
        ];
        // xorshift64: deterministic, no dependency.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200 {
            let mut stream = Vec::new();
            for _ in 0..(next() % 40) {
                match next() % 10 {
                    0 => stream.extend(std::iter::repeat(b'a').take((next() % (2 * MAX_FRAME as u64)) as usize)),
                    1 => stream.extend((0..next() % 64).map(|_| next() as u8)),
                    _ => stream.extend_from_slice(fragments[(next() % fragments.len() as u64) as usize]),
                }
            }
            let mut buffer = LineBuffer::new();
            let mut frames = 0;
            let mut answers = Vec::new();
            let mut rest = &stream[..];
            while !rest.is_empty() {
                let cut = ((next() % 5000) as usize + 1).min(rest.len());
                buffer.push(&rest[..cut], |frame| {
                    frames += 1;
                    answers.extend(handle_frame(&frame, &mut Fake));
                });
                rest = &rest[cut..];
            }
            assert!(answers.len() <= frames);
            assert!(buffer.pending() <= MAX_FRAME);
            for answer in answers {
                assert!(answer.len() <= MAX_FRAME + 1, "{} bytes", answer.len());
                let v: Value = serde_json::from_str(answer.trim_start_matches('\n')).expect("answer is JSON");
                assert_eq!(v["jsonrpc"], "2.0");
                assert!(v.get("id").is_some(), "{v}");
                assert!(v.get("result").is_some() != v.get("error").is_some(), "{v}");
            }
        }
    }

    #[test]
    fn params_errors_name_the_field() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Inner {
            mac: String,
        }
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Outer {
            items: Vec<Inner>,
        }
        let field = |params: Value| {
            let e = parse_params::<Outer>(Some(params)).expect_err("invalid");
            assert_eq!(e.code, INVALID_PARAMS);
            e.data.and_then(|d| d["field"].as_str().map(str::to_string)).unwrap_or_default()
        };
        assert_eq!(field(json!({"items": [{"mac": 5}]})), "items[0].mac");
        assert_eq!(field(json!({"items": [{"mac": "x"}, {}]})), "items[1].mac");
        assert_eq!(field(json!({"items": [{"mac": "x", "up": true}]})), "items[0].up");
        assert_eq!(field(json!({})), "items");
        assert_eq!(field(json!({"items": [], "more": 1})), "more");
        assert_eq!(field(json!("string")), "params");
        // Absent params count as {}: no fields required means it parses.
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct NoParams {}
        assert!(parse_params::<NoParams>(None).is_ok());
        assert!(parse_params::<NoParams>(Some(json!({"x": 1}))).is_err());
    }
}
