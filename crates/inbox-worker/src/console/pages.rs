//! What operators read: the pages.

use actix_web::web;
use askama::Template;

use super::auth::Operator;

/// The routes of the pages.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(overview));
}

#[derive(Template)]
#[template(path = "console/overview.html")]
struct Overview {
    operator: Operator,
}

async fn overview(operator: Operator) -> actix_web::HttpResponse {
    super::render(&Overview { operator }, actix_web::http::StatusCode::OK)
}
