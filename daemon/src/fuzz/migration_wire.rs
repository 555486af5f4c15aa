//! The migration port's wire as the cargo fuzz target `migration_wire` drives it: arbitrary
//! bytes from a peer on the port (docs/moving.md). The first byte picks what they are:
//!
//! - `0`: a client's opening line ([`wire::parse_open`]): an accepted line names a valid VM
//!   and a channel whose export is a safe name, and encodes back to a line that parses equal;
//! - `1`: a frame ([`wire::frame_len`], [`wire::open_frame`]): a length implying a payload
//!   outside 1..=1 MiB is refused, bytes the fuzzer made never open (it does not know the key),
//!   and what [`wire::seal`] makes of the payload opens back to it at its own position, in its
//!   own direction, under its own stream's key only, and does not contain it;
//! - `3`: a `files` frame's payload ([`files::parse_frame`]): accepted, its chunk or zero run
//!   is 1 to [`files::CHUNK`] bytes, and it encodes back to a payload that parses equal;
//! - anything else: a control frame's JSON ([`ControlMsg`]): accepted, it serializes back to
//!   JSON that parses equal.
//!
//! It panics when one of those promises breaks.

use crate::migration::files::{self, FilesFrame};
use crate::migration::wire::{self, NONCE_LEN};
use crate::migration::{ControlMsg, Secret};

/// Runs `data` as one input of a peer.
///
/// # Panics
/// When a promise of the module documentation breaks: that is a bug the fuzzer found.
pub fn wire_bytes(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else { return };
    match mode {
        0 => opening_line(rest),
        1 => frame(rest),
        3 => files_frame(rest),
        _ => control_json(rest),
    }
}

fn opening_line(line: &[u8]) {
    let Ok(open) = wire::parse_open(line) else { return };
    assert!(crate::validate::is_valid_name(&open.vm), "accepted VM {:?}", open.vm);
    if let crate::migration::ChannelKind::Disk(e) = &open.channel {
        assert!(!e.is_empty() && e.len() <= wire::MAX_EXPORT_LEN, "export {e:?}");
        assert!(e.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)), "export {e:?}");
    }
    let encoded = wire::encode_open(&open.vm, &open.channel, &open.proof);
    assert_eq!(encoded.last(), Some(&b'\n'));
    assert!(encoded.len() <= wire::MAX_OPEN_LINE, "an accepted line re-encodes too long");
    let again = wire::parse_open(&encoded[..encoded.len() - 1]).unwrap_or_else(|e| panic!("re-encoded refused: {e}"));
    assert_eq!(again, open);
}

fn frame(data: &[u8]) {
    let Ok(secret) = Secret::parse(&"5a".repeat(32)) else { unreachable!("64 hex digits") };
    let (a, b) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
    let (Ok(ours), Ok(theirs)) = (wire::frame_keys(&secret, &a, &b), wire::frame_keys(&secret, &b, &a)) else {
        unreachable!("two different nonces")
    };
    if data.len() >= 4 {
        let header = [data[0], data[1], data[2], data[3]];
        let n = u32::from_be_bytes(header) as usize;
        match wire::frame_len(header) {
            Ok(len) => assert!(len == n && (wire::TAG_LEN + 1..=wire::MAX_FRAME + wire::TAG_LEN).contains(&len)),
            Err(_) => assert!(n <= wire::TAG_LEN || n > wire::MAX_FRAME + wire::TAG_LEN),
        }
        // Bytes the fuzzer made carry no valid tag under a key it does not know.
        assert!(wire::open_frame(&theirs.receive, 0, header, data[4..].to_vec()).is_err(), "a forged frame passed");
    }
    if let Ok(sealed) = wire::seal(&ours.send, 7, data) {
        let header = [sealed[0], sealed[1], sealed[2], sealed[3]];
        let body = sealed[4..].to_vec();
        assert_eq!(wire::open_frame(&theirs.receive, 7, header, body.clone()).ok().as_deref(), Some(data));
        assert!(wire::open_frame(&theirs.receive, 8, header, body.clone()).is_err(), "replayed at another position");
        assert!(wire::open_frame(&ours.receive, 7, header, body.clone()).is_err(), "reflected");
        if data.len() >= 16 {
            assert!(!sealed.windows(16).any(|w| w == &data[..16]), "plaintext on the wire");
        }
    } else {
        assert!(data.is_empty() || data.len() > wire::MAX_FRAME);
    }
}

fn files_frame(data: &[u8]) {
    let Ok(frame) = files::parse_frame(data) else { return };
    match &frame {
        FilesFrame::Data(d) => assert!((1..=files::CHUNK).contains(&d.len())),
        FilesFrame::Zeros(n) => assert!((1..=files::CHUNK as u64).contains(n)),
        FilesFrame::Trailer(sha) => assert!(sha.len() == 64),
        FilesFrame::Header(_) | FilesFrame::End => {}
    }
    let encoded = frame.encode();
    assert_eq!(files::parse_frame(&encoded).as_ref(), Ok(&frame), "accepted once, refused back");
}

fn control_json(data: &[u8]) {
    let Ok(msg) = serde_json::from_slice::<ControlMsg>(data) else { return };
    let json = serde_json::to_vec(&msg).unwrap_or_else(|e| panic!("an accepted message serializes: {e}"));
    let again: ControlMsg =
        serde_json::from_slice(&json).unwrap_or_else(|e| panic!("accepted once, refused back: {e}"));
    assert_eq!(again, msg);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        assert!(crate::fuzz::replay("migration_wire", wire_bytes) >= 5, "the seed corpus is committed");
    }
}
