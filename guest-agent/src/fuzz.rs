//! The request parser as the cargo fuzz target `agent_request` drives it (`guest-agent/fuzz/`), and
//! the replay of its corpus and past crashes as unit tests.
//!
//! [`requests`] feeds arbitrary host bytes through exactly the path a real port loop takes
//! ([`LineBuffer::push`] → [`handle_frame`] → the method's closed parameter types and pure
//! validation), with the kernel replaced by a fabricated snapshot so that no input can change the
//! machine running the fuzzer. It panics when a reply breaks the protocol's promises: every
//! request line is answered by one JSON-RPC 2.0 object within the frame limit, and no more than
//! [`MAX_FRAME`] bytes of an unfinished line are ever held. No production code calls it.

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::Value;

use crate::agent::{Agent, NoParams, Paths};
use crate::apply::{self, ApplyParams};
use crate::check::{self, CheckParams};
use crate::netlink::{Address, Link, Route};
use crate::probe::ProbeOutcome;
use crate::protocol::{handle_frame, parse_params, LineBuffer, Methods, RpcError, MAX_FRAME};
use crate::state::{Dns, Snapshot};

/// The agent's methods with a fabricated kernel: `sync`, `hello` and `agent.info` are the real
/// ones; `net.state`, `net.check` and `net.apply` parse and validate exactly as the real ones do,
/// then read [`fabricated_snapshot`] and stop before any netlink call.
struct Offline {
    agent: Agent,
    snapshot: Snapshot,
}

/// A guest with `lo` and `eth0` (10.0.0.5/24, default route via 10.0.0.1) and an agent-made VLAN.
fn fabricated_snapshot() -> Snapshot {
    let link = |index: u32, name: &str, kind: &str, alias: &str, mac: Option<[u8; 6]>| Link {
        index,
        name: name.into(),
        kind: kind.into(),
        alias: alias.into(),
        up: true,
        promisc: false,
        mtu: 1500,
        mac,
        parent: (kind == "vlan").then_some(2),
        vlan_id: (kind == "vlan").then_some(20),
    };
    Snapshot {
        links: vec![
            link(1, "lo", "", "", None),
            link(2, "eth0", "", "", Some([0x52, 0x54, 0, 0x12, 0x34, 0x56])),
            link(3, "eth0.20", "vlan", "vmhost-agent", Some([0x52, 0x54, 0, 0x12, 0x34, 0x56])),
        ],
        addresses: vec![
            Address { index: 1, addr: Ipv4Addr::LOCALHOST, prefix: 8 },
            Address { index: 2, addr: Ipv4Addr::new(10, 0, 0, 5), prefix: 24 },
        ],
        routes: vec![Route {
            dst: Ipv4Addr::UNSPECIFIED,
            dst_len: 0,
            gateway: Some(Ipv4Addr::new(10, 0, 0, 1)),
            oif: Some(2),
            priority: 0,
        }],
    }
}

impl Methods for Offline {
    fn call(&mut self, method: &str, params: Option<Value>) -> Result<Value, RpcError> {
        let state = || self.snapshot.view(Dns::default());
        match method {
            "net.state" => {
                parse_params::<NoParams>(params)?;
                to_value(&state())
            }
            "net.check" => {
                let p: CheckParams = parse_params(params)?;
                let expected = check::validate(&p.expected)?;
                to_value(&check::evaluate(&expected, &state(), &mut |_| ProbeOutcome::NoReply(Duration::ZERO)))
            }
            "net.apply" => {
                let p: ApplyParams = parse_params(params)?;
                let desired = apply::validate(&p, &self.snapshot)?;
                let plan = apply::plan(&desired, &self.snapshot);
                Ok(Value::String(format!("{plan:?}")))
            }
            _ => self.agent.call(method, params),
        }
    }
}

/// A reply value, as the real methods serialise theirs.
fn to_value<T: serde::Serialize>(value: &T) -> Result<Value, RpcError> {
    serde_json::to_value(value).map_err(|e| RpcError::internal(e.to_string()))
}

/// Runs `data` through the agent's framing and request handling as the host's bytes.
///
/// The first byte chooses how the rest is cut into reads (1 to 256 bytes each), so that the same
/// input also exercises lines split across reads.
///
/// # Panics
/// When a reply breaks the protocol's promises (see the module documentation): that is a bug the
/// fuzzer found.
pub fn requests(data: &[u8]) {
    let Some((&step, rest)) = data.split_first() else { return };
    // Nothing of the machine is read either: /proc of an instrumented process is slow to read
    // (smaps_rollup walks its sanitizer's shadow mappings) and says nothing about the parser.
    let nowhere = std::path::PathBuf::from("/nonexistent/vmhost-agent-fuzz");
    let paths = Paths {
        resolv_conf: nowhere.join("resolv.conf"),
        resolved_conf: nowhere.join("resolved.conf"),
        intent: nowhere.join("intent"),
        proc_root: nowhere,
    };
    let mut methods = Offline { agent: Agent::new(paths), snapshot: fabricated_snapshot() };
    let mut buffer = LineBuffer::new();
    for chunk in rest.chunks(usize::from(step) + 1) {
        buffer.push(chunk, |frame| {
            if let Some(reply) = handle_frame(&frame, &mut methods) {
                check_reply(&reply);
            }
        });
        assert!(buffer.pending() <= MAX_FRAME, "held {} bytes of an unfinished line", buffer.pending());
    }
}

/// One reply: a single line (the `sync` answer may start with a newline) holding a JSON-RPC 2.0
/// response object, within the frame limit.
fn check_reply(reply: &str) {
    let line = reply.strip_prefix('\n').unwrap_or(reply);
    assert!(!line.contains('\n'), "a reply spans lines: {line:?}");
    assert!(line.len() <= MAX_FRAME, "a reply of {} bytes", line.len());
    let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("reply is not JSON ({e}): {line}"));
    assert_eq!(value.get("jsonrpc"), Some(&Value::from("2.0")), "{line}");
    assert!(value.get("id").is_some(), "a reply without id: {line}");
    assert!(value.get("result").is_some() != value.get("error").is_some(), "result xor error: {line}");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Every input of the committed corpus and every past crash, through the fuzz entry point.
    #[test]
    fn the_fuzz_corpus_and_past_crashes_replay_cleanly() {
        let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
        let mut seen = 0;
        for dir in ["corpus/agent_request", "regressions/agent_request"] {
            let Ok(entries) = std::fs::read_dir(fuzz.join(dir)) else { continue };
            for entry in entries.flatten() {
                let data = std::fs::read(entry.path()).expect("read corpus file");
                requests(&data);
                seen += 1;
            }
        }
        assert!(seen >= 5, "the seed corpus is committed ({seen} inputs found)");
    }

    #[test]
    fn a_stream_of_valid_and_broken_requests_is_answered_within_the_rules() {
        let mut input = vec![7u8];
        input.extend_from_slice(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"sync\",\"params\":{\"nonce\":\"n\"}}\n");
        input.extend_from_slice(
            b"{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"net.apply\",\"params\":{\"interfaces\":[]}}\n",
        );
        input.extend_from_slice(b"\xff\n[1,2]\n{\"id\":{}}\n");
        input.extend(std::iter::repeat_n(b'x', MAX_FRAME + 10));
        input.extend_from_slice(b"\n{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"net.state\"}\n");
        requests(&input);
    }
}
