//! Every way a webhook request can be refused, mapped to its status code.
//!
//! Messages are safe to send back: they never echo the signature, a secret or the payload.

use std::borrow::Cow;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use inbox_domain::budget::NoRoom;
use inbox_domain::inbox::event::EventHeadError;
use inbox_domain::inbox::signature::SignatureError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum IngestError {
    /// The request's source is not in `--allow-from`: refused before anything else is looked at.
    #[error("source address not allowed")]
    ForbiddenSource,
    #[error("unknown endpoint")]
    UnknownEndpoint,
    #[error("body larger than the limit")]
    TooLarge,
    #[error("request headers larger than 8 KiB")]
    HeadersTooLarge,
    #[error("body not received in time")]
    BodyTimeout,
    #[error("body could not be read")]
    BodyRead,
    #[error("signature verification failed: {0}")]
    BadSignature(SignatureError),
    #[error("{0}")]
    BadPayload(EventHeadError),
    /// The database could not confirm the row in time. Stripe retries; the retry is deduplicated.
    /// The cause (with the server's SQLSTATE and message when it sent one) is logged, never sent.
    #[error("database unavailable")]
    Unavailable(Cow<'static, str>),
    /// No room in the bytes in flight (`--max-bytes-in-flight`) for the body, in time: the process
    /// holds as many bodies as it may. Answered before the body is read (or, for a chunked body
    /// that outgrew its room, before the rest is); the sender retries.
    #[error("too busy: retry later")]
    Busy(NoRoom),
}

impl IngestError {
    /// The metric/log label of this outcome.
    pub fn outcome(&self) -> &'static str {
        match self {
            IngestError::ForbiddenSource => "forbidden_source",
            IngestError::UnknownEndpoint => "unknown_endpoint",
            IngestError::TooLarge => "too_large",
            IngestError::HeadersTooLarge => "headers_too_large",
            IngestError::BodyTimeout => "body_timeout",
            IngestError::BodyRead => "body_read_error",
            IngestError::BadSignature(_) => "bad_signature",
            IngestError::BadPayload(_) => "bad_payload",
            IngestError::Unavailable(_) => "unavailable",
            IngestError::Busy(_) => "busy",
        }
    }
}

impl ResponseError for IngestError {
    fn status_code(&self) -> StatusCode {
        match self {
            IngestError::ForbiddenSource => StatusCode::FORBIDDEN,
            IngestError::UnknownEndpoint => StatusCode::NOT_FOUND,
            IngestError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            IngestError::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            IngestError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            IngestError::BodyRead | IngestError::BadSignature(_) | IngestError::BadPayload(_) => {
                StatusCode::BAD_REQUEST
            }
            IngestError::Unavailable(_) | IngestError::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status_code());
        if let IngestError::Unavailable(_) | IngestError::Busy(_) = self {
            // Stripe ignores it, other senders and proxies may honour it.
            response.insert_header(("Retry-After", "1"));
        }
        response.json(serde_json::json!({ "error": self.to_string() }))
    }
}
