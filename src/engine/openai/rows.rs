//! Report rows from request-level answers: each measured request compared with its reference
//! on logprobs (`compare::compare_logprobs`), the worst speaking for the row, with the
//! cross-checks the API allows: the server's prompt token count against parity's, its text
//! against the decoding of its own most probable tokens, its presented token against its top-1.

use super::Checkpoint;
use super::client::{Completion, RequestError};
use super::plan::{RowPlan, Schedule};
use super::run::References;
use crate::compare::{self, LogprobComparison, Verdict};
use crate::report::{ApiFacts, DivergenceReport, Row};
use crate::run::{Unit, empty_row};

/// The row of `r`, from the schedule's answers. `ended`: how the server died, if it did.
pub(crate) fn row(
    cx: &Checkpoint,
    u: &Unit,
    s: &Schedule,
    r: &RowPlan,
    answers: &[Result<Completion, RequestError>],
    references: &References,
    ended: Option<&str>,
) -> Row {
    let spec = cx.spec;
    let mut row = empty_row(spec, &r.prompt, u.scenario, &r.case, &u.path, Verdict::Identical);
    row.notes = r.notes.clone();
    let fail = |mut row: Row, why: String| {
        row.verdict = Verdict::Error;
        row.failure = Some(match ended {
            Some(how) => format!("{why}; the server {how}"),
            None => why,
        });
        row
    };
    let mut compared: Vec<(usize, LogprobComparison, &Completion)> = Vec::new();
    let mut facts = ApiFacts::default();
    for &m in &r.measured {
        let req = &s.requests[m];
        let answer = match &answers[m] {
            Ok(a) => a,
            Err(e) => return fail(row, format!("{} on {}: request {m}: {e}", u.scenario.name(), u.path)),
        };
        let reference = match references.get(&req.ids) {
            Some(Ok(c)) => c,
            Some(Err(e)) => return fail(row, format!("reference request failed: {e}")),
            None => return fail(row, "no reference was computed for this prompt".into()),
        };
        let tol = f64::from(spec.tolerance.max_logprob_delta);
        let mut cmp = compare::compare_logprobs(&reference.trace, &answer.trace, tol);
        // Asked for `max_tokens` but given fewer (or more than the reference, which stopped):
        // the lengths are the divergence when every shared step agrees.
        let (nr, na) = (reference.trace.tokens.len(), answer.trace.tokens.len());
        if cmp.first_divergence.is_none() && (na < req.max_tokens.min(nr) || (na > nr && nr < req.max_tokens)) {
            cmp.verdict = Verdict::Diverged;
            row.notes.push(format!(
                "request {m} generated {na} tokens ({}), the reference {nr} ({})",
                answer.finish_reason.as_deref().unwrap_or("?"),
                reference.finish_reason.as_deref().unwrap_or("?")
            ));
        }
        cross_check(cx, m, req.ids.len(), answer, &mut facts, &mut row.notes);
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
        compared.push((m, cmp, answer));
    }
    // The worst request speaks for the row; among equals, the earliest divergence.
    let Some(w) = (0..compared.len()).max_by_key(|&i| {
        let c = &compared[i].1;
        (c.verdict.rank(), std::cmp::Reverse(c.first_divergence.as_ref().map_or(usize::MAX, |d| d.step)))
    }) else {
        return fail(row, "the row measures no request".into());
    };
    let (m, cmp, answer) = &compared[w];
    row.paths = compared.len();
    row.verdict = cmp.verdict;
    row.tokens = cmp.tokens.clone();
    row.reference_tokens = cmp.reference_tokens.clone();
    let prompt_len = s.requests[*m].ids.len();
    row.first_divergence = cmp.first_divergence.as_ref().map(|d| {
        // A server's layout is not visible: the position is the prompt plus the steps, the
        // batch the schedule's requests.
        let position = prompt_len.saturating_sub(1) + d.step;
        DivergenceReport {
            choice: d.clone(),
            path: w,
            position,
            position_mod_tile: position % spec.settings.tile.max(1),
            kv_row: position,
            block_index: None,
            offset_in_block: None,
            pads_trimmed: 0,
            batch_row: *m,
            batch_size: s.requests.len(),
        }
    });
    facts.server_prompt_tokens = answer.prompt_tokens;
    facts.cached_tokens = answer.cached_tokens;
    facts.finish_reason = answer.finish_reason.clone();
    facts.prompt_tokens = prompt_len;
    row.text = cx.tokenizer.decode(&row.tokens).ok();
    row.reference_text = cx.tokenizer.decode(&row.reference_tokens).ok();
    row.api = Some(facts);
    judge(&mut row, spec);
    row
}

/// What one answer says about the server itself, noted on the row.
fn cross_check(
    cx: &Checkpoint,
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
    let decoded = |n: usize| cx.tokenizer.decode(&toks[..n]).unwrap_or_default();
    let plain = |n: usize| cx.tokenizer.decode_without_special(&toks[..n]).unwrap_or_default();
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

/// A row passes when its verdict is allowed, its largest logprob shift is within the
/// tolerance, and (for a bitwise suite) nothing differs at all.
fn judge(row: &mut Row, spec: &crate::suite::CheckpointSpec) {
    let mut why = Vec::new();
    if !spec.tolerance.allow.contains(&row.verdict) {
        why.push(match &row.first_divergence {
            Some(d) => format!("{} at step {} (position {})", row.verdict.name(), d.choice.step, d.position),
            None => row.verdict.name().to_string(),
        });
    }
    if let Some(f) = &row.api {
        let tol = f64::from(spec.tolerance.max_logprob_delta);
        if f.max_logprob_delta > tol {
            why.push(format!("max |delta logprob| {:.3e} > tolerance {tol:.1e}", f.max_logprob_delta));
        }
        if spec.tolerance.bitwise
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
