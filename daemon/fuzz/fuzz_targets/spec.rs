//! VM spec validation, NIC allocation and set planning under arbitrary JSON: see
//! `vmhost::fuzz::spec`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vmhost::fuzz::spec::spec_json(data));
