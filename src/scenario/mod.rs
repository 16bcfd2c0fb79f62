//! Scenarios: the ways an engine batches, pads, chunks, trims and shares sequences, each
//! producing case outputs that the run's judge turns into rows.
//!
//! - Step level ([`run`], one small module per scenario): a plan run on one path through the
//!   step interface ([`EnginePath`], [`Session`]); adding one never touches an engine. Every
//!   path is teacher-forced with its prompt's reference tokens (the reference path, one
//!   sequence, unpadded): at each step the path's own greedy choice and its full logits row are
//!   recorded, and the reference token is fed next. The first divergence is therefore the first
//!   step where the path would have chosen differently, and after it the metrics keep measuring
//!   the same computation, so a tie at step 5 cannot hide a RoPE bug at step 20.
//! - Request level ([`requests`]): what to send a server and when, through the request
//!   interface ([`crate::engine::openai::RequestPath`]); each measured answer is compared with
//!   the reference path's answer to the same prompt sent alone.

pub mod batch2;
pub mod chunked;
pub mod concurrent;
pub mod corpus;
pub mod explore;
pub mod padded;
pub mod prefix;
pub mod repeat;
pub mod requests;
pub mod rollback;
pub mod script;
pub mod shared;
pub mod single;
mod watched;

pub use watched::{Driven, Watched};

use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::{Duration, Instant};

use mlx_rs::Array;

use crate::array::{greedy, require_finite, rows};
use crate::engine::{self, EnginePath, PathInfo, Session};
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::kv::{Counters, KvStats, SeqId};
use crate::model::RowStep;
use crate::vocab::{PathTrace, Prompt, Scenario, Script, Settings, StepLayout, Trace};

/// Every case of step-level scenario `sc` for `prompts` on `path`, then a skipped case for each
/// case the scenario cannot form for a prompt (a row that says why, never a missing one).
/// Never fails as a whole: a case that cannot run is a failed or skipped case, and the others
/// go on.
pub fn run(sc: Scenario, setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut cases = match sc {
        Scenario::Single => single::run(setup, path, prompts),
        Scenario::Batch2 => batch2::run(setup, path, prompts),
        Scenario::Concurrent => concurrent::run(setup, path, prompts),
        Scenario::Padded => padded::run(setup, path, prompts),
        Scenario::Chunked => chunked::run(setup, path, prompts),
        Scenario::Rollback => rollback::run(setup, path, prompts),
        Scenario::Prefix => prefix::run(setup, path, prompts),
        Scenario::Script => script::run_all(setup, path, prompts),
        Scenario::Corpus => corpus::run(setup, path, prompts),
        Scenario::Repeat => repeat::run(setup, path, prompts),
        // Suites refuse this on step-level engines (the parser); never silently pass.
        Scenario::Lengths => CaseOutput::for_every_prompt(
            prompts,
            Outcome::Failed(format!("`{}` runs on kind = \"openai\" only", sc.name())),
        ),
        // Explore has a budget and judges as it goes: `run` drives it, not this.
        Scenario::Explore => CaseOutput::for_every_prompt(
            prompts,
            Outcome::Failed("`explore` runs from `parity explore`, through its own driver".into()),
        ),
    };
    cases.extend(absent(sc, prompts));
    cases
}

/// Cases a step-level scenario leaves out for a prompt (no partner of another length, a prompt
/// too short to share): skipped cases with the reason.
fn absent(sc: Scenario, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let unpaired = ragged_partner(prompts, i).is_none();
        let why = || format!("no prompt of another length than {} tokens to pair with", p.ids.len());
        let skip = |case: &str, why: String| CaseOutput::new(case, p, Vec::new(), Outcome::Skipped(why));
        match sc {
            Scenario::Batch2 if unpaired => out.push(skip("ragged", why())),
            Scenario::Padded if unpaired => out.push(skip("batch-right", why())),
            Scenario::Prefix if p.ids.len() < 3 => out.push(skip(
                "*",
                format!(
                    "the {}-token prompt is too short to share: prefix needs at least 3 tokens (a shared part \
                     and an own part)",
                    p.ids.len()
                ),
            )),
            _ => {}
        }
    }
    out
}

/// How a case ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Ran,
    /// The path cannot do what the case needs (a capability it lacks): a named skip.
    Skipped(String),
    /// The case could not finish (an engine error, a trim that did less than asked, ...): the
    /// row names the scenario and path before this cause.
    Failed(String),
    /// The case never started (its path did not start, its server had died): this sentence
    /// is the whole failure.
    NotRun(String),
}

/// The outcome of one case of a scenario on one path: what it measured for one row, and what
/// that is compared with. `M` is what its kind of engine shows: the traces of a stepped path
/// ([`Sequences`]), or each measured request's answer from a server ([`requests::Answers`]).
#[derive(Debug, Clone)]
pub struct CaseOutput<M = Sequences> {
    /// e.g. `same`, `ragged`, `req3`, `tile`, `while-running`.
    pub case: String,
    /// The prompt the row is named after and its reference is computed for.
    pub prompt: Prompt,
    pub measured: M,
    /// Facts worth printing next to the verdict (e.g. `padded 37 -> 64, trimmed 27`).
    pub notes: Vec<String>,
    /// The KV store's memory when the case ended (absent when the path does not report it).
    pub kv: Option<KvStats>,
    pub outcome: Outcome,
    /// The KV store's books when the case ended ([`Session::audit`]): a leak or refcount
    /// mismatch, naming the blocks, fails the row even when every token matches.
    pub audit: Option<String>,
    /// What the case's session showed beside the tokens (stepped paths): the evidence its
    /// claims are judged on.
    pub observed: Option<Observed>,
    /// `corpus`: the path's next-token distributions against the reference's, position by
    /// position, summarised; judged by the distribution's bounds instead of step by step.
    pub distribution: Option<crate::vocab::Distribution>,
}

/// What a stepped case's session showed when it ended: parity's record of its own driving,
/// what the engine counted, and the lengths of the sequences still live (what a paged path's
/// blocks and a layout's bytes are held to).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    pub driven: Driven,
    pub counters: Option<Counters>,
    pub live: Vec<usize>,
}

/// What a stepped case measured: the sequences it decoded (e.g. both rows of a same-prompt
/// batch), each beside the reference trace it is compared with step by step.
pub type Sequences = Vec<Decoded>;

/// One sequence a case decoded, and the reference it is compared with: step `i` of `trace`
/// against step `i` of `reference`.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub reference: Trace,
    pub trace: PathTrace,
}

impl<M> CaseOutput<M> {
    /// A case with nothing noted and no store facts.
    pub fn new(case: impl Into<String>, prompt: &Prompt, measured: M, outcome: Outcome) -> Self {
        CaseOutput {
            case: case.into(),
            prompt: prompt.clone(),
            measured,
            notes: Vec::new(),
            kv: None,
            outcome,
            audit: None,
            observed: None,
            distribution: None,
        }
    }
}

impl Outcome {
    /// A case's error as its outcome: an operation the path does not support is a skip.
    pub fn of(e: Error) -> Outcome {
        match e {
            Error::Unsupported(why) => Outcome::Skipped(why),
            e => Outcome::Failed(e.to_string()),
        }
    }
}

impl CaseOutput {
    /// One `*` case per prompt with the same outcome and nothing computed: a scenario that
    /// could not run at all still gives every prompt a row saying why.
    pub fn for_every_prompt(prompts: &[Prompt], outcome: Outcome) -> Vec<CaseOutput> {
        prompts.iter().map(|p| CaseOutput::new("*", p, Vec::new(), outcome.clone())).collect()
    }
}

/// The setup every step-level case of one checkpoint runs in: the settings, the faults planted
/// in the paths under test, the pad token, which rows this run wants, and the reference path
/// with its single-sequence traces (computed once per prompt, reused by every scenario and
/// path). References always run fault-free.
pub struct Setup<'r> {
    pub settings: Settings,
    pub faults: Faults,
    /// The token used for padding: the checkpoint's pad token, else its first EOS, else 0.
    pub pad_token: u32,
    reference: &'r mut dyn EnginePath,
    references: HashMap<Vec<u32>, Trace>,
    /// Per base prompt, how far apart two correct runs of the reference are (`None`: not
    /// measurable).
    floors: BTreeMap<String, Option<f32>>,
    /// Reference streams (a script's sequences), by their fixed tokens.
    streams: HashMap<Vec<u32>, Rc<Stream>>,
    /// The reference's last logits and choice after a prefix prefilled whole (a script's feed
    /// that ends inside the fixed tokens), by the prefix.
    prefixes: HashMap<Vec<u32>, (Array, u32)>,
    /// The rows (prompt name, case) this run wants; `None`: all of them.
    select: Option<Selector<'r>>,
    /// The suite's pinned scripts, by name (the `script` scenario).
    pub scripts: Vec<(String, Script)>,
    /// Time spent on the reference path so far computing references (prompts, streams,
    /// prefixes).
    reference_time: Duration,
    /// Time spent measuring noise floors, less the references they needed: the reference path
    /// re-run next to a partner, a forward of two rows a step (as long as a batch2 row).
    floor_time: Duration,
    /// Where this run's workers share references and floors (`parity run --jobs`).
    shared: Option<shared::Shared>,
}

/// A token stream as the reference reads it: fixed tokens (a prompt, or a donor's rows and a
/// prompt), then the reference's greedy continuation. Every token of `tokens` can be fed and
/// compared: the reference's logits after each is [`Setup::stream_at`].
#[derive(Debug)]
pub struct Stream {
    pub tokens: Vec<u32>,
    /// How many of `tokens` are fixed.
    pub fixed: usize,
    /// The reference of the fixed tokens (prefilled whole, then decoded greedily): its logits
    /// are the stream's from the last fixed token on.
    reference: Trace,
}

/// Whether a row, named by its prompt and case, is wanted (`--filter`).
pub type Selector<'r> = Box<dyn Fn(&str, &str) -> bool + 'r>;

impl<'r> Setup<'r> {
    /// Scenarios run with `faults` planted in the paths they drive; references never do.
    pub fn new(reference: &'r mut dyn EnginePath, settings: Settings, faults: Faults, pad_token: u32) -> Self {
        Setup {
            settings,
            faults,
            pad_token,
            reference,
            references: HashMap::new(),
            floors: BTreeMap::new(),
            streams: HashMap::new(),
            prefixes: HashMap::new(),
            select: None,
            scripts: Vec::new(),
            reference_time: Duration::ZERO,
            floor_time: Duration::ZERO,
            shared: None,
        }
    }

    /// Share references and noise floors with the run's other workers through `shared`.
    pub fn share(&mut self, shared: shared::Shared) {
        self.shared = Some(shared);
    }

    /// A fresh session of `path` with this run's faults planted, watched (see [`Watched`]).
    pub fn open<'p>(&self, path: &'p mut dyn EnginePath) -> Result<Watched<'p>> {
        let block_size = path.info().capabilities.block_size;
        Ok(Watched::new(path.session(self.faults)?, block_size))
    }

    /// [`open`](Self::open), every forward computed ([`EnginePath::computed_session`]).
    pub fn open_computed<'p>(&self, path: &'p mut dyn EnginePath) -> Result<Watched<'p>> {
        let block_size = path.info().capabilities.block_size;
        Ok(Watched::new(path.computed_session(self.faults)?, block_size))
    }

    /// Time spent on the reference path so far.
    pub fn reference_time(&self) -> Duration {
        self.reference_time
    }

    /// A fresh session of the reference path, for a case that runs it in lockstep with the
    /// path (its time is the caller's to add: [`add_reference_time`](Self::add_reference_time)).
    pub fn reference_session(&mut self) -> Result<Box<dyn Session + '_>> {
        self.reference.session(Faults::NONE)
    }

    /// Time spent measuring noise floors so far (see [`noise_floor`](Self::noise_floor)).
    pub fn floor_time(&self) -> Duration {
        self.floor_time
    }

    pub fn add_reference_time(&mut self, t: Duration) {
        self.reference_time += t;
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

    /// The reference for `prompt`: the reference path, one sequence, unpadded, greedy.
    pub fn reference(&mut self, prompt: &[u32]) -> Result<Trace> {
        self.reference_now(prompt, true).unwrap_or_else(|| Err(Error::Invalid("reference not computed".into())))
    }

    /// [`reference`](Self::reference); `wait`: for a worker sharing it that is computing it
    /// now, else `None` while one is.
    fn reference_now(&mut self, prompt: &[u32], wait: bool) -> Option<Result<Trace>> {
        if let Some(t) = self.references.get(prompt) {
            return Some(Ok(t.clone()));
        }
        let started = Instant::now();
        let steps = self.settings.max_tokens;
        let reference = &mut *self.reference;
        let mut compute = || {
            reference
                .session(Faults::NONE)
                .and_then(|mut s| engine::generate(s.as_mut(), prompt, steps))
                .map(|(_, t)| t)
        };
        let run = match &self.shared {
            Some(shared) => shared.reference(prompt, steps, wait, compute)?,
            None => compute(),
        };
        // The prompt cannot run on the reference path at all: its rows fail, saying where.
        let checked = run
            .map_err(|e| match e {
                Error::Unsupported(why) => Error::Unsupported(why),
                e => Error::Invalid(format!("reference run failed: {e}")),
            })
            // NaN in the reference is the checkpoint's or the runtime's, never the pool's: said
            // so, instead of a pool bug blamed on every row of the prompt.
            .and_then(|trace| require_finite("reference logits", &trace.logits).map(|_| trace));
        if let Ok(trace) = &checked {
            self.references.insert(prompt.to_vec(), trace.clone());
        }
        self.reference_time += started.elapsed();
        Some(checked)
    }

    /// A worker of several ([`share`](Self::share)d): first the references and noise floors of
    /// `prompts` that no other worker is computing now, so that the workers split them between
    /// them instead of waiting for each other's. Alone, or when every one is already known:
    /// nothing.
    pub fn prefetch(&mut self, prompts: &[Prompt]) {
        if self.shared.is_none() {
            return;
        }
        for p in prompts {
            let _ = self.reference_now(&p.ids, false);
        }
        for p in prompts {
            let _ = self.floor_now(&p.name, prompts, false);
        }
    }

    /// The stream that starts with `fixed`: its reference as [`Setup::reference`] computes it
    /// (the reference path prefills `fixed` whole and decodes `max_tokens` greedy tokens), so a
    /// script's stream and a scenario's prompt are judged against the same reference.
    pub fn stream(&mut self, fixed: &[u32]) -> Result<Rc<Stream>> {
        if let Some(s) = self.streams.get(fixed) {
            return Ok(s.clone());
        }
        if fixed.is_empty() {
            return Err(Error::Invalid("a stream needs at least one token".into()));
        }
        let reference = self.reference(fixed)?;
        // The last greedy token is the stream's end: no logits follow it.
        let continuation = &reference.tokens[..reference.tokens.len().saturating_sub(1)];
        let tokens = fixed.iter().chain(continuation).copied().collect();
        let stream = Rc::new(Stream { tokens, fixed: fixed.len(), reference });
        self.streams.insert(fixed.to_vec(), stream.clone());
        Ok(stream)
    }

    /// The reference's logits and greedy choice having read `stream` up to position `p`. From
    /// the last fixed token on they are the stream's reference; inside the fixed tokens, the
    /// reference path prefills the first `p + 1` of them whole (once per prefix).
    pub fn stream_at(&mut self, stream: &Stream, p: usize) -> Result<(Array, u32)> {
        if let Some(k) = (p + 1).checked_sub(stream.fixed) {
            let r = &stream.reference;
            return match (r.logits.get(k), r.tokens.get(k)) {
                (Some(l), Some(&t)) => Ok((l.clone(), t)),
                _ => Err(Error::Invalid(format!("position {p} is past the stream's end"))),
            };
        }
        let prefix = &stream.tokens[..=p];
        if let Some(hit) = self.prefixes.get(prefix) {
            return Ok(hit.clone());
        }
        let started = Instant::now();
        let mut session = self.reference.session(Faults::NONE)?;
        let seq = session.create(0)?;
        let out = session.forward(&[RowStep::new(seq, prefix.to_vec())])?;
        let hit = (rows(&out)?.remove(0), greedy(&out)?[0]);
        drop(session);
        require_finite("reference logits", std::slice::from_ref(&hit.0))?;
        self.prefixes.insert(prefix.to_vec(), hit.clone());
        self.reference_time += started.elapsed();
        Ok(hit)
    }

    /// The noise floor of a row's base prompt (`p` of `p/shared7`), measured once per prompt:
    /// the reference re-run in a different batch composition (as row 1 of a batch of two,
    /// next to another of `all`), how far apart two correct runs are on this machine. A
    /// measurement aid: when it cannot be taken it is unknown (`None`), not a failure.
    pub fn noise_floor(&mut self, prompt: &str, all: &[Prompt]) -> Option<f32> {
        self.floor_now(prompt, all, true).flatten()
    }

    /// [`noise_floor`](Self::noise_floor); `wait` as for [`reference_now`](Self::reference_now).
    fn floor_now(&mut self, prompt: &str, all: &[Prompt], wait: bool) -> Option<Option<f32>> {
        let base = prompt.split('/').next().unwrap_or(prompt);
        if let Some(f) = self.floors.get(base) {
            return Some(*f);
        }
        let Some(p) = all.iter().find(|p| p.name == base) else { return Some(None) };
        let (started, reference_before) = (Instant::now(), self.reference_time);
        let floor = match self.shared.clone() {
            Some(shared) => shared.floor(&p.name, &p.ids, wait, || self.measure_floor(p, all).ok().flatten())?,
            None => self.measure_floor(p, all).ok().flatten(),
        };
        self.floor_time += started.elapsed().saturating_sub(self.reference_time - reference_before);
        self.floors.insert(base.to_string(), floor);
        Some(floor)
    }

    /// Every noise floor measured so far, by base prompt.
    pub fn noise_floors(&self) -> &BTreeMap<String, Option<f32>> {
        &self.floors
    }

    fn measure_floor(&mut self, p: &Prompt, all: &[Prompt]) -> Result<Option<f32>> {
        let partner = all
            .iter()
            .find(|q| q.ids != p.ids)
            .cloned()
            .unwrap_or_else(|| Prompt { name: "reversed".into(), ids: p.ids.iter().rev().copied().collect() });
        let (reference, partner_ref) = (self.reference(&p.ids)?, self.reference(&partner.ids)?);
        let steps = self.settings.max_tokens;
        let info = self.reference.info().clone();
        if info.capabilities.max_batch.is_some_and(|m| m < 2) {
            return Ok(None);
        }
        let mut s = self.reference.session(Faults::NONE)?;
        let mut lives =
            [ForcedSeq::new(s.create(0)?, &partner_ref, steps), ForcedSeq::new(s.create(0)?, &reference, steps)];
        prefill(s.as_mut(), &mut lives[0], &partner.ids)?;
        prefill(s.as_mut(), &mut lives[1], &p.ids)?;
        decode_all(s.as_mut(), &mut lives)?;
        let cmp = crate::compare::compare(&reference, &lives[1].trace, info.dtype, f32::INFINITY)?;
        Ok(crate::compare::finite(cmp.max_rel_rms))
    }
}

/// A sequence being decoded under teacher forcing.
pub struct ForcedSeq {
    pub seq: SeqId,
    /// The tokens fed, one per step: the reference's choices.
    pub forced: Vec<u32>,
    pub trace: PathTrace,
    /// Steps this path runs (at most the reference's length).
    pub steps: usize,
    pub pads_trimmed: usize,
    /// Rows decoded then trimmed away (rollback).
    pub rolled_back: usize,
}

impl ForcedSeq {
    pub fn new(seq: SeqId, reference: &Trace, steps: usize) -> Self {
        ForcedSeq {
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
pub fn record_step(s: &dyn Session, lives: &mut [&mut ForcedSeq], logits: &Array, fed_rows: &[usize]) -> Result<()> {
    let tokens = greedy(logits)?;
    let rows = rows(logits)?;
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
pub fn decode_step(s: &mut dyn Session, lives: &mut [&mut ForcedSeq]) -> Result<()> {
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
pub fn prefill(s: &mut dyn Session, live: &mut ForcedSeq, prompt: &[u32]) -> Result<()> {
    let start = s.len(live.seq)?;
    let logits = s.forward(&[RowStep::new(live.seq, prompt.to_vec())])?;
    record_step(s, &mut [live], &logits, &[start + prompt.len() - 1])
}

/// Decode every live row, batched, until each has run its steps.
pub fn decode_all(s: &mut dyn Session, lives: &mut [ForcedSeq]) -> Result<()> {
    loop {
        let mut active: Vec<&mut ForcedSeq> = lives.iter_mut().filter(|l| !l.done()).collect();
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
pub fn need_batch(info: &PathInfo, rows: usize) -> Result<()> {
    match info.capabilities.max_batch {
        Some(max) if rows > max => {
            Err(Error::Unsupported(format!("path `{}` batches at most {max} rows; this case needs {rows}", info.name)))
        }
        _ => Ok(()),
    }
}

/// A case that left-pads a row: skipped on a path without masked prefixes.
pub fn need_masked_prefix(info: &PathInfo) -> Result<()> {
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
    setup: &mut Setup<'r>,
    out: &mut Vec<CaseOutput>,
    rows: &[(&Prompt, &str)],
    f: impl FnOnce(&mut Setup<'r>) -> Result<Vec<CaseOutput>>,
) {
    let Some(&(prompt, case)) = rows.first() else { return };
    if !rows.iter().any(|(p, c)| setup.wants(&p.name, c)) {
        return;
    }
    match f(setup) {
        Ok(mut cases) => out.append(&mut cases),
        Err(e) => out.push(CaseOutput::new(case, prompt, Vec::new(), Outcome::of(e))),
    }
}

/// `(a, b)` pairs of distinct-length prompts for ragged batches: each prompt with the next one
/// of a different length (cyclically); prompts with no such partner are skipped.
pub fn ragged_partner(prompts: &[Prompt], i: usize) -> Option<usize> {
    let n = prompts.len();
    (1..n).map(|k| (i + k) % n).find(|&j| prompts[j].ids.len() != prompts[i].ids.len())
}

/// A case's output: the traces of its sequences for `prompt`, the reference they are compared
/// with, the memory its KV store held at the end (peak included), and what its session showed.
pub fn case(
    s: &mut Watched,
    case: impl Into<String>,
    prompt: &Prompt,
    reference: &Trace,
    paths: Vec<PathTrace>,
) -> Result<CaseOutput> {
    let audit = s.audit()?;
    let measured = paths.into_iter().map(|trace| Decoded { reference: reference.clone(), trace }).collect();
    let observed = Observed { driven: s.driven.clone(), counters: s.counters()?, live: s.live_lengths()? };
    Ok(CaseOutput {
        kv: s.stats()?,
        audit,
        observed: Some(observed),
        ..CaseOutput::new(case, prompt, measured, Outcome::Ran)
    })
}
