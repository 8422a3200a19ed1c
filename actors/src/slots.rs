//! `[limits.concurrency] per_agent`: how many jobs of an agent (steps and
//! sub-agents, of every run) run their loops at once on the node. A job
//! waits for a slot before its first turn, in arrival order, holding its
//! grant and nothing else; a stop ends the wait. Slots are the node's
//! memory: after a restart every resumed job takes one again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

struct Slot {
    limit: u32,
    free: Arc<Semaphore>,
    waiting: AtomicUsize,
}

/// Every bounded agent's slots.
#[derive(Default)]
pub struct AgentSlots {
    by_agent: BTreeMap<String, Slot>,
}

/// A bounded agent's slots now: (agent, limit, running, waiting).
pub type SlotView = (String, u32, usize, usize);

impl AgentSlots {
    pub fn new(per_agent: &BTreeMap<String, u32>) -> Self {
        AgentSlots {
            by_agent: per_agent
                .iter()
                .map(|(agent, limit)| {
                    let slot = Slot {
                        limit: *limit,
                        free: Arc::new(Semaphore::new(*limit as usize)),
                        waiting: AtomicUsize::new(0),
                    };
                    (agent.clone(), slot)
                })
                .collect(),
        }
    }

    /// A slot for a job of `agent`, held until the permit is dropped:
    /// `Ok(None)` at once for an agent with no bound; `Err` if `cancel`
    /// fired while it waited.
    pub async fn take(
        &self,
        agent: &str,
        cancel: &CancellationToken,
    ) -> Result<Option<OwnedSemaphorePermit>, ()> {
        let Some(slot) = self.by_agent.get(agent) else {
            return Ok(None);
        };
        slot.waiting.fetch_add(1, Ordering::AcqRel);
        let taken = tokio::select! {
            permit = slot.free.clone().acquire_owned() => permit.map_err(|_| ()),
            _ = cancel.cancelled() => Err(()),
        };
        slot.waiting.fetch_sub(1, Ordering::AcqRel);
        taken.map(Some)
    }

    pub fn view(&self) -> Vec<SlotView> {
        self.by_agent
            .iter()
            .map(|(agent, slot)| {
                let free = slot.free.available_permits();
                (
                    agent.clone(),
                    slot.limit,
                    (slot.limit as usize).saturating_sub(free),
                    slot.waiting.load(Ordering::Acquire),
                )
            })
            .collect()
    }
}
