//! The scenarios a suite can name and the settings they run with: plain data, shared by the
//! suite parser, the scenarios that run them on an engine, and the reports that record them.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    Single,
    Batch2,
    Concurrent,
    Padded,
    Chunked,
    Rollback,
    Prefix,
    /// Request level only (kind = "openai"): prompt lengths across tile/block boundaries.
    Lengths,
    /// On a server (kind = "openai"), the same request twice, uncached then cached; on a
    /// stepped engine, named by a suite only, the concurrent schedule twice, the second run held
    /// to the first bit for bit.
    Repeat,
    /// The suite's pinned scripts (`[[scripts]]`), one case each: reproducers `parity explore`
    /// found, kept as rows of every run.
    Script,
    /// Random schedules, shrunk to a minimal script when one fails: `parity explore` only,
    /// never a suite's.
    Explore,
    /// A lossy path's next-token distributions over a corpus read teacher-forced, against the
    /// reference's: judged by bounds on the distribution (KL, top-1 agreement, ...), not step
    /// by step. Named by a suite, never run by default.
    Corpus,
}

/// What an engine that is stepped runs (kind = "builtin" or "process"), and its default.
pub const STEP_LEVEL: &[Scenario] = &[
    Scenario::Single,
    Scenario::Batch2,
    Scenario::Concurrent,
    Scenario::Padded,
    Scenario::Chunked,
    Scenario::Rollback,
    Scenario::Prefix,
];

/// What an engine that can only be sent whole requests runs (kind = "openai"), and its default.
pub const REQUEST_LEVEL: &[Scenario] =
    &[Scenario::Single, Scenario::Batch2, Scenario::Concurrent, Scenario::Lengths, Scenario::Prefix, Scenario::Repeat];

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Single => "single",
            Scenario::Batch2 => "batch2",
            Scenario::Concurrent => "concurrent",
            Scenario::Padded => "padded",
            Scenario::Chunked => "chunked",
            Scenario::Rollback => "rollback",
            Scenario::Prefix => "prefix",
            Scenario::Lengths => "lengths",
            Scenario::Repeat => "repeat",
            Scenario::Script => "script",
            Scenario::Explore => "explore",
            Scenario::Corpus => "corpus",
        }
    }

    /// A scenario a suite may name (`explore` is not one: it runs from `parity explore`).
    pub fn parse(s: &str) -> Option<Scenario> {
        STEP_LEVEL
            .iter()
            .chain(REQUEST_LEVEL)
            .chain(&[Scenario::Script, Scenario::Corpus])
            .copied()
            .find(|x| x.name() == s)
    }

    /// Every scenario name a suite may write, for error messages.
    pub fn known_names() -> Vec<&'static str> {
        let mut names: Vec<&str> = STEP_LEVEL.iter().map(|s| s.name()).collect();
        let more: Vec<&str> = REQUEST_LEVEL.iter().map(|s| s.name()).filter(|n| !names.contains(n)).collect();
        names.extend(more);
        names.push(Scenario::Script.name());
        names.push(Scenario::Corpus.name());
        names
    }
}

/// Scenario settings, from the suite (with these defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    /// Greedy steps per path (the reference's length).
    pub max_tokens: usize,
    /// Rows per KV block (paged backend).
    pub block_size: usize,
    /// Padded prefill pads prompts to a multiple of this many rows.
    pub tile: usize,
    /// Chunked prefill chunk size.
    pub chunk: usize,
    /// Rollback: draft tokens decoded then trimmed, as speculative decoding does on rejection.
    pub lookahead: usize,
    /// Rollback: roll back after every this many decode steps.
    pub rollback_every: usize,
    pub concurrent: ConcurrentSettings,
    /// Poison freed and trimmed paged rows with NaN (see `kv::paged`).
    pub poison: bool,
    /// Paged pool budget in blocks (none: grow as needed).
    pub pool_blocks: Option<usize>,
    /// `lengths` (kind = "openai"): prompt lengths to send; default the boundaries of `tile`,
    /// `block_size` and `chunk` (each minus one, exact, plus one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lengths: Option<Vec<usize>>,
    /// `corpus`: positions read per prompt, teacher-forced one token at a time (each prompt's
    /// first `corpus_tokens + 1` tokens: the last is only a target).
    pub corpus_tokens: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_tokens: 16,
            block_size: 32,
            tile: 32,
            chunk: 5,
            lookahead: 4,
            rollback_every: 5,
            concurrent: ConcurrentSettings::default(),
            poison: true,
            pool_blocks: None,
            lengths: None,
            corpus_tokens: 512,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConcurrentSettings {
    /// Number of requests (prompts are taken round-robin from the suite's prompts).
    pub requests: usize,
    /// Decode step at which each request arrives (cycled if shorter than `requests`).
    pub arrivals: Vec<usize>,
    /// Most rows decoded together; later arrivals wait for a finished row's slot.
    pub max_batch: usize,
}

impl Default for ConcurrentSettings {
    fn default() -> Self {
        ConcurrentSettings { requests: 5, arrivals: vec![0, 0, 2, 3, 6], max_batch: 3 }
    }
}

/// One request of the `concurrent` schedule: when it arrives and how many steps it decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// The decode step it arrives at (at request level: how many tokens the clock request has
    /// streamed).
    pub at: usize,
    pub steps: usize,
}

impl ConcurrentSettings {
    /// Every request of the schedule, in request order. Arrivals cycle through `arrivals`;
    /// lengths are staggered (full, a quarter shorter, half shorter, again) so that requests
    /// leave the batch at different steps as well as join at different ones. The step-level
    /// scenario, the request-level one and the settings audit all read the schedule from here.
    pub fn schedule(&self, max_tokens: usize) -> Vec<Arrival> {
        if self.arrivals.is_empty() {
            return Vec::new();
        }
        (0..self.requests)
            .map(|j| Arrival {
                at: self.arrivals[j % self.arrivals.len()],
                steps: max_tokens.saturating_sub((j % 3) * (max_tokens / 4)).max(1),
            })
            .collect()
    }
}
