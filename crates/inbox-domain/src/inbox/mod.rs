//! The Transactional Inbox itself, independent of any business: what a verified Stripe event is
//! ([`event`]), how its signature is checked ([`signature`]), every statement on the inbox table
//! ([`store`]), and the schema ([`schema`]).

pub mod event;
pub mod schema;
pub mod signature;
pub mod store;
