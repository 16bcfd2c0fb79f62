//! Escaping for the markup renderings: XML for JUnit, and the same escapes for HTML (valid
//! there too, and they keep control characters visible). A suite is untrusted input, so every
//! string taken from a report goes through here before it reaches markup.

use std::fmt::Write;

/// Element text: like [`xml`], but newlines and tabs stay literal so a failure body reads
/// as lines in the raw XML too.
pub fn xml_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for (k, part) in s.split('\n').enumerate() {
        if k > 0 {
            out.push('\n');
        }
        out.push_str(&xml(part).replace("&#9;", "\t"));
    }
    out
}

/// Escapes for attribute values (and, through [`xml_text`], text). Newlines and tabs become character references
/// so attribute normalisation keeps them; characters XML 1.0 cannot carry at all (most C0
/// controls, U+FFFE/U+FFFF) are written as `\u{..}` text rather than dropped, so a
/// tokenizer's stray control byte is still visible in the report.
pub fn xml(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' => out.push_str("&#10;"),
            '\r' => out.push_str("&#13;"),
            '\t' => out.push_str("&#9;"),
            '\u{0}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}' => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}
