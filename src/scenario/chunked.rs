//! chunked: prefill in chunks of C tokens, each chunk a forward that continues the sequence
//! (causal attention aligned to the chunk's offset), then decode.

use super::{CaseOutput, ForcedSeq, Prompt, Setup, attempt, case, decode_all, record_step};
use crate::engine::{EnginePath, Session};
use crate::error::Error;
use crate::model::RowStep;

pub fn run(setup: &mut Setup, path: &mut dyn EnginePath, prompts: &[Prompt]) -> Vec<CaseOutput> {
    let c = setup.settings.chunk;
    let name = format!("c{c}");
    let mut out = Vec::new();
    for p in prompts {
        attempt(setup, &mut out, &[(p, &name)], |setup| {
            if c == 0 {
                return Err(Error::Invalid("chunk must be positive".into()));
            }
            let reference = setup.reference(&p.ids)?;
            let mut s = setup.open(path)?;
            let mut live = ForcedSeq::new(s.create(0)?, &reference, setup.settings.max_tokens);
            let chunks: Vec<&[u32]> = p.ids.chunks(c).collect();
            let last = chunks.len() - 1;
            for (k, chunk) in chunks.iter().enumerate() {
                let logits = s.forward(&[RowStep::new(live.seq, chunk.to_vec())])?;
                if k == last {
                    record_step(&s, &mut [&mut live], &logits, &[p.ids.len() - 1])?;
                }
            }
            let mut lives = [live];
            decode_all(&mut s, &mut lives)?;
            let [live] = lives;
            let mut out_case = case(&mut s, name.clone(), p, &reference, vec![live.trace])?;
            let sizes: Vec<String> = chunks.iter().map(|ch| ch.len().to_string()).collect();
            out_case.notes.push(format!("chunks {}", sizes.join("+")));
            Ok(vec![out_case])
        });
    }
    out
}
