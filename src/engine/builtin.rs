//! The builtin engine: parity's own MLX runtime ([`Model`]) over its two KV backends, in
//! process. Paths `dense` and `paged` run batched attention (the fast path engines ship, and
//! where their batching bugs live); `dense-rowwise` and `paged-rowwise` run attention row by
//! row (the simplest correct form), so "batched vs row-by-row" is a comparison a suite can ask
//! for. The dense path is the default reference.

use mlx_rs::Array;

use super::{Capabilities, EngineId, EnginePath, PathInfo, Session, ShareMode, Trace};
use crate::error::Result;
use crate::faults::{self, Faults};
use crate::kv::{Backend, DenseCache, KvCache, KvStats, PagedBlockPool, PoolOptions, SeqId};
use crate::model::{AttentionMode, Model, RowStep};
use crate::scenario::Settings;

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

/// One builtin path with the settings its pools are built with.
pub struct Builtin<'m> {
    model: &'m Model,
    path: BuiltinPath,
    settings: Settings,
    info: PathInfo,
    /// The KV store of the current session (a session borrows it).
    kv: Option<Box<dyn KvCache>>,
}

impl<'m> Builtin<'m> {
    pub fn new(model: &'m Model, path: impl Into<BuiltinPath>, settings: &Settings) -> Self {
        let path = path.into();
        let backend = path.backend;
        let info = PathInfo {
            name: path.name(),
            engine: EngineId::builtin(),
            vocab_size: model.config.vocab_size,
            dtype: model.dtype,
            capabilities: Capabilities {
                masked_prefix: true,
                share_prefix: true,
                max_batch: None,
                stats: true,
                block_size: (backend == Backend::Paged).then_some(settings.block_size),
                faults: path.faults(),
            },
        };
        Builtin { model, path, settings: settings.clone(), info, kv: None }
    }

    pub fn path(&self) -> BuiltinPath {
        self.path
    }

    /// A fresh KV store of this path's backend with `faults` planted in it.
    pub fn kv(&self, faults: Faults) -> Result<Box<dyn KvCache>> {
        Ok(match self.path.backend {
            Backend::Dense => Box::new(DenseCache::new(self.model.kv_shape())),
            Backend::Paged => Box::new(PagedBlockPool::new(
                self.model.kv_shape(),
                PoolOptions {
                    block_size: self.settings.block_size,
                    max_blocks: self.settings.pool_blocks,
                    poison: self.settings.poison,
                    ..PoolOptions::default()
                },
                faults,
            )?),
        })
    }
}

impl EnginePath for Builtin<'_> {
    fn info(&self) -> &PathInfo {
        &self.info
    }

    fn session(&mut self, faults: Faults) -> Result<Box<dyn Session + '_>> {
        // A row-by-row path has no code for the batching faults: a skip, never a quiet pass.
        self.info.check_faults(faults)?;
        let kv = self.kv(faults)?;
        let kv = self.kv.insert(kv);
        Ok(Box::new(BuiltinSession::new(self.model, kv.as_mut(), faults, self.path.attention)))
    }
}

/// The model stepping over one KV store with a set of planted faults and an attention mode.
pub struct BuiltinSession<'a> {
    model: &'a Model,
    kv: &'a mut dyn KvCache,
    faults: Faults,
    attention: AttentionMode,
}

impl<'a> BuiltinSession<'a> {
    pub fn new(model: &'a Model, kv: &'a mut dyn KvCache, faults: Faults, attention: AttentionMode) -> Self {
        BuiltinSession { model, kv, faults, attention }
    }
}

impl Session for BuiltinSession<'_> {
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        self.kv.create(masked_prefix)
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        self.kv.len(seq)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        self.kv.masked_prefix(seq)
    }

    fn forward(&mut self, rows: &[RowStep]) -> Result<Array> {
        // Sessions of one model interleave (a reference is computed in the middle of a
        // faulty path's case): the faults are this session's, set for each of its steps.
        self.model.set_faults(self.faults);
        self.model.forward_mode(self.kv, rows, self.attention)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        self.kv.trim(seq, n)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.kv.release(seq)
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        Ok(self.kv.share_prefix(donor, rows)?.map(|seq| (seq, ShareMode::Storage)))
    }

    fn stats(&mut self) -> Result<Option<KvStats>> {
        Ok(Some(self.kv.stats()))
    }

    fn audit(&mut self) -> Result<Option<String>> {
        Ok(self.kv.audit().err().map(|e| e.to_string()))
    }
}

/// Greedy generation on the builtin runtime over `kv`, no faults (`parity generate`, tests).
pub fn generate(model: &Model, kv: &mut dyn KvCache, prompt: &[u32], max_tokens: usize) -> Result<(SeqId, Trace)> {
    super::generate(&mut BuiltinSession::new(model, kv, Faults::NONE, AttentionMode::default()), prompt, max_tokens)
}
