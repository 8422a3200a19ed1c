//! agent.md `budget.per_run` (I-65): what all the jobs of one agent in one
//! run may be granted together, kept the way a grant is. When an account
//! reserves grants for children of a pooled agent, each is cut to its
//! share of the pool's room (the room divided evenly among that agent's
//! children in the reservation) and held from the pool with its grant;
//! when the account settles a child, the pool keeps only what it spent;
//! a grant extended by a top-up is held from the pool first. So a pooled
//! agent's jobs, running and ended, never hold more than `per_run`
//! between them, however they are spread over the tree.
//!
//! The pools are the node's, one per run and agent, made when first
//! touched from the run's tree (a resumed run's jobs hold their grants,
//! its ended jobs what they spent) and forgotten when the run stops.

use crate::grant::{Grant, GrantAsk};
use arbor_protocol::{AgentDef, Amount, JobId, PerRun, Refusal, RunId};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Every pooled agent's pool of every run on the node.
#[derive(Default)]
pub struct AgentPools {
    pools: Mutex<HashMap<(RunId, String), Pool>>,
    /// Whether any pool was ever made: a node without pooled agents
    /// settles its children without taking the lock.
    used: std::sync::atomic::AtomicBool,
}

/// One agent's pool in one run.
#[derive(Debug, Default)]
struct Pool {
    cap: PerRun,
    /// Each child's hold: its grant while it runs, what it spent once settled.
    held: BTreeMap<JobId, Amount>,
    total: Amount,
}

impl Pool {
    fn set(&mut self, child: JobId, amount: Amount) {
        let before = self.held.insert(child, amount).unwrap_or_default();
        self.total.tokens = self.total.tokens - before.tokens + amount.tokens;
        self.total.usd_micros = self.total.usd_micros - before.usd_micros + amount.usd_micros;
    }

    /// What is left: tokens and micro-dollars (None: no cap in that unit).
    fn room(&self) -> (Option<u64>, Option<u64>) {
        (
            self.cap
                .tokens
                .map(|cap| cap.saturating_sub(self.total.tokens)),
            self.cap
                .usd_micros
                .map(|cap| cap.saturating_sub(self.total.usd_micros)),
        )
    }
}

fn least(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The figures a pool holds for a child: its grant, or what it spent.
fn grant_amount(grant: Grant) -> Amount {
    Amount {
        tokens: grant.tokens,
        usd_micros: grant.usd_micros.unwrap_or(0),
    }
}

impl AgentPools {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(RunId, String), Pool>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the pools of `run`'s pooled agents among `names` that are not
    /// made yet, from the run's tree as `holds` reads it (each job of an
    /// agent: its id and what it holds).
    fn make(
        &self,
        run: RunId,
        names: &[&str],
        agents: &BTreeMap<String, Arc<AgentDef>>,
        holds: &dyn Fn(&str) -> Vec<(JobId, Amount)>,
    ) {
        for name in names {
            let Some(cap) = agents.get(*name).and_then(|a| a.per_run) else {
                continue;
            };
            let key = (run, name.to_string());
            if self.lock().contains_key(&key) {
                continue;
            }
            // Read outside the pools' lock: the tree has a lock of its own.
            let mut pool = Pool {
                cap,
                ..Pool::default()
            };
            for (job, amount) in holds(name) {
                pool.set(job, amount);
            }
            self.used.store(true, std::sync::atomic::Ordering::Release);
            self.lock().entry(key).or_insert(pool);
        }
    }

    /// Reserves `asks` through `plan` (the account's own reservation), each
    /// child of a pooled agent cut to its share of its pool's room and, if
    /// granted, held from the pool. A pool with no room refuses the whole
    /// reservation, as the account does.
    pub fn reserve(
        &self,
        run: RunId,
        asks: &[GrantAsk],
        agents: &BTreeMap<String, Arc<AgentDef>>,
        holds: &dyn Fn(&str) -> Vec<(JobId, Amount)>,
        plan: impl FnOnce(&[GrantAsk]) -> Result<Vec<Grant>, Refusal>,
    ) -> Result<Vec<Grant>, Refusal> {
        let pooled: Vec<&str> = asks
            .iter()
            .map(|a| a.agent.as_str())
            .filter(|name| agents.get(*name).is_some_and(|a| a.per_run.is_some()))
            .collect();
        if pooled.is_empty() {
            return plan(asks);
        }
        self.make(run, &pooled, agents, holds);
        // Held across the plan: no other reservation of the run's pools
        // can come between reading their room and holding from it.
        let mut pools = self.lock();
        let mut cut = asks.to_vec();
        for ask in &mut cut {
            let Some(pool) = pools.get(&(run, ask.agent.clone())) else {
                continue;
            };
            let among = pooled.iter().filter(|n| **n == ask.agent).count() as u64;
            let (tokens, usd) = pool.room();
            let share = |room: Option<u64>| room.map(|r| r / among);
            let (tokens, usd) = (share(tokens), share(usd));
            if tokens == Some(0) || usd == Some(0) {
                return Err(Refusal::Budget {
                    message: format!(
                        "agent {:?} may spend {} in one run, all of its jobs together (budget.per_run), and its jobs hold all of it",
                        ask.agent,
                        describe(pool.cap)
                    ),
                });
            }
            ask.agent_max = least(ask.agent_max, tokens);
            ask.agent_max_usd_micros = least(ask.agent_max_usd_micros, usd);
        }
        let grants = plan(&cut)?;
        for (ask, grant) in cut.iter().zip(&grants) {
            if let Some(pool) = pools.get_mut(&(run, ask.agent.clone())) {
                pool.set(ask.child, grant_amount(*grant));
            }
        }
        Ok(grants)
    }

    /// `child` settled at `spent`: its pool keeps only that (never more
    /// than it held).
    pub fn settle(&self, run: RunId, child: JobId, spent: Amount) {
        if !self.used.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut pools = self.lock();
        if let Some(pool) = holding(&mut pools, run, child) {
            let held = pool.held[&child];
            let kept = Amount {
                tokens: held.tokens.min(spent.tokens),
                usd_micros: held.usd_micros.min(spent.usd_micros),
            };
            pool.set(child, kept);
        }
    }

    /// `given` (an extension of `child`'s grant), cut to its pool's room
    /// and held from it; None if that is short of `at_least`. All of it
    /// for a child of no pool.
    pub fn extend(
        &self,
        run: RunId,
        child: JobId,
        given: Amount,
        at_least: Amount,
    ) -> Option<Amount> {
        let mut pools = self.lock();
        let Some(pool) = holding(&mut pools, run, child) else {
            return Some(given);
        };
        let (tokens, usd) = pool.room();
        let allowed = Amount {
            tokens: tokens.map_or(given.tokens, |room| room.min(given.tokens)),
            usd_micros: usd.map_or(given.usd_micros, |room| room.min(given.usd_micros)),
        };
        if allowed.tokens < at_least.tokens || allowed.usd_micros < at_least.usd_micros {
            return None;
        }
        let held = pool.held[&child];
        pool.set(
            child,
            Amount {
                tokens: held.tokens + allowed.tokens,
                usd_micros: held.usd_micros + allowed.usd_micros,
            },
        );
        Some(allowed)
    }

    /// What `agent`'s jobs of `run` hold together, if it has a pool.
    pub fn held(&self, run: RunId, agent: &str) -> Option<Amount> {
        self.lock().get(&(run, agent.to_string())).map(|p| p.total)
    }

    /// The run stopped: its pools go (a resumed run makes them again).
    pub fn forget(&self, run: RunId) {
        self.lock().retain(|(r, _), _| *r != run);
    }
}

/// The pool of `run` that holds for `child`, if one does.
fn holding(
    pools: &mut HashMap<(RunId, String), Pool>,
    run: RunId,
    child: JobId,
) -> Option<&mut Pool> {
    pools
        .iter_mut()
        .find(|((r, _), pool)| *r == run && pool.held.contains_key(&child))
        .map(|(_, pool)| pool)
}

fn describe(cap: PerRun) -> String {
    let mut parts = vec![];
    if let Some(tokens) = cap.tokens {
        parts.push(format!("{tokens} tokens"));
    }
    if let Some(micros) = cap.usd_micros {
        parts.push(format!("${:.6}", micros as f64 / 1e6));
    }
    parts.join(" and ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agents(per_run: PerRun) -> BTreeMap<String, Arc<AgentDef>> {
        let mut def = crate::policy::tests::agent(&[], &[], Default::default());
        def.name = "worker".into();
        def.per_run = Some(per_run);
        BTreeMap::from([("worker".to_string(), Arc::new(def))])
    }

    fn ask(child: JobId) -> GrantAsk {
        GrantAsk {
            child,
            agent: "worker".into(),
            asked: None,
            agent_max: None,
            asked_usd_micros: None,
            agent_max_usd_micros: None,
        }
    }

    /// The account's part: each child granted what its ask allows, up to `offer`.
    fn grant_up_to(offer: u64) -> impl FnOnce(&[GrantAsk]) -> Result<Vec<Grant>, Refusal> {
        move |asks| {
            Ok(asks
                .iter()
                .map(|a| Grant {
                    tokens: a.agent_max.map_or(offer, |m| m.min(offer)),
                    usd_micros: a.agent_max_usd_micros,
                })
                .collect())
        }
    }

    #[test]
    fn inv_65_a_pool_never_holds_more_than_per_run_across_reserves_settles_and_extensions() {
        let pools = AgentPools::default();
        let run = RunId::new();
        let agents = agents(PerRun {
            tokens: Some(1_000),
            usd_micros: None,
        });
        let none = |_: &str| vec![];
        let (a, b) = (JobId::new(), JobId::new());
        let grants = pools
            .reserve(run, &[ask(a), ask(b)], &agents, &none, grant_up_to(10_000))
            .unwrap();
        assert_eq!(
            grants.iter().map(|g| g.tokens).collect::<Vec<_>>(),
            [500, 500]
        );
        let c = JobId::new();
        let refused = pools.reserve(run, &[ask(c)], &agents, &none, grant_up_to(10_000));
        assert!(refused.unwrap_err().to_string().contains("budget.per_run"));
        pools.settle(
            run,
            a,
            Amount {
                tokens: 200,
                usd_micros: 0,
            },
        );
        assert_eq!(pools.held(run, "worker").unwrap().tokens, 700);
        // An extension is cut to the room (300), or refused below its least.
        let wide = Amount {
            tokens: 900,
            usd_micros: 0,
        };
        let least = |tokens| Amount {
            tokens,
            usd_micros: 0,
        };
        assert_eq!(pools.extend(run, b, wide, least(400)), None);
        assert_eq!(pools.extend(run, b, wide, least(100)), Some(least(300)));
        assert_eq!(pools.held(run, "worker").unwrap().tokens, 1_000);
        pools.forget(run);
        assert_eq!(pools.held(run, "worker"), None);
    }

    #[test]
    fn inv_65_a_resumed_runs_pool_starts_from_what_its_jobs_hold() {
        let pools = AgentPools::default();
        let run = RunId::new();
        let agents = agents(PerRun {
            tokens: None,
            usd_micros: Some(1_000_000),
        });
        let (old, new) = (JobId::new(), JobId::new());
        let tree = move |_: &str| {
            vec![(
                old,
                Amount {
                    tokens: 50,
                    usd_micros: 600_000,
                },
            )]
        };
        let grants = pools
            .reserve(run, &[ask(new)], &agents, &tree, grant_up_to(10_000))
            .unwrap();
        assert_eq!(grants[0].usd_micros, Some(400_000), "what the old job left");
    }
}
