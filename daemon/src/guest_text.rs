//! Text a guest chose, made safe to print: in the daemon's text log and in `vmhostctl`'s tables
//! and messages.
//!
//! A guest's agent answers with strings (its version, error messages, the cells of `vm.check`).
//! Printed as they are, a `\n` forges a whole log line ("... level=ERROR ..."), a `\r` overwrites
//! the start of the line on a terminal, and an ESC or C1 sequence (CSI is U+009B on its own)
//! moves the cursor, recolours, sets the window title or worse. [`escape`] writes every such
//! character as a visible escape instead: the C0 controls (`\n`, `\r`, `\t` by name, the others as
//! `\x1b`), DEL, the C1 controls (`\u{9b}`), the line and paragraph separators and the bidi
//! overrides and isolates (which reorder what a reader sees). Everything else, including other
//! non-ASCII text and backslashes, is kept, so ordinary text reads as it was sent.
//!
//! Order of use: the daemon wraps a guest string in [`GuestText`] where it logs it or puts it in
//! a message (escaped and cut to [`MAX_LOGGED_CHARS`]); `vmhostctl` runs every human-readable
//! line through [`escape`] (uncapped: a table cell is shown whole) and its JSON through
//! [`escape_json_c1`] (serde already escapes C0, not C1).

use std::borrow::Cow;
use std::fmt;

/// Longest guest string logged, in characters (before escaping); the rest is replaced by a note
/// of how much was cut.
pub const MAX_LOGGED_CHARS: usize = 256;

/// Whether `c` must not reach a log or terminal as itself.
pub fn is_unsafe(c: char) -> bool {
    c.is_control() // C0, DEL and C1
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

fn write_escaped(out: &mut impl fmt::Write, c: char) -> fmt::Result {
    match c {
        '\n' => out.write_str("\\n"),
        '\r' => out.write_str("\\r"),
        '\t' => out.write_str("\\t"),
        c if (c as u32) < 0x80 => write!(out, "\\x{:02x}", c as u32),
        c => write!(out, "\\u{{{:x}}}", c as u32),
    }
}

/// `text` with every unsafe character (see the module doc) written as a visible escape; borrowed
/// when there is none.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(is_unsafe) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if is_unsafe(c) {
            // Writing to a String cannot fail.
            let _ = write_escaped(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Serialized JSON with the C1 controls (and the other unsafe non-ASCII characters) written as
/// `\u00XX` escapes: the same JSON value, safe on a terminal. serde_json escapes only the C0
/// controls; outside strings JSON text is ASCII, so every such character is inside a string.
pub fn escape_json_c1(json: &str) -> Cow<'_, str> {
    if !json.chars().any(|c| !c.is_ascii() && is_unsafe(c)) {
        return Cow::Borrowed(json);
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if !c.is_ascii() && is_unsafe(c) {
            // All of them are in the Basic Multilingual Plane: one \uXXXX each.
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A guest's string for a log line or a message: displays escaped ([`escape`]) and cut to
/// [`MAX_LOGGED_CHARS`] characters.
#[derive(Debug, Clone, Copy)]
pub struct GuestText<'a>(pub &'a str);

impl fmt::Display for GuestText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut chars = self.0.chars();
        for c in chars.by_ref().take(MAX_LOGGED_CHARS) {
            if is_unsafe(c) {
                write_escaped(f, c)?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        let rest = chars.count();
        if rest > 0 {
            write!(f, "...({rest} more characters)")?;
        }
        Ok(())
    }
}

/// Guest strings (e.g. interface names an agent reports) as one escaped, capped text: `a, b`.
#[derive(Debug, Clone, Copy)]
pub struct GuestList<'a>(pub &'a [String]);

impl fmt::Display for GuestList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", GuestText(s))?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_c1_and_reordering_characters_are_escaped_and_the_rest_kept() {
        assert!(matches!(escape("eth0 10.0.0.5/24 ✓ ü \\n"), Cow::Borrowed(_)), "nothing to escape");
        assert_eq!(escape("a\nb\rc\td"), "a\\nb\\rc\\td");
        assert_eq!(escape("\u{1b}[31mred\u{1b}[0m\u{7}"), "\\x1b[31mred\\x1b[0m\\x07");
        assert_eq!(escape("\0\u{7f}"), "\\x00\\x7f");
        assert_eq!(escape("\u{9b}31m\u{85}\u{80}\u{9f}"), "\\u{9b}31m\\u{85}\\u{80}\\u{9f}");
        assert_eq!(escape("abc\u{202e}def\u{2028}\u{2066}"), "abc\\u{202e}def\\u{2028}\\u{2066}");
        // Nothing unsafe survives, whatever the input.
        let all: String = (0u32..0x3000).filter_map(char::from_u32).collect();
        assert!(!escape(&all).chars().any(is_unsafe));
    }

    #[test]
    fn guest_text_is_one_line_and_capped() {
        let forged = "0.9\nFORGED level=ERROR root login\r\u{1b}[2K";
        let shown = GuestText(forged).to_string();
        assert_eq!(shown, "0.9\\nFORGED level=ERROR root login\\r\\x1b[2K");
        assert!(!shown.contains('\n') && !shown.contains('\r') && !shown.contains('\u{1b}'));
        let long = "é".repeat(MAX_LOGGED_CHARS + 10);
        let shown = GuestText(&long).to_string();
        assert!(shown.starts_with(&"é".repeat(MAX_LOGGED_CHARS)), "cut at characters, not bytes");
        assert!(shown.ends_with("...(10 more characters)"), "{shown}");
        assert_eq!(GuestText("plain").to_string(), "plain");
        assert_eq!(GuestList(&["a\n".into(), "b".into()]).to_string(), "[a\\n, b]");
    }

    #[test]
    fn json_keeps_its_value_and_loses_its_c1_characters() {
        let v = serde_json::json!({"name": "x\u{9b}31m\u{1b}[0m\u{202e}", "n": 1});
        let text = serde_json::to_string(&v).unwrap();
        assert!(text.contains('\u{9b}'), "serde leaves C1 as is");
        let safe = escape_json_c1(&text);
        assert!(!safe.chars().any(is_unsafe), "{safe}");
        assert_eq!(serde_json::from_str::<serde_json::Value>(&safe).unwrap(), v);
        assert!(matches!(escape_json_c1("{\"a\":\"ü\"}"), Cow::Borrowed(_)));
    }
}
