//! Bare ractor, nothing of arbor: the actor benchmarks set arbor beside.
//! `Echo` is the least an actor can be, an answer to one message; a round
//! trip spawns one, calls it once, stops it and waits for its exit.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

/// An actor that answers one message and does nothing else; idle until asked.
pub struct Echo;

pub enum EchoMsg {
    Ping(RpcReplyPort<()>),
}

impl Actor for Echo {
    type Msg = EchoMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match message {
            EchoMsg::Ping(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

/// Spawns an `Echo`, calls it once, stops it and waits for its exit.
pub async fn round_trip() {
    let (actor, exited) = Actor::spawn(None, Echo, ())
        .await
        .expect("the echo actor starts");
    ractor::call!(actor, EchoMsg::Ping).expect("the echo actor answers");
    actor.stop(None);
    exited.await.expect("the echo actor exits");
}
