//! Engine kind `openai`: any OpenAI-compatible HTTP server, in two or more configurations.
//!
//! This is the protocol the bugs parity exists for were found with by hand: start the
//! server in its default configuration and again with another KV/batching configuration
//! forced, send the same prompts (alone, two at once, N concurrently), a fresh server per
//! run, and compare greedy outputs. A server cannot be stepped, so this kind runs the
//! request-level scenarios ([`plan`]) and compares what the API returns — greedy tokens and
//! top-k logprobs per step ([`crate::compare::compare_logprobs`]) — into the same rows,
//! verdicts, snapshots and reports as every other engine.
//!
//! - [`spec`]: the suite's `[engine]` table (server command or loopback `url`, paths with
//!   extra arguments and request fields).
//! - [`server`]: one server process on a free loopback port, ready-polled, logged, killed.
//! - [`client`]: one completion request and its answer (server quirks handled there).
//! - [`plan`] / [`exec`]: what each scenario sends and when; sending it.
//! - [`run`] / [`rows`]: references, a fresh server per scenario x path, rows.

pub mod client;
pub mod exec;
pub mod plan;
pub mod rows;
pub mod run;
pub mod server;
pub mod spec;

pub(crate) use run::run_checkpoint;

use crate::checkpoint::{ModelConfig, Tokenizer};
use crate::suite::{CheckpointSpec, Suite};

/// One checkpoint of a suite on an openai engine, with parity's own tokenizer of it (prompts
/// are encoded, counted and decoded with it).
pub struct Checkpoint<'a> {
    pub suite: &'a Suite,
    pub spec: &'a CheckpointSpec,
    pub openai: &'a spec::OpenaiSpec,
    pub dir: &'a std::path::Path,
    pub tokenizer: &'a Tokenizer,
    pub config: &'a ModelConfig,
}
