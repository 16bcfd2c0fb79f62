//! What a row shows its path did. A row that passes says "this path agrees with the
//! reference"; that is worth nothing if the path never did what the case exists to test: a
//! "batched" forward run row by row, a prefix recomputed instead of shared, a paged kernel that
//! only runs above 4096 rows, a server that answers two requests one after the other, a prompt
//! cache that never hits. Each case therefore states its claims, and the row carries the
//! evidence for each: from parity's own driving, the engine's replies, and what the engine
//! counts about itself (`kv::Counters`). A claim the evidence contradicts makes the row
//! `vacuous`, not a pass.
//!
//! Memory is held to the same standard: right tokens from a pool that holds more blocks than
//! its sequences need, or stores KV at twice the bytes its layout declares (Int8 kept as Fp16),
//! fail the row with the numbers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One claim of a case and what was seen for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// `batched`, `trimmed`, `shared`, `chunked`, `crosses-blocks`, `non-adjacent`,
    /// `blocks-held`, `row-bytes`, `overlapped`, `cached`, `metric:NAME`.
    pub claim: String,
    /// What the case needs the path to have done, in words.
    pub wanted: String,
    /// What the evidence says it did.
    pub seen: String,
    pub status: Status,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// The evidence shows the claim.
    Held,
    /// The evidence contradicts the claim: the row is `vacuous` (a memory claim: it fails).
    Missing,
    /// Nothing reports on the claim (the path keeps no such counter); `vacuous` only where
    /// the suite requires the evidence ([`Witness::require`]).
    Unreported,
    /// The suite waived the claim for this path, with its reason in `seen`.
    Waived,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Held => "held",
            Status::Missing => "missing",
            Status::Unreported => "unreported",
            Status::Waived => "waived",
        }
    }
}

/// Claims that are about memory: a missing one is a violation (the row fails with the
/// numbers), not a case that tested nothing.
pub const MEMORY_CLAIMS: [&str; 2] = ["blocks-held", "row-bytes"];

/// What a suite says one path must show (`[engine.witness.PATH]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Witness {
    /// Claims this path is known not to show, each with the suite's reason: recorded on the
    /// row as `waived`, never judged.
    pub waive: BTreeMap<String, String>,
    /// Evidence the path must report: `counters` (an unreported counter-backed claim is then
    /// missing), `cached-tokens` (a server's `cached` claim), `stats` (memory claims).
    pub require: Vec<String>,
    /// Prometheus counters (kind = "openai", scraped from the engine's `metrics` endpoint
    /// before and after each case) that must increase during every case on this path, and
    /// those that must not change.
    pub moves: Vec<String>,
    pub still: Vec<String>,
}

/// Claims a suite may waive, and evidence it may require (the parser checks names against
/// these).
pub const CLAIMS: [&str; 11] = [
    "batched",
    "trimmed",
    "shared",
    "chunked",
    "crosses-blocks",
    "non-adjacent",
    "blocks-held",
    "row-bytes",
    "overlapped",
    "cached",
    "metrics",
];
pub const REQUIREMENTS: [&str; 3] = ["counters", "cached-tokens", "stats"];
