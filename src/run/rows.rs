//! Report rows: a case's paths compared with their references and folded into one row, judged
//! against the checkpoint's tolerance; the blanket rows of units that could not run; and the
//! noise floor each row is read against.

use std::collections::BTreeMap;

use super::select::Filter;
use super::{RunOptions, Unit};
use crate::checkpoint::Tokenizer;
use crate::compare::{self, PathComparison, Verdict, nan_max};
use crate::engine::PathInfo;
use crate::error::Result;
use crate::report::{DivergenceReport, Row, StepPlace, finite};
use crate::scenario::{self, CaseOutput, Harness, Live, Outcome, Prompt, Scenario};
use crate::suite::{CheckpointSpec, Suite};

/// Rows for units that could not run at all (checkpoint absent or broken).
pub(crate) fn blanket_rows<'u>(
    suite: &Suite,
    spec: &CheckpointSpec,
    units: impl IntoIterator<Item = &'u Unit>,
    opts: &RunOptions,
    verdict: Verdict,
    why: &str,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for u in units {
        for &p in &u.prompts {
            let mut row = empty_row(spec, &suite.prompts[p].name, u.scenario, "*", &u.path, verdict);
            row.pass = verdict == Verdict::Skipped;
            row.failure = (verdict != Verdict::Skipped).then(|| why.to_string());
            row.notes.push(why.lines().next().unwrap_or(why).to_string());
            rows.push(row);
        }
    }
    rows.retain(|r| Filter(opts.filter.as_deref()).selects_row(r));
    rows
}

pub(crate) fn empty_row(
    spec: &CheckpointSpec,
    prompt: &str,
    scenario: Scenario,
    case: &str,
    path: &str,
    verdict: Verdict,
) -> Row {
    Row {
        checkpoint: spec.name.clone(),
        prompt: prompt.to_string(),
        scenario: scenario.name().to_string(),
        case: case.to_string(),
        backend: path.to_string(),
        verdict,
        pass: false,
        failure: None,
        first_divergence: None,
        tokens: Vec::new(),
        reference_tokens: Vec::new(),
        text: None,
        reference_text: None,
        max_rel_rms: None,
        max_kl: None,
        step_rel_rms: Vec::new(),
        step_kl: Vec::new(),
        step_layout: Vec::new(),
        block_size: None,
        noise_floor_rel_rms: None,
        nan: false,
        paths: 0,
        notes: Vec::new(),
        kv: None,
        api: None,
    }
}

/// The noise floor of a row's base prompt (`p` of `p/shared7`), measured once per prompt.
pub(super) fn floor_for(
    h: &mut Harness,
    floors: &mut BTreeMap<String, Option<f32>>,
    prompt: &str,
    all: &[Prompt],
) -> Option<f32> {
    let base = prompt.split('/').next().unwrap_or(prompt);
    if let Some(f) = floors.get(base) {
        return *f;
    }
    let p = all.iter().find(|p| p.name == base)?;
    // A measurement aid: if it cannot be taken, the floor is unknown (null), not a failure.
    let floor = noise_floor(h, p, all).ok().flatten();
    floors.insert(base.to_string(), floor);
    floor
}

/// The reference re-run in a different batch composition (as row 1 of a batch of two on the
/// reference path, next to another prompt): how far apart two correct runs are on this machine.
fn noise_floor(h: &mut Harness, p: &Prompt, all: &[Prompt]) -> Result<Option<f32>> {
    let partner = all
        .iter()
        .find(|q| q.ids != p.ids)
        .cloned()
        .unwrap_or_else(|| Prompt { name: "reversed".into(), ids: p.ids.iter().rev().copied().collect() });
    let (reference, partner_ref) = (h.reference(&p.ids)?, h.reference(&partner.ids)?);
    let steps = h.settings.max_tokens;
    let info = h.reference_info().clone();
    if info.capabilities.max_batch.is_some_and(|m| m < 2) {
        return Ok(None);
    }
    let mut s = h.reference_session()?;
    let mut lives = [Live::new(s.create(0)?, &partner_ref, steps), Live::new(s.create(0)?, &reference, steps)];
    scenario::prefill(s.as_mut(), &mut lives[0], &partner.ids)?;
    scenario::prefill(s.as_mut(), &mut lives[1], &p.ids)?;
    scenario::decode_all(s.as_mut(), &mut lives)?;
    let cmp = compare::compare(&reference, &lives[1].trace, info.dtype, f32::INFINITY)?;
    Ok(finite(cmp.max_rel_rms))
}

/// Compare every path of a case with its reference and fold them into one row.
pub(super) fn case_row(
    h: &mut Harness,
    spec: &CheckpointSpec,
    u: &Unit,
    c: &CaseOutput,
    tok: &Tokenizer,
    floor: Option<f32>,
    path: &PathInfo,
) -> Row {
    let mut row = empty_row(spec, &c.prompt.name, u.scenario, &c.case, &u.path, Verdict::Identical);
    row.notes = c.notes.clone();
    match &c.outcome {
        Outcome::Ran => {}
        Outcome::Skipped(why) => {
            row.verdict = Verdict::Skipped;
            row.pass = true;
            row.notes.push(why.clone());
            return row;
        }
        Outcome::Failed(why) => {
            row.verdict = Verdict::Error;
            row.failure = Some(format!("{} on {}: {why}", u.scenario.name(), u.path));
            return row;
        }
    }
    row.paths = c.paths.len();
    row.kv = c.kv;
    row.noise_floor_rel_rms = floor;
    // A case that tested nothing of its scenario is skipped with the reason, never a pass.
    if let Some(why) = crate::coverage::skip_reason(u.scenario, path.kv_backend(), c, &spec.settings) {
        row.verdict = Verdict::Skipped;
        row.pass = true;
        row.notes.push(why);
        return row;
    }
    let reference = match h.reference(&c.prompt.ids) {
        Ok(r) => r,
        Err(e) => {
            row.verdict = Verdict::Error;
            row.failure = Some(format!("reference: {e}"));
            return row;
        }
    };
    let mut comparisons: Vec<PathComparison> = Vec::new();
    for trace in &c.paths {
        match compare::compare(&reference, trace, path.dtype, spec.tolerance.max_rel_rms) {
            Ok(cmp) => comparisons.push(cmp),
            Err(e) => {
                row.verdict = Verdict::Error;
                row.failure = Some(format!("comparison: {e}"));
                return row;
            }
        }
    }
    // The worst path speaks for the row; among equals, the earliest divergence.
    let worst = comparisons
        .iter()
        .enumerate()
        .max_by_key(|(_, cmp)| {
            (cmp.verdict.rank(), std::cmp::Reverse(cmp.first_divergence.as_ref().map_or(usize::MAX, |d| d.choice.step)))
        })
        .map(|(i, _)| i);
    let Some(w) = worst else {
        row.verdict = Verdict::Error;
        row.failure = Some("case produced no paths".into());
        return row;
    };
    let cmp = &comparisons[w];
    row.verdict = cmp.verdict;
    row.tokens = cmp.tokens.clone();
    row.reference_tokens = cmp.reference_tokens.clone();
    let steps = comparisons.iter().map(|c| c.steps.len()).max().unwrap_or(0);
    let mut step_rms = vec![0f32; steps];
    let mut step_kl = vec![0f32; steps];
    let (mut max_rms, mut max_kl) = (0f32, 0f32);
    for cmp in &comparisons {
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
    row.step_layout = StepPlace::runs(c.paths[w].layout.iter().map(|l| StepPlace {
        step: 0,
        kv_row: l.kv_row,
        position: l.position,
        pads_trimmed: l.pads_trimmed,
        rolled_back: l.rolled_back,
    }));
    row.block_size = path.capabilities.block_size.filter(|&bs| bs > 0);
    row.first_divergence = cmp.first_divergence.as_ref().map(|d| {
        let blocks = path.capabilities.block_size.filter(|&bs| bs > 0);
        DivergenceReport {
            choice: d.choice.clone(),
            path: w,
            position: d.layout.position,
            position_mod_tile: d.layout.position % spec.settings.tile.max(1),
            kv_row: d.layout.kv_row,
            block_index: blocks.map(|bs| d.layout.kv_row / bs),
            offset_in_block: blocks.map(|bs| d.layout.kv_row % bs),
            pads_trimmed: d.layout.pads_trimmed,
            batch_row: d.layout.batch_row,
            batch_size: d.layout.batch_size,
        }
    });
    row.text = tok.decode(&row.tokens).ok();
    row.reference_text = tok.decode(&row.reference_tokens).ok();
    judge(&mut row, spec);
    // Same tokens from a pool that leaks is still a broken engine: the books fail the row.
    if let Some(books) = &c.audit {
        row.verdict = Verdict::Error;
        row.pass = false;
        row.failure = Some(row.failure.take().map_or_else(|| books.clone(), |f| format!("{f}; {books}")));
    }
    row
}

/// A row passes when its verdict is allowed and its largest relative RMS is within the
/// tolerance (a NaN never is).
fn judge(row: &mut Row, spec: &CheckpointSpec) {
    let tol = spec.tolerance.max_rel_rms;
    let mut why = Vec::new();
    if !spec.tolerance.allow.contains(&row.verdict) {
        why.push(match &row.first_divergence {
            Some(d) => format!("{} at step {} (position {})", row.verdict.name(), d.choice.step, d.position),
            None => row.verdict.name().to_string(),
        });
    }
    match row.max_rel_rms {
        None if row.nan => why.push("NaN logits from a finite reference (a poisoned or freed row was read)".into()),
        Some(r) if r > tol => why.push(format!("max relative RMS {r:.3e} > tolerance {tol:.1e}")),
        _ => {}
    }
    row.pass = why.is_empty();
    row.failure = (!why.is_empty()).then(|| why.join("; "));
}
