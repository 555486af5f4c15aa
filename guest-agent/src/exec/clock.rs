//! `time.set`: sets the guest's `CLOCK_REALTIME` from the host's, after a revert, a resume or
//! on request (the guest's clock stood still or went back with the snapshot).
//!
//! Order of use: the session calls [`time_set`] with the system's [`Clock`] ([`SystemClock`]);
//! tests pass their own so that they never set the machine's clock. The host's time is taken
//! when it sent the request, so the guest ends up behind by the request's transit time
//! (microseconds over virtio-serial): good enough for logs and TLS, not a replacement for NTP.

use std::io;

use vmhost_agent_protocol::exec::{TimeSetParams, TimeSetReply};

use crate::protocol::RpcError;

/// Reads and sets the real-time clock.
pub trait Clock {
    /// Nanoseconds since the epoch.
    ///
    /// # Errors
    /// The `clock_gettime` error.
    fn now_ns(&self) -> io::Result<u64>;
    /// Sets the clock to `ns` nanoseconds since the epoch.
    ///
    /// # Errors
    /// The `clock_settime` error (`EPERM` without `CAP_SYS_TIME`).
    fn set_ns(&self, ns: u64) -> io::Result<()>;
}

/// The kernel's `CLOCK_REALTIME`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ns(&self) -> io::Result<u64> {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime fills the timespec we own.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let secs = u64::try_from(ts.tv_sec).map_err(|_| io::Error::other("clock before 1970"))?;
        Ok(secs * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0))
    }

    fn set_ns(&self, ns: u64) -> io::Result<()> {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(ns / 1_000_000_000)
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
            tv_nsec: libc::c_long::try_from(ns % 1_000_000_000).unwrap_or(0),
        };
        // SAFETY: clock_settime reads the timespec we own.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Earliest time `time.set` accepts: 2000-01-01T00:00:00Z (a zero or tiny value is a host bug).
pub const EARLIEST_NS: u64 = 946_684_800 * 1_000_000_000;

/// Latest: 2262-01-01 (a 64-bit `time_t` holds more, but nanoseconds in a u64 end in 2554 and
/// nothing legitimate is that far ahead).
pub const LATEST_NS: u64 = 9_214_646_400 * 1_000_000_000;

/// Sets `clock` to `params.unix_ns`; answers the clock before and right after.
///
/// # Errors
/// 5100 (`unix_ns`) outside [`EARLIEST_NS`]..=[`LATEST_NS`]; -32603 when the clock cannot be
/// read or set.
pub fn time_set(params: &TimeSetParams, clock: &dyn Clock) -> Result<TimeSetReply, RpcError> {
    if !(EARLIEST_NS..=LATEST_NS).contains(&params.unix_ns) {
        return Err(RpcError::invalid("unix_ns", "unix_ns must be between 2000 and 2262"));
    }
    let before_ns = clock.now_ns().map_err(|e| RpcError::internal(format!("cannot read the clock: {e}")))?;
    clock.set_ns(params.unix_ns).map_err(|e| RpcError::internal(format!("cannot set the clock: {e}")))?;
    let after_ns = clock.now_ns().map_err(|e| RpcError::internal(format!("cannot read the clock: {e}")))?;
    Ok(TimeSetReply { before_ns, after_ns })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::Cell;

    /// A clock that is set, not the machine's.
    #[derive(Debug, Default)]
    pub(crate) struct FakeClock {
        pub(crate) ns: Cell<u64>,
        pub(crate) refuse: bool,
    }

    impl Clock for FakeClock {
        fn now_ns(&self) -> io::Result<u64> {
            Ok(self.ns.get())
        }
        fn set_ns(&self, ns: u64) -> io::Result<()> {
            if self.refuse {
                return Err(io::Error::from_raw_os_error(libc::EPERM));
            }
            self.ns.set(ns);
            Ok(())
        }
    }

    #[test]
    fn the_clock_is_set_and_before_and_after_are_reported() {
        let clock = FakeClock { ns: Cell::new(978_307_200 * 1_000_000_000), refuse: false }; // 2001
        let now = SystemClock.now_ns().unwrap_or(0);
        let reply = time_set(&TimeSetParams { unix_ns: now }, &clock).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((reply.before_ns, reply.after_ns), (978_307_200 * 1_000_000_000, now));
        let field = |ns| {
            time_set(&TimeSetParams { unix_ns: ns }, &clock).err().and_then(|e| e.data).map(|d| d["field"].clone())
        };
        assert_eq!(field(0), Some("unix_ns".into()));
        assert_eq!(field(LATEST_NS + 1), Some("unix_ns".into()));
        let refusing = FakeClock { refuse: true, ..FakeClock::default() };
        let e = time_set(&TimeSetParams { unix_ns: now }, &refusing).err();
        assert!(e.is_some_and(|e| e.code == crate::protocol::INTERNAL_ERROR && e.message.contains("cannot set")));
        assert!(SystemClock.now_ns().unwrap_or(0) >= now, "the machine's clock was only read");
    }
}
