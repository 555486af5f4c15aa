//! Test harness
