//! The JSON-RPC front end: socket, framing, peer checks ([`server`], [`auth`]) and the method
//! table ([`methods`]).

pub mod auth;
pub mod methods;
pub mod server;
