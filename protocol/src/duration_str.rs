//! Durations as humantime strings ("5m", "250ms") in every user-facing format.

use std::time::Duration;

pub fn parse(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|e| format!("bad duration {text:?}: {e}"))
}
