//! corpus: a lossy path (a quantized KV cache) reads a text teacher-forced, one token per
//! forward, beside the reference reading the same tokens; at every position the two next-token
//! distributions are compared ([`crate::vocab::Distribution`]: KL, the change in the
//! probability of the text's next token, top-1 agreement, top-k overlap, by position). One
//! token per forward makes every position's logits the decode path's, where a quantized cache
//! is read back, and lets the error compound with context as it does in generation.
//!
//! The reference runs in lockstep with the path (both sessions open at once), so no position's
//! full logits outlive the metrics computed from them: a corpus of thousands of positions over
//! a vocabulary of 262,144 would not fit otherwise.

use std::time::Instant;

use super::{CaseOutput, Outcome, Prompt, Setup, attempt};
use crate::array::{first_non_finite, require_finite, rows};
use crate::compare::{CORPUS_TOP_K, position_samples};
use crate::engine::{EnginePath, Session};
use crate::error::{Error, Result};
use crate::model::RowStep;
use crate::vocab::Distribution;

/// Positions whose logits are reduced together on the device.
const CHUNK: usize = 32;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    for p in prompts {
        attempt(setup, &mut out, &[(p, "teacher-forced")], |setup| Ok(vec![read(setup, path, p)?]));
    }
    out
}

fn read(setup: &mut Setup, path: &mut dyn EnginePath, p: &Prompt) -> Result<CaseOutput> {
    let n = setup.settings.corpus_tokens.min(p.ids.len().saturating_sub(1));
    if n == 0 {
        return Err(Error::Unsupported(format!(
            "the {}-token prompt has no next token to predict: corpus needs at least 2",
            p.ids.len()
        )));
    }
    let mut s = setup.open(path)?;
    let seq = s.create(0)?;
    let (samples, reference_time) = {
        let mut r = setup.reference_session()?;
        let rseq = r.create(0)?;
        let mut samples = Vec::with_capacity(n);
        let mut reference_time = std::time::Duration::ZERO;
        let (mut ref_rows, mut path_rows) = (Vec::with_capacity(CHUNK), Vec::with_capacity(CHUNK));
        for (i, &token) in p.ids[..n].iter().enumerate() {
            let t = Instant::now();
            let rl = r.forward(&[RowStep::new(rseq, vec![token])])?;
            reference_time += t.elapsed();
            let pl = s.forward(&[RowStep::new(seq, vec![token])])?;
            ref_rows.push(rows(&rl)?.remove(0));
            path_rows.push(rows(&pl)?.remove(0));
            if ref_rows.len() == CHUNK || i + 1 == n {
                let first = i + 1 - ref_rows.len();
                require_finite("reference logits", &ref_rows)?;
                // KL against NaN logits would read as 0 (a NaN is dropped by `max`): a path
                // that answers non-finite logits fails at the position, never reads as exact.
                if let Some(at) = first_non_finite(&path_rows)? {
                    return Err(Error::NonFinite { what: "the path's logits (corpus position)", step: first + at });
                }
                samples.extend(position_samples(&ref_rows, &path_rows, &p.ids[first + 1..=i + 1], first)?);
                ref_rows.clear();
                path_rows.clear();
            }
        }
        (samples, reference_time)
    };
    setup.add_reference_time(reference_time);
    let d = Distribution::of(&samples, CORPUS_TOP_K);
    let note = format!("{} positions read teacher-forced, one token per forward", d.positions);
    let observed = super::Observed { driven: s.driven.clone(), counters: s.counters()?, live: s.live_lengths()? };
    let mut c = CaseOutput {
        kv: s.stats()?,
        audit: s.audit()?,
        observed: Some(observed),
        distribution: Some(d),
        ..CaseOutput::new("teacher-forced", p, Vec::new(), Outcome::Ran)
    };
    c.notes.push(note);
    Ok(c)
}
