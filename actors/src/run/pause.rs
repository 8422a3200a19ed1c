//! A run's budget pause (`on_ceiling = "pause"`, I-58). When the run's
//! ceiling refuses a step's next call, or leaves nothing to start its next
//! steps with, they wait instead of ending: a step holds nothing while it
//! waits (its call was refused whole), its wall timeout and the run's are
//! paused, and the pause has one deadline. Each waiter is a
//! `budget_reached` event, durable before the run shows it. A top-up
//! (`RunMsg::TopUp`) lets them go on in their order: a step's hold is
//! extended from the root (`LedgerOp::Extend`, appended) and its account's
//! grant grown by as much (`Grow`, committed, which covers the extension),
//! so every account balances at each step. At the deadline they end as they
//! would have without the pause; a stop ends them at once (their loops'
//! tokens are cancelled).

use super::checks::{Left, Waiter};
use super::{PlannedStep, RunMsg, RunState};
use crate::account::AccountMsg;
use crate::parent::{BudgetWait, Payer};
use arbor_protocol::{AgentDef, Amount, ErrorClass, EventKind, Status};
use ractor::{ActorProcessingErr, ActorRef};
use std::time::{Duration, Instant};

impl RunState {
    /// A step's way to ask for a top-up, when the run pauses at its ceiling
    /// and the step's ceiling is the run's. A step whose agent sets a
    /// budget, or whose loop bounds it, is at a ceiling of its own, and
    /// ends at it as before (I-13).
    pub(super) fn payer(
        &self,
        myself: &ActorRef<RunMsg>,
        agent: &AgentDef,
        left: &Left,
    ) -> Option<Payer> {
        let own = agent.budget_tokens.is_some()
            || agent.budget_usd_micros.is_some()
            || left.tokens.is_some()
            || left.usd_micros.is_some();
        (self.spec.pause.is_some() && !own).then(|| myself.get_derived())
    }

    /// A step's call was refused at the ceiling: it waits its turn.
    pub(super) async fn budget_wait(
        &mut self,
        myself: &ActorRef<RunMsg>,
        wait: BudgetWait,
    ) -> Result<(), ActorProcessingErr> {
        if self.finish.is_some() || self.spec.pause.is_none() || !self.steps.contains_key(&wait.job)
        {
            let _ = wait.reply.send(false);
            return Ok(());
        }
        let (job, needs) = (wait.job, wait.needs);
        self.pause.waiters.push_back(Waiter::Step(wait));
        // What a step that ended gave back may be enough already.
        self.serve(myself).await?;
        if self.pause.waiters.iter().any(|w| w.job() == Some(job)) {
            self.announce(myself, Some(job), needs).await?;
        }
        Ok(())
    }

    /// The run could not grant its next steps anything: they wait.
    pub(super) async fn wait_to_start(
        &mut self,
        myself: &ActorRef<RunMsg>,
        planned: Vec<PlannedStep>,
    ) {
        let n = planned.len() as u64;
        let (tokens, usd) = self.available().await;
        let needs = Amount {
            tokens: n.saturating_sub(tokens).max(1),
            usd_micros: usd.map_or(0, |usd| n.saturating_sub(usd)),
        };
        self.pause.waiters.push_back(Waiter::Start(planned, needs));
        if let Err(e) = self.announce(myself, None, needs).await {
            self.begin_finish(
                Status::Failed,
                Some(ErrorClass::Internal),
                format!("the journal could not record the budget pause: {e}"),
            );
        }
    }

    /// What the run's root has available: tokens, and micro-dollars if it
    /// has a usd ceiling.
    async fn available(&self) -> (u64, Option<u64>) {
        ractor::call!(self.account, |reply| AccountMsg::Available { reply }).unwrap_or((0, None))
    }

    /// A top-up was committed: the pause's deadline is spent, and its
    /// waiters go on in their order while there is enough.
    pub(super) async fn topped_up(
        &mut self,
        myself: &ActorRef<RunMsg>,
    ) -> Result<(), ActorProcessingErr> {
        self.pause.kept_deadline = None;
        self.serve(myself).await
    }

    /// Each waiter in order gets what it needs, while the root has it: a
    /// step's grant is extended (at least its needs, else an even share of
    /// what is available among those still waiting), steps not started are
    /// started. The first that cannot be served holds back those after it.
    pub(super) async fn serve(
        &mut self,
        myself: &ActorRef<RunMsg>,
    ) -> Result<(), ActorProcessingErr> {
        for _ in 0..self.pause.waiters.len() {
            let Some(front) = self.pause.waiters.pop_front() else {
                break;
            };
            match front {
                // It ended, or was stopped, while it waited.
                Waiter::Step(wait) if wait.reply.is_closed() => {}
                Waiter::Step(wait) => {
                    let among = self.pause.waiters.len() as u64 + 1;
                    let given = ractor::call!(self.account, |reply| AccountMsg::Extend {
                        child: wait.job,
                        at_least: wait.needs,
                        among,
                        reply
                    })?;
                    let Some(amount) = given else {
                        self.pause.waiters.push_front(Waiter::Step(wait));
                        break;
                    };
                    self.extended(wait, amount).await;
                }
                Waiter::Start(planned, needs) => {
                    let (tokens, usd) = self.available().await;
                    if tokens < needs.tokens || usd.is_some_and(|usd| usd < needs.usd_micros) {
                        self.pause.waiters.push_front(Waiter::Start(planned, needs));
                        break;
                    }
                    self.admit(myself, planned).await;
                }
            }
        }
        if self.pause.waiters.is_empty() && self.pause.open.is_some() {
            self.end_pause(myself, false);
        }
        Ok(())
    }

    /// The root holds `amount` more for the step: its grant grows by as
    /// much (a commit, which makes the root's extension durable with it),
    /// and it goes on. A step that ended meanwhile keeps nothing of it: its
    /// hold, extension and all, is released at its end.
    async fn extended(&mut self, wait: BudgetWait, amount: Amount) {
        let grown = ractor::call!(wait.account, |reply| AccountMsg::Grow {
            amount,
            with: vec![],
            reply
        });
        let grown = matches!(grown, Ok(Ok(_)));
        if grown && let Some(step) = self.steps.get_mut(&wait.job) {
            step.grant.tokens += amount.tokens;
            if let Some(usd) = &mut step.grant.usd_micros {
                *usd += amount.usd_micros;
            }
        }
        tracing::info!(run = %self.id, job = %wait.job, tokens = amount.tokens, usd_micros = amount.usd_micros, grown, "a paused step goes on");
        let _ = wait.reply.send(grown);
    }

    /// A waiter is told: `budget_reached`, durable before anyone acts on
    /// it. The first opens the pause: its deadline (one a restart kept, or
    /// `pause_timeout` from now) is armed, and the run's wall cap stops.
    async fn announce(
        &mut self,
        myself: &ActorRef<RunMsg>,
        id: Option<arbor_protocol::JobId>,
        needs: Amount,
    ) -> Result<(), ActorProcessingErr> {
        let now = crate::events::now_ms();
        let deadline_ms = match &self.pause.open {
            Some((deadline, _)) => *deadline,
            None => {
                let timeout = self
                    .spec
                    .pause
                    .unwrap_or(arbor_protocol::RunSpec::PAUSE_TIMEOUT);
                let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
                let deadline = self
                    .pause
                    .kept_deadline
                    .unwrap_or_else(|| now.saturating_add(timeout_ms));
                let wait = Duration::from_millis(deadline.saturating_sub(now));
                let timer = crate::timer::after(myself, wait, move || RunMsg::PauseExpired {
                    deadline_ms: deadline,
                });
                self.pause.open = Some((deadline, timer));
                self.stop_wall();
                deadline
            }
        };
        tracing::info!(run = %self.id, tokens = needs.tokens, usd_micros = needs.usd_micros, deadline_ms, "the run pauses at its ceiling");
        self.ctx.events.emit(
            self.id,
            EventKind::BudgetReached {
                id,
                needs,
                deadline_ms,
            },
        );
        self.ctx.journal.flush().await?;
        Ok(())
    }

    /// The pause is over: told, its deadline disarmed, the wall cap counting again.
    fn end_pause(&mut self, myself: &ActorRef<RunMsg>, expired: bool) {
        self.pause.open = None;
        self.ctx
            .events
            .emit(self.id, EventKind::BudgetPauseEnded { expired });
        self.start_wall(myself);
    }

    /// The pause's deadline passed without a top-up that served them: its
    /// waiters end as they would have without it.
    pub(super) fn pause_expired(&mut self, myself: &ActorRef<RunMsg>, deadline_ms: u64) {
        if self.pause.open.as_ref().map(|(d, _)| *d) != Some(deadline_ms) {
            return;
        }
        let mut unstarted = false;
        for waiter in std::mem::take(&mut self.pause.waiters) {
            match waiter {
                Waiter::Step(wait) => {
                    let _ = wait.reply.send(false);
                }
                Waiter::Start(..) => unstarted = true,
            }
        }
        self.pause.kept_deadline = None;
        self.end_pause(myself, true);
        // From here the run is as it would have been without the pause: at
        // its ceiling again, it ends.
        self.spec.pause = None;
        if unstarted && self.finish.is_none() {
            self.begin_finish(
                Status::Failed,
                Some(ErrorClass::BudgetExhausted),
                "its budget pause reached its deadline (pause_timeout) without a top-up, and its next steps could not start".into(),
            );
        }
    }

    /// The run's wall cap counts from now, for what is left of it (I-59).
    pub(super) fn start_wall(&mut self, myself: &ActorRef<RunMsg>) {
        let left = self.pause.wall_left.unwrap_or_else(|| self.wall_cap());
        self._wall = Some(crate::timer::after(myself, left, || RunMsg::TimedOut));
        self.pause.wall_since = Some(Instant::now());
    }

    /// The run's wall cap stops counting while it pauses.
    fn stop_wall(&mut self) {
        if let Some(since) = self.pause.wall_since.take() {
            let left = self.pause.wall_left.unwrap_or_else(|| self.wall_cap());
            self.pause.wall_left = Some(left.saturating_sub(since.elapsed()));
            self._wall = None;
        }
    }

    /// A run resumed in a pause whose steps could start after all (a
    /// top-up came before the crash): the pause is over, and said so.
    pub(super) fn resumed_pause_over(&mut self) {
        if self.pause.kept_deadline.is_some() && self.pause.waiters.is_empty() {
            self.pause.kept_deadline = None;
            self.ctx
                .events
                .emit(self.id, EventKind::BudgetPauseEnded { expired: false });
        }
    }

    /// Whether the run is paused: its wall cap is not counting.
    pub(super) fn paused(&self) -> bool {
        self.pause.open.is_some()
    }

    /// Steps that wait to start keep their group from being over.
    pub(super) fn waiting_to_start(&self) -> bool {
        self.pause
            .waiters
            .iter()
            .any(|w| matches!(w, Waiter::Start(..)))
    }
}
