//! `vmhostctl ssh NAME [-l USER] [-- SSH_ARGS...]`: `ssh` to a VM by its name.
//!
//! Why a module of its own: it chooses an address and a user from what vmhostd knows (the spec,
//! and what the guest's agent reports, which the guest chose) and hands the terminal to
//! `ssh`, so what reaches `ssh`'s argv is checked here.
//!
//! Order of use: [`address_from_spec`] (the first NIC with a static IPv4 address in the VM's
//! spec, from `vm.get`), else [`address_from_guest`] (the first global IPv4 address the agent
//! reports, from `vm.guest_network`; parsed, so a guest cannot put an option or a second host
//! into the argv); [`user_of`] (`-l`, else the spec's `ssh.user`, else root); then
//! [`ssh_argv`] and [`exec_ssh`], which replaces vmhostctl with `ssh` from `PATH` (an argv,
//! never a shell string).

use super::Failure;
use serde_json::Value;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;

/// Arguments of `vmhostctl ssh`.
#[derive(clap::Args, Debug)]
pub struct SshArgs {
    /// The VM.
    pub name: String,
    /// The account (default: the spec's `ssh.user`, else root).
    #[arg(short = 'l', long = "user")]
    pub user: Option<String>,
    /// More arguments for ssh, after the address (options, a remote command).
    #[arg(last = true, value_name = "SSH_ARGS")]
    pub extra: Vec<String>,
}

/// The address of the first NIC of `vm` (a `vm.get` view) with a static IPv4 address.
pub fn address_from_spec(vm: &Value) -> Option<Ipv4Addr> {
    vm["spec"]["nics"].as_array()?.iter().find_map(|nic| {
        let ipv4 = &nic["ipv4"];
        if ipv4["mode"].as_str() != Some("static") {
            return None;
        }
        let text = ipv4["address"].as_str()?;
        text.split('/').next()?.parse().ok()
    })
}

/// Whether `a` may be reached from outside the guest: not loopback, link-local, unspecified,
/// broadcast or multicast (private ranges are what VMs usually have).
fn is_global(a: Ipv4Addr) -> bool {
    !(a.is_loopback() || a.is_link_local() || a.is_unspecified() || a.is_broadcast() || a.is_multicast())
}

/// The first global IPv4 address in a `vm.guest_network` answer, in the agent's interface
/// order (each `a.b.c.d/p`). Whatever the guest wrote that does not parse is skipped.
pub fn address_from_guest(net: &Value) -> Option<Ipv4Addr> {
    net["interfaces"].as_array()?.iter().flat_map(|i| i["addresses"].as_array().into_iter().flatten()).find_map(|a| {
        let ip: Ipv4Addr = a.as_str()?.split('/').next()?.parse().ok()?;
        is_global(ip).then_some(ip)
    })
}

/// The account: `-l`, else the spec's `ssh.user`, else root.
pub fn user_of(given: Option<&str>, vm: &Value) -> String {
    given.or_else(|| vm["spec"]["ssh"]["user"].as_str()).unwrap_or("root").to_string()
}

/// `ssh`'s arguments: `-l USER ADDR EXTRA...` (ssh reads options after the host too; the first
/// other word starts the remote command).
///
/// # Errors
///
/// [`Failure::Usage`] for a user that is empty or starts with `-` (it would be read as an
/// option).
pub fn ssh_argv(user: &str, addr: Ipv4Addr, extra: &[String]) -> Result<Vec<String>, Failure> {
    if user.is_empty() || user.starts_with('-') {
        return Err(Failure::Usage(format!("-l {user:?}: not a user name")));
    }
    let mut argv = vec!["-l".to_string(), user.to_string(), addr.to_string()];
    argv.extend(extra.iter().cloned());
    Ok(argv)
}

/// The address of VM `name`: from its spec, else from its agent.
///
/// # Errors
///
/// vmhostd's error for `vm.get`; [`Failure::Usage`] when neither the spec nor the agent gives
/// an address (with the agent's error when it could not be asked).
pub fn find_address(client: &mut vmhost::client::Client, name: &str, vm: &Value) -> Result<Ipv4Addr, Failure> {
    if let Some(addr) = address_from_spec(vm) {
        return Ok(addr);
    }
    match client.call::<Value>("vm.guest_network", serde_json::json!({ "name": name })) {
        Ok(net) => address_from_guest(&net).ok_or_else(|| {
            Failure::Usage(format!(
                "{name}: no static address in its spec and its agent reports no global IPv4 address"
            ))
        }),
        Err(e) => Err(Failure::Usage(format!(
            "{name}: no static address in its spec, and its agent could not be asked for one: {e}"
        ))),
    }
}

/// Replaces vmhostctl with `ssh ARGV` (found in `PATH`); returns only when that fails.
pub fn exec_ssh(argv: &[String]) -> Failure {
    let e = std::process::Command::new("ssh").args(argv).exec();
    Failure::Usage(format!("cannot run ssh: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_spec_s_first_static_address_wins() {
        let vm = json!({"spec": {"nics": [
            {"network": "a", "ipv4": {"mode": "dhcp"}},
            {"network": "b", "ipv4": {"mode": "static", "address": "10.0.0.5/24"}},
            {"network": "c", "ipv4": {"mode": "static", "address": "10.0.1.5/24"}},
        ]}});
        assert_eq!(address_from_spec(&vm), Some(Ipv4Addr::new(10, 0, 0, 5)));
        assert_eq!(address_from_spec(&json!({"spec": {"nics": [{"network": "a"}]}})), None);
        assert_eq!(address_from_spec(&json!({"spec": {}})), None);
    }

    #[test]
    fn the_guest_s_first_global_address_is_taken_and_lies_are_skipped() {
        let net = json!({"interfaces": [
            {"name": "lo", "addresses": ["127.0.0.1/8"]},
            {"name": "eth0", "addresses": ["169.254.3.4/16", "-oProxyCommand=x/24", "10.0.0.1 evil/24", "192.168.7.9/24"]},
            {"name": "eth1", "addresses": ["10.9.9.9/24"]},
        ]});
        assert_eq!(address_from_guest(&net), Some(Ipv4Addr::new(192, 168, 7, 9)));
        assert_eq!(address_from_guest(&json!({"interfaces": [{"addresses": ["127.0.0.1/8"]}]})), None);
        assert_eq!(address_from_guest(&json!({"interfaces": "x"})), None);
    }

    #[test]
    fn the_user_is_given_else_the_spec_s_else_root() {
        let with = json!({"spec": {"ssh": {"user": "ops", "keys": ["ssh-ed25519 AAAA"]}}});
        assert_eq!(user_of(Some("me"), &with), "me");
        assert_eq!(user_of(None, &with), "ops");
        assert_eq!(user_of(None, &json!({"spec": {}})), "root");
    }

    #[test]
    fn ssh_gets_user_address_then_the_extra_arguments() {
        let addr = Ipv4Addr::new(10, 0, 0, 5);
        let extra = vec!["-p".to_string(), "2222".to_string(), "uptime".to_string()];
        assert_eq!(
            ssh_argv("ops", addr, &extra).ok(),
            Some(vec!["-l".into(), "ops".into(), "10.0.0.5".into(), "-p".into(), "2222".into(), "uptime".into()])
        );
        assert!(ssh_argv("-oProxyCommand=x", addr, &[]).is_err());
        assert!(ssh_argv("", addr, &[]).is_err());
    }
}
