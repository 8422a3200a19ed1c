//! A typed client of arbord's API (feature `client`): what the `arbor` CLI,
//! the testkit's `TestService`, the soak and the benches speak, so each
//! route's path, its bearer token, its error shape and its event stream are
//! written once, beside the types the routes serve.
//!
//! Invariants:
//! 1. Every request carries the token, when the client has one; no error
//!    message quotes it.
//! 2. A failure says what a caller needs to act on it: arbord unreachable,
//!    a URL that is not one, a refusal (its HTTP status and arbord's own
//!    message), a reply that is not what the route serves, an event stream
//!    that broke (the caller may resume from the last id).

use crate::api::{
    ApprovalList, AuditList, AuditQuery, BackfillBody, BackfillResult, CardView, Continued,
    CredentialList, CredentialMade, CredentialView, DecisionBody, Deployment, DrainAsked,
    NewCredential, ReplayRun, ReplayStarted, RollbackBody, RunCreated, RunDocument, RunList,
    ScheduleList, ScheduleView, SteerQueued, StopAccepted, StreamEvent, SubmitRun, VersionList,
};
use crate::status::NodeStatus;
use arbor_protocol::RunId;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::time::Duration;

pub use reqwest::Method;

/// Why a call did not give what its route serves.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0:?} is not a URL, e.g. http://127.0.0.1:7878")]
    BadUrl(String),
    #[error("cannot reach arbord at {url}: {cause}")]
    Unreachable { url: String, cause: String },
    /// arbord answered with an error status; `message` is its `error.message`
    /// (or the body, when it is not arbord's error shape).
    #[error("{message}")]
    Refused { status: u16, message: String },
    #[error("a reply that is not what the route serves: {0}")]
    BadReply(String),
    /// An event stream that broke off mid-message (a restart, a dropped reader).
    #[error("the event stream broke: {0}")]
    Broken(String),
}

impl Error {
    /// The HTTP status of a refusal.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// One arbord, at `base`, with its token.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    /// `base` is arbord's address (`http://127.0.0.1:7878`); a trailing `/` is dropped.
    pub fn new(base: &str, token: Option<String>) -> Result<Self, Error> {
        let base = base.trim_end_matches('/').to_string();
        match reqwest::Url::parse(&base) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.has_host() => {}
            _ => return Err(Error::BadUrl(base)),
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| Error::BadUrl(format!("{base}: {e}")))?;
        Ok(Self { http, base, token })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// A request to `path` with the token: for what the typed calls do not
    /// cover (a test of headers, a method a route does not allow).
    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// The same connection pool, without the token (a test of what arbord
    /// does for a caller that has none).
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Sends; an error status is a `Refused` with arbord's message.
    pub async fn send(&self, request: reqwest::RequestBuilder) -> Result<reqwest::Response, Error> {
        let response = request.send().await.map_err(|e| self.unreachable(&e))?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        Err(Error::Refused {
            status: status.as_u16(),
            message,
        })
    }

    async fn call<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, Error> {
        let response = self.send(request).await?;
        let bytes = response.bytes().await.map_err(|e| self.unreachable(&e))?;
        serde_json::from_slice(&bytes).map_err(|e| Error::BadReply(e.to_string()))
    }

    fn unreachable(&self, e: &reqwest::Error) -> Error {
        let mut cause: &dyn std::error::Error = e;
        while let Some(next) = cause.source() {
            cause = next;
        }
        Error::Unreachable {
            url: self.base.clone(),
            cause: cause.to_string(),
        }
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<NodeStatus, Error> {
        self.call(self.request(Method::GET, "/v1/status")).await
    }

    /// `GET /v1/limits`: what the node throttles.
    pub async fn limits(&self) -> Result<crate::api::Limits, Error> {
        self.call(self.request(Method::GET, "/v1/limits")).await
    }

    /// `GET /v1/runs`: one page, newest first. `status` is passed as given
    /// (arbord says what it accepts).
    pub async fn runs(
        &self,
        status: Option<&str>,
        limit: u32,
        after: Option<RunId>,
    ) -> Result<RunList, Error> {
        let mut query = vec![("limit", limit.to_string())];
        query.extend(status.map(|s| ("status", s.to_string())));
        query.extend(after.map(|a| ("after", a.to_string())));
        self.call(self.request(Method::GET, "/v1/runs").query(&query))
            .await
    }

    /// `GET /v1/runs/{id}`.
    pub async fn run(&self, run: RunId) -> Result<RunDocument, Error> {
        self.call(self.request(Method::GET, &format!("/v1/runs/{run}")))
            .await
    }

    /// `POST /v1/runs`; the same `idempotency_key` gives the same run.
    pub async fn submit(
        &self,
        run: &SubmitRun,
        idempotency_key: Option<&str>,
    ) -> Result<RunCreated, Error> {
        let mut request = self.request(Method::POST, "/v1/runs").json(run);
        if let Some(key) = idempotency_key {
            request = request.header("Idempotency-Key", key);
        }
        self.call(request).await
    }

    /// `POST /v1/runs/{id}/replay` (not a dry run: that answers a plan,
    /// read with `post_json`).
    pub async fn replay(&self, run: &str, body: &ReplayRun) -> Result<ReplayStarted, Error> {
        self.call(
            self.request(Method::POST, &format!("/v1/runs/{run}/replay"))
                .json(body),
        )
        .await
    }

    /// `POST /v1/runs/{id}/stop`.
    pub async fn stop_run(&self, run: &str) -> Result<StopAccepted, Error> {
        self.call(self.request(Method::POST, &format!("/v1/runs/{run}/stop")))
            .await
    }

    /// `POST /v1/runs/{id}/budget`: a top-up.
    pub async fn top_up(
        &self,
        run: &str,
        body: &crate::api::TopUpBody,
    ) -> Result<crate::api::ToppedUp, Error> {
        self.call(
            self.request(Method::POST, &format!("/v1/runs/{run}/budget"))
                .json(body),
        )
        .await
    }

    /// `POST /v1/jobs/{id}/stop`.
    pub async fn stop_job(&self, job: &str) -> Result<StopAccepted, Error> {
        self.call(self.request(Method::POST, &format!("/v1/jobs/{job}/stop")))
            .await
    }

    /// `POST /v1/workspace/reload`.
    pub async fn reload(&self) -> Result<Deployment, Error> {
        self.call(self.request(Method::POST, "/v1/workspace/reload"))
            .await
    }

    /// `GET /v1/workspace/versions`.
    pub async fn versions(&self) -> Result<VersionList, Error> {
        self.call(self.request(Method::GET, "/v1/workspace/versions"))
            .await
    }

    /// `POST /v1/workspace/rollback`.
    pub async fn rollback(&self, version: &str) -> Result<Deployment, Error> {
        let body = RollbackBody {
            version: version.to_string(),
        };
        self.call(
            self.request(Method::POST, "/v1/workspace/rollback")
                .json(&body),
        )
        .await
    }

    /// `GET /v1/schedules`.
    pub async fn schedules(&self) -> Result<ScheduleList, Error> {
        self.call(self.request(Method::GET, "/v1/schedules")).await
    }

    /// `POST /v1/schedules/{name}/pause` or `.../unpause`.
    pub async fn pause_schedule(&self, name: &str, pause: bool) -> Result<ScheduleView, Error> {
        let verb = if pause { "pause" } else { "unpause" };
        let path = format!("/v1/schedules/{}/{verb}", urlencoding_free(name));
        self.call(self.request(Method::POST, &path)).await
    }

    /// `POST /v1/schedules/{name}/trigger`.
    pub async fn trigger_schedule(&self, name: &str) -> Result<RunCreated, Error> {
        let path = format!("/v1/schedules/{}/trigger", urlencoding_free(name));
        self.call(self.request(Method::POST, &path)).await
    }

    /// `POST /v1/schedules/{name}/backfill`.
    pub async fn backfill_schedule(
        &self,
        name: &str,
        body: &BackfillBody,
    ) -> Result<BackfillResult, Error> {
        let path = format!("/v1/schedules/{}/backfill", urlencoding_free(name));
        self.call(self.request(Method::POST, &path).json(body))
            .await
    }

    /// `POST /v1/nodes/{id}/drain`.
    pub async fn drain_node(&self, node: &str) -> Result<DrainAsked, Error> {
        let path = format!("/v1/nodes/{}/drain", urlencoding_free(node));
        self.call(self.request(Method::POST, &path)).await
    }

    /// `POST /v1/jobs/{id}/messages`.
    pub async fn steer(&self, job: &str, text: &str) -> Result<SteerQueued, Error> {
        let body = serde_json::json!({ "text": text });
        self.call(
            self.request(Method::POST, &format!("/v1/jobs/{job}/messages"))
                .json(&body),
        )
        .await
    }

    /// `POST /v1/jobs/{id}/continue`.
    pub async fn continue_job(&self, job: &str) -> Result<Continued, Error> {
        self.call(self.request(Method::POST, &format!("/v1/jobs/{job}/continue")))
            .await
    }

    /// `GET /v1/approvals`: of one run or all, in one state or any (passed
    /// as given: arbord says what it accepts).
    pub async fn approvals(
        &self,
        run: Option<&str>,
        state: Option<&str>,
    ) -> Result<ApprovalList, Error> {
        let mut query = vec![];
        query.extend(run.map(|r| ("run", r.to_string())));
        query.extend(state.map(|s| ("state", s.to_string())));
        self.call(self.request(Method::GET, "/v1/approvals").query(&query))
            .await
    }

    /// `GET /v1/tokens`.
    pub async fn tokens(&self) -> Result<CredentialList, Error> {
        self.call(self.request(Method::GET, "/v1/tokens")).await
    }

    /// `POST /v1/tokens`.
    pub async fn add_token(&self, new: &NewCredential) -> Result<CredentialMade, Error> {
        self.call(self.request(Method::POST, "/v1/tokens").json(new))
            .await
    }

    /// `DELETE /v1/tokens/{name}`.
    pub async fn revoke_token(&self, name: &str) -> Result<CredentialView, Error> {
        self.call(self.request(Method::DELETE, &format!("/v1/tokens/{name}")))
            .await
    }

    /// `GET /v1/audit`: one page.
    pub async fn audit(&self, query: &AuditQuery) -> Result<AuditList, Error> {
        self.call(self.request(Method::GET, "/v1/audit").query(query))
            .await
    }

    /// `POST /v1/approvals/{id}`.
    pub async fn decide(&self, card: &str, body: &DecisionBody) -> Result<CardView, Error> {
        self.call(
            self.request(Method::POST, &format!("/v1/approvals/{card}"))
                .json(body),
        )
        .await
    }

    /// `GET path`: the status and the body as JSON, whatever the status
    /// (for callers that check what arbord refuses, and how).
    pub async fn get_json(&self, path: &str) -> Result<(u16, Value), Error> {
        self.json_of(self.request(Method::GET, path)).await
    }

    /// `POST path` with `body` as JSON: the status and the reply as JSON.
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<(u16, Value), Error> {
        self.json_of(self.request(Method::POST, path).json(body))
            .await
    }

    async fn json_of(&self, request: reqwest::RequestBuilder) -> Result<(u16, Value), Error> {
        let response = request.send().await.map_err(|e| self.unreachable(&e))?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.map_err(|e| self.unreachable(&e))?;
        let body = serde_json::from_slice(&bytes).map_err(|_| {
            Error::BadReply(format!(
                "a {status} whose body is not JSON: {:?}",
                String::from_utf8_lossy(&bytes)
            ))
        })?;
        Ok((status, body))
    }

    /// `GET /v1/runs/{id}/events`: the run's events after `after` (its
    /// `Last-Event-ID`), following until the run ends unless `follow` is false.
    pub async fn events(
        &self,
        run: RunId,
        follow: bool,
        after: Option<u64>,
    ) -> Result<Events, Error> {
        let mut request = self
            .request(Method::GET, &format!("/v1/runs/{run}/events"))
            .query(&[("follow", follow)]);
        if let Some(after) = after {
            request = request.header("Last-Event-ID", after.to_string());
        }
        let response = self.send(request).await?;
        Ok(Events {
            stream: eventsource_stream::EventStream::new(response.bytes_stream()).boxed(),
        })
    }
}

/// A run's event stream: each SSE message's `id:` and `data:`.
pub struct Events {
    stream: BoxStream<
        'static,
        Result<eventsource_stream::Event, eventsource_stream::EventStreamError<reqwest::Error>>,
    >,
}

impl Events {
    /// The next event's id and data as JSON; None when the stream ends.
    pub async fn next_json(&mut self) -> Option<Result<(u64, Value), Error>> {
        let message = match self.stream.next().await? {
            Ok(message) => message,
            Err(e) => return Some(Err(Error::Broken(e.to_string()))),
        };
        let parsed = message
            .id
            .parse::<u64>()
            .ok()
            .zip(serde_json::from_str(&message.data).ok());
        Some(
            parsed.ok_or_else(|| {
                Error::BadReply(format!("event {:?}: not an arbor event", message.id))
            }),
        )
    }

    /// The next event, typed.
    pub async fn next(&mut self) -> Option<Result<StreamEvent, Error>> {
        let (id, data) = match self.next_json().await? {
            Ok(event) => event,
            Err(e) => return Some(Err(e)),
        };
        Some(
            serde_json::from_value(data)
                .map_err(|e| Error::BadReply(format!("event {id}: not an arbor event: {e}"))),
        )
    }
}

/// A node id in a path: its characters are letters, digits, `.`, `_` and
/// `-` (what arbor accepts as one), so anything else is escaped byte by
/// byte rather than reach the path as it is.
fn urlencoding_free(id: &str) -> String {
    id.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' => (b as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}
