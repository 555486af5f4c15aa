//! Request parsing as the cargo fuzz target `request` drives it: arbitrary bytes as one line a
//! client sends on the API socket.
//!
//! [`request_line`] runs the line through exactly what the server does before dispatch
//! ([`classify`], which parses every request's envelope) and then parses the params of every
//! known method into its closed type, with the check of the one method table
//! ([`crate::rpc::methods::METHODS`]), as the method's handler does. It
//! panics when a promise breaks: a refused line is -32700, -32600 or 1003 (an over-long batch), an accepted request has a
//! string/number/null id and array/object params, an invalid one is answered with a valid id or
//! `null`, and a params refusal is -32602 naming a field. `image.import`'s params also go through
//! the pure check of the request ([`crate::images::check_import`], the strict URL parser
//! included): a refusal is 2001 naming one of its fields, and an accepted URL's redacted form
//! keeps nothing after a `?` but the redaction mark.

use crate::api::images::ImportParams;
use crate::api::Code;
use crate::rpc::methods::{self, parse_params};
use crate::rpc::request::{classify, is_valid_id, Line, Parsed};
use serde_json::value::RawValue;

/// Runs `data` as one request line.
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn request_line(data: &[u8]) {
    match classify(data.to_vec()) {
        Line::Blank => {}
        Line::Error(e) => {
            assert!(matches!(e.code, Code::ParseError | Code::InvalidRequest | Code::LimitExceeded), "{e:?}");
        }
        Line::Single(parsed) => one_request(parsed),
        Line::Batch(elements) => {
            assert!(!elements.is_empty(), "an empty batch is refused, not dispatched");
            assert!(elements.len() <= crate::rpc::limits::MAX_BATCH, "an over-long batch is refused, not dispatched");
            for element in elements {
                one_request(element);
            }
        }
    }
}

fn one_request(parsed: Parsed) {
    match parsed {
        Ok(request) => {
            if let Some(id) = &request.id {
                assert!(is_valid_id(id), "accepted id {}", id.get());
            }
            if let Some(params) = &request.params {
                assert!(params.get().starts_with(['[', '{']), "accepted params {}", params.get());
            }
            typed_params(&request.method, request.params.as_deref());
        }
        Err(invalid) => assert!(is_valid_id(&invalid.id), "answered with id {}", invalid.id.get()),
    }
}

/// The params of each method, parsed into the type its handler uses.
fn typed_params(method: &str, params: Option<&RawValue>) {
    let Some(m) = methods::find(method) else { return };
    if let Err(e) = (m.check)(params) {
        assert_eq!(e.code, Code::InvalidParams, "{e:?}");
        assert!(e.field.as_deref().is_some_and(|f| !f.is_empty()), "a params refusal names its field: {e:?}");
    }
    if method == "image.import" {
        if let Ok(p) = parse_params::<ImportParams>(params) {
            image_import(&p);
        }
    }
}

/// The host `image.import` is checked against: the defaults.
const HOST: &str = "[hardware]\ncpu = 4\nmemory_gib = 8\n";

fn image_import(p: &ImportParams) {
    let config =
        crate::config::Config::parse(HOST, std::path::Path::new("fuzz-host.toml")).unwrap_or_else(|e| panic!("{e}"));
    match crate::images::check_import(&config, &p.name, &p.sha256, p.source.as_deref(), p.timeout_s) {
        Err(e) => {
            let e = crate::api::ApiError::from(e);
            assert_eq!(e.code, Code::InvalidSpec, "{e:?}");
            let field = e.field.as_deref().unwrap_or_default();
            assert!(["name", "sha256", "source", "timeout_s"].contains(&field), "{e:?}");
        }
        Ok(req) => {
            if let crate::images::Source::Url(url) = &req.source {
                let shown = url.redacted();
                let after = shown.split_once('?').map(|(_, q)| q);
                assert!(after.is_none_or(|q| q == crate::images::url::REDACTED), "{shown}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("request", request_line) >= 5, "the seed corpus is committed");
    }
}
