//! rollback: every few decode steps, feed `lookahead` draft tokens (all wrong, as a rejected
//! speculative draft), trim them through the same trim every other scenario uses, and carry
//! on. Must equal plain decode: any row the trim leaves behind, or a position it forgets to
//! rewind, changes the next token's attention.

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_step, prefill, trim_exact};
use crate::engine::{EnginePath, Session};
use crate::model::RowStep;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let (k, every) = (setup.settings.lookahead, setup.settings.rollback_every.max(1));
    let vocab = path.info().vocab_size as u32;
    let name = format!("k{k}");
    let mut out = Vec::new();
    for p in prompts {
        attempt(setup, &mut out, &[(p, &name)], |setup| {
            let reference = setup.reference(&p.ids)?;
            let mut s = setup.open(path)?;
            let mut live = ForcedSeq::new(s.create(0)?, &reference, setup.settings.max_tokens);
            prefill(&mut s, &mut live, &p.ids)?;
            let mut rollbacks = 0;
            while !live.done() {
                if k > 0 && live.trace.tokens.len().is_multiple_of(every) {
                    let next = live.next_input()?;
                    let drafts: Vec<u32> = (0..k as u32).map(|d| (next + 1 + d) % vocab).collect();
                    s.forward(&[RowStep::new(live.seq, drafts)])?;
                    trim_exact(&mut s, live.seq, k)?;
                    live.rolled_back += k;
                    rollbacks += 1;
                }
                decode_step(&mut s, &mut [&mut live])?;
            }
            let mut c = case(&mut s, name.clone(), p, &reference, vec![live.trace])?;
            c.notes.push(format!("{rollbacks} rollbacks of {k} rows"));
            Ok(vec![c])
        });
    }
    out
}
