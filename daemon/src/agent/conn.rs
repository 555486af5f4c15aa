//! One session with a guest agent over the VM's virtio-serial chardev socket.
//!
//! Order: [`AgentConn::connect`] (connect, resync, `hello`), then [`AgentConn::call`] as often as
//! needed; drop it on any error and connect again. The guest is hostile: every line is at most
//! [`super::frame::MAX_FRAME`] bytes (a longer one ends the session), every wait is bounded,
//! replies are parsed into closed types, and at most [`super::frame::MAX_SKIPPED_BYTES`] of
//! unrelated lines are read while waiting for one reply.
//!
//! Resync: the byte stream survives host disconnects, so it may hold a partial line or stale
//! replies from an earlier session. A session starts with a bare `\n` (ends whatever partial line
//! the agent holds) and a `sync` request carrying a fresh nonce; every line until the reply with
//! that nonce is discarded. Request ids are then numbered from 1 and a reply with another id is
//! skipped, so nothing stale can be taken for an answer. Framing and reply matching are the pure
//! functions of [`super::frame`].

use super::error::AgentError;
use super::frame::{match_reply, LineReader, SkipBudget};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use vmhost_agent_protocol::{Hello, SyncParams, SyncReply, PROTOCOL_VERSION};

/// An open, synchronised session.
#[derive(Debug)]
pub struct AgentConn {
    stream: UnixStream,
    reader: LineReader,
    next_id: u64,
    /// What the agent said in `hello`.
    pub hello: Hello,
}

fn nonce() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:x}{:x}", t.as_nanos(), std::process::id())
}

impl AgentConn {
    /// Connects to `socket`, resynchronises the stream and says hello.
    ///
    /// # Errors
    /// [`AgentError`] when the socket is absent, the agent does not answer in `timeout`, or
    /// answers with something that is not the protocol.
    pub async fn connect(socket: &Path, timeout: Duration) -> Result<AgentConn, AgentError> {
        let stream = tokio::time::timeout(timeout, UnixStream::connect(socket))
            .await
            .map_err(|_| AgentError::Timeout(timeout))?
            .map_err(AgentError::Connect)?;
        let mut conn = AgentConn {
            stream,
            reader: LineReader::new(),
            next_id: 1,
            hello: Hello { agent_version: String::new(), protocol_version: 0, capabilities: Vec::new() },
        };
        let n = nonce();
        let sync_id = format!("sync-{n}");
        let params = SyncParams { nonce: n.clone() };
        let line = json!({"jsonrpc": "2.0", "id": sync_id, "method": "sync", "params": params});
        conn.write_line(&format!("\n{line}")).await?;
        let reply: SyncReply = conn.wait_reply(&json!(sync_id), timeout).await?;
        if reply.nonce != n {
            return Err(AgentError::Protocol("sync answered with another nonce".into()));
        }
        conn.hello = conn.call("hello", json!({}), timeout).await?;
        if conn.hello.protocol_version != PROTOCOL_VERSION {
            return Err(AgentError::Protocol(format!(
                "protocol version {} (want {PROTOCOL_VERSION})",
                conn.hello.protocol_version
            )));
        }
        Ok(conn)
    }

    /// Calls `method` and parses the result into `T`.
    ///
    /// # Errors
    /// [`AgentError`]; after any error other than `Remote` the session must be dropped.
    pub async fn call<T: DeserializeOwned>(
        &mut self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<T, AgentError> {
        let id = self.next_id;
        self.next_id += 1;
        let line = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        self.write_line(&line.to_string()).await?;
        self.wait_reply(&json!(id), timeout).await
    }

    /// The synchronised stream, the bytes already read past the last reply and the next free
    /// request id: for a session that goes on with bulk transfers of its own (an exec port's,
    /// [`super::exec::session`]) after [`AgentConn::connect`].
    pub fn into_parts(self) -> (UnixStream, LineReader, u64) {
        (self.stream, self.reader, self.next_id)
    }

    async fn write_line(&mut self, text: &str) -> Result<(), AgentError> {
        let mut bytes = text.as_bytes().to_vec();
        bytes.push(b'\n');
        self.stream.write_all(&bytes).await.map_err(|e| AgentError::Closed(e.to_string()))
    }

    /// Reads replies until the one with `id`, bounded in time and in bytes skipped.
    async fn wait_reply<T: DeserializeOwned>(&mut self, id: &Value, timeout: Duration) -> Result<T, AgentError> {
        let deadline = Instant::now() + timeout;
        let mut budget = SkipBudget::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line =
                tokio::time::timeout(left, self.read_line()).await.map_err(|_| AgentError::Timeout(timeout))??;
            if let Some(outcome) = match_reply(&line, id) {
                return outcome;
            }
            budget.skip(&line)?;
        }
    }

    /// One line without its newline; more than [`super::frame::MAX_FRAME`] bytes ends the session.
    async fn read_line(&mut self) -> Result<Vec<u8>, AgentError> {
        loop {
            if let Some(line) = self.reader.next_line()? {
                return Ok(line);
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await.map_err(|e| AgentError::Closed(e.to_string()))?;
            if n == 0 {
                return Err(AgentError::Closed("EOF".into()));
            }
            self.reader.push(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, BufReader};
    use tokio::net::UnixListener;

    /// A scripted fake agent: answers sync and hello properly, then runs `then` on the stream.
    async fn fake_agent<F, Fut>(path: std::path::PathBuf, then: F)
    where
        F: FnOnce(BufReader<tokio::net::unix::OwnedReadHalf>, tokio::net::unix::OwnedWriteHalf) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            // Stale data from an "earlier session" first.
            w.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{\"stale\":true}}\npartial garb").await.unwrap();
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).await.unwrap() == 0 {
                    return;
                }
                let Ok(v) = serde_json::from_str::<Value>(&line) else { continue };
                let id = v["id"].clone();
                match v["method"].as_str() {
                    Some("sync") => {
                        let reply = json!({"jsonrpc": "2.0", "id": id, "result": {"nonce": v["params"]["nonce"]}});
                        w.write_all(format!("\n{reply}\n").as_bytes()).await.unwrap();
                    }
                    Some("hello") => {
                        let reply = json!({"jsonrpc": "2.0", "id": id, "result":
                            {"agent_version": "t", "protocol_version": 1, "capabilities": ["agent.info"]}});
                        w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
                        break;
                    }
                    _ => {}
                }
            }
            then(r, w).await;
        });
    }

    #[tokio::test]
    async fn resync_skips_stale_data_and_calls_match_ids() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("agent");
        fake_agent(p.clone(), |mut r, mut w| async move {
            let mut line = String::new();
            r.read_line(&mut line).await.unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            // A stale reply with another id, then the real one.
            w.write_all(b"{\"jsonrpc\":\"2.0\",\"id\":99,\"result\":1}\n").await.unwrap();
            let reply = json!({"jsonrpc": "2.0", "id": v["id"], "result": {"version": "t", "hostname": "g",
                "kernel": "6.1", "uptime_s": 5, "boot_id": "b", "rss_kib": 900}});
            w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
        })
        .await;
        let mut c = AgentConn::connect(&p, Duration::from_secs(5)).await.unwrap();
        assert_eq!(c.hello.protocol_version, 1);
        let info: vmhost_agent_protocol::AgentInfo =
            c.call("agent.info", json!({}), Duration::from_secs(5)).await.unwrap();
        assert_eq!(info.hostname, "g");
    }

    async fn hostile(reply: &'static [u8]) -> AgentError {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("agent");
        fake_agent(p.clone(), move |mut r, mut w| async move {
            let mut line = String::new();
            let _ = r.read_line(&mut line).await;
            let _ = w.write_all(reply).await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        })
        .await;
        let mut c = AgentConn::connect(&p, Duration::from_secs(5)).await.unwrap();
        c.call::<vmhost_agent_protocol::AgentInfo>("agent.info", json!({}), Duration::from_millis(800))
            .await
            .unwrap_err()
    }

    #[tokio::test]
    async fn hostile_replies_are_refused_in_bounded_time() {
        // Extra fields in a reply: refused by the closed type.
        let e = hostile(b"{\"jsonrpc\":\"2.0\",\"id\":2,\"result\":{\"version\":\"t\",\"hostname\":\"g\",\"kernel\":\"k\",\"uptime_s\":1,\"boot_id\":\"b\",\"rss_kib\":1,\"host_path\":\"/etc\"}}\n").await;
        assert!(matches!(e, AgentError::Protocol(_)), "{e:?}");
        // Garbage and invalid UTF-8 are skipped; nothing else comes: a timeout.
        let e = hostile(b"\xff\xfe garbage\n{not json}\n").await;
        assert!(matches!(e, AgentError::Timeout(_)), "{e:?}");
        // A stall: a timeout.
        let e = hostile(b"").await;
        assert!(matches!(e, AgentError::Timeout(_)), "{e:?}");
    }

    #[tokio::test]
    async fn a_flood_of_long_garbage_lines_stops_being_read_after_the_byte_cap() {
        // 64 lines of 60 KiB (each within the frame limit, far fewer than the old cap of 1000
        // lines), then the real reply: the wait gives up after MAX_SKIPPED_BYTES instead of
        // parsing 3.75 MiB of garbage.
        static FLOOD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let flood: &'static [u8] = FLOOD.get_or_init(|| {
            let mut v = Vec::new();
            for _ in 0..64 {
                v.extend(std::iter::repeat_n(b'g', 60 * 1024));
                v.push(b'\n');
            }
            v.extend_from_slice(br#"{"jsonrpc":"2.0","id":2,"result":{"version":"t","hostname":"g","kernel":"k","uptime_s":1,"boot_id":"b","rss_kib":1}}"#);
            v.push(b'\n');
            v
        });
        let e = hostile(flood).await;
        assert!(matches!(e, AgentError::Protocol(ref m) if m == "more than 262144 bytes of unrelated lines"), "{e:?}");
    }

    #[tokio::test]
    async fn an_oversize_line_ends_the_session() {
        static BIG: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let big: &'static [u8] = BIG.get_or_init(|| vec![b'x'; 10 * 1024 * 1024]);
        let e = hostile(big).await;
        assert!(matches!(e, AgentError::Protocol(ref m) if m.contains("longer than")), "{e:?}");
    }
}
