//! The method table of API v1: the one place a method is described, and what runs it.
//!
//! [`METHODS`] holds, per method and in documentation order: its name, who may call it
//! ([`Access`]), whether it counts against the guest-agent rate ([`RateClass`]), the closed type
//! its params are parsed into, and its handler. Everything else is derived from it: the
//! dispatcher the server runs ([`dispatcher`]), the read-only peers' list ([`read_methods`],
//! docs/api.md is tested against it), the agent rate's methods and the fuzz target's params
//! checks ([`Method::check`]).
//!
//! Order of use: [`dispatcher`] at start-up; per request the server finds the method, checks
//! its access, and the handler parses the params once ([`parse_params`], a -32602 names the
//! field at fault), counts an agent call ([`crate::rpc::agent_rate`]), then runs.

use crate::api::backup::{ExportParams, ImportVmParams};
use crate::api::disks::PurgeKeptDisksParams;
use crate::api::exec::{ExecOutput, ExecParams, ExecResult, FilePullParams, FilePushParams, EXEC_OUTPUT_NOTIFICATION};
use crate::api::images::{ImageNameParams, ImportParams};
use crate::api::migration::{MigrateInParams, MigrateParams, MoveParams};
use crate::api::snapshots::{SnapshotParams, TakeSnapshotParams};
use crate::api::stats::StatsParams;
use crate::api::{
    ApiError, ApplyParams, Code, ConsoleParams, CreateParams, HostCheck, NameParams, ReconcileParams,
    ShutdownVmsParams, StopParams, EVENT_NOTIFICATION,
};
use crate::console::Consoles;
use crate::lifecycle::{self, Manager};
use crate::rpc::agent_rate::AgentRate;
use crate::rpc::dispatch::{Access, Body, Caller, Dispatcher, Handler, Running, Sink};
use crate::rpc::single_flight::SingleFlight;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use std::sync::Arc;

/// Params that are not looked at: any object or array.
type Anything = serde::de::IgnoredAny;

/// Params that must be an object (members are not looked at).
type Object = serde_json::Map<String, serde_json::Value>;

/// Whether calls count against a VM's guest-agent rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateClass {
    /// Not counted.
    Free,
    /// Calls the VM's guest agent: counted per VM (its `name` param) and role.
    Agent,
}

/// One method of API v1.
pub struct Method {
    /// Its name.
    pub name: &'static str,
    /// Who may call it.
    pub access: Access,
    /// Whether it counts against the guest-agent rate.
    pub rate: RateClass,
    /// The type its params are parsed into, as written here.
    pub params: &'static str,
    /// Parses params into that type and drops them (the fuzz target's check).
    pub check: fn(Option<&RawValue>) -> Result<(), ApiError>,
    /// What runs it.
    pub kind: Kind,
}

/// Parses a call's params, counts an agent call, and starts it.
pub type CallFn = fn(&Arc<Context>, Option<&RawValue>, Caller) -> Result<Running, ApiError>;

/// How a method runs.
#[derive(Clone, Copy)]
pub enum Kind {
    /// Parses its params, counts an agent call, and starts.
    Call(CallFn),
    /// The same, for a call that may send its caller notifications before the answer.
    Notifying(CallFn),
    /// `events.subscribe`: VM status changes as notifications.
    Subscribe,
    /// `events.unsubscribe`.
    Unsubscribe,
    /// `vm.console`: the transport switches the connection.
    Console,
}

/// What the handlers share.
pub struct Context {
    manager: Arc<Manager>,
    /// One host check at a time: it starts processes, and concurrent callers share its report.
    host_check: Arc<SingleFlight<HostCheck>>,
    /// Guest-agent calls per VM and role.
    agent_calls: AgentRate,
}

/// Serializes a method's result as its answer.
fn json<T: serde::Serialize>(result: T) -> Result<Body, ApiError> {
    Body::json(&result)
}

/// One [`Method`] of kind [`Kind::Call`] (or, with `notifying` first, [`Kind::Notifying`]):
/// `call!(name, access, rate, ParamsType, |ctx, p| body)`,
/// where `body` is an expression (it may `.await`) giving `Result<Body, ApiError>`.
macro_rules! call {
    (@rate Free, $ctx:ident, $p:ident, $role:expr) => {};
    (@rate Agent, $ctx:ident, $p:ident, $role:expr) => {
        $ctx.agent_calls.check(&$p.name, $role)?
    };
    ($name:literal, $access:ident, $rate:ident, $params:ty, |$ctx:ident, $p:pat_param| $run:expr) => {
        call!($name, $access, $rate, $params, |$ctx, $p, _caller| $run)
    };
    // The same, with the caller (its uid) in `$caller`.
    ($name:literal, $access:ident, $rate:ident, $params:ty, |$ctx:ident, $p:pat_param, $caller:ident| $run:expr) => {
        call!(@kind Call, $name, $access, $rate, $params, |$ctx, $p, $caller| $run)
    };
    // A call that sends notifications through `$caller.notify` ([`Kind::Notifying`]).
    (notifying $name:literal, $access:ident, $rate:ident, $params:ty, |$ctx:ident, $p:pat_param, $caller:ident| $run:expr) => {
        call!(@kind Notifying, $name, $access, $rate, $params, |$ctx, $p, $caller| $run)
    };
    (@kind $kind:ident, $name:literal, $access:ident, $rate:ident, $params:ty, |$ctx:ident, $p:pat_param, $caller:ident| $run:expr) => {
        Method {
            name: $name,
            access: Access::$access,
            rate: RateClass::$rate,
            params: stringify!($params),
            check: |raw| parse_params::<$params>(raw).map(drop),
            kind: Kind::$kind(|ctx, raw, caller| {
                let params = parse_params::<$params>(raw)?;
                call!(@rate $rate, ctx, params, caller.role);
                let $ctx = Arc::clone(ctx);
                let $p = params;
                #[allow(unused_variables)]
                let $caller = caller;
                Ok(Box::pin(async move { $run }))
            }),
        }
    };
}

/// Every method of API v1, in documentation order.
pub static METHODS: [Method; 38] = [
    // Directory listings, statvfs and sysfs reads: off the runtime worker's tasks.
    call!("host.info", Read, Free, Object, |ctx, _p| {
        let mut info = crate::blocking::run(|| ctx.manager.host_info());
        info.capture = ctx.manager.capture_info().await;
        json(info)
    }),
    call!("host.check", Read, Free, Anything, |ctx, _p| {
        let mgr = Arc::clone(&ctx.manager);
        let report = ctx
            .host_check
            .run(|| async move {
                tracing::debug!("host check running");
                let networks = mgr.host_net().probe_networks(mgr.config()).await;
                let images = lifecycle::images::image_check(&mgr);
                let uefi_vms = mgr.uefi_vms();
                let secure_vms = mgr.secure_boot_vms();
                let identity = crate::preflight::hardware_identity(
                    lifecycle::vfio::judge_model(&mgr).await.map_err(|e| e.to_string()),
                );
                let mut report = crate::preflight::check(
                    mgr.config(),
                    &mgr.broken_records(),
                    &networks,
                    mgr.binary_integrity(),
                    images,
                    &uefi_vms,
                    identity,
                )
                .await;
                crate::preflight::add_secure_boot_firmware(&mut report, mgr.config(), &secure_vms);
                // What netlink says of the capture interfaces now: with the host's other
                // devices, before the sandbox's own layers, which stay last.
                let capture = mgr.capture_check().await;
                report.ok &= capture.status == crate::api::CheckStatus::Ok;
                let at = report.items.iter().position(|i| i.name == "sandbox").unwrap_or(report.items.len());
                report.items.insert(at, capture);
                // swtpm, beside the firmware (both needed only by the VMs that ask for them).
                let tpm = crate::tpm::check_item(&mgr.config().qemu.swtpm, &mgr.tpm_vms()).await;
                report.ok &= tpm.status == crate::api::CheckStatus::Ok;
                let at = report
                    .items
                    .iter()
                    .rposition(|i| i.name.ends_with("firmware"))
                    .map_or(report.items.len(), |i| i + 1);
                report.items.insert(at, tpm);
                report
            })
            .await;
        report.ok_or_else(|| ApiError::internal("the host check failed unexpectedly")).and_then(json)
    }),
    call!("host.reconcile", Write, Free, ReconcileParams, |ctx, p| lifecycle::reconcile::reconcile(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("host.shutdown_vms", Write, Free, ShutdownVmsParams, |ctx, p| {
        lifecycle::shutdown::shutdown_vms(&ctx.manager, p.timeout_s).await.and_then(json)
    }),
    call!("host.purge_kept_disks", Write, Free, PurgeKeptDisksParams, |ctx, p| {
        lifecycle::data_disks::purge_kept_disks(&ctx.manager, &p.vm).and_then(json)
    }),
    // The manager's ready-made views, answered as they are (not serialized again).
    call!("vm.list", Read, Free, Anything, |ctx, _p| Ok(Body::from(ctx.manager.list_json()))),
    call!("vm.get", Read, Free, NameParams, |ctx, p| ctx.manager.get_json(&p.name).map(Body::from)),
    call!("vm.create", Write, Free, CreateParams, |ctx, p| lifecycle::ops::create(&ctx.manager, p.spec)
        .await
        .and_then(json)),
    call!("vm.apply", Write, Free, ApplyParams, |ctx, p| lifecycle::ops::apply(&ctx.manager, p).await.and_then(json)),
    call!("vm.start", Write, Free, NameParams, |ctx, p| lifecycle::ops::start(&ctx.manager, &p.name)
        .await
        .and_then(json)),
    call!("vm.stop", Write, Free, StopParams, |ctx, p, caller| lifecycle::ops::stop(&ctx.manager, p, caller.uid)
        .await
        .and_then(json)),
    call!("vm.restart", Write, Free, StopParams, |ctx, p, caller| {
        lifecycle::ops::restart(&ctx.manager, p, caller.uid).await.and_then(json)
    }),
    call!("vm.destroy", Write, Free, NameParams, |ctx, p| lifecycle::ops::destroy(&ctx.manager, &p.name)
        .await
        .and_then(json)),
    call!("vm.guest_info", Read, Agent, NameParams, |ctx, p| lifecycle::agent::guest_info(&ctx.manager, &p.name)
        .await
        .and_then(json)),
    call!("vm.guest_network", Read, Agent, NameParams, |ctx, p| {
        lifecycle::agent::guest_network(&ctx.manager, &p.name).await.and_then(json)
    }),
    call!("vm.check", Read, Agent, NameParams, |ctx, p| lifecycle::agent::check_guest(&ctx.manager, &p.name)
        .await
        .and_then(json)),
    // Commands and files in the guest, as root: admins only, counted like agent calls, and
    // the caller's uid goes to the audit line.
    call!(notifying "vm.exec", Write, Agent, ExecParams, |ctx, p, caller| exec(&ctx.manager, p, caller)
        .await
        .and_then(json)),
    call!("vm.file_push", Write, Agent, FilePushParams, |ctx, p, caller| {
        lifecycle::exec::file_push(&ctx.manager, p, caller.uid).await.and_then(json)
    }),
    call!("vm.file_pull", Write, Agent, FilePullParams, |ctx, p, caller| {
        lifecycle::exec::file_pull(&ctx.manager, p, caller.uid).await.and_then(json)
    }),
    // Housekeeping the operator asks for: admins only, no allow_exec needed.
    call!("vm.sync_time", Write, Agent, NameParams, |ctx, p, caller| {
        lifecycle::housekeeping::sync_time(&ctx.manager, &p.name, caller.uid).await.and_then(json)
    }),
    Method {
        name: "vm.console",
        access: Access::Read,
        rate: RateClass::Free,
        params: "ConsoleParams",
        check: |raw| parse_params::<ConsoleParams>(raw).map(drop),
        kind: Kind::Console,
    },
    call!("vm.stats", Read, Free, StatsParams, |ctx, p| lifecycle::stats::vm_stats(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("host.stats", Read, Free, Object, |ctx, _p| json(lifecycle::stats::host_stats(&ctx.manager).await)),
    Method {
        name: "events.subscribe",
        access: Access::Read,
        rate: RateClass::Free,
        params: "Anything",
        check: |raw| parse_params::<Anything>(raw).map(drop),
        kind: Kind::Subscribe,
    },
    Method {
        name: "events.unsubscribe",
        access: Access::Read,
        rate: RateClass::Free,
        params: "[subscription_id]",
        // Any params: other shapes end nothing and answer false.
        check: |_| Ok(()),
        kind: Kind::Unsubscribe,
    },
    call!("image.import", Write, Free, ImportParams, |ctx, p| lifecycle::images::image_import(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("image.list", Read, Free, Object, |ctx, _p| lifecycle::images::image_list(&ctx.manager).await.and_then(json)),
    call!("image.delete", Write, Free, ImageNameParams, |ctx, p| {
        lifecycle::images::image_delete(&ctx.manager, &p.name).await.and_then(json)
    }),
    call!("vm.export", Write, Free, ExportParams, |ctx, p| lifecycle::backup::export_vm(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("vm.import", Write, Free, ImportVmParams, |ctx, p| lifecycle::backup::import_vm(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("vm.migrate_in", Write, Free, MigrateInParams, |ctx, p| {
        lifecycle::migrate::incoming::migrate_in(&ctx.manager, p).await.and_then(json)
    }),
    call!("vm.migrate", Write, Free, MigrateParams, |ctx, p| {
        lifecycle::migrate::outgoing::migrate(&ctx.manager, p).await.and_then(json)
    }),
    call!("vm.move", Write, Free, MoveParams, |ctx, p| lifecycle::migrate::cold::move_vm(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("vm.migrate_settle", Write, Free, crate::api::migration::MigrateSettleParams, |ctx, p| {
        lifecycle::migrate::migrate_settle(&ctx.manager, p).await.and_then(json)
    }),
    call!("vm.snapshot", Write, Free, TakeSnapshotParams, |ctx, p| lifecycle::snapshots::snapshot(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("vm.snapshots", Read, Free, NameParams, |ctx, p| {
        crate::blocking::run(|| lifecycle::snapshots::snapshots(&ctx.manager, &p.name)).and_then(json)
    }),
    call!("vm.revert", Write, Free, SnapshotParams, |ctx, p| lifecycle::snapshots::revert(&ctx.manager, p)
        .await
        .and_then(json)),
    call!("vm.snapshot_delete", Write, Free, SnapshotParams, |ctx, p| {
        lifecycle::snapshots::snapshot_delete(&ctx.manager, p).await.and_then(json)
    }),
];

/// The method called `name`.
pub fn find(name: &str) -> Option<&'static Method> {
    METHODS.iter().find(|m| m.name == name)
}

/// The methods a read-only peer may call, in documentation order.
pub fn read_methods() -> impl Iterator<Item = &'static str> {
    METHODS.iter().filter(|m| m.access == Access::Read).map(|m| m.name)
}

/// Builds the daemon's dispatcher over `manager` from [`METHODS`].
///
/// # Errors
/// Only if a method name were in the table twice (a programming error caught by the tests).
pub fn dispatcher(manager: Arc<Manager>, consoles: Arc<Consoles>) -> Result<Dispatcher, String> {
    let ctx =
        Arc::new(Context { manager, host_check: Arc::new(SingleFlight::default()), agent_calls: AgentRate::default() });
    let mut dispatcher = Dispatcher::new();
    for method in &METHODS {
        let handler = match method.kind {
            Kind::Call(call) => {
                let ctx = Arc::clone(&ctx);
                Handler::Call(Arc::new(move |raw, caller| call(&ctx, raw, caller)))
            }
            Kind::Notifying(call) => {
                let ctx = Arc::clone(&ctx);
                Handler::Notifying(Arc::new(move |raw, caller| call(&ctx, raw, caller)))
            }
            Kind::Subscribe => {
                let manager = Arc::clone(&ctx.manager);
                Handler::Subscribe {
                    notification: EVENT_NOTIFICATION,
                    open: Arc::new(move |sink| {
                        // Subscribed before the answer is sent: no change after it is missed.
                        let events = manager.events().subscribe();
                        Box::pin(send_events(events, sink))
                    }),
                }
            }
            Kind::Unsubscribe => Handler::Unsubscribe,
            Kind::Console => Handler::Console(Arc::clone(&consoles)),
        };
        dispatcher.add(method.name, method.access, handler)?;
    }
    Ok(dispatcher)
}

/// `vm.exec`: with `stream`, its output goes to the caller as `vm.exec.output` notifications
/// while the command runs (the connection writes them before the answer). A caller that goes
/// away closes the channel, which ends the session and so kills the command in the guest.
async fn exec(mgr: &Arc<Manager>, p: ExecParams, caller: Caller) -> Result<ExecResult, ApiError> {
    if !p.stream {
        return lifecycle::exec::exec(mgr, p, caller.uid, None).await;
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<crate::agent::exec::session::OutputChunk>(2);
    let name = p.name.clone();
    let forward = async move {
        while let Some(chunk) = rx.recv().await {
            let data = crate::agent::exec::base64::encode(&chunk.data);
            let note = ExecOutput { name: name.clone(), stream: chunk.stream, data };
            if caller.notify.send(EXEC_OUTPUT_NOTIFICATION, &note).await.is_err() {
                break;
            }
        }
    };
    let (result, ()) = tokio::join!(lifecycle::exec::exec(mgr, p, caller.uid, Some(tx)), forward);
    result
}

/// Sends VM status changes to a subscriber until it unsubscribes or its connection ends.
async fn send_events(mut events: tokio::sync::broadcast::Receiver<crate::api::Event>, sink: Sink) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        tokio::select! {
            () = sink.closed() => break,
            event = events.recv() => match event {
                Ok(event) => {
                    if sink.send(&event).await.is_err() {
                        break;
                    }
                }
                Err(RecvError::Lagged(n)) => tracing::warn!(missed = n, "event subscriber fell behind; events dropped"),
                Err(RecvError::Closed) => break,
            },
        }
    }
}

/// Parses method params (an object; absent means `{}`) into `T`, naming the field at fault.
///
/// # Errors
/// -32602 with `data.field` set to the dotted path (`spec.boot.kernel`, or `params`).
pub fn parse_params<T: DeserializeOwned>(params: Option<&RawValue>) -> Result<T, ApiError> {
    let raw = params.map_or("{}", RawValue::get);
    let de = &mut serde_json::Deserializer::from_str(raw);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let mut path = field_path(e.path());
        let message = e.inner().to_string();
        // serde names a missing field only in its message (the path stops at its parent).
        if let Some(field) = message.strip_prefix("missing field `").and_then(|r| r.split('`').next()) {
            path = if path.is_empty() { field.to_string() } else { format!("{path}.{field}") };
        }
        if path.is_empty() {
            path = "params".to_string();
        }
        ApiError::new(Code::InvalidParams, format!("invalid params: {message}")).field(path)
    })
}

/// The dotted path of the offending field (`spec.disks[1].size_gib`), empty at the root.
///
/// An empty key is written `""`: a client may send one (`{"": 1}`), and the field must still
/// name something, never the empty string (found by the `request` fuzz target).
fn field_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(if key.is_empty() { "\"\"" } else { key });
            }
            Segment::Unknown => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &'static str) -> Option<&'static RawValue> {
        Some(Box::leak(RawValue::from_string(s.to_string()).unwrap()))
    }

    #[test]
    fn the_table_names_each_method_once_and_derives_the_lists() {
        let names: std::collections::BTreeSet<&str> = METHODS.iter().map(|m| m.name).collect();
        assert_eq!(names.len(), METHODS.len(), "a method is in the table twice");
        let agent: Vec<&str> = METHODS.iter().filter(|m| m.rate == RateClass::Agent).map(|m| m.name).collect();
        assert_eq!(
            agent,
            [
                "vm.guest_info",
                "vm.guest_network",
                "vm.check",
                "vm.exec",
                "vm.file_push",
                "vm.file_pull",
                "vm.sync_time"
            ]
        );
        assert!(agent[..3]
            .iter()
            .all(|m| find(m).is_some_and(|m| m.access == Access::Read && m.params == "NameParams")));
        // Commands and files in a guest run as root there, and housekeeping changes it: admins only.
        assert!(agent[3..].iter().all(|m| find(m).is_some_and(|m| m.access == Access::Write)));
        let read: Vec<&str> = read_methods().collect();
        assert!(read.contains(&"vm.list") && read.contains(&"events.unsubscribe") && !read.contains(&"vm.create"));
        assert!(find("vm.console").is_some_and(|m| matches!(m.kind, Kind::Console)));
        // Only a streaming call gets a notification channel per call; the others none.
        let notifying: Vec<&str> =
            METHODS.iter().filter(|m| matches!(m.kind, Kind::Notifying(_))).map(|m| m.name).collect();
        assert_eq!(notifying, ["vm.exec"]);
        assert!(find("no.such").is_none());
    }

    /// docs/api.md's paragraph "Read methods (...)" names exactly the methods whose access is
    /// `Read` in [`METHODS`]: the list operators read their access rules from cannot drift from
    /// the code again (it once left out `image.list` and `vm.snapshots`).
    #[test]
    fn api_md_lists_exactly_the_read_methods() {
        let doc = include_str!("../../../docs/api.md");
        let start = doc.find("Read methods (`rpc::methods::METHODS`").expect("api.md has the read methods paragraph");
        let paragraph = &doc[start..];
        let paragraph = &paragraph[..paragraph.find("Everything else").expect("the paragraph ends")];
        let named: std::collections::BTreeSet<&str> =
            paragraph.split('`').skip(1).step_by(2).filter(|word| find(word).is_some()).collect();
        let code: std::collections::BTreeSet<&str> = read_methods().collect();
        assert_eq!(named, code, "docs/api.md's read methods differ from the method table");
    }

    /// Each method's check parses its params into the type its handler uses: a wrong type or a
    /// missing member is -32602 naming the field, absent params are `{}`.
    #[test]
    fn each_check_parses_into_the_handlers_params_type() {
        for m in &METHODS {
            match m.params {
                "NameParams" | "ConsoleParams" | "ImageNameParams" => {
                    let e = (m.check)(None).unwrap_err();
                    assert_eq!((e.code, e.field.as_deref()), (Code::InvalidParams, Some("name")), "{}", m.name);
                    let e = (m.check)(p(r#"{"name": 1}"#)).unwrap_err();
                    assert_eq!(e.field.as_deref(), Some("name"), "{}", m.name);
                    assert!((m.check)(p(r#"{"name": "a"}"#)).is_ok(), "{}", m.name);
                }
                "Object" => {
                    assert!((m.check)(None).is_ok(), "{}", m.name);
                    assert_eq!((m.check)(p("[1]")).unwrap_err().field.as_deref(), Some("params"), "{}", m.name);
                }
                "Anything" | "[subscription_id]" => assert!((m.check)(p("[1]")).is_ok(), "{}", m.name),
                _ => assert!((m.check)(p("7")).is_err(), "{}", m.name),
            }
        }
    }

    #[test]
    fn params_errors_name_the_field() {
        let e = parse_params::<NameParams>(p("{}")).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::InvalidParams, Some("name")));
        let e = parse_params::<NameParams>(p(r#"{"name": 3}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("name"));
        let e = parse_params::<NameParams>(p(r#"{"name": "a", "x": 1}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("x"));
        let e =
            parse_params::<CreateParams>(p(r#"{"spec": {"name": "a", "cpu": "two", "memory_mib": 1, "boot": {}}}"#))
                .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.cpu"));
        let e = parse_params::<CreateParams>(p(
            r#"{"spec": {"name": "a", "cpu": 1, "memory_mib": 1, "boot": {"kernal": "/k"}}}"#,
        ))
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.boot.kernal"));
        let e = parse_params::<NameParams>(p(r#""a""#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("params"));
        assert!(parse_params::<NameParams>(p(r#"{"name": "a"}"#)).is_ok());
    }

    #[test]
    fn an_empty_key_is_named_not_left_empty() {
        let e = parse_params::<NameParams>(p(r#"{"": "sensor1"}"#)).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::InvalidParams, Some(r#""""#)));
        let e = parse_params::<CreateParams>(p(r#"{"spec": {"": 1}}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some(r#"spec."""#));
        let e = parse_params::<CreateParams>(p(
            r#"{"spec": {"name": "a", "cpu": 1, "memory_mib": 1, "boot": {}, "nics": [{"": 1}]}}"#,
        ))
        .unwrap_err();
        assert!(e.field.as_deref().is_some_and(|f| f.starts_with("spec.nics[0]")), "{e:?}");
    }
}
