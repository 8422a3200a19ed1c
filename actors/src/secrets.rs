//! Secret values (I-27): held by the node, handed to a sandbox as its
//! environment, and cut out of everything that leaves the sandbox.
//!
//! Invariants:
//! 1. A value is never formatted: `Debug` shows names only, and nothing here
//!    returns a value but `env_for`, whose result goes to a process's
//!    environment and nowhere else.
//! 2. Every byte a sandbox hands back (command output, a file read) passes
//!    through `redact` first, so a value a command echoes or writes to a
//!    file never reaches the model, an event, a log or the journal.

use std::collections::{BTreeMap, BTreeSet};

/// The node's secrets, by name.
#[derive(Clone, Default)]
pub struct Secrets {
    values: BTreeMap<String, String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.values.keys()).finish()
    }
}

impl Secrets {
    /// Values as found (a secrets file's, then the environment's). Empty
    /// values are no values.
    pub fn new(values: BTreeMap<String, String>) -> Self {
        Self {
            values: values.into_iter().filter(|(_, v)| !v.is_empty()).collect(),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// The environment a sandbox holding `names` gets; `Err` names the first
    /// one without a value.
    pub fn env_for(&self, names: &BTreeSet<String>) -> Result<Vec<(String, String)>, String> {
        names
            .iter()
            .map(|n| {
                self.values
                    .get(n)
                    .map(|v| (n.clone(), v.clone()))
                    .ok_or_else(|| format!("the secret {n} has no value on this node"))
            })
            .collect()
    }

    /// `text` with every value of the node's secrets replaced by
    /// `[secret NAME]`, longest first so that a value inside another is not
    /// half-cut.
    pub fn redact(&self, text: &str) -> String {
        if self.values.is_empty() {
            return text.to_string();
        }
        let mut by_length: Vec<(&String, &String)> = self.values.iter().collect();
        by_length.sort_by_key(|(_, v)| std::cmp::Reverse(v.len()));
        let mut out = text.to_string();
        for (name, value) in by_length {
            if out.contains(value.as_str()) {
                out = out.replace(value.as_str(), &format!("[secret {name}]"));
            }
        }
        out
    }

    /// `redact` over every string of a JSON value, keys included.
    pub fn redact_json(&self, value: &serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::String(s) => Value::String(self.redact(s)),
            Value::Array(items) => {
                Value::Array(items.iter().map(|v| self.redact_json(v)).collect())
            }
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (self.redact(k), self.redact_json(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
}

impl Secrets {
    /// As `redact`, for text that was cut short (a command's output at its
    /// limit): a value cut by the limit leaves its start at the very end,
    /// which `redact` cannot recognise, so that start is cut too.
    pub fn redact_cut(&self, text: &str) -> String {
        let mut out = self.redact(text);
        for value in self.values.values() {
            if let Some(k) = (1..value.len())
                .rev()
                .find(|&k| value.is_char_boundary(k) && out.ends_with(&value[..k]))
            {
                out.truncate(out.len() - k);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_27_values_are_cut_from_text_and_never_printed() {
        let secrets = Secrets::new(BTreeMap::from([
            ("TOKEN".to_string(), "s3cr3t-value".to_string()),
            ("INNER".to_string(), "cr3t".to_string()),
            ("EMPTY".to_string(), String::new()),
        ]));
        assert_eq!(
            secrets.redact("a s3cr3t-value b cr3t"),
            "a [secret TOKEN] b [secret INNER]"
        );
        assert_eq!(format!("{secrets:?}"), r#"{"INNER", "TOKEN"}"#);
        assert!(!secrets.has("EMPTY"), "an empty value is no value");
        let err = secrets
            .env_for(&BTreeSet::from(["EMPTY".to_string()]))
            .unwrap_err();
        assert!(err.contains("EMPTY"), "{err}");
    }

    #[test]
    fn inv_27_a_value_cut_by_the_output_limit_leaves_no_start_behind() {
        let secrets = Secrets::new(BTreeMap::from([(
            "TOKEN".to_string(),
            "s3cr3t-value".to_string(),
        )]));
        assert_eq!(secrets.redact_cut("output: s3cr3t-va"), "output: ");
        assert_eq!(
            secrets.redact_cut("s3cr3t-value then s"),
            "[secret TOKEN] then "
        );
        assert_eq!(secrets.redact_cut("nothing here"), "nothing here");
    }

    #[test]
    fn inv_27_a_json_value_is_redacted_in_keys_and_strings_alone() {
        let secrets = Secrets::new(BTreeMap::from([(
            "TOKEN".to_string(),
            "s3cr3t-value".to_string(),
        )]));
        let value = serde_json::json!({"s3cr3t-value": ["it was s3cr3t-value", 7, null]});
        assert_eq!(
            secrets.redact_json(&value),
            serde_json::json!({"[secret TOKEN]": ["it was [secret TOKEN]", 7, null]})
        );
    }
}
