//! Which queued runs a node takes from a shared (PostgreSQL) queue (I-65):
//! fair between tenants, within the concurrency keys, without a turn
//! that every node would have to share. The tenant running the fewest runs
//! for its weight, across every node, goes first (ties: the one whose run
//! came first); within a tenant, the lowest `priority`, then arrival. So a
//! tenant that floods the queue holds no more than its weighted share of
//! what runs, and another tenant's run waits only for the next free slot.
//! A node's own queue keeps its weighted turns (`admission`); both serve
//! the same keys.

use arbor_protocol::RunId;
use std::collections::{BTreeMap, HashMap};

/// A queued run, in arrival order.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub run: RunId,
    pub tenant: String,
    pub flow: String,
    pub priority: u8,
}

/// What bounds the choice: each tenant's weight, and the concurrency keys.
pub struct Bounds<'a> {
    pub weight: &'a dyn Fn(&str) -> f64,
    pub per_tenant: Option<u32>,
    pub per_flow: &'a BTreeMap<String, u32>,
}

/// Up to `room` of `queued` (in arrival order) to start now, in the order
/// they should start, given what runs now (`running`: each run's tenant
/// and flow, on every node).
pub fn pick(
    queued: &[Candidate],
    running: &[(String, String)],
    bounds: &Bounds<'_>,
    room: usize,
) -> Vec<RunId> {
    let mut by_tenant: HashMap<&str, u32> = HashMap::new();
    let mut by_flow: HashMap<&str, u32> = HashMap::new();
    for (tenant, flow) in running {
        *by_tenant.entry(tenant).or_default() += 1;
        *by_flow.entry(flow).or_default() += 1;
    }
    let full = |count: &HashMap<&str, u32>, key: &str, limit: Option<u32>| {
        limit.is_some_and(|limit| count.get(key).copied().unwrap_or(0) >= limit)
    };
    let mut taken = vec![false; queued.len()];
    let mut picks = vec![];
    while picks.len() < room {
        // Each tenant's head: (priority, arrival).
        let mut heads: HashMap<&str, (u8, usize)> = HashMap::new();
        for (at, c) in queued.iter().enumerate() {
            if taken[at]
                || full(&by_tenant, &c.tenant, bounds.per_tenant)
                || full(&by_flow, &c.flow, bounds.per_flow.get(&c.flow).copied())
            {
                continue;
            }
            let key = (c.priority, at);
            heads
                .entry(&c.tenant)
                .and_modify(|head| *head = (*head).min(key))
                .or_insert(key);
        }
        let load = |tenant: &str| {
            f64::from(by_tenant.get(tenant).copied().unwrap_or(0)) / (bounds.weight)(tenant)
        };
        let Some((_, (_, at))) = heads
            .into_iter()
            .min_by(|a, b| load(a.0).total_cmp(&load(b.0)).then(a.1.1.cmp(&b.1.1)))
        else {
            break;
        };
        taken[at] = true;
        let c = &queued[at];
        *by_tenant.entry(&c.tenant).or_default() += 1;
        *by_flow.entry(&c.flow).or_default() += 1;
        picks.push(c.run);
    }
    picks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(of: &[(&str, &str, u8)]) -> Vec<Candidate> {
        of.iter()
            .map(|(tenant, flow, priority)| Candidate {
                run: RunId::new(),
                tenant: tenant.to_string(),
                flow: flow.to_string(),
                priority: *priority,
            })
            .collect()
    }

    fn at(queued: &[Candidate], picks: &[RunId]) -> Vec<usize> {
        picks
            .iter()
            .map(|p| queued.iter().position(|c| c.run == *p).unwrap())
            .collect()
    }

    #[test]
    fn a_flooding_tenant_delays_only_itself_and_weights_share_what_runs() {
        let mut of = vec![("a", "f", 3); 6];
        of.push(("b", "f", 3));
        let queued = queue(&of);
        let one = |_: &str| 1.0;
        let flows = BTreeMap::new();
        let bounds = Bounds {
            weight: &one,
            per_tenant: None,
            per_flow: &flows,
        };
        let running = vec![("a".to_string(), "f".to_string())];
        // a runs one already: b's run, last to come, goes first.
        assert_eq!(at(&queued, &pick(&queued, &running, &bounds, 3)), [6, 0, 1]);
        // Weighted 3 to 1, a takes three for b's one.
        let weights = |t: &str| if t == "a" { 3.0 } else { 1.0 };
        let weighted = Bounds {
            weight: &weights,
            ..bounds
        };
        let mut of = vec![("a", "f", 3); 4];
        of.extend([("b", "f", 3); 4]);
        let queued = queue(&of);
        assert_eq!(at(&queued, &pick(&queued, &[], &weighted, 4)), [0, 4, 1, 2]);
    }

    #[test]
    fn the_concurrency_keys_and_priority_decide_within_the_room() {
        let queued = queue(&[
            ("a", "slow", 3),
            ("a", "f", 5),
            ("a", "f", 1),
            ("b", "slow", 3),
        ]);
        let one = |_: &str| 1.0;
        let flows = BTreeMap::from([("slow".to_string(), 1)]);
        let bounds = Bounds {
            weight: &one,
            per_tenant: Some(2),
            per_flow: &flows,
        };
        // a's priority 1 first; then b's slow run (b runs fewer), which
        // takes the slow flow's one slot; then a's priority 5; a's slow run
        // waits for the slot, and is past per_tenant besides.
        assert_eq!(at(&queued, &pick(&queued, &[], &bounds, 4)), [2, 3, 1]);
        let running = vec![("b".to_string(), "other".to_string())];
        assert_eq!(at(&queued, &pick(&queued, &running, &bounds, 1)), [2]);
    }
}
