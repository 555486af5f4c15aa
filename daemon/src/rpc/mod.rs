//! The JSON-RPC front end: socket, framing, peer checks ([`server`], [`auth`]), the pure request
//! parsing ([`request`]), the one method table ([`methods`]) and the dispatcher made from it
//! ([`dispatch`]); [`activation`] takes the socket from systemd instead of binding it.

pub mod activation;
pub mod agent_rate;
pub mod auth;
pub mod dispatch;
pub mod limits;
pub mod methods;
pub mod request;
pub mod server;
pub mod single_flight;
pub mod socket_dir;
