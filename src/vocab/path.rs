//! Names of what runs a path: parity's own builtin paths (a KV backend and an attention mode)
//! and the engine that served a path, as reports record it.

use serde::{Deserialize, Serialize};

use crate::faults;
use crate::kv::Backend;
use crate::model::AttentionMode;

/// Which engine served a path, as reports record it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineId {
    /// `builtin`, `process` or `openai`.
    pub kind: String,
    pub name: String,
    pub version: String,
}

impl EngineId {
    pub fn builtin() -> Self {
        EngineId { kind: "builtin".into(), name: "parity".into(), version: env!("CARGO_PKG_VERSION").into() }
    }
}

/// A builtin path: a KV backend and an attention mode, named `dense`, `paged` (batched) or
/// `dense-rowwise`, `paged-rowwise`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BuiltinPath {
    pub backend: Backend,
    pub attention: AttentionMode,
}

impl BuiltinPath {
    /// Every path, in the order reports list them.
    pub const ALL: [BuiltinPath; 4] = [
        BuiltinPath::batched(Backend::Dense),
        BuiltinPath::batched(Backend::Paged),
        BuiltinPath { backend: Backend::Dense, attention: AttentionMode::RowByRow },
        BuiltinPath { backend: Backend::Paged, attention: AttentionMode::RowByRow },
    ];

    /// What a suite runs when it names no paths: the batched ones (rows and snapshots of
    /// suites written before row-by-row was a path stay as they were).
    pub const DEFAULT: [BuiltinPath; 2] = [BuiltinPath::batched(Backend::Dense), BuiltinPath::batched(Backend::Paged)];

    pub const fn batched(backend: Backend) -> Self {
        BuiltinPath { backend, attention: AttentionMode::Batched }
    }

    pub fn name(self) -> String {
        match self.attention {
            AttentionMode::Batched => self.backend.name().to_string(),
            AttentionMode::RowByRow => format!("{}-rowwise", self.backend.name()),
        }
    }

    /// The planted faults this path has code for: the batching faults live in the batched
    /// attention only (row by row there is no offsets array, no single RoPE call, no shared
    /// mask to get wrong).
    pub fn faults(self) -> Vec<faults::Fault> {
        use faults::Fault::{BatchRowSwap, RaggedMaskWide, RopeBatchAlias};
        let batched_only = [RopeBatchAlias, BatchRowSwap, RaggedMaskWide];
        faults::ALL
            .iter()
            .copied()
            .filter(|f| self.attention == AttentionMode::Batched || !batched_only.contains(f))
            .collect()
    }
}

impl From<Backend> for BuiltinPath {
    fn from(backend: Backend) -> Self {
        BuiltinPath::batched(backend)
    }
}

impl std::str::FromStr for BuiltinPath {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        BuiltinPath::ALL.into_iter().find(|p| p.name() == s).ok_or_else(|| {
            let names: Vec<String> = BuiltinPath::ALL.iter().map(|p| p.name()).collect();
            format!("unknown builtin path `{s}`; expected {}", names.join(", "))
        })
    }
}
