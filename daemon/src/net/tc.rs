//! tc over netlink: the clsact qdisc, mirror filters, the drop filter.
//!
//! Capture NICs copy what a host interface (the *source*) sees into a monitor tap. The copy is
//! made by the kernel's traffic control, on the source's `clsact` qdisc: a classic-BPF classifier
//! that matches every frame, with one `mirred` action that mirrors the frame to the tap's egress
//! (the tap's egress is what the guest reads). The guest's own sends into a monitor tap are
//! dropped by another classic-BPF filter, in direct-action mode, on the tap's ingress. Nothing
//! here needs the `bpf(2)` syscall: classic BPF travels inside the netlink message
//! (`TCA_BPF_OPS`), and the kernel checks and runs it itself.
//!
//! The capture planner (`net::capture`) uses these calls in this order: [`Netlink::clsact_links`]
//! and [`Netlink::filters`] to look; [`Netlink::add_clsact`] where the source has none;
//! [`Netlink::add_mirror`] per wanted copy (the action carries vmhostd's cookie, the only marker
//! that makes a filter ours); [`Netlink::del_filter`] for a copy no longer wanted (only that
//! filter, by its full id); [`Netlink::del_clsact`] only when vmhostd made the qdisc and nothing
//! is left on it. `net::host` adds [`Netlink::add_drop_all`] on each monitor tap's ingress.
//!
//! Kernel modules: `sch_ingress` (clsact), `cls_bpf`, `act_mirred`. A missing one answers
//! `ENOENT` (the kernel's module autoload failed), which is [`NetError::Unsupported`] here.
//!
//! What `tc -s filter show dev SRC ingress` shows for a mirror vmhostd added (the capture planner
//! puts vmhost's mirrors one pref before every other filter on the hook, all at that pref;
//! 49152 on a hook with no other filter):
//! `filter protocol all pref 49152 bpf chain 0 handle 0x1 not_in_hw bytecode '1,6 0 0 4294967295'`,
//! then `action order 1: mirred (Egress Mirror to device TAP) continue`, its counters (`Sent N bytes
//! M pkt`), and `cookie` followed by the cookie in hex (`766d6863...`: "vmhc" and the tap name's
//! tail). A monitor tap's drop filter shows as `bpf ... direct-action not_in_hw bytecode '1,6 0 0 2'`
//! under `tc filter show dev TAP ingress`.

use futures_util::StreamExt;
use rtnetlink::packet_core::{
    DefaultNla, Emitable, NetlinkMessage, NetlinkPayload, Nla, NlasIterator, Parseable, NLM_F_ACK, NLM_F_CREATE,
    NLM_F_DUMP, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REQUEST,
};
use rtnetlink::packet_route::tc::{
    TcAction, TcActionAttribute, TcActionMirror, TcActionMirrorOption, TcActionOption, TcActionType, TcAttribute,
    TcBpfFlags, TcFilterBpf, TcFilterBpfOption, TcFilterMatchAllOption, TcFilterU32Option, TcHandle, TcMessage,
    TcMirror, TcMirrorActionType, TcOption, TcStats2,
};
use rtnetlink::packet_route::RouteNetlinkMessage;

use super::link::{errno_of, Netlink};
use super::NetError;

/// `ETH_P_ALL`: a filter for every protocol (host byte order).
pub const ETH_P_ALL: u16 = 0x0003;

/// Longest action cookie the kernel keeps (`TC_COOKIE_MAX_SIZE`).
pub const MAX_COOKIE: usize = 16;

/// `TCA_BPF_ACT`: the actions of a bpf filter (not a variant of `TcFilterBpfOption`).
const TCA_BPF_ACT: u16 = 1;
/// `TCA_BPF_OPS_LEN`: the number of classic-BPF instructions (u16).
const TCA_BPF_OPS_LEN: u16 = 4;
/// `TCA_BPF_OPS`: the classic-BPF program (`struct sock_filter[]`).
const TCA_BPF_OPS: u16 = 5;
/// `TCA_STATS_PKT64`: a 64-bit packet count next to the basic stats (kernels since 5.4).
const TCA_STATS_PKT64: u16 = 8;
/// `BPF_RET | BPF_K`: return the constant `k`.
const BPF_RET_K: u16 = 0x06;
/// The qdisc handle of clsact (and ingress): `ffff:0`.
const CLSACT_HANDLE: TcHandle = TcHandle { major: 0xffff, minor: 0 };
/// What the capture needs of the kernel, named in [`NetError::Unsupported`].
const CLSACT_WHAT: &str = "tc clsact qdisc (module sch_ingress)";
/// As [`CLSACT_WHAT`], for the mirror filter.
const MIRROR_WHAT: &str = "tc bpf classifier with mirred action (modules cls_bpf, act_mirred)";
/// As [`CLSACT_WHAT`], for the drop filter.
const DROP_WHAT: &str = "tc bpf classifier (module cls_bpf)";

/// One of clsact's two hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// Frames the link receives (`TC_H_MIN_INGRESS`).
    Ingress,
    /// Frames the link sends (`TC_H_MIN_EGRESS`).
    Egress,
}

impl Hook {
    /// The filter parent naming this hook: `ffff:fff2` or `ffff:fff3`.
    fn parent(self) -> TcHandle {
        let minor = match self {
            Hook::Ingress => TcHandle::MIN_INGRESS,
            Hook::Egress => TcHandle::MIN_EGRESS,
        };
        TcHandle { major: 0xffff, minor }
    }

    /// The word `tc` uses for the hook.
    pub fn name(self) -> &'static str {
        match self {
            Hook::Ingress => "ingress",
            Hook::Egress => "egress",
        }
    }
}

/// What names exactly one filter on a link's hook: deleting by this id never touches another
/// filter, even one at the same priority.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FilterId {
    /// The hook the filter is on.
    pub hook: Hook,
    /// Its priority (`pref`); the kernel picks it for filters vmhostd adds.
    pub prio: u16,
    /// Its protocol, an `ETH_P_*` value in host byte order ([`ETH_P_ALL`] for ours).
    pub protocol: u16,
    /// Its handle inside the classifier instance.
    pub handle: u32,
    /// The classifier's kind (`bpf`, `u32`, ...): the kernel refuses a delete whose kind differs.
    pub kind: String,
}

/// One filter as [`Netlink::filters`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterInfo {
    /// Its id, for [`Netlink::del_filter`].
    pub id: FilterId,
    /// The cookie of its first action that has one (vmhostd's marker lives there).
    pub cookie: Option<Vec<u8>>,
    /// The target ifindex of its first `mirred` action; `Some(0)` when the target link is gone.
    pub mirred_to: Option<u32>,
    /// Packets its actions handled (the first action's counter).
    pub packets: u64,
}

/// The netlink `flags` of a request that changes something and wants the kernel's answer.
const CHANGE: u16 = NLM_F_REQUEST | NLM_F_ACK;

/// Classic BPF: a program of one `ret k` instruction, as `TCA_BPF_OPS` carries it
/// (`struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }`, host byte order).
fn ret_program(k: u32) -> Vec<TcFilterBpfOption> {
    let mut ops = Vec::with_capacity(8);
    ops.extend_from_slice(&BPF_RET_K.to_ne_bytes());
    ops.extend_from_slice(&[0, 0]);
    ops.extend_from_slice(&k.to_ne_bytes());
    vec![
        TcFilterBpfOption::Other(DefaultNla::new(TCA_BPF_OPS_LEN, 1u16.to_ne_bytes().to_vec())),
        TcFilterBpfOption::Other(DefaultNla::new(TCA_BPF_OPS, ops)),
    ]
}

/// The `mirred` action that mirrors every frame to `target`'s egress and carries `cookie`.
fn mirror_action(target: u32, cookie: &[u8]) -> TcAction {
    let mut parms = TcMirror::default();
    // "continue" (TC_ACT_UNSPEC): after the copy, classification goes on to the next filter.
    // "pipe" would end it here: a second monitor's mirror and any operator filter after this one
    // (the kernel gives a new filter the prio before the first) would never see a frame.
    parms.generic.action = TcActionType::Unspec;
    parms.eaction = TcMirrorActionType::EgressMirror;
    parms.ifindex = target;
    let mut action = TcAction::default();
    action.attributes = vec![
        TcActionAttribute::Kind(TcActionMirror::KIND.to_string()),
        TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(parms))]),
        TcActionAttribute::Cookie(cookie.to_vec()),
    ];
    action
}

/// `TCA_BPF_ACT` holding `actions` (each nested under its order, from 1).
fn bpf_actions(mut actions: Vec<TcAction>) -> TcFilterBpfOption {
    for (i, a) in actions.iter_mut().enumerate() {
        a.tab = u16::try_from(i + 1).unwrap_or(u16::MAX);
    }
    let mut buf = vec![0; actions.as_slice().buffer_len()];
    actions.as_slice().emit(&mut buf);
    TcFilterBpfOption::Other(DefaultNla::new(TCA_BPF_ACT, buf))
}

/// A filter message for link `ifindex`'s `hook` with `prio`/`protocol` in `tcm_info`.
fn filter_message(ifindex: u32, hook: Hook, prio: u16, protocol: u16, handle: u32) -> Result<TcMessage, NetError> {
    let mut msg = TcMessage::with_index(link_index(ifindex)?);
    msg.header.parent = hook.parent();
    // tcm_info: the priority in the upper half, the protocol in network byte order in the lower.
    msg.header.info = (u32::from(prio) << 16) | u32::from(protocol.to_be());
    msg.header.handle = TcHandle::from(handle);
    Ok(msg)
}

/// The `i32` index netlink's tc header carries.
fn link_index(ifindex: u32) -> Result<i32, NetError> {
    i32::try_from(ifindex).map_err(|_| NetError::NotFound(format!("link #{ifindex}")))
}

/// The actions of one filter's options, whatever the classifier (bpf, u32, matchall).
fn actions_of(options: &[TcOption]) -> Vec<TcAction> {
    let mut out = Vec::new();
    for option in options {
        match option {
            TcOption::Bpf(TcFilterBpfOption::Other(nla)) if nla.kind() & 0x3fff == TCA_BPF_ACT => {
                let mut value = vec![0; nla.value_len()];
                nla.emit_value(&mut value);
                for nested in NlasIterator::new(value.as_slice()).flatten() {
                    if let Ok(action) = TcAction::parse(&nested) {
                        out.push(action);
                    }
                }
            }
            TcOption::U32(TcFilterU32Option::Action(actions)) => out.extend(actions.iter().cloned()),
            TcOption::MatchAll(TcFilterMatchAllOption::Action(actions)) => out.extend(actions.iter().cloned()),
            _ => {}
        }
    }
    out.sort_by_key(|a| a.tab);
    out
}

/// The packets an action's stats count: the 64-bit counter when the kernel sends one.
fn packets_of(stats: &[TcStats2]) -> Option<u64> {
    let pkt64 = stats.iter().find_map(|s| match s {
        TcStats2::Other(nla) if nla.kind() == TCA_STATS_PKT64 && nla.value_len() == 8 => {
            let mut v = [0u8; 8];
            nla.emit_value(&mut v);
            Some(u64::from_ne_bytes(v))
        }
        _ => None,
    });
    pkt64.or_else(|| {
        stats.iter().find_map(|s| match s {
            TcStats2::Basic(b) => Some(u64::from(b.packets)),
            _ => None,
        })
    })
}

/// Reads a filter message of a dump or an echo; `None` for the per-classifier header message
/// (handle 0) the kernel sends before a classifier's filters.
fn filter_info(msg: &TcMessage, hook: Hook) -> Option<FilterInfo> {
    let handle = u32::from(msg.header.handle);
    if handle == 0 {
        return None;
    }
    let mut kind = None;
    let mut options: &[TcOption] = &[];
    for attr in &msg.attributes {
        match attr {
            TcAttribute::Kind(k) => kind = Some(k.clone()),
            TcAttribute::Options(o) => options = o,
            _ => {}
        }
    }
    let id = FilterId {
        hook,
        prio: (msg.header.info >> 16) as u16,
        protocol: u16::from_be((msg.header.info & 0xffff) as u16),
        handle,
        kind: kind?,
    };
    let mut info = FilterInfo { id, cookie: None, mirred_to: None, packets: 0 };
    let mut counted = false;
    for action in actions_of(options) {
        for attr in &action.attributes {
            match attr {
                TcActionAttribute::Cookie(c) if info.cookie.is_none() => info.cookie = Some(c.clone()),
                TcActionAttribute::Options(opts) if info.mirred_to.is_none() => {
                    for o in opts {
                        if let TcActionOption::Mirror(TcActionMirrorOption::Parms(p)) = o {
                            info.mirred_to = Some(p.ifindex);
                        }
                    }
                }
                TcActionAttribute::Stats(stats) if !counted => {
                    if let Some(p) = packets_of(stats) {
                        info.packets = p;
                        counted = true;
                    }
                }
                _ => {}
            }
        }
    }
    Some(info)
}

/// Maps the kernel's refusal of a tc request: `ENODEV` is a missing link, `ENOENT` a missing
/// kernel module (`what`) for an add and a missing object for a delete, `EEXIST` an existing one.
fn tc_err(
    op: &'static str,
    subject: String,
    what: &'static str,
    adding: bool,
) -> impl FnOnce(rtnetlink::Error) -> NetError {
    move |source| match errno_of(&source) {
        Some(libc::ENODEV) => NetError::NotFound(subject),
        Some(libc::EEXIST) => NetError::Exists(subject),
        Some(libc::ENOENT) if adding => NetError::Unsupported { what },
        Some(libc::EOPNOTSUPP) => NetError::Unsupported { what },
        Some(libc::ENOENT) | Some(libc::EINVAL) if !adding => NetError::NotFound(subject),
        errno => NetError::Netlink { op, errno, source },
    }
}

impl Netlink {
    /// Sends one tc request and collects the messages the kernel answers with (the echo of a
    /// `NLM_F_ECHO` request, the parts of a dump) until its ack or `NLMSG_DONE`.
    async fn tc_request(&self, msg: RouteNetlinkMessage, flags: u16) -> Result<Vec<TcMessage>, rtnetlink::Error> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = flags;
        let mut handle = self.handle.clone();
        let mut answers = handle.request(req)?;
        let mut out = Vec::new();
        while let Some(answer) = answers.next().await {
            match answer.payload {
                NetlinkPayload::Error(e) => return Err(rtnetlink::Error::NetlinkError(e)),
                NetlinkPayload::InnerMessage(
                    RouteNetlinkMessage::NewTrafficFilter(m) | RouteNetlinkMessage::NewQueueDiscipline(m),
                ) => out.push(m),
                _ => {}
            }
        }
        Ok(out)
    }

    /// Whether link `ifindex` has a clsact qdisc.
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the qdisc dump fails.
    pub async fn has_clsact(&self, ifindex: u32) -> Result<bool, NetError> {
        Ok(self.clsact_links().await?.contains(&ifindex))
    }

    /// The links that have a clsact qdisc: one dump of the host's qdiscs (a capture sync asks
    /// this once, not once per link).
    ///
    /// # Errors
    /// [`NetError::Netlink`] when the dump fails.
    pub async fn clsact_links(&self) -> Result<std::collections::BTreeSet<u32>, NetError> {
        let msg = RouteNetlinkMessage::GetQueueDiscipline(TcMessage::with_index(0));
        let qdiscs = self.tc_request(msg, NLM_F_REQUEST | NLM_F_DUMP).await.map_err(|source| NetError::Netlink {
            op: "dump qdiscs",
            errno: errno_of(&source),
            source,
        })?;
        Ok(qdiscs
            .iter()
            .filter(|q| q.attributes.iter().any(|a| matches!(a, TcAttribute::Kind(k) if k == "clsact")))
            .filter_map(|q| u32::try_from(q.header.index).ok())
            .collect())
    }

    /// Adds a clsact qdisc to link `ifindex` (what `tc qdisc add dev X clsact` does).
    ///
    /// # Errors
    /// [`NetError::Exists`] when the link has one (or another qdisc at `ffff:`, such as
    /// `ingress`); [`NetError::NotFound`] when there is no such link; [`NetError::Unsupported`]
    /// without `sch_ingress`; [`NetError::Netlink`] otherwise.
    pub async fn add_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        let mut msg = TcMessage::with_index(link_index(ifindex)?);
        msg.header.parent = TcHandle::CLSACT;
        msg.header.handle = CLSACT_HANDLE;
        msg.attributes.push(TcAttribute::Kind("clsact".to_string()));
        let subject = format!("clsact qdisc on link #{ifindex}");
        self.tc_request(RouteNetlinkMessage::NewQueueDiscipline(msg), CHANGE | NLM_F_CREATE | NLM_F_EXCL)
            .await
            .map_err(|source| match errno_of(&source) {
                // The kernel answers a link without the qdisc's module, or an existing qdisc of
                // another kind at ffff:, in its own words; an existing clsact is EEXIST.
                Some(libc::ENODEV) => NetError::NotFound(format!("link #{ifindex}")),
                _ => tc_err("add clsact", subject, CLSACT_WHAT, true)(source),
            })?;
        Ok(())
    }

    /// Deletes link `ifindex`'s clsact qdisc, and with it every filter on it (the caller checks
    /// that none but its own are left).
    ///
    /// # Errors
    /// [`NetError::NotFound`] when the link or its clsact is gone; [`NetError::Netlink`]
    /// otherwise.
    pub async fn del_clsact(&self, ifindex: u32) -> Result<(), NetError> {
        let mut msg = TcMessage::with_index(link_index(ifindex)?);
        msg.header.parent = TcHandle::CLSACT;
        msg.header.handle = CLSACT_HANDLE;
        msg.attributes.push(TcAttribute::Kind("clsact".to_string()));
        let subject = format!("clsact qdisc on link #{ifindex}");
        self.tc_request(RouteNetlinkMessage::DelQueueDiscipline(msg), CHANGE).await.map_err(tc_err(
            "delete clsact",
            subject,
            CLSACT_WHAT,
            false,
        ))?;
        Ok(())
    }

    /// The filters on link `ifindex`'s `hook`, in the kernel's order (by priority). Empty when
    /// the link has no clsact.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when there is no such link; [`NetError::Netlink`] when the dump
    /// fails.
    pub async fn filters(&self, ifindex: u32, hook: Hook) -> Result<Vec<FilterInfo>, NetError> {
        let msg = filter_message(ifindex, hook, 0, 0, 0)?;
        let dump = self
            .tc_request(RouteNetlinkMessage::GetTrafficFilter(msg), NLM_F_REQUEST | NLM_F_DUMP)
            .await
            .map_err(|source| match errno_of(&source) {
                Some(libc::ENODEV) => NetError::NotFound(format!("link #{ifindex}")),
                errno => NetError::Netlink { op: "dump filters", errno, source },
            })?;
        Ok(dump.iter().filter_map(|m| filter_info(m, hook)).collect())
    }

    /// Adds a filter to `ifindex`'s `hook` with the kernel picking a free priority, and returns
    /// the id the kernel echoes back.
    async fn add_filter(
        &self,
        ifindex: u32,
        hook: Hook,
        prio: u16,
        options: Vec<TcFilterBpfOption>,
        what: &'static str,
    ) -> Result<FilterId, NetError> {
        // prio 0 with NLM_F_CREATE: a new classifier instance at a priority the kernel picks
        // (after the filters below 0x8000), so a filter already there is never replaced or
        // joined. Handle 0 with NLM_F_EXCL: a new filter, never a change of one there.
        let mut msg = filter_message(ifindex, hook, prio, ETH_P_ALL, 0)?;
        msg.attributes.push(TcAttribute::Kind(TcFilterBpf::KIND.to_string()));
        msg.attributes.push(TcAttribute::Options(options.into_iter().map(TcOption::Bpf).collect()));
        let subject = format!("link #{ifindex}");
        let answer = match self
            .tc_request(RouteNetlinkMessage::NewTrafficFilter(msg), CHANGE | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO)
            .await
        {
            Ok(answer) => answer,
            // No clsact on the link: the kernel says EINVAL ("Parent Qdisc doesn't exists").
            Err(e) if errno_of(&e) == Some(libc::EINVAL) && !self.has_clsact(ifindex).await.unwrap_or(true) => {
                return Err(NetError::NotFound(format!("clsact qdisc on link #{ifindex}")));
            }
            Err(e) => return Err(tc_err("add filter", subject, what, true)(e)),
        };
        answer
            .iter()
            .find_map(|m| filter_info(m, hook))
            .map(|f| f.id)
            .ok_or_else(|| NetError::Unexpected(format!("no echo of the filter added on link #{ifindex}")))
    }

    /// Adds a classic-BPF match-everything filter with one mirred (egress mirror) action to
    /// `target`, carrying `cookie`, at priority `prio` (0: the kernel picks one after the
    /// filters there). Returns its id. A priority some classifier of another kind or protocol
    /// already holds is refused by the kernel; one our mirrors hold is joined (the classic-BPF
    /// classifier runs each of its filters in turn, and a mirror continues).
    ///
    /// The classifier returns -1 ("match, default class") for every frame, whatever its length
    /// (u32 would miss frames with fewer than 4 bytes after the Ethernet header); the action
    /// copies the frame to `target`'s egress and lets classification go on to the next filter
    /// (`continue`), so other mirrors and filters on the hook still see the frame.
    ///
    /// # Errors
    /// [`NetError::InvalidCookie`] for an empty cookie or one over [`MAX_COOKIE`] bytes;
    /// [`NetError::NotFound`] when the link, the target or the link's clsact is missing;
    /// [`NetError::Unsupported`] without `cls_bpf` or `act_mirred`; [`NetError::Netlink`]
    /// otherwise.
    pub async fn add_mirror(
        &self,
        ifindex: u32,
        hook: Hook,
        prio: u16,
        target: u32,
        cookie: &[u8],
    ) -> Result<FilterId, NetError> {
        if cookie.is_empty() || cookie.len() > MAX_COOKIE {
            return Err(NetError::InvalidCookie(cookie.len()));
        }
        if target == 0 {
            return Err(NetError::NotFound("mirror target link #0".to_string()));
        }
        let mut options = ret_program(u32::MAX);
        options.push(bpf_actions(vec![mirror_action(target, cookie)]));
        self.add_filter(ifindex, hook, prio, options, MIRROR_WHAT).await
    }

    /// Adds the classic-BPF direct-action filter that drops every frame (the monitor tap's
    /// ingress): the program returns `TC_ACT_SHOT`, no action module is involved.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when the link or its clsact is missing; [`NetError::Unsupported`]
    /// without `cls_bpf`; [`NetError::Netlink`] otherwise.
    pub async fn add_drop_all(&self, ifindex: u32, hook: Hook) -> Result<FilterId, NetError> {
        let mut options = ret_program(i32::from(TcActionType::Shot) as u32);
        options.push(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction));
        self.add_filter(ifindex, hook, 0, options, DROP_WHAT).await
    }

    /// Deletes exactly the filter `id` on link `ifindex`: its priority, protocol, handle and kind
    /// must all match, so another filter (at the same priority too) stays.
    ///
    /// # Errors
    /// [`NetError::NotFound`] when the link, its clsact or the filter is gone (or the kind at
    /// that place differs); [`NetError::Netlink`] otherwise.
    pub async fn del_filter(&self, ifindex: u32, id: &FilterId) -> Result<(), NetError> {
        if id.prio == 0 || id.handle == 0 {
            // prio 0 or handle 0 would delete a whole priority or classifier instance.
            return Err(NetError::NotFound(format!("filter {id:?} (an incomplete id)")));
        }
        let mut msg = filter_message(ifindex, id.hook, id.prio, id.protocol, id.handle)?;
        msg.attributes.push(TcAttribute::Kind(id.kind.clone()));
        let subject = format!(
            "{} filter pref {} handle {:#x} on link #{ifindex} {}",
            id.kind,
            id.prio,
            id.handle,
            id.hook.name()
        );
        self.tc_request(RouteNetlinkMessage::DelTrafficFilter(msg), CHANGE).await.map_err(tc_err(
            "delete filter",
            subject,
            DROP_WHAT,
            false,
        ))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::Duration;

    use super::super::tap::create_tap;
    use super::super::testing::{in_netns, read_test_frames, send_frame, test_frame, write_tap};
    use super::*;

    /// Runs `cmd ARGS` (`ip`, `tc`) as a test fixture or to look from outside the code under test.
    fn run(cmd: &str, args: &[&str]) -> String {
        let out = Command::new(cmd).args(args).output().expect("run fixture command");
        assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    const COOKIE: &[u8] = b"vmhc12345678n0";
    const WAIT: Duration = Duration::from_secs(10);
    const DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
    const SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

    /// A veth pair `src0` (the capture source) / `peer0` (the wire), both up, and the index of
    /// `src0`.
    async fn source(nl: &Netlink) -> u32 {
        run("ip", &["link", "add", "src0", "type", "veth", "peer", "name", "peer0"]);
        for l in ["src0", "peer0"] {
            let index = nl.link_by_name(l).await.unwrap().unwrap().index;
            // No IPv6 chatter from the fixture itself.
            nl.set_ipv6_off(index).await.unwrap();
            nl.set_up(index).await.unwrap();
        }
        nl.link_by_name("src0").await.unwrap().unwrap().index
    }

    #[test]
    fn clsact_is_added_seen_and_deleted() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            assert!(!nl.has_clsact(src).await.unwrap());
            assert_eq!(nl.filters(src, Hook::Ingress).await.unwrap(), []);
            nl.add_clsact(src).await.unwrap();
            assert!(nl.has_clsact(src).await.unwrap());
            assert!(run("tc", &["qdisc", "show", "dev", "src0"]).contains("clsact"));
            let err = nl.add_clsact(src).await.unwrap_err();
            assert!(matches!(err, NetError::Exists(_)), "{err:?}");
            assert_eq!(nl.filters(src, Hook::Egress).await.unwrap(), []);
            // Another link's qdisc is not this one's.
            let peer = nl.link_by_name("peer0").await.unwrap().unwrap().index;
            assert!(!nl.has_clsact(peer).await.unwrap());

            nl.del_clsact(src).await.unwrap();
            assert!(!nl.has_clsact(src).await.unwrap());
            let err = nl.del_clsact(src).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
            let err = nl.add_clsact(4242).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn mirror_needs_clsact_a_target_and_a_cookie_that_fits() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            let peer = nl.link_by_name("peer0").await.unwrap().unwrap().index;
            let err = nl.add_mirror(src, Hook::Ingress, 0, peer, COOKIE).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(ref s) if s.contains("clsact")), "{err:?}");
            nl.add_clsact(src).await.unwrap();
            for cookie in [&b""[..], &[7u8; 17][..]] {
                let err = nl.add_mirror(src, Hook::Ingress, 0, peer, cookie).await.unwrap_err();
                assert!(matches!(err, NetError::InvalidCookie(n) if n == cookie.len()), "{err:?}");
            }
            let err = nl.add_mirror(src, Hook::Ingress, 0, 4242, COOKIE).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
            let err = nl.add_mirror(src, Hook::Ingress, 0, 0, COOKIE).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
            assert_eq!(nl.filters(src, Hook::Ingress).await.unwrap(), [], "a refused add leaves nothing");
            let err = nl.add_drop_all(4242, Hook::Ingress).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
        });
    }

    #[test]
    fn mirror_copies_every_frame_into_the_tap_with_its_cookie_and_target() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            let tap_fd = create_tap("vmhmon0").unwrap();
            let tap = nl.link_by_name("vmhmon0").await.unwrap().unwrap().index;
            nl.set_ipv6_off(tap).await.unwrap();
            nl.set_up(tap).await.unwrap();
            nl.add_clsact(src).await.unwrap();

            let id = nl.add_mirror(src, Hook::Ingress, 0, tap, COOKIE).await.unwrap();
            assert_eq!(id.hook, Hook::Ingress);
            assert_eq!(id.kind, "bpf");
            assert_eq!(id.protocol, ETH_P_ALL);
            assert_ne!(id.prio, 0);
            assert_ne!(id.handle, 0);
            let listed = nl.filters(src, Hook::Ingress).await.unwrap();
            assert_eq!(listed.len(), 1, "{listed:?}");
            assert_eq!(listed[0].id, id, "the echoed id is the dumped one");
            assert_eq!(listed[0].cookie.as_deref(), Some(COOKIE));
            assert_eq!(listed[0].mirred_to, Some(tap));
            assert_eq!(listed[0].packets, 0);
            assert_eq!(nl.filters(src, Hook::Egress).await.unwrap(), []);
            // What an operator sees: the cookie in hex.
            let shown = run("tc", &["-s", "filter", "show", "dev", "src0", "ingress"]);
            let hex: String = COOKIE.iter().map(|b| format!("{b:02x}")).collect();
            assert!(shown.contains(&format!("cookie {hex}")), "{shown}");
            assert!(shown.contains("Egress Mirror to device vmhmon0"), "{shown}");

            // An ordinary frame, a VLAN-tagged one and a runt of 20 bytes (6 after the header).
            let frames = [
                test_frame(DST, SRC, None, &[1; 46]),
                test_frame(DST, SRC, Some(10), &[2; 42]),
                test_frame(DST, SRC, None, &[3; 6]),
            ];
            assert_eq!(frames[2].len(), 20);
            for f in &frames {
                send_frame("peer0", f);
            }
            let got = read_test_frames(&tap_fd, frames.len(), WAIT);
            assert_eq!(got, frames, "every frame arrives as sent, the VLAN tag included");
            let after = nl.filters(src, Hook::Ingress).await.unwrap();
            assert!(after[0].packets >= 3, "{after:?}");

            // The egress hook copies what the source sends.
            let out = nl.add_mirror(src, Hook::Egress, 0, tap, COOKIE).await.unwrap();
            assert_eq!(out.hook, Hook::Egress);
            let sent = test_frame(DST, SRC, None, &[4; 46]);
            send_frame("src0", &sent);
            assert_eq!(read_test_frames(&tap_fd, 1, WAIT), [sent]);

            // Without the filter, nothing arrives: the mirror is what delivers.
            nl.del_filter(src, &id).await.unwrap();
            nl.del_filter(src, &out).await.unwrap();
            send_frame("peer0", &frames[0]);
            send_frame("src0", &frames[0]);
            // A frame sent after those, through a fresh mirror, arrives first.
            nl.add_mirror(src, Hook::Ingress, 0, tap, COOKIE).await.unwrap();
            let marker = test_frame(DST, SRC, None, &[9; 46]);
            send_frame("peer0", &marker);
            assert_eq!(read_test_frames(&tap_fd, 1, WAIT), [marker]);
        });
    }

    #[test]
    fn a_frame_reaches_every_mirror_and_the_filters_after_ours() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            let mut taps = Vec::new();
            for name in ["vmhmon0", "vmhmon1", "vmhfor0"] {
                let fd = create_tap(name).unwrap();
                let index = nl.link_by_name(name).await.unwrap().unwrap().index;
                nl.set_ipv6_off(index).await.unwrap();
                nl.set_up(index).await.unwrap();
                taps.push((fd, index));
            }
            nl.add_clsact(src).await.unwrap();
            // An operator's mirror first: ours get lower prefs, so the kernel runs them before it.
            let foreign = "bpf bytecode 1,6_0_0_4294967295, action mirred egress mirror dev vmhfor0";
            let args: Vec<String> = ["filter", "add", "dev", "src0", "ingress"]
                .iter()
                .map(|a| a.to_string())
                .chain(foreign.split(' ').map(|a| a.replace('_', " ")))
                .collect();
            run("tc", &args.iter().map(String::as_str).collect::<Vec<_>>());
            let first = nl.add_mirror(src, Hook::Ingress, 0, taps[0].1, COOKIE).await.unwrap();
            let second = nl.add_mirror(src, Hook::Ingress, 0, taps[1].1, b"vmhc2").await.unwrap();
            assert!(second.prio < first.prio, "{first:?} {second:?}");
            let frame = test_frame(DST, SRC, None, &[6; 46]);
            send_frame("peer0", &frame);
            for (fd, _) in &taps {
                assert_eq!(
                    read_test_frames(fd, 1, WAIT),
                    std::slice::from_ref(&frame),
                    "every mirror, ours and not, copies it"
                );
            }
        });
    }

    #[test]
    fn a_gone_target_reads_as_ifindex_zero() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            let tap_fd = create_tap("vmhmon0").unwrap();
            let tap = nl.link_by_name("vmhmon0").await.unwrap().unwrap().index;
            nl.add_clsact(src).await.unwrap();
            nl.add_mirror(src, Hook::Ingress, 0, tap, COOKIE).await.unwrap();
            // The tap goes when its last descriptor closes; a child another test forks at that
            // moment holds a copy until its exec, so wait for it.
            drop(tap_fd);
            wait_until(|| async { nl.filters(src, Hook::Ingress).await.unwrap()[0].mirred_to == Some(0) }).await;
            let listed = nl.filters(src, Hook::Ingress).await.unwrap();
            assert_eq!(listed[0].cookie.as_deref(), Some(COOKIE));
        });
    }

    #[test]
    fn drop_all_drops_what_the_guest_writes_into_the_tap() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            // Fixture: the tap and a veth in one bridge, so what the tap takes in reaches peer0.
            let br = nl.create_bridge("br0", false, "").await.unwrap();
            let src = source(&nl).await;
            let tap_fd = create_tap("vmhmon0").unwrap();
            let tap = nl.link_by_name("vmhmon0").await.unwrap().unwrap().index;
            for (l, master) in [(tap, true), (src, true), (br.index, false)] {
                nl.set_ipv6_off(l).await.unwrap();
                if master {
                    nl.set_master(l, br.index).await.unwrap();
                }
                nl.set_up(l).await.unwrap();
            }
            let frame = test_frame(DST, SRC, None, &[5; 46]);

            // Without the filter the frame gets through (so the check below can fail).
            let before = peer_rx(&nl).await;
            write_tap(&tap_fd, &frame);
            wait_until(|| async { peer_rx(&nl).await > before }).await;

            nl.add_clsact(tap).await.unwrap();
            let drop = nl.add_drop_all(tap, Hook::Ingress).await.unwrap();
            assert_eq!(drop.kind, "bpf");
            let shown = run("tc", &["filter", "show", "dev", "vmhmon0", "ingress"]);
            assert!(shown.contains("direct-action") && shown.contains("bytecode '1,6 0 0 2'"), "{shown}");
            let before = peer_rx(&nl).await;
            for _ in 0..5 {
                write_tap(&tap_fd, &frame);
            }
            // Lift the filter and send one more: exactly that one arrives, so the five were dropped
            // (not merely late).
            nl.del_filter(tap, &drop).await.unwrap();
            write_tap(&tap_fd, &frame);
            wait_until(|| async { peer_rx(&nl).await > before }).await;
            assert_eq!(peer_rx(&nl).await, before + 1);
        });
    }

    /// Packets `peer0` received.
    async fn peer_rx(nl: &Netlink) -> u64 {
        nl.link_counters().await.unwrap()["peer0"].rx_packets
    }

    /// Waits (yielding to the runtime, up to [`WAIT`]) until `cond` holds.
    async fn wait_until<F, Fut>(cond: F)
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = std::time::Instant::now() + WAIT;
        while !cond().await {
            assert!(std::time::Instant::now() < deadline, "condition not met within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[test]
    fn the_daemons_seccomp_filter_allows_tc_and_the_link_watch() {
        in_netns(|| async {
            // Fixtures first: under the filter no program can be run.
            run("ip", &["link", "add", "src0", "type", "veth", "peer", "name", "peer0"]);
            // The filter binds this thread only (the test's own), as it binds the daemon's.
            crate::sandbox::seccomp::apply(crate::config::SeccompMode::Enforce).unwrap();
            // SAFETY: a plain unshare, refused under the filter (proves it is in force).
            let refused = unsafe { libc::unshare(libc::CLONE_NEWNS) };
            assert_eq!((refused, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
            let nl = Netlink::connect().unwrap();
            let mut watch = super::super::watch::LinkWatch::open().unwrap();
            let src = nl.link_by_name("src0").await.unwrap().unwrap().index;
            let tap_fd = create_tap("vmhmon0").unwrap();
            let tap = nl.link_by_name("vmhmon0").await.unwrap().unwrap().index;
            nl.set_ipv6_off(tap).await.unwrap();
            nl.set_promisc(src, true).await.unwrap();
            nl.add_clsact(src).await.unwrap();
            let id = nl.add_mirror(src, Hook::Ingress, 0, tap, COOKIE).await.unwrap();
            nl.add_clsact(tap).await.unwrap();
            nl.add_drop_all(tap, Hook::Ingress).await.unwrap();
            assert_eq!(nl.filters(src, Hook::Ingress).await.unwrap()[0].id, id);
            nl.del_filter(src, &id).await.unwrap();
            nl.del_clsact(src).await.unwrap();
            nl.set_up(src).await.unwrap();
            let seen = tokio::time::timeout(WAIT, async {
                while let Some(change) = watch.next().await {
                    if change.name == "src0" {
                        return true;
                    }
                }
                false
            });
            assert!(seen.await.unwrap(), "the watch sees src0 change");
            drop(tap_fd);
        });
    }

    #[test]
    fn del_filter_removes_only_its_own_filter() {
        in_netns(|| async {
            let nl = Netlink::connect().unwrap();
            let src = source(&nl).await;
            let tap_fd = create_tap("vmhmon0").unwrap();
            let tap = nl.link_by_name("vmhmon0").await.unwrap().unwrap().index;
            nl.add_clsact(src).await.unwrap();
            // Foreign filters: a u32 one, and after ours a bpf one at our very priority.
            run("tc", &["filter", "add", "dev", "src0", "ingress", "u32", "match", "u8", "0", "0", "flowid", "1:1"]);
            let ours = nl.add_mirror(src, Hook::Ingress, 0, tap, COOKIE).await.unwrap();
            let pref = ours.prio.to_string();
            let args = ["filter", "add", "dev", "src0", "ingress", "pref", &pref, "protocol", "all", "handle", "0x7"];
            run("tc", &[&args[..], &["bpf", "bytecode", "1,6 0 0 0,"]].concat());
            let before = nl.filters(src, Hook::Ingress).await.unwrap();
            let foreign: Vec<&FilterInfo> = before.iter().filter(|f| f.id != ours).collect();
            assert!(foreign.iter().any(|f| f.id.kind == "u32"), "{before:?}");
            assert!(foreign.iter().any(|f| f.id.prio == ours.prio && f.id.handle == 7), "{before:?}");
            assert!(foreign.iter().all(|f| f.cookie.is_none()), "{before:?}");

            // A wrong kind or handle at our place deletes nothing.
            let wrong_kind = FilterId { kind: "u32".into(), ..ours.clone() };
            assert!(matches!(nl.del_filter(src, &wrong_kind).await.unwrap_err(), NetError::NotFound(_)));
            let wrong_handle = FilterId { handle: 0x99, ..ours.clone() };
            assert!(matches!(nl.del_filter(src, &wrong_handle).await.unwrap_err(), NetError::NotFound(_)));
            let whole_prio = FilterId { handle: 0, ..ours.clone() };
            assert!(matches!(nl.del_filter(src, &whole_prio).await.unwrap_err(), NetError::NotFound(_)));
            assert_eq!(nl.filters(src, Hook::Ingress).await.unwrap(), before);

            nl.del_filter(src, &ours).await.unwrap();
            let after = nl.filters(src, Hook::Ingress).await.unwrap();
            let expected: Vec<FilterInfo> = before.iter().filter(|f| f.id != ours).cloned().collect();
            assert_eq!(after, expected);
            let err = nl.del_filter(src, &ours).await.unwrap_err();
            assert!(matches!(err, NetError::NotFound(_)), "{err:?}");
            assert!(nl.has_clsact(src).await.unwrap());
            drop(tap_fd);
        });
    }
}
