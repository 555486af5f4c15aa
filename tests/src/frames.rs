//! Raw Ethernet frames for the capture tests and benchmark (issue 31): build frames a monitored
//! source must copy into a guest, send them through an `AF_PACKET` socket, and read the
//! interface counters that show where they went.
//!
//! Why not scapy or pktgen: this kernel has no pktgen, and a Python stack on a 2-core machine is
//! slower than the thing measured. A packet socket writes exactly the bytes built here, runts and
//! 802.1Q tags included, with no help (or padding) from the kernel's stack.
//!
//! Order of use: [`Rng::new`], then [`random_frames`] (or [`frame`] / [`runt`] for one), then
//! [`Sender::open`] in the namespace the link lives in and [`Sender::send_all`] (or [`send`] in
//! one go); [`counters`] before and after to see the deltas.
//!
//! Every frame has locally administered unicast MAC addresses on both ends (nobody's real MAC,
//! and no multicast that a switch or the guest would treat differently) and the ethertype
//! [`ETHERTYPE`], IEEE's "local experimental" value, which no stack on the way answers.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;

/// IEEE 802 "local experimental ethertype 1": nothing answers it.
pub const ETHERTYPE: u16 = 0x88b5;

/// The 802.1Q tag protocol identifier.
pub const TPID_8021Q: u16 = 0x8100;

/// Length of an Ethernet header without a tag.
pub const ETH_HLEN: usize = 14;

/// Length of a runt: the header and two bytes, far below the 60-byte minimum. A u32 classifier
/// that reads four bytes past the header misses it; a vmhost mirror must not.
pub const RUNT_LEN: usize = ETH_HLEN + 2;

/// A small xorshift64* generator: random MACs and tags per run, no `rand` crate needed. Seeded
/// from the kernel so two runs send different addresses.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from `/dev/urandom` (the clock when that cannot be read).
    pub fn new() -> Rng {
        let mut seed = [0u8; 8];
        let read = fs::File::open("/dev/urandom").and_then(|mut f| io::Read::read_exact(&mut f, &mut seed));
        let seed = if read.is_ok() {
            u64::from_le_bytes(seed)
        } else {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        };
        Rng::seeded(seed)
    }

    /// A generator with a fixed seed (unit tests).
    pub fn seeded(seed: u64) -> Rng {
        // Zero is xorshift's one fixed point.
        Rng(if seed == 0 { 0x9e37_79b9_7f4a_7c15 } else { seed })
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

impl Default for Rng {
    fn default() -> Self {
        Rng::new()
    }
}

/// A random locally administered unicast MAC: bit 1 of the first byte set, bit 0 clear.
pub fn random_mac(rng: &mut Rng) -> [u8; 6] {
    let b = rng.next_u64().to_be_bytes();
    [(b[0] & 0xfc) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

/// `aa:bb:...` form of a MAC.
pub fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// An Ethernet frame `dst` <- `src` of ethertype [`ETHERTYPE`], 802.1Q-tagged with VLAN `vlan`
/// (priority 0) when given, and `payload` bytes of payload (a counting pattern). No padding:
/// the caller decides the length.
pub fn frame(dst: [u8; 6], src: [u8; 6], vlan: Option<u16>, payload: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(ETH_HLEN + 4 + payload);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    if let Some(vid) = vlan {
        f.extend_from_slice(&TPID_8021Q.to_be_bytes());
        f.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
    }
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend((0..payload).map(|i| i as u8));
    f
}

/// A runt of [`RUNT_LEN`] bytes: header and two bytes of payload.
pub fn runt(dst: [u8; 6], src: [u8; 6]) -> Vec<u8> {
    frame(dst, src, None, RUNT_LEN - ETH_HLEN)
}

/// `n` frames with fresh random MACs each: every fourth a runt, the others tagged with one of
/// `vlans` in turn when `vlans` is not empty (else untagged), with 46 to 1000 bytes of payload.
/// What a monitored source must copy into a guest one for one.
pub fn random_frames(rng: &mut Rng, n: usize, vlans: &[u16]) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let (dst, src) = (random_mac(rng), random_mac(rng));
            if i % 4 == 3 {
                return runt(dst, src);
            }
            let vlan = (!vlans.is_empty()).then(|| vlans[i % vlans.len()]);
            frame(dst, src, vlan, 46 + rng.below(955) as usize)
        })
        .collect()
}

/// The VLAN id of a tagged frame, `None` for an untagged one.
pub fn vlan_of(frame: &[u8]) -> Option<u16> {
    let tpid = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    (tpid == TPID_8021Q).then(|| u16::from_be_bytes([frame[14], frame.get(15).copied().unwrap_or(0)]) & 0x0fff)
}

/// A packet socket bound to one link that sends whole frames as given. Opened inside a
/// network namespace, it keeps sending there from any thread.
#[derive(Debug)]
pub struct Sender {
    fd: OwnedFd,
    ifindex: i32,
}

impl Sender {
    /// Opens a raw packet socket on `ifname`, in the network namespace `netns` (an `ip netns`
    /// name) when given, else in the caller's. Receives nothing (protocol 0). Frames go through
    /// the link's qdisc and egress hook like any sent frame.
    ///
    /// # Errors
    /// When the namespace cannot be entered, the link does not exist there, or the socket
    /// cannot be made (needs CAP_NET_RAW).
    pub fn open(netns: Option<&str>, ifname: &str) -> io::Result<Sender> {
        let ifname = ifname.to_string();
        let ns_file = netns.map(|n| fs::File::open(format!("/run/netns/{n}"))).transpose()?;
        // A thread of its own enters the namespace: setns changes only the calling thread, and
        // the socket stays in the namespace it was made in after the thread is gone.
        std::thread::spawn(move || -> io::Result<Sender> {
            if let Some(ns) = &ns_file {
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            }
            let name =
                std::ffi::CString::new(ifname.clone()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            // SAFETY: a NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
            if ifindex == 0 {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("no link {ifname}")));
            }
            // SAFETY: plain socket(2); the descriptor is owned below.
            let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: a fresh descriptor nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let ifindex = i32::try_from(ifindex).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            Ok(Sender { fd, ifindex })
        })
        .join()
        .map_err(|_| io::Error::other("the namespace thread panicked"))?
    }

    /// Sends one frame as is.
    ///
    /// # Errors
    /// The socket's error (`ENOBUFS` when the link's queue is full, `ENETDOWN` when it is down).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_ll is plain data; zero is a valid value of every field.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = self.ifindex;
        addr.sll_halen = 6;
        for (i, b) in addr.sll_addr.iter_mut().take(6).enumerate() {
            *b = frame.get(i).copied().unwrap_or(0);
        }
        // SAFETY: the buffer and the address outlive the call; the sizes are theirs.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != frame.len() => Err(io::Error::other(format!("sent {n} of {} bytes", frame.len()))),
            _ => Ok(()),
        }
    }

    /// Sends every frame in order, retrying one the kernel had no buffer for (the caller wants
    /// each frame on the wire once, so it counts).
    ///
    /// # Errors
    /// The first error other than `ENOBUFS`.
    pub fn send_all(&self, frames: &[Vec<u8>]) -> io::Result<usize> {
        for f in frames {
            loop {
                match self.send(f) {
                    Ok(()) => break,
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => std::thread::yield_now(),
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(frames.len())
    }
}

/// Sends `frames` on `ifname` in `netns` (see [`Sender::open`]) and returns how many were sent.
///
/// # Errors
/// As [`Sender::open`] and [`Sender::send_all`].
pub fn send(netns: Option<&str>, ifname: &str, frames: &[Vec<u8>]) -> io::Result<usize> {
    Sender::open(netns, ifname)?.send_all(frames)
}

/// A link's packet counters (`/sys/class/net/X/statistics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// `rx_packets`.
    pub rx_packets: u64,
    /// `tx_packets`.
    pub tx_packets: u64,
    /// `rx_dropped`.
    pub rx_dropped: u64,
    /// `tx_dropped`.
    pub tx_dropped: u64,
}

/// The counter files [`Counters`] reads, in its field order.
const COUNTER_FILES: [&str; 4] = ["rx_packets", "tx_packets", "rx_dropped", "tx_dropped"];

/// Parses the four numbers [`COUNTER_FILES`] printed one a line.
///
/// # Errors
/// When there are not four numbers.
pub fn parse_counters(text: &str) -> Result<Counters, String> {
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|w| w.parse::<u64>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{e}: {text:?}"))?;
    match v[..] {
        [rx_packets, tx_packets, rx_dropped, tx_dropped] => {
            Ok(Counters { rx_packets, tx_packets, rx_dropped, tx_dropped })
        }
        _ => Err(format!("expected {} counters: {text:?}", COUNTER_FILES.len())),
    }
}

/// The shell command that prints the counters of `ifname` for [`parse_counters`] (also what a
/// guest runs through `vm.exec`).
pub fn counters_argv(ifname: &str) -> Vec<String> {
    let files: Vec<String> = COUNTER_FILES.iter().map(|f| format!("/sys/class/net/{ifname}/statistics/{f}")).collect();
    let mut argv = vec!["cat".to_string()];
    argv.extend(files);
    argv
}

/// The counters of `ifname` from sysfs: the caller's own when `netns` is `None`, else read in
/// `ip netns exec NETNS` (which mounts that namespace's sysfs: a process's /sys shows the
/// namespace it was mounted in, not the thread's).
///
/// # Errors
/// When the link does not exist or the files cannot be read.
pub fn counters(netns: Option<&str>, ifname: &str) -> Result<Counters, String> {
    let text = match netns {
        None => COUNTER_FILES
            .iter()
            .map(|f| fs::read_to_string(format!("/sys/class/net/{ifname}/statistics/{f}")))
            .collect::<io::Result<Vec<String>>>()
            .map_err(|e| format!("{ifname}: {e}"))?
            .join("\n"),
        Some(ns) => {
            let out = Command::new("ip")
                .args(["netns", "exec", ns])
                .args(counters_argv(ifname))
                .output()
                .map_err(|e| format!("ip netns exec: {e}"))?;
            if !out.status.success() {
                return Err(format!("{ifname} in {ns}: {}", String::from_utf8_lossy(&out.stderr)));
            }
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    parse_counters(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_macs_are_locally_administered_unicast_and_differ() {
        let mut rng = Rng::seeded(7);
        let macs: Vec<[u8; 6]> = (0..1000).map(|_| random_mac(&mut rng)).collect();
        for m in &macs {
            assert_eq!(m[0] & 0x01, 0, "unicast: {}", mac_text(m));
            assert_eq!(m[0] & 0x02, 0x02, "locally administered: {}", mac_text(m));
        }
        let distinct: std::collections::BTreeSet<_> = macs.iter().collect();
        assert!(distinct.len() > 990, "{} distinct of 1000", distinct.len());
    }

    #[test]
    fn an_untagged_frame_is_header_and_payload() {
        let (d, s) = ([0x02, 1, 2, 3, 4, 5], [0x06, 9, 8, 7, 6, 5]);
        let f = frame(d, s, None, 50);
        assert_eq!(f.len(), ETH_HLEN + 50);
        assert_eq!(&f[..6], &d);
        assert_eq!(&f[6..12], &s);
        assert_eq!(&f[12..14], &[0x88, 0xb5]);
        assert_eq!(vlan_of(&f), None);
    }

    #[test]
    fn a_tagged_frame_carries_the_8021q_tag_before_the_ethertype() {
        let f = frame([2; 6], [6; 6], Some(4094), 46);
        assert_eq!(f.len(), ETH_HLEN + 4 + 46);
        assert_eq!(&f[12..18], &[0x81, 0x00, 0x0f, 0xfe, 0x88, 0xb5]);
        assert_eq!(vlan_of(&f), Some(4094));
        // Only the 12 VLAN bits go into the tag: priority and DEI stay 0.
        assert_eq!(vlan_of(&frame([2; 6], [6; 6], Some(0xf00a), 0)), Some(10));
    }

    #[test]
    fn a_runt_is_sixteen_bytes() {
        let r = runt([2; 6], [6; 6]);
        assert_eq!(r.len(), 16);
        assert_eq!(&r[12..14], &[0x88, 0xb5]);
    }

    #[test]
    fn random_frames_mix_runts_and_the_given_vlans() {
        let mut rng = Rng::seeded(42);
        let fs = random_frames(&mut rng, 40, &[10, 20]);
        assert_eq!(fs.len(), 40);
        let runts = fs.iter().filter(|f| f.len() == RUNT_LEN).count();
        assert_eq!(runts, 10);
        let tagged: Vec<u16> = fs.iter().filter_map(|f| vlan_of(f)).collect();
        assert_eq!(tagged.len(), 30);
        assert!(tagged.contains(&10) && tagged.contains(&20));
        assert!(fs.iter().filter(|f| f.len() != RUNT_LEN).all(|f| f.len() >= ETH_HLEN + 4 + 46 && f.len() <= 1518));
        let untagged = random_frames(&mut rng, 8, &[]);
        assert!(untagged.iter().all(|f| vlan_of(f).is_none()));
        // Fresh addresses per frame.
        let srcs: std::collections::BTreeSet<&[u8]> = fs.iter().map(|f| &f[6..12]).collect();
        assert_eq!(srcs.len(), 40);
    }

    #[test]
    fn counters_parse_four_numbers() {
        assert_eq!(
            parse_counters("5\n6\n0\n1\n"),
            Ok(Counters { rx_packets: 5, tx_packets: 6, rx_dropped: 0, tx_dropped: 1 })
        );
        assert!(parse_counters("5\n6\n").is_err());
        assert!(parse_counters("x\n6\n0\n1").is_err());
        assert_eq!(counters_argv("eth1")[1], "/sys/class/net/eth1/statistics/rx_packets");
    }

    #[test]
    fn loopback_counters_read_from_sysfs() {
        assert!(counters(None, "lo").is_ok());
        assert!(counters(None, "no-such-link0").is_err());
    }

    /// A namespace of this test's own with a veth pair `a0`/`b0`, IPv6 off, up; deleted on drop.
    struct Netns(String);

    impl Netns {
        fn new(tag: &str) -> Netns {
            let name = format!("frames-{tag}-{}", std::process::id());
            let ip = |args: &[&str]| {
                let st = Command::new("ip").args(args).status().expect("run ip");
                assert!(st.success(), "ip {args:?}");
            };
            ip(&["netns", "add", &name]);
            let ns = Netns(name.clone());
            ip(&[
                "netns",
                "exec",
                &name,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ]);
            ip(&["-n", &name, "link", "add", "a0", "type", "veth", "peer", "name", "b0"]);
            ip(&["-n", &name, "link", "set", "a0", "up"]);
            ip(&["-n", &name, "link", "set", "b0", "up"]);
            ns
        }
    }

    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }

    #[test]
    fn frames_sent_into_a_veth_arrive_counted_at_its_peer_runts_and_tags_included() {
        let ns = Netns::new("send");
        let before = counters(Some(&ns.0), "a0").expect("a0 counters");
        let frames = random_frames(&mut Rng::new(), 37, &[10, 4094]);
        assert_eq!(send(Some(&ns.0), "b0", &frames).expect("send"), 37);
        let after = counters(Some(&ns.0), "a0").expect("a0 counters");
        // veth delivers synchronously: the counters hold once send returned. The peer of a
        // quiet wire counted exactly what was sent.
        assert_eq!(after.rx_packets - before.rx_packets, 37, "{before:?} -> {after:?}");
        assert_eq!(counters(Some(&ns.0), "b0").expect("b0").tx_packets, after.rx_packets);
        assert!(Sender::open(Some(&ns.0), "nosuch0").is_err());
    }
}
