//! rollback: every few decode steps, feed `lookahead` draft tokens (all wrong, as a rejected
//! speculative draft), trim them through the same trim every other scenario uses, and carry
//! on. Must equal plain decode: any row the trim leaves behind, or a position it forgets to
//! rewind, changes the next token's attention.

use super::{CaseOutput, Harness, Live, Prompt, case, decode_step, prefill, trim_exact};
use crate::error::Result;
use crate::kv::Backend;
use crate::model::RowStep;

pub fn run(h: &mut Harness, backend: Backend, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let (k, every) = (h.settings.lookahead, h.settings.rollback_every.max(1));
    let vocab = h.model.config.vocab_size as u32;
    let mut out = Vec::new();
    for p in prompts {
        let reference = h.reference(&p.ids)?;
        let mut kv = h.kv(backend)?;
        let mut live = Live::new(kv.create(0)?, &reference, h.settings.max_tokens);
        prefill(h.model, kv.as_mut(), &mut live, &p.ids)?;
        let mut rollbacks = 0;
        while !live.done() {
            if k > 0 && live.trace.tokens.len().is_multiple_of(every) {
                let next = live.next_input()?;
                let drafts: Vec<u32> = (0..k as u32).map(|d| (next + 1 + d) % vocab).collect();
                h.model.forward(kv.as_mut(), &[RowStep::new(live.seq, drafts)])?;
                trim_exact(kv.as_mut(), live.seq, k)?;
                rollbacks += 1;
            }
            decode_step(h.model, kv.as_mut(), &mut [&mut live])?;
        }
        let mut c = case(kv.as_ref(), format!("k{k}"), p, vec![live.trace]);
        c.notes.push(format!("{rollbacks} rollbacks of {k} rows"));
        out.push(c);
    }
    Ok(out)
}
