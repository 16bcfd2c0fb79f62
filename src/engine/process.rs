//! Engine kind `process`: one adapter child per path, driven over the step protocol
//! (docs/step-protocol.md, wire types in [`super::protocol`]).
//!
//! Failure containment: an error reply fails the case that sent it and the adapter keeps
//! serving. A crash, a hang past the timeout, or a reply that breaks the protocol kills the
//! adapter (its whole process group) and fails the case with the adapter's stderr tail; the
//! next case starts a fresh adapter. Two such failures in a row and the path is given up: its
//! remaining cases fail at once with the first error, so a broken adapter costs at most two
//! timeouts, never a hung run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use mlx_rs::Array;
use serde::de::DeserializeOwned;

use super::protocol::{
    CreateReply, Envelope, ForwardReply, HelloReply, Request, ShareReply, StatsReply, TrimReply, VERSION, WireRow,
    WireStats,
};
use super::{Capabilities, Dirs, EnginePath, PathInfo, Session, ShareMode};
use crate::dtype::DtypeName;
use crate::error::{Error, Result};
use crate::faults::{Fault, Faults};
use crate::kv::Counters;
use crate::kv::{KvStats, SeqId};
use crate::model::RowStep;
use crate::proc::{self, Child, Spawn};
use crate::vocab::{EngineId, ProcessSpec, Settings};

/// Consecutive broken exchanges after which a path is given up.
const GIVE_UP_AFTER: u32 = 2;
/// How long an adapter may take to exit after `shutdown` before its group is killed.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How one request went wrong.
enum CallError {
    /// The adapter answered `ok: false`: it is alive and the case fails.
    Reply(String),
    /// The adapter answered `unsupported`: the case is skipped.
    Unsupported(String),
    /// No usable answer (crash, timeout, garbage): the adapter is gone.
    Broken(String),
}

/// A running adapter and its stdout lines.
struct Client {
    child: Child,
    lines: Receiver<std::io::Result<String>>,
    next_id: u64,
}

impl Client {
    fn spawn(argv: &[String], cwd: &Path) -> std::result::Result<Client, String> {
        let mut child = Child::spawn(&Spawn {
            argv: argv.to_vec(),
            cwd: cwd.to_path_buf(),
            env: Vec::new(),
            stdin: true,
            stdout: proc::Stdout::Piped,
            log_file: None,
        })
        .map_err(|e| e.to_string())?;
        let lines = child.stdout_lines().ok_or("the adapter's stdout is not readable")?;
        Ok(Client { child, lines, next_id: 0 })
    }

    /// Send one request and wait up to `timeout` for its reply. On `Broken`, the caller
    /// must drop the client (which kills the adapter's group).
    fn call(&mut self, request: &Request, timeout: Duration) -> std::result::Result<serde_json::Value, CallError> {
        let id = self.next_id;
        self.next_id += 1;
        let op = request.op();
        let line = serde_json::to_string(&Envelope { id, request: request.clone() })
            .map_err(|e| CallError::Broken(format!("cannot encode {op}: {e}")))?;
        if let Err(e) = self.child.send_line(&line) {
            return Err(self.broken(&format!("{op}: cannot write to the adapter ({e})")));
        }
        let deadline = Instant::now() + timeout;
        let reply = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Ok(line)) if line.trim().is_empty() => continue,
                Ok(Ok(line)) => break line,
                Ok(Err(e)) => return Err(self.broken(&format!("{op}: reading the adapter's stdout failed ({e})"))),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(
                        self.broken(&format!("{op}: no reply within {}s (engine.timeout)", timeout.as_secs_f64()))
                    );
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.broken(&format!("{op}: the adapter closed its stdout before replying")));
                }
            }
        };
        let value: serde_json::Value = serde_json::from_str(&reply)
            .map_err(|e| self.broken(&format!("{op}: reply is not JSON ({e}): {}", excerpt(&reply))))?;
        if value.get("id").and_then(|v| v.as_u64()) != Some(id) {
            return Err(self.broken(&format!(
                "{op}: reply has id {}, expected {id}",
                value.get("id").unwrap_or(&serde_json::Value::Null)
            )));
        }
        match value.get("ok").and_then(|v| v.as_bool()) {
            Some(true) => Ok(value),
            Some(false) => {
                let msg = value.get("error").and_then(|v| v.as_str()).unwrap_or("(no error message)").to_string();
                if value.get("unsupported").and_then(|v| v.as_bool()) == Some(true) {
                    Err(CallError::Unsupported(msg))
                } else {
                    Err(CallError::Reply(format!("{op}: {msg}")))
                }
            }
            None => Err(self.broken(&format!("{op}: reply has no boolean `ok`: {}", excerpt(&reply)))),
        }
    }

    /// Describe a broken exchange with how the adapter ended and its stderr tail.
    fn broken(&mut self, what: &str) -> CallError {
        // Give a crashing adapter a moment to finish dying, so its exit status and last
        // words make the message.
        let deadline = Instant::now() + Duration::from_millis(300);
        while self.child.exited().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let (status, tail) = match self.child.exited() {
            // Dead: what it wrote last is on its way; wait for it (bounded, its group may
            // still hold the pipe open).
            Some(s) => {
                (format!("; the adapter {}", proc::describe_exit(s)), self.child.settled_tail(Duration::from_secs(2)))
            }
            None => (String::new(), self.child.tail()),
        };
        let tail = if tail.is_empty() { String::new() } else { format!("\nadapter stderr (last lines):\n{tail}") };
        CallError::Broken(format!("{what}{status}{tail}"))
    }

    fn shutdown(mut self) {
        let _ = self.call(&Request::Shutdown, SHUTDOWN_GRACE);
        self.child.close_stdin();
        self.child.stop(SHUTDOWN_GRACE);
    }
}

fn excerpt(s: &str) -> String {
    let s = s.trim();
    if s.len() <= 200 {
        return s.to_string();
    }
    let mut cut = 200;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{} [... {} bytes]", &s[..cut], s.len())
}

/// One path of a `process` engine.
pub struct ProcessPath {
    argv: Vec<String>,
    cwd: PathBuf,
    hello: Request,
    timeout: Duration,
    start_timeout: Duration,
    info: PathInfo,
    client: Option<Client>,
    failures: u32,
    given_up: Option<String>,
}

impl ProcessPath {
    /// Start the adapter for `path` and shake hands. The command's placeholders: `{model}`
    /// (the engine's model file where the suite names one, else the checkpoint),
    /// `{checkpoint}` (the resolved checkpoint directory), `{path}`, `{suite_dir}`, `{dtype}`
    /// (the suite's setting: `float32`, `bfloat16`, `float16` or `native`) and `{parity}`
    /// (this executable).
    pub fn start(spec: &ProcessSpec, path: &str, dirs: Dirs, dtype: &str, settings: &Settings) -> Result<Self> {
        let (checkpoint, suite_dir) = dirs.absolute();
        let model = match &spec.model {
            Some(m) => suite_dir.join(m),
            None => checkpoint.clone(),
        };
        let checkpoint_s = checkpoint.display().to_string();
        let extra = spec
            .paths
            .iter()
            .find(|(n, _)| n == path)
            .map(|(_, a)| a.clone())
            .ok_or_else(|| Error::Invalid(format!("engine has no path `{path}`")))?;
        let parity = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "parity".into());
        let (model_s, suite_s) = (model.display().to_string(), suite_dir.display().to_string());
        let values = [
            ("model", model_s.as_str()),
            ("checkpoint", &checkpoint_s),
            ("path", path),
            ("suite_dir", &suite_s),
            ("dtype", dtype),
            ("parity", &parity),
        ];
        let argv = super::command(&spec.command, &extra, &values, &suite_dir);
        let hello =
            Request::Hello { protocol: VERSION, model: model_s, path: path.to_string(), settings: settings.clone() };
        let mut p = ProcessPath {
            argv,
            cwd: suite_dir,
            hello,
            timeout: spec.timeout,
            start_timeout: spec.start_timeout,
            info: PathInfo {
                name: path.to_string(),
                engine: EngineId::unnamed("process", ""),
                vocab_size: 0,
                dtype: DtypeName::Float32,
                capabilities: Capabilities {
                    masked_prefix: false,
                    share_prefix: false,
                    max_batch: Some(1),
                    stats: false,
                    block_size: None,
                    kv_row_bytes: None,
                    faults: Vec::new(),
                },
            },
            client: None,
            failures: 0,
            given_up: None,
        };
        let (client, info) = p.connect()?;
        p.info = info;
        p.client = Some(client);
        Ok(p)
    }

    fn engine_error(&self, message: impl Into<String>) -> Error {
        Error::Engine { engine: self.describe_engine(), path: self.info.name.clone(), message: message.into() }
    }

    fn describe_engine(&self) -> String {
        if self.info.engine.name.is_empty() {
            format!("`{}`", self.argv.join(" "))
        } else {
            format!("{} {}", self.info.engine.name, self.info.engine.version)
        }
    }

    /// Spawn the adapter and check its hello against what parity needs.
    fn connect(&mut self) -> Result<(Client, PathInfo)> {
        let mut client = Client::spawn(&self.argv, &self.cwd).map_err(|e| self.engine_error(e))?;
        let value = client.call(&self.hello, self.start_timeout).map_err(|e| match e {
            CallError::Reply(m) | CallError::Unsupported(m) | CallError::Broken(m) => self.engine_error(m),
        })?;
        let hello: HelloReply = parse("hello", value).map_err(|m| self.engine_error(m))?;
        let info = self.info_from(hello).map_err(|m| self.engine_error(format!("hello: {m}")))?;
        Ok((client, info))
    }

    fn info_from(&self, h: HelloReply) -> std::result::Result<PathInfo, String> {
        if h.protocol != VERSION {
            return Err(format!("the adapter speaks protocol {}, parity speaks {VERSION}", h.protocol));
        }
        if h.vocab_size == 0 {
            return Err("vocab_size is 0".into());
        }
        let dtype = match h.dtype.as_str() {
            "float32" => DtypeName::Float32,
            "bfloat16" => DtypeName::Bfloat16,
            "float16" => DtypeName::Float16,
            other => return Err(format!("unknown dtype `{other}` (float32, bfloat16 or float16)")),
        };
        let faults = h
            .capabilities
            .faults
            .iter()
            .map(|f| Fault::parse(f).ok_or_else(|| format!("unknown fault `{f}` in capabilities.faults")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if h.capabilities.max_batch == Some(0) {
            return Err("capabilities.max_batch is 0".into());
        }
        if h.capabilities.kv_row_bytes == Some(0) {
            return Err("capabilities.kv_row_bytes is 0".into());
        }
        Ok(PathInfo {
            name: self.info.name.clone(),
            engine: EngineId {
                kind: "process".into(),
                name: h.engine.name,
                version: h.engine.version,
                device: h.engine.device,
            },
            vocab_size: h.vocab_size,
            dtype,
            capabilities: Capabilities {
                masked_prefix: h.capabilities.masked_prefix,
                share_prefix: h.capabilities.share_prefix,
                max_batch: h.capabilities.max_batch,
                stats: h.capabilities.stats,
                block_size: h.capabilities.block_size,
                kv_row_bytes: h.capabilities.kv_row_bytes,
                faults,
            },
        })
    }

    /// One request on the live adapter, with the failure bookkeeping described above.
    fn call<T: DeserializeOwned>(&mut self, request: &Request) -> Result<T> {
        if let Some(why) = &self.given_up {
            return Err(self.engine_error(format!("given up after {GIVE_UP_AFTER} failures in a row; first: {why}")));
        }
        let Some(client) = self.client.as_mut() else {
            return Err(self.engine_error("the adapter is not running"));
        };
        let op = request.op();
        let result = client.call(request, self.timeout);
        match result {
            Ok(value) => parse::<T>(op, value).map_err(|m| self.fail(m)),
            Err(CallError::Reply(m)) => Err(self.engine_error(m)),
            Err(CallError::Unsupported(m)) => Err(Error::Unsupported(format!("path `{}`: {m}", self.info.name))),
            Err(CallError::Broken(m)) => Err(self.fail(m)),
        }
    }

    /// The adapter broke the protocol or died: kill it, count it, maybe give up.
    fn fail(&mut self, message: String) -> Error {
        self.client = None; // dropping the client kills the adapter's group
        self.failures += 1;
        if self.failures >= GIVE_UP_AFTER && self.given_up.is_none() {
            self.given_up = Some(message.lines().next().unwrap_or_default().to_string());
        }
        self.engine_error(message)
    }
}

impl Drop for ProcessPath {
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            c.shutdown();
        }
    }
}

/// A reply's fields, or a sentence saying which is missing or wrong.
fn parse<T: DeserializeOwned>(op: &str, value: serde_json::Value) -> std::result::Result<T, String> {
    serde_json::from_value(value).map_err(|e| format!("{op}: malformed reply: {e}"))
}

impl EnginePath for ProcessPath {
    fn info(&self) -> &PathInfo {
        &self.info
    }

    fn session(&mut self, faults: Faults) -> Result<Box<dyn Session + '_>> {
        self.info.check_faults(faults)?;
        if self.client.is_none() && self.given_up.is_none() {
            match self.connect() {
                Ok((client, info)) if info == self.info => self.client = Some(client),
                Ok(_) => return Err(self.fail("the restarted adapter's hello differs from its first".into())),
                Err(e) => return Err(self.fail(e.to_string())),
            }
        }
        let faults: Vec<String> = faults.list().iter().map(|f| f.name().to_string()).collect();
        self.call::<Ack>(&Request::Reset { faults })?;
        let failures_before = self.failures;
        Ok(Box::new(ProcessSession { path: self, seqs: BTreeMap::new(), failures_before, stats: None }))
    }
}

/// A reply with nothing in it but `ok`.
#[derive(serde::Deserialize)]
struct Ack {}

/// What parity knows of a sequence: as the adapter last reported it.
#[derive(Debug, Clone, Copy)]
struct SeqState {
    len: usize,
    masked: usize,
}

struct ProcessSession<'a> {
    path: &'a mut ProcessPath,
    seqs: BTreeMap<SeqId, SeqState>,
    /// The path's failure count when this case began: a case that ends without a new one
    /// clears it, so only failures in consecutive cases add up to giving up.
    failures_before: u32,
    /// The last `stats` reply, until the next operation: the end of a case reads the books,
    /// the counters and the memory of one state, so the adapter is asked once.
    stats: Option<WireStats>,
}

impl Drop for ProcessSession<'_> {
    fn drop(&mut self) {
        if self.path.failures == self.failures_before {
            self.path.failures = 0;
        }
    }
}

impl ProcessSession<'_> {
    fn state(&self, seq: SeqId) -> Result<SeqState> {
        self.seqs.get(&seq).copied().ok_or_else(|| Error::Kv(format!("unknown sequence {}", seq.0)))
    }

    fn new_seq(&mut self, seq: u32, state: SeqState) -> Result<SeqId> {
        let id = SeqId(seq);
        if self.seqs.insert(id, state).is_some() {
            return Err(self.path.engine_error(format!("the adapter reused sequence id {seq}")));
        }
        Ok(id)
    }
}

impl Session for ProcessSession<'_> {
    fn create(&mut self, masked_prefix: usize) -> Result<SeqId> {
        self.stats = None;
        if masked_prefix > 0 && !self.path.info.capabilities.masked_prefix {
            return Err(Error::Unsupported(format!("path `{}` cannot mask left-pad rows", self.path.info.name)));
        }
        let r: CreateReply = self.path.call(&Request::Create { masked_prefix })?;
        self.new_seq(r.seq, SeqState { len: 0, masked: masked_prefix })
    }

    fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.len)
    }

    fn masked_prefix(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.masked)
    }

    fn forward(&mut self, rows: &[RowStep]) -> Result<Array> {
        self.stats = None;
        let t = rows.first().map(|r| r.tokens.len()).unwrap_or(0);
        if t == 0 || rows.iter().any(|r| r.tokens.len() != t || r.logits_at >= t) {
            return Err(Error::Invalid("every row of a step needs the same, non-zero number of tokens".into()));
        }
        let mut before = Vec::with_capacity(rows.len());
        for r in rows {
            before.push(self.state(r.seq)?.len);
        }
        let wire =
            rows.iter().map(|r| WireRow { seq: r.seq.0, tokens: r.tokens.clone(), logits_at: r.logits_at }).collect();
        let reply: ForwardReply = self.path.call(&Request::Forward { rows: wire })?;
        let vocab = self.path.info.vocab_size;
        let values = reply.logits.decode(rows.len(), vocab).map_err(|m| self.path.fail(format!("forward: {m}")))?;
        if reply.lengths.len() != rows.len() {
            return Err(self.path.fail(format!("forward: {} lengths for {} rows", reply.lengths.len(), rows.len())));
        }
        for ((r, &old), &new) in rows.iter().zip(&before).zip(&reply.lengths) {
            // The engine's own counter must have moved by exactly the tokens written: a second
            // source of truth for positions is the bug this catches.
            if new != old + t {
                return Err(self.path.engine_error(format!(
                    "forward: sequence {} had {old} rows, {t} were appended, the engine reports {new}",
                    r.seq.0
                )));
            }
        }
        for (r, &new) in rows.iter().zip(&reply.lengths) {
            if let Some(s) = self.seqs.get_mut(&r.seq) {
                s.len = new;
            }
        }
        Ok(Array::from_slice(&values, &[rows.len() as i32, vocab as i32]))
    }

    fn trim(&mut self, seq: SeqId, n: usize) -> Result<usize> {
        self.stats = None;
        self.state(seq)?;
        let r: TrimReply = self.path.call(&Request::Trim { seq: seq.0, n })?;
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len = r.len;
        }
        Ok(r.removed)
    }

    fn release(&mut self, seq: SeqId) -> Result<()> {
        self.stats = None;
        self.state(seq)?;
        let _: Ack = self.path.call(&Request::Release { seq: seq.0 })?;
        self.seqs.remove(&seq);
        Ok(())
    }

    fn share_prefix(&mut self, donor: SeqId, rows: usize) -> Result<Option<(SeqId, ShareMode)>> {
        self.stats = None;
        let d = self.state(donor)?;
        if !self.path.info.capabilities.share_prefix {
            return Err(Error::Unsupported(format!("path `{}` cannot share a prefix", self.path.info.name)));
        }
        let r: ShareReply = self.path.call(&Request::SharePrefix { donor: donor.0, rows })?;
        let Some(seq) = r.seq else { return Ok(None) };
        let mode = match r.mode.as_deref() {
            Some("share") => ShareMode::Storage,
            Some("copy") => ShareMode::Copy,
            other => {
                return Err(self.path.fail(format!("share_prefix: mode {other:?}, expected \"share\" or \"copy\"")));
            }
        };
        let id = self.new_seq(seq, SeqState { len: rows, masked: d.masked.min(rows) })?;
        Ok(Some((id, mode)))
    }

    fn stats(&mut self) -> Result<Option<KvStats>> {
        Ok(self.wire_stats()?.map(|w| w.kv))
    }

    fn counters(&mut self) -> Result<Option<Counters>> {
        Ok(self.wire_stats()?.and_then(|w| w.counters))
    }

    /// From outside an engine the books are what it reports: with no live sequence (by
    /// parity's count and by the engine's), nothing may still be held.
    fn audit(&mut self) -> Result<Option<String>> {
        let Some(w) = self.wire_stats()? else { return Ok(None) };
        if !self.seqs.is_empty() || w.sequences > 0 {
            return Ok(None);
        }
        Ok((w.kv.blocks_in_use > 0 || w.kv.bytes_in_use > 0).then(|| {
            format!(
                "every sequence was released, yet the engine still holds {} blocks ({} bytes) of KV",
                w.kv.blocks_in_use, w.kv.bytes_in_use
            )
        }))
    }
}

impl ProcessSession<'_> {
    fn wire_stats(&mut self) -> Result<Option<WireStats>> {
        if !self.path.info.capabilities.stats {
            return Ok(None);
        }
        if self.stats.is_none() {
            let r: StatsReply = self.path.call(&Request::Stats)?;
            self.stats = Some(r.stats);
        }
        Ok(self.stats)
    }
}
