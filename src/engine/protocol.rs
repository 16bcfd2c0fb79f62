//! The step protocol's wire format (docs/step-protocol.md), shared by parity's client
//! ([`super::process`]) and parity's own adapter ([`super::adapter`]) so the two cannot drift.

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::kv::Counters;
use crate::kv::KvStats;
use crate::vocab::Settings;

pub const VERSION: u32 = 1;

/// A request: its `id` and the operation, one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    pub id: u64,
    #[serde(flatten)]
    pub request: Request,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Hello { protocol: u32, model: String, path: String, settings: Settings },
    Reset { faults: Vec<String> },
    Create { masked_prefix: usize },
    Forward { rows: Vec<WireRow> },
    Trim { seq: u32, n: usize },
    Release { seq: u32 },
    SharePrefix { donor: u32, rows: usize },
    Stats,
    Shutdown,
}

impl Request {
    /// The operation's name, for error messages.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "hello",
            Request::Reset { .. } => "reset",
            Request::Create { .. } => "create",
            Request::Forward { .. } => "forward",
            Request::Trim { .. } => "trim",
            Request::Release { .. } => "release",
            Request::SharePrefix { .. } => "share_prefix",
            Request::Stats => "stats",
            Request::Shutdown => "shutdown",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WireRow {
    pub seq: u32,
    pub tokens: Vec<u32>,
    pub logits_at: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HelloReply {
    pub protocol: u32,
    pub engine: WireEngine,
    pub vocab_size: usize,
    pub dtype: String,
    pub capabilities: WireCapabilities,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireEngine {
    pub name: String,
    pub version: String,
    /// The device the adapter computes on (`cpu`, `gpu`; optional): reports record it beside
    /// the run's own, so a comparison across devices names both sides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireCapabilities {
    pub masked_prefix: bool,
    pub share_prefix: bool,
    pub max_batch: Option<usize>,
    pub stats: bool,
    #[serde(default)]
    pub faults: Vec<String>,
    pub block_size: Option<usize>,
    /// Bytes of K and V per row over all layers that the path's layout promises (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_row_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateReply {
    pub seq: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForwardReply {
    pub lengths: Vec<usize>,
    pub logits: WireLogits,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrimReply {
    pub removed: usize,
    pub len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShareReply {
    pub seq: Option<u32>,
    #[serde(default)]
    pub mode: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReply {
    pub stats: WireStats,
}

/// KV statistics on the wire: [`KvStats`]' fields (each optional, absent is zero), the
/// number of live sequences, and (optional) what the engine counted since the last `reset`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct WireStats {
    #[serde(flatten)]
    pub kv: KvStats,
    #[serde(default)]
    pub sequences: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<Counters>,
}

/// `[rows, vocab]` float32 logits: little-endian bytes, standard base64. Text decimals would
/// round; these survive the trip bit for bit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WireLogits {
    pub dtype: String,
    pub shape: Vec<usize>,
    pub b64: String,
}

impl WireLogits {
    pub fn encode(values: &[f32], rows: usize, vocab: usize) -> Self {
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        WireLogits {
            dtype: "f32".into(),
            shape: vec![rows, vocab],
            b64: base64::engine::general_purpose::STANDARD.encode(bytes),
        }
    }

    /// The values, checked against the shape parity expects.
    pub fn decode(&self, rows: usize, vocab: usize) -> Result<Vec<f32>, String> {
        if self.dtype != "f32" {
            return Err(format!("logits dtype `{}`, expected \"f32\"", self.dtype));
        }
        if self.shape != [rows, vocab] {
            return Err(format!("logits of shape {:?}, expected [{rows}, {vocab}] (rows x vocab_size)", self.shape));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.b64.as_bytes())
            .map_err(|e| format!("logits are not valid base64: {e}"))?;
        if bytes.len() != rows * vocab * 4 {
            return Err(format!(
                "logits carry {} bytes, expected {} ({rows} x {vocab} float32)",
                bytes.len(),
                rows * vocab * 4
            ));
        }
        Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The protocol's promise: float32 logits survive the trip bit for bit, NaN and the
    /// extremes included (a text encoding would round them).
    #[test]
    fn logits_round_trip_bit_for_bit() {
        let values =
            [0.1f32, -0.0, f32::MIN_POSITIVE, f32::MAX, f32::NAN, f32::INFINITY, 1.0 + f32::EPSILON, -3.25e-20];
        let wire = WireLogits::encode(&values, 2, 4);
        let json = serde_json::to_string(&wire).unwrap();
        let back: WireLogits = serde_json::from_str(&json).unwrap();
        let decoded = back.decode(2, 4).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&decoded), bits(&values));
    }

    #[test]
    fn wrong_sized_logits_are_refused_with_both_shapes() {
        let wire = WireLogits::encode(&[1.0; 6], 2, 3);
        let err = wire.decode(2, 4).unwrap_err();
        assert!(err.contains("[2, 3]") && err.contains("[2, 4]"), "{err}");
        let mut short = wire.clone();
        short.shape = vec![2, 4];
        assert!(short.decode(2, 4).unwrap_err().contains("24 bytes, expected 32"));
    }

    #[test]
    fn requests_are_one_flat_json_object_with_op() {
        let e = Envelope { id: 7, request: Request::Trim { seq: 2, n: 27 } };
        assert_eq!(serde_json::to_string(&e).unwrap(), r#"{"id":7,"op":"trim","seq":2,"n":27}"#);
        let back: Envelope = serde_json::from_str(r#"{"id": 3, "op": "stats"}"#).unwrap();
        assert_eq!(back.request, Request::Stats);
    }
}
