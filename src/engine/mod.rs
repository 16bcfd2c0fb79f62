//! Engines under test. A suite compares **paths** (named ways of running one checkpoint:
//! `dense` and `paged`, or mlx-lm's `KVCache` and `BatchKVCache`); each path is served by an
//! engine, behind one of two interfaces:
//!
//! - step level, [`Session`] and [`EnginePath`]: a fresh KV store in which sequences are
//!   created, stepped, trimmed, shared and released. [`builtin`] (parity's own MLX runtime, in
//!   process) and [`process`] (any engine with an adapter speaking the step protocol,
//!   `docs/step-protocol.md`) live behind it.
//! - request level, [`openai::RequestPath`]: a server that can only be sent whole completion
//!   requests (kind = "openai"). A server cannot be stepped, so it is not forced behind
//!   `Session`.
//!
//! Engines know no scenario, suite file, run or report: they take the suite's spec types and
//! answer operations.

pub mod adapter;
pub mod builtin;
pub mod openai;
pub mod process;
pub mod protocol;

use std::path::{Path, PathBuf};

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use crate::array::{greedy, rows};
use crate::checkpoint::ModelConfig;
use crate::dtype::DtypeName;
use crate::error::Result;
use crate::faults::Faults;
pub use crate::kv::ShareMode;
use crate::kv::{Counters, KvStats, SeqId};
use crate::model::{Model, RowStep};
use crate::vocab::{
    BuiltinPath, BuiltinRef, CheckpointSpec, Device, EngineId, EngineSpec, ProcessSpec, ReferenceSpec, Trace,
};

/// Where a started engine lives: the resolved checkpoint (what `{model}` or `{checkpoint}`
/// stands for) and the suite's directory (`{suite_dir}`, where the child runs).
#[derive(Debug, Clone, Copy)]
pub struct Dirs<'a> {
    pub checkpoint: &'a Path,
    pub suite_dir: &'a Path,
}

impl Dirs<'_> {
    /// Both directories made absolute: the child runs in the suite's directory, so every path
    /// handed to it must hold from there, whatever directory parity was started from.
    pub fn absolute(&self) -> (PathBuf, PathBuf) {
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        (absolute(self.checkpoint), absolute(self.suite_dir))
    }
}

/// A command from a suite's argv template and a path's extra arguments, every `{name}` of
/// `values` substituted in every argument (nothing goes through a shell), and the program
/// resolved against the suite's directory so a missing one is a spawn error that names it.
pub fn command(template: &[String], extra: &[String], values: &[(&str, &str)], suite_dir: &Path) -> Vec<String> {
    let fill =
        |arg: &String| values.iter().fold(arg.clone(), |a, (name, value)| a.replace(&format!("{{{name}}}"), value));
    let mut argv: Vec<String> = template.iter().chain(extra).map(fill).collect();
    if let Some(program) = argv.first_mut() {
        *program = crate::proc::resolve_program(program, suite_dir);
    }
    argv
}

/// What a path can do. A case that needs more is skipped with a sentence naming the path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Sequences may start with masked left-pad rows (batched left-padded prefill).
    pub masked_prefix: bool,
    /// `share_prefix` is implemented (it may still answer "recompute").
    pub share_prefix: bool,
    /// Most rows in one forward; `None`: no limit.
    pub max_batch: Option<usize>,
    /// KV memory statistics are reported.
    pub stats: bool,
    /// Rows per KV block when the path is paged: divergences are then located by block.
    pub block_size: Option<usize>,
    /// Bytes of K and V one row takes over all layers, as the path's layout promises (its
    /// stored dtype or quantization): the stats it reports are held to it, so a layout
    /// stored wider than it declares fails its rows.
    pub kv_row_bytes: Option<u64>,
    /// Planted faults the path can switch on (parity's own runtime only).
    pub faults: Vec<crate::faults::Fault>,
}

/// A path as the scenarios and the report see it.
#[derive(Debug, Clone, PartialEq)]
pub struct PathInfo {
    pub name: String,
    pub engine: EngineId,
    pub vocab_size: usize,
    /// Compute dtype: sets the near-tie threshold.
    pub dtype: DtypeName,
    pub capabilities: Capabilities,
}

impl PathInfo {
    /// The kind of KV store this path is, for checks that only matter to a block pool
    /// (a block size no prompt crosses tests nothing there).
    pub fn kv_backend(&self) -> crate::kv::Backend {
        if self.capabilities.block_size.is_some() { crate::kv::Backend::Paged } else { crate::kv::Backend::Dense }
    }

    /// Fail with a skip when `faults` asks for a fault this path cannot plant: a selftest
    /// through an engine that ignores faults would "catch" nothing and prove nothing.
    pub fn check_faults(&self, faults: Faults) -> Result<()> {
        match faults.list().into_iter().find(|f| !self.capabilities.faults.contains(f)) {
            None => Ok(()),
            Some(f) => Err(crate::error::Error::Unsupported(format!(
                "path `{}` ({} {}) cannot plant fault `{}`",
                self.name,
                self.engine.kind,
                self.engine.name,
                f.name()
            ))),
        }
    }
}

/// One fresh KV store of a path: what every scenario runs against. Each sequence has one
/// length counter, kept by the engine; RoPE positions derive from it (the "two sources of
/// truth" bug is a second counter), and parity checks what the engine reports about it.
pub trait Session {
    /// A new empty sequence whose first `masked_prefix` rows (left padding of a batched
    /// prefill) are never attended by real tokens and do not count towards positions.
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId>;

    /// Rows written to the sequence so far (as the engine last reported it).
    fn len(&self, seq: SeqId) -> Result<usize>;

    fn masked_prefix(&self, seq: SeqId) -> Result<usize>;

    /// One batched step: append each row's tokens to its sequence and return the logits
    /// `[B, vocab]` at each row's `logits_at`.
    fn forward(&mut self, rows: &[RowStep]) -> Result<Array>;

    /// Drop the newest `n` rows; returns how many the engine says it removed (callers verify,
    /// see `scenario::trim_exact`).
    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize>;

    fn release(&mut self, seq: SeqId) -> Result<()>;

    /// A new sequence holding `donor`'s first `rows` rows, or `None` when the path cannot
    /// reuse rows and the caller must recompute them.
    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>>;

    /// KV memory now (peak since the session began); `None` if the path does not report it.
    fn stats(&mut self) -> Result<Option<KvStats>>;

    /// What the engine counted about its own work since the session began: the evidence that
    /// a case did what it exists to test. `None`: the path keeps no counters.
    fn counters(&mut self) -> Result<Option<Counters>> {
        Ok(None)
    }

    /// The store's books, checked where a case ends: `Some(what is wrong)` when storage is held
    /// by no live sequence or refcounts disagree with the tables. A release that forgets its
    /// blocks gives the same tokens, so no verdict can see it; in production the pool runs dry.
    fn audit(&mut self) -> Result<Option<String>>;
}

/// One path of an engine: it opens a fresh [`Session`] per case.
pub trait EnginePath {
    fn info(&self) -> &PathInfo;

    /// A fresh KV store with `faults` planted (none for references). Every sequence of an
    /// earlier session is gone.
    fn session(&mut self, faults: Faults) -> Result<Box<dyn Session + '_>>;

    /// [`session`](Self::session) with every forward computed, none served from an earlier
    /// session's identical one (builtin paths on the CPU keep fresh sessions' first prefills,
    /// see [`builtin::Prefills`]): for a case whose point is to compare two runs of the path.
    fn computed_session(&mut self, faults: Faults) -> Result<Box<dyn Session + '_>> {
        self.session(faults)
    }
}

/// A stand-in path for planning: scenarios name their rows before they touch an engine, so a
/// run against this one (with a selector that lets nothing run) lists the rows a real run
/// would make. Opening a session is an error: nothing may run on it.
pub struct Planning(PathInfo);

impl Planning {
    pub fn new(vocab_size: usize) -> Self {
        Planning(PathInfo {
            name: "planning".into(),
            engine: EngineId::unnamed("planning", ""),
            vocab_size,
            dtype: DtypeName::Float32,
            capabilities: Capabilities {
                masked_prefix: true,
                share_prefix: true,
                max_batch: None,
                stats: false,
                block_size: None,
                kv_row_bytes: None,
                faults: Vec::new(),
            },
        })
    }
}

impl EnginePath for Planning {
    fn info(&self) -> &PathInfo {
        &self.0
    }

    fn session(&mut self, _faults: Faults) -> Result<Box<dyn Session + '_>> {
        Err(crate::error::Error::Invalid("the planning stand-in runs nothing".into()))
    }
}

/// Prefill `prompt` into a fresh sequence and decode `max_tokens` greedy tokens: the
/// reference run, and `parity generate`.
pub fn generate(session: &mut dyn Session, prompt: &[u32], max_tokens: usize) -> Result<(SeqId, Trace)> {
    let seq = session.create(0)?;
    let mut trace = Trace::default();
    let mut logits = session.forward(&[RowStep::new(seq, prompt.to_vec())])?;
    for _ in 0..max_tokens {
        let next = greedy(&logits)?[0];
        trace.tokens.push(next);
        trace.logits.push(rows(&logits)?.remove(0));
        if trace.tokens.len() == max_tokens {
            break;
        }
        logits = session.forward(&[RowStep::new(seq, vec![next])])?;
    }
    Ok((seq, trace))
}

/// How long a pinned reference's child may take per request and to start (load the weights):
/// a builtin engine names no timeouts, so these are the process engine's defaults.
const PINNED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);
const PINNED_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// The adapter that serves a reference pinned to a device: this executable's own `parity
/// adapter` on the checkpoint, with `--device` set. It is driven as any process engine is, so
/// it inherits that engine's containment: a crash or hang fails the case, the child's process
/// group is killed when the path is dropped, on every exit path of parity. It inherits
/// parity's environment too (`MLX_ENABLE_TF32` among it), so both sides compute under the
/// same MLX settings.
fn pinned_spec(
    path: BuiltinPath,
    device: Device,
    dequantize: bool,
    (timeout, start_timeout): (std::time::Duration, std::time::Duration),
) -> ProcessSpec {
    let args = ["{parity}", "adapter", "{checkpoint}", "--device", device.name(), "--path", &path.name()];
    let mut command: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    command.extend(["--dtype".into(), "{dtype}".into()]);
    if dequantize {
        command.push("--dequantize".into());
    }
    let name = BuiltinRef { path, device: Some(device) }.name();
    ProcessSpec {
        command,
        model: None,
        paths: vec![(name.clone(), Vec::new())],
        reference: ReferenceSpec::Path(name),
        timeout,
        start_timeout,
    }
}

/// A checkpoint's step-level engine (kind = "builtin" or "process"), which its paths are opened
/// from. It holds parity's own load of the weights when a builtin path or a builtin reference
/// needs them: loaded once, shared by every builtin path.
pub struct Engine<'a> {
    spec: &'a CheckpointSpec,
    dirs: Dirs<'a>,
    model: Option<Model>,
    /// Every builtin path's first prefills (see [`builtin::Prefills`]).
    prefills: builtin::Prefills,
}

impl<'a> Engine<'a> {
    /// Load what the checkpoint's engine needs in process: the weights, when a builtin path or
    /// reference reads them.
    pub fn load(spec: &'a CheckpointSpec, dirs: Dirs<'a>, config: &ModelConfig) -> Result<Self> {
        let model = if spec.engine.needs_builtin() {
            Some(Model::load(dirs.checkpoint, config.clone(), spec.dtype.resolve(), spec.dequantize)?)
        } else {
            None
        };
        Ok(Engine { spec, dirs, model, prefills: builtin::Prefills::default() })
    }

    /// Open path `name`, or the reference path when `name` is `None`.
    pub fn open(&self, name: Option<&str>) -> Result<Box<dyn EnginePath + '_>> {
        let (engine, settings) = (&self.spec.engine, &self.spec.settings);
        let builtin = |path: BuiltinPath| -> Result<Box<dyn EnginePath + '_>> {
            let model = self
                .model
                .as_ref()
                .ok_or_else(|| crate::error::Error::Invalid("the builtin runtime's weights were not loaded".into()))?;
            let path = builtin::Builtin::new(model, path, settings);
            // MLX's CPU backend computes the same bits on every run (every committed snapshot
            // rests on it); a GPU's reductions need not, and two runs there are two results.
            Ok(Box::new(if crate::environment::device() == "cpu" { path.sharing(&self.prefills) } else { path }))
        };
        let target = match name {
            Some(n) => ReferenceSpec::Path(n.to_string()),
            None => engine.reference(),
        };
        let dtype = self.spec.dtype.resolve().map_or("native", |d| d.name());
        match (engine, target) {
            (_, ReferenceSpec::Builtin(BuiltinRef { path, device: None })) => builtin(path),
            (_, ReferenceSpec::Builtin(pinned @ BuiltinRef { path, device: Some(device) })) => {
                let timeouts = match engine {
                    EngineSpec::Process(p) => (p.timeout, p.start_timeout),
                    _ => (PINNED_TIMEOUT, PINNED_START_TIMEOUT),
                };
                let spec = pinned_spec(path, device, self.spec.dequantize, timeouts);
                let started = process::ProcessPath::start(&spec, &pinned.name(), self.dirs, dtype, settings)?;
                // The child says where it computes; a reference that ran on another device than
                // the one named would make a device-parity pass mean nothing.
                let said = started.info().engine.device.clone();
                if said.as_deref() != Some(device.name()) {
                    return Err(crate::error::Error::Engine {
                        engine: "parity adapter".into(),
                        path: pinned.name(),
                        message: format!(
                            "asked to compute on {}, the adapter says it computes on {}",
                            device.name(),
                            said.as_deref().unwrap_or("an unnamed device")
                        ),
                    });
                }
                Ok(Box::new(started))
            }
            (EngineSpec::Builtin { .. }, ReferenceSpec::Path(n)) => {
                builtin(n.parse().map_err(crate::error::Error::Invalid)?)
            }
            (EngineSpec::Process(p), ReferenceSpec::Path(n)) => {
                Ok(Box::new(process::ProcessPath::start(p, &n, self.dirs, dtype, settings)?))
            }
            (EngineSpec::Openai(o), ReferenceSpec::Path(n)) => Err(crate::error::Error::Engine {
                engine: o.name.clone(),
                path: n,
                message: "an OpenAI-compatible server cannot be stepped; it runs request-level scenarios".into(),
            }),
        }
    }
}
