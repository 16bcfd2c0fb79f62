//! A suite as plain data: its prompts and checkpoints, each checkpoint with the engine that
//! serves its paths, the scenarios and settings it runs, and its tolerance. The parser
//! (`crate::suite`) produces these, checked; everything that runs a suite reads them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Map, Value};

use super::audit::{Problem, lengths_problem, request_level_problems, settings_problems};
use super::{
    BuiltinPath, BuiltinRef, DistributionTolerance, RequestScript, Scenario, Script, Settings, Verdict, Witness,
};
use crate::dtype::DtypeSetting;
use crate::kv::Backend;

/// Which engine serves a checkpoint's paths (`[engine]`, or `engine = {...}` on a checkpoint).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineSpec {
    /// parity's own runtime: paths `dense` and `paged` (batched attention) unless the suite
    /// also names `dense-rowwise`, `paged-rowwise`; reference `dense` in process unless the
    /// suite names another (`builtin:dense@cpu`: the same runtime on another device).
    Builtin { reference: BuiltinRef },
    /// An adapter process per path, speaking the step protocol (docs/step-protocol.md).
    Process(ProcessSpec),
    /// An OpenAI-compatible HTTP server per path, driven at request level
    /// (`engine::openai`).
    Openai(OpenaiSpec),
}

impl EngineSpec {
    /// The paths a checkpoint runs when the suite names none, in the order written.
    pub fn path_names(&self) -> Vec<String> {
        match self {
            EngineSpec::Builtin { .. } => BuiltinPath::DEFAULT.iter().map(|p| p.name()).collect(),
            EngineSpec::Process(p) => p.paths.iter().map(|(n, _)| n.clone()).collect(),
            EngineSpec::Openai(o) => o.paths.iter().map(|p| p.name.clone()).collect(),
        }
    }

    /// Every path a suite may name for this engine.
    pub fn known_paths(&self) -> Vec<String> {
        match self {
            EngineSpec::Builtin { .. } => BuiltinPath::ALL.iter().map(|p| p.name()).collect(),
            EngineSpec::Process(_) | EngineSpec::Openai(_) => self.path_names(),
        }
    }

    pub fn reference(&self) -> ReferenceSpec {
        match self {
            EngineSpec::Builtin { reference } => ReferenceSpec::Builtin(*reference),
            EngineSpec::Process(p) => p.reference.clone(),
            EngineSpec::Openai(o) => ReferenceSpec::Path(o.reference.clone()),
        }
    }

    /// parity must load the weights itself (a builtin path, or a builtin reference run in this
    /// process; a pinned one loads them in its own child).
    pub fn needs_builtin(&self) -> bool {
        matches!(self.reference(), ReferenceSpec::Builtin(BuiltinRef { device: None, .. }))
            || matches!(self, EngineSpec::Builtin { .. })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSpec {
    /// argv template: `{model}`, `{checkpoint}`, `{path}`, `{suite_dir}`, `{dtype}`, `{parity}`
    /// are substituted.
    pub command: Vec<String>,
    /// What `{model}` is, when not the checkpoint directory: the engine's own model file (a
    /// GGUF beside the checkpoint whose tokenizer parity uses), relative to the suite.
    pub model: Option<String>,
    /// Path name and the extra arguments appended to `command` for it.
    pub paths: Vec<(String, Vec<String>)>,
    pub reference: ReferenceSpec,
    /// Longest any one request may take.
    pub timeout: Duration,
    /// Longest from spawn to the hello reply (model load).
    pub start_timeout: Duration,
}

/// Where a checkpoint's references come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ReferenceSpec {
    /// A path of the checkpoint's own engine.
    Path(String),
    /// A path of parity's builtin runtime on the same checkpoint (`builtin:dense`): an engine
    /// checked against an independent implementation, not only against itself. Pinned to a
    /// device (`builtin:dense@cpu`), it runs there in a child process: device parity.
    Builtin(BuiltinRef),
}

impl ReferenceSpec {
    /// As reports print it: `dense (builtin)` or `KVCache`.
    pub fn describe(&self) -> String {
        match self {
            ReferenceSpec::Path(p) => p.clone(),
            ReferenceSpec::Builtin(b) => format!("builtin:{}", b.name()),
        }
    }

    /// `builtin:PATH` or `builtin:PATH@DEVICE` as a suite writes it; `None` when `s` is not
    /// spelled `builtin:` at all (then it names one of the engine's own paths).
    pub fn parse_builtin(s: &str) -> Option<std::result::Result<BuiltinRef, String>> {
        s.strip_prefix("builtin:").map(str::parse)
    }

    /// Every builtin spelling, for error messages: `builtin:dense / ... / builtin:PATH@cpu|gpu`.
    pub fn builtin_spellings() -> String {
        let mut all: Vec<String> = BuiltinPath::ALL.iter().map(|p| format!("builtin:{}", p.name())).collect();
        all.push("builtin:PATH@cpu|gpu".into());
        all.join(" / ")
    }
}

/// The host every started server is told to bind, and the only kind of host parity contacts.
pub const LOOPBACK: &str = "127.0.0.1";

#[derive(Debug, Clone, PartialEq)]
pub struct OpenaiSpec {
    /// Engine name in reports (`mlx_lm.server`, `llama-server`).
    pub name: String,
    pub server: ServerSpec,
    /// Named configurations of the server, in the order written.
    pub paths: Vec<OpenaiPath>,
    /// The path every other is compared with.
    pub reference: String,
    /// GET this (relative to the server's root) until it answers 200: the server is ready.
    pub ready: String,
    /// The server's Prometheus text endpoint (relative to its root), scraped before and after
    /// each case where a path's witness names counters (`moves`, `still`).
    pub metrics: Option<String>,
    /// Longest any one request may take.
    pub timeout: Duration,
    /// Longest from spawn to ready (model load).
    pub start_timeout: Duration,
    /// `top_logprobs` asked for on every request (as many as the server allows).
    pub top_logprobs: usize,
    /// The server returns logprobs in streamed chunks too (llama-server does, mlx_lm.server
    /// does not): the concurrent scenario's clock request is then a measured one.
    pub stream_logprobs: bool,
    /// How prompts travel.
    pub prompt: PromptForm,
    /// JSON fields added to every request (a path's own fields are added after these).
    pub request: Map<String, Value>,
}

/// Where the server comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerSpec {
    /// parity starts one per checkpoint x path x scenario: an argv template (`{model}`,
    /// `{port}`, `{host}`, `{checkpoint}`, `{suite_dir}`, `{path}`), and what `{model}` is
    /// (default: the resolved checkpoint directory; `${VAR:-default}` expanded, relative to
    /// the suite).
    Command { argv: Vec<String>, model: Option<String> },
    /// A server already running (loopback only); parity starts nothing.
    Url(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct OpenaiPath {
    pub name: String,
    /// Appended to the start command.
    pub args: Vec<String>,
    /// Added to every request this path sends (e.g. `seed`, which makes mlx_lm.server serve a
    /// request on its sequential path).
    pub request: Map<String, Value>,
}

/// The prompt's form on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptForm {
    /// parity's token ids decoded to text (special tokens kept); the server tokenizes it, and
    /// `usage.prompt_tokens` is checked against parity's count.
    Text,
    /// The token ids themselves (`"prompt": [1, 2, 3]`), for servers that take them
    /// (llama-server): the server sees exactly parity's tokens.
    Ids,
}

impl PromptForm {
    pub fn parse(s: &str) -> Result<PromptForm, String> {
        match s {
            "text" => Ok(PromptForm::Text),
            "ids" => Ok(PromptForm::Ids),
            other => Err(format!("unknown prompt form `{other}`; expected text or ids")),
        }
    }
}

impl OpenaiSpec {
    pub fn path(&self, name: &str) -> Option<&OpenaiPath> {
        self.paths.iter().find(|p| p.name == name)
    }
}

/// Fields parity sets itself on every request: a suite may not override them, or the
/// comparison would silently stop being greedy or stop returning what it compares.
pub const RESERVED_FIELDS: &[&str] = &["prompt", "max_tokens", "temperature", "stream", "stream_options"];

#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Raw text, encoded with the tokenizer's special tokens.
    Text(String),
    /// A single user turn rendered with the checkpoint's chat template.
    Chat(String),
    /// Token ids, used as given.
    Ids(Vec<u32>),
    /// A text file (relative to the suite file; read when the prompt is encoded), encoded as
    /// raw text: a corpus.
    File(PathBuf),
}

#[derive(Debug, Clone, PartialEq)]
pub struct PromptSpec {
    pub name: String,
    pub source: PromptSource,
    /// Repeat or cut the encoded prompt to exactly this many tokens (to hit a boundary).
    pub length: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Tolerance {
    /// Largest per-step relative logit RMS a row may show.
    pub max_rel_rms: f32,
    pub allow: Vec<Verdict>,
    /// kind = "openai": largest |delta logprob| over the top-k tokens both sides returned.
    pub max_logprob_delta: f32,
    /// kind = "openai": any logprob difference at all fails (engines claiming batch invariance).
    pub bitwise: bool,
    /// `corpus` rows: bounds on the distribution of the path's distance from the reference.
    pub distribution: DistributionTolerance,
}

#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointSpec {
    pub name: String,
    /// A path (relative to the suite file, `${VAR:-default}` expanded) or a repo id.
    pub reference: String,
    pub dtype: DtypeSetting,
    pub dequantize: bool,
    pub engine: EngineSpec,
    /// The engine paths this checkpoint runs (`backends` in the suite), in order.
    pub paths: Vec<String>,
    pub scenarios: Vec<Scenario>,
    pub settings: Settings,
    pub tolerance: Tolerance,
    /// Prompt names this checkpoint runs (all when the suite does not say).
    pub prompts: Vec<String>,
    /// What each path must show (`[engine.witness.PATH]`), by path name; a path not named
    /// keeps the default rules.
    pub witness: BTreeMap<String, Witness>,
    /// `no_snapshot = "why"`: this checkpoint's rows are judged every run but never
    /// snapshotted. For rows that are not a function of the code: a server's batches and
    /// cache hits follow request timing, so which of its rows fail changes from run to run,
    /// and a snapshot would report a change on every run that no commit made.
    pub no_snapshot: Option<String>,
}

impl CheckpointSpec {
    /// What path `name` must show.
    pub fn witness(&self, name: &str) -> Witness {
        self.witness.get(name).cloned().unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Suite {
    pub name: String,
    pub file: PathBuf,
    pub prompts: Vec<PromptSpec>,
    pub checkpoints: Vec<CheckpointSpec>,
    /// Pinned scripts (`[[scripts]]`), run by the `script` scenario.
    pub scripts: Vec<ScriptSpec>,
}

/// A pinned script: a reproducer `parity explore` printed, kept as a row of every run.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptSpec {
    pub name: String,
    pub script: Pinned,
}

/// What a pinned script drives: a stepped engine's operations (`ops = "..."`) or a server's
/// requests (`requests = "..."`).
#[derive(Debug, Clone, PartialEq)]
pub enum Pinned {
    Steps(Script),
    Requests(RequestScript),
}

impl Suite {
    /// The pinned scripts for a stepped engine, by name.
    pub fn step_scripts(&self) -> Vec<(String, Script)> {
        self.scripts
            .iter()
            .filter_map(|s| match &s.script {
                Pinned::Steps(script) => Some((s.name.clone(), script.clone())),
                Pinned::Requests(_) => None,
            })
            .collect()
    }

    /// The pinned scripts for a server, by name.
    pub fn request_scripts(&self) -> Vec<(String, RequestScript)> {
        self.scripts
            .iter()
            .filter_map(|s| match &s.script {
                Pinned::Requests(script) => Some((s.name.clone(), script.clone())),
                Pinned::Steps(_) => None,
            })
            .collect()
    }
}

impl CheckpointSpec {
    /// The builtin KV stores among this checkpoint's paths, for checks that only matter to a
    /// block pool. Another engine's paths are known only once started (their `hello` says
    /// whether they are paged), so none of them counts here.
    pub fn kv_backends(&self) -> Vec<Backend> {
        match self.engine {
            EngineSpec::Builtin { .. } => {
                let mut kv: Vec<Backend> = Vec::new();
                for p in self.paths.iter().filter_map(|p| p.parse::<BuiltinPath>().ok()) {
                    if !kv.contains(&p.backend) {
                        kv.push(p.backend);
                    }
                }
                kv
            }
            // Neither owns one of parity's KV pools: the engine keeps its cache to itself.
            EngineSpec::Process(_) | EngineSpec::Openai(_) => Vec::new(),
        }
    }

    /// What this checkpoint's settings make impossible to test ([`super::audit`]), by the
    /// rules of its engine's kind: a server is driven by whole requests, the others by steps.
    /// `lengths`: every prompt's length when the suite fixes them.
    pub fn settings_problems(&self, lengths: Option<&[usize]>) -> Vec<Problem> {
        let (s, sc) = (&self.settings, &self.scenarios);
        let mut out = match self.engine {
            EngineSpec::Openai(_) => request_level_problems(s, sc),
            _ => settings_problems(s, sc, &self.kv_backends(), lengths),
        };
        out.extend(lengths_problem(s, sc));
        out
    }
}

impl Suite {
    /// The directory relative checkpoint paths are resolved against, and where engine
    /// commands run. A bare file name (`parity run mlx-lm.toml`) has the empty path as its
    /// parent, which no process can be started in: that is `.`.
    pub fn dir(&self) -> PathBuf {
        match self.file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        }
    }
}

/// Tolerance defaults by dtype: float32 paths match to ~1e-6 when correct and a real bug moves
/// logits by far more than 1e-3; half precision noise is larger.
pub fn default_tolerance(dtype: DtypeSetting) -> Tolerance {
    let max_rel_rms = match dtype {
        DtypeSetting::Float32 => 1e-3,
        _ => 2e-2,
    };
    // Logprobs as servers return them: a logit of magnitude ~20 has a spacing of 2e-6 in
    // float32 (reduction-order noise stays well under 1e-3), 2^-6 in float16 and 2^-3 in
    // bfloat16 (two such steps allowed).
    let max_logprob_delta = match dtype {
        DtypeSetting::Float32 => 1e-3,
        DtypeSetting::Float16 => 5e-2,
        _ => 0.25,
    };
    Tolerance {
        max_rel_rms,
        allow: vec![Verdict::Identical, Verdict::NearTie],
        max_logprob_delta,
        bitwise: false,
        distribution: DistributionTolerance::default(),
    }
}
