//! batch2: two sequences prefilled separately, then decoded together in one batched forward.
//!
//! - `same`: the prompt twice. Both rows sit at the same position, so a row that is rotated at
//!   `offset + b` (RoPE stride aliasing) is the only thing that can tell them apart.
//! - `ragged`: the prompt in batch row 1 next to a prompt of another length in row 0, so the
//!   rows' positions differ and exchanging or sharing them shows.

use super::{CaseOutput, Harness, Live, Prompt, case, decode_all, prefill, ragged_partner};
use crate::error::Result;
use crate::kv::Backend;

pub fn run(h: &mut Harness, backend: Backend, prompts: &[Prompt]) -> Result<Vec<CaseOutput>> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let reference = h.reference(&p.ids)?;
        let steps = h.settings.max_tokens;

        let mut kv = h.kv(backend)?;
        let mut lives = [Live::new(kv.create(0)?, &reference, steps), Live::new(kv.create(0)?, &reference, steps)];
        for live in lives.iter_mut() {
            prefill(h.model, kv.as_mut(), live, &p.ids)?;
        }
        decode_all(h.model, kv.as_mut(), &mut lives)?;
        out.push(case(kv.as_ref(), "same", p, lives.into_iter().map(|l| l.trace).collect()));

        if let Some(j) = ragged_partner(prompts, i) {
            let other = &prompts[j];
            let other_ref = h.reference(&other.ids)?;
            let mut kv = h.kv(backend)?;
            let mut lives = [Live::new(kv.create(0)?, &other_ref, steps), Live::new(kv.create(0)?, &reference, steps)];
            prefill(h.model, kv.as_mut(), &mut lives[0], &other.ids)?;
            prefill(h.model, kv.as_mut(), &mut lives[1], &p.ids)?;
            decode_all(h.model, kv.as_mut(), &mut lives)?;
            let [_, mine] = lives;
            let mut c = case(kv.as_ref(), "ragged", p, vec![mine.trace]);
            c.notes.push(format!("row 0: {} ({} tokens)", other.name, other.ids.len()));
            out.push(c);
        }
    }
    Ok(out)
}
