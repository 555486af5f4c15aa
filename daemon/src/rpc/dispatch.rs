//! The one dispatcher: what the server knows of a method once its envelope is parsed.
//!
//! A [`Dispatcher`] maps each method name to an [`Entry`]: whether a read-only peer may call it
//! ([`Access`]) and what runs it ([`Handler`]): a call that parses its params once into their
//! closed type and answers one [`Body`], an event subscription (its notifications go through a
//! [`Sink`]), the unsubscription, or the console switch (which the transport performs itself).
//! The daemon's dispatcher is made from the one method table ([`super::methods::METHODS`]);
//! the transport's tests make small ones of their own.
//!
//! Order of use: [`Dispatcher::new`] and [`Dispatcher::add`] at start-up; per request the
//! server looks the method up ([`Dispatcher::get`]), checks the access, and runs the handler;
//! a subscription is registered ([`Dispatcher::open`]) until [`Dispatcher::unsubscribe`] or
//! its connection ends it.

use crate::api::{ApiError, Code};
use crate::console::Consoles;
use crate::rpc::auth::Role;
use futures_util::future::BoxFuture;
use serde::Serialize;
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};

/// Who may call a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Changes nothing: read-only peers may call it.
    Read,
    /// Changes something: admins only (1002 for read-only peers).
    Write,
}

/// A method's answer, serialized once: written after the response head that carries the
/// client's id, without being copied into another message.
#[derive(Debug, Clone)]
pub enum Body {
    /// JSON shared with other answers (the manager's ready-made `vm.list` and `vm.get` views).
    Shared(Arc<RawValue>),
    /// JSON made for this answer.
    Own(Box<RawValue>),
}

impl Body {
    /// Serializes `value` (once) as an answer.
    ///
    /// # Errors
    /// -32603 if `value` cannot be serialized (a map with non-string keys: a programming error).
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<Body, ApiError> {
        serde_json::value::to_raw_value(value)
            .map(Body::Own)
            .map_err(|e| ApiError::internal(format!("cannot serialize the answer: {e}")))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        match self {
            Body::Shared(raw) => raw.get(),
            Body::Own(raw) => raw.get(),
        }
    }
}

impl From<crate::lifecycle::RawView> for Body {
    fn from(view: crate::lifecycle::RawView) -> Body {
        Body::Shared(view.0)
    }
}

/// A started call: resolves to the answer.
pub type Running = BoxFuture<'static, Result<Body, ApiError>>;

/// Parses the params (absent: `None`) for `caller` and starts the call; `Err` is the refusal to
/// answer (-32602 naming the field, 1004, ...).
pub type CallFn = Arc<dyn Fn(Option<&RawValue>, Caller) -> Result<Running, ApiError> + Send + Sync>;

/// Who makes a call, and where its notifications go.
#[derive(Debug, Clone)]
pub struct Caller {
    /// What the peer may call.
    pub role: Role,
    /// The peer's uid (kernel credentials at connect), for audit lines.
    pub uid: u32,
    /// Notifications written on the caller's connection before the call's answer.
    pub notify: Notifier,
}

impl Caller {
    /// A caller whose notifications go nowhere (every [`Handler::Call`], tests).
    pub fn new(role: Role, uid: u32) -> Caller {
        Caller { role, uid, notify: Notifier { tx: None } }
    }
}

/// Sends notifications of one call (`vm.exec.output`) to its caller's connection, where they
/// are written before the call's answer. Bounded: a caller that does not read makes `send` wait
/// (back-pressure reaches the guest), and a gone connection makes it fail.
#[derive(Debug, Clone)]
pub struct Notifier {
    tx: Option<mpsc::Sender<String>>,
}

impl Notifier {
    /// A notifier writing into `tx`.
    pub(crate) fn new(tx: mpsc::Sender<String>) -> Notifier {
        Notifier { tx: Some(tx) }
    }

    /// Sends one notification `{"jsonrpc":"2.0","method":METHOD,"params":PARAMS}`.
    ///
    /// # Errors
    /// [`Closed`] when the caller's connection is gone (or there is none).
    pub async fn send<T: Serialize + ?Sized>(&self, method: &str, params: &T) -> Result<(), Closed> {
        let tx = self.tx.as_ref().ok_or(Closed)?;
        let line = serde_json::to_string(&serde_json::json!({"jsonrpc": "2.0", "method": method, "params": params}))
            .map_err(|_| Closed)?;
        tx.send(line).await.map_err(|_| Closed)
    }
}

/// Starts a subscription's task, which sends notifications through the [`Sink`] until it closes.
/// Whatever the notifications come from must be subscribed to before this returns, so nothing
/// that happens after the answer is missed.
pub type SubscribeFn = Arc<dyn Fn(Sink) -> BoxFuture<'static, ()> + Send + Sync>;

/// What runs a method.
pub enum Handler {
    /// An ordinary call: one answer.
    Call(CallFn),
    /// A call that may send notifications to its caller before its answer (`vm.exec` with
    /// `stream`): only these get a notification channel, so ordinary calls cost nothing more.
    Notifying(CallFn),
    /// Opens a subscription whose notifications are named `notification`; the answer is its id.
    Subscribe {
        /// The notifications' `method`.
        notification: &'static str,
        /// Starts the subscription's task.
        open: SubscribeFn,
    },
    /// Ends a subscription: params `[id]`, answer `true` when one was ended.
    Unsubscribe,
    /// Switches the connection to a console's byte stream (the transport does it, see
    /// `server`); reached as a call only from a batch or a notification, which cannot switch.
    Console(Arc<Consoles>),
}

/// One method.
pub struct Entry {
    /// Who may call it.
    pub access: Access,
    /// What runs it.
    pub handler: Handler,
}

/// The methods of one server and its open subscriptions.
pub struct Dispatcher {
    entries: HashMap<&'static str, Entry>,
    /// Open subscriptions by id; sending on (or dropping) the sender ends one.
    subscriptions: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Subscription ids are hashes of a counter with a random key: unique, not guessable.
    counter: AtomicU64,
    keys: std::collections::hash_map::RandomState,
}

/// Subscription ids stay below 2^53, so JavaScript clients read them exactly.
const ID_MASK: u64 = (1 << 53) - 1;

impl Default for Dispatcher {
    fn default() -> Self {
        Dispatcher::new()
    }
}

impl Dispatcher {
    /// A dispatcher with no methods.
    pub fn new() -> Dispatcher {
        Dispatcher {
            entries: HashMap::new(),
            subscriptions: Mutex::new(HashMap::new()),
            counter: AtomicU64::new(0),
            keys: std::collections::hash_map::RandomState::new(),
        }
    }

    /// Adds `name`.
    ///
    /// # Errors
    /// The name, when it is already there (a programming error the tests catch).
    pub fn add(&mut self, name: &'static str, access: Access, handler: Handler) -> Result<&mut Self, String> {
        if self.entries.insert(name, Entry { access, handler }).is_some() {
            return Err(format!("method {name} added twice"));
        }
        Ok(self)
    }

    /// The method called `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// Registers a new subscription: its id, and what ends it.
    pub(crate) fn open(&self) -> (u64, oneshot::Receiver<()>) {
        let (end, ended) = oneshot::channel();
        let mut open = self.lock();
        loop {
            let id = self.keys.hash_one(self.counter.fetch_add(1, Ordering::Relaxed)) & ID_MASK;
            if let std::collections::hash_map::Entry::Vacant(slot) = open.entry(id) {
                slot.insert(end);
                return (id, ended);
            }
        }
    }

    /// Ends subscription `id` (of any connection, as its id is known only to whom it was sent);
    /// false when there is none.
    pub fn unsubscribe(&self, id: u64) -> bool {
        match self.lock().remove(&id) {
            Some(end) => {
                let _ = end.send(());
                true
            }
            None => false,
        }
    }

    /// Forgets subscription `id` once it has ended by itself.
    pub(crate) fn forget(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<()>>> {
        self.subscriptions.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The params of the unsubscription: `[id]`, exactly one element. Anything else ends nothing
/// (answer `false`, as jsonrpsee answered before).
pub fn unsubscribe_id(params: Option<&RawValue>) -> Option<u64> {
    /// The first element of an array, when it is a subscription id.
    struct FirstId(Option<u64>);
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Element {
        Id(u64),
        Other(serde::de::IgnoredAny),
    }
    impl<'de> serde::Deserialize<'de> for FirstId {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = FirstId;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("[subscription_id]")
                }
                fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<FirstId, A::Error> {
                    let first = seq.next_element::<Element>()?;
                    let mut more = false;
                    while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                        more = true;
                    }
                    Ok(FirstId(match first {
                        Some(Element::Id(id)) if !more => Some(id),
                        _ => None,
                    }))
                }
            }
            d.deserialize_seq(V)
        }
    }
    serde_json::from_str::<FirstId>(params?.get()).ok()?.0
}

/// Where a subscription's task sends its notifications.
pub struct Sink {
    /// The subscription's id.
    pub id: u64,
    notification: &'static str,
    tx: mpsc::Sender<String>,
}

/// The subscription has ended: unsubscribed, or its connection is gone.
#[derive(Debug, thiserror::Error)]
#[error("the subscription has ended")]
pub struct Closed;

impl Sink {
    /// A sink for subscription `id` sending `notification`s into `tx`.
    pub(crate) fn new(id: u64, notification: &'static str, tx: mpsc::Sender<String>) -> Sink {
        Sink { id, notification, tx }
    }

    /// Sends `result` as one notification, waiting while the connection's buffer is full.
    ///
    /// # Errors
    /// [`Closed`] when the subscription has ended (or `result` cannot be serialized).
    pub async fn send<T: Serialize + ?Sized>(&self, result: &T) -> Result<(), Closed> {
        let result = serde_json::to_string(result).map_err(|_| Closed)?;
        let line = format!(
            r#"{{"jsonrpc":"2.0","method":{},"params":{{"subscription":{},"result":{result}}}}}"#,
            serde_json::to_string(self.notification).map_err(|_| Closed)?,
            self.id
        );
        self.tx.send(line).await.map_err(|_| Closed)
    }

    /// Resolves once the subscription has ended.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// The error a call that is not a method gets (as jsonrpsee answered it before: no `data`).
pub fn method_not_found() -> ApiError {
    ApiError::new(Code::MethodNotFound, "Method not found")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_string()).unwrap()
    }

    #[test]
    fn unsubscribe_takes_one_numeric_id_in_an_array() {
        assert_eq!(unsubscribe_id(Some(&raw("[5]"))), Some(5));
        for other in ["[]", "[5, 6]", r#"["5"]"#, "[-1]", "[1.5]", r#"{"subscription":5}"#, "[[5]]"] {
            assert_eq!(unsubscribe_id(Some(&raw(other))), None, "{other}");
        }
        assert_eq!(unsubscribe_id(None), None);
    }

    #[tokio::test]
    async fn subscriptions_get_distinct_ids_and_end_once() {
        let d = Dispatcher::new();
        let (a, mut a_end) = d.open();
        let (b, _b_end) = d.open();
        assert_ne!(a, b);
        assert!(a <= ID_MASK && b <= ID_MASK);
        assert!(d.unsubscribe(a));
        assert!(a_end.try_recv().is_ok(), "the subscription was told");
        assert!(!d.unsubscribe(a), "ended once");
        d.forget(b);
        assert!(!d.unsubscribe(b));
    }

    #[tokio::test]
    async fn a_sink_frames_notifications_and_sees_the_end() {
        let (tx, mut rx) = mpsc::channel(4);
        let sink = Sink::new(7, "events.event", tx);
        sink.send(&serde_json::json!({"vm": "a"})).await.unwrap();
        assert_eq!(
            rx.recv().await.unwrap(),
            r#"{"jsonrpc":"2.0","method":"events.event","params":{"subscription":7,"result":{"vm":"a"}}}"#
        );
        drop(rx);
        sink.closed().await;
        assert!(sink.send(&1).await.is_err());
    }
}
