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
