//! The guest agent's top-level modules import one way: no module imports one that imports it
//! back, directly or around a circle (`cargo test -p gpufeed-guest --test module_graph`
//! prints the graph and fails on a circle, naming the lines of each edge in it).
//!
//! An edge is a `crate::<module>` path in a module's non-test code (comments and
//! `#[cfg(test)]` code left out: a test may reach anywhere). Submodules count as their
//! top-level module; a parent and its own submodules may use each other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// (top-level module, file, line) of every `crate::x` reference outside tests and comments.
fn references(src: &Path) -> Vec<(String, String, PathBuf, usize)> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    let mut test_files = BTreeSet::new();
    let mut files = Vec::new();
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    // Files declared under #[cfg(test)] by their parent (`#[cfg(test)] mod scenarios;`).
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for w in lines.windows(2) {
            if w[0].trim() == "#[cfg(test)]" {
                if let Some(name) = w[1]
                    .trim()
                    .strip_prefix("mod ")
                    .and_then(|r| r.strip_suffix(';'))
                {
                    let dir = if f.file_name().is_some_and(|n| n == "mod.rs") {
                        f.parent().unwrap().to_path_buf()
                    } else {
                        f.with_extension("")
                    };
                    test_files.insert(dir.join(format!("{name}.rs")));
                }
            }
        }
    }
    for f in files {
        let rel = f.strip_prefix(src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" || test_files.contains(&f) {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.trim_start();
            let next = lines.get(i + 1).map_or("", |l| l.trim());
            if code.starts_with("#[cfg(test)]") && next.starts_with("mod ") && next.ends_with('{') {
                break; // the file's test module, at its end
            }
            if code.starts_with("//") {
                continue;
            }
            let code = code.split("//").next().unwrap();
            for (at, _) in code.match_indices("crate::") {
                let name: String = code[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // `crate::{a, b}` lists: each name in the braces
                let names: Vec<String> = if name.is_empty() && code[at + 7..].starts_with('{') {
                    code[at + 8..]
                        .split('}')
                        .next()
                        .unwrap()
                        .split(',')
                        .map(|n| n.trim().split("::").next().unwrap().to_string())
                        .filter(|n| !n.is_empty())
                        .collect()
                } else {
                    vec![name]
                };
                for n in names {
                    if n != top && !n.is_empty() {
                        out.push((top.clone(), n, f.clone(), i + 1));
                    }
                }
            }
        }
    }
    out
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit(t: &mut T<'_>, v: &str) {
        t.index.insert(v.to_string(), t.next);
        t.low.insert(v.to_string(), t.next);
        t.next += 1;
        t.stack.push(v.to_string());
        let succ: Vec<String> = t.edges.get(v).into_iter().flatten().cloned().collect();
        for w in succ {
            if !t.index.contains_key(&w) {
                visit(t, &w);
                let lw = t.low[&w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.stack.contains(&w) {
                let iw = t.index[&w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            loop {
                let w = t.stack.pop().unwrap();
                let done = w == v;
                c.push(w);
                if done {
                    break;
                }
            }
            if c.len() > 1 {
                c.sort();
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    let nodes: BTreeSet<String> = edges
        .iter()
        .flat_map(|(a, bs)| std::iter::once(a.clone()).chain(bs.iter().cloned()))
        .collect();
    for n in nodes {
        if !t.index.contains_key(&n) {
            visit(&mut t, &n);
        }
    }
    t.out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let refs = references(&src);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b, _, _) in &refs {
        edges.entry(a.clone()).or_default().insert(b.clone());
    }
    for (a, bs) in &edges {
        eprintln!(
            "{a} -> {}",
            bs.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    assert!(edges.len() > 10, "the graph was read: {edges:?}");
    let found = circles(&edges);
    let mut why = String::new();
    for c in &found {
        why.push_str(&format!("circle {c:?}:\n"));
        for (a, b, f, l) in &refs {
            if c.contains(a) && c.contains(b) {
                why.push_str(&format!(
                    "  {a} -> {b}  {}:{l}\n",
                    f.strip_prefix(&src).unwrap().display()
                ));
            }
        }
    }
    assert!(found.is_empty(), "{why}");
}

/// The check itself finds a circle, and through a `crate::{a, b}` list.
#[test]
fn a_circle_is_found() {
    let mut e: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("e", "d")] {
        e.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(circles(&e), vec![vec!["a", "b", "c"]]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("x.rs"),
        "use crate::{y, z::W};\n// crate::q\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("y.rs"),
        "use crate::x;\n#[cfg(test)]\nmod tests {\n    use crate::z;\n}\n",
    )
    .unwrap();
    let r: Vec<(String, String)> = references(dir.path())
        .into_iter()
        .map(|(a, b, _, _)| (a, b))
        .collect();
    let r: BTreeSet<(String, String)> = r.into_iter().collect();
    let want: BTreeSet<(String, String)> = [("x", "y"), ("x", "z"), ("y", "x")]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(r, want);
}
