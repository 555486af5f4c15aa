//! The JSON-RPC front end: socket, framing, peer checks ([`server`], [`auth`]), the pure request
//! parsing ([`request`]) and the method table ([`methods`]); [`activation`] takes the socket from systemd instead of binding it.

pub mod activation;
pub mod auth;
pub mod methods;
pub mod request;
pub mod server;
