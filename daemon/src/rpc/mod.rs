//! The JSON-RPC front end: socket, framing, peer checks ([`server`], [`auth`]), the pure request
//! parsing ([`request`]) and the method table ([`methods`]); [`activation`] takes the socket from systemd instead of binding it.

pub mod activation;
pub mod agent_rate;
pub mod auth;
pub mod limits;
pub mod methods;
pub mod request;
pub mod server;
pub mod single_flight;
pub mod socket_dir;
