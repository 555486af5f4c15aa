//! The config parser as the cargo fuzz target `config` drives it: arbitrary text as
//! `vmhostd.toml`.
//!
//! [`config_text`] panics when a promise of [`Config::parse`] breaks: it either returns a config or
//! a [`ConfigError`] naming the file (never a panic), and a config it accepts parses again to the
//! same value (the daemon re-reads its config at every start).

use crate::config::{Config, ConfigError};
use std::path::Path;

/// Parses `data` (when it is UTF-8) as the config file `fuzz.toml`.
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn config_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let file = Path::new("fuzz.toml");
    match Config::parse(text, file) {
        Ok(config) => {
            let again = Config::parse(text, file).unwrap_or_else(|e| panic!("accepted once, refused again: {e}"));
            assert_eq!(config, again);
        }
        Err(e @ (ConfigError::Syntax { .. } | ConfigError::Key { .. })) => {
            assert!(e.to_string().starts_with("fuzz.toml: "), "the error names the file: {e}");
        }
        Err(e) => panic!("parsing text never fails as I/O: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("config", config_text) >= 5, "the seed corpus is committed");
    }
}
