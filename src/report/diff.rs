//! A compact inline diff of two decoded outputs, for the place where a path left its
//! reference: `The capital is [-Paris-]{+Lyon+}, France`.
//!
//! The result is one line (newlines and other control characters are shown escaped) so it
//! can sit in a table cell, a JUnit attribute or a log line without breaking the layout, and a
//! changed newline is visible rather than a blank line.

use similar::{DiffTag, TextDiff};

/// Equal runs longer than this are shortened around the changes: the outputs are short by
/// default, but a long `max_tokens` should not turn a one-word flip into a page of text.
const KEEP: usize = 40;

/// `reference` against `text`, word by word: deletions as `[-old-]`, insertions as
/// `{+new+}`. Equal strings come back unmarked.
pub fn text_diff(reference: &str, text: &str) -> String {
    let old = tokens(reference);
    let new = tokens(text);
    let diff = TextDiff::from_slices(&old, &new);
    let mut segments: Vec<Segment> = Vec::new();
    for op in diff.ops() {
        let (tag, o, n) = op.as_tag_tuple();
        let del: String = old[o].concat();
        let ins: String = new[n].concat();
        match tag {
            DiffTag::Equal => segments.push(Segment::Equal(del)),
            _ => push_change(&mut segments, del, ins),
        }
    }
    merge_across_spaces(&mut segments);
    render(&segments)
}

enum Segment {
    Equal(String),
    Change(String, String),
}

fn push_change(segments: &mut Vec<Segment>, del: String, ins: String) {
    // Myers may report a replacement as a delete op followed by an insert op.
    if let Some(Segment::Change(d, i)) = segments.last_mut() {
        d.push_str(&del);
        i.push_str(&ins);
    } else {
        segments.push(Segment::Change(del, ins));
    }
}

/// `[-a-]{+x+} [-b-]{+y+}` reads worse than `[-a b-]{+x y+}`: changes separated only by
/// whitespace are joined.
fn merge_across_spaces(segments: &mut Vec<Segment>) {
    let mut out: Vec<Segment> = Vec::with_capacity(segments.len());
    let mut iter = std::mem::take(segments).into_iter().peekable();
    while let Some(seg) = iter.next() {
        let joinable = matches!(&seg, Segment::Equal(s) if s.trim().is_empty())
            && matches!(out.last(), Some(Segment::Change(..)))
            && matches!(iter.peek(), Some(Segment::Change(..)));
        match (joinable, seg, out.last_mut()) {
            (true, Segment::Equal(space), Some(Segment::Change(d, i))) => {
                d.push_str(&space);
                i.push_str(&space);
                if let Some(Segment::Change(d2, i2)) = iter.next() {
                    d.push_str(&d2);
                    i.push_str(&i2);
                }
            }
            (_, seg, _) => out.push(seg),
        }
    }
    *segments = out;
}

fn render(segments: &[Segment]) -> String {
    let mut out = String::new();
    let last = segments.len().saturating_sub(1);
    for (k, seg) in segments.iter().enumerate() {
        match seg {
            Segment::Equal(s) => {
                let chars: Vec<char> = s.chars().collect();
                let (head, tail) = match (k == 0, k == last) {
                    _ if segments.len() == 1 => (usize::MAX, 0),
                    (true, _) => (0, KEEP),
                    (_, true) => (KEEP, 0),
                    _ => (KEEP / 2, KEEP / 2),
                };
                if chars.len() > head.saturating_add(tail) {
                    out.push_str(&escape(&chars[..head].iter().collect::<String>()));
                    out.push_str("...");
                    let from = chars.len() - tail;
                    out.push_str(&escape(&chars[from..].iter().collect::<String>()));
                } else {
                    out.push_str(&escape(s));
                }
            }
            Segment::Change(d, i) => {
                if !d.is_empty() {
                    out.push_str(&format!("[-{}-]", escape(d)));
                }
                if !i.is_empty() {
                    out.push_str(&format!("{{+{}+}}", escape(i)));
                }
            }
        }
    }
    out
}

/// Words, runs of whitespace, and single punctuation characters, so that `Paris,` against
/// `Lyon,` marks the word and not the comma.
fn tokens(s: &str) -> Vec<&str> {
    #[derive(PartialEq)]
    enum Class {
        Word,
        Space,
        Other,
    }
    let class = |c: char| {
        if c.is_alphanumeric() || c == '_' {
            Class::Word
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let mut out = Vec::new();
    let mut start = 0;
    let mut prev: Option<Class> = None;
    for (i, c) in s.char_indices() {
        let k = class(c);
        let split = match &prev {
            None => false,
            Some(p) => *p != k || k == Class::Other,
        };
        if split {
            out.push(&s[start..i]);
            start = i;
        }
        prev = Some(k);
    }
    if start < s.len() {
        out.push(&s[start..]);
    }
    out
}

/// Control characters shown as escapes; `\` doubled so an escape in the model's output is
/// not mistaken for one of ours.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}
