//! A message sent to an actor after a delay, called off when dropped.
//!
//! ractor's `send_after` leaves its task asleep until the delay has passed,
//! whether or not the actor is still there: a job's hour-long wall timeout
//! kept a task alive for an hour after the job was stopped. A `Timer` is
//! kept in the state it belongs to, so it goes with that state.

use ractor::{ActorRef, Message};
use std::time::Duration;
use tokio::task::AbortHandle;

#[must_use = "a timer is called off when dropped"]
pub struct Timer(AbortHandle);

impl Drop for Timer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends `msg()` to `actor` after `delay`, unless the `Timer` is dropped first.
pub fn after<M, F>(actor: &ActorRef<M>, delay: Duration, msg: F) -> Timer
where
    M: Message,
    F: FnOnce() -> M + Send + 'static,
{
    Timer(actor.send_after(delay, msg).abort_handle())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::{Actor, ActorProcessingErr};
    use tokio::sync::mpsc;

    struct Echo;

    impl Actor for Echo {
        type Msg = u32;
        type State = mpsc::UnboundedSender<u32>;
        type Arguments = mpsc::UnboundedSender<u32>;

        async fn pre_start(
            &self,
            _: ActorRef<u32>,
            tx: Self::Arguments,
        ) -> Result<Self::State, ActorProcessingErr> {
            Ok(tx)
        }

        async fn handle(
            &self,
            _: ActorRef<u32>,
            msg: u32,
            tx: &mut Self::State,
        ) -> Result<(), ActorProcessingErr> {
            let _ = tx.send(msg);
            Ok(())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_timer_sends_nothing_and_leaves_no_task() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (actor, _) = Actor::spawn(None, Echo, tx).await.unwrap();
        let tasks = tokio::runtime::Handle::current().metrics();
        let before = tasks.num_alive_tasks();
        let kept = after(&actor, Duration::from_secs(3600), || 1);
        let dropped = after(&actor, Duration::from_secs(60), || 2);
        assert_eq!(tasks.num_alive_tasks(), before + 2);
        drop(dropped);
        tokio::time::sleep(Duration::from_secs(3601)).await;
        assert_eq!(rx.recv().await, Some(1), "the kept timer fires");
        assert!(rx.try_recv().is_err(), "the dropped one never does");
        drop(kept);
        assert_eq!(tasks.num_alive_tasks(), before, "no timer task is left");
        actor.stop(None);
    }
}
