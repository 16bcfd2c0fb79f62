//! Suite files (TOML): checkpoints, prompts, scenarios and their settings, dtype and
//! tolerances, with suite-level defaults and per-checkpoint overrides.
//!
//! Every mistake is reported with file, line and column before anything runs: unknown keys and
//! wrong types by the TOML deserializer, semantic checks (positive sizes, tile a multiple of
//! 8, known scenario names) against the span of the offending value.
//!
//! Suites are untrusted input (fuzzed: see `fuzz/`). Names become file names, so they must be
//! plain file-name components ([`crate::names`]); sizes have an upper bound, so no value can
//! make a run allocate without limit; settings that would make a scenario test nothing are
//! errors ([`crate::coverage`]).

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

mod engine_openai;

use crate::compare::Verdict;
use crate::dtype::DtypeSetting;
use crate::engine::builtin::BuiltinPath;
use crate::engine::openai::spec::{self as openai, OpenaiPath, OpenaiSpec, PromptForm, ServerSpec};
use crate::kv::Backend;
use crate::scenario::{self, Scenario, Settings};

/// Which engine serves a checkpoint's paths (`[engine]`, or `engine = {...}` on a checkpoint).
#[derive(Debug, Clone, PartialEq)]
pub enum EngineSpec {
    /// parity's own runtime: paths `dense` and `paged` (batched attention) unless the suite
    /// also names `dense-rowwise`, `paged-rowwise`; reference `dense`.
    Builtin,
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
            EngineSpec::Builtin => BuiltinPath::DEFAULT.iter().map(|p| p.name()).collect(),
            EngineSpec::Process(p) => p.paths.iter().map(|(n, _)| n.clone()).collect(),
            EngineSpec::Openai(o) => o.paths.iter().map(|p| p.name.clone()).collect(),
        }
    }

    /// Every path a suite may name for this engine.
    pub fn known_paths(&self) -> Vec<String> {
        match self {
            EngineSpec::Builtin => BuiltinPath::ALL.iter().map(|p| p.name()).collect(),
            EngineSpec::Process(_) | EngineSpec::Openai(_) => self.path_names(),
        }
    }

    pub fn reference(&self) -> ReferenceSpec {
        match self {
            EngineSpec::Builtin => ReferenceSpec::Builtin(BuiltinPath::batched(Backend::Dense)),
            EngineSpec::Process(p) => p.reference.clone(),
            EngineSpec::Openai(o) => ReferenceSpec::Path(o.reference.clone()),
        }
    }

    /// parity must load the weights itself (a builtin path or a builtin reference).
    pub fn needs_builtin(&self) -> bool {
        matches!(self.reference(), ReferenceSpec::Builtin(_)) || matches!(self, EngineSpec::Builtin)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ProcessSpec {
    /// argv template: `{model}`, `{path}`, `{suite_dir}`, `{parity}` are substituted.
    pub command: Vec<String>,
    /// Path name and the extra arguments appended to `command` for it.
    pub paths: Vec<(String, Vec<String>)>,
    pub reference: ReferenceSpec,
    /// Longest any one request may take.
    pub timeout: std::time::Duration,
    /// Longest from spawn to the hello reply (model load).
    pub start_timeout: std::time::Duration,
}

/// Where a checkpoint's references come from.
#[derive(Debug, Clone, PartialEq)]
pub enum ReferenceSpec {
    /// A path of the checkpoint's own engine.
    Path(String),
    /// A path of parity's builtin runtime on the same checkpoint (`builtin:dense`): an engine
    /// checked against an independent implementation, not only against itself.
    Builtin(BuiltinPath),
}

impl ReferenceSpec {
    /// As reports print it: `dense (builtin)` or `KVCache`.
    pub fn describe(&self) -> String {
        match self {
            ReferenceSpec::Path(p) => p.clone(),
            ReferenceSpec::Builtin(b) => format!("builtin:{}", b.name()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SuiteError {
    pub file: PathBuf,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl std::fmt::Display for SuiteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}: {}", self.file.display(), self.line, self.column, self.message)
    }
}

impl std::error::Error for SuiteError {}

#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Raw text, encoded with the tokenizer's special tokens.
    Text(String),
    /// A single user turn rendered with the checkpoint's chat template.
    Chat(String),
    /// Token ids, used as given.
    Ids(Vec<u32>),
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct Suite {
    pub name: String,
    pub file: PathBuf,
    pub prompts: Vec<PromptSpec>,
    pub checkpoints: Vec<CheckpointSpec>,
}

impl CheckpointSpec {
    /// The builtin KV stores among this checkpoint's paths, for checks that only matter to a
    /// block pool. Another engine's paths are known only once started (their `hello` says
    /// whether they are paged), so none of them counts here.
    pub fn kv_backends(&self) -> Vec<Backend> {
        match self.engine {
            EngineSpec::Builtin => {
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

    /// What this checkpoint's settings make impossible to test ([`crate::coverage`]), by the
    /// rules of its engine's kind: a server is driven by whole requests, the others by steps.
    /// `lengths`: every prompt's length when the suite fixes them.
    pub fn settings_problems(&self, lengths: Option<&[usize]>) -> Vec<crate::coverage::Problem> {
        let (s, sc) = (&self.settings, &self.scenarios);
        let mut out = match self.engine {
            EngineSpec::Openai(_) => crate::coverage::request_level_problems(s, sc),
            _ => crate::coverage::settings_problems(s, sc, &self.kv_backends(), lengths),
        };
        out.extend(crate::coverage::lengths_problem(s, sc));
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

// ---- raw form, as written ------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSuite {
    name: Option<Spanned<String>>,
    #[allow(dead_code)]
    description: Option<String>,
    dtype: Option<Spanned<String>>,
    dequantize: Option<bool>,
    engine: Option<Spanned<RawEngine>>,
    backends: Option<Vec<Spanned<String>>>,
    scenarios: Option<Vec<Spanned<String>>>,
    settings: Option<SettingsPatch>,
    tolerance: Option<TolerancePatch>,
    #[serde(default)]
    prompts: Vec<Spanned<RawPrompt>>,
    #[serde(default)]
    checkpoints: Vec<Spanned<RawCheckpoint>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPrompt {
    name: Spanned<String>,
    text: Option<String>,
    chat: Option<String>,
    ids: Option<Vec<u32>>,
    length: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCheckpoint {
    name: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    repo: Option<Spanned<String>>,
    dtype: Option<Spanned<String>>,
    dequantize: Option<bool>,
    engine: Option<Spanned<RawEngine>>,
    backends: Option<Vec<Spanned<String>>>,
    scenarios: Option<Vec<Spanned<String>>>,
    prompts: Option<Vec<Spanned<String>>>,
    settings: Option<SettingsPatch>,
    tolerance: Option<TolerancePatch>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    kind: Spanned<String>,
    command: Option<Spanned<Vec<String>>>,
    paths: Option<Spanned<OrderedPaths>>,
    reference: Option<Spanned<String>>,
    timeout: Option<Spanned<f64>>,
    start_timeout: Option<Spanned<f64>>,
    // kind = "openai" only:
    name: Option<String>,
    url: Option<Spanned<String>>,
    model: Option<Spanned<String>>,
    ready: Option<Spanned<String>>,
    top_logprobs: Option<Spanned<i64>>,
    stream_logprobs: Option<bool>,
    prompt: Option<Spanned<String>>,
    request: Option<Spanned<toml::Table>>,
}

/// One `[engine.paths]` entry: extra arguments, or (kind = "openai") a table with the
/// arguments and the request fields of that path.
#[derive(Deserialize, Clone)]
#[serde(untagged, deny_unknown_fields)]
enum RawPath {
    Args(Vec<String>),
    Table {
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        request: toml::Table,
    },
}

/// `[engine.paths]` in the order written (it decides the order paths run and are reported).
struct OrderedPaths(Vec<(String, RawPath)>);

impl<'de> Deserialize<'de> for OrderedPaths {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OrderedPaths;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a table of path name = [extra arguments]")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<OrderedPaths, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, RawPath>()? {
                    out.push((k, v));
                }
                Ok(OrderedPaths(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Settings as a suite or checkpoint writes them: each key optional, applied over defaults.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SettingsPatch {
    max_tokens: Option<Spanned<i64>>,
    block_size: Option<Spanned<i64>>,
    tile: Option<Spanned<i64>>,
    chunk: Option<Spanned<i64>>,
    lookahead: Option<Spanned<i64>>,
    rollback_every: Option<Spanned<i64>>,
    poison: Option<bool>,
    pool_blocks: Option<Spanned<i64>>,
    lengths: Option<Spanned<Vec<i64>>>,
    concurrent: Option<ConcurrentPatch>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ConcurrentPatch {
    requests: Option<Spanned<i64>>,
    arrivals: Option<Spanned<Vec<i64>>>,
    max_batch: Option<Spanned<i64>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TolerancePatch {
    max_rel_rms: Option<Spanned<f64>>,
    /// Demand identical tokens: a near-tie fails.
    strict: Option<bool>,
    max_logprob_delta: Option<Spanned<f64>>,
    bitwise: Option<bool>,
}

struct Ctx<'a> {
    file: &'a Path,
    text: &'a str,
}

/// Largest count any size, length or step setting may hold: beyond any context parity can run,
/// and small enough that no value in a suite can make a run allocate without bound.
pub const MAX_COUNT: usize = 1 << 24;

/// Where each effective setting was written (suite level or checkpoint override), so a check
/// that involves several settings can point at the one the suite actually set.
type SettingSpans = BTreeMap<&'static str, Range<usize>>;

impl Ctx<'_> {
    fn err(&self, span: std::ops::Range<usize>, message: impl Into<String>) -> SuiteError {
        let (line, column) = line_col(self.text, span.start);
        SuiteError { file: self.file.to_path_buf(), line, column, message: message.into() }
    }

    fn positive(&self, key: &str, v: &Option<Spanned<i64>>, allow_zero: bool) -> Result<Option<usize>, SuiteError> {
        let Some(v) = v else { return Ok(None) };
        let n = *v.get_ref();
        if n < 0 || (n == 0 && !allow_zero) {
            let what = if allow_zero { "must not be negative" } else { "must be positive" };
            return Err(self.err(v.span(), format!("{key}: {n} {what}")));
        }
        if n as u64 > MAX_COUNT as u64 {
            return Err(self.err(v.span(), format!("{key}: {n} is larger than the limit of {MAX_COUNT}")));
        }
        Ok(Some(n as usize))
    }

    /// A name that becomes (part of) a file name: one plain component, or an error at `span`.
    fn file_name(&self, what: &str, name: &str, span: Range<usize>) -> Result<(), SuiteError> {
        crate::names::check_component(name).map_err(|why| {
            self.err(span, format!("{what} `{}` {why}: names become report file names", name.escape_debug()))
        })
    }

    fn apply(&self, p: &SettingsPatch, s: &mut Settings, spans: &mut SettingSpans) -> Result<(), SuiteError> {
        let mut set = |dst: &mut usize, key: &'static str, v: &Option<Spanned<i64>>, zero: bool| {
            if let Some(n) = self.positive(key, v, zero)? {
                *dst = n;
                spans.insert(key, v.as_ref().map(|v| v.span()).unwrap_or(0..0));
            }
            Ok::<(), SuiteError>(())
        };
        set(&mut s.max_tokens, "settings.max_tokens", &p.max_tokens, false)?;
        set(&mut s.block_size, "settings.block_size", &p.block_size, false)?;
        set(&mut s.tile, "settings.tile", &p.tile, false)?;
        if let Some(t) = &p.tile
            && *t.get_ref() % 8 != 0
        {
            return Err(self.err(t.span(), format!("settings.tile: {} is not a multiple of 8", t.get_ref())));
        }
        set(&mut s.chunk, "settings.chunk", &p.chunk, false)?;
        set(&mut s.lookahead, "settings.lookahead", &p.lookahead, true)?;
        set(&mut s.rollback_every, "settings.rollback_every", &p.rollback_every, false)?;
        if let Some(b) = p.poison {
            s.poison = b;
        }
        if let Some(c) = &p.concurrent {
            set(&mut s.concurrent.requests, "settings.concurrent.requests", &c.requests, false)?;
            set(&mut s.concurrent.max_batch, "settings.concurrent.max_batch", &c.max_batch, false)?;
            if let Some(a) = &c.arrivals {
                if a.get_ref().is_empty() || a.get_ref().iter().any(|&x| x < 0 || x as u64 > MAX_COUNT as u64) {
                    return Err(self.err(
                        a.span(),
                        format!("settings.concurrent.arrivals: needs at least one step, each from 0 to {MAX_COUNT}"),
                    ));
                }
                s.concurrent.arrivals = a.get_ref().iter().map(|&x| x as usize).collect();
                spans.insert("settings.concurrent.arrivals", a.span());
            }
        }
        if let Some(n) = self.positive("settings.pool_blocks", &p.pool_blocks, false)? {
            s.pool_blocks = Some(n);
            spans.insert("settings.pool_blocks", p.pool_blocks.as_ref().map(|v| v.span()).unwrap_or(0..0));
        }
        if let Some(l) = &p.lengths {
            // Each length is a prompt sent to the server: bounded like every other count.
            if l.get_ref().is_empty() || l.get_ref().iter().any(|&x| x <= 0 || x as u64 > MAX_COUNT as u64) {
                return Err(self.err(
                    l.span(),
                    format!("settings.lengths: needs at least one length, each from 1 to {MAX_COUNT}"),
                ));
            }
            s.lengths = Some(l.get_ref().iter().map(|&x| x as usize).collect());
            spans.insert("settings.lengths", l.span());
        }
        Ok(())
    }

    /// Settings that make one of the checkpoint's scenarios test nothing (see
    /// [`crate::coverage`]), reported at the first involved setting the suite wrote, else at
    /// the checkpoint.
    fn coverage(
        &self,
        c: &CheckpointSpec,
        prompts: &[PromptSpec],
        spans: &SettingSpans,
        fallback: Range<usize>,
    ) -> Result<(), SuiteError> {
        // Lengths are known before any tokenizer runs when every prompt fixes its length.
        let lengths: Option<Vec<usize>> = prompts
            .iter()
            .filter(|p| c.prompts.contains(&p.name))
            .map(|p| match (&p.length, &p.source) {
                (Some(n), _) => Some(*n),
                (None, PromptSource::Ids(ids)) => Some(ids.len()),
                _ => None,
            })
            .collect();
        let problems = c.settings_problems(lengths.as_deref());
        match problems.into_iter().next() {
            None => Ok(()),
            Some(p) => {
                let span = p.keys.iter().find_map(|k| spans.get(k).cloned()).unwrap_or(fallback);
                Err(self.err(span, format!("{} (checkpoint `{}`)", p.message, c.name)))
            }
        }
    }

    fn tolerance(&self, p: &Option<TolerancePatch>, t: &mut Tolerance) -> Result<(), SuiteError> {
        let Some(p) = p else { return Ok(()) };
        if let Some(v) = &p.max_rel_rms {
            let x = *v.get_ref();
            if !(x.is_finite() && x >= 0.0) {
                return Err(self.err(v.span(), format!("tolerance.max_rel_rms: {x} must be a non-negative number")));
            }
            t.max_rel_rms = x as f32;
        }
        if let Some(v) = &p.max_logprob_delta {
            let x = *v.get_ref();
            if !(x.is_finite() && x >= 0.0) {
                return Err(
                    self.err(v.span(), format!("tolerance.max_logprob_delta: {x} must be a non-negative number"))
                );
            }
            t.max_logprob_delta = x as f32;
        }
        if let Some(b) = p.bitwise {
            t.bitwise = b;
        }
        if let Some(strict) = p.strict {
            t.allow = if strict { vec![Verdict::Identical] } else { vec![Verdict::Identical, Verdict::NearTie] };
        }
        Ok(())
    }

    fn dtype(&self, v: &Spanned<String>) -> Result<DtypeSetting, SuiteError> {
        v.get_ref().parse().map_err(|e: String| self.err(v.span(), format!("dtype: {e}")))
    }

    fn scenarios(&self, list: &[Spanned<String>]) -> Result<Vec<Scenario>, SuiteError> {
        list.iter()
            .map(|s| {
                Scenario::parse(s.get_ref()).ok_or_else(|| {
                    let known = Scenario::known_names();
                    self.err(s.span(), format!("unknown scenario `{}`; known: {}", s.get_ref(), known.join(", ")))
                })
            })
            .collect()
    }

    /// Path names a checkpoint runs: each must be a path of its engine, none twice.
    fn paths(&self, list: &[Spanned<String>], engine: &EngineSpec) -> Result<Vec<String>, SuiteError> {
        let known = engine.known_paths();
        let mut out: Vec<String> = Vec::new();
        for b in list {
            let name = b.get_ref();
            if !known.contains(name) {
                return Err(self.err(b.span(), format!("unknown path `{name}`; this engine has {}", known.join(", "))));
            }
            if out.contains(name) {
                return Err(self.err(b.span(), format!("path `{name}` is listed twice")));
            }
            out.push(name.clone());
        }
        Ok(out)
    }

    fn engine(&self, raw: &Spanned<RawEngine>) -> Result<EngineSpec, SuiteError> {
        let e = raw.get_ref();
        let only_process = |what: &str, span: std::ops::Range<usize>| {
            self.err(span, format!("engine.{what} is only for kind = \"process\""))
        };
        let kind = e.kind.get_ref().as_str();
        if kind != "openai"
            && let Some((key, span)) = engine_openai::openai_only_key(raw)
        {
            return Err(self.err(span, format!("engine.{key} is only for kind = \"openai\"")));
        }
        match kind {
            "openai" => engine_openai::parse(self, raw),
            "builtin" => {
                if let Some(c) = &e.command {
                    return Err(only_process("command", c.span()));
                }
                if let Some(p) = &e.paths {
                    return Err(only_process("paths", p.span()));
                }
                if let Some(r) = &e.reference {
                    return Err(only_process("reference", r.span()));
                }
                Ok(EngineSpec::Builtin)
            }
            "process" => {
                let command = e
                    .command
                    .as_ref()
                    .ok_or_else(|| self.err(raw.span(), "engine: kind = \"process\" needs `command` (an argv list)"))?;
                if command.get_ref().is_empty() || command.get_ref()[0].is_empty() {
                    return Err(self.err(command.span(), "engine.command: give the program and its arguments"));
                }
                let paths = e.paths.as_ref().ok_or_else(|| {
                    self.err(raw.span(), "engine: kind = \"process\" needs [engine.paths] (name = [extra arguments])")
                })?;
                if paths.get_ref().0.is_empty() {
                    return Err(self.err(paths.span(), "engine.paths: name at least one path"));
                }
                // A path name is part of report ids and file names: one plain component.
                for (name, _) in &paths.get_ref().0 {
                    if let Err(why) = crate::names::check_component(name) {
                        return Err(self.err(paths.span(), format!("engine.paths: `{name}` {why}")));
                    }
                }
                let names: Vec<&str> = paths.get_ref().0.iter().map(|(n, _)| n.as_str()).collect();
                let mut args = Vec::new();
                for (name, p) in &paths.get_ref().0 {
                    match p {
                        RawPath::Args(a) => args.push((name.clone(), a.clone())),
                        RawPath::Table { .. } => {
                            return Err(self.err(
                                paths.span(),
                                format!("engine.paths.{name}: kind = \"process\" takes a list of extra arguments"),
                            ));
                        }
                    }
                }
                let reference = match &e.reference {
                    None => ReferenceSpec::Path(names[0].to_string()),
                    Some(r) => match r.get_ref().strip_prefix("builtin:") {
                        Some(b) => ReferenceSpec::Builtin(
                            b.parse().map_err(|m: String| self.err(r.span(), format!("engine.reference: {m}")))?,
                        ),
                        None if names.contains(&r.get_ref().as_str()) => ReferenceSpec::Path(r.get_ref().clone()),
                        None => {
                            let builtin: Vec<String> =
                                BuiltinPath::ALL.iter().map(|p| format!("builtin:{}", p.name())).collect();
                            return Err(self.err(
                                r.span(),
                                format!(
                                    "engine.reference: `{}` is not a path of this engine ({}) nor {}",
                                    r.get_ref(),
                                    names.join(", "),
                                    builtin.join(" / ")
                                ),
                            ));
                        }
                    },
                };
                Ok(EngineSpec::Process(ProcessSpec {
                    command: command.get_ref().clone(),
                    paths: args,
                    reference,
                    timeout: self.seconds("engine.timeout", &e.timeout, 120.0)?,
                    start_timeout: self.seconds("engine.start_timeout", &e.start_timeout, 300.0)?,
                }))
            }
            other => Err(self.err(
                e.kind.span(),
                format!("engine.kind: unknown kind `{other}`; expected builtin, process or openai"),
            )),
        }
    }

    fn seconds(&self, key: &str, v: &Option<Spanned<f64>>, default: f64) -> Result<std::time::Duration, SuiteError> {
        let Some(v) = v else { return Ok(std::time::Duration::from_secs_f64(default)) };
        let x = *v.get_ref();
        if !(x.is_finite() && x > 0.0 && x <= 86_400.0) {
            return Err(self.err(v.span(), format!("{key}: {x} must be a number of seconds in (0, 86400]")));
        }
        Ok(std::time::Duration::from_secs_f64(x))
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
    Tolerance { max_rel_rms, allow: vec![Verdict::Identical, Verdict::NearTie], max_logprob_delta, bitwise: false }
}

pub fn load(file: &Path) -> Result<Suite, SuiteError> {
    let text = std::fs::read_to_string(file).map_err(|e| SuiteError {
        file: file.to_path_buf(),
        line: 0,
        column: 0,
        message: format!("cannot read: {e}"),
    })?;
    parse(file, &text)
}

pub fn parse(file: &Path, text: &str) -> Result<Suite, SuiteError> {
    let cx = Ctx { file, text };
    let raw: RawSuite = toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        cx.err(span, e.message().to_string())
    })?;

    let suite_dtype = raw.dtype.as_ref().map(|d| cx.dtype(d)).transpose()?.unwrap_or(DtypeSetting::Float32);
    let suite_engine = match &raw.engine {
        Some(e) => cx.engine(e)?,
        None => EngineSpec::Builtin,
    };
    let suite_scenarios = match &raw.scenarios {
        Some(s) => cx.scenarios(s)?,
        None => scenario::ALL.to_vec(),
    };
    let mut suite_settings = Settings::default();
    let mut suite_spans = SettingSpans::new();
    if let Some(p) = &raw.settings {
        cx.apply(p, &mut suite_settings, &mut suite_spans)?;
    }
    let name = match &raw.name {
        Some(n) => {
            cx.file_name("suite name", n.get_ref(), n.span())?;
            n.get_ref().clone()
        }
        None => {
            let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            cx.file_name("suite name (from the file name; set `name`)", &stem, 0..0)?;
            stem
        }
    };

    if raw.prompts.is_empty() {
        return Err(cx.err(0..0, "no [[prompts]]: a suite needs at least one prompt"));
    }
    let mut prompts: Vec<PromptSpec> = Vec::new();
    for p in &raw.prompts {
        let span = p.span();
        let p = p.get_ref();
        let name = p.name.get_ref().clone();
        cx.file_name("prompt name", &name, p.name.span())?;
        if prompts.iter().any(|q| q.name == name) {
            return Err(cx.err(p.name.span(), format!("prompt `{name}` is defined twice")));
        }
        let source = match (&p.text, &p.chat, &p.ids) {
            (Some(t), None, None) => PromptSource::Text(t.clone()),
            (None, Some(c), None) => PromptSource::Chat(c.clone()),
            (None, None, Some(ids)) if !ids.is_empty() => PromptSource::Ids(ids.clone()),
            _ => {
                return Err(cx.err(span, format!("prompt `{name}`: give exactly one of text, chat or ids (non-empty)")));
            }
        };
        let length = cx.positive("length", &p.length, false)?;
        prompts.push(PromptSpec { name, source, length });
    }

    if raw.checkpoints.is_empty() {
        return Err(cx.err(0..0, "no [[checkpoints]]: a suite needs at least one checkpoint"));
    }
    let mut checkpoints: Vec<CheckpointSpec> = Vec::new();
    for c in &raw.checkpoints {
        let span = c.span();
        let c = c.get_ref();
        let reference = match (&c.path, &c.repo) {
            (Some(p), None) => expand_env(p.get_ref()).map_err(|m| cx.err(p.span(), format!("path: {m}")))?,
            (None, Some(r)) => r.get_ref().clone(),
            _ => return Err(cx.err(span, "checkpoint: give exactly one of path or repo")),
        };
        let name = match &c.name {
            Some(n) => {
                cx.file_name("checkpoint name", n.get_ref(), n.span())?;
                n.get_ref().clone()
            }
            None => {
                let name = default_name(&reference);
                let at = c.path.as_ref().or(c.repo.as_ref()).map(|v| v.span()).unwrap_or(span.clone());
                cx.file_name("checkpoint name (from its path or repo; set `name`)", &name, at)?;
                name
            }
        };
        if checkpoints.iter().any(|k| k.name == name) {
            return Err(cx.err(span, format!("checkpoint name `{name}` is used twice; set `name`")));
        }
        let dtype = match &c.dtype {
            Some(d) => cx.dtype(d)?,
            None => suite_dtype,
        };
        let mut settings = suite_settings.clone();
        let mut spans = suite_spans.clone();
        if let Some(p) = &c.settings {
            cx.apply(p, &mut settings, &mut spans)?;
        }
        let mut tolerance = default_tolerance(dtype);
        cx.tolerance(&raw.tolerance, &mut tolerance)?;
        cx.tolerance(&c.tolerance, &mut tolerance)?;
        let prompt_names = match &c.prompts {
            Some(list) => {
                let mut names = Vec::new();
                for n in list {
                    if !prompts.iter().any(|p| &p.name == n.get_ref()) {
                        return Err(cx.err(n.span(), format!("unknown prompt `{}`", n.get_ref())));
                    }
                    names.push(n.get_ref().clone());
                }
                names
            }
            None => prompts.iter().map(|p| p.name.clone()).collect(),
        };
        let engine = match &c.engine {
            Some(e) => cx.engine(e)?,
            None => suite_engine.clone(),
        };
        let paths = match c.backends.as_ref().or(raw.backends.as_ref()) {
            Some(b) => cx.paths(b, &engine)?,
            None => engine.path_names(),
        };
        let scenarios = match (&c.scenarios, &raw.scenarios) {
            (Some(s), _) => engine_openai::scenarios_for(&cx, &engine, cx.scenarios(s)?, Some(s), span.clone())?,
            (None, Some(s)) => {
                engine_openai::scenarios_for(&cx, &engine, suite_scenarios.clone(), Some(s), span.clone())?
            }
            (None, None) => engine_openai::scenarios_for(&cx, &engine, suite_scenarios.clone(), None, span.clone())?,
        };
        let spec = CheckpointSpec {
            name,
            reference,
            dtype,
            dequantize: c.dequantize.or(raw.dequantize).unwrap_or(false),
            engine,
            paths,
            scenarios,
            settings,
            tolerance,
            prompts: prompt_names,
        };
        cx.coverage(&spec, &prompts, &spans, span)?;
        checkpoints.push(spec);
    }

    Ok(Suite { name, file: file.to_path_buf(), prompts, checkpoints })
}

/// A checkpoint's report name from its reference: the last path component or the repo name,
/// without a `.toml` extension.
fn default_name(reference: &str) -> String {
    let last = reference.trim_end_matches('/').rsplit('/').next().unwrap_or(reference);
    last.strip_suffix(".toml").unwrap_or(last).to_string()
}

/// `${VAR}` and `${VAR:-default}` in checkpoint paths, so a suite can point at a machine's
/// own copy of a model without editing the file.
pub fn expand_env(s: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unterminated `${{` in `{s}`"))?;
        let inner = &after[..end];
        let (var, default) = match inner.split_once(":-") {
            Some((v, d)) => (v, Some(d)),
            None => (inner, None),
        };
        match (std::env::var(var).ok().filter(|v| !v.is_empty()), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "environment variable {var} is not set (write ${{{var}:-default}} for a fallback)"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// 1-based line and column of a byte offset. An offset inside a multi-byte character counts
/// from that character's start (TOML error spans are not guaranteed to fall on a boundary).
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, column)
}
