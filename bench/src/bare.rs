//! The baselines' actors beside the testkit's `bare::Echo`: bare ractor,
//! nothing of arbor. Each is the least an actor of its kind can do, so a
//! baseline is what the actor library alone costs on this machine, in the
//! same process and run as arbor.

use arbor_tests::bare;
use arbor_tests::measure::Cpu;
use ractor::{Actor, ActorProcessingErr, ActorRef};

/// `actors` round trips (`arbor_tests::bare::round_trip`: spawn, call,
/// stop, exit), one after another. Returns the process CPU time of all of it.
pub async fn spawn_call_stop(actors: usize) -> Cpu {
    let before = Cpu::now();
    for _ in 0..actors {
        bare::round_trip().await;
    }
    Cpu::now().since(before)
}

/// A node of a bare tree: in `pre_start` it spawns its children, linked,
/// each with the rest of the levels. `levels[0]` children here, each with
/// `levels[1]` of their own, and so on; a node with no levels is a leaf.
/// Spawning returns once the whole subtree has started.
pub struct Branch;

impl Actor for Branch {
    type Msg = ();
    type State = ();
    type Arguments = Vec<usize>;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        levels: Vec<usize>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some((&children, below)) = levels.split_first() {
            for _ in 0..children {
                Actor::spawn_linked(None, Branch, below.to_vec(), myself.get_cell()).await?;
            }
        }
        Ok(())
    }
}

/// An actor that counts the casts it gets and says when it has had `target`.
pub struct Counter;

pub struct CounterArgs {
    pub target: u64,
    pub reached: tokio::sync::oneshot::Sender<()>,
}

pub struct CounterState {
    seen: u64,
    target: u64,
    reached: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Actor for Counter {
    type Msg = ();
    type State = CounterState;
    type Arguments = CounterArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: CounterArgs,
    ) -> Result<CounterState, ActorProcessingErr> {
        Ok(CounterState {
            seen: 0,
            target: args.target,
            reached: Some(args.reached),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        _message: (),
        state: &mut CounterState,
    ) -> Result<(), ActorProcessingErr> {
        state.seen += 1;
        if state.seen == state.target
            && let Some(reached) = state.reached.take()
        {
            let _ = reached.send(());
        }
        Ok(())
    }
}
