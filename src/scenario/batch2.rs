//! batch2: two sequences prefilled separately, then decoded together in one batched forward.
//!
//! - `same`: the prompt twice. Both rows sit at the same position, so a row that is rotated at
//!   `offset + b` (RoPE stride aliasing) is the only thing that can tell them apart.
//! - `ragged`: the prompt in batch row 1 next to a prompt of another length in row 0, so the
//!   rows' positions differ and exchanging or sharing them shows.

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, need_batch, prefill, ragged_partner};
use crate::engine::{EnginePath, Session};

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let mut out = Vec::new();
    let steps = setup.settings.max_tokens;
    for (i, p) in prompts.iter().enumerate() {
        attempt(setup, &mut out, &[(p, "same")], |setup| {
            need_batch(path.info(), 2)?;
            let reference = setup.reference(&p.ids)?;
            let mut s = setup.open(path)?;
            let mut lives =
                [ForcedSeq::new(s.create(0)?, &reference, steps), ForcedSeq::new(s.create(0)?, &reference, steps)];
            for live in lives.iter_mut() {
                prefill(&mut s, live, &p.ids)?;
            }
            decode_all(&mut s, &mut lives)?;
            Ok(vec![case(&mut s, "same", p, &reference, lives.into_iter().map(|l| l.trace).collect())?])
        });

        if let Some(j) = ragged_partner(prompts, i) {
            attempt(setup, &mut out, &[(p, "ragged")], |setup| {
                need_batch(path.info(), 2)?;
                let other = &prompts[j];
                let reference = setup.reference(&p.ids)?;
                let other_ref = setup.reference(&other.ids)?;
                let mut s = setup.open(path)?;
                let mut lives =
                    [ForcedSeq::new(s.create(0)?, &other_ref, steps), ForcedSeq::new(s.create(0)?, &reference, steps)];
                prefill(&mut s, &mut lives[0], &other.ids)?;
                prefill(&mut s, &mut lives[1], &p.ids)?;
                decode_all(&mut s, &mut lives)?;
                let [_, mine] = lives;
                let mut c = case(&mut s, "ragged", p, &reference, vec![mine.trace])?;
                c.notes.push(format!("row 0: {} ({} tokens)", other.name, other.ids.len()));
                Ok(vec![c])
            });
        }
    }
    out
}
