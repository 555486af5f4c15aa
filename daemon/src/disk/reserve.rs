//! Disk-space reservations: what running imports, snapshots and exports will still write, by
//! file system, so that two of them cannot both be admitted against the same free space.
//!
//! A free-space check alone is not enough: two operations that each fit alone both see the
//! same free space, both start, and together fill the disk. So each reserves what it will
//! write (its estimate) before it writes a byte, and is refused (3002) when that does not fit
//! next to what the others still hold: a share of the free space (the same margin a lone
//! operation gets) less what the others have reserved and not written yet. The reservation is
//! an RAII guard ([`Reservation`]): it goes when the operation ends, however it ends.
//!
//! Reservations are keyed by the file system's device (`st_dev` of the directory written),
//! so an export to a backups disk and an image import to the state disk do not hold each
//! other back. An operation that can say what it has written so far ([`Reservation::wrote`],
//! fed by [`crate::images::Temp`]) holds only the rest: those bytes are in the free space the
//! next check reads already. One that cannot (a copy QEMU makes) holds all of it until it ends:
//! counted twice meanwhile, on the safe side.
//!
//! [`Book`] is the pure accounting, tested exhaustively; [`Ledger`] wraps it with the
//! `statvfs` read, under its lock so that no two admissions interleave.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

/// A file system's size and free space, as `statvfs` reads them. Here rather than in
/// [`super::space`], which builds on the ledger: the ledger needs the read, not the admission
/// rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    /// Its size in bytes.
    pub total: u64,
    /// Bytes an unprivileged writer may still use (`f_bavail`).
    pub free: u64,
}

impl FsSpace {
    /// The file system holding `path`.
    ///
    /// # Errors
    /// `statvfs` failed.
    pub fn of(path: &Path) -> std::io::Result<FsSpace> {
        let st = nix::sys::statvfs::statvfs(path)?;
        let frsize = st.fragment_size();
        Ok(FsSpace { total: st.blocks().saturating_mul(frsize), free: st.blocks_available().saturating_mul(frsize) })
    }
}

/// A file system, by device number.
pub type FsId = u64;

/// What one reservation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    /// Bytes reserved.
    bytes: u64,
    /// Bytes written so far (reported by its owner).
    written: u64,
}

impl Held {
    /// What it still holds: the bytes it has not written yet.
    fn outstanding(self) -> u64 {
        self.bytes.saturating_sub(self.written)
    }
}

/// A reservation refused: it asked for more than was available.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes it could have had: the share of the free space less what others hold.
    pub available: u64,
    /// The file system's free space when it was asked.
    pub free: u64,
    /// What other operations held on it then.
    pub reserved: u64,
}

/// The reservations of every file system: pure accounting, no I/O.
#[derive(Debug, Default)]
pub struct Book {
    next: u64,
    held: BTreeMap<(FsId, u64), Held>,
}

/// `percent` % of `free`, rounded down.
fn share(free: u64, percent: u64) -> u64 {
    (u128::from(free) * u128::from(percent) / 100).min(u128::from(u64::MAX)) as u64
}

impl Book {
    /// What the reservations on `fs` still hold (reserved, not yet written).
    pub fn reserved(&self, fs: FsId) -> u64 {
        self.held.range((fs, 0)..=(fs, u64::MAX)).map(|(_, h)| h.outstanding()).fold(0, u64::saturating_add)
    }

    /// What a new reservation on `fs` may take when it has `free` bytes: `percent` % of them
    /// less what the others hold.
    pub fn available(&self, fs: FsId, free: u64, percent: u64) -> u64 {
        share(free, percent).saturating_sub(self.reserved(fs))
    }

    /// Reserves `bytes` on `fs` (with `free` bytes free, `percent` % of them the most all
    /// reservations may take); returns its id. Nothing (0 bytes) always fits.
    ///
    /// # Errors
    /// [`Refused`] when `bytes` exceeds [`Book::available`]; nothing is held then.
    pub fn take(&mut self, fs: FsId, bytes: u64, free: u64, percent: u64) -> Result<u64, Refused> {
        let available = self.available(fs, free, percent);
        if bytes > available {
            return Err(Refused { requested: bytes, available, free, reserved: self.reserved(fs) });
        }
        Ok(self.insert(fs, bytes))
    }

    /// Reserves all that is available on `fs` (a write of unknown length, bounded by what it
    /// got); returns its id and its bytes.
    ///
    /// # Errors
    /// [`Refused`] (asking for 1 byte) when nothing is available.
    pub fn take_rest(&mut self, fs: FsId, free: u64, percent: u64) -> Result<(u64, u64), Refused> {
        let available = self.available(fs, free, percent);
        if available == 0 {
            return Err(Refused { requested: 1, available, free, reserved: self.reserved(fs) });
        }
        Ok((self.insert(fs, available), available))
    }

    fn insert(&mut self, fs: FsId, bytes: u64) -> u64 {
        self.next += 1;
        self.held.insert((fs, self.next), Held { bytes, written: 0 });
        self.next
    }

    /// Counts `bytes` more written by reservation `id` (it then holds that much less).
    pub fn wrote(&mut self, fs: FsId, id: u64, bytes: u64) {
        if let Some(h) = self.held.get_mut(&(fs, id)) {
            h.written = h.written.saturating_add(bytes);
        }
    }

    /// Counts `bytes` of what reservation `id` wrote as gone again (a file emptied to start
    /// over): it holds them once more.
    pub fn freed(&mut self, fs: FsId, id: u64, bytes: u64) {
        if let Some(h) = self.held.get_mut(&(fs, id)) {
            h.written = h.written.saturating_sub(bytes);
        }
    }

    /// Ends reservation `id`.
    pub fn release(&mut self, fs: FsId, id: u64) {
        self.held.remove(&(fs, id));
    }

    /// How many reservations there are (on every file system).
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// Why a reservation could not be made.
#[derive(Debug)]
pub enum Shortfall {
    /// The free space (or the file system's identity) could not be read.
    Io(std::io::Error),
    /// It does not fit.
    Refused(Refused),
}

/// The daemon's reservations (one per daemon: a field of the lifecycle manager).
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    book: Arc<Mutex<Book>>,
}

/// The device and free space of the file system holding `dir`.
fn fs_of(dir: &Path) -> std::io::Result<(FsId, FsSpace)> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir)?.dev();
    Ok((dev, FsSpace::of(dir)?))
}

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `bytes` on the file system holding `dir`, with `percent` % of its free space
    /// the most all reservations there may take.
    ///
    /// # Errors
    /// [`Shortfall::Refused`] when it does not fit next to the others; [`Shortfall::Io`] when
    /// the free space cannot be read.
    pub fn reserve(&self, dir: &Path, bytes: u64, percent: u64) -> Result<Reservation, Shortfall> {
        // The free space is read under the lock: an admission between the read and the take
        // would be counted neither in the one nor in the other.
        let mut book = self.lock();
        let (fs, space) = crate::blocking::run(|| fs_of(dir)).map_err(Shortfall::Io)?;
        let id = book.take(fs, bytes, space.free, percent).map_err(Shortfall::Refused)?;
        Ok(Reservation { book: Arc::clone(&self.book), fs, id, bytes })
    }

    /// Reserves all that is available on the file system holding `dir` (`percent` % of its
    /// free space less what others hold): a write of unknown length is bounded by it.
    ///
    /// # Errors
    /// As [`Ledger::reserve`]; refused when nothing is available.
    pub fn reserve_rest(&self, dir: &Path, percent: u64) -> Result<Reservation, Shortfall> {
        let mut book = self.lock();
        let (fs, space) = crate::blocking::run(|| fs_of(dir)).map_err(Shortfall::Io)?;
        let (id, bytes) = book.take_rest(fs, space.free, percent).map_err(Shortfall::Refused)?;
        Ok(Reservation { book: Arc::clone(&self.book), fs, id, bytes })
    }

    /// The free space of the file system holding `dir` less what reservations there still
    /// hold (for admissions that do not reserve: a create's sparse disks).
    ///
    /// # Errors
    /// The free space cannot be read.
    pub fn space_left(&self, dir: &Path) -> std::io::Result<FsSpace> {
        let book = self.lock();
        let (fs, space) = crate::blocking::run(|| fs_of(dir))?;
        Ok(FsSpace { total: space.total, free: space.free.saturating_sub(book.reserved(fs)) })
    }
}

/// Space held for one operation, released when dropped.
#[derive(Debug)]
pub struct Reservation {
    book: Arc<Mutex<Book>>,
    fs: FsId,
    id: u64,
    bytes: u64,
}

impl Reservation {
    /// The bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Counts `bytes` more written by this operation (the free space shows them now).
    pub fn wrote(&self, bytes: u64) {
        self.book.lock().unwrap_or_else(|p| p.into_inner()).wrote(self.fs, self.id, bytes);
    }

    /// Counts `bytes` this operation wrote as removed again: it holds them once more.
    pub fn freed(&self, bytes: u64) {
        self.book.lock().unwrap_or_else(|p| p.into_inner()).freed(self.fs, self.id, bytes);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.book.lock().unwrap_or_else(|p| p.into_inner()).release(self.fs, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn one_that_fits_alone_does_not_fit_next_to_another() {
        let mut b = Book::default();
        // 100 MiB free, 90 % of it: 90 MiB for all reservations together.
        let first = b.take(1, 60 * MIB, 100 * MIB, 90).unwrap();
        assert_eq!(b.reserved(1), 60 * MIB);
        assert_eq!(b.available(1, 100 * MIB, 90), 30 * MIB);
        let e = b.take(1, 40 * MIB, 100 * MIB, 90).unwrap_err();
        assert_eq!(e, Refused { requested: 40 * MIB, available: 30 * MIB, free: 100 * MIB, reserved: 60 * MIB });
        assert_eq!(b.len(), 1, "a refusal holds nothing");
        assert!(b.take(1, 30 * MIB, 100 * MIB, 90).is_ok(), "exactly what is left fits");
        assert_eq!(b.available(1, 100 * MIB, 90), 0);
        b.release(1, first);
        assert_eq!(b.reserved(1), 30 * MIB);
        assert!(b.take(1, 40 * MIB, 100 * MIB, 90).is_ok(), "released: it fits again");
    }

    #[test]
    fn file_systems_do_not_hold_each_other_back() {
        let mut b = Book::default();
        b.take(1, 90 * MIB, 100 * MIB, 90).unwrap();
        assert!(b.take(1, 1, 100 * MIB, 90).is_err());
        assert!(b.take(2, 90 * MIB, 100 * MIB, 90).is_ok());
        assert_eq!((b.reserved(1), b.reserved(2), b.reserved(3)), (90 * MIB, 90 * MIB, 0));
        // Neighbouring keys: fs 0 and u64::MAX.
        b.take(0, 5, 10, 100).unwrap();
        b.take(u64::MAX, 7, 10, 100).unwrap();
        assert_eq!((b.reserved(0), b.reserved(u64::MAX)), (5, 7));
    }

    #[test]
    fn what_is_written_is_held_no_more() {
        let mut b = Book::default();
        let id = b.take(1, 50 * MIB, 100 * MIB, 90).unwrap();
        b.wrote(1, id, 20 * MIB);
        assert_eq!(b.reserved(1), 30 * MIB);
        // The free space now shows the 20 MiB written.
        assert_eq!(b.available(1, 80 * MIB, 90), 72 * MIB - 30 * MIB);
        b.wrote(1, id, 100 * MIB);
        assert_eq!(b.reserved(1), 0, "more written than reserved holds nothing, never less");
        b.wrote(1, 999, MIB);
        b.wrote(2, id, MIB);
        assert_eq!(b.len(), 1, "an unknown id changes nothing");
    }

    #[test]
    fn what_was_written_and_removed_is_held_again() {
        // A redirect's body written, then the file emptied for the image: the reservation
        // holds all of it again (else a server could spend it on a body thrown away).
        let mut b = Book::default();
        let id = b.take(1, 50 * MIB, 100 * MIB, 90).unwrap();
        b.wrote(1, id, 40 * MIB);
        assert_eq!(b.reserved(1), 10 * MIB);
        b.freed(1, id, 40 * MIB);
        assert_eq!(b.reserved(1), 50 * MIB);
        b.freed(1, id, MIB);
        assert_eq!(b.reserved(1), 50 * MIB, "never more than was reserved");
    }

    #[test]
    fn the_rest_is_all_that_is_available_and_nothing_is_refused() {
        let mut b = Book::default();
        let (id, bytes) = b.take_rest(1, 100 * MIB, 90).unwrap();
        assert_eq!(bytes, 90 * MIB);
        let e = b.take_rest(1, 100 * MIB, 90).unwrap_err();
        assert_eq!((e.requested, e.available, e.reserved), (1, 0, 90 * MIB));
        assert!(b.take(1, 1, 100 * MIB, 90).is_err());
        assert!(b.take(1, 0, 100 * MIB, 90).is_ok(), "nothing always fits");
        b.release(1, id);
        let (_, bytes) = b.take_rest(1, 10, 90).unwrap();
        assert_eq!(bytes, 9);
        assert!(b.take_rest(1, 1, 90).is_err(), "90 % of 1 byte is none");
    }

    #[test]
    fn edges_neither_overflow_nor_go_negative() {
        let mut b = Book::default();
        assert_eq!(b.available(1, u64::MAX, 100), u64::MAX);
        assert_eq!(b.available(1, u64::MAX, 1000), u64::MAX, "a share above 100 % saturates");
        b.take(1, u64::MAX, u64::MAX, 100).unwrap();
        b.take(1, 0, u64::MAX, 100).unwrap();
        assert_eq!(b.reserved(1), u64::MAX);
        assert_eq!(b.available(1, 10, 90), 0, "more held than free: none available, not negative");
        assert_eq!(b.available(1, 0, 90), 0);
        assert!(!b.is_empty() && b.len() == 2);
    }

    #[test]
    fn a_temp_file_emptied_for_a_redirect_holds_its_room_again() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let r = ledger.reserve(dir.path(), MIB, 100).unwrap();
        let fs = r.fs;
        let mut temp = crate::images::Temp::create(dir.path(), "img").unwrap();
        temp.hold(r);
        temp.write(&[7u8; 4096]).unwrap();
        temp.write(&[0u8; 4096]).unwrap();
        assert_eq!(ledger.lock().reserved(fs), MIB - 4096, "zeros are skipped, not written");
        temp.reset().unwrap();
        assert_eq!(ledger.lock().reserved(fs), MIB, "the redirect's body is gone: all of it held again");
        temp.write(&[7u8; 4096]).unwrap();
        assert_eq!(ledger.lock().reserved(fs), MIB - 4096);
    }

    #[test]
    fn a_reservation_goes_when_dropped_and_counts_what_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::default();
        let free = FsSpace::of(dir.path()).unwrap().free;
        assert!(free > 2 * MIB, "the test needs some free space");
        let r = ledger.reserve(dir.path(), MIB, 100).unwrap();
        assert_eq!(r.bytes(), MIB);
        assert_eq!(ledger.lock().reserved(r.fs), MIB);
        r.wrote(MIB / 2);
        assert_eq!(ledger.lock().reserved(r.fs), MIB / 2);
        let fs = r.fs;
        drop(r);
        assert_eq!(ledger.lock().reserved(fs), 0);
        assert!(ledger.lock().is_empty());
        // Everything there is, then nothing more; released, there is room again.
        let all = ledger.reserve_rest(dir.path(), 90).unwrap();
        assert!(all.bytes() > 0);
        // (Others write to this file system too: ask for as much again, which cannot fit.)
        match ledger.reserve(dir.path(), all.bytes(), 90) {
            Err(Shortfall::Refused(e)) => assert_eq!((e.requested, e.reserved), (all.bytes(), all.bytes())),
            other => panic!("{other:?}"),
        }
        drop(all);
        assert!(ledger.reserve(dir.path(), MIB, 90).is_ok());
        assert!(matches!(ledger.reserve(&dir.path().join("none"), 1, 90), Err(Shortfall::Io(_))));
    }
}
