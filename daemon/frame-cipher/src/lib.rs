//! The AEAD of vmhost's migration streams (ChaCha20-Poly1305, RFC 8439, from RustCrypto's
//! `chacha20poly1305`), behind two non-generic functions.
//!
//! Why a crate of its own: Rust instantiates a generic function in the crate that calls it with
//! concrete types, under that crate's optimisation level. Called from vmhostd, the cipher's code
//! would be built unoptimised in the debug builds the tests run (about 5 MiB/s, too slow to move
//! a disk); here it is instantiated once, in a crate the workspace's dev profile optimises.
//!
//! Order: [`Key::new`] once per key, then [`Key::seal`] / [`Key::open`] per message.

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Nonce, Tag};

/// Length of a tag.
pub const TAG_LEN: usize = 16;

/// A ChaCha20-Poly1305 key.
#[derive(Clone)]
pub struct Key(ChaCha20Poly1305);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key bytes.
        f.write_str("Key(..)")
    }
}

/// The message did not open: its tag does not match its bytes, nonce, associated data and key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotAuthentic;

impl Key {
    /// The key made of these 32 bytes.
    pub fn new(key: &[u8; 32]) -> Key {
        Key(ChaCha20Poly1305::new(key.into()))
    }

    /// Encrypts `buf` in place under `nonce`, authenticating it and `aad`; returns the tag.
    pub fn seal(&self, nonce: &[u8; 12], aad: &[u8], buf: &mut [u8]) -> [u8; TAG_LEN] {
        // Errors only for a message longer than 256 GiB (the counter's range): never a frame.
        match self.0.encrypt_in_place_detached(Nonce::from_slice(nonce), aad, buf) {
            Ok(tag) => tag.into(),
            Err(_) => unreachable!("a message within ChaCha20's 256 GiB"),
        }
    }

    /// Checks `tag` over `buf`, `nonce` and `aad`, then decrypts `buf` in place.
    ///
    /// # Errors
    /// [`NotAuthentic`] when the tag does not match (then `buf` is left as it was).
    pub fn open(&self, nonce: &[u8; 12], aad: &[u8], buf: &mut [u8], tag: &[u8; TAG_LEN]) -> Result<(), NotAuthentic> {
        self.0
            .decrypt_in_place_detached(Nonce::from_slice(nonce), aad, buf, Tag::from_slice(tag))
            .map_err(|_| NotAuthentic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_8439_section_2_8_2() {
        let key: Vec<u8> = (0x80u8..=0x9f).collect();
        let key = Key::new(key.as_slice().try_into().unwrap());
        let nonce = [0x07, 0, 0, 0, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47];
        let aad = [0x50, 0x51, 0x52, 0x53, 0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7];
        let plain = b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, sunscreen would be it.";
        let mut buf = plain.to_vec();
        let tag = key.seal(&nonce, &aad, &mut buf);
        assert_eq!(
            tag,
            [0x1a, 0xe1, 0x0b, 0x59, 0x4f, 0x09, 0xe2, 0x6a, 0x7e, 0x90, 0x2e, 0xcb, 0xd0, 0x60, 0x06, 0x91]
        );
        assert_eq!(&buf[..4], &[0xd3, 0x1a, 0x8d, 0x34]);
        let sealed = buf.clone();
        key.open(&nonce, &aad, &mut buf, &tag).unwrap();
        assert_eq!(buf, plain);
        let mut tampered = sealed.clone();
        tampered[0] ^= 1;
        assert_eq!(key.open(&nonce, &aad, &mut tampered, &tag), Err(NotAuthentic));
        assert_eq!(tampered[1..], sealed[1..], "a refused message was changed");
        let mut again = sealed;
        assert_eq!(key.open(&nonce, &aad[1..], &mut again, &tag), Err(NotAuthentic));
    }
}
