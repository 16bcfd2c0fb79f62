//! Decode scenarios: the ways an engine batches, pads, chunks, trims and shares sequences.
//! Each scenario is a small module that builds a plan and runs it on one path through the
//! engine interface ([`Session`]); adding one never touches an engine.
//!
//! Every path is teacher-forced with its prompt's reference tokens (the dense single-sequence
//! unpadded run): at each step the path's own greedy choice and its full logits row are
//! recorded, and the reference token is fed next. The first divergence is therefore the first
//! step where the path would have chosen differently, and after it the metrics keep measuring
//! the same computation, so a tie at step 5 cannot hide a RoPE bug at step 20.

pub mod batch2;
pub mod chunked;
pub mod concurrent;
pub mod padded;
pub mod prefix;
pub mod rollback;
pub mod single;

use std::collections::HashMap;

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use crate::engine::{self, EnginePath, PathInfo, Session, Trace};
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::kv::{KvStats, SeqId};
use crate::model::RowStep;

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
    /// Request level only (kind = "openai"): the same request twice, uncached then cached.
    Repeat,
}

pub const ALL: &[Scenario] = &[
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
        }
    }

    pub fn parse(s: &str) -> Option<Scenario> {
        ALL.iter().chain(REQUEST_LEVEL).copied().find(|x| x.name() == s)
    }

    /// Every scenario name, for error messages.
    pub fn known_names() -> Vec<&'static str> {
        let mut names: Vec<&str> = ALL.iter().map(|s| s.name()).collect();
        let more: Vec<&str> = REQUEST_LEVEL.iter().map(|s| s.name()).filter(|n| !names.contains(n)).collect();
        names.extend(more);
        names
    }

    /// Every case of this scenario for `prompts` on `path`. Never fails as a whole: a case
    /// that cannot run is a failed or skipped case, and the others go on.
    pub fn run(self, h: &mut Harness, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
        match self {
            Scenario::Single => single::run(h, path, prompts),
            Scenario::Batch2 => batch2::run(h, path, prompts),
            Scenario::Concurrent => concurrent::run(h, path, prompts),
            Scenario::Padded => padded::run(h, path, prompts),
            Scenario::Chunked => chunked::run(h, path, prompts),
            Scenario::Rollback => rollback::run(h, path, prompts),
            Scenario::Prefix => prefix::run(h, path, prompts),
            // Suites refuse these on step-level engines (suite.rs); never silently pass.
            Scenario::Lengths | Scenario::Repeat => CaseOutput::for_every_prompt(
                prompts,
                Outcome::Failed(format!("`{}` runs on kind = \"openai\" only", self.name())),
            ),
        }
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

/// A prompt as the scenarios see it: a name for reports and its token ids.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub name: String,
    pub ids: Vec<u32>,
}

/// Layout facts about one step of a path, for locating a divergence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepLayout {
    /// KV row of the token fed at this step (the last prompt token at step 0).
    pub kv_row: usize,
    /// RoPE position of that token (kv_row minus any masked left padding).
    pub position: usize,
    pub batch_row: usize,
    pub batch_size: usize,
    /// Pad rows trimmed before this step (padded scenario).
    pub pads_trimmed: usize,
    /// Rows rolled back (decoded, then trimmed) before this step (rollback scenario).
    pub rolled_back: usize,
}

/// One sequence's run: per step, its greedy choice, its logits and where it was.
#[derive(Debug, Clone, Default)]
pub struct PathTrace {
    pub tokens: Vec<u32>,
    pub logits: Vec<Array>,
    pub layout: Vec<StepLayout>,
}

/// How a case ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ran,
    /// The path cannot do what the case needs (a capability it lacks): a named skip.
    Skipped(String),
    /// The case could not finish (an engine error, a trim that did less than asked, ...).
    Failed(String),
}

/// The outcome of one case of a scenario on one path: the sequences that share a prompt.
#[derive(Debug, Clone)]
pub struct CaseOutput {
    /// e.g. `same`, `ragged`, `req3`, `tile`, `while-running`.
    pub case: String,
    pub prompt: Prompt,
    pub paths: Vec<PathTrace>,
    /// Facts worth printing next to the verdict (e.g. `padded 37 -> 64, trimmed 27`).
    pub notes: Vec<String>,
    /// The KV store's memory when the case ended (absent when the path does not report it).
    pub kv: Option<KvStats>,
    pub outcome: Outcome,
    /// The KV store's books when the case ended ([`Session::audit`]): a leak or refcount
    /// mismatch, naming the blocks, fails the row even when every token matches.
    pub audit: Option<String>,
}

impl CaseOutput {
    /// One `*` case per prompt with the same outcome and nothing computed: a scenario that
    /// could not run at all still gives every prompt a row saying why.
    pub fn for_every_prompt(prompts: &[Prompt], outcome: Outcome) -> Vec<CaseOutput> {
        prompts
            .iter()
            .map(|p| CaseOutput {
                case: "*".into(),
                prompt: p.clone(),
                paths: Vec::new(),
                notes: Vec::new(),
                kv: None,
                outcome: outcome.clone(),
                audit: None,
            })
            .collect()
    }
}

/// What scenarios share for one checkpoint: the settings, the planted faults, and the
/// reference path with its single-sequence traces (computed once per prompt, reused by every
/// scenario and path). References always run fault-free.
pub struct Harness<'r> {
    pub settings: Settings,
    pub faults: Faults,
    /// The token used for padding: the checkpoint's pad token, else its first EOS, else 0.
    pub pad_token: u32,
    reference: &'r mut dyn EnginePath,
    references: HashMap<Vec<u32>, Trace>,
    /// The rows (prompt name, case) this run wants; `None`: all of them.
    select: Option<Selector<'r>>,
}

/// Whether a row, named by its prompt and case, is wanted (`--filter`).
pub type Selector<'r> = Box<dyn Fn(&str, &str) -> bool + 'r>;

impl<'r> Harness<'r> {
    /// Scenarios run with `faults` planted in the paths they drive; references never do.
    pub fn new(reference: &'r mut dyn EnginePath, settings: Settings, faults: Faults, pad_token: u32) -> Self {
        Harness { settings, faults, pad_token, reference, references: HashMap::new(), select: None }
    }

    /// Run only the cases producing rows `select` wants (each scenario still sees every
    /// prompt, so a selected row is computed exactly as in a full run: same ragged partner,
    /// same batch). `None` selects everything.
    pub fn select(&mut self, select: Option<Selector<'r>>) {
        self.select = select;
    }

    pub fn wants(&self, prompt: &str, case: &str) -> bool {
        self.select.as_ref().is_none_or(|f| f(prompt, case))
    }

    /// The reference path (engine, dtype, capabilities), as reports name it.
    pub fn reference_info(&self) -> &PathInfo {
        self.reference.info()
    }

    /// The reference for `prompt`: the reference path, one sequence, unpadded, greedy.
    pub fn reference(&mut self, prompt: &[u32]) -> Result<Trace> {
        if let Some(t) = self.references.get(prompt) {
            return Ok(t.clone());
        }
        let steps = self.settings.max_tokens;
        let run = self.reference.session(Faults::NONE).and_then(|mut s| engine::generate(s.as_mut(), prompt, steps));
        // The prompt cannot run on the reference path at all: its rows fail, saying where.
        let (_, trace) = run.map_err(|e| match e {
            Error::Unsupported(why) => Error::Unsupported(why),
            e => Error::Invalid(format!("reference run failed: {e}")),
        })?;
        // Guard (issue #14): NaN in the reference is the checkpoint's, not the pool's.
        crate::compare::require_finite("reference logits", &trace.logits)?;
        self.references.insert(prompt.to_vec(), trace.clone());
        Ok(trace)
    }

    /// A fault-free session of the reference path (the noise floor re-runs it batched).
    pub fn reference_session(&mut self) -> Result<Box<dyn Session + '_>> {
        self.reference.session(Faults::NONE)
    }
}

/// A sequence being decoded under teacher forcing.
pub struct Live {
    pub seq: SeqId,
    pub forced: Vec<u32>,
    pub trace: PathTrace,
    /// Steps this path runs (at most the reference's length).
    pub steps: usize,
    pub pads_trimmed: usize,
    /// Rows decoded then trimmed away (rollback).
    pub rolled_back: usize,
}

impl Live {
    pub fn new(seq: SeqId, reference: &Trace, steps: usize) -> Self {
        Live {
            seq,
            forced: reference.tokens.clone(),
            trace: PathTrace::default(),
            steps: steps.min(reference.tokens.len()),
            pads_trimmed: 0,
            rolled_back: 0,
        }
    }

    pub fn done(&self) -> bool {
        self.trace.tokens.len() >= self.steps
    }

    /// The token to feed next: the reference's choice at the last recorded step.
    pub fn next_input(&self) -> Result<u32> {
        let i = self.trace.tokens.len().checked_sub(1).ok_or_else(|| Error::Invalid("no step recorded yet".into()))?;
        Ok(self.forced[i])
    }

    fn record(&mut self, token: u32, logits: Array, layout: StepLayout) {
        self.trace.tokens.push(token);
        self.trace.logits.push(logits);
        self.trace.layout.push(layout);
    }
}

/// Record one step for `rows` from a forward's logits `[B, vocab]`. `fed_rows[i]` is the KV
/// row of the token whose logits these are.
pub fn record_step(s: &dyn Session, lives: &mut [&mut Live], logits: &Array, fed_rows: &[usize]) -> Result<()> {
    let tokens = engine::greedy(logits)?;
    let rows = engine::rows(logits)?;
    let b = lives.len();
    for (i, ((live, token), row)) in lives.iter_mut().zip(tokens).zip(rows).enumerate() {
        let masked = s.masked_prefix(live.seq)?;
        let layout = StepLayout {
            kv_row: fed_rows[i],
            position: fed_rows[i].saturating_sub(masked),
            batch_row: i,
            batch_size: b,
            pads_trimmed: live.pads_trimmed,
            rolled_back: live.rolled_back,
        };
        live.record(token, row, layout);
    }
    Ok(())
}

/// One batched decode step: every live row feeds its forced token.
pub fn decode_step(s: &mut dyn Session, lives: &mut [&mut Live]) -> Result<()> {
    let mut steps = Vec::with_capacity(lives.len());
    let mut fed = Vec::with_capacity(lives.len());
    for l in lives.iter() {
        fed.push(s.len(l.seq)?);
        steps.push(RowStep::new(l.seq, vec![l.next_input()?]));
    }
    let logits = s.forward(&steps)?;
    record_step(s, lives, &logits, &fed)
}

/// Prefill one sequence (B=1) and record its first step.
pub fn prefill(s: &mut dyn Session, live: &mut Live, prompt: &[u32]) -> Result<()> {
    let start = s.len(live.seq)?;
    let logits = s.forward(&[RowStep::new(live.seq, prompt.to_vec())])?;
    record_step(s, &mut [live], &logits, &[start + prompt.len() - 1])
}

/// Decode every live row, batched, until each has run its steps.
pub fn decode_all(s: &mut dyn Session, lives: &mut [Live]) -> Result<()> {
    loop {
        let mut active: Vec<&mut Live> = lives.iter_mut().filter(|l| !l.done()).collect();
        if active.is_empty() {
            return Ok(());
        }
        decode_step(s, &mut active)?;
    }
}

/// Trim exactly `n` rows, or fail: the guard against a trim that silently does less (the
/// pool-backed trim no-op returned 0 and decode attended the pad rows).
pub fn trim_exact(s: &mut dyn Session, seq: SeqId, n: usize) -> Result<()> {
    let before = s.len(seq)?;
    let trimmed = s.trim(seq, n)?;
    let after = s.len(seq)?;
    if trimmed != n || after + n != before {
        return Err(Error::Kv(format!(
            "trim of {n} rows removed {trimmed} (length {before} -> {after}, expected {})",
            before.saturating_sub(n)
        )));
    }
    Ok(())
}

/// A case that needs `rows` sequences in one forward: skipped on a path that cannot batch them.
pub fn need_batch(path: &dyn EnginePath, rows: usize) -> Result<()> {
    let info = path.info();
    match info.capabilities.max_batch {
        Some(max) if rows > max => {
            Err(Error::Unsupported(format!("path `{}` batches at most {max} rows; this case needs {rows}", info.name)))
        }
        _ => Ok(()),
    }
}

/// A case that left-pads a row: skipped on a path without masked prefixes.
pub fn need_masked_prefix(path: &dyn EnginePath) -> Result<()> {
    let info = path.info();
    if info.capabilities.masked_prefix {
        Ok(())
    } else {
        Err(Error::Unsupported(format!("path `{}` cannot mask left-pad rows (masked_prefix)", info.name)))
    }
}

/// Run one case, which yields the rows `rows` (prompt, case name), if any of them is wanted,
/// and keep its output. An error becomes a failed row (the first name) and an unsupported
/// operation a skipped one, so one case never takes its prompt's others down.
pub fn attempt<'r>(
    h: &mut Harness<'r>,
    out: &mut Vec<CaseOutput>,
    rows: &[(&Prompt, &str)],
    f: impl FnOnce(&mut Harness<'r>) -> Result<Vec<CaseOutput>>,
) {
    let Some(&(prompt, case)) = rows.first() else { return };
    if !rows.iter().any(|(p, c)| h.wants(&p.name, c)) {
        return;
    }
    match f(h) {
        Ok(mut cases) => out.append(&mut cases),
        Err(e) => out.push(CaseOutput {
            case: case.to_string(),
            prompt: prompt.clone(),
            paths: Vec::new(),
            notes: Vec::new(),
            kv: None,
            audit: None,
            outcome: match e {
                Error::Unsupported(why) => Outcome::Skipped(why),
                e => Outcome::Failed(e.to_string()),
            },
        }),
    }
}

/// `(a, b)` pairs of distinct-length prompts for ragged batches: each prompt with the next one
/// of a different length (cyclically); prompts with no such partner are skipped.
pub fn ragged_partner(prompts: &[Prompt], i: usize) -> Option<usize> {
    let n = prompts.len();
    (1..n).map(|k| (i + k) % n).find(|&j| prompts[j].ids.len() != prompts[i].ids.len())
}

/// A case's output, with the memory its KV store held at the end (peak included).
pub fn case(
    s: &mut dyn Session,
    case: impl Into<String>,
    prompt: &Prompt,
    paths: Vec<PathTrace>,
) -> Result<CaseOutput> {
    let audit = s.audit()?;
    Ok(CaseOutput {
        case: case.into(),
        prompt: prompt.clone(),
        paths,
        notes: Vec::new(),
        kv: s.stats()?,
        outcome: Outcome::Ran,
        audit,
    })
}
