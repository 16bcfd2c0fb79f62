//! The builtin engine: parity's own MLX runtime ([`Model`]) over its two KV backends, in
//! process. Paths `dense` and `paged` run batched attention (the fast path engines ship, and
//! where their batching bugs live); `dense-rowwise` and `paged-rowwise` run attention row by
//! row (the simplest correct form), so "batched vs row-by-row" is a comparison a suite can ask
//! for. The dense path is the default reference.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use mlx_rs::Array;

use super::adapter::{AdapterError, Described, Forwarded, StepEngine};
use super::protocol::{WireCapabilities, WireEngine, WireRow, WireStats};
use super::{Capabilities, EnginePath, PathInfo, Session, ShareMode};
use crate::array::host_f32;
use crate::error::Result;
use crate::faults::{Fault, Faults};
use crate::kv::{Backend, Counters, DenseCache, KvCache, KvStats, PagedBlockPool, PoolOptions, SeqId};
use crate::model::{AttentionMode, Model, RowStep};
use crate::vocab::{BuiltinPath, EngineId, Settings, Trace};

/// One builtin path with the settings its pools are built with.
pub struct Builtin<'m> {
    model: &'m Model,
    path: BuiltinPath,
    settings: Settings,
    info: PathInfo,
    /// The KV store of the current session and the model calls made on it (a session
    /// borrows both).
    kv: Option<(Box<dyn KvCache>, Counters)>,
    /// First prefills, shared with the other paths of the same loaded model (none: each
    /// session computes its own).
    prefills: Option<&'m Prefills>,
}

/// The first forward of fresh sessions, kept for the next session that makes the same one.
///
/// A session's first forward, one row into a store whose sequences are all new and unmasked, is
/// a function of the path (backend and attention), the faults planted, the sequences created
/// and the row alone. Every scenario starts that way (a single prompt, the first row of a batch,
/// a rollback, the reference and its noise floor), so a suite prefills each prompt dozens of
/// times on each path, the same computation each time (on the CPU, where MLX computes the same
/// bits on every run: `Engine` shares these only there). Kept here are the logits, the store as the forward left it and the calls counted; the
/// next such forward gets copies and computes nothing, and whatever it does next runs for real
/// on its copy. Shared by every path of one loaded model, so that the dense path's prefills are
/// the reference's (the key names the path: a path never gets another's). Bounded by the bytes
/// the kept stores reserve, the least recently used dropped first.
#[derive(Default)]
pub struct Prefills {
    kept: RefCell<VecDeque<(PrefillKey, Rc<Prefilled>)>>,
    served: std::cell::Cell<u64>,
}

#[derive(PartialEq)]
struct PrefillKey {
    path: BuiltinPath,
    faults: Faults,
    /// Sequences the store held (created, nothing written: a batch's rows are created before
    /// the first is prefilled), and the one prefilled.
    created: u32,
    seq: SeqId,
    tokens: Vec<u32>,
    logits_at: usize,
}

struct Prefilled {
    logits: Array,
    kv: Box<dyn KvCache>,
    calls: Counters,
}

/// What the kept stores may reserve in all: a suite's prompts on its paths (SmolLM2's suite keeps
/// 25 stores of about 11.5 MiB each), not a corpus's every text.
const PREFILLS_MAX_BYTES: u64 = 512 << 20;

impl Prefills {
    /// Forwards served from a kept prefill instead of computed.
    pub fn served(&self) -> u64 {
        self.served.get()
    }

    /// The kept prefill of `key`, now the most recently used.
    fn get(&self, key: &PrefillKey) -> Option<Rc<Prefilled>> {
        let mut kept = self.kept.borrow_mut();
        let at = kept.iter().position(|(k, _)| k == key)?;
        let entry = kept.remove(at)?;
        let p = Rc::clone(&entry.1);
        kept.push_back(entry);
        self.served.set(self.served.get() + 1);
        Some(p)
    }

    fn keep(&self, key: PrefillKey, prefilled: Prefilled) {
        let mut kept = self.kept.borrow_mut();
        kept.push_back((key, Rc::new(prefilled)));
        let bytes = |kept: &VecDeque<(PrefillKey, Rc<Prefilled>)>| -> u64 {
            kept.iter().map(|(_, p)| p.kv.stats().bytes_reserved).sum()
        };
        while kept.len() > 1 && bytes(&kept) > PREFILLS_MAX_BYTES {
            kept.pop_front();
        }
    }
}

impl<'m> Builtin<'m> {
    pub fn new(model: &'m Model, path: impl Into<BuiltinPath>, settings: &Settings) -> Self {
        let path = path.into();
        let backend = path.backend;
        let info = PathInfo {
            name: path.name(),
            engine: EngineId::builtin(crate::environment::device()),
            vocab_size: model.config.vocab_size,
            dtype: model.dtype,
            capabilities: Capabilities {
                masked_prefix: true,
                share_prefix: true,
                max_batch: None,
                stats: true,
                block_size: (backend == Backend::Paged).then_some(settings.block_size),
                kv_row_bytes: Some(model.kv_shape().row_bytes()),
                faults: path.faults(),
            },
        };
        Builtin { model, path, settings: settings.clone(), info, kv: None, prefills: None }
    }

    /// This path with its sessions' first prefills kept in, and taken from, `prefills`.
    pub fn sharing(self, prefills: &'m Prefills) -> Self {
        Builtin { prefills: Some(prefills), ..self }
    }

    pub fn path(&self) -> BuiltinPath {
        self.path
    }

    /// A session over a fresh store with `faults` planted, its first prefill kept in and taken
    /// from `prefills` when given.
    fn open(&mut self, faults: Faults, prefills: Option<&'m Prefills>) -> Result<Box<dyn Session + '_>> {
        // A row-by-row path has no code for the batching faults: a skip, never a quiet pass.
        self.info.check_faults(faults)?;
        let kv = self.kv(faults)?;
        let (kv, calls) = self.kv.insert((kv, Counters::default()));
        let mut session = BuiltinSession::new(self.model, kv.as_mut(), calls, faults, self.path.attention);
        session.first = prefills.map(|p| (p, self.path, First::Created(0)));
        Ok(Box::new(session))
    }

    /// A fresh KV store of this path's backend with `faults` planted in it.
    pub fn kv(&self, faults: Faults) -> Result<Box<dyn KvCache>> {
        Ok(match self.path.backend {
            Backend::Dense => Box::new(DenseCache::new(self.model.kv_shape())),
            Backend::Paged => Box::new(PagedBlockPool::windowed(
                self.model.kv_shape(),
                &self.model.layer_windows(),
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
        let prefills = self.prefills;
        self.open(faults, prefills)
    }

    fn computed_session(&mut self, faults: Faults) -> Result<Box<dyn Session + '_>> {
        self.open(faults, None)
    }
}

/// The model stepping over one KV store with a set of planted faults and an attention mode.
pub struct BuiltinSession<'a> {
    model: &'a Model,
    kv: &'a mut dyn KvCache,
    /// Model calls made on this store (kept beside it: parity's adapter opens a session per
    /// request over the same store).
    calls: &'a mut Counters,
    faults: Faults,
    attention: AttentionMode,
    /// Where first prefills are kept, this session's path, and how far the session is from a
    /// fresh store (`None`: nothing is kept).
    first: Option<(&'a Prefills, BuiltinPath, First)>,
}

/// How far a session is from its fresh, empty store.
#[derive(Clone, Copy, PartialEq)]
enum First {
    /// Only sequences created (ids `0..n`), none with a masked prefix: `Created(0)` is empty.
    Created(u32),
    /// Anything else: no forward from here on is a first prefill.
    Past,
}

impl<'a> BuiltinSession<'a> {
    pub fn new(
        model: &'a Model,
        kv: &'a mut dyn KvCache,
        calls: &'a mut Counters,
        faults: Faults,
        attention: AttentionMode,
    ) -> Self {
        BuiltinSession { model, kv, calls, faults, attention, first: None }
    }

    /// Note that the session did something other than create an unmasked sequence.
    fn moved(&mut self) {
        if let Some((_, _, at)) = &mut self.first {
            *at = First::Past;
        }
    }

    /// The key of `rows` when they are a fresh store's first prefill.
    fn first_prefill(&self, rows: &[RowStep]) -> Option<(&'a Prefills, PrefillKey)> {
        let (prefills, path, First::Created(created)) = self.first? else { return None };
        let [row] = rows else { return None };
        (row.seq.0 < created).then(|| {
            let (faults, tokens, logits_at) = (self.faults, row.tokens.clone(), row.logits_at);
            (prefills, PrefillKey { path, faults, created, seq: row.seq, tokens, logits_at })
        })
    }

    fn compute(&mut self, rows: &[RowStep]) -> Result<Array> {
        // Sessions of one model interleave (a reference is computed in the middle of a
        // faulty path's case): the faults are this session's, set for each of its steps.
        self.model.set_faults(self.faults);
        let logits = self.model.forward_mode(self.kv, rows, self.attention)?;
        // One forward is one model call over every row, whichever attention mode reads the KV.
        let c = &mut *self.calls;
        Counters::add(&mut c.forwards, 1);
        Counters::add(&mut c.tokens, rows.iter().map(|r| r.tokens.len() as u64).sum());
        c.max_rows = Some(c.max_rows.unwrap_or(0).max(rows.len() as u64));
        Ok(logits)
    }
}

impl Session for BuiltinSession<'_> {
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        let seq = self.kv.create(masked_prefix)?;
        match &mut self.first {
            Some((_, _, First::Created(n))) if masked_prefix == 0 && seq.0 == *n => *n += 1,
            _ => self.moved(),
        }
        Ok(seq)
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        self.kv.len(seq)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        self.kv.masked_prefix(seq)
    }

    fn forward(&mut self, rows: &[RowStep]) -> Result<Array> {
        let first = self.first_prefill(rows);
        self.moved();
        let Some((prefills, key)) = first else { return self.compute(rows) };
        if let Some(kept) = prefills.get(&key) {
            self.kv.restore(kept.kv.as_ref())?;
            *self.calls = kept.calls;
            return Ok(kept.logits.clone());
        }
        let logits = self.compute(rows)?;
        prefills.keep(key, Prefilled { logits: logits.clone(), kv: self.kv.fork(), calls: *self.calls });
        Ok(logits)
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        self.moved();
        self.kv.trim(seq, n)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.moved();
        self.kv.release(seq)
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        self.moved();
        self.kv.share_prefix(donor, rows)
    }

    fn counters(&mut self) -> Result<Option<Counters>> {
        Ok(Some(self.calls.or(self.kv.counters())))
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
    let mut calls = Counters::default();
    let mut session = BuiltinSession::new(model, kv, &mut calls, Faults::NONE, AttentionMode::default());
    super::generate(&mut session, prompt, max_tokens)
}

/// parity's runtime as a step engine: what `parity adapter` serves over the protocol, the
/// protocol's proof (a suite through `builtin` and through the adapter gives bit-identical
/// rows, and every planted fault is still caught through it). The model is loaded before
/// hello; hello builds the path with the suite's settings.
pub struct BuiltinAdapter<'m> {
    model: &'m Model,
    path: BuiltinPath,
    served: Option<Served<'m>>,
}

/// The path and the KV store of the current case, with the model calls made on it (a
/// session is opened per request).
struct Served<'m> {
    path: Builtin<'m>,
    kv: Box<dyn KvCache>,
    calls: Counters,
    faults: Faults,
}

impl<'m> BuiltinAdapter<'m> {
    pub fn new(model: &'m Model, path: BuiltinPath) -> Self {
        BuiltinAdapter { model, path, served: None }
    }

    fn served(&mut self) -> std::result::Result<&mut Served<'m>, AdapterError> {
        self.served.as_mut().ok_or_else(|| AdapterError::Failed("the first request must be hello".into()))
    }

    fn session(&mut self) -> std::result::Result<BuiltinSession<'_>, AdapterError> {
        let model = self.model;
        let s = self.served()?;
        Ok(BuiltinSession::new(model, s.kv.as_mut(), &mut s.calls, s.faults, s.path.path().attention))
    }
}

impl StepEngine for BuiltinAdapter<'_> {
    fn hello(
        &mut self,
        _model: &str,
        _path: &str,
        settings: &Settings,
    ) -> std::result::Result<Described, AdapterError> {
        let path = Builtin::new(self.model, self.path, settings);
        let info = path.info().clone();
        let kv = path.kv(Faults::NONE)?;
        self.served = Some(Served { path, kv, calls: Counters::default(), faults: Faults::NONE });
        let c = &info.capabilities;
        Ok(Described {
            engine: WireEngine {
                name: "parity".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                device: info.engine.device.clone(),
            },
            vocab_size: info.vocab_size,
            dtype: info.dtype.name().into(),
            capabilities: WireCapabilities {
                masked_prefix: c.masked_prefix,
                share_prefix: c.share_prefix,
                max_batch: c.max_batch,
                stats: c.stats,
                faults: c.faults.iter().map(|f| f.name().to_string()).collect(),
                block_size: c.block_size,
                kv_row_bytes: c.kv_row_bytes,
            },
        })
    }

    fn reset(&mut self, faults: &[String]) -> std::result::Result<(), AdapterError> {
        let s = self.served()?;
        let mut set = Faults::NONE;
        for f in faults {
            set = set.with(Fault::parse(f).ok_or_else(|| AdapterError::Failed(format!("unknown fault `{f}`")))?);
        }
        s.kv = s.path.kv(set)?;
        s.calls = Counters::default();
        s.faults = set;
        Ok(())
    }

    fn create(&mut self, masked_prefix: usize) -> std::result::Result<u32, AdapterError> {
        Ok(self.session()?.create(masked_prefix)?.0)
    }

    fn forward(&mut self, rows: &[WireRow]) -> std::result::Result<Forwarded, AdapterError> {
        let steps: Vec<RowStep> = rows
            .iter()
            .map(|r| RowStep { seq: SeqId(r.seq), tokens: r.tokens.clone(), logits_at: r.logits_at })
            .collect();
        let mut session = self.session()?;
        let logits = session.forward(&steps)?;
        let lengths = steps.iter().map(|r| session.len(r.seq)).collect::<Result<Vec<_>>>()?;
        Ok(Forwarded { logits: host_f32(&logits)?, lengths })
    }

    fn trim(&mut self, seq: u32, n: usize) -> std::result::Result<(usize, usize), AdapterError> {
        let mut session = self.session()?;
        let removed = session.trim(SeqId(seq), n)?;
        Ok((removed, session.len(SeqId(seq))?))
    }

    fn release(&mut self, seq: u32) -> std::result::Result<(), AdapterError> {
        Ok(self.session()?.release(SeqId(seq))?)
    }

    fn share_prefix(&mut self, donor: u32, rows: usize) -> std::result::Result<Option<(u32, ShareMode)>, AdapterError> {
        Ok(self.session()?.share_prefix(SeqId(donor), rows)?.map(|(seq, mode)| (seq.0, mode)))
    }

    fn stats(&mut self) -> std::result::Result<WireStats, AdapterError> {
        let mut session = self.session()?;
        let kv = session.stats()?.unwrap_or_default();
        Ok(WireStats { kv, sequences: 0, counters: session.counters()? })
    }
}
