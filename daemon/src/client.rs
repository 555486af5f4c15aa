//! A small synchronous client for the daemon's socket, used by `vmhostctl`, the benchmark and
//! the tests.
//!
//! Blocking std I/O on purpose: its users make one call at a time and should not need an async
//! runtime. It speaks the framing of [`crate::rpc::server`]: one JSON-RPC 2.0 message per line.
//!
//! Order of use: [`Client::connect`], optionally [`Client::set_timeout`], then [`Client::call`]
//! for typed calls ([`Client::call_streaming`] for a call whose output comes as notifications
//! before its answer). For events, [`Client::subscribe_events`] once, then [`Client::next_event`] in
//! a loop. [`Client::console`] turns the connection into a console's byte stream. Protocol tests use [`Client::call_raw`], [`Client::send_raw`] and
//! [`Client::read_raw_line`] to send arbitrary bytes and see the daemon's exact answer.

use crate::api::{ApiError, ConsoleAttached, Event, EVENT_NOTIFICATION};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, ErrorKind, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Default time to wait for an answer: VM operations (image copies, guest shutdowns) can be slow.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// How long to look for the daemon's reason after it closed the connection on us.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// Why a client operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting, reading or writing the socket failed, or the daemon closed the connection.
    #[error("daemon socket: {0}")]
    Io(#[from] io::Error),
    /// The daemon sent something that is not the JSON-RPC this client expects.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The daemon answered with an error (including 1001 when it refuses this peer).
    #[error(transparent)]
    Api(#[from] ApiError),
    /// No answer within the timeout.
    #[error("no answer from the daemon within {0:?}")]
    Timeout(Duration),
}

/// A connection to the daemon.
#[derive(Debug)]
pub struct Client {
    /// The socket; writes go through `get_ref()`.
    reader: BufReader<UnixStream>,
    /// Bytes of a line whose end has not arrived yet; kept across timeouts so nothing is lost.
    partial: Vec<u8>,
    /// Notifications that arrived while waiting for an answer, oldest first.
    queued: VecDeque<Value>,
    /// Id of the next call.
    next_id: u64,
    /// How long a call waits for its answer.
    timeout: Duration,
    /// The id of the events subscription, once [`Client::subscribe_events`] succeeded.
    subscription: Option<Value>,
}

impl Client {
    /// Connects to the daemon's socket.
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`] when the socket cannot be reached (missing file, no permission,
    /// nobody listening); the message names the path.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref();
        let stream =
            UnixStream::connect(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        stream.set_write_timeout(Some(DEFAULT_TIMEOUT))?;
        Ok(Client {
            reader: BufReader::new(stream),
            partial: Vec::new(),
            queued: VecDeque::new(),
            next_id: 1,
            timeout: DEFAULT_TIMEOUT,
            subscription: None,
        })
    }

    /// Sets how long calls wait for their answer (and writes for the daemon to read).
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`] for a zero timeout or when the socket rejects the setting.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), ClientError> {
        self.reader.get_ref().set_write_timeout(Some(timeout))?;
        self.timeout = timeout;
        Ok(())
    }

    /// The current call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Calls `method` and decodes its result. `params` is sent as given, or left out when it is
    /// `null`. Notifications that arrive meanwhile are kept for [`Client::next_event`].
    ///
    /// # Errors
    ///
    /// [`ClientError::Api`] with the daemon's error (also for a connection-level refusal such
    /// as 1001), [`ClientError::Timeout`] when no answer came in time, [`ClientError::Protocol`]
    /// when the result does not decode as `T`, [`ClientError::Io`] when the connection fails.
    pub fn call<T: DeserializeOwned>(&mut self, method: &str, params: Value) -> Result<T, ClientError> {
        self.exchange(method, params, None, |_| Ok(()))
    }

    /// Calls `method` like [`Client::call`], handing each notification named `notification`
    /// that arrives before the answer to `on_notification` (its `params`) as it comes, in order;
    /// other notifications are queued as [`Client::call`] queues them. This is how
    /// `vm.exec {stream: true}` delivers output before its answer.
    ///
    /// # Errors
    ///
    /// As [`Client::call`]; an error `on_notification` returns ends the call with it (the answer
    /// is not waited for).
    pub fn call_streaming<T: DeserializeOwned>(
        &mut self,
        method: &str,
        params: Value,
        notification: &str,
        on_notification: impl FnMut(Value) -> Result<(), ClientError>,
    ) -> Result<T, ClientError> {
        self.exchange(method, params, Some(notification), on_notification)
    }

    /// One request and its answer; notifications named `notification` go to `on_notification`,
    /// the others to the queue, answers to earlier calls that timed out are skipped.
    fn exchange<T: DeserializeOwned>(
        &mut self,
        method: &str,
        params: Value,
        notification: Option<&str>,
        mut on_notification: impl FnMut(Value) -> Result<(), ClientError>,
    ) -> Result<T, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut request = json!({"jsonrpc": "2.0", "id": id, "method": method});
        if !params.is_null() {
            request["params"] = params;
        }
        self.send_line(&request.to_string())?;
        let deadline = Instant::now() + self.timeout;
        let id = Value::from(id);
        loop {
            let mut message = self.read_message(deadline, self.timeout)?;
            if is_notification(&message) {
                if notification.is_some() && message.get("method").and_then(Value::as_str) == notification {
                    on_notification(message.get_mut("params").map(Value::take).unwrap_or(Value::Null))?;
                } else {
                    self.queued.push_back(message);
                }
                continue;
            }
            let answer_id = message.get("id");
            if answer_id == Some(&id) {
                return decode_result(method, message);
            }
            if answer_id == Some(&Value::Null) {
                if let Some(error) = message.get("error") {
                    // Addressed to no request: the daemon refuses the peer or the line.
                    return Err(ClientError::Api(ApiError::from_json(error)));
                }
            }
            // Anything else is a late answer to an earlier call that timed out: skip it.
        }
    }

    /// Sends `line` as is (a `\n` is added when missing) and returns the next message that is
    /// not a notification, as its elements when it is a batch answer.
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`] (`UnexpectedEof` when the daemon closed the connection),
    /// [`ClientError::Timeout`], or [`ClientError::Protocol`] when the answer is not JSON.
    pub fn call_raw(&mut self, line: &str) -> Result<Vec<Value>, ClientError> {
        let mut bytes = line.as_bytes().to_vec();
        if !bytes.ends_with(b"\n") {
            bytes.push(b'\n');
        }
        self.send_raw(&bytes)?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let message = self.read_message(deadline, self.timeout)?;
            if is_notification(&message) {
                self.queued.push_back(message);
                continue;
            }
            return Ok(match message {
                Value::Array(elements) => elements,
                single => vec![single],
            });
        }
    }

    /// Writes raw bytes to the socket, framing and all.
    ///
    /// # Errors
    ///
    /// [`ClientError::Io`] when the write fails, [`ClientError::Timeout`] when the daemon does
    /// not read within the timeout.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let mut socket = self.reader.get_ref();
        socket.write_all(bytes).map_err(|e| self.timeout_or(e))?;
        Ok(())
    }

    /// Reads the next line from the daemon, whatever it is, without its `\n`; `None` at EOF.
    ///
    /// # Errors
    ///
    /// [`ClientError::Timeout`], [`ClientError::Io`], or [`ClientError::Protocol`] for a line
    /// that is not UTF-8.
    pub fn read_raw_line(&mut self) -> Result<Option<String>, ClientError> {
        self.read_line(Instant::now() + self.timeout, self.timeout)
    }

    /// Attaches to the serial console of VM `name` (`vm.console`): on success the connection is
    /// no longer JSON-RPC but the console's byte stream, returned with the bytes of it that
    /// already arrived (the start of the replay) and the daemon's answer.
    ///
    /// # Errors
    ///
    /// As [`Client::call`] (4090 when another client writes and `force` is not set, 1002 for a
    /// read-only peer that does not ask for `read_only`, 4091 when the VM has no console).
    pub fn console(
        mut self,
        name: &str,
        read_only: bool,
        force: bool,
    ) -> Result<(UnixStream, Vec<u8>, ConsoleAttached), ClientError> {
        let attached: ConsoleAttached =
            self.call("vm.console", json!({"name": name, "read_only": read_only, "force": force}))?;
        // The answer's line is taken; whatever follows it in the buffer is console output.
        let mut early = std::mem::take(&mut self.partial);
        early.extend_from_slice(self.reader.buffer());
        let stream = self.reader.into_inner();
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        Ok((stream, early, attached))
    }

    /// Subscribes this connection to VM events; returns the subscription id.
    ///
    /// # Errors
    ///
    /// As [`Client::call`].
    pub fn subscribe_events(&mut self) -> Result<Value, ClientError> {
        let id: Value = self.call("events.subscribe", Value::Null)?;
        self.subscription = Some(id.clone());
        Ok(id)
    }

    /// Ends the subscription made by [`Client::subscribe_events`]; true when the daemon had it.
    ///
    /// # Errors
    ///
    /// As [`Client::call`]; [`ClientError::Protocol`] when there is no subscription.
    pub fn unsubscribe_events(&mut self) -> Result<bool, ClientError> {
        let id = self.subscription.take().ok_or_else(|| ClientError::Protocol("not subscribed to events".into()))?;
        self.call("events.unsubscribe", json!([id]))
    }

    /// The next event of the subscription, waiting at most `timeout`; `None` when none came.
    ///
    /// # Errors
    ///
    /// [`ClientError::Api`] when the daemon ends the subscription with an error,
    /// [`ClientError::Protocol`] for a malformed event, [`ClientError::Io`] when the
    /// connection fails or closes.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<Event>, ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            while let Some(notification) = self.queued.pop_front() {
                if let Some(event) = self.decode_event(&notification)? {
                    return Ok(Some(event));
                }
            }
            match self.read_message(deadline, timeout) {
                Ok(message) if is_notification(&message) => self.queued.push_back(message),
                // An answer nobody waits for (a call that timed out earlier).
                Ok(_) => {}
                Err(ClientError::Timeout(_)) => return Ok(None),
                Err(e) => return Err(e),
            }
        }
    }

    /// The event in an `events.event` notification of our subscription; `None` for other
    /// notifications.
    fn decode_event(&self, notification: &Value) -> Result<Option<Event>, ClientError> {
        if notification.get("method").and_then(Value::as_str) != Some(EVENT_NOTIFICATION) {
            return Ok(None);
        }
        let params = notification.get("params").unwrap_or(&Value::Null);
        if let Some(ours) = &self.subscription {
            if params.get("subscription") != Some(ours) {
                return Ok(None);
            }
        }
        if let Some(error) = params.get("error") {
            return Err(ClientError::Api(ApiError::from_json(error)));
        }
        let result = params
            .get("result")
            .ok_or_else(|| ClientError::Protocol(format!("event without result: {notification}")))?;
        serde_json::from_value(result.clone())
            .map(Some)
            .map_err(|e| ClientError::Protocol(format!("malformed event {result}: {e}")))
    }

    /// Writes one request line. When the daemon has already closed the connection, its reason
    /// (an error line it sent before closing, e.g. 1001) is returned instead of the broken pipe.
    fn send_line(&mut self, line: &str) -> Result<(), ClientError> {
        let mut bytes = Vec::with_capacity(line.len() + 1);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        let mut socket = self.reader.get_ref();
        match socket.write_all(&bytes) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
                let deadline = Instant::now() + REFUSAL_WAIT;
                match self.read_message(deadline, REFUSAL_WAIT) {
                    Ok(message) if message.get("id") == Some(&Value::Null) => match message.get("error") {
                        Some(error) => Err(ClientError::Api(ApiError::from_json(error))),
                        None => Err(e.into()),
                    },
                    _ => Err(e.into()),
                }
            }
            Err(e) => Err(self.timeout_or(e)),
        }
    }

    /// Reads the next line and parses it as JSON.
    fn read_message(&mut self, deadline: Instant, budget: Duration) -> Result<Value, ClientError> {
        let line = self.read_line(deadline, budget)?.ok_or_else(|| {
            ClientError::Io(io::Error::new(ErrorKind::UnexpectedEof, "the daemon closed the connection"))
        })?;
        serde_json::from_str(&line)
            .map_err(|e| ClientError::Protocol(format!("invalid JSON from the daemon ({e}): {line}")))
    }

    /// Reads one line, waiting until `deadline`; `budget` is what a timeout reports.
    fn read_line(&mut self, deadline: Instant, budget: Duration) -> Result<Option<String>, ClientError> {
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(ClientError::Timeout(budget));
            }
            self.reader.get_ref().set_read_timeout(Some(remaining))?;
            match self.reader.read_until(b'\n', &mut self.partial) {
                // EOF: hand out an unterminated last line first, then report the end.
                Ok(0) if self.partial.is_empty() => return Ok(None),
                Ok(0) => return self.take_line().map(Some),
                Ok(_) if self.partial.ends_with(b"\n") => return self.take_line().map(Some),
                Ok(_) => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Takes the pending line out of `partial`, without its `\n` or `\r\n`.
    fn take_line(&mut self) -> Result<String, ClientError> {
        let mut line = std::mem::take(&mut self.partial);
        if line.ends_with(b"\n") {
            line.pop();
        }
        if line.ends_with(b"\r") {
            line.pop();
        }
        String::from_utf8(line).map_err(|_| ClientError::Protocol("the daemon sent a line that is not UTF-8".into()))
    }

    /// Maps a write timeout to [`ClientError::Timeout`], other errors to [`ClientError::Io`].
    fn timeout_or(&self, e: io::Error) -> ClientError {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            ClientError::Timeout(self.timeout)
        } else {
            ClientError::Io(e)
        }
    }
}

/// A JSON-RPC notification: a method and no id.
fn is_notification(message: &Value) -> bool {
    message.get("method").is_some() && message.get("id").is_none()
}

/// The result of an answer, or its error.
fn decode_result<T: DeserializeOwned>(method: &str, mut answer: Value) -> Result<T, ClientError> {
    if let Some(error) = answer.get("error") {
        return Err(ClientError::Api(ApiError::from_json(error)));
    }
    let result = answer
        .get_mut("result")
        .map(Value::take)
        .ok_or_else(|| ClientError::Protocol(format!("answer to {method} has neither result nor error")))?;
    serde_json::from_value(result).map_err(|e| ClientError::Protocol(format!("unexpected result of {method}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Code;
    use std::os::unix::net::UnixListener;

    /// A fake daemon: accepts one connection, reads one request line, answers with `lines`.
    fn fake_daemon(lines: &'static [&'static str]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).unwrap();
            let mut out = &stream;
            for line in lines {
                out.write_all(line.as_bytes()).unwrap();
                out.write_all(b"\n").unwrap();
            }
            // Keep the connection open a little so the client sees the lines before EOF.
            std::thread::sleep(Duration::from_millis(300));
        });
        (dir, path)
    }

    #[test]
    fn call_skips_stale_answers_and_queues_notifications() {
        let (_dir, path) = fake_daemon(&[
            r#"{"jsonrpc":"2.0","id":99,"result":"stale"}"#,
            r#"{"jsonrpc":"2.0","method":"events.event","params":{"subscription":5,"result":{"vm":"a","from":null,"to":"running","reason":"r","time":"t"}}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{"n":3}}"#,
        ]);
        let mut client = Client::connect(&path).unwrap();
        let got: Value = client.call("vm.list", Value::Null).unwrap();
        assert_eq!(got, json!({"n": 3}));
        let event = client.next_event(Duration::from_millis(10)).unwrap().unwrap();
        assert_eq!(event.vm, "a");
        assert!(client.next_event(Duration::from_millis(50)).unwrap().is_none());
    }

    #[test]
    fn call_returns_api_errors_and_connection_refusals() {
        let (_dir, path) = fake_daemon(&[
            r#"{"jsonrpc":"2.0","id":1,"error":{"code":4040,"message":"no VM named \"x\"","data":{"kind":"not_found","field":"name","details":null}}}"#,
        ]);
        let mut client = Client::connect(&path).unwrap();
        match client.call::<Value>("vm.get", json!({"name": "x"})) {
            Err(ClientError::Api(e)) => {
                assert_eq!(e.code, Code::NotFound);
                assert_eq!(e.field.as_deref(), Some("name"));
            }
            other => panic!("{other:?}"),
        }
        let (_dir, path) = fake_daemon(&[r#"{"jsonrpc":"2.0","id":null,"error":{"code":1001,"message":"no"}}"#]);
        let mut client = Client::connect(&path).unwrap();
        match client.call::<Value>("vm.list", Value::Null) {
            Err(ClientError::Api(e)) => assert_eq!(e.code, Code::Unauthorized),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn streaming_call_hands_over_its_notifications_in_order_and_queues_the_rest() {
        let (_dir, path) = fake_daemon(&[
            r#"{"jsonrpc":"2.0","method":"vm.exec.output","params":{"name":"a","stream":"stdout","data":"b25l"}}"#,
            r#"{"jsonrpc":"2.0","method":"events.event","params":{"subscription":5,"result":{"vm":"a","from":null,"to":"running","reason":"r","time":"t"}}}"#,
            r#"{"jsonrpc":"2.0","method":"vm.exec.output","params":{"name":"a","stream":"stderr","data":"dHdv"}}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":{"exit_code":3}}"#,
        ]);
        let mut client = Client::connect(&path).unwrap();
        let mut seen = Vec::new();
        let got: Value = client
            .call_streaming("vm.exec", json!({"name": "a"}), "vm.exec.output", |p| {
                seen.push(p["data"].as_str().unwrap_or_default().to_string());
                Ok(())
            })
            .unwrap();
        assert_eq!(got, json!({"exit_code": 3}));
        assert_eq!(seen, ["b25l", "dHdv"]);
        assert!(client.next_event(Duration::from_millis(10)).unwrap().is_some(), "other notifications are kept");
    }

    #[test]
    fn times_out_and_reports_eof() {
        let (_dir, path) = fake_daemon(&[]);
        let mut client = Client::connect(&path).unwrap();
        client.set_timeout(Duration::from_millis(100)).unwrap();
        match client.call::<Value>("vm.list", Value::Null) {
            Err(ClientError::Timeout(d)) => assert_eq!(d, Duration::from_millis(100)),
            other => panic!("{other:?}"),
        }
        client.set_timeout(Duration::from_secs(5)).unwrap();
        assert!(client.read_raw_line().unwrap().is_none());
    }
}
