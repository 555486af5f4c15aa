//! Link notifications: a netlink socket subscribed to `RTNLGRP_LINK`.
//!
//! Capture sources come and go (a bond is rebuilt, a VLAN sub-interface is deleted and made
//! again, a USB NIC is unplugged): when one comes back, it is a new link with a new ifindex and
//! no filters, and its monitors must be set up again. Polling would either lag or spin;
//! the kernel announces every link change to the `RTNLGRP_LINK` multicast group instead.
//!
//! Order of use: [`LinkWatch::open`] once (inside a tokio runtime, in the namespace to watch),
//! then [`LinkWatch::next`] in a loop; each [`LinkChange`] says a link appeared, changed or went
//! away, by name. The watcher re-reads the kernel's state on any change (it never trusts the
//! notification's content beyond the name), so a lost notification costs nothing once the next
//! arrives; if the kernel had to drop notifications because the socket's buffer was full, `next`
//! yields a change with an empty name, which means "anything may have changed".
//!
//! The socket needs no capability: `NETLINK_ROUTE` lets any process join `RTNLGRP_LINK`. Under
//! the daemon's seccomp filter it uses `socket`, `bind`, `setsockopt` and `recvfrom`, all
//! allowed for the netlink socket it already has.

use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::sys::{AsyncSocket, SocketAddr};
use rtnetlink::MulticastGroup;

use super::NetError;

/// The receive buffer asked for: room for a burst of link changes (a bond of many ports going
/// down) before the kernel drops notifications.
const RECEIVE_BUFFER: usize = 1 << 20;

/// One link notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkChange {
    /// The link's name; empty when notifications were lost (re-read every link then).
    pub name: String,
    /// True when the link exists after the change (`RTM_NEWLINK`), false when it went away
    /// (`RTM_DELLINK`) or notifications were lost.
    pub present: bool,
}

/// The notifications the connection task forwards.
type Notifications = Pin<Box<dyn Stream<Item = (NetlinkMessage<RouteNetlinkMessage>, SocketAddr)> + Send>>;

/// A netlink socket subscribed to `RTNLGRP_LINK`; yields the names of links that appeared,
/// changed or went away.
pub struct LinkWatch {
    /// What the kernel multicasts, forwarded by the connection task.
    messages: Notifications,
    /// The connection task, stopped when the watch is dropped.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for LinkWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LinkWatch {
    /// Opens the socket, joins `RTNLGRP_LINK` and spawns its connection task on the current tokio
    /// runtime. Notifications start at once; the caller reads the links' present state itself
    /// after opening, so nothing between the two is missed.
    ///
    /// # Errors
    /// [`NetError::Io`] when the socket cannot be opened or joined to the group, or when called
    /// outside a tokio runtime.
    pub fn open() -> Result<LinkWatch, NetError> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| NetError::Io { op: "link watch", source: std::io::Error::other(e) })?;
        let (mut connection, _handle, messages) = rtnetlink::new_multicast_connection(&[MulticastGroup::Link])
            .map_err(|source| NetError::Io { op: "link watch socket", source })?;
        // A smaller buffer only means an overrun sooner, which `next` reports: not fatal.
        if let Err(e) = connection.socket_mut().socket_mut().set_rx_buf_sz(RECEIVE_BUFFER) {
            tracing::debug!(error = %e, "cannot enlarge the link watch's receive buffer");
        }
        let task = runtime.spawn(connection);
        Ok(LinkWatch { messages: Box::pin(messages), task })
    }

    /// The next link change; `None` when the socket is closed (the connection task ended).
    pub async fn next(&mut self) -> Option<LinkChange> {
        while let Some((msg, _)) = self.messages.next().await {
            match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) => {
                    return Some(LinkChange { name: name_of(&link), present: true });
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(link)) => {
                    return Some(LinkChange { name: name_of(&link), present: false });
                }
                NetlinkPayload::Overrun(_) => return Some(LinkChange { name: String::new(), present: false }),
                _ => {}
            }
        }
        None
    }
}

/// The `IFLA_IFNAME` of a link notification (always sent by the kernel).
fn name_of(link: &LinkMessage) -> String {
    link.attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::IfName(name) => Some(name.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::Duration;

    use super::super::testing::in_netns;
    use super::*;

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    /// Reads changes until one for `name` with `present` arrives (other links' and repeated
    /// changes are skipped), failing after ten seconds.
    async fn until(watch: &mut LinkWatch, name: &str, present: bool) {
        let wait = async {
            loop {
                let change = watch.next().await.expect("watch closed");
                if change.name == name && change.present == present {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("no change {name} present={present}"));
    }

    #[test]
    fn a_link_deleted_and_made_again_is_seen_each_time() {
        in_netns(|| async {
            let mut watch = LinkWatch::open().unwrap();
            ip(&["link", "add", "eth9", "type", "veth", "peer", "name", "eth9p"]);
            until(&mut watch, "eth9", true).await;
            ip(&["link", "set", "eth9", "up"]);
            until(&mut watch, "eth9", true).await;
            ip(&["link", "del", "eth9"]);
            until(&mut watch, "eth9", false).await;
            ip(&["link", "add", "eth9", "type", "veth", "peer", "name", "eth9p"]);
            until(&mut watch, "eth9", true).await;
        });
    }

    #[test]
    fn open_outside_a_runtime_is_an_error() {
        assert_eq!(LinkWatch::open().err().map(|e| e.code()), Some("io"));
    }
}
