//! What runs produce: prompts as token ids, a reference's trace, a path's trace with where each
//! step sat in the cache layout, and a server's top-k logprobs per step. Comparisons read
//! them; scenarios and engines write them.

use mlx_rs::Array;
use serde::Serialize;

/// A prompt as the scenarios see it: a name for reports and its token ids.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub name: String,
    pub ids: Vec<u32>,
}

/// The tokens a path produced and, per step, the full logits row that selected each token
/// (kept on the device; comparisons reduce them there).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub tokens: Vec<u32>,
    pub logits: Vec<Array>,
}

/// Layout facts about one step of a path, for locating a divergence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepLayout {
    /// KV row of the token fed at this step (the last prompt token at step 0).
    pub kv_row: usize,
    /// RoPE position of that token (kv_row minus any masked left padding).
    pub position: usize,
    pub batch_row: usize,
    pub batch_size: usize,
    /// Pad rows trimmed before this step (padded scenario).
    pub pads_trimmed: usize,
    /// Rows rolled back (decoded, then trimmed) before this step (rollback scenario).
    pub rolled_back: usize,
}

/// One sequence's run: per step, its greedy choice, its logits and where it was.
#[derive(Debug, Clone, Default)]
pub struct PathTrace {
    pub tokens: Vec<u32>,
    pub logits: Vec<Array>,
    pub layout: Vec<StepLayout>,
}

/// What a request-level engine (kind = "openai") returns per generated token: the top-k
/// `(token, logprob)` the server reported, sorted most probable first (ties by token id, as
/// an argmax picks them). The greedy token is the first entry, whatever the server presented.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogprobTrace {
    pub tokens: Vec<u32>,
    pub steps: Vec<Vec<(u32, f64)>>,
}
