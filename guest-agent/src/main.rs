//! vmhost guest agent.
//!
//! Placeholder binary: the agent protocol (hello handshake, `net.check`, `net.apply`) is specified in
//! issue 5 and not implemented yet. It prints its version so packaging and the harness can find it.

fn main() {
    println!("vmhost-agent {} (protocol not implemented yet)", env!("CARGO_PKG_VERSION"));
}
