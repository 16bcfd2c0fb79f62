//! `parity adapter`: parity's own runtime served over the step protocol. It is the protocol's
//! proof (a suite through `builtin` and through this adapter must give bit-identical reports,
//! and every planted fault must still be caught through it) and a working example of an
//! adapter for engine teams.

use std::io::{BufRead, Write};

use serde_json::{Value, json};

use super::builtin::{Builtin, BuiltinSession};
use super::protocol::{Envelope, Request, VERSION, WireLogits, WireStats};
use super::{EnginePath, Session, ShareMode};
use crate::array::host_f32;
use crate::error::{Error, Result};
use crate::faults::{Fault, Faults};
use crate::kv::Counters;
use crate::kv::{KvCache, SeqId};
use crate::model::{Model, RowStep};
use crate::vocab::BuiltinPath;

/// What the adapter holds after `hello`: the path and the KV store of the current case.
struct Served<'m> {
    path: Builtin<'m>,
    kv: Box<dyn KvCache>,
    /// Model calls on `kv` since the last reset (a session is opened per request).
    calls: Counters,
    faults: Faults,
    /// Live sequences (for `stats`).
    live: usize,
}

/// Serve requests from `input` until `shutdown` or end of input. Protocol errors are replies;
/// only an I/O error on `output` ends the loop with an error.
pub fn serve(model: &Model, path: BuiltinPath, input: impl BufRead, mut output: impl Write) -> Result<()> {
    let mut served: Option<Served> = None;
    for line in input.lines() {
        let line = line.map_err(|e| Error::Invalid(format!("reading stdin: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let (id, result, stop) = match serde_json::from_str::<Envelope>(&line) {
            Ok(env) => {
                let stop = env.request == Request::Shutdown;
                (json!(env.id), handle(model, path, &mut served, env.request), stop)
            }
            Err(e) => {
                // Echo the id when the line has one, so the client can match the error.
                let id = serde_json::from_str::<Value>(&line).ok().and_then(|v| v.get("id").cloned());
                (id.unwrap_or(Value::Null), Err(Error::Invalid(format!("malformed request: {e}"))), false)
            }
        };
        let mut reply = match result {
            Ok(Value::Object(fields)) => Value::Object(fields),
            Ok(_) => json!({}),
            Err(e) => json!({"ok": false, "error": e.to_string()}),
        };
        if let Value::Object(m) = &mut reply {
            m.insert("id".into(), id);
            m.entry("ok").or_insert(Value::Bool(true));
        }
        let text = serde_json::to_string(&reply).map_err(|e| Error::Invalid(format!("encoding a reply: {e}")))?;
        writeln!(output, "{text}").and_then(|_| output.flush()).map_err(|e| Error::Invalid(format!("stdout: {e}")))?;
        if stop {
            break;
        }
    }
    Ok(())
}

fn handle<'m>(model: &'m Model, path: BuiltinPath, served: &mut Option<Served<'m>>, request: Request) -> Result<Value> {
    if let Request::Hello { protocol, settings, .. } = &request {
        if *protocol != VERSION {
            return Err(Error::Invalid(format!("protocol {protocol} requested; this adapter speaks {VERSION}")));
        }
        let path = Builtin::new(model, path, settings);
        let info = path.info().clone();
        let kv = path.kv(Faults::NONE)?;
        *served = Some(Served { path, kv, calls: Counters::default(), faults: Faults::NONE, live: 0 });
        let c = &info.capabilities;
        return Ok(json!({
            "protocol": VERSION,
            "engine": {"name": "parity", "version": env!("CARGO_PKG_VERSION")},
            "vocab_size": info.vocab_size,
            "dtype": info.dtype.name(),
            "capabilities": {
                "masked_prefix": c.masked_prefix,
                "share_prefix": c.share_prefix,
                "max_batch": c.max_batch,
                "stats": c.stats,
                "faults": c.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
                "block_size": c.block_size,
                "kv_row_bytes": c.kv_row_bytes,
            },
        }));
    }
    let s = served.as_mut().ok_or_else(|| Error::Invalid("the first request must be hello".into()))?;
    if let Request::Reset { faults } = &request {
        let mut set = Faults::NONE;
        for f in faults {
            set = set.with(Fault::parse(f).ok_or_else(|| Error::Invalid(format!("unknown fault `{f}`")))?);
        }
        s.kv = s.path.kv(set)?;
        s.calls = Counters::default();
        s.faults = set;
        s.live = 0;
        return Ok(json!({}));
    }
    let mut session = BuiltinSession::new(model, s.kv.as_mut(), &mut s.calls, s.faults, s.path.path().attention);
    Ok(match request {
        // Answered above; an arm here keeps the match total without a panic path.
        Request::Hello { .. } | Request::Reset { .. } => json!({}),
        Request::Create { masked_prefix } => {
            let seq = session.create(masked_prefix)?;
            s.live += 1;
            json!({"seq": seq.0})
        }
        Request::Forward { rows } => {
            let steps: Vec<RowStep> = rows
                .iter()
                .map(|r| RowStep { seq: SeqId(r.seq), tokens: r.tokens.clone(), logits_at: r.logits_at })
                .collect();
            let logits = session.forward(&steps)?;
            let lengths = steps.iter().map(|r| session.len(r.seq)).collect::<Result<Vec<_>>>()?;
            let shape = logits.shape().to_vec();
            let values = host_f32(&logits)?;
            json!({"lengths": lengths, "logits": WireLogits::encode(&values, shape[0] as usize, shape[1] as usize)})
        }
        Request::Trim { seq, n } => {
            let removed = session.trim(SeqId(seq), n)?;
            json!({"removed": removed, "len": session.len(SeqId(seq))?})
        }
        Request::Release { seq } => {
            session.release(SeqId(seq))?;
            s.live = s.live.saturating_sub(1);
            json!({})
        }
        Request::SharePrefix { donor, rows } => match session.share_prefix(SeqId(donor), rows)? {
            Some((seq, mode)) => {
                s.live += 1;
                let mode = match mode {
                    ShareMode::Storage => "share",
                    ShareMode::Copy => "copy",
                };
                json!({"seq": seq.0, "mode": mode})
            }
            None => json!({"seq": null}),
        },
        Request::Stats => {
            let stats = session.stats()?.unwrap_or_default();
            let counters = session.counters()?;
            json!({"stats": WireStats { kv: stats, sequences: s.live, counters }})
        }
        Request::Shutdown => json!({}),
    })
}
