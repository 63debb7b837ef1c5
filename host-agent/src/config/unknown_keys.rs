//! Keys this version does not know. A key that a later version removed (or an earlier one
//! never had) must not stop an agent whose file was written for another version: such keys are
//! taken out of the text and named in a warning, and the rest is parsed as strictly as before
//! (types, ranges, every known key).
//!
//! The section structs stay `deny_unknown_fields`, so what counts as unknown is decided by the
//! same definitions that parse the file: the parser's error points at the key (its span), the
//! key's lines are blanked out (spaces, newlines kept, so that line numbers in any later
//! message are still those of the file), and the parse is tried again.

use std::ops::Range;

use serde::de::DeserializeOwned;
use toml_edit::{ImDocument, Item, Table};

/// More unknown keys than this is no file for this program: the error is reported.
const MAX_IGNORED: usize = 64;

/// Parses `text` as `T`, ignoring keys that `T` does not know; returns them as dotted paths
/// (`pcie.old_key`, `stream.guests[0].old_key`). Keys inside inline tables are not taken out:
/// they stay errors.
pub fn parse<T: DeserializeOwned>(text: &str) -> Result<(T, Vec<String>), toml::de::Error> {
    let mut text = text.to_owned();
    let mut ignored = Vec::new();
    loop {
        let err = match toml::from_str::<T>(&text) {
            Ok(v) => return Ok((v, ignored)),
            Err(e) => e,
        };
        let found = match err.span() {
            Some(span) if err.message().starts_with("unknown field") => locate(&text, span),
            _ => None,
        };
        match found {
            Some((path, ranges)) if ignored.len() < MAX_IGNORED => {
                for r in ranges {
                    blank(&mut text, r);
                }
                ignored.push(path);
            }
            _ => return Err(err),
        }
    }
}

/// Replaces `range` of `text` with spaces, keeping its newlines.
fn blank(text: &mut String, range: Range<usize>) {
    let kept: String = text[range.clone()]
        .chars()
        .map(|c| if c == '\n' { '\n' } else { ' ' })
        .collect();
    text.replace_range(range, &kept);
}

/// The dotted path of the key at `span` and the text ranges that hold it and its value.
fn locate(text: &str, span: Range<usize>) -> Option<(String, Vec<Range<usize>>)> {
    let doc = ImDocument::parse(text).ok()?;
    let mut headers = Vec::new();
    headers_of(doc.as_table(), &mut headers);
    headers.sort_unstable();
    find(doc.as_table(), &span, "", text, &headers)
}

/// Start offsets of every table header (`[a]`, `[[a]]`) under `t`.
fn headers_of(t: &Table, out: &mut Vec<usize>) {
    for (_, item) in t.iter() {
        let tables: Vec<&Table> = match item {
            Item::Table(t) => vec![t],
            Item::ArrayOfTables(a) => a.iter().collect(),
            _ => continue,
        };
        for t in tables {
            out.extend(t.span().map(|s| s.start));
            headers_of(t, out);
        }
    }
}

fn find(
    t: &Table,
    span: &Range<usize>,
    prefix: &str,
    text: &str,
    headers: &[usize],
) -> Option<(String, Vec<Range<usize>>)> {
    for (k, item) in t.iter() {
        let path = if prefix.is_empty() {
            k.to_owned()
        } else {
            format!("{prefix}.{k}")
        };
        let key = t.key(k).and_then(|k| k.span());
        if key.as_ref() == Some(span) {
            let ranges = match item {
                Item::Value(v) => {
                    std::iter::once(line_start(text, span.start)..v.span()?.end).collect()
                }
                Item::Table(t) => sections(t, text, headers),
                Item::ArrayOfTables(a) => {
                    a.iter().flat_map(|t| sections(t, text, headers)).collect()
                }
                Item::None => return None,
            };
            return Some((path, ranges));
        }
        let found = match item {
            Item::Table(t) => find(t, span, &path, text, headers),
            Item::ArrayOfTables(a) => a
                .iter()
                .enumerate()
                .find_map(|(i, t)| find(t, span, &format!("{path}[{i}]"), text, headers)),
            _ => None,
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// The text of a table and of every table below it: from each header line up to the next
/// header. A table without a header of its own (`[a.b]` alone makes `a`) has only its
/// sub-tables.
fn sections(t: &Table, text: &str, headers: &[usize]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    if let Some(start) = t.span().map(|s| s.start) {
        let end = headers
            .iter()
            .copied()
            .find(|&h| h > start)
            .map_or(text.len(), |h| line_start(text, h));
        out.push(line_start(text, start)..end);
    }
    for (_, item) in t.iter() {
        match item {
            Item::Table(t) => out.extend(sections(t, text, headers)),
            Item::ArrayOfTables(a) => a
                .iter()
                .for_each(|t| out.extend(sections(t, text, headers))),
            _ => {}
        }
    }
    out
}

/// Where the line holding `at` starts (a dotted key's earlier parts are on it too).
fn line_start(text: &str, at: usize) -> usize {
    text[..at].rfind('\n').map_or(0, |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, Default, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Root {
        a: u32,
        sec: Sec,
        list: Vec<Sec>,
    }

    #[derive(Debug, serde::Deserialize, Default, PartialEq)]
    #[serde(deny_unknown_fields, default)]
    struct Sec {
        b: u32,
    }

    #[test]
    fn unknown_keys_tables_and_arrays_are_taken_out() {
        let text = "a = 1\nold = [1,\n  2]\n[sec]\nb = 2\ngone = \"x\" # note\n\
                    [removed]\nx = 1\n[removed.deeper]\ny = 2\n[[list]]\nb = 3\n\
                    [[list]]\nb = 4\nold = true\n[[olds]]\nz = 1\n";
        let (r, ignored) = parse::<Root>(text).unwrap();
        assert_eq!(
            r,
            Root {
                a: 1,
                sec: Sec { b: 2 },
                list: vec![Sec { b: 3 }, Sec { b: 4 }],
            }
        );
        assert_eq!(
            ignored,
            ["old", "sec.gone", "removed", "list[1].old", "olds"]
        );
    }

    #[test]
    fn other_errors_keep_the_line_of_the_file() {
        let e = parse::<Root>("old = 1\n\n[sec]\nb = \"two\"\n").unwrap_err();
        assert!(e.to_string().contains("line 4"), "{e}");
        assert!(e.message().contains("expected u32"), "{e}");
        // Inside an inline table the key is not taken out.
        let e = parse::<Root>("sec = { b = 1, c = 2 }\n").unwrap_err();
        assert!(e.message().contains("unknown field `c`"), "{e}");
    }
}
