//! The smallest guests: a raw base image whose only content is a hand-assembled 512-byte boot
//! sector, run by SeaBIOS with no kernel at all. Cheap to run by the dozen (the stats benchmark)
//! and exact about what they do (the metrics test: a guest that writes its disk in a loop).
//!
//! Use: [`write_image`] with [`HALT`] or [`WRITE_LOOP`] into the host's images dir, then a spec
//! with `boot.image` naming it.

use std::path::Path;

/// `hlt; jmp $-1`: an idle guest (TCG sleeps while the vCPU halts).
pub const HALT: &[u8] = &[0xF4, 0xEB, 0xFD];

/// Writes its own sector to sector 2 of the boot disk through the BIOS (`int 13h`, AH=03), for
/// ever: every round is a virtio-blk write request, and the vCPU never idles.
///
/// ```text
/// 31 C0     xor ax, ax
/// 8E D8     mov ds, ax
/// 8E C0     mov es, ax
/// B8 01 03  again: mov ax, 0x0301   ; write 1 sector
/// B9 02 00  mov cx, 0x0002          ; cylinder 0, sector 2
/// BA 80 00  mov dx, 0x0080          ; head 0, first hard disk
/// BB 00 7C  mov bx, 0x7c00          ; from ES:BX, this sector
/// CD 13     int 0x13
/// EB F0     jmp again
/// ```
pub const WRITE_LOOP: &[u8] = &[
    0x31, 0xC0, 0x8E, 0xD8, 0x8E, 0xC0, 0xB8, 0x01, 0x03, 0xB9, 0x02, 0x00, 0xBA, 0x80, 0x00, 0xBB, 0x00, 0x7C, 0xCD,
    0x13, 0xEB, 0xF0,
];

/// Code that writes `text` to the first serial port (COM1, I/O port 0x3F8) and halts: a guest
/// whose console says which disk the BIOS booted.
///
/// ```text
/// 31 C0     xor ax, ax
/// 8E D8     mov ds, ax
/// BE 15 7C  mov si, 0x7c15          ; the text, after the code
/// BA F8 03  mov dx, 0x3f8
/// AC        next: lodsb
/// 84 C0     test al, al
/// 74 03     jz done
/// EE        out dx, al
/// EB F8     jmp next
/// F4        done: hlt
/// EB FD     jmp done
/// ```
///
/// # Panics
/// When `text` holds a NUL byte or does not fit in the sector.
pub fn serial_print(text: &str) -> Vec<u8> {
    assert!(!text.contains('\0') && text.len() < 510 - 22, "{text:?}");
    let mut code = vec![
        0x31, 0xC0, 0x8E, 0xD8, 0xBE, 0x15, 0x7C, 0xBA, 0xF8, 0x03, 0xAC, 0x84, 0xC0, 0x74, 0x03, 0xEE, 0xEB, 0xF8,
        0xF4, 0xEB, 0xFD,
    ];
    code.extend_from_slice(text.as_bytes());
    code.push(0);
    code
}

/// Code that prints `tag` on the first serial port, then the first sector of each further BIOS
/// disk (0x81 to 0x83: the data disks and the seed, in the BIOS's order) up to its first NUL
/// byte, one line each, and halts: a guest that says which image it booted and what its other
/// disks hold, without any OS.
///
/// ```text
/// 31 C0        xor ax, ax
/// 8E D8        mov ds, ax
/// 8E C0        mov es, ax
/// BE 3D 7C     mov si, tag           ; 0x7c00 + 61
/// E8 22 00     call print
/// BF 81 00     mov di, 0x81          ; first disk after the boot disk
/// B8 01 02  L: mov ax, 0x0201        ; read 1 sector
/// B9 01 00     mov cx, 0x0001        ; cylinder 0, sector 1
/// 89 FA        mov dx, di            ; head 0, drive DI
/// BB 00 7E     mov bx, 0x7e00        ; into ES:BX
/// CD 13        int 0x13
/// 72 06        jc N                  ; no such disk
/// BE 00 7E     mov si, 0x7e00
/// E8 0A 00     call print
/// 47        N: inc di
/// 81 FF 84 00  cmp di, 0x84
/// 75 E4        jne L
/// F4        H: hlt
/// EB FD        jmp H
/// BA F8 03  print: mov dx, 0x3f8     ; COM1
/// AC        P: lodsb
/// 84 C0        test al, al
/// 74 03        jz E
/// EE           out dx, al
/// EB F8        jmp P
/// B0 0A     E: mov al, 0x0a
/// EE           out dx, al
/// C3           ret
/// ```
///
/// # Panics
/// When `tag` holds a NUL byte or does not fit in the sector.
pub fn print_disks(tag: &str) -> Vec<u8> {
    let mut code = vec![
        0x31, 0xC0, 0x8E, 0xD8, 0x8E, 0xC0, 0xBE, 0x3D, 0x7C, 0xE8, 0x22, 0x00, 0xBF, 0x81, 0x00, 0xB8, 0x01, 0x02,
        0xB9, 0x01, 0x00, 0x89, 0xFA, 0xBB, 0x00, 0x7E, 0xCD, 0x13, 0x72, 0x06, 0xBE, 0x00, 0x7E, 0xE8, 0x0A, 0x00,
        0x47, 0x81, 0xFF, 0x84, 0x00, 0x75, 0xE4, 0xF4, 0xEB, 0xFD, 0xBA, 0xF8, 0x03, 0xAC, 0x84, 0xC0, 0x74, 0x03,
        0xEE, 0xEB, 0xF8, 0xB0, 0x0A, 0xEE, 0xC3,
    ];
    assert_eq!(code.len(), 61, "the tag's address in the code is 0x7c00 + 61");
    assert!(!tag.contains('\0') && tag.len() < 510 - code.len(), "{tag:?}");
    code.extend_from_slice(tag.as_bytes());
    code.push(0);
    code
}

/// Writes a 1 MiB raw disk image at `path` whose boot sector runs `code`.
///
/// # Panics
/// When the file cannot be written or `code` does not fit before the signature.
pub fn write_image(path: &Path, code: &[u8]) {
    assert!(code.len() <= 510, "a boot sector holds 510 bytes of code");
    let mut image = vec![0u8; 1 << 20];
    image[..code.len()].copy_from_slice(code);
    image[510] = 0x55;
    image[511] = 0xAA;
    std::fs::write(path, image).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}
