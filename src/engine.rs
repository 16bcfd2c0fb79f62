//! Greedy decoding over any backend: prefill a prompt, then decode one token at a time.
//! Scenarios build richer schedules on the same [`Model::forward`].

use mlx_rs::Array;

use crate::error::Result;
use crate::kv::{KvCache, SeqId};
use crate::model::{Model, RowStep};

/// The tokens a path produced and, per step, the full logits row that selected each token
/// (kept on the device; comparisons reduce them there).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub tokens: Vec<u32>,
    pub logits: Vec<Array>,
}

/// Argmax of each row of `[B, vocab]` logits, brought to the host as B integers.
pub fn greedy(logits: &Array) -> Result<Vec<u32>> {
    let ids = mlx_rs::ops::indexing::argmax_axis(logits, -1, false)?;
    ids.eval()?;
    Ok(ids.as_slice::<u32>().to_vec())
}

/// A small array's values on the host as f32 (contiguous copy first; views are not).
pub fn host_f32(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32)?.contiguous()?;
    a.eval()?;
    Ok(a.as_slice::<f32>().to_vec())
}

/// Split `[B, vocab]` into B rows of `[vocab]`.
pub fn rows(logits: &Array) -> Result<Vec<Array>> {
    use mlx_rs::ops::indexing::IndexOp;
    let b = logits.shape()[0];
    Ok((0..b).map(|i| logits.index(i)).collect())
}

/// Prefill `prompt` into a fresh sequence and decode `max_tokens` greedy tokens.
pub fn generate(model: &Model, kv: &mut dyn KvCache, prompt: &[u32], max_tokens: usize) -> Result<(SeqId, Trace)> {
    let seq = kv.create(0)?;
    let mut trace = Trace::default();
    let mut logits = model.forward(kv, &[RowStep::new(seq, prompt.to_vec())])?;
    for _ in 0..max_tokens {
        let next = greedy(&logits)?[0];
        trace.tokens.push(next);
        trace.logits.push(rows(&logits)?.remove(0));
        if trace.tokens.len() == max_tokens {
            break;
        }
        logits = model.forward(kv, &[RowStep::new(seq, vec![next])])?;
    }
    Ok((seq, trace))
}
