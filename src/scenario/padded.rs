//! padded: tile-padded prefill. The prompt is padded with the pad token to a multiple of
//! `tile` rows, the logits are taken at the last real token, and the pad rows are trimmed so
//! decode continues at the real length. The reference case of the trim no-op bug: a 37-token
//! prompt writes 64 rows and must trim 27.
//!
//! - `tile`: one sequence, padded on the right.
//! - `batch-right`: two ragged rows in one prefill, each padded on the right to the longest
//!   row's tile; each row trims its own pad count, then both decode together.
//! - `batch-left`: two ragged rows aligned on their last token (the shorter one left-padded,
//!   as batched generation does) then tile-padded on the right. The left pads stay in the
//!   cache for good and must be masked from every real token; RoPE positions skip them.

use super::{
    CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, need_batch, need_masked_prefix, record_step,
    trim_exact,
};
use crate::engine::{EnginePath, Session};
use crate::error::Error;
use crate::model::RowStep;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let tile = setup.settings.tile;
    let pad = setup.pad_token;
    let steps = setup.settings.max_tokens;
    let round = |n: usize| n.div_ceil(tile) * tile;
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let n = p.ids.len();
        attempt(setup, &mut out, &[(p, "tile")], |setup| {
            if tile == 0 {
                return Err(Error::Invalid("tile must be positive".into()));
            }
            let reference = setup.reference(&p.ids)?;
            let mut s = setup.open(path)?;
            let mut live = ForcedSeq::new(s.create(0)?, &reference, steps);
            let t = round(n);
            let mut tokens = p.ids.clone();
            tokens.resize(t, pad);
            let logits = s.forward(&[RowStep { seq: live.seq, tokens, logits_at: n - 1 }])?;
            record_step(&s, &mut [&mut live], &logits, &[n - 1])?;
            trim_exact(&mut s, live.seq, t - n)?;
            live.pads_trimmed = t - n;
            let mut lives = [live];
            decode_all(&mut s, &mut lives)?;
            let [live] = lives;
            let mut c = case(&mut s, "tile", p, &reference, vec![live.trace])?;
            c.notes.push(format!("padded {n} -> {t}, trimmed {}", t - n));
            Ok(vec![c])
        });
        if tile == 0 {
            continue;
        }

        // batch-right: this prompt in row 0, a prompt of another length in row 1.
        if let Some(j) = super::ragged_partner(prompts, i) {
            attempt(setup, &mut out, &[(p, "batch-right")], |setup| {
                need_batch(path.info(), 2)?;
                let other = &prompts[j];
                let reference = setup.reference(&p.ids)?;
                let other_ref = setup.reference(&other.ids)?;
                let t = round(n.max(other.ids.len()));
                let mut s = setup.open(path)?;
                let mut lives =
                    [ForcedSeq::new(s.create(0)?, &reference, steps), ForcedSeq::new(s.create(0)?, &other_ref, steps)];
                let rows: Vec<RowStep> = [(&lives[0], &p.ids), (&lives[1], &other.ids)]
                    .into_iter()
                    .map(|(l, ids)| {
                        let mut tokens = ids.clone();
                        tokens.resize(t, pad);
                        RowStep { seq: l.seq, tokens, logits_at: ids.len() - 1 }
                    })
                    .collect();
                let logits = s.forward(&rows)?;
                {
                    let [a, b] = &mut lives;
                    record_step(&s, &mut [a, b], &logits, &[n - 1, other.ids.len() - 1])?;
                }
                for (live, len) in lives.iter_mut().zip([n, other.ids.len()]) {
                    trim_exact(&mut s, live.seq, t - len)?;
                    live.pads_trimmed = t - len;
                }
                decode_all(&mut s, &mut lives)?;
                let [mine, _] = lives;
                let mut c = case(&mut s, "batch-right", p, &reference, vec![mine.trace])?;
                c.notes.push(format!(
                    "rows {n} and {} padded to {t}, trimmed {} and {}",
                    other.ids.len(),
                    t - n,
                    t - other.ids.len()
                ));
                Ok(vec![c])
            });
        }

        // batch-left: this prompt left-padded next to a longer row (its own tokens twice, so
        // every prompt gets left pads whatever the suite's lengths).
        attempt(setup, &mut out, &[(p, "batch-left")], |setup| {
            need_batch(path.info(), 2)?;
            need_masked_prefix(path.info())?;
            let reference = setup.reference(&p.ids)?;
            let longer: Vec<u32> = p.ids.iter().chain(&p.ids).copied().collect();
            let longer_ref = setup.reference(&longer)?;
            let l = longer.len();
            let t = round(l);
            let masked = l - n;
            let mut s = setup.open(path)?;
            let mut lives = [
                ForcedSeq::new(s.create(masked)?, &reference, steps),
                ForcedSeq::new(s.create(0)?, &longer_ref, steps),
            ];
            let mut mine = vec![pad; masked];
            mine.extend(&p.ids);
            mine.resize(t, pad);
            let mut theirs = longer.clone();
            theirs.resize(t, pad);
            let rows = vec![
                RowStep { seq: lives[0].seq, tokens: mine, logits_at: l - 1 },
                RowStep { seq: lives[1].seq, tokens: theirs, logits_at: l - 1 },
            ];
            let logits = s.forward(&rows)?;
            {
                let [a, b] = &mut lives;
                record_step(&s, &mut [a, b], &logits, &[l - 1, l - 1])?;
            }
            for live in lives.iter_mut() {
                trim_exact(&mut s, live.seq, t - l)?;
                live.pads_trimmed = t - l;
            }
            decode_all(&mut s, &mut lives)?;
            let [mine, _] = lives;
            let mut c = case(&mut s, "batch-left", p, &reference, vec![mine.trace])?;
            c.notes.push(format!("{masked} left pads (masked), {n} real, {} right pads trimmed", t - l));
            Ok(vec![c])
        });
    }
    out
}
