//! arbor.toml `[triggers.NAME]`: a flow started by a signed HTTP call
//! (`POST /v1/triggers/NAME`), verified as the Standard Webhooks
//! specification says: `webhook-id`, `webhook-timestamp` (within five
//! minutes of the node's clock) and `webhook-signature` (`v1,` and the
//! base64 of HMAC-SHA256 over `id.timestamp.body`, keyed by the secret's
//! `whsec_` value). The same `webhook-id` makes one run.

use serde::Deserialize;
use std::collections::BTreeMap;

/// How far a `webhook-timestamp` may be from the node's clock.
pub const TOLERANCE_S: u64 = 5 * 60;

/// One trigger, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trigger {
    pub name: String,
    /// The flow it starts.
    pub flow: String,
    /// The secret (by name) whose value signs its calls.
    pub secret: String,
    /// A JSON Pointer into the body: the flow's input. None: the whole
    /// body, if the flow takes an input.
    pub input: Option<String>,
    /// The tenant its runs are for; none: `default`.
    pub tenant: Option<String>,
}

/// `[triggers.NAME]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TriggerFile {
    flow: String,
    secret: String,
    #[serde(default)]
    input: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
}

impl TriggerFile {
    /// The trigger, its `input` a JSON Pointer; `secret_name` says whether
    /// its secret's name is one (the workspace's own rule).
    pub fn check(self, name: &str, secret_name: fn(&str) -> bool) -> Result<Trigger, String> {
        if !secret_name(&self.secret) {
            return Err(format!(
                "triggers.{name}.secret: {:?} is not a secret's name (an environment variable's: A-Z, 0-9, _)",
                self.secret
            ));
        }
        if let Some(pointer) = &self.input
            && !pointer.is_empty()
            && !pointer.starts_with('/')
        {
            return Err(format!(
                "triggers.{name}.input: {pointer:?} is not a JSON Pointer (it starts with /, or is empty for the whole body)"
            ));
        }
        Ok(Trigger {
            name: name.to_string(),
            flow: self.flow,
            secret: self.secret,
            input: self.input,
            tenant: self.tenant,
        })
    }
}

/// Each trigger's signing key, from its secret's value: refused at start
/// if one has none, or one that is no signing secret.
pub fn keys(
    triggers: &BTreeMap<String, Trigger>,
    secrets: &arbor_actors::secrets::Secrets,
) -> Result<BTreeMap<String, Vec<u8>>, String> {
    triggers
        .values()
        .map(|t| {
            let block = format!("triggers.{}", t.name);
            let key = crate::notify::signing_key(secrets, &block, &t.secret)?;
            Ok((t.name.clone(), key))
        })
        .collect()
}

/// Why a call's signature is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unsigned {
    #[error("no {0} header")]
    Missing(&'static str),
    #[error("webhook-timestamp is not a number of seconds")]
    BadTimestamp,
    #[error("webhook-timestamp is more than five minutes from the node's clock")]
    OldTimestamp,
    #[error("no signature in webhook-signature matches the body")]
    NoMatch,
}

/// Checks a call's Standard Webhooks headers against `key` at `now_s`.
pub fn verify(
    key: &[u8],
    id: Option<&str>,
    timestamp: Option<&str>,
    signatures: Option<&str>,
    body: &[u8],
    now_s: u64,
) -> Result<(), Unsigned> {
    use base64::Engine as _;
    use hmac::{KeyInit, Mac};
    let id = id.ok_or(Unsigned::Missing("webhook-id"))?;
    let timestamp = timestamp.ok_or(Unsigned::Missing("webhook-timestamp"))?;
    let signatures = signatures.ok_or(Unsigned::Missing("webhook-signature"))?;
    let at: u64 = timestamp
        .trim()
        .parse()
        .map_err(|_| Unsigned::BadTimestamp)?;
    if at.abs_diff(now_s) > TOLERANCE_S {
        return Err(Unsigned::OldTimestamp);
    }
    for signature in signatures.split_whitespace() {
        let Some(encoded) = signature.strip_prefix("v1,") else {
            continue;
        };
        let Ok(tag) = base64::engine::general_purpose::STANDARD.decode(encoded) else {
            continue;
        };
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes any key");
        mac.update(format!("{id}.{timestamp}.").as_bytes());
        mac.update(body);
        // In constant time.
        if mac.verify_slice(&tag).is_ok() {
            return Ok(());
        }
    }
    Err(Unsigned::NoMatch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_made_by_the_secret_verifies_and_any_change_is_refused() {
        let key = crate::notify::secret_key("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = r#"{"topic":"tides"}"#;
        let signed = crate::notify::sign(&key, "msg_1", 1_700_000_000, body);
        let check = |id, ts, sig: &str, body: &str, now| {
            verify(&key, Some(id), Some(ts), Some(sig), body.as_bytes(), now)
        };
        let now = 1_700_000_100;
        assert_eq!(check("msg_1", "1700000000", &signed, body, now), Ok(()));
        // One of several signatures (a secret being rotated) is enough.
        let several = format!("v1,AAAA {signed}");
        assert_eq!(check("msg_1", "1700000000", &several, body, now), Ok(()));
        assert_eq!(
            check("msg_2", "1700000000", &signed, body, now),
            Err(Unsigned::NoMatch)
        );
        assert_eq!(
            check("msg_1", "1700000000", &signed, "{}", now),
            Err(Unsigned::NoMatch)
        );
        assert_eq!(
            check("msg_1", "1700000000", &signed, body, now + TOLERANCE_S),
            Err(Unsigned::OldTimestamp)
        );
        assert_eq!(
            check("msg_1", "soon", &signed, body, now),
            Err(Unsigned::BadTimestamp)
        );
        assert_eq!(
            verify(&key, None, Some("1"), Some(&signed), b"", now),
            Err(Unsigned::Missing("webhook-id"))
        );
    }
}
