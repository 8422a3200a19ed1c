//! What a reservation asks for each child, and what it grants: the words
//! the account (`account`) and an agent's run pool (`pools`) share.

use arbor_protocol::JobId;

/// One child's part of a reservation.
#[derive(Clone, Debug)]
pub struct GrantAsk {
    pub child: JobId,
    pub agent: String,
    /// What the request asked for, if anything.
    pub asked: Option<u64>,
    /// The agent's front-matter budget: the most one of its jobs may be granted.
    pub agent_max: Option<u64>,
    /// The same two, in micro-dollars.
    pub asked_usd_micros: Option<u64>,
    pub agent_max_usd_micros: Option<u64>,
}

/// One child's grant: tokens, and micro-dollars when it has a usd ceiling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    pub tokens: u64,
    pub usd_micros: Option<u64>,
}
