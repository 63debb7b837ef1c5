//! Every crate's modules import one way (the guest agent, the host agent, the shared library,
//! the lab: each directory of the workspace with a `src/`): no module imports one that imports
//! it back, directly or around a circle, at any depth (`cargo test -p gpufeed-guest --test
//! module_graph -- --nocapture` prints each crate's graph and fails on a circle, naming the
//! lines of each edge in it).
//!
//! A module is a file (`probes/unit.rs` is `probes::unit`, `probes/mod.rs` is `probes`). An
//! edge is a path in a module's non-test code (comments and `#[cfg(test)]` code left out: a
//! test may reach anywhere) that names another module or an item in it: `crate::a::b::…`,
//! `super::…`, `self::…`, and a child's name in its parent (`child::…`), each resolved to the
//! deepest module the path names. Declaring a child (`mod child;`) is not an edge; a parent
//! that re-exports or calls its child, and a child that takes anything from its parent, are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root: `["probes", "unit"]`.
type Module = Vec<String>;

fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut m: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if m.last().is_some_and(|l| l == "mod") {
        m.pop();
    }
    m
}

fn name(m: &[String]) -> String {
    m.join("::")
}

/// The code of a file without comments and without its test module (at its end), a line at
/// a time; a `use` over several lines is one line (where it starts).
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut open_use = false;
    for (i, line) in lines.iter().enumerate() {
        let code = line.trim_start();
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        let next = next
            .strip_prefix("pub(crate) ")
            .or_else(|| next.strip_prefix("pub "))
            .unwrap_or(next);
        if code.starts_with("#[cfg(test)]") && next.starts_with("mod ") && next.ends_with('{') {
            break;
        }
        if code.starts_with("//") {
            continue;
        }
        let code = code.split("//").next().unwrap();
        match out.last_mut() {
            Some((_, prev)) if open_use => prev.push_str(code),
            _ => out.push((i + 1, code.to_string())),
        }
        let last = &out.last().unwrap().1;
        open_use = last.contains("use ") && !last.contains(';');
    }
    out
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The paths after `at` in `code` (which starts a `crate::`, `super::` or `self::` path or a
/// child's name): the path itself and, for a `{…}` list at its end, one path per entry.
fn paths_at(code: &str) -> Vec<Vec<String>> {
    let mut segs = Vec::new();
    let mut rest = code;
    loop {
        let id = ident(rest);
        if id.is_empty() {
            break;
        }
        rest = &rest[id.len()..];
        segs.push(id);
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => return vec![segs],
        }
    }
    // `a::{b, c}` names what its entries name (`a::b`, `a::c`), not `a` itself
    let Some(list) = rest.strip_prefix('{') else {
        return vec![segs];
    };
    let mut out = Vec::new();
    for entry in list.split('}').next().unwrap().split(',') {
        let head = ident(entry.trim());
        if head.is_empty() {
            continue;
        }
        let mut p = segs.clone();
        if head != "self" {
            p.push(head);
        }
        if !p.is_empty() {
            out.push(p);
        }
    }
    out
}

/// (module, module it names, file, line) of every reference outside tests and comments.
fn references(src: &Path) -> Vec<(String, String, PathBuf, usize)> {
    let mut stack = vec![src.to_path_buf()];
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
    let modules: BTreeMap<Module, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    // Modules declared under #[cfg(test)] by their parent (`#[cfg(test)] mod scenarios;`).
    let mut test_modules = BTreeSet::new();
    for (m, f) in &modules {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for w in lines.windows(2) {
            if w[0].trim() == "#[cfg(test)]" {
                if let Some(child) = w[1]
                    .trim()
                    .strip_prefix("mod ")
                    .and_then(|r| r.strip_suffix(';'))
                {
                    let mut c = m.clone();
                    c.push(child.to_string());
                    test_modules.insert(c);
                }
            }
        }
    }
    let resolve = |path: &[String]| -> Option<Module> {
        (1..=path.len())
            .rev()
            .map(|k| path[..k].to_vec())
            .find(|p| modules.contains_key(p))
    };
    let mut out = Vec::new();
    for (m, f) in &modules {
        let root = m.first().is_some_and(|t| t == "lib" || t == "main");
        if root || (1..=m.len()).any(|k| test_modules.contains(&m[..k])) {
            continue;
        }
        let children: BTreeSet<String> = modules
            .keys()
            .filter(|c| c.len() == m.len() + 1 && c.starts_with(m))
            .map(|c| c[m.len()].clone())
            .collect();
        let text = std::fs::read_to_string(f).unwrap();
        for (line, code) in code_lines(&text) {
            let mut at = 0;
            while at < code.len() {
                let here = &code[at..];
                let prev = code[..at].chars().next_back();
                let boundary =
                    !prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
                let id = ident(here);
                if !boundary || id.is_empty() {
                    at += here.chars().next().map_or(1, char::len_utf8);
                    continue;
                }
                let after = &here[id.len()..];
                let base: Option<Module> = match id.as_str() {
                    "crate" => Some(Vec::new()),
                    "super" => Some(m[..m.len().saturating_sub(1)].to_vec()),
                    "self" => Some(m.clone()),
                    child if children.contains(child) => Some(m.clone()),
                    _ => None,
                };
                if let (Some(mut base), Some(rest)) = (base, after.strip_prefix("::")) {
                    let mut rest = rest;
                    if id != "crate" && id != "super" && id != "self" {
                        base.push(id.clone());
                    }
                    while let Some(r) = rest.strip_prefix("super::") {
                        base.pop();
                        rest = r;
                    }
                    for p in paths_at(rest) {
                        let mut full = base.clone();
                        full.extend(p);
                        if let Some(to) = resolve(&full) {
                            if &to != m {
                                out.push((name(m), name(&to), f.clone(), line));
                            }
                        }
                    }
                }
                at += id.len();
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

/// Every crate of the workspace: the directories beside this crate's with a `src/`.
fn crate_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path().join("src")))
        .filter(|src| src.is_dir() && src.parent().unwrap().join("Cargo.toml").is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let sources = crate_sources();
    let names: Vec<String> = sources
        .iter()
        .map(|s| {
            s.parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    for want in ["guest-agent", "host-agent", "shared"] {
        assert!(names.iter().any(|n| n == want), "{want} among {names:?}");
    }
    let mut why = String::new();
    for src in &sources {
        why.push_str(&circles_in(src));
    }
    assert!(why.is_empty(), "{why}");
}

/// How many `.rs` files a crate's `src/` holds.
fn rs_files(src: &Path) -> usize {
    let mut n = 0;
    let mut stack = vec![src.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                n += 1;
            }
        }
    }
    n
}

/// The circles of one crate's modules, with the lines of each edge in them ("" when none).
fn circles_in(src: &Path) -> String {
    eprintln!("{}:", src.display());
    let refs = references(src);
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
    // The reader's sanity: a crate of many modules has edges between them (a small one, the
    // test kit's leaf modules, may have none).
    let modules = rs_files(src);
    assert!(
        modules < 12 || edges.len() > 3,
        "the graph of {} ({modules} files) was read: {edges:?}",
        src.display()
    );
    let found = circles(&edges);
    let mut why = String::new();
    for c in &found {
        why.push_str(&format!("circle in {} {c:?}:\n", src.display()));
        for (a, b, f, l) in &refs {
            if c.contains(a) && c.contains(b) {
                why.push_str(&format!(
                    "  {a} -> {b}  {}:{l}\n",
                    f.strip_prefix(src).unwrap().display()
                ));
            }
        }
    }
    why
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
    // a parent and its children, by super::, a bare child path and a use list
    std::fs::create_dir(dir.path().join("z")).unwrap();
    std::fs::write(
        dir.path().join("z/mod.rs"),
        "pub mod a;\npub mod b;\npub use a::A;\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("z/a.rs"), "use super::b::B;\n").unwrap();
    std::fs::write(
        dir.path().join("z/b.rs"),
        "use super::{\n    a,\n    W,\n};\n",
    )
    .unwrap();
    let r: Vec<(String, String)> = references(dir.path())
        .into_iter()
        .map(|(a, b, _, _)| (a, b))
        .collect();
    let r: BTreeSet<(String, String)> = r.into_iter().collect();
    let want: BTreeSet<(String, String)> = [
        ("x", "y"),
        ("x", "z"),
        ("y", "x"),
        ("z", "z::a"),
        ("z::a", "z::b"),
        ("z::b", "z::a"),
        ("z::b", "z"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(r, want);
}
