//! The migration port's wire, as pure functions: what a stream's opening exchange and the
//! control channel's frames look like, so they can be unit-tested and fuzzed without sockets
//! (the socket side is [`super::listener`], [`super::connect`] and [`super::control`]).
//!
//! Order on a stream: the server sends [`GREETING`] and a nonce; the client answers one
//! [`encode_open`] line carrying [`proof`]; the server reads it with [`parse_open`], checks it
//! with [`verify_proof`] and answers [`OK`] or [`REFUSED`]. On an authenticated stream that is
//! framed ([`super::Control`], [`super::files`]): each side sends a [`NONCE_LEN`]-byte nonce,
//! both derive the stream's keys with [`frame_keys`], then every frame is made by [`seal`] and
//! read with [`frame_len`] and [`open_frame`]: encrypted and authenticated (ChaCha20-Poly1305),
//! numbered per direction, so nothing on the wire after the opening line is plaintext and a
//! frame is valid on one stream, in one direction, at one position only.

use super::{ChannelKind, Secret};
use vmhost_frame_cipher::Key;

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
/// Length of a frame's authentication tag (Poly1305).
pub const TAG_LEN: usize = vmhost_frame_cipher::TAG_LEN;
/// Longest export name in a `disk:EXPORT` channel.
pub const MAX_EXPORT_LEN: usize = 64;

const PROOF_CONTEXT: &[u8] = b"vmhost-migrate-v1\0";
const FRAME_CONTEXT: &[u8] = b"vmhost-frames-v1\0";

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
    /// A frame's tag does not match: tampered, injected, replayed, reordered, reflected,
    /// spliced from another stream or sealed with another key.
    #[error("frame not authentic (tampered, out of sequence, or another key)")]
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

/// The key of one direction of one framed stream: what [`seal`] and [`open_frame`] use.
#[derive(Clone)]
pub struct FrameKey {
    cipher: Key,
    /// The nonce's first byte: 0 for the side whose nonce sorts first, 1 for the other.
    direction: u8,
}

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key: a Debug of a stream's state must not leak it into a log.
        write!(f, "FrameKey(direction {})", self.direction)
    }
}

/// Both keys of one framed stream, as one side sees them.
#[derive(Debug, Clone)]
pub struct FrameKeys {
    /// Seals what this side sends.
    pub send: FrameKey,
    /// Opens what the peer sends.
    pub receive: FrameKey,
}

/// The keys of a framed stream on which this side sent the nonce `mine` and the peer `theirs`:
/// each direction's key is HMAC-SHA256(secret, `vmhost-frames-v1\0` || sender's nonce ||
/// receiver's nonce), so a key belongs to one stream (both nonces are fresh) and one direction.
///
/// # Errors
/// [`WireError::Reflected`] when both nonces are equal (our own bytes sent back).
pub fn frame_keys(secret: &Secret, mine: &[u8; NONCE_LEN], theirs: &[u8; NONCE_LEN]) -> Result<FrameKeys, WireError> {
    if mine == theirs {
        return Err(WireError::Reflected);
    }
    let key = |sender: &[u8; NONCE_LEN], receiver: &[u8; NONCE_LEN]| FrameKey {
        cipher: Key::new(&secret.mac(&[FRAME_CONTEXT, sender, receiver])),
        direction: u8::from(sender > receiver),
    };
    Ok(FrameKeys { send: key(mine, theirs), receive: key(theirs, mine) })
}

/// The AEAD nonce of a direction's `seq`th frame: direction byte, three zeros, `seq` (u64 BE).
fn aead_nonce(key: &FrameKey, seq: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[0] = key.direction;
    n[4..].copy_from_slice(&seq.to_be_bytes());
    n
}

/// The length of a frame's body (ciphertext and tag) from its 4-byte big-endian header.
///
/// # Errors
/// [`WireError::FrameLength`] when the payload it implies is empty or above [`MAX_FRAME`].
pub fn frame_len(header: [u8; 4]) -> Result<usize, WireError> {
    let n = u32::from_be_bytes(header) as usize;
    if n <= TAG_LEN || n > MAX_FRAME + TAG_LEN {
        return Err(WireError::FrameLength(n.saturating_sub(TAG_LEN)));
    }
    Ok(n)
}

/// One frame: the body's length (4 bytes, big-endian), then `payload` encrypted and
/// authenticated with `key` as that direction's `seq`th frame (ChaCha20-Poly1305; the header is
/// authenticated too), then the 16-byte tag.
///
/// # Errors
/// [`WireError::FrameLength`] when `payload` is empty or above [`MAX_FRAME`].
pub fn seal(key: &FrameKey, seq: u64, payload: &[u8]) -> Result<Vec<u8>, WireError> {
    if payload.is_empty() || payload.len() > MAX_FRAME {
        return Err(WireError::FrameLength(payload.len()));
    }
    let header = ((payload.len() + TAG_LEN) as u32).to_be_bytes();
    let mut out = Vec::with_capacity(4 + payload.len() + TAG_LEN);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    let tag = key.cipher.seal(&aead_nonce(key, seq), &header, &mut out[4..]);
    out.extend_from_slice(&tag);
    Ok(out)
}

/// Opens a frame's `body` (what follows `header`) as the `seq`th frame of the direction `key`
/// opens; returns the payload.
///
/// # Errors
/// [`WireError::FrameMac`] when it is not authentic: tampered, injected, replayed, reordered,
/// reflected, from another stream or under another key (they are one case: the tag does not
/// match); [`WireError::FrameLength`] when `header` and `body` disagree or are out of bounds.
pub fn open_frame(key: &FrameKey, seq: u64, header: [u8; 4], mut body: Vec<u8>) -> Result<Vec<u8>, WireError> {
    let len = frame_len(header)?;
    if body.len() != len {
        return Err(WireError::FrameLength(body.len().saturating_sub(TAG_LEN)));
    }
    let mut tag = [0u8; TAG_LEN];
    tag.copy_from_slice(&body[len - TAG_LEN..]);
    body.truncate(len - TAG_LEN);
    key.cipher.open(&aead_nonce(key, seq), &header, &mut body, &tag).map_err(|_| WireError::FrameMac)?;
    Ok(body)
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

    fn keys(secret: &Secret) -> (FrameKeys, FrameKeys) {
        let (a, b) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        (frame_keys(secret, &a, &b).unwrap(), frame_keys(secret, &b, &a).unwrap())
    }

    fn split(frame: &[u8]) -> ([u8; 4], Vec<u8>) {
        (frame[..4].try_into().unwrap(), frame[4..].to_vec())
    }

    #[test]
    fn a_sealed_frame_opens_at_its_position_only() {
        let (a, b) = keys(&secret());
        let frame = seal(&a.send, 5, b"{\"msg\":\"commit\"}").unwrap();
        let (header, body) = split(&frame);
        assert_eq!(frame_len(header).unwrap(), body.len());
        assert_eq!(body.len(), 16 + TAG_LEN);
        assert_eq!(open_frame(&b.receive, 5, header, body.clone()).unwrap(), b"{\"msg\":\"commit\"}");
        // Replayed or reordered (another sequence number): refused.
        assert_eq!(open_frame(&b.receive, 6, header, body.clone()), Err(WireError::FrameMac));
        assert_eq!(open_frame(&b.receive, 4, header, body.clone()), Err(WireError::FrameMac));
        // Reflected: our own frame back to us opens with neither of our keys.
        assert_eq!(open_frame(&a.receive, 5, header, body.clone()), Err(WireError::FrameMac));
        // Another secret, another stream's nonces: refused.
        let (_, other) = keys(&Secret([9; 32]));
        assert_eq!(open_frame(&other.receive, 5, header, body.clone()), Err(WireError::FrameMac));
        let spliced = frame_keys(&secret(), &[2u8; NONCE_LEN], &[3u8; NONCE_LEN]).unwrap();
        assert_eq!(open_frame(&spliced.receive, 5, header, body.clone()), Err(WireError::FrameMac));
        // Any byte flipped, in the ciphertext, the tag or the header: refused.
        for i in 0..body.len() {
            let mut t = body.clone();
            t[i] ^= 0x20;
            assert_eq!(open_frame(&b.receive, 5, header, t), Err(WireError::FrameMac), "byte {i}");
        }
        let mut h = frame.clone();
        h[3] ^= 1;
        let (h, hb) = split(&h);
        assert!(open_frame(&b.receive, 5, h, hb).is_err());
        // Truncated: refused before any decryption.
        assert!(matches!(
            open_frame(&b.receive, 5, header, body[..body.len() - 1].to_vec()),
            Err(WireError::FrameLength(_))
        ));
    }

    #[test]
    fn the_bytes_on_the_wire_are_not_the_payload() {
        let (a, _) = keys(&secret());
        let marker = b"MARKER-cloud-init-user-data-MARKER";
        let frame = seal(&a.send, 0, marker).unwrap();
        assert!(!frame.windows(8).any(|w| marker.windows(8).any(|m| m == w)), "plaintext on the wire");
        // The same payload at the next position is other bytes (a fresh nonce per frame).
        assert_ne!(seal(&a.send, 1, marker).unwrap()[4..], frame[4..]);
    }

    #[test]
    fn the_two_directions_and_two_streams_have_different_keys() {
        let (a, b) = keys(&secret());
        assert_eq!((a.send.direction, b.send.direction), (0, 1));
        let x = seal(&a.send, 0, b"x").unwrap();
        let y = seal(&b.send, 0, b"x").unwrap();
        assert_ne!(x, y, "both directions sealed alike");
        assert_eq!(frame_keys(&secret(), &[4; NONCE_LEN], &[4; NONCE_LEN]).err(), Some(WireError::Reflected));
    }

    #[test]
    fn frame_lengths_are_bounded() {
        assert_eq!(frame_len(0u32.to_be_bytes()), Err(WireError::FrameLength(0)));
        assert!(frame_len((TAG_LEN as u32).to_be_bytes()).is_err(), "an empty payload");
        assert_eq!(frame_len((TAG_LEN as u32 + 1).to_be_bytes()), Ok(TAG_LEN + 1));
        assert_eq!(frame_len(((MAX_FRAME + TAG_LEN) as u32).to_be_bytes()), Ok(MAX_FRAME + TAG_LEN));
        assert!(frame_len(((MAX_FRAME + TAG_LEN) as u32 + 1).to_be_bytes()).is_err());
        assert!(frame_len(u32::MAX.to_be_bytes()).is_err());
        let (a, b) = keys(&secret());
        assert!(seal(&a.send, 0, b"").is_err());
        assert!(seal(&a.send, 0, &vec![b' '; MAX_FRAME + 1]).is_err());
        let big = seal(&a.send, 0, &vec![b' '; MAX_FRAME]).unwrap();
        let (h, body) = split(&big);
        assert_eq!(open_frame(&b.receive, 0, h, body).unwrap().len(), MAX_FRAME);
    }
}
