//! `vmhostctl move`: a stopped VM (or with `--stop` a running one) moved cold to another
//! vmhostd (`vm.move`, docs/moving.md).
//!
//! Why a module of its own: like `migrate --to-socket` it drives two daemons: the destination's
//! `vm.migrate_in` with `mode: cold` and the spec as this host has it ([`super::migrate::incoming_spec`],
//! each NIC with its MAC), then this host's `vm.move` with the address and secret it answered.
//!
//! Order of use: [`move_vm`] only.

use super::Failure;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use vmhost::client::Client;

/// Arguments of `vmhostctl move`.
#[derive(clap::Args, Debug)]
pub struct MoveArgs {
    /// The VM.
    pub name: String,
    /// The destination vmhostd's API socket: vmhostctl prepares the destination itself.
    #[arg(long, value_name = "DEST_SOCKET")]
    pub to_socket: PathBuf,
    /// Stop the VM first if it runs, and start it on the destination.
    #[arg(long)]
    pub stop: bool,
    /// Longest the move may take, seconds (the disks' size over the link, twice hashed).
    #[arg(long, default_value_t = 3600)]
    pub timeout: u64,
}

/// `vmhostctl move`: the `vm.move` result.
///
/// # Errors
/// Either daemon refuses or cannot be reached.
pub fn move_vm(c: &mut Client, args: &MoveArgs) -> Result<Value, Failure> {
    let view: Value = c.call("vm.get", json!({ "name": args.name }))?;
    // Checked before the destination is prepared: a move this host refuses would leave it
    // waiting for a source that never comes (until its prepare timeout).
    match view["status"].as_str() {
        Some("stopped" | "dead") => {}
        Some("running") if args.stop => {}
        Some("running") => {
            return Err(Failure::Usage(format!("{} runs: stop it first, or move it with --stop", args.name)))
        }
        other => {
            return Err(Failure::Usage(format!(
                "{} is {}: only a stopped or running VM moves",
                args.name,
                other.unwrap_or("?")
            )))
        }
    }
    let mut dest = Client::connect(&args.to_socket)
        .map_err(|e| Failure::Connect(format!("cannot reach the destination at {}: {e}", args.to_socket.display())))?;
    dest.set_timeout(Duration::from_secs(300))?;
    let spec = super::migrate::incoming_spec(&view);
    let prepared: Value = dest.call("vm.migrate_in", json!({ "spec": spec, "mode": "cold" }))?;
    let field = |k: &str| prepared[k].as_str().map(str::to_string);
    let (Some(destination), Some(secret)) = (field("address"), field("secret")) else {
        return Err(Failure::Connect(format!("vm.migrate_in answered without address or secret: {prepared}")));
    };
    c.set_timeout(Duration::from_secs(args.timeout))?;
    let params = json!({ "name": args.name, "destination": destination, "secret": secret, "stop": args.stop });
    Ok(c.call::<Value>("vm.move", params)?)
}
