//! Scripts: a schedule of step-level operations over a few named sequences, as plain data and
//! as the short text a reproducer is printed in and a suite pins (`[[scripts]]`). `parity
//! explore` generates them at random and shrinks the failing ones; the `script` scenario runs
//! pinned ones as rows of `parity run`.
//!
//! ```text
//! a = trim37[:17] m2   a new sequence on prompt trim37's first 17 tokens, 2 masked left pads
//! prefill a 9          one forward: a's next 9 rows (pads first), logits at the last
//! prefill a,b 4        one forward, each row its next 4 rows
//! step a,b             one batched decode step: each row its next token
//! trim a 3             drop a's newest 3 rows (the stream rewinds; the trim is verified)
//! c = a@12 + japan     c holds a's first 12 rows (shared or copied); its stream goes on
//!                      with japan's tokens
//! release a
//! ```
//!
//! Each sequence reads a fixed token stream: its prompt (or a donor's first rows and then a
//! prompt), followed by the reference's greedy continuation. Every logits row a path returns
//! is compared with the reference's logits for the same stream prefix.
//!
//! A server cannot be stepped: its scripts are [`RequestScript`]s, requests sent when their
//! condition holds, each compared with the reference path's answer to its prompt alone.
//!
//! ```text
//! r0 = trim37[:20]                 sent at once
//! r1 = japan at r0+3               once r0 has streamed 3 tokens
//! r2 = r0 + answer after r0        r0's prompt and its answer, once r0 ended (a cache hit)
//! r3 = r0 + answer + japan[:2] after r1
//! r4 = r0[:12] after r2 max 4      r0's prompt cut back to 12 tokens, 4 tokens asked for
//! ```

use std::fmt;

/// A prompt of the suite, cut to its first `cut` tokens (all of them when `None`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PromptCut {
    pub prompt: String,
    pub cut: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `a = trim37[:17] m2`: a new sequence on a prompt's stream, its first `masked` rows
    /// left pads that are never attended and take no position.
    Create { seq: String, stream: PromptCut, masked: usize },
    /// `c = a@12 + japan`: a new sequence holding `donor`'s first `rows` rows; its stream is
    /// the donor's first `rows` tokens, then `then`'s.
    Share { seq: String, donor: String, rows: usize, then: PromptCut },
    /// `prefill a,b 4` (`step a,b` when `rows` is 1): one forward in which each sequence
    /// feeds its next `rows` rows.
    Feed { seqs: Vec<String>, rows: usize },
    /// `trim a 3`.
    Trim { seq: String, rows: usize },
    /// `release a`.
    Release { seq: String },
}

impl Op {
    /// The sequences the operation names.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Op::Create { seq, .. } | Op::Trim { seq, .. } | Op::Release { seq } => vec![seq],
            Op::Share { seq, donor, .. } => vec![seq, donor],
            Op::Feed { seqs, .. } => seqs.iter().map(String::as_str).collect(),
        }
    }
}

/// A schedule of operations, run in order on one fresh KV store.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Script {
    pub ops: Vec<Op>,
}

impl fmt::Display for PromptCut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cut {
            Some(n) => write!(f, "{}[:{n}]", self.prompt),
            None => write!(f, "{}", self.prompt),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Create { seq, stream, masked: 0 } => write!(f, "{seq} = {stream}"),
            Op::Create { seq, stream, masked } => write!(f, "{seq} = {stream} m{masked}"),
            Op::Share { seq, donor, rows, then } => write!(f, "{seq} = {donor}@{rows} + {then}"),
            Op::Feed { seqs, rows: 1 } => write!(f, "step {}", seqs.join(",")),
            Op::Feed { seqs, rows } => write!(f, "prefill {} {rows}", seqs.join(",")),
            Op::Trim { seq, rows } => write!(f, "trim {seq} {rows}"),
            Op::Release { seq } => write!(f, "release {seq}"),
        }
    }
}

/// One line, operations separated by `; `: how a reproducer is printed and pinned.
impl fmt::Display for Script {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ops: Vec<String> = self.ops.iter().map(ToString::to_string).collect();
        f.write_str(&ops.join("; "))
    }
}

/// Largest count a script may name (rows, cuts, pads): scripts are untrusted input.
const MAX_ROWS: usize = 1 << 20;

impl std::str::FromStr for Script {
    type Err = String;

    /// Operations separated by `;` or newlines; a `#` starts a comment. An error names the
    /// operation (1-based) and what is wrong with it.
    fn from_str(text: &str) -> Result<Script, String> {
        let mut ops = Vec::new();
        let parts = text.lines().flat_map(|l| l.split('#').next().unwrap_or_default().split(';'));
        for (i, part) in parts.map(str::trim).filter(|p| !p.is_empty()).enumerate() {
            ops.push(parse_op(part).map_err(|e| format!("operation {} `{part}`: {e}", i + 1))?);
        }
        if ops.is_empty() {
            return Err("no operations".into());
        }
        Ok(Script { ops })
    }
}

fn parse_op(s: &str) -> Result<Op, String> {
    if let Some((seq, rhs)) = s.split_once('=') {
        let seq = name(seq.trim())?;
        let rhs = rhs.trim();
        if let Some((donor, rest)) = rhs.split_once('@') {
            let (rows, then) = rest.split_once('+').ok_or("a share is `c = a@ROWS + PROMPT`")?;
            return Ok(Op::Share {
                seq,
                donor: name(donor.trim())?,
                rows: count(rows.trim(), "rows")?,
                then: prompt_cut(then.trim())?,
            });
        }
        let mut words = rhs.split_whitespace();
        let stream = prompt_cut(words.next().ok_or("a sequence needs a prompt: `a = PROMPT`")?)?;
        let masked = match words.next() {
            None => 0,
            Some(m) => {
                count(m.strip_prefix('m').ok_or("after the prompt only `mN` (masked pads) may follow")?, "pads")?
            }
        };
        if let Some(extra) = words.next() {
            return Err(format!("unexpected `{extra}`"));
        }
        return Ok(Op::Create { seq, stream, masked });
    }
    let words: Vec<&str> = s.split_whitespace().collect();
    let seqs = |w: &str| -> Result<Vec<String>, String> {
        let names = w.split(',').map(|n| name(n.trim())).collect::<Result<Vec<_>, _>>()?;
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(format!("`{n}` is named twice in one forward"));
            }
        }
        Ok(names)
    };
    match words.as_slice() {
        ["step", list] => Ok(Op::Feed { seqs: seqs(list)?, rows: 1 }),
        ["prefill", list, n] => Ok(Op::Feed { seqs: seqs(list)?, rows: positive(n, "rows")? }),
        ["trim", seq, n] => Ok(Op::Trim { seq: name(seq)?, rows: positive(n, "rows")? }),
        ["release", seq] => Ok(Op::Release { seq: name(seq)? }),
        _ => {
            Err("expected `a = PROMPT`, `c = a@ROWS + PROMPT`, `prefill a,b N`, `step a,b`, `trim a N` or `release a`"
                .into())
        }
    }
}

/// A sequence name: a lowercase letter, then letters or digits.
fn name(s: &str) -> Result<String, String> {
    let ok = s.chars().next().is_some_and(|c| c.is_ascii_lowercase())
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && s.len() <= 16;
    if ok { Ok(s.to_string()) } else { Err(format!("`{s}` is not a sequence name (a-z, then a-z or 0-9)")) }
}

/// `trim37` or `trim37[:17]`.
fn prompt_cut(s: &str) -> Result<PromptCut, String> {
    let (prompt, cut) = match s.split_once("[:") {
        Some((p, rest)) => {
            let n = rest.strip_suffix(']').ok_or_else(|| format!("`{s}`: a cut is `PROMPT[:N]`"))?;
            (p, Some(positive(n, "cut")?))
        }
        None => (s, None),
    };
    if prompt.is_empty() || prompt.contains(char::is_whitespace) {
        return Err(format!("`{s}` is not a prompt name"));
    }
    Ok(PromptCut { prompt: prompt.to_string(), cut })
}

fn count(s: &str, what: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("{what}: `{s}` is not a number"))?;
    if n > MAX_ROWS {
        return Err(format!("{what}: {n} is larger than the limit of {MAX_ROWS}"));
    }
    Ok(n)
}

fn positive(s: &str, what: &str) -> Result<usize, String> {
    match count(s, what)? {
        0 => Err(format!("{what}: must be positive")),
        n => Ok(n),
    }
}

/// What a request sends as its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestPrompt {
    /// `trim37[:20]`.
    Prompt(PromptCut),
    /// `r0 + answer [+ PROMPT]`: an earlier request's prompt and the reference's answer to it
    /// (a conversation going on: a prompt cache holds all of it but the new part).
    Extends { of: String, then: Option<PromptCut> },
    /// `r0[:12]`: the first tokens of an earlier request's prompt (a cached sequence cut back).
    Back { of: String, cut: usize },
}

/// When a request is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestWhen {
    Now,
    /// `after r0`: once r0 has ended.
    After(String),
    /// `at r0+3`: once r0 has streamed 3 tokens (r0 is sent streamed).
    At(String, usize),
}

/// One request of a request script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub name: String,
    pub prompt: RequestPrompt,
    pub when: RequestWhen,
    /// Tokens asked for (`max N`); `None`: the suite's `max_tokens`.
    pub max_tokens: Option<usize>,
}

impl Request {
    /// The earlier requests this one names.
    pub fn names(&self) -> Vec<&str> {
        let mut out = vec![self.name.as_str()];
        match &self.prompt {
            RequestPrompt::Extends { of, .. } | RequestPrompt::Back { of, .. } => out.push(of),
            RequestPrompt::Prompt(_) => {}
        }
        match &self.when {
            RequestWhen::After(of) | RequestWhen::At(of, _) => out.push(of),
            RequestWhen::Now => {}
        }
        out
    }
}

/// Requests sent to one fresh server, each when its condition holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestScript {
    pub requests: Vec<Request>,
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} = ", self.name)?;
        match &self.prompt {
            RequestPrompt::Prompt(p) => write!(f, "{p}")?,
            RequestPrompt::Extends { of, then: None } => write!(f, "{of} + answer")?,
            RequestPrompt::Extends { of, then: Some(p) } => write!(f, "{of} + answer + {p}")?,
            RequestPrompt::Back { of, cut } => write!(f, "{of}[:{cut}]")?,
        }
        match &self.when {
            RequestWhen::Now => {}
            RequestWhen::After(of) => write!(f, " after {of}")?,
            RequestWhen::At(of, t) => write!(f, " at {of}+{t}")?,
        }
        if let Some(n) = self.max_tokens {
            write!(f, " max {n}")?;
        }
        Ok(())
    }
}

impl fmt::Display for RequestScript {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let requests: Vec<String> = self.requests.iter().map(ToString::to_string).collect();
        f.write_str(&requests.join("; "))
    }
}

impl std::str::FromStr for RequestScript {
    type Err = String;

    /// Requests separated by `;` or newlines; `#` starts a comment. A request may only name
    /// requests before it.
    fn from_str(text: &str) -> Result<RequestScript, String> {
        let mut requests: Vec<Request> = Vec::new();
        let parts = text.lines().flat_map(|l| l.split('#').next().unwrap_or_default().split(';'));
        for (i, part) in parts.map(str::trim).filter(|p| !p.is_empty()).enumerate() {
            let mut r = parse_request(part).map_err(|e| format!("request {} `{part}`: {e}", i + 1))?;
            // `r0[:12]` cuts an earlier request's prompt back: request names come before the
            // suite's prompt names.
            if let RequestPrompt::Prompt(PromptCut { prompt, cut: Some(cut) }) = &r.prompt
                && requests.iter().any(|q| &q.name == prompt)
            {
                r.prompt = RequestPrompt::Back { of: prompt.clone(), cut: *cut };
            }
            if requests.iter().any(|q| q.name == r.name) {
                return Err(format!("request {} `{part}`: `{}` is defined twice", i + 1, r.name));
            }
            if let Some(unknown) = r.names().into_iter().skip(1).find(|n| !requests.iter().any(|q| q.name == *n)) {
                return Err(format!("request {} `{part}`: `{unknown}` is not an earlier request", i + 1));
            }
            requests.push(r);
        }
        if requests.is_empty() {
            return Err("no requests".into());
        }
        Ok(RequestScript { requests })
    }
}

fn parse_request(s: &str) -> Result<Request, String> {
    let (name, rhs) = s.split_once('=').ok_or("a request is `r0 = PROMPT [after rN | at rN+T] [max N]`")?;
    let name = self::name(name.trim())?;
    let mut rest = rhs.trim();
    let mut max_tokens = None;
    if let Some((before, n)) = rest.rsplit_once(" max ") {
        max_tokens = Some(positive(n.trim(), "max")?);
        rest = before.trim();
    }
    let mut when = RequestWhen::Now;
    if let Some((before, of)) = rest.rsplit_once(" after ") {
        when = RequestWhen::After(self::name(of.trim())?);
        rest = before.trim();
    } else if let Some((before, at)) = rest.rsplit_once(" at ") {
        let (of, t) = at.trim().split_once('+').ok_or("`at` is `at rN+TOKENS`")?;
        when = RequestWhen::At(self::name(of.trim())?, positive(t.trim(), "tokens")?);
        rest = before.trim();
    }
    let prompt = if let Some((of, more)) = rest.split_once('+') {
        let more = more.trim();
        let then = match more.strip_prefix("answer") {
            Some("") => None,
            Some(tail) => Some(prompt_cut(
                tail.trim().strip_prefix('+').ok_or("after `answer` only `+ PROMPT` may follow")?.trim(),
            )?),
            None => return Err("an extension is `rN + answer [+ PROMPT]`".into()),
        };
        RequestPrompt::Extends { of: self::name(of.trim())?, then }
    } else {
        RequestPrompt::Prompt(prompt_cut(rest)?)
    };
    Ok(Request { name, prompt, when, max_tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_prints_as_it_parses() {
        let text = "a = trim37[:17] m2; b = japan; prefill a 9; prefill a,b 4; step a,b; trim a 3; \
                    c = a@12 + japan[:2]; release a";
        let script: Script = text.parse().expect("parses");
        assert_eq!(script.ops.len(), 8);
        assert_eq!(script.to_string(), text);
        assert_eq!(script.to_string().parse::<Script>().expect("round trip"), script);
    }

    #[test]
    fn newlines_and_comments_separate_like_semicolons() {
        let s: Script = "a = p  # the donor\nprefill a 5\n\nstep a".parse().expect("parses");
        assert_eq!(s.to_string(), "a = p; prefill a 5; step a");
    }

    #[test]
    fn a_request_script_prints_as_it_parses() {
        let text = "r0 = trim37[:20]; r1 = japan at r0+3; r2 = r0 + answer after r0; \
                    r3 = r0 + answer + japan[:2] after r1; r4 = r0[:12] after r2 max 4";
        let script: RequestScript = text.parse().expect("parses");
        assert_eq!(script.requests.len(), 5);
        assert_eq!(script.requests[4].prompt, RequestPrompt::Back { of: "r0".into(), cut: 12 });
        assert_eq!(script.to_string(), text);
        for (bad, says) in [
            ("r0 = p; r0 = q", "defined twice"),
            ("r0 = p after r1", "not an earlier request"),
            ("r0 = p; r1 = r0 + p", "rN + answer"),
            ("r0 = p; r1 = q at r0", "at rN+TOKENS"),
            ("r0 = p max 0", "max: must be positive"),
        ] {
            let e = bad.parse::<RequestScript>().expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn mistakes_name_the_operation() {
        for (bad, says) in [
            ("a = p; prefill a 0", "operation 2 `prefill a 0`: rows: must be positive"),
            ("a = p; step a,a", "`a` is named twice"),
            ("A = p", "not a sequence name"),
            ("a = p x", "only `mN`"),
            ("c = a@3", "a share is"),
            ("a = p[:4", "a cut is"),
            ("jump a", "expected"),
            ("", "no operations"),
            ("trim a 99999999999", "larger than the limit"),
        ] {
            let e = bad.parse::<Script>().expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
