//! The one-time secret of a migration: made by the destination's `vm.migrate_in`, carried by
//! the operator (or the fleet tool) to the source, and the key of every proof and MAC on the
//! migration port. QEMU never sees it: its TLS key is derived ([`Secret::tls_psk_hex`]).
//!
//! Order of use: [`Secret::generate`] (destination) or [`Secret::parse`] (source, a record
//! read back), then [`Secret::mac`] for the wire's proofs and frames.

use super::MigrationError;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A one-time migration secret: 32 random bytes, written as 64 hex digits.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub(super) [u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the digits: a Debug of a record or params must not leak the key into a log.
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A new random secret.
    ///
    /// # Errors
    /// When the kernel's random source fails.
    pub fn generate() -> Result<Secret, MigrationError> {
        Ok(Secret(random_32()?))
    }

    /// Parses 64 hex digits (either case).
    ///
    /// # Errors
    /// [`MigrationError::BadSecret`] when `hex` is not 64 hex digits.
    pub fn parse(hex: &str) -> Result<Secret, MigrationError> {
        let bytes = hex.as_bytes();
        if bytes.len() != 64 {
            return Err(MigrationError::BadSecret);
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            let (Some(hi), Some(lo)) = (hex_digit(pair[0]), hex_digit(pair[1])) else {
                return Err(MigrationError::BadSecret);
            };
            out[i] = (hi << 4) | lo;
        }
        Ok(Secret(out))
    }

    /// The 64 hex digits.
    pub fn to_hex(&self) -> String {
        to_hex(&self.0)
    }

    /// The key QEMU's TLS uses (hex), derived from the secret so QEMU never holds the secret.
    pub fn tls_psk_hex(&self) -> String {
        to_hex(&self.mac(&[b"vmhost-qemu-tls-psk"]))
    }

    /// HMAC-SHA256 keyed with the secret over the concatenation of `parts`.
    pub(crate) fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        let mut m = self.hmac();
        for p in parts {
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }

    /// Whether `tag` is the HMAC of `parts`, compared in constant time.
    pub(crate) fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut m = self.hmac();
        for p in parts {
            m.update(p);
        }
        m.verify_slice(tag).is_ok()
    }

    fn hmac(&self) -> HmacSha256 {
        // HMAC takes a key of any length: new_from_slice cannot fail for 32 bytes.
        match HmacSha256::new_from_slice(&self.0) {
            Ok(m) => m,
            Err(_) => unreachable!("HMAC accepts keys of any length"),
        }
    }
}

/// 32 bytes from the kernel's random source (nonces and secrets).
///
/// # Errors
/// [`MigrationError::Random`] when getrandom fails.
pub(crate) fn random_32() -> Result<[u8; 32], MigrationError> {
    let mut out = [0u8; 32];
    getrandom::fill(&mut out).map_err(|e| MigrationError::Random(e.to_string()))?;
    Ok(out)
}

/// Lower-case hex of `bytes`.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trips_and_refuses_malformed() {
        let s = Secret::generate().unwrap();
        assert_eq!(Secret::parse(&s.to_hex()).unwrap(), s);
        assert_eq!(Secret::parse(&s.to_hex().to_uppercase()).unwrap(), s);
        let good = "00".repeat(32);
        assert!(Secret::parse(&good).is_ok());
        for bad in [
            "",
            "0",
            &"0".repeat(63),
            &"0".repeat(65),
            &format!("{}g", "0".repeat(63)),
            &format!("{}é", "0".repeat(62)),
        ] {
            assert!(matches!(Secret::parse(bad), Err(MigrationError::BadSecret)), "{bad:?}");
        }
    }

    #[test]
    fn two_secrets_differ_and_debug_hides_the_digits() {
        let (a, b) = (Secret::generate().unwrap(), Secret::generate().unwrap());
        assert_ne!(a, b);
        assert_eq!(format!("{a:?}"), "Secret(..)");
    }

    #[test]
    fn tls_key_is_the_rfc_4231_hmac_and_not_the_secret() {
        // RFC 4231 test case 2 checks the HMAC itself with a short key; here the key is 32
        // bytes of 0x0b, so compare against a second, independent computation instead.
        let s = Secret([0x0b; 32]);
        let psk = s.tls_psk_hex();
        assert_eq!(psk.len(), 64);
        assert_ne!(psk, s.to_hex());
        assert_eq!(psk, to_hex(&s.mac(&[b"vmhost-qemu-", b"tls-psk"])));
        assert!(s.verify(&[b"vmhost-qemu-tls-psk"], &s.mac(&[b"vmhost-qemu-tls-psk"])));
        assert!(!s.verify(&[b"vmhost-qemu-tls-psk"], &[0u8; 32]));
    }
}
