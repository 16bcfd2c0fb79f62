//! A toy engine served over parity's step protocol with the Rust adapter kit
//! (`parity::adapter`): the shape of an adapter an engine team writes as a small binary in its
//! own repository, with parity as a dependency. `tests/adapter_kit.rs` builds it and runs
//! `suites/kit.toml` on it.
//!
//!     cargo run --example toy_adapter -- --path alone|batched
//!
//! Its "model" is a pure function of a sequence's tokens so far (a seeded hash of the history),
//! its "KV cache" that history, 8 bytes a row. `alone` runs a forward's rows one model call
//! each; `batched` all in one. The same engine as `adapters/toy_adapter.py`, on the Rust kit.

use std::collections::BTreeMap;
use std::io::{BufReader, stdin, stdout};

use parity::ShareMode;
use parity::adapter::{AdapterError, Described, Forwarded, StepEngine, serve};
use parity::kv::{Counters, KvStats};
use parity::protocol::{WireCapabilities, WireEngine, WireRow, WireStats};
use parity::vocab::Settings;

const ROW_BYTES: u64 = 8;

struct Toy {
    batched: bool,
    vocab: usize,
    seqs: BTreeMap<u32, Vec<u32>>,
    next: u32,
    peak_rows: u64,
    counts: Counters,
}

impl Toy {
    /// The logits after `history`: a splitmix-style hash of the last 64 tokens and the length,
    /// spread over the vocabulary. The same history gives the same logits, however it was fed.
    fn logits(&self, history: &[u32]) -> Vec<f32> {
        let mut seed: u64 = 1469598103934665603;
        for &t in &history[history.len().saturating_sub(64)..] {
            seed = (seed ^ u64::from(t)).wrapping_mul(1099511628211);
        }
        seed ^= history.len() as u64;
        (0..self.vocab)
            .map(|v| {
                let mut z = seed.wrapping_add((v as u64 + 1).wrapping_mul(0x9e3779b97f4a7c15));
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 12.0 - 6.0
            })
            .collect()
    }

    fn rows(&self) -> u64 {
        self.seqs.values().map(|h| h.len() as u64).sum()
    }

    /// One model call over `rows`.
    fn call(&mut self, rows: &[WireRow], logits: &mut Vec<f32>) {
        Counters::add(&mut self.counts.forwards, 1);
        self.counts.max_rows = Some(self.counts.max_rows.unwrap_or(0).max(rows.len() as u64));
        for r in rows {
            let history = self.seqs.entry(r.seq).or_default();
            let before = history.len();
            history.extend(&r.tokens);
            let seen = history[..before + r.logits_at + 1].to_vec();
            Counters::add(&mut self.counts.tokens, r.tokens.len() as u64);
            logits.extend(self.logits(&seen));
        }
        self.peak_rows = self.peak_rows.max(self.rows());
    }
}

fn failed(m: String) -> AdapterError {
    AdapterError::Failed(m)
}

impl StepEngine for Toy {
    fn hello(&mut self, model: &str, _path: &str, _settings: &Settings) -> Result<Described, AdapterError> {
        let config = std::path::Path::new(model).join("config.json");
        let text = std::fs::read_to_string(&config).map_err(|e| failed(format!("{}: {e}", config.display())))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| failed(format!("{}: {e}", config.display())))?;
        self.vocab =
            json["vocab_size"].as_u64().ok_or_else(|| failed(format!("{}: no vocab_size", config.display())))? as usize;
        Ok(Described {
            engine: WireEngine { name: "toy-rs".into(), version: "1".into(), device: None },
            vocab_size: self.vocab,
            dtype: "float32".into(),
            capabilities: WireCapabilities {
                masked_prefix: false,
                share_prefix: true,
                max_batch: None,
                stats: true,
                faults: Vec::new(),
                block_size: None,
                kv_row_bytes: Some(ROW_BYTES),
            },
        })
    }

    fn reset(&mut self, _faults: &[String]) -> Result<(), AdapterError> {
        self.seqs.clear();
        self.peak_rows = 0;
        self.counts = Counters {
            forwards: Some(0),
            max_rows: Some(0),
            tokens: Some(0),
            rows_trimmed: Some(0),
            rows_copied: Some(0),
            ..Counters::default()
        };
        Ok(())
    }

    fn create(&mut self, masked_prefix: usize) -> Result<u32, AdapterError> {
        if masked_prefix > 0 {
            return Err(AdapterError::Unsupported("the toy has no masked prefix".into()));
        }
        self.next += 1;
        self.seqs.insert(self.next, Vec::new());
        Ok(self.next)
    }

    fn forward(&mut self, rows: &[WireRow]) -> Result<Forwarded, AdapterError> {
        let mut logits = Vec::with_capacity(rows.len() * self.vocab);
        if self.batched {
            self.call(rows, &mut logits);
        } else {
            for r in rows {
                self.call(std::slice::from_ref(r), &mut logits);
            }
        }
        let lengths = rows.iter().map(|r| self.seqs[&r.seq].len()).collect();
        Ok(Forwarded { logits, lengths })
    }

    fn trim(&mut self, seq: u32, n: usize) -> Result<(usize, usize), AdapterError> {
        let history = self.seqs.entry(seq).or_default();
        let removed = n.min(history.len());
        history.truncate(history.len() - removed);
        let len = history.len();
        Counters::add(&mut self.counts.rows_trimmed, removed as u64);
        Ok((removed, len))
    }

    fn release(&mut self, seq: u32) -> Result<(), AdapterError> {
        self.seqs.remove(&seq);
        Ok(())
    }

    fn share_prefix(&mut self, donor: u32, rows: usize) -> Result<Option<(u32, ShareMode)>, AdapterError> {
        let history = self.seqs.get(&donor).cloned().unwrap_or_default();
        if rows > history.len() {
            return Err(failed(format!("sequence {donor} has {} rows, cannot share {rows}", history.len())));
        }
        let seq = self.create(0)?;
        self.seqs.insert(seq, history[..rows].to_vec());
        Counters::add(&mut self.counts.rows_copied, rows as u64);
        self.peak_rows = self.peak_rows.max(self.rows());
        Ok(Some((seq, ShareMode::Copy)))
    }

    fn stats(&mut self) -> Result<WireStats, AdapterError> {
        let live = self.rows() * ROW_BYTES;
        let kv = KvStats {
            bytes_live: live,
            bytes_in_use: live,
            bytes_reserved: live,
            peak_bytes_in_use: self.peak_rows * ROW_BYTES,
            ..KvStats::default()
        };
        Ok(WireStats { kv, sequences: 0, counters: Some(self.counts) })
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let batched = match args.iter().position(|a| a == "--path").and_then(|i| args.get(i + 1)).map(String::as_str) {
        Some("batched") => true,
        Some("alone") => false,
        other => {
            eprintln!("usage: toy_adapter --path alone|batched (got {other:?})");
            std::process::exit(2);
        }
    };
    let mut toy = Toy { batched, vocab: 0, seqs: BTreeMap::new(), next: 0, peak_rows: 0, counts: Counters::default() };
    toy.reset(&[]).map_err(|e| std::io::Error::other(e.to_string()))?;
    serve(&mut toy, BufReader::new(stdin().lock()), stdout().lock())
}
