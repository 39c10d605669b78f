//! What operators change: POST only, each behind the session's CSRF token and the read-only flag.

use actix_web::web;

/// The routes of the actions.
pub fn configure(_cfg: &mut web::ServiceConfig) {}
