//! What the ingest reads from a verified webhook body, and how the body reaches PostgreSQL.

use std::borrow::Cow;

use postgres_types::{to_sql_checked, IsNull, ToSql, Type};
use serde::Deserialize;

/// The longest event id we store. Stripe's ids are about 30 characters; anything much longer is
/// not a Stripe event and would only bloat the primary key.
pub const MAX_EVENT_ID_LEN: usize = 255;
/// The longest event type we store (Stripe's longest type names are under 80 characters).
pub const MAX_EVENT_TYPE_LEN: usize = 255;

/// The fields of a Stripe event the ingest needs: its id (the inbox key) and its type.
///
/// Parsing this from the body also validates that the whole body is JSON (serde reads every
/// value it skips), so a row is only ever written with a payload PostgreSQL will accept as `jsonb`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventHead<'a> {
    pub id: Cow<'a, str>,
    pub event_type: Cow<'a, str>,
}

/// Why a verified body is not an event we can store. The texts are safe to return to the caller:
/// they never echo the payload.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
pub enum EventHeadError {
    #[error("body is not a JSON object")]
    NotJson,
    #[error("event has no string `id`")]
    MissingId,
    #[error("event has no string `type`")]
    MissingType,
    #[error("event `id` is empty or too long")]
    BadId,
    #[error("event `type` is empty or too long")]
    BadType,
}

#[derive(Deserialize)]
struct RawHead<'a> {
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default, rename = "type")]
    event_type: Option<Cow<'a, str>>,
}

impl<'a> EventHead<'a> {
    /// Parses a verified body. Extra fields are ignored; `id` and `type` must be non-empty strings.
    pub fn parse(body: &'a [u8]) -> Result<Self, EventHeadError> {
        // A non-string `id`/`type` is a type error from serde: distinguish it from broken JSON by
        // checking the syntax separately only on that (rare) path.
        let raw: RawHead<'a> = match serde_json::from_slice(body) {
            Ok(raw) => raw,
            Err(e) if e.is_data() => {
                return Err(match serde_json::from_slice::<serde_json::Value>(body) {
                    Ok(serde_json::Value::Object(map)) => {
                        if !map.get("id").is_some_and(|v| v.is_string()) {
                            EventHeadError::MissingId
                        } else {
                            EventHeadError::MissingType
                        }
                    }
                    _ => EventHeadError::NotJson,
                })
            }
            Err(_) => return Err(EventHeadError::NotJson),
        };
        let id = raw.id.ok_or(EventHeadError::MissingId)?;
        let event_type = raw.event_type.ok_or(EventHeadError::MissingType)?;
        if id.is_empty() || id.len() > MAX_EVENT_ID_LEN {
            return Err(EventHeadError::BadId);
        }
        if event_type.is_empty() || event_type.len() > MAX_EVENT_TYPE_LEN {
            return Err(EventHeadError::BadType);
        }
        Ok(EventHead { id, event_type })
    }
}

/// A JSON document already validated, passed to PostgreSQL as `json`/`jsonb` without parsing it
/// into a tree and serialising it again (the ingest's hot path sends the body as received).
#[derive(Clone, Copy)]
pub struct JsonBytes<'a>(pub &'a [u8]);

/// Prints the size only: the driver's debug logs list parameters, and payloads hold customer data.
impl std::fmt::Debug for JsonBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JsonBytes({} bytes)", self.0.len())
    }
}

impl ToSql for JsonBytes<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // jsonb's binary format: a version byte, then the JSON text.
            out.extend_from_slice(&[1]);
        }
        out.extend_from_slice(self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSON || *ty == Type::JSONB
    }

    to_sql_checked!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_id_and_type_and_ignores_the_rest() {
        let head =
            EventHead::parse(br#"{"id":"evt_1","object":"event","data":{"x":[1,2]},"type":"invoice.paid"}"#)
                .unwrap();
        assert_eq!(head.id, "evt_1");
        assert_eq!(head.event_type, "invoice.paid");
    }

    #[test]
    fn refuses_what_is_not_an_event() {
        assert_eq!(EventHead::parse(b"not json"), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(b"[1,2]"), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1","type":"x"} trailing"#), Err(EventHeadError::NotJson));
        assert_eq!(EventHead::parse(br#"{"type":"x"}"#), Err(EventHeadError::MissingId));
        assert_eq!(EventHead::parse(br#"{"id":1,"type":"x"}"#), Err(EventHeadError::MissingId));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1"}"#), Err(EventHeadError::MissingType));
        assert_eq!(EventHead::parse(br#"{"id":"evt_1","type":null}"#), Err(EventHeadError::MissingType));
        assert_eq!(EventHead::parse(br#"{"id":"","type":"x"}"#), Err(EventHeadError::BadId));
        assert_eq!(EventHead::parse(br#"{"id":"e","type":""}"#), Err(EventHeadError::BadType));
        let long = format!(r#"{{"id":"{}","type":"x"}}"#, "e".repeat(MAX_EVENT_ID_LEN + 1));
        assert_eq!(EventHead::parse(long.as_bytes()), Err(EventHeadError::BadId));
    }

    #[test]
    fn escaped_strings_are_unescaped() {
        let head = EventHead::parse(br#"{"id":"evt_\u0031","type":"invoice.paid"}"#).unwrap();
        assert_eq!(head.id, "evt_1");
    }
}
