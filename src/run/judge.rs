//! The one judge: a case becomes a report row, whichever kind of engine produced it, by the
//! same steps. The case's outcome first (skipped, failed, never run); then each measured
//! sequence (stepped paths) or request (servers) compared with its reference; the worst
//! speaking for the row ([`compare::worst`]), its divergence located in the cache layout; the
//! per-step metrics the worst over all; and one verdict rule against the checkpoint's
//! tolerance.

use std::ops::ControlFlow;

use super::{Cell, witness};
use crate::checkpoint::Tokenizer;
use crate::compare::{self, Choice, LogprobComparison, PathComparison, finite, nan_max};
use crate::engine::PathInfo;
use crate::engine::openai::Completion;
use crate::kv::Backend;
use crate::report::{ApiFacts, DivergenceReport, Row, StepPlace};
use crate::scenario::requests::Answers;
use crate::scenario::{CaseOutput, Outcome};
use crate::vocab::{
    CheckpointSpec, Distribution, Evidence, MEMORY_CLAIMS, Scenario, Settings, Status, StepLayout, Tolerance, Verdict,
    audit,
};

/// What every row of one cell is judged against.
pub(super) struct Judge<'a> {
    pub spec: &'a CheckpointSpec,
    pub cell: &'a Cell,
    /// Decodes the tokens for the report (and, for servers, checks their text).
    pub tokenizer: &'a Tokenizer,
}

impl Judge<'_> {
    /// The row of a stepped path's case: each sequence's logits against the reference
    /// trace of its prompt. `floor`: the prompt's noise floor; `path`: what the path is.
    pub fn steps(&self, c: &CaseOutput, floor: Option<f32>, path: &PathInfo) -> Row {
        let mut row = match self.opened(c) {
            ControlFlow::Continue(row) => row,
            ControlFlow::Break(done) => return done,
        };
        row.paths = c.measured.len();
        row.kv = c.kv;
        row.noise_floor_rel_rms = floor;
        // A case that tested nothing of its scenario is skipped with the reason, never a pass.
        if let Some(why) = vacuous(self.cell.scenario, path.kv_backend(), c, &self.spec.settings) {
            row.verdict = Verdict::Skipped;
            row.pass = true;
            row.notes.push(why);
            return row;
        }
        if let Some(d) = &c.distribution {
            return self.distribution(row, d, c, path);
        }
        let tolerance = self.step_tolerance();
        let mut compared: Vec<PathComparison> = Vec::new();
        for d in &c.measured {
            match compare::compare(&d.reference, &d.trace, path.dtype, tolerance.max_rel_rms) {
                Ok(cmp) => compared.push(cmp),
                Err(e) => return fail(row, format!("comparison: {e}")),
            }
        }
        let Some(w) = compare::worst(compared.iter().map(|c| (c.verdict, c.first_divergence.as_ref()))) else {
            return fail(row, "case produced no paths".into());
        };
        let cmp = &compared[w];
        row.verdict = cmp.verdict;
        row.tokens = cmp.tokens.clone();
        row.reference_tokens = cmp.reference_tokens.clone();
        let steps = compared.iter().map(|c| c.steps.len()).max().unwrap_or(0);
        let mut step_rms = vec![0f32; steps];
        let mut step_kl = vec![0f32; steps];
        let (mut max_rms, mut max_kl) = (0f32, 0f32);
        for cmp in &compared {
            for (i, m) in cmp.steps.iter().enumerate() {
                step_rms[i] = nan_max(step_rms[i], m.rel_rms);
                step_kl[i] = nan_max(step_kl[i], m.kl);
            }
            max_rms = nan_max(max_rms, cmp.max_rel_rms);
            max_kl = nan_max(max_kl, cmp.max_kl);
        }
        row.nan = max_rms.is_nan();
        row.max_rel_rms = finite(max_rms);
        row.max_kl = finite(max_kl);
        row.step_rel_rms = step_rms.into_iter().map(finite).collect();
        row.step_kl = step_kl.into_iter().map(finite).collect();
        let layout = &c.measured[w].trace.layout;
        row.step_layout = StepPlace::runs(layout.iter().map(|l| StepPlace {
            step: 0,
            kv_row: l.kv_row,
            position: l.position,
            pads_trimmed: l.pads_trimmed,
            rolled_back: l.rolled_back,
        }));
        let blocks = path.capabilities.block_size.filter(|&bs| bs > 0);
        row.block_size = blocks;
        row.first_divergence = cmp
            .first_divergence
            .as_ref()
            .map(|d| self.divergence(d, w, layout.get(d.step).copied().unwrap_or_default(), blocks));
        if let Some(o) = &c.observed {
            row.counters = o.counters;
            let w = self.spec.witness(&self.cell.path);
            row.evidence = witness::steps(self.cell.scenario, &c.case, o, c.kv.as_ref(), path, &w);
        }
        weigh_evidence(&mut row);
        self.finish(&mut row, &tolerance);
        if self.cell.scenario == Scenario::Repeat
            && let Some(f) = row.failure.take()
        {
            row.failure = Some(format!("not reproducible: the second run of the schedule differs from the first: {f}"));
        }
        memory_claims(&mut row);
        // Same tokens from a pool that leaks is still a broken engine: the books fail the row.
        if let Some(books) = &c.audit {
            fail_books(&mut row, books.clone());
        }
        row
    }

    /// The row of a server's case: each measured request's logprobs against the reference
    /// path's answer to the same prompt sent alone, with the cross-checks the API allows (the
    /// server's prompt token count against parity's, its text against the decoding of its own
    /// most probable tokens, its presented token against its top-1).
    pub fn requests(&self, c: &CaseOutput<Answers>) -> Row {
        let mut row = match self.opened(c) {
            ControlFlow::Continue(row) => row,
            ControlFlow::Break(done) => return done,
        };
        if let Some(d) = &c.distribution {
            return self.request_distribution(row, d, c);
        }
        let answers = &c.measured;
        // A server that died explains every failure after it.
        let fail = |row: Row, why: String| {
            fail(
                row,
                match &answers.server_ended {
                    Some(how) => format!("{why}; the server {how}"),
                    None => why,
                },
            )
        };
        let mut compared: Vec<(usize, LogprobComparison, &Completion)> = Vec::new();
        let mut facts = ApiFacts::default();
        for (k, a) in answers.requests.iter().enumerate() {
            let m = a.index;
            let answer = match &a.result {
                Ok(answer) => answer,
                Err(e) => {
                    return fail(row, format!("{} on {}: request {m}: {e}", self.cell.scenario.name(), self.cell.path));
                }
            };
            let reference = match &a.reference {
                Some(Ok(r)) => r,
                Some(Err(e)) => return fail(row, format!("reference request failed: {e}")),
                None => return fail(row, "no reference was computed for this prompt".into()),
            };
            let tol = f64::from(self.spec.tolerance.max_logprob_delta);
            let cmp = compare::compare_logprobs(&reference.trace, &answer.trace, tol, a.request.max_tokens);
            if let Some((nr, na)) = cmp.length_mismatch {
                row.notes.push(format!(
                    "request {m} generated {na} tokens ({}), the reference {nr} ({})",
                    answer.finish_reason.as_deref().unwrap_or("?"),
                    reference.finish_reason.as_deref().unwrap_or("?")
                ));
            }
            cross_check(self.tokenizer, m, a.request.ids.len(), answer, &mut facts, &mut row.notes);
            facts.max_logprob_delta = facts.max_logprob_delta.max(cmp.max_delta);
            for (i, d) in cmp.step_max_delta.iter().enumerate() {
                if facts.step_logprob_delta.len() <= i {
                    facts.step_logprob_delta.push(0.0);
                }
                facts.step_logprob_delta[i] = facts.step_logprob_delta[i].max(*d);
            }
            if facts.first_difference.is_none() {
                facts.first_difference = cmp.first_difference.clone();
            }
            facts.seconds += answer.seconds;
            facts.parity_seconds += answer.parity_seconds;
            compared.push((k, cmp, answer));
        }
        let Some(w) = compare::worst(compared.iter().map(|(_, c, _)| (c.verdict, c.first_divergence.as_ref()))) else {
            return fail(row, "the row measures no request".into());
        };
        let (k, cmp, answer) = &compared[w];
        let a = &answers.requests[*k];
        row.paths = compared.len();
        row.verdict = cmp.verdict;
        row.tokens = cmp.tokens.clone();
        row.reference_tokens = cmp.reference_tokens.clone();
        let prompt_len = a.request.ids.len();
        row.first_divergence = cmp.first_divergence.as_ref().map(|d| {
            // A server's layout is not visible: the position is the prompt plus the steps, the
            // batch the schedule's requests.
            let position = prompt_len.saturating_sub(1) + d.step;
            let at = StepLayout {
                kv_row: position,
                position,
                batch_row: a.index,
                batch_size: answers.sent,
                pads_trimmed: 0,
                rolled_back: 0,
            };
            self.divergence(d, w, at, None)
        });
        facts.server_prompt_tokens = answer.prompt_tokens;
        facts.cached_tokens = answer.cached_tokens;
        facts.finish_reason = answer.finish_reason.clone();
        facts.prompt_tokens = prompt_len;
        row.api = Some(facts);
        row.evidence = witness::requests(self.cell.scenario, &c.case, answers, &self.spec.witness(&self.cell.path));
        weigh_evidence(&mut row);
        self.finish(&mut row, &self.spec.tolerance);
        row
    }

    /// The row of a path explore found nothing on: what was explored, in `summary`.
    pub fn explored_clean(&self, seed: u64, summary: String) -> Row {
        let case = format!("seed{seed}");
        let mut row =
            Row::new(&self.spec.name, "*", self.cell.scenario.name(), &case, &self.cell.path, Verdict::Identical);
        row.pass = true;
        row.notes.push(summary);
        row
    }

    /// The row a case starts from (its name, notes, and a verdict to be weighed), or the whole
    /// row when the case did not run to the end.
    fn opened<M>(&self, c: &CaseOutput<M>) -> ControlFlow<Row, Row> {
        let mut row = Row::new(
            &self.spec.name,
            &c.prompt.name,
            self.cell.scenario.name(),
            &c.case,
            &self.cell.path,
            Verdict::Identical,
        );
        row.notes = c.notes.clone();
        match &c.outcome {
            Outcome::Ran => ControlFlow::Continue(row),
            Outcome::Skipped(why) => {
                row.verdict = Verdict::Skipped;
                row.pass = true;
                row.notes.push(why.clone());
                ControlFlow::Break(row)
            }
            Outcome::Failed(why) => {
                ControlFlow::Break(fail(row, format!("{} on {}: {why}", self.cell.scenario.name(), self.cell.path)))
            }
            Outcome::NotRun(why) => ControlFlow::Break(fail(row, why.clone())),
        }
    }

    /// Where a divergence sits: step `at` of the worst path (`path`, its index among the
    /// case's), in the terms that tell a RoPE bug from a block-boundary bug.
    fn divergence(&self, choice: &Choice, path: usize, at: StepLayout, blocks: Option<usize>) -> DivergenceReport {
        DivergenceReport {
            choice: choice.clone(),
            path,
            position: at.position,
            position_mod_tile: at.position % self.spec.settings.tile.max(1),
            kv_row: at.kv_row,
            block_index: blocks.map(|bs| at.kv_row / bs),
            offset_in_block: blocks.map(|bs| at.kv_row % bs),
            pads_trimmed: at.pads_trimmed,
            batch_row: at.batch_row,
            batch_size: at.batch_size,
        }
    }

    /// The row of a `corpus` case: the distribution against each bound the tolerance sets
    /// (with none, every position's argmax must agree), then the memory claims and the books
    /// as on any other row.
    fn distribution(&self, mut row: Row, d: &Distribution, c: &CaseOutput, path: &PathInfo) -> Row {
        self.bounds(&mut row, d);
        row.block_size = path.capabilities.block_size.filter(|&bs| bs > 0);
        if let Some(o) = &c.observed {
            row.counters = o.counters;
            let w = self.spec.witness(&self.cell.path);
            row.evidence = witness::steps(self.cell.scenario, &c.case, o, c.kv.as_ref(), path, &w);
        }
        memory_claims(&mut row);
        if let Some(books) = &c.audit {
            fail_books(&mut row, books.clone());
        }
        row
    }

    /// The row of a server's `corpus` case: the distribution (from the returned top-k) against
    /// the bounds, and the evidence that each position was one token decoded over the prompt
    /// cache: a read that held its bounds without it tested prefill, not the cache, and is
    /// `vacuous`.
    fn request_distribution(&self, mut row: Row, d: &Distribution, c: &CaseOutput<Answers>) -> Row {
        self.bounds(&mut row, d);
        row.paths = 1;
        let answers = &c.measured;
        row.evidence = witness::requests(self.cell.scenario, &c.case, answers, &self.spec.witness(&self.cell.path));
        // As weigh_evidence, for the verdicts a held distribution has (`within` too).
        let missing = row.evidence.iter().any(|e| e.status == Status::Missing && !is_memory(e));
        if missing && row.pass {
            row.verdict = Verdict::Vacuous;
            if !self.spec.tolerance.allow.contains(&Verdict::Vacuous) {
                row.pass = false;
                row.failure = Some(missing_claims(&row));
            }
        }
        row
    }

    /// The distribution's bounds checked onto the row: its verdict, pass and failure.
    fn bounds(&self, row: &mut Row, d: &Distribution) {
        let tolerance = &self.spec.tolerance.distribution;
        let bounds = tolerance.check(d);
        let broken: Vec<String> = bounds
            .iter()
            .filter(|b| !b.held)
            .map(|b| format!("{} {:.4} not {} {}", b.name, b.measured, b.relation, b.limit))
            .collect();
        row.verdict = match (broken.is_empty(), tolerance.is_empty()) {
            (false, _) => Verdict::Diverged,
            (true, true) => Verdict::Identical,
            (true, false) => Verdict::Within,
        };
        row.max_kl = Some(d.kl.max as f32);
        row.distribution = Some(d.clone());
        row.bounds = bounds;
        row.pass = broken.is_empty();
        row.failure = (!broken.is_empty()).then(|| format!("distribution: {}", broken.join(", ")));
    }

    /// The row's texts, and its verdict against the tolerance.
    fn finish(&self, row: &mut Row, tolerance: &Tolerance) {
        row.text = self.tokenizer.decode(&row.tokens).ok();
        row.reference_text = self.tokenizer.decode(&row.reference_tokens).ok();
        verdict(row, tolerance);
    }

    /// What a stepped row is held to. A `repeat` row compares the path's run of a schedule
    /// with its own earlier run of the same schedule and inputs: only nondeterminism can move
    /// it, so any difference fails, whatever the checkpoint allows against another path.
    fn step_tolerance(&self) -> Tolerance {
        let mut t = self.spec.tolerance.clone();
        if self.cell.scenario == Scenario::Repeat {
            t.max_rel_rms = 0.0;
            t.allow = vec![Verdict::Identical];
        }
        t
    }
}

/// Right tokens from a path that did not do what its case tests are no pass: a claim its
/// evidence contradicts turns an agreeing row `vacuous` (a disagreeing row keeps its verdict,
/// the evidence beside it).
fn weigh_evidence(row: &mut Row) {
    let vacuous = row.evidence.iter().any(|e| e.status == Status::Missing && !is_memory(e));
    if vacuous && matches!(row.verdict, Verdict::Identical | Verdict::NearTie) {
        row.verdict = Verdict::Vacuous;
    }
}

/// A memory claim the stats contradict (blocks held beyond the live rows' need, bytes per row
/// beyond the declared layout) fails the row with the numbers, whatever its tokens.
fn memory_claims(row: &mut Row) {
    let broken: Vec<String> = row
        .evidence
        .iter()
        .filter(|e| e.status == Status::Missing && is_memory(e))
        .map(|e| format!("memory: {}: wanted {}; {}", e.claim, e.wanted, e.seen))
        .collect();
    if !broken.is_empty() {
        fail_books(row, broken.join("; "));
    }
}

/// Books that do not add up (a leaking pool, memory beyond the layout's promise) fail the row
/// as an error; a row whose tokens already diverged stays `diverged`, the books beside it,
/// so a bisect for a trim no-op (which both diverges and holds the pad rows' blocks) sees the
/// divergence's exit code.
fn fail_books(row: &mut Row, books: String) {
    if row.verdict != Verdict::Diverged {
        row.verdict = Verdict::Error;
    }
    row.pass = false;
    row.failure = Some(row.failure.take().map_or_else(|| books.clone(), |f| format!("{f}; {books}")));
}

fn is_memory(e: &Evidence) -> bool {
    MEMORY_CLAIMS.contains(&e.claim.as_str())
}

/// Why a `vacuous` row tested nothing: each claim its evidence contradicts.
fn missing_claims(row: &Row) -> String {
    let missing: Vec<String> = row
        .evidence
        .iter()
        .filter(|e| e.status == Status::Missing && !is_memory(e))
        .map(|e| format!("{}: wanted {}; {}", e.claim, e.wanted, e.seen))
        .collect();
    format!("vacuous: {}", missing.join("; "))
}

fn fail(mut row: Row, why: String) -> Row {
    row.verdict = Verdict::Error;
    row.failure = Some(why);
    row
}

/// The verdict rule, one for every kind of engine: a row passes when its verdict is allowed
/// and what it measured is within the tolerance: the largest relative RMS of a stepped path
/// (a NaN never is), the largest logprob shift of a server, and for a bitwise suite nothing
/// differing at all.
fn verdict(row: &mut Row, tolerance: &Tolerance) {
    let mut why = Vec::new();
    if !tolerance.allow.contains(&row.verdict) {
        why.push(match &row.first_divergence {
            _ if row.verdict == Verdict::Vacuous => missing_claims(row),
            Some(d) => format!("{} at step {} (position {})", row.verdict.name(), d.choice.step, d.position),
            None => row.verdict.name().to_string(),
        });
    }
    let tol = tolerance.max_rel_rms;
    match row.max_rel_rms {
        None if row.nan => why.push("NaN logits from a finite reference (a poisoned or freed row was read)".into()),
        Some(r) if r > tol => why.push(format!("max relative RMS {r:.3e} > tolerance {tol:.1e}")),
        _ => {}
    }
    if let Some(f) = &row.api {
        let tol = f64::from(tolerance.max_logprob_delta);
        if f.max_logprob_delta > tol {
            why.push(format!("max |delta logprob| {:.3e} > tolerance {tol:.1e}", f.max_logprob_delta));
        }
        if tolerance.bitwise
            && let Some(d) = &f.first_difference
        {
            let v = |x: Option<f64>| x.map_or("absent".to_string(), |x| format!("{x:?}"));
            let by = match (d.reference, d.path) {
                (Some(a), Some(b)) => format!(" (by {:.3e})", (b - a).abs()),
                _ => " (in one top-k only)".into(),
            };
            why.push(format!(
                "not bitwise identical: step {}, token {}: reference {} vs {}{by}; max |delta logprob| {:.3e}",
                d.step,
                d.token,
                v(d.reference),
                v(d.path),
                f.max_logprob_delta
            ));
        }
    }
    row.pass = why.is_empty();
    row.failure = (!why.is_empty()).then(|| why.join("; "));
}

/// Why a stepped case that ran tested nothing of its scenario, if it did not: the row is then
/// `skipped` with this reason instead of passing. The settings audit first (settings built in
/// code never met the parser), then what only the prompt decides.
fn vacuous(sc: Scenario, backend: Backend, case: &CaseOutput, s: &Settings) -> Option<String> {
    if let Some(p) = audit::settings_problems(s, &[sc], &[backend], None).into_iter().next() {
        return Some(p.message);
    }
    let n = case.prompt.ids.len();
    match sc {
        Scenario::Chunked if n <= s.chunk => Some(format!(
            "the {n}-token prompt fits in one chunk of {}: prefilled in one forward, as `single` does",
            s.chunk
        )),
        // Only the cases whose point is trimming right pads; batch-left always has masked pads.
        Scenario::Padded
            if matches!(case.case.as_str(), "tile" | "batch-right")
                && case.measured.iter().all(|d| d.trace.layout.iter().all(|l| l.pads_trimmed == 0)) =>
        {
            Some(format!("no pad rows: the {n}-token prompt fills whole tiles of {}, so nothing is trimmed", s.tile))
        }
        _ => None,
    }
}

/// What one answer says about the server itself, noted on the row.
fn cross_check(
    tokenizer: &Tokenizer,
    m: usize,
    prompt_len: usize,
    a: &Completion,
    facts: &mut ApiFacts,
    notes: &mut Vec<String>,
) {
    if let Some(n) = a.prompt_tokens.filter(|&n| n != prompt_len) {
        notes.push(format!(
            "request {m}: the server counted {n} prompt tokens, parity {prompt_len} (it tokenized the prompt differently)"
        ));
    }
    // Counted, not noted: which entry a server presents can depend on its batch, and notes
    // are part of the (stable) snapshots. The table and JSON report the totals.
    facts.presented_not_top1 +=
        a.presented.iter().zip(&a.trace.tokens).filter(|(p, t)| p.is_some_and(|p| p != **t)).count();
    // The text should be the decoding of the tokens. Three conventions are not
    // contradictions: a stop token's text is not returned, special tokens may be printed as
    // nothing (llama-server), and a streaming detokenizer may drop the space that begins the
    // first token (mlx-lm's BPE detokenizer does: " Tokyo" -> "Tokyo").
    let toks = &a.trace.tokens;
    let decoded = |n: usize| tokenizer.decode(&toks[..n]).unwrap_or_default();
    let plain = |n: usize| tokenizer.decode_without_special(&toks[..n]).unwrap_or_default();
    let same = |d: String| d == a.text || d.strip_prefix(' ') == Some(a.text.as_str());
    let agrees = [toks.len(), toks.len().saturating_sub(1)].into_iter().any(|n| same(decoded(n)) || same(plain(n)));
    if !agrees && facts.text_contradiction.is_none() {
        let why = format!(
            "request {m}: the server's text {:?} is not the decoding of its most probable tokens {:?}: its logprobs contradict its own output",
            a.text,
            decoded(toks.len())
        );
        notes.push(why.clone());
        facts.text_contradiction = Some(why);
    }
}

/// How a judged row fails, in words that stay the same while the script behind it shrinks:
/// the verdict, or an error's cause without where it happened (no operation or request
/// number, no counts); `None` when it passes. Shrinking keeps a candidate only when its row
/// fails with the same signature, so a reproducer reproduces the failure it was found with.
pub(super) fn signature(row: &Row) -> Option<String> {
    if row.pass || row.verdict == Verdict::Skipped {
        return None;
    }
    if row.verdict != Verdict::Error {
        let how = if row.nan {
            " NaN"
        } else if row.first_divergence.is_none() {
            " over tolerance"
        } else {
            ""
        };
        return Some(format!("{}{how}", row.verdict.name()));
    }
    let mut cause = row.failure.as_deref().unwrap_or_default();
    let location = format!("{} on {}: ", row.scenario, row.path);
    cause = cause.strip_prefix(location.as_str()).unwrap_or(cause);
    // `operation 5 `trim a 3`: `, `after operation 2 `release a`: `, `request 3: `.
    loop {
        let rest = cause.strip_prefix("after ").unwrap_or(cause);
        let Some(rest) = rest.strip_prefix("operation ").or_else(|| rest.strip_prefix("request ")) else { break };
        let Some((_, tail)) = rest.split_once(": ") else { break };
        cause = tail;
    }
    let words: Vec<String> = cause
        .split_whitespace()
        .take(3)
        .map(|w| w.chars().map(|c| if c.is_ascii_digit() { 'N' } else { c }).collect())
        .collect();
    Some(format!("error: {}", words.join(" ")))
}
