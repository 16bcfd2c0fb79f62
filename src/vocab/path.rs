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
    /// The MLX device it computed on (`cpu`, `gpu`), where it says: parity's builtin paths and
    /// parity's own adapter do. Device parity compares two of these, so each side names its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

impl EngineId {
    /// parity's runtime in this process, on `device` (this process's MLX default).
    pub fn builtin(device: String) -> Self {
        EngineId {
            kind: "builtin".into(),
            name: "parity".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            device: Some(device),
        }
    }

    /// An engine that says nothing about itself yet (planning, a server before it answers).
    pub fn unnamed(kind: &str, name: &str) -> Self {
        EngineId { kind: kind.into(), name: name.into(), version: String::new(), device: None }
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

/// A device a builtin reference can be pinned to (`builtin:dense@cpu`). Not `auto`: a pinned
/// reference exists to name the other side's device, and `auto` would leave it to each machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Gpu => "gpu",
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "gpu" => Ok(Device::Gpu),
            other => Err(format!("unknown device `{other}`; expected cpu or gpu")),
        }
    }
}

/// parity's builtin runtime as a reference: a path, and the device it runs on when that is
/// named (`dense@cpu`). Unpinned, it runs in this process on the run's `--device`. Pinned, it
/// runs in a child process (`parity adapter --device D`): MLX has one default device per
/// process, so the only way two sides compute on two devices is two processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BuiltinRef {
    pub path: BuiltinPath,
    pub device: Option<Device>,
}

impl BuiltinRef {
    /// The default reference of a builtin engine: dense, batched, in process.
    pub const DENSE: BuiltinRef = BuiltinRef { path: BuiltinPath::batched(Backend::Dense), device: None };

    /// `dense` or `dense@cpu`, as a suite writes it after `builtin:`.
    pub fn name(self) -> String {
        match self.device {
            None => self.path.name(),
            Some(d) => format!("{}@{}", self.path.name(), d.name()),
        }
    }
}

impl std::str::FromStr for BuiltinRef {
    type Err = String;
    /// `PATH` or `PATH@DEVICE`; each error names the part that is wrong and what is allowed.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (path, device) = match s.split_once('@') {
            None => (s, None),
            Some((p, d)) => (p, Some(d.parse::<Device>()?)),
        };
        Ok(BuiltinRef { path: path.parse()?, device })
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
