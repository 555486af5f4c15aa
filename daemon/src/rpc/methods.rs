//! The method table of API v1: parses params into the closed wire types and calls the manager.
//!
//! [`build`] registers every method of [`crate::api::ALL_METHODS`] on a jsonrpsee `RpcModule`;
//! the transport ([`super::server`]) dispatches lines to it. Params are parsed here with the
//! path of the offending field, so a bad request gets -32602 naming exactly what is wrong.

use crate::api::{
    ApiError, ApplyParams, Code, CreateParams, NameParams, ReconcileParams, ShutdownVmsParams, StopParams,
    EVENT_NOTIFICATION,
};
use crate::lifecycle::Manager;
use crate::rpc::single_flight::SingleFlight;
use jsonrpsee::types::{ErrorObjectOwned, Params};
use jsonrpsee::{RpcModule, SubscriptionMessage};
use serde::de::DeserializeOwned;
use std::sync::Arc;

type RpcResult<T> = Result<T, ErrorObjectOwned>;

/// Parses method params (an object; absent means `{}`) into `T`, naming the field at fault.
///
/// # Errors
/// -32602 with `data.field` set to the dotted path (`spec.boot.kernel`, or `params`).
pub fn parse_params<T: DeserializeOwned>(params: &Params<'_>) -> Result<T, ApiError> {
    let raw = params.as_str().unwrap_or("{}");
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

fn call<T>(r: Result<T, ApiError>) -> RpcResult<T> {
    r.map_err(Into::into)
}

/// Builds the method table over `manager`.
///
/// # Errors
/// Only if a method name were registered twice (a programming error caught by the tests).
pub fn build(manager: Arc<Manager>) -> Result<RpcModule<Arc<Manager>>, jsonrpsee::core::RegisterMethodError> {
    let mut m = RpcModule::new(manager);
    // One host check at a time: it starts processes, and concurrent callers share its report.
    let host_check = Arc::new(SingleFlight::default());
    m.register_method("host.info", |params, mgr, _| {
        // Directory listings, statvfs and sysfs reads: off the runtime worker's tasks.
        call(
            parse_params::<serde_json::Map<String, serde_json::Value>>(&params)
                .map(|_| crate::blocking::run(|| mgr.host_info())),
        )
    })?;
    m.register_async_method("host.check", move |_params, mgr, _| {
        let host_check = Arc::clone(&host_check);
        async move {
            let report = host_check
                .run(|| async move {
                    tracing::debug!("host check running");
                    let networks = mgr.host_net().probe_networks(mgr.config()).await;
                    let images = mgr.image_check();
                    let uefi_vms = mgr.uefi_vms();
                    crate::preflight::check(
                        mgr.config(),
                        &mgr.broken_records(),
                        &networks,
                        mgr.binary_integrity(),
                        images,
                        &uefi_vms,
                    )
                    .await
                })
                .await;
            call(report.ok_or_else(|| ApiError::internal("the host check failed unexpectedly")))
        }
    })?;
    m.register_async_method("host.reconcile", |params, mgr, _| async move {
        let p: ReconcileParams = match parse_params(&params) {
            Ok(p) => p,
            Err(e) => return call(Err(e)),
        };
        call(mgr.reconcile(p).await)
    })?;
    m.register_async_method("host.shutdown_vms", |params, mgr, _| async move {
        match parse_params::<ShutdownVmsParams>(&params) {
            Ok(p) => call(mgr.shutdown_vms(p.timeout_s).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_method("host.purge_kept_disks", |params, mgr, _| {
        call(parse_params::<crate::api::disks::PurgeKeptDisksParams>(&params).and_then(|p| mgr.purge_kept_disks(&p.vm)))
    })?;
    m.register_method("vm.list", |_params, mgr, _| call(Ok::<_, ApiError>(mgr.list_json())))?;
    m.register_method("vm.get", |params, mgr, _| {
        call(parse_params::<NameParams>(&params).and_then(|p| mgr.get_json(&p.name)))
    })?;
    m.register_async_method("vm.create", |params, mgr, _| async move {
        match parse_params::<CreateParams>(&params) {
            Ok(p) => call(mgr.create(p.spec).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.apply", |params, mgr, _| async move {
        match parse_params::<ApplyParams>(&params) {
            Ok(p) => call(mgr.apply(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.start", |params, mgr, _| async move {
        match parse_params::<NameParams>(&params) {
            Ok(p) => call(mgr.start(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.stop", |params, mgr, _| async move {
        match parse_params::<StopParams>(&params) {
            Ok(p) => call(mgr.stop(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.restart", |params, mgr, _| async move {
        match parse_params::<StopParams>(&params) {
            Ok(p) => call(mgr.restart(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.destroy", |params, mgr, _| async move {
        match parse_params::<NameParams>(&params) {
            Ok(p) => call(mgr.destroy(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.guest_info", |params, mgr, _| async move {
        match parse_params::<NameParams>(&params) {
            Ok(p) => call(mgr.guest_info(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.guest_network", |params, mgr, _| async move {
        match parse_params::<NameParams>(&params) {
            Ok(p) => call(mgr.guest_network(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.check", |params, mgr, _| async move {
        match parse_params::<NameParams>(&params) {
            Ok(p) => call(mgr.check_guest(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    // The transport serves vm.console itself (it switches the connection to a byte stream,
    // docs/console.md); what reaches this table is a vm.console it cannot switch for.
    m.register_method("vm.console", |_params, _mgr, _| {
        call(Err::<(), _>(ApiError::new(
            Code::InvalidRequest,
            "vm.console must be a request of its own line, with an id (not in a batch, not a notification)",
        )))
    })?;
    m.register_async_method("vm.stats", |params, mgr, _| async move {
        match parse_params::<crate::api::stats::StatsParams>(&params) {
            Ok(p) => call(mgr.vm_stats(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("host.stats", |params, mgr, _| async move {
        match parse_params::<serde_json::Map<String, serde_json::Value>>(&params) {
            Ok(_) => call(Ok::<_, ApiError>(mgr.host_stats().await)),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("image.import", |params, mgr, _| async move {
        match parse_params::<crate::api::images::ImportParams>(&params) {
            Ok(p) => call(mgr.image_import(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("image.list", |params, mgr, _| async move {
        match parse_params::<serde_json::Map<String, serde_json::Value>>(&params) {
            Ok(_) => call(mgr.image_list().await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("image.delete", |params, mgr, _| async move {
        match parse_params::<crate::api::images::ImageNameParams>(&params) {
            Ok(p) => call(mgr.image_delete(&p.name).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.export", |params, mgr, _| async move {
        match parse_params::<crate::api::backup::ExportParams>(&params) {
            Ok(p) => call(mgr.export_vm(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.import", |params, mgr, _| async move {
        match parse_params::<crate::api::backup::ImportVmParams>(&params) {
            Ok(p) => call(mgr.import_vm(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.snapshot", |params, mgr, _| async move {
        match parse_params::<crate::api::snapshots::TakeSnapshotParams>(&params) {
            Ok(p) => call(mgr.snapshot(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_method("vm.snapshots", |params, mgr, _| {
        call(parse_params::<NameParams>(&params).and_then(|p| crate::blocking::run(|| mgr.snapshots(&p.name))))
    })?;
    m.register_async_method("vm.revert", |params, mgr, _| async move {
        match parse_params::<crate::api::snapshots::SnapshotParams>(&params) {
            Ok(p) => call(mgr.revert(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_async_method("vm.snapshot_delete", |params, mgr, _| async move {
        match parse_params::<crate::api::snapshots::SnapshotParams>(&params) {
            Ok(p) => call(mgr.snapshot_delete(p).await),
            Err(e) => call(Err(e)),
        }
    })?;
    m.register_subscription(
        "events.subscribe",
        EVENT_NOTIFICATION,
        "events.unsubscribe",
        |_params, pending, mgr, _| async move {
            let mut rx = mgr.events().subscribe();
            let sink = pending.accept().await?;
            loop {
                tokio::select! {
                    _ = sink.closed() => break,
                    ev = rx.recv() => match ev {
                        Ok(ev) => {
                            let msg = SubscriptionMessage::from(serde_json::value::to_raw_value(&ev)?);
                            if sink.send(msg).await.is_err() {
                                break;
                            }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            tracing::warn!(missed = n, "event subscriber fell behind; events dropped");
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                    },
                }
            }
            Ok(())
        },
    )?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &'static str) -> Params<'static> {
        Params::new(Some(s))
    }

    #[test]
    fn params_errors_name_the_field() {
        let e = parse_params::<NameParams>(&p("{}")).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::InvalidParams, Some("name")));
        let e = parse_params::<NameParams>(&p(r#"{"name": 3}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("name"));
        let e = parse_params::<NameParams>(&p(r#"{"name": "a", "x": 1}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("x"));
        let e =
            parse_params::<CreateParams>(&p(r#"{"spec": {"name": "a", "cpu": "two", "memory_mib": 1, "boot": {}}}"#))
                .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.cpu"));
        let e = parse_params::<CreateParams>(&p(
            r#"{"spec": {"name": "a", "cpu": 1, "memory_mib": 1, "boot": {"kernal": "/k"}}}"#,
        ))
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("spec.boot.kernal"));
        let e = parse_params::<NameParams>(&p(r#""a""#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("params"));
        assert!(parse_params::<NameParams>(&p(r#"{"name": "a"}"#)).is_ok());
    }

    #[test]
    fn an_empty_key_is_named_not_left_empty() {
        let e = parse_params::<NameParams>(&p(r#"{"": "sensor1"}"#)).unwrap_err();
        assert_eq!((e.code, e.field.as_deref()), (Code::InvalidParams, Some(r#""""#)));
        let e = parse_params::<CreateParams>(&p(r#"{"spec": {"": 1}}"#)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some(r#"spec."""#));
        let e = parse_params::<CreateParams>(&p(
            r#"{"spec": {"name": "a", "cpu": 1, "memory_mib": 1, "boot": {}, "nics": [{"": 1}]}}"#,
        ))
        .unwrap_err();
        assert!(e.field.as_deref().is_some_and(|f| f.starts_with("spec.nics[0]")), "{e:?}");
    }
}
