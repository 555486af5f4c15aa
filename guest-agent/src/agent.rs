//! The agent's methods: maps each JSON-RPC method name to the module that answers it.
//!
//! [`Agent`] implements [`Methods`] for the port loop. Every method parses its parameters into a
//! closed type first (unknown members are -32602, see [`parse_params`]), so nothing reaches the
//! kernel before the request is known to be well-formed. Kernel access opens a fresh netlink socket
//! per request: the agent serves one request at a time and the socket costs microseconds, while a
//! long-lived one would need its own recovery.

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::Value;

use crate::apply::{self, ApplyParams};
use crate::check::{self, CheckParams};
use crate::info;
use crate::log;
use crate::netlink::Netlink;
use crate::probe;
use crate::protocol::{parse_params, Methods, RpcError, INVALID_SEMANTICS, METHOD_NOT_FOUND};
use crate::state::{read_dns, Snapshot, RESOLVED_CONF, RESOLV_CONF};
use vmhost_agent_protocol::{NetStateParams, SyncParams, SyncReply};

/// Longest nonce `sync` accepts, in bytes.
pub const MAX_NONCE: usize = 128;

/// Where the agent reads and writes, overridable for tests and unusual images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// `resolv.conf` to report.
    pub resolv_conf: PathBuf,
    /// systemd-resolved's list of upstream servers, reported instead when `resolv_conf` names
    /// only resolved's local stub.
    pub resolved_conf: PathBuf,
    /// Where `net.apply` saves its intent.
    pub intent: PathBuf,
    /// The proc file system.
    pub proc_root: PathBuf,
}

impl Default for Paths {
    fn default() -> Paths {
        Paths {
            resolv_conf: PathBuf::from(RESOLV_CONF),
            resolved_conf: PathBuf::from(RESOLVED_CONF),
            intent: PathBuf::from("/run/vmhost-agent/intent.json"),
            proc_root: PathBuf::from("/proc"),
        }
    }
}

/// Parameters of the methods that take none.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NoParams {}

/// The method handlers.
#[derive(Debug, Default)]
pub struct Agent {
    /// File locations.
    pub paths: Paths,
    /// The file systems `fs.freeze` froze.
    freezer: crate::freeze::Freezer,
}

/// Serializes a reply value.
pub(crate) fn to_value<T: serde::Serialize>(value: &T) -> Result<Value, RpcError> {
    serde_json::to_value(value).map_err(|e| RpcError::internal(format!("cannot serialize the reply: {e}")))
}

/// Opens netlink, as -32603 when that fails.
fn netlink() -> Result<Netlink, RpcError> {
    Netlink::open().map_err(|e| RpcError::internal(format!("netlink unavailable: {e}")))
}

impl Agent {
    /// An agent using `paths`.
    pub fn new(paths: Paths) -> Agent {
        Agent { paths, freezer: crate::freeze::Freezer::default() }
    }

    /// `net.state` as a typed value; `promisc`: with each link's promiscuous flag.
    fn net_state(&self, promisc: bool) -> Result<crate::state::NetState, RpcError> {
        let snapshot = Snapshot::take(&mut netlink()?)
            .map_err(|e| RpcError::internal(format!("cannot read the network state: {e}")))?;
        Ok(snapshot.view_with(read_dns(&self.paths.resolv_conf, &self.paths.resolved_conf), promisc))
    }
}

/// `sync`, the same on the agent port and the exec ports.
///
/// # Errors
/// -32602 for parameters of the wrong shape, 5100 for an empty or longer than [`MAX_NONCE`] nonce.
pub fn sync(params: Option<Value>) -> Result<Value, RpcError> {
    let p: SyncParams = parse_params(params)?;
    if p.nonce.is_empty() || p.nonce.len() > MAX_NONCE {
        return Err(RpcError::invalid("nonce", format!("nonce must be 1 to {MAX_NONCE} bytes")));
    }
    to_value(&SyncReply { nonce: p.nonce })
}

impl Methods for Agent {
    fn call(&mut self, method: &str, params: Option<Value>) -> Result<Value, RpcError> {
        match method {
            "sync" => sync(params),
            "hello" => {
                parse_params::<NoParams>(params)?;
                to_value(&info::hello())
            }
            "agent.info" => {
                parse_params::<NoParams>(params)?;
                to_value(&info::agent_info(&self.paths.proc_root))
            }
            "net.state" => {
                let p: NetStateParams = parse_params(params)?;
                to_value(&self.net_state(p.promisc)?)
            }
            "net.check" => {
                let p: CheckParams = parse_params(params)?;
                let expected = check::validate(&p.expected)?;
                // The capture checks read the flag; the reply carries only the checks.
                let state = self.net_state(true)?;
                to_value(&check::evaluate(&expected, &state, &mut probe::ping))
            }
            "net.apply" => {
                let p: ApplyParams = parse_params(params)?;
                let result = apply::apply(&p, &mut netlink()?, &self.paths.intent);
                match &result {
                    Ok(r) if r.changed => log(&format!(
                        "net.apply: created {:?} updated {:?} deleted {:?}",
                        r.created, r.updated, r.deleted
                    )),
                    Ok(_) => {}
                    Err(e) if e.code == INVALID_SEMANTICS => log(&format!("net.apply refused: {}", e.message)),
                    Err(e) => log(&format!("net.apply failed: {}", e.message)),
                }
                to_value(&result?)
            }
            "fs.freeze" => {
                let p: vmhost_agent_protocol::FreezeParams = parse_params(params)?;
                let done = std::fs::read_to_string(self.paths.proc_root.join("self/mountinfo"))
                    .map_err(|e| RpcError::internal(format!("cannot read the mount table: {e}")))
                    .and_then(|table| self.freezer.freeze(&table, p.timeout_s));
                match &done {
                    Ok(d) if d.skipped.is_empty() => log(&format!("fs.freeze: froze {:?}", d.mounts)),
                    Ok(d) => log(&format!(
                        "fs.freeze: froze {:?}; {} file system(s) skipped, left as they are",
                        d.mounts,
                        d.skipped.len()
                    )),
                    Err(e) => log(&format!("fs.freeze failed: {}", e.message)),
                }
                let done = done?;
                to_value(&vmhost_agent_protocol::FreezeReport { mounts: done.mounts, skipped: Some(done.skipped) })
            }
            "fs.thaw" => {
                parse_params::<NoParams>(params)?;
                let mounts = self.freezer.thaw();
                log(&format!("fs.thaw: thawed {mounts:?}"));
                to_value(&vmhost_agent_protocol::FreezeReport { mounts, skipped: None })
            }
            _ => Err(RpcError::new(METHOD_NOT_FOUND, format!("unknown method {method:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{handle_line, INVALID_PARAMS};
    use serde_json::json;

    fn call(line: &str) -> Value {
        let mut agent = Agent::default();
        let text = handle_line(line.as_bytes(), &mut agent).expect("a reply");
        serde_json::from_str(text.trim_start()).expect("JSON")
    }

    #[test]
    fn sync_hello_and_info_need_no_kernel() {
        let v = call(r#"{"jsonrpc":"2.0","id":"sync-n1","method":"sync","params":{"nonce":"n1"}}"#);
        assert_eq!(v, json!({"jsonrpc": "2.0", "id": "sync-n1", "result": {"nonce": "n1"}}));
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"hello"}"#);
        assert_eq!(v["result"]["protocol_version"], 1);
        assert_eq!(
            v["result"]["capabilities"],
            json!(["agent.info", "net.state", "net.check", "net.apply", "fs.freeze", "net.capture"])
        );
        let v = call(r#"{"jsonrpc":"2.0","id":2,"method":"agent.info","params":{}}"#);
        assert!(v["result"]["rss_kib"].as_u64().unwrap_or(0) > 0, "{v}");
    }

    #[test]
    fn the_default_paths_are_the_guests_own() {
        let p = Paths::default();
        assert_eq!(p.resolv_conf, PathBuf::from("/etc/resolv.conf"));
        assert_eq!(p.resolved_conf, PathBuf::from("/run/systemd/resolve/resolv.conf"));
        assert_eq!(p.proc_root, PathBuf::from("/proc"));
    }

    #[test]
    fn params_are_checked_before_anything_runs() {
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"sync","params":{}}"#);
        assert_eq!(
            (v["error"]["code"].clone(), v["error"]["data"]["field"].clone()),
            (json!(INVALID_PARAMS), json!("nonce"))
        );
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"sync","params":{"nonce":""}}"#);
        assert_eq!(v["error"]["code"], INVALID_SEMANTICS);
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"hello","params":{"x":1}}"#);
        assert_eq!(v["error"]["data"]["field"], "x");
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"net.apply","params":{"interfaces":[{"name":"d"}]}}"#);
        assert_eq!(v["error"]["data"]["field"], "interfaces[0].address");
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"net.check","params":{"expected":{"gateway":"x"}}}"#);
        assert_eq!(v["error"]["data"]["field"], "expected.gateway");
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"net.state","params":{"promisc":1}}"#);
        assert_eq!(v["error"]["data"]["field"], "promisc");
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"net.apply","params":{"interfaces":[],"capture":["x"]}}"#);
        assert_eq!(v["error"]["data"]["field"], "capture[0]");
        let v = call(r#"{"jsonrpc":"2.0","id":1,"method":"vm.start"}"#);
        assert_eq!(v["error"]["code"], METHOD_NOT_FOUND);
    }
}
