//! The adapter kit for Rust engines (public as `parity::adapter`): an engine implements
//! [`StepEngine`] (its own calls: create, forward, trim, release, share a prefix, report its
//! KV) and [`serve`] speaks the step protocol (docs/step-protocol.md) for it on stdin/stdout.
//! `parity adapter` is parity's runtime served this way; `examples/toy_adapter.rs` is the
//! smallest complete one, built as a small binary as an engine team would in its own
//! repository, with parity as a dependency.
//!
//! Before a request reaches the engine, `serve` checks what the protocol promises and every
//! engine would otherwise check by hand: hello first; live sequence ids (it keeps them from
//! create, share_prefix and release); forward rows (non-empty, one width, distinct sequences,
//! token ids within `vocab_size`, `logits_at` within the tokens). After the engine answers it
//! checks the reply: a logits row of `vocab_size` and a length per row, no more rows removed
//! than asked, new sequence ids that are not live. Logits go out as exact float32.

use std::collections::BTreeSet;
use std::io::{BufRead, Write};

use serde_json::{Value, json};

use super::ShareMode;
use super::protocol::{Envelope, Request, VERSION, WireCapabilities, WireEngine, WireLogits, WireRow, WireStats};
use crate::vocab::Settings;

/// Why an engine did not do what a request asked.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// The path cannot do this: parity skips the case's rows with the sentence.
    #[error("{0}")]
    Unsupported(String),
    /// The request failed: the case's rows fail with the sentence; the adapter keeps serving.
    #[error("{0}")]
    Failed(String),
}

impl From<crate::error::Error> for AdapterError {
    fn from(e: crate::error::Error) -> Self {
        match e {
            crate::error::Error::Unsupported(why) => AdapterError::Unsupported(why),
            other => AdapterError::Failed(other.to_string()),
        }
    }
}

/// hello's answer: the engine, the logits' width and precision, what the path can do.
#[derive(Debug, Clone)]
pub struct Described {
    pub engine: WireEngine,
    pub vocab_size: usize,
    /// The precision the logits are computed in: `float32`, `bfloat16` or `float16`.
    pub dtype: String,
    pub capabilities: WireCapabilities,
}

/// A forward's answer: `[rows, vocab_size]` logits, row-major in request order, and each
/// sequence's length after the step.
#[derive(Debug, Clone)]
pub struct Forwarded {
    pub logits: Vec<f32>,
    pub lengths: Vec<usize>,
}

/// One path of an engine, driven a step at a time. Sequence ids are the engine's choice
/// (never reused within a reset). Every request reaching a method has passed `serve`'s checks.
pub trait StepEngine {
    /// Load (or check) the model for the path named `path` and describe it. `model` is the
    /// checkpoint directory, or the suite's `engine.model` file.
    fn hello(&mut self, model: &str, path: &str, settings: &Settings) -> Result<Described, AdapterError>;

    /// Drop every sequence: a fresh KV store, peak statistics and counters. `faults` are
    /// planted faults to switch on, where the path declared any.
    fn reset(&mut self, faults: &[String]) -> Result<(), AdapterError>;

    /// A new empty sequence whose first `masked_prefix` rows will be left padding.
    fn create(&mut self, masked_prefix: usize) -> Result<u32, AdapterError>;

    /// Append every row's tokens to its sequence in one step; the logits at each `logits_at`.
    fn forward(&mut self, rows: &[WireRow]) -> Result<Forwarded, AdapterError>;

    /// Drop the newest `n` rows; `(removed, length)` as they are, not as asked.
    fn trim(&mut self, seq: u32, n: usize) -> Result<(usize, usize), AdapterError>;

    /// The sequence is finished.
    fn release(&mut self, seq: u32) -> Result<(), AdapterError>;

    /// A new sequence whose first `rows` rows are the donor's, and how: `None` where the path
    /// cannot reuse rows (parity then recomputes them, and the row is vacuous).
    fn share_prefix(&mut self, donor: u32, rows: usize) -> Result<Option<(u32, ShareMode)>, AdapterError> {
        let _ = (donor, rows);
        Err(AdapterError::Unsupported("this path cannot share a prefix".into()))
    }

    /// KV memory and counters (`sequences` is filled in by `serve`).
    fn stats(&mut self) -> Result<WireStats, AdapterError> {
        Err(AdapterError::Unsupported("this path keeps no statistics".into()))
    }
}

/// The protocol state `serve` keeps around an engine.
struct Served {
    vocab: Option<usize>,
    live: BTreeSet<u32>,
}

impl Served {
    fn live(&self, seq: u32, op: &str) -> Result<u32, AdapterError> {
        if self.live.contains(&seq) {
            return Ok(seq);
        }
        let live: Vec<u32> = self.live.iter().copied().collect();
        Err(AdapterError::Failed(format!("{op}: no sequence {seq} (live: {live:?})")))
    }

    fn adopt(&mut self, seq: u32, op: &str) -> Result<u32, AdapterError> {
        if !self.live.insert(seq) {
            return Err(AdapterError::Failed(format!("{op}: the engine returned sequence id {seq}, which is live")));
        }
        Ok(seq)
    }

    fn check_rows(&self, rows: &[WireRow], vocab: usize) -> Result<(), AdapterError> {
        let fail = |m: String| Err(AdapterError::Failed(m));
        let Some(first) = rows.first() else { return fail("forward needs a non-empty list of rows".into()) };
        let mut seen = BTreeSet::new();
        for r in rows {
            self.live(r.seq, "forward")?;
            if !seen.insert(r.seq) {
                return fail(format!("a forward names sequence {} twice", r.seq));
            }
            if r.tokens.is_empty() || r.tokens.len() != first.tokens.len() {
                return fail("every row of a forward must have the same number of tokens (at least one)".into());
            }
            if let Some(t) = r.tokens.iter().find(|&&t| t as usize >= vocab) {
                return fail(format!("sequence {}: token {t} is not below vocab_size {vocab}", r.seq));
            }
            if r.logits_at >= r.tokens.len() {
                return fail(format!(
                    "sequence {}: logits_at {} is not within its {} tokens",
                    r.seq,
                    r.logits_at,
                    r.tokens.len()
                ));
            }
        }
        Ok(())
    }

    fn handle(&mut self, engine: &mut impl StepEngine, request: Request) -> Result<Value, AdapterError> {
        let failed = |m: String| AdapterError::Failed(m);
        if let Request::Hello { protocol, model, path, settings } = &request {
            if *protocol != VERSION {
                return Err(failed(format!("protocol {protocol} requested; this adapter speaks {VERSION}")));
            }
            let d = engine.hello(model, path, settings)?;
            if d.vocab_size == 0 {
                return Err(failed("the engine describes a vocab_size of 0".into()));
            }
            self.vocab = Some(d.vocab_size);
            self.live.clear();
            return Ok(json!({
                "protocol": VERSION,
                "engine": d.engine,
                "vocab_size": d.vocab_size,
                "dtype": d.dtype,
                "capabilities": d.capabilities,
            }));
        }
        let vocab = self.vocab.ok_or_else(|| failed("the first request must be hello".into()))?;
        Ok(match request {
            // Answered above; an arm here keeps the match total without a panic path.
            Request::Hello { .. } | Request::Shutdown => json!({}),
            Request::Reset { faults } => {
                engine.reset(&faults)?;
                self.live.clear();
                json!({})
            }
            Request::Create { masked_prefix } => {
                let seq = engine.create(masked_prefix)?;
                json!({"seq": self.adopt(seq, "create")?})
            }
            Request::Forward { rows } => {
                self.check_rows(&rows, vocab)?;
                let f = engine.forward(&rows)?;
                if f.lengths.len() != rows.len() || f.logits.len() != rows.len() * vocab {
                    return Err(failed(format!(
                        "the engine answered {} rows with {} lengths and {} logits, expected {} and {} ({} x vocab_size {vocab})",
                        rows.len(),
                        f.lengths.len(),
                        f.logits.len(),
                        rows.len(),
                        rows.len() * vocab,
                        rows.len()
                    )));
                }
                json!({"lengths": f.lengths, "logits": WireLogits::encode(&f.logits, rows.len(), vocab)})
            }
            Request::Trim { seq, n } => {
                let (removed, len) = engine.trim(self.live(seq, "trim")?, n)?;
                if removed > n {
                    return Err(failed(format!("the engine removed {removed} rows when {n} were asked")));
                }
                json!({"removed": removed, "len": len})
            }
            Request::Release { seq } => {
                engine.release(self.live(seq, "release")?)?;
                self.live.remove(&seq);
                json!({})
            }
            Request::SharePrefix { donor, rows } => {
                match engine.share_prefix(self.live(donor, "share_prefix")?, rows)? {
                    Some((seq, mode)) => {
                        let mode = match mode {
                            ShareMode::Storage => "share",
                            ShareMode::Copy => "copy",
                        };
                        json!({"seq": self.adopt(seq, "share_prefix")?, "mode": mode})
                    }
                    None => json!({"seq": null}),
                }
            }
            Request::Stats => {
                let stats = engine.stats()?;
                json!({"stats": WireStats { sequences: self.live.len(), ..stats }})
            }
        })
    }
}

/// Serve `engine` from `input` until `shutdown` or the end of input: one JSON request per
/// line, one reply per line on `output`. Failed and unsupported requests are replies; only an
/// I/O error ends the loop with an error.
pub fn serve(engine: &mut impl StepEngine, input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
    let mut served = Served { vocab: None, live: BTreeSet::new() };
    for line in input.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let (id, result, stop) = match serde_json::from_str::<Envelope>(&line) {
            Ok(env) => {
                let stop = env.request == Request::Shutdown;
                (json!(env.id), served.handle(engine, env.request), stop)
            }
            Err(e) => {
                // Echo the id when the line has one, so the client can match the error.
                let id = serde_json::from_str::<Value>(&line).ok().and_then(|v| v.get("id").cloned());
                (id.unwrap_or(Value::Null), Err(AdapterError::Failed(format!("malformed request: {e}"))), false)
            }
        };
        let mut reply = match result {
            Ok(Value::Object(fields)) => Value::Object(fields),
            Ok(_) => json!({}),
            Err(AdapterError::Unsupported(why)) => json!({"ok": false, "unsupported": true, "error": why}),
            Err(AdapterError::Failed(why)) => json!({"ok": false, "error": why}),
        };
        if let Value::Object(m) = &mut reply {
            m.insert("id".into(), id);
            m.entry("ok").or_insert(Value::Bool(true));
        }
        writeln!(output, "{reply}")?;
        output.flush()?;
        if stop {
            break;
        }
    }
    Ok(())
}
