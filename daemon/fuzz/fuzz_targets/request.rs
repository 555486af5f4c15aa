//! The API socket's request parsing under arbitrary lines: see `vmhost::fuzz::request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::request::request_line(data));
