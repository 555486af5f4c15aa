//! The migration port's wire, as pure functions: what a stream's opening exchange and the
//! control channel's frames look like, so they can be unit-tested and fuzzed without sockets
//! (the socket side is [`super::listener`], [`super::connect`] and [`super::control`]).
//!
//! Order on a stream: the server sends [`GREETING`] and a nonce; the client answers one
//! [`encode_open`] line carrying [`proof`]; the server reads it with [`parse_open`], checks it
//! with [`verify_proof`] and answers [`OK`] or [`REFUSED`]. On an authenticated stream that is
//! framed ([`super::Control`], [`super::files`]): each side sends a [`NONCE_LEN`]-byte nonce,
//! then frames made by [`seal`] and read with [`frame_len`] and [`open_frame`].

use super::{ChannelKind, Secret};

/// What the server sends first, before its nonce.
pub const GREETING: &[u8] = b"VMHOST-MIGRATE/1\n";
/// Length of the server's nonce and of each side's frame nonce.
pub const NONCE_LEN: usize = 32;
/// Longest opening line (JSON plus `\n`).
pub const MAX_OPEN_LINE: usize = 1024;
/// The server's answer to a good proof.
pub const OK: &[u8] = b"ok\n";
/// The server's answer to anything else (then it closes).
pub const REFUSED: &[u8] = b"refused\n";
/// Longest frame payload (JSON).
pub const MAX_FRAME: usize = 1024 * 1024;
/// Length of a frame's MAC.
pub const MAC_LEN: usize = 32;
/// Longest export name in a `disk:EXPORT` channel.
pub const MAX_EXPORT_LEN: usize = 64;

const PROOF_CONTEXT: &[u8] = b"vmhost-migrate-v1\0";
const FRAME_CONTEXT: &[u8] = b"vmhost-migrate-frame-v1\0";

/// Why bytes from a peer are not the wire.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The opening line is not the JSON object the wire defines.
    #[error("malformed opening line: {0}")]
    Open(String),
    /// The opening line names no valid VM.
    #[error("invalid VM name")]
    VmName,
    /// The opening line names no channel the wire knows.
    #[error("unknown channel {0:?}")]
    Channel(String),
    /// The proof is not 64 hex digits.
    #[error("malformed proof")]
    ProofFormat,
    /// A frame is longer than [`MAX_FRAME`] (or empty).
    #[error("frame of {0} bytes (at most {MAX_FRAME})")]
    FrameLength(usize),
    /// A frame's MAC does not match: injected, replayed, reordered or corrupted.
    #[error("frame not authentic (wrong MAC or out of sequence)")]
    FrameMac,
    /// Both sides sent the same nonce: a reflected stream.
    #[error("the peer sent our own nonce back")]
    Reflected,
}

/// What a client's opening line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// The VM.
    pub vm: String,
    /// The channel.
    pub channel: ChannelKind,
    /// HMAC-SHA256 over the server's nonce, the VM and the channel ([`proof`]).
    pub proof: [u8; 32],
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenJson {
    vm: String,
    channel: String,
    proof: String,
}

impl ChannelKind {
    /// The channel as the opening line names it.
    pub fn as_wire(&self) -> String {
        match self {
            ChannelKind::Control => "control".into(),
            ChannelKind::Ram => "ram".into(),
            ChannelKind::Files => "files".into(),
            ChannelKind::Disk(export) => format!("disk:{export}"),
        }
    }

    /// Parses a channel name of the opening line.
    ///
    /// # Errors
    /// [`WireError::Channel`] for anything else (a `disk:` export must be 1 to
    /// [`MAX_EXPORT_LEN`] of `A-Z a-z 0-9 - _ .`).
    pub fn from_wire(s: &str) -> Result<ChannelKind, WireError> {
        match s {
            "control" => Ok(ChannelKind::Control),
            "ram" => Ok(ChannelKind::Ram),
            "files" => Ok(ChannelKind::Files),
            _ => match s.strip_prefix("disk:") {
                Some(e)
                    if !e.is_empty()
                        && e.len() <= MAX_EXPORT_LEN
                        && e.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) =>
                {
                    Ok(ChannelKind::Disk(e.to_string()))
                }
                _ => Err(WireError::Channel(s.chars().take(80).collect())),
            },
        }
    }
}

/// The proof a client sends for VM `vm`'s channel `channel` after the server's `nonce`.
pub fn proof(secret: &Secret, nonce: &[u8; NONCE_LEN], vm: &str, channel: &ChannelKind) -> [u8; 32] {
    secret.mac(&[PROOF_CONTEXT, nonce, vm.as_bytes(), b"\0", channel.as_wire().as_bytes()])
}

/// Whether `open`'s proof is right for `secret` and `nonce` (constant time).
pub fn verify_proof(secret: &Secret, nonce: &[u8; NONCE_LEN], open: &Open) -> bool {
    secret.verify(&[PROOF_CONTEXT, nonce, open.vm.as_bytes(), b"\0", open.channel.as_wire().as_bytes()], &open.proof)
}

/// The client's opening line, `\n` included.
pub fn encode_open(vm: &str, channel: &ChannelKind, proof: &[u8; 32]) -> Vec<u8> {
    let json = OpenJson { vm: vm.into(), channel: channel.as_wire(), proof: super::secret::to_hex(proof) };
    let mut line = serde_json::to_vec(&json).unwrap_or_default();
    line.push(b'\n');
    line
}

/// Parses an opening line (without its `\n`).
///
/// # Errors
/// [`WireError`] saying what is wrong.
pub fn parse_open(line: &[u8]) -> Result<Open, WireError> {
    if line.len() >= MAX_OPEN_LINE {
        return Err(WireError::Open("too long".into()));
    }
    let json: OpenJson = serde_json::from_slice(line).map_err(|e| WireError::Open(e.to_string()))?;
    if !crate::validate::is_valid_name(&json.vm) {
        return Err(WireError::VmName);
    }
    let channel = ChannelKind::from_wire(&json.channel)?;
    let proof = Secret::parse(&json.proof).map_err(|_| WireError::ProofFormat)?.0;
    Ok(Open { vm: json.vm, channel, proof })
}

/// A frame's payload length from its 4-byte big-endian header.
///
/// # Errors
/// [`WireError::FrameLength`] when it is 0 or above [`MAX_FRAME`].
pub fn frame_len(header: [u8; 4]) -> Result<usize, WireError> {
    let n = u32::from_be_bytes(header) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(WireError::FrameLength(n));
    }
    Ok(n)
}

/// One frame: length, `payload`, MAC over both nonces (the sender's first: that is the
/// direction), the sender's sequence number and the payload.
///
/// # Errors
/// [`WireError::FrameLength`] when `payload` is empty or above [`MAX_FRAME`].
pub fn seal(
    secret: &Secret,
    sender_nonce: &[u8; NONCE_LEN],
    receiver_nonce: &[u8; NONCE_LEN],
    seq: u64,
    payload: &[u8],
) -> Result<Vec<u8>, WireError> {
    if payload.is_empty() || payload.len() > MAX_FRAME {
        return Err(WireError::FrameLength(payload.len()));
    }
    let mac = secret.mac(&[FRAME_CONTEXT, sender_nonce, receiver_nonce, &seq.to_be_bytes(), payload]);
    let mut out = Vec::with_capacity(4 + payload.len() + MAC_LEN);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&mac);
    Ok(out)
}

/// Checks a frame's body (the payload and MAC after the header) as the `seq`th frame from the
/// sender of `sender_nonce`; returns the payload.
///
/// # Errors
/// [`WireError::FrameMac`] when the MAC does not match (including any other sequence number or
/// direction), [`WireError::FrameLength`] when the body is shorter than a MAC or too long.
pub fn open_frame<'a>(
    secret: &Secret,
    sender_nonce: &[u8; NONCE_LEN],
    receiver_nonce: &[u8; NONCE_LEN],
    seq: u64,
    body: &'a [u8],
) -> Result<&'a [u8], WireError> {
    if body.len() <= MAC_LEN || body.len() > MAX_FRAME + MAC_LEN {
        return Err(WireError::FrameLength(body.len().saturating_sub(MAC_LEN)));
    }
    let (payload, mac) = body.split_at(body.len() - MAC_LEN);
    if !secret.verify(&[FRAME_CONTEXT, sender_nonce, receiver_nonce, &seq.to_be_bytes(), payload], mac) {
        return Err(WireError::FrameMac);
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Secret {
        Secret([7; 32])
    }

    #[test]
    fn open_line_round_trips_and_proof_verifies() {
        let nonce = [3u8; NONCE_LEN];
        for kind in [ChannelKind::Control, ChannelKind::Ram, ChannelKind::Files, ChannelKind::Disk("virtio0".into())] {
            let p = proof(&secret(), &nonce, "web-1", &kind);
            let line = encode_open("web-1", &kind, &p);
            assert_eq!(line.last(), Some(&b'\n'));
            assert!(line.len() < MAX_OPEN_LINE);
            let open = parse_open(&line[..line.len() - 1]).unwrap();
            assert_eq!(open, Open { vm: "web-1".into(), channel: kind.clone(), proof: p });
            assert!(verify_proof(&secret(), &nonce, &open));
        }
    }

    #[test]
    fn a_proof_is_bound_to_secret_nonce_vm_and_channel() {
        let nonce = [3u8; NONCE_LEN];
        let p = proof(&secret(), &nonce, "web-1", &ChannelKind::Ram);
        let ok = Open { vm: "web-1".into(), channel: ChannelKind::Ram, proof: p };
        assert!(verify_proof(&secret(), &nonce, &ok));
        assert!(!verify_proof(&Secret([8; 32]), &nonce, &ok));
        assert!(!verify_proof(&secret(), &[4u8; NONCE_LEN], &ok));
        assert!(!verify_proof(&secret(), &nonce, &Open { vm: "web-2".into(), ..ok.clone() }));
        assert!(!verify_proof(&secret(), &nonce, &Open { channel: ChannelKind::Control, ..ok.clone() }));
        // "a" + "\0" + "bc" must not prove "a\0b" + "c": the VM name cannot hold a NUL.
        assert!(parse_open(br#"{"vm":"a\u0000b","channel":"ram","proof":""}"#).is_err());
    }

    #[test]
    fn malformed_opening_lines_are_refused() {
        let hex = "00".repeat(32);
        let cases: Vec<(String, WireError)> = vec![
            ("".into(), WireError::Open(String::new())),
            ("{".into(), WireError::Open(String::new())),
            (format!(r#"{{"vm":"a","channel":"ram","proof":"{hex}","x":1}}"#), WireError::Open(String::new())),
            (format!(r#"{{"vm":"A b","channel":"ram","proof":"{hex}"}}"#), WireError::VmName),
            (format!(r#"{{"vm":"a","channel":"disk:","proof":"{hex}"}}"#), WireError::Channel(String::new())),
            (format!(r#"{{"vm":"a","channel":"disk:../x","proof":"{hex}"}}"#), WireError::Channel(String::new())),
            (
                format!(r#"{{"vm":"a","channel":"disk:{}","proof":"{hex}"}}"#, "e".repeat(65)),
                WireError::Channel(String::new()),
            ),
            (format!(r#"{{"vm":"a","channel":"video","proof":"{hex}"}}"#), WireError::Channel(String::new())),
            (r#"{"vm":"a","channel":"ram","proof":"zz"}"#.into(), WireError::ProofFormat),
            (
                format!(r#"{{"vm":"{}","channel":"ram","proof":"{hex}"}}"#, "a".repeat(2000)),
                WireError::Open(String::new()),
            ),
        ];
        for (line, want) in cases {
            let got = parse_open(line.as_bytes()).expect_err(&line);
            assert_eq!(std::mem::discriminant(&got), std::mem::discriminant(&want), "{line}: {got}");
        }
        assert_eq!(
            parse_open(format!(r#"{{"vm":"a","channel":"disk:data-x_1.2","proof":"{hex}"}}"#).as_bytes())
                .unwrap()
                .channel,
            ChannelKind::Disk("data-x_1.2".into())
        );
    }

    #[test]
    fn frames_check_mac_sequence_and_direction() {
        let (a, b) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let frame = seal(&secret(), &a, &b, 5, b"{\"msg\":\"commit\"}").unwrap();
        let len = frame_len(frame[..4].try_into().unwrap()).unwrap();
        let body = &frame[4..];
        assert_eq!(body.len(), len + MAC_LEN);
        assert_eq!(open_frame(&secret(), &a, &b, 5, body).unwrap(), b"{\"msg\":\"commit\"}");
        // Replayed (another sequence number), reflected (the other direction), another key,
        // another channel's nonces, a flipped byte: all refused.
        assert_eq!(open_frame(&secret(), &a, &b, 6, body), Err(WireError::FrameMac));
        assert_eq!(open_frame(&secret(), &a, &b, 4, body), Err(WireError::FrameMac));
        assert_eq!(open_frame(&secret(), &b, &a, 5, body), Err(WireError::FrameMac));
        assert_eq!(open_frame(&Secret([9; 32]), &a, &b, 5, body), Err(WireError::FrameMac));
        assert_eq!(open_frame(&secret(), &a, &[3; NONCE_LEN], 5, body), Err(WireError::FrameMac));
        let mut flipped = body.to_vec();
        flipped[3] ^= 1;
        assert_eq!(open_frame(&secret(), &a, &b, 5, &flipped), Err(WireError::FrameMac));
        assert!(matches!(open_frame(&secret(), &a, &b, 5, &body[..MAC_LEN]), Err(WireError::FrameLength(_))));
    }

    #[test]
    fn frame_lengths_are_bounded() {
        assert_eq!(frame_len(0u32.to_be_bytes()), Err(WireError::FrameLength(0)));
        assert_eq!(frame_len((MAX_FRAME as u32).to_be_bytes()), Ok(MAX_FRAME));
        assert!(frame_len((MAX_FRAME as u32 + 1).to_be_bytes()).is_err());
        assert!(frame_len(u32::MAX.to_be_bytes()).is_err());
        assert!(seal(&secret(), &[0; NONCE_LEN], &[1; NONCE_LEN], 0, b"").is_err());
        assert!(seal(&secret(), &[0; NONCE_LEN], &[1; NONCE_LEN], 0, &vec![b' '; MAX_FRAME + 1]).is_err());
    }
}
