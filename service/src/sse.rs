//! `GET /v1/runs/{id}/events`: a run's events as Server-Sent Events.
//!
//! Each message's `id:` is the event's place in the run (1, 2, 3, ...), so a
//! client that reconnects with `Last-Event-ID: N` gets event N+1 onwards and
//! misses nothing. The stream ends after the run's `run_finished`.
//!
//! Invariant: a client's buffer is bounded (`sse_buffer`). A client that
//! leaves it full for `sse_stall` is dropped, never buffered without bound;
//! it may reconnect from where it was. The node's broadcast is bounded too:
//! a producer that lags behind it reads the rest from the journal, where
//! every event is before it is broadcast.
//!
//! On a shared journal the run may be another node's, whose events never
//! reach this node's broadcast: the producer reads the journal again every
//! `SHARED_REREAD` as well.

use crate::api::StreamEvent;
use arbor_actors::EventBus;
use arbor_protocol::{Event, EventKind, JobId, RunId};
use arbor_storage::Journal;
use axum::response::sse;
use futures::Stream;
use std::convert::Infallible;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

/// How often a stream on a shared journal reads the run's events again.
pub const SHARED_REREAD: Duration = Duration::from_millis(250);

pub struct Source {
    pub bus: EventBus,
    pub journal: Journal,
    pub run: RunId,
    /// Events up to this index were seen already (`Last-Event-ID`).
    pub after: u64,
    /// False: the events so far, then the end.
    pub follow: bool,
    /// Only this step's or job's events, and the run's end.
    pub job: Option<JobId>,
    pub buffer: usize,
    pub stall: Duration,
    /// Read the journal again this often (a shared journal's).
    pub reread: Option<Duration>,
    pub shutdown: CancellationToken,
    /// Where the producer task is tracked (the service waits for it on a drain).
    pub tasks: tokio_util::task::TaskTracker,
}

/// The stream an SSE response sends; its producer is a task of its own.
pub fn stream(source: Source) -> impl Stream<Item = Result<sse::Event, Infallible>> {
    let (tx, rx) = mpsc::channel(source.buffer);
    let tasks = source.tasks.clone();
    tasks.spawn(produce(source, tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (Ok(event), rx))
    })
}

fn message(index: u64, event: Event) -> sse::Event {
    let data = serde_json::to_string(&StreamEvent { index, event }).unwrap_or_default();
    sse::Event::default().id(index.to_string()).data(data)
}

/// Sends from the journal, then live; on lag, from the journal again.
async fn produce(source: Source, tx: mpsc::Sender<sse::Event>) {
    let mut live = source.bus.subscribe_run(source.run);
    let mut index = 0u64;
    let mut last_seq = 0u64;
    loop {
        let history = match source.journal.events(source.run) {
            Ok(history) => history,
            Err(error) => {
                tracing::warn!(%error, "an event stream could not read the journal");
                return;
            }
        };
        let fresh: Vec<Event> = history.into_iter().filter(|e| e.seq > last_seq).collect();
        for event in fresh {
            match forward(&source, &tx, &mut index, &mut last_seq, event).await {
                Next::Go => {}
                Next::End => return,
            }
        }
        if !source.follow {
            return;
        }
        let reread = async {
            match source.reread {
                Some(every) => tokio::time::sleep(every).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(reread);
        loop {
            let got = tokio::select! {
                _ = source.shutdown.cancelled() => return,
                _ = tx.closed() => return,
                _ = &mut reread => break,
                got = live.recv() => got,
            };
            match got {
                Ok(event) if event.run == source.run && event.seq > last_seq => {
                    let event = std::sync::Arc::unwrap_or_clone(event);
                    match forward(&source, &tx, &mut index, &mut last_seq, event).await {
                        Next::Go => {}
                        Next::End => return,
                    }
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => break,
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    }
}

enum Next {
    Go,
    End,
}

async fn forward(
    source: &Source,
    tx: &mpsc::Sender<sse::Event>,
    index: &mut u64,
    last_seq: &mut u64,
    event: Event,
) -> Next {
    *index += 1;
    *last_seq = event.seq;
    let end = matches!(event.kind, EventKind::RunFinished { .. });
    let wanted = end || source.job.is_none_or(|job| event.kind.job() == Some(job));
    if *index > source.after && wanted {
        let sent = tokio::select! {
            sent = tx.send_timeout(message(*index, event), source.stall) => sent,
            _ = source.shutdown.cancelled() => return Next::End,
        };
        match sent {
            Ok(()) => {}
            Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
                tracing::info!(run = %source.run, index = *index, "dropped a slow event-stream client");
                return Next::End;
            }
            Err(mpsc::error::SendTimeoutError::Closed(_)) => return Next::End,
        }
    }
    if end { Next::End } else { Next::Go }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn source(bus: &EventBus, journal: &Journal, run: RunId) -> Source {
        Source {
            bus: bus.clone(),
            journal: journal.clone(),
            run,
            after: 0,
            follow: true,
            job: None,
            buffer: 1,
            stall: Duration::from_millis(200),
            reread: None,
            shutdown: CancellationToken::new(),
            tasks: tokio_util::task::TaskTracker::new(),
        }
    }

    fn emit_three(bus: &EventBus, run: RunId) {
        for _ in 0..3 {
            bus.emit(
                run,
                EventKind::JobRunning {
                    id: arbor_protocol::JobId::new(),
                },
            );
        }
    }

    /// A client that reads nothing while its buffer (1 event) is full for
    /// longer than the stall is dropped: it gets what was buffered, then the
    /// end, not every event held for it without bound.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_stalls_is_dropped_not_buffered_without_bound() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let bus = EventBus::new(journal.clone());
        let run = RunId::new();
        let stream = stream(source(&bus, &journal, run));
        emit_three(&bus, run);
        // The client stalls well past the stall limit before it reads.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let got: Vec<_> = tokio::time::timeout(Duration::from_secs(30), stream.collect())
            .await
            .expect("the stalled client was dropped, so its stream ended");
        assert_eq!(got.len(), 1, "only what fit in its buffer");
    }

    /// The same events, read as they come: every one arrives.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_keeps_up_gets_every_event() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let bus = EventBus::new(journal.clone());
        let run = RunId::new();
        let mut stream = Box::pin(stream(source(&bus, &journal, run)));
        let mut got = 0;
        emit_three(&bus, run);
        while got < 3 {
            let _ = stream.next().await.expect("an event");
            got += 1;
        }
        bus.emit(
            run,
            EventKind::RunFinished {
                limitations: Vec::new(),
                status: arbor_protocol::Status::Done,
                error_class: None,
                reason: None,
                output: serde_json::Value::Null,
            },
        );
        assert!(stream.next().await.is_some(), "the end event");
        assert!(stream.next().await.is_none(), "and then the end");
    }
}
