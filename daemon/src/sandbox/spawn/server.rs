//! The spawner process: what it may start ([`Allowlist`]) and its loop ([`serve`]).
//!
//! [`crate::sandbox::enter`] forks the spawner, which confines itself and then calls [`serve`]
//! for the rest of its life. Each request read from the control socket ([`super::wire`]) is
//! checked here, never on the daemon's word: a `run` against the [`Allowlist`] ([`start`]: the
//! program, its arguments and stdin, then as whom it runs), and started under the child's own
//! confinement ([`launch`]: nested Landlock layer, the no-IP seccomp filter but for the
//! download, modprobe's one ambient capability). The other requests do their owner's work with
//! one capability raised for the call ([`crate::sandbox::caps::with_effective`]). This is the
//! top of the spawner: it reaches into the owners (boot files, KVM, PCI, the image download's
//! argument check), and nothing below it imports it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use nix::sys::socket::MsgFlags;

use super::client::groups_for;
use super::requests::set_vfio_node;
use super::setup::{cpu_mask, place_fds, stdin_of, ChildSetup, CHILD_PATH, MAX_PASSED_FDS};
use super::wire::{recv_with_fds, send_reply, Reply, Request, RunRequest};
use crate::config::UserIds;

/// The modprobe binaries the spawner may run (`modprobe vfio-pci` only).
pub const MODPROBE: [&str; 2] = ["/usr/sbin/modprobe", "/sbin/modprobe"];

/// What the spawner may start, and as whom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowlist {
    /// Exact program paths.
    pub programs: Vec<PathBuf>,
    /// modprobe may run, with exactly `vfio-pci` as its argument (passthrough configured).
    pub modprobe: bool,
    /// Programs that always run as another user (the QEMU binary as `qemu.user`), whatever
    /// the request says.
    pub run_as: Vec<(PathBuf, UserIds)>,
    /// `accel = "kvm"`: a program run as another user keeps the group owning `/dev/kvm` when
    /// that user is a member ([`crate::qemu::kvm::qemu_groups`]).
    pub kvm: bool,
    /// VFIO group nodes may be handed to QEMU's group ([`super::vfio_node`]): passthrough configured.
    pub vfio_nodes: bool,
    /// `paths.boot`: the only directories a kernel or initrd is opened beneath
    /// ([`crate::qemu::boot_files::open_under`]), whatever path the daemon asks for.
    pub boot_dirs: Vec<PathBuf>,
    /// `images.curl`: may run with the arguments and the config on stdin that
    /// [`crate::images::download`] makes, and is the only program that may connect to a TCP
    /// port.
    pub fetch: Option<PathBuf>,
}

impl Allowlist {
    /// The user `program` runs as: its `run_as` entry, else the spawner's own.
    pub fn user_for(&self, program: &Path) -> Option<UserIds> {
        self.run_as.iter().find(|(p, _)| p == program).map(|(_, u)| *u)
    }

    /// Whether `program` is the image download (`images.curl`): the one program that keeps IP
    /// sockets and the spawner's TCP ports ([`crate::sandbox::child_seccomp`]).
    pub fn is_download(&self, program: &Path) -> bool {
        self.fetch.as_deref() == Some(program)
    }

    /// Whether `program ARGS` may run (a `run` request) with `stdin` (none: `/dev/null`); only
    /// curl reads anything on stdin.
    pub fn permits(&self, program: &Path, args: &[String], stdin: Option<&str>) -> bool {
        if MODPROBE.iter().any(|m| Path::new(m) == program) {
            return stdin.is_none() && self.modprobe && args == ["vfio-pci"];
        }
        if self.fetch.as_deref() == Some(program) {
            return crate::images::download::permits(args, stdin);
        }
        stdin.is_none() && self.programs.iter().any(|p| p == program)
    }
}

struct Running {
    child: std::process::Child,
    pidfd: Option<OwnedFd>,
    reply: OwnedFd,
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open returns a new fd or -1.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let fd = i32::try_from(ret).ok().filter(|f| *f >= 0)?;
    // SAFETY: the kernel just returned this new descriptor; we own it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The spawner's loop: serve requests on `control` until the daemon closes it, then exit.
/// Runs in the forked spawner process, which is single-threaded.
pub(crate) fn serve(control: OwnedFd, allow: &Allowlist, ambient_sys_module: bool) -> ! {
    let nested = crate::sandbox::landlock::child_domain();
    let no_ip = crate::sandbox::child_seccomp::program();
    let mut running: Vec<Running> = Vec::new();
    let mut copies = crate::qemu::boot_files::CopyCache::default();
    loop {
        let mut pfds: Vec<libc::pollfd> =
            vec![libc::pollfd { fd: control.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        for r in &running {
            let fd = r.pidfd.as_ref().map_or(-1, AsRawFd::as_raw_fd);
            pfds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
        // Without pidfds (old kernels) poll with a timeout and try_wait everything.
        let timeout = if running.iter().any(|r| r.pidfd.is_none()) { 50 } else { -1 };
        // SAFETY: pfds is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            std::process::exit(1);
        }
        // Reap what exited. Backwards, so swap_remove only moves entries already looked at and
        // `pfds[i + 1]` stays the entry of `running[i]`.
        for i in (0..running.len()).rev() {
            let ready = pfds[i + 1].revents != 0 || running[i].pidfd.is_none();
            if ready {
                if let Ok(Some(status)) = running[i].child.try_wait() {
                    let r = running.swap_remove(i);
                    send_reply(&r.reply, &Reply { status: Some(status.into_raw()), ..Reply::default() }, None);
                }
            }
        }
        if pfds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) == 0 {
            continue;
        }
        let (bytes, mut fds) = match recv_with_fds(control.as_raw_fd(), MsgFlags::empty()) {
            Ok(got) => got,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            // More descriptors than a request may carry (MSG_CTRUNC): the kernel closed the
            // surplus; drop the request, keep serving.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
            Err(_) => std::process::exit(0),
        };
        if bytes.is_empty() && fds.is_empty() {
            // The daemon closed its end: it is gone. Programs still running are left alone,
            // like a daemon that was killed leaves them.
            std::process::exit(0);
        }
        if fds.is_empty() {
            continue;
        }
        let reply = fds.remove(0);
        let failed = |e: io::Error| Reply { error: Some(e.to_string()), errno: e.raw_os_error(), ..Reply::default() };
        let req = match serde_json::from_slice::<Request>(&bytes) {
            Ok(req) => req,
            Err(e) => {
                send_reply(&reply, &failed(io::Error::new(io::ErrorKind::InvalidInput, e)), None);
                continue;
            }
        };
        match req {
            Request::Run(run) => match start(run, fds, allow, ambient_sys_module, nested.as_ref(), &no_ip) {
                Ok(child) => {
                    let pidfd = pidfd_open(child.id());
                    let pid = i32::try_from(child.id()).unwrap_or(0);
                    send_reply(&reply, &Reply { pid: Some(pid), ..Reply::default() }, pidfd.as_ref());
                    running.push(Running { child, pidfd, reply });
                }
                Err(e) => send_reply(&reply, &failed(e), None),
            },
            Request::BootFile { path, copy } => {
                match serve_boot_file(&mut copies, &allow.boot_dirs, Path::new(&path), copy) {
                    Ok(fd) => send_reply(&reply, &Reply { ok: Some(true), ..Reply::default() }, fd.as_ref()),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::KvmAccess => {
                let user = allow.run_as.first().map(|(_, u)| *u);
                match crate::qemu::kvm::probe_as_qemu(user) {
                    Ok(access) => {
                        send_reply(&reply, &Reply { access: Some(access), ..Reply::default() }, None);
                    }
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::TpmStateFile { name } => {
                let opened = match fds.first() {
                    Some(dir) => crate::sandbox::caps::with_effective(::caps::Capability::CAP_DAC_READ_SEARCH, || {
                        crate::tpm::open_state_file(std::os::fd::AsFd::as_fd(dir), &name)
                    }),
                    None => Err(io::Error::new(io::ErrorKind::InvalidInput, "no state directory passed")),
                };
                match opened {
                    Ok(fd) => send_reply(&reply, &Reply { ok: Some(true), ..Reply::default() }, Some(&fd)),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::TpmStatePlace { name } => {
                use std::os::fd::AsFd;
                let placed = match (fds.first(), fds.get(1), allow.run_as.first().map(|(_, u)| *u)) {
                    (Some(dir), Some(data), Some(user)) => {
                        crate::tpm::write_state_file_as(dir.as_fd(), &name, data.as_fd(), user)
                    }
                    (Some(dir), Some(data), None) => {
                        crate::tpm::write_state_file(dir.as_fd(), &name, data.as_fd(), None)
                    }
                    _ => {
                        Err(io::Error::new(io::ErrorKind::InvalidInput, "a state directory and a file must be passed"))
                    }
                };
                match placed {
                    Ok(()) => send_reply(&reply, &Reply { ok: Some(true), ..Reply::default() }, None),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
            Request::VfioNode { group, gid, mode } => {
                let changed = if allow.vfio_nodes {
                    crate::sandbox::caps::with_effective(::caps::Capability::CAP_CHOWN, || {
                        set_vfio_node(group, gid, mode)
                    })
                } else {
                    Err(io::Error::new(io::ErrorKind::PermissionDenied, "no passthrough configured"))
                };
                match changed {
                    Ok(node) => send_reply(&reply, &Reply { node: Some(node), ..Reply::default() }, None),
                    Err(e) => send_reply(&reply, &failed(e), None),
                }
            }
        }
    }
}

/// Opens (and with `copy`, copies) a boot file in the spawner. Opening is the one thing done
/// with CAP_DAC_READ_SEARCH raised, so a file root can read boots wherever it lives
/// ([`crate::sandbox::caps::SPAWNER`]); the copy reads the open descriptor.
fn serve_boot_file(
    copies: &mut crate::qemu::boot_files::CopyCache,
    boot_dirs: &[PathBuf],
    path: &Path,
    copy: bool,
) -> io::Result<Option<OwnedFd>> {
    use crate::qemu::boot_files;
    let file = crate::sandbox::caps::with_effective(::caps::Capability::CAP_DAC_READ_SEARCH, || {
        boot_files::open_under(boot_dirs, path)
    })?;
    if copy {
        copies.copy(file, path).map(Some)
    } else {
        Ok(None)
    }
}

/// Checks and starts one request in the spawner. `nested` is the Landlock layer of every program but curl (no TCP, no reach into curl)
/// ([`crate::sandbox::landlock::child_domain`]), `no_ip` the seccomp program without IP sockets
/// ([`crate::sandbox::child_seccomp`]): every program gets both but the image download (curl).
fn start(
    req: RunRequest,
    fds: Vec<OwnedFd>,
    allow: &Allowlist,
    ambient_sys_module: bool,
    nested: Option<&OwnedFd>,
    no_ip: &[crate::sandbox::child_seccomp::Instruction],
) -> io::Result<std::process::Child> {
    let program = PathBuf::from(&req.program);
    if !allow.permits(&program, &req.args, req.stdin.as_deref()) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("the spawner does not run {} with these arguments (not on its allowlist)", program.display()),
        ));
    }
    // Only curl keeps the TCP ports the spawner's domain allows, and IP sockets at all.
    let download = allow.is_download(&program);
    let nested = nested.filter(|_| !download).map(AsRawFd::as_raw_fd);
    let no_ip = (!download).then(|| no_ip.to_vec());
    launch(req, fds, allow, ambient_sys_module, nested, no_ip)
}

/// Starts an allowed request: its descriptors in place, its session, limits and user, then
/// `no_ip` (the child seccomp filter, last: nothing after it but the exec).
fn launch(
    req: RunRequest,
    mut fds: Vec<OwnedFd>,
    allow: &Allowlist,
    ambient_sys_module: bool,
    nested: Option<RawFd>,
    no_ip: Option<Vec<crate::sandbox::child_seccomp::Instruction>>,
) -> io::Result<std::process::Child> {
    let want = usize::from(req.stdout) + usize::from(req.stderr) + req.nfds;
    if fds.len() != want || req.nfds > MAX_PASSED_FDS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "descriptor count does not match the request"));
    }
    let program = PathBuf::from(&req.program);
    let passed = fds.split_off(usize::from(req.stdout) + usize::from(req.stderr));
    let mut stdio = fds.into_iter();
    let mut command = std::process::Command::new(&program);
    command.args(&req.args).env_clear().env("PATH", CHILD_PATH).stdin(stdin_of(req.stdin.as_deref())?);
    command.stdout(if req.stdout { stdio.next().map_or_else(Stdio::null, Stdio::from) } else { Stdio::null() });
    command.stderr(if req.stderr { stdio.next().map_or_else(Stdio::null, Stdio::from) } else { Stdio::null() });
    let raw: Vec<RawFd> = passed.iter().map(AsRawFd::as_raw_fd).collect();
    let user = allow.user_for(&program);
    let mask = req.affinity.as_deref().map(cpu_mask).transpose()?;
    let setup = ChildSetup::new(req.memlock, user, groups_for(user, allow.kvm)).with_affinity(mask);
    let raise_module = ambient_sys_module && MODPROBE.iter().any(|m| Path::new(m) == program);
    // SAFETY: only async-signal-safe calls (setsid, setrlimit, setgroups, setgid, setuid, umask,
    // prctl, landlock_restrict_self, fcntl, dup2, seccomp), no allocation: the filter's program
    // was built before the fork.
    unsafe {
        command.pre_exec(move || {
            setup.apply()?;
            if let Some(ruleset) = nested {
                // Landlock needs no_new_privs; the spawner's own domain set it, unless that failed.
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            if raise_module {
                // modprobe gets CAP_SYS_MODULE as an ambient capability; nothing else gets any.
                let cap = libc::c_ulong::from(crate::sandbox::caps::CAP_SYS_MODULE);
                if libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong, cap, 0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            place_fds(&raw)?;
            match &no_ip {
                Some(program) => crate::sandbox::child_seccomp::install(program),
                None => Ok(()),
            }
        });
    }
    let child = command.spawn();
    drop(passed);
    child
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::spawn::pgrp_and_session;

    #[test]
    fn allowlist_is_exact() {
        let a = Allowlist {
            programs: vec!["/usr/bin/qemu-system-x86_64".into()],
            modprobe: true,
            run_as: vec![],
            kvm: false,
            vfio_nodes: false,
            boot_dirs: vec![],
            fetch: None,
        };
        assert!(a.permits(Path::new("/usr/bin/qemu-system-x86_64"), &["-version".into()], None));
        assert!(!a.permits(Path::new("/usr/bin/qemu-img2"), &[], None));
        assert!(!a.permits(Path::new("/bin/sh"), &["-c".into(), "id".into()], None));
        assert!(a.permits(Path::new("/usr/sbin/modprobe"), &["vfio-pci".into()], None));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["evil".into()], None));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["-r".into(), "vfio-pci".into()], None));
        let no_pci = Allowlist { modprobe: false, ..a.clone() };
        assert!(!no_pci.permits(Path::new("/sbin/modprobe"), &["vfio-pci".into()], None));
        // qemu-img is not a program the daemon needs (image work is QEMU's, as qemu.user).
        assert!(!a.permits(Path::new("/usr/bin/qemu-img"), &["info".into()], None));
        // Only curl reads a config on stdin.
        assert!(!a.permits(Path::new("/usr/bin/qemu-system-x86_64"), &["-version".into()], Some("x")));
        assert!(!a.permits(Path::new("/usr/sbin/modprobe"), &["vfio-pci".into()], Some("")));
    }

    /// An allowlist of `/bin/sleep` alone.
    fn sleep_only() -> Allowlist {
        Allowlist {
            programs: vec!["/bin/sleep".into()],
            modprobe: false,
            run_as: vec![],
            kvm: false,
            vfio_nodes: false,
            boot_dirs: vec![],
            fetch: None,
        }
    }

    #[test]
    fn spawner_children_get_their_own_session_and_group() {
        // The spawner's `start`, called in this process (no spawner fork needed to check it).
        let allow = sleep_only();
        let req = RunRequest {
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            stdin: None,
            stdout: false,
            stderr: false,
            nfds: 0,
            memlock: None,
            affinity: None,
        };
        let no_ip = crate::sandbox::child_seccomp::program();
        let mut child = start(req, Vec::new(), &allow, false, None, &no_ip).unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert_eq!(pgrp_and_session(&pid.to_string()), (pid, pid), "its own process group and session");
        assert_ne!(pgrp_and_session("self"), (pid, pid));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn spawner_children_run_on_the_cpus_asked_for() {
        let allow = sleep_only();
        let req = RunRequest {
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            stdin: None,
            stdout: false,
            stderr: false,
            nfds: 0,
            memlock: None,
            affinity: Some(vec![0]),
        };
        let mut child = start(req, Vec::new(), &allow, false, None, &crate::sandbox::child_seccomp::program()).unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        assert_eq!(crate::sandbox::spawn::cpus_allowed(pid), "0");
        child.kill().unwrap();
        child.wait().unwrap();
        // Through the wire: the field survives the JSON, and an old request without it loads.
        let json =
            r#"{"op":"run","program":"/bin/sleep","args":[],"stdout":false,"stderr":false,"nfds":0,"memlock":null}"#;
        assert!(matches!(
            serde_json::from_str::<Request>(json).unwrap(),
            Request::Run(RunRequest { affinity: None, .. })
        ));
    }

    /// The `Seccomp:` line of /proc/PID/status (0 none, 2 a filter).
    fn seccomp_mode(pid: u32) -> String {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status.lines().find_map(|l| l.strip_prefix("Seccomp:")).map(|v| v.trim().to_string()).unwrap_or_default()
    }

    #[test]
    fn every_spawner_child_but_the_download_runs_under_the_no_ip_filter() {
        let sleep = |allow: &Allowlist, args: Vec<String>| {
            let req = RunRequest {
                program: "/bin/sleep".into(),
                args,
                stdout: false,
                stderr: false,
                nfds: 0,
                memlock: None,
                affinity: None,
                stdin: None,
            };
            start(req, Vec::new(), allow, false, None, &crate::sandbox::child_seccomp::program()).unwrap()
        };
        let allow = sleep_only();
        assert_eq!(seccomp_mode(std::process::id()), "0", "the test process itself has no filter");
        let mut child = sleep(&allow, vec!["30".into()]);
        assert_eq!(seccomp_mode(child.id()), "2", "a program gets the filter");
        child.kill().unwrap();
        child.wait().unwrap();
        // The download: curl is recognised by its path, and started without the filter.
        let curl = Allowlist { programs: vec![], fetch: Some("/usr/bin/curl".into()), ..allow.clone() };
        assert!(curl.is_download(Path::new("/usr/bin/curl")));
        assert!(!curl.is_download(Path::new("/bin/sleep")) && !allow.is_download(Path::new("/usr/bin/curl")));
        let req = RunRequest {
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            stdout: false,
            stderr: false,
            nfds: 0,
            memlock: None,
            affinity: None,
            stdin: None,
        };
        let mut child = launch(req, Vec::new(), &allow, false, None, None).unwrap();
        assert_eq!(seccomp_mode(child.id()), "0", "the download keeps its IP sockets");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
