//! Engine kind `openai`: any OpenAI-compatible HTTP server, in two or more configurations.
//!
//! This is the protocol the bugs parity exists for were found with by hand: start the
//! server in its default configuration and again with another KV/batching configuration
//! forced, send the same prompts (alone, two at once, N concurrently), a fresh server per
//! run, and compare greedy outputs. A server cannot be stepped, so it sits behind a small
//! request-level interface of its own, [`RequestPath`]: send a schedule of completion
//! requests, each when its condition holds, and get back what the API returned (greedy tokens
//! and top-k logprobs per step). The request-level scenarios (`crate::scenario::requests`)
//! are written against it.
//!
//! - [`server`]: one server process on a free loopback port, ready-polled, logged, killed.
//! - [`client`]: one completion request and its answer (server quirks handled there).
//! - `exec`: sending a schedule, a thread per request waiting for its condition.

mod client;
mod exec;
mod server;

use std::path::PathBuf;

pub use client::{Completion, RequestError};

use super::Dirs;
use crate::checkpoint::Tokenizer;
use crate::vocab::OpenaiSpec;

/// When a request of a schedule is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Now,
    /// Once request `of` has streamed this many tokens (or ended).
    AfterTokens {
        of: usize,
        tokens: usize,
    },
    /// Once request `of` has ended.
    AfterDone {
        of: usize,
    },
}

/// One completion request of a schedule: greedy, `max_tokens` long, sent `when` it says.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    pub when: When,
    /// Streamed (the clock later arrivals wait on).
    pub stream: bool,
}

/// When one request of a schedule was sent, streamed its first token (streamed requests: it
/// is visibly under way from then to its last) and was answered, in seconds since the
/// schedule began: parity's own evidence of whether a server ran requests together. Kept
/// whether or not the answer could be read: the pacer of a schedule whose streams carry no
/// logprobs is never measured, but its stream is what the others overlap with.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sent {
    pub at: f64,
    pub first_token: Option<f64>,
    pub answered: f64,
}

/// One request's answer (or why it could not be read) and its [`Sent`].
#[derive(Debug, Clone)]
pub struct Reply {
    pub result: Result<Completion, RequestError>,
    pub sent: Sent,
}

/// A path of a request-level engine: a server that answers whole completion requests.
pub trait RequestPath {
    /// Send every request of a schedule as its `when` says; the answers in request order. A
    /// request that fails still counts as ended, so nothing waits forever on it.
    fn send(&mut self, requests: &[CompletionRequest]) -> Vec<Reply>;

    /// After a failed request: how the server ended (its exit and log tail), if it did,
    /// giving a dying server a moment to be seen dead. `None` while it runs.
    fn ended_after_failure(&mut self) -> Option<String>;

    /// The server's Prometheus counters now, each summed over its label sets; `None` when the
    /// suite names no metrics endpoint.
    fn metrics(&mut self) -> Option<Result<Metrics, String>> {
        None
    }
}

/// Prometheus samples by metric name, each summed over its label sets.
pub type Metrics = std::collections::BTreeMap<String, f64>;

/// One path of an openai engine: its server, started (or reached at the suite's `url`) and
/// ready, and what every request to it carries.
pub struct ServerPath<'a> {
    server: server::Server,
    client: client::Client<'a>,
}

impl<'a> ServerPath<'a> {
    /// Start `path`'s server, its output appended to `log`, and wait until it is ready; or
    /// say why not (how it ended and the tail of its log).
    pub fn start(
        spec: &'a OpenaiSpec,
        path: &str,
        dirs: Dirs,
        log: Option<PathBuf>,
        tokenizer: &'a Tokenizer,
    ) -> Result<Self, String> {
        let p = spec.paths.iter().find(|p| p.name == path).ok_or_else(|| format!("no path `{path}`"))?;
        let server = server::Server::start(spec, p, dirs, log)?;
        let client =
            client::Client { agent: server::agent(spec.timeout), base: server.base.clone(), spec, path: p, tokenizer };
        Ok(ServerPath { server, client })
    }

    /// Seconds since the start command ran (its start-up time, called right after `start`).
    pub fn age(&self) -> f64 {
        self.server.age()
    }

    /// Kill the server's process group now (also done on drop).
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

impl RequestPath for ServerPath<'_> {
    fn send(&mut self, requests: &[CompletionRequest]) -> Vec<Reply> {
        exec::run(&self.client, requests)
    }

    fn ended_after_failure(&mut self) -> Option<String> {
        self.server.ended_after_failure()
    }

    fn metrics(&mut self) -> Option<Result<Metrics, String>> {
        let at = self.client.spec.metrics.as_deref()?;
        Some(self.client.metrics(at))
    }
}
