//! The crate's import graph has no cycles: a lower module never imports a higher one.
//!
//! A test, not a build step: it reads every `daemon/src/**/*.rs` (but `bin/`), collects the
//! crate paths each file uses (`use` trees and paths in code: `crate::…`, `super::…`,
//! `self::…`, and a module's own children by name), resolves each to the module file that
//! defines the item, and fails on any cycle of that graph, naming its files and the paths that
//! make each edge. Steps, in this order: [`modules`] finds the files, [`code_of`] keeps the code
//! a normal build compiles (no comments, no string contents, no `#[cfg(test)]` items: a test
//! may reach up for fixtures), [`references`] and [`reexports`] collect the paths, [`resolve`]
//! follows re-exports (`pub use`) to where an item lives, so a façade `mod.rs` hides no cycle,
//! and [`cycles`] finds the strongly connected components.
//!
//! One rule for directories: a module's `mod.rs` may use its own children freely (it declares
//! them, re-exports them, and often drives them), so an edge from a module to one of its
//! descendants is not counted. The other way is: a child that uses its parent's items sits
//! below them, and a parent item that uses the child back is a cycle like any other.
//!
//! There is no order of top-level layers in the test: counted by top-level directory the code
//! does not follow one yet (`config` takes a setting's type from `images::address`, `state`
//! keeps `pci::bind`'s records, `validate` asks `qemu::boot_files`, `qemu` runs through
//! `sandbox::spawn` whose server serves `qemu` again, `rpc` and `console` use each other), so
//! cycles between module files alone are checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module, as its path from the crate root (`["sandbox", "spawn", "client"]`; the root is
/// empty).
type Module = Vec<String>;

/// Cycles that exist today and are being removed, each as its set of modules. A cycle found
/// that is not exactly one of these fails the test; so does an entry here that is no longer
/// found, so that the list is emptied as the code is fixed rather than left to tolerate a
/// cycle coming back.
/// Empty since issue 28 removed the last one (lifecycle launch, teardown and undo).
const ALLOWED: &[&[&str]] = &[];

/// Every module file of the library: its module path and its file. `bin/` holds the binaries,
/// which are crates of their own.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(src).unwrap().to_path_buf();
            if path.is_dir() {
                if rel != Path::new("bin") {
                    dirs.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let mut module: Module = rel.with_extension("").iter().map(|c| c.to_string_lossy().into_owned()).collect();
            if module.last().is_some_and(|l| l == "mod") || module == ["lib"] {
                module.pop();
            }
            out.insert(module, path);
        }
    }
    out
}

/// The code of `text` a normal build compiles, with its structure kept: comments become
/// spaces, string and char literals become empty (their quotes stay), and every item marked
/// `#[cfg(test)]` (attribute through the end of its block or `;`) is dropped.
fn code_of(text: &str) -> String {
    let code = strip_comments_and_literals(text);
    drop_test_items(&code)
}

fn strip_comments_and_literals(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
            continue;
        }
        // Raw strings: r"…", r#"…"#, br"…".
        if b[i] == b'r' && (i == 0 || !ident(b[i - 1]) || (b[i - 1] == b'b' && (i < 2 || !ident(b[i - 2])))) {
            let mut j = i + 1;
            while j < b.len() && b[j] == b'#' {
                j += 1;
            }
            if j < b.len() && b[j] == b'"' {
                let hashes = j - i - 1;
                let mut k = j + 1;
                loop {
                    if k >= b.len() {
                        break;
                    }
                    if b[k] == b'"' && b[k + 1..].iter().take(hashes).filter(|c| **c == b'#').count() == hashes {
                        k += 1 + hashes;
                        break;
                    }
                    k += 1;
                }
                out.push_str("\"\"");
                i = k;
                continue;
            }
        }
        if b[i] == b'"' {
            let mut k = i + 1;
            while k < b.len() && b[k] != b'"' {
                if b[k] == b'\\' {
                    k += 1;
                }
                k += 1;
            }
            out.push_str("\"\"");
            i = k + 1;
            continue;
        }
        if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{1F600}'), not a lifetime ('a).
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..].iter().position(|c| *c == b'\'').map(|p| i + 2 + p)
            } else {
                let ch = text[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + ch) == Some(&b'\'')).then_some(i + 1 + ch)
            };
            if let Some(end) = end {
                out.push_str("' '");
                i = end + 1;
                continue;
            }
        }
        let ch = text[i..].chars().next().unwrap();
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

fn drop_test_items(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        out.push_str(&rest[..at]);
        let after = &rest[at + MARK.len()..];
        // The item ends at its first `;` outside braces, or with the block it opens.
        let mut depth = 0usize;
        let mut end = after.len();
        for (k, c) in after.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// One path a file uses: its segments (absolute when `crate::`, else as written, with its
/// first segment `super`, `self` or a child's name) and the text it was found as.
#[derive(Debug, Clone)]
struct Use {
    segments: Vec<String>,
    /// The name it is known by in the file (`as` alias, or its last segment): for re-exports.
    name: String,
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Parses a path or `use` tree at `code[i..]` whose first segments are `prefix`, pushing each
/// leaf; returns where it ended.
fn parse_tree(code: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Use>) -> usize {
    let skip_ws = |i: &mut usize| {
        while *i < code.len() && code[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    let mut segs = prefix;
    loop {
        skip_ws(&mut i);
        if i < code.len() && code[i] == b'{' {
            i += 1;
            loop {
                skip_ws(&mut i);
                if i >= code.len() {
                    return i;
                }
                if code[i] == b'}' {
                    return i + 1;
                }
                i = parse_tree(code, i, segs.clone(), out);
                skip_ws(&mut i);
                if i < code.len() && code[i] == b',' {
                    i += 1;
                }
            }
        }
        let start = i;
        while i < code.len() && (is_ident_byte(code[i]) || code[i] == b'*') {
            i += 1;
        }
        if start == i {
            if let Some(last) = segs.last().cloned() {
                out.push(Use { segments: segs, name: last });
            }
            return i;
        }
        segs.push(String::from_utf8_lossy(&code[start..i]).into_owned());
        if code[i..].starts_with(b"::") && !code[i + 2..].starts_with(b"<") {
            i += 2;
            continue;
        }
        let mut name = segs.last().cloned().unwrap_or_default();
        let mut j = i;
        skip_ws(&mut j);
        if code[j..].starts_with(b"as") && code.get(j + 2).is_some_and(|c| c.is_ascii_whitespace()) {
            j += 2;
            skip_ws(&mut j);
            let s = j;
            while j < code.len() && is_ident_byte(code[j]) {
                j += 1;
            }
            name = String::from_utf8_lossy(&code[s..j]).into_owned();
            i = j;
        }
        if name == "self" {
            segs.pop();
            name = segs.last().cloned().unwrap_or_default();
        }
        out.push(Use { segments: segs, name });
        return i;
    }
}

/// Every crate path in `code` (of module `me`, whose child modules are `children`).
fn references(code: &str, children: &BTreeSet<String>) -> Vec<Use> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let boundary = i == 0 || !(is_ident_byte(b[i - 1]) || b[i - 1] == b':' || b[i - 1] == b'$');
        if boundary && is_ident_byte(b[i]) {
            let s = i;
            while i < b.len() && is_ident_byte(b[i]) {
                i += 1;
            }
            let word = &code[s..i];
            if code[i..].starts_with("::") && (matches!(word, "crate" | "super" | "self") || children.contains(word)) {
                i = parse_tree(b, s, Vec::new(), &mut out);
            }
            continue;
        }
        i += 1;
    }
    out
}

/// The names module `code` re-exports (`pub use`, `pub(crate) use`, `pub(super) use`) and the
/// paths they stand for.
fn reexports(code: &str) -> Vec<Use> {
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("pub") {
        let at = from + at;
        from = at + 3;
        if at > 0 && is_ident_byte(b[at - 1]) {
            continue;
        }
        let mut j = at + 3;
        if code[j..].starts_with('(') {
            let Some(close) = code[j..].find(')') else { continue };
            j += close + 1;
        }
        let rest = code[j..].trim_start();
        if let Some(tree) = rest.strip_prefix("use ") {
            let start = code.len() - tree.len();
            parse_tree(b, start, Vec::new(), &mut out);
        }
    }
    out
}

/// What each module file says: what it uses, and what it re-exports.
struct Scan {
    files: BTreeMap<Module, PathBuf>,
    uses: BTreeMap<Module, Vec<Use>>,
    reexports: BTreeMap<Module, Vec<Use>>,
}

/// `segments` as written in module `me`, made absolute; `None` when it leaves the crate.
fn absolute(me: &Module, segments: &[String], files: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let mut base: Module = me.clone();
    let mut segs = segments;
    match segs.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            segs = &segs[1..];
        }
        Some("self") => segs = &segs[1..],
        Some("super") => {
            while segs.first().is_some_and(|s| s == "super") {
                base.pop();
                segs = &segs[1..];
            }
        }
        Some(first) => {
            let mut child = me.clone();
            child.push(first.to_string());
            if !files.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    base.extend(segs.iter().cloned());
    Some(base)
}

/// The module file where the item at absolute path `path` lives, following re-exports.
fn resolve(scan: &Scan, path: &[String], depth: usize) -> Module {
    let mut module: Module = Vec::new();
    for (k, seg) in path.iter().enumerate() {
        let mut child = module.clone();
        child.push(seg.clone());
        if scan.files.contains_key(&child) {
            module = child;
            continue;
        }
        if depth < 8 {
            let found = scan.reexports.get(&module).and_then(|r| r.iter().find(|u| u.name == *seg));
            if let Some(target) = found.and_then(|u| absolute(&module, &u.segments, &scan.files)) {
                let mut full = target;
                full.extend(path[k + 1..].iter().cloned());
                return resolve(scan, &full, depth + 1);
            }
        }
        break;
    }
    module
}

fn scan(src: &Path) -> Scan {
    let files = modules(src);
    let mut uses = BTreeMap::new();
    let mut exports = BTreeMap::new();
    for (module, path) in &files {
        let code = code_of(&std::fs::read_to_string(path).unwrap());
        let children: BTreeSet<String> = files
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(module))
            .filter_map(|m| m.last().cloned())
            .collect();
        uses.insert(module.clone(), references(&code, &children));
        exports.insert(module.clone(), reexports(&code));
    }
    Scan { files, uses, reexports: exports }
}

/// The graph: for each module, the modules it uses, each with one path that shows it.
fn graph(scan: &Scan) -> BTreeMap<Module, BTreeMap<Module, String>> {
    let mut edges: BTreeMap<Module, BTreeMap<Module, String>> = BTreeMap::new();
    for (module, uses) in &scan.uses {
        let out = edges.entry(module.clone()).or_default();
        for u in uses {
            let Some(path) = absolute(module, &u.segments, &scan.files) else { continue };
            let target = resolve(scan, &path, 0);
            // A module may use itself and its own descendants (module doc).
            if target.starts_with(module) {
                continue;
            }
            out.entry(target).or_insert_with(|| u.segments.join("::"));
        }
    }
    edges
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn cycles<V>(edges: &BTreeMap<Module, BTreeMap<Module, V>>) -> Vec<Vec<Module>> {
    struct State<'g, V> {
        edges: &'g BTreeMap<Module, BTreeMap<Module, V>>,
        index: BTreeMap<&'g Module, usize>,
        low: BTreeMap<&'g Module, usize>,
        stack: Vec<&'g Module>,
        on_stack: BTreeSet<&'g Module>,
        found: Vec<Vec<Module>>,
    }
    fn visit<'g, V>(s: &mut State<'g, V>, v: &'g Module) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.edges.get(v).into_iter().flat_map(|e| e.keys()) {
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.found.push(comp);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found.sort();
    s.found
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "lib".to_string()
    } else {
        m.join("::")
    }
}

/// One cycle through the component `comp`, as the lines a reader needs: each edge with the
/// path that makes it.
fn describe(comp: &[Module], edges: &BTreeMap<Module, BTreeMap<Module, String>>) -> String {
    let inside: BTreeSet<&Module> = comp.iter().collect();
    // Shortest way back to the first module (breadth first), within the component.
    let start = &comp[0];
    let mut prev: BTreeMap<&Module, &Module> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    let mut back = None;
    while let Some(v) = queue.pop_front() {
        for w in edges[v].keys().filter(|w| inside.contains(w)) {
            if w == start {
                back = Some(v);
                break;
            }
            if !prev.contains_key(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
        if back.is_some() {
            break;
        }
    }
    let mut path = vec![start];
    let mut v = back.unwrap_or(start);
    while v != start {
        path.push(v);
        v = prev[v];
    }
    path[1..].reverse();
    path.push(start);
    let mut text = format!("import cycle among {{{}}}:\n", comp.iter().map(name).collect::<Vec<_>>().join(", "));
    for pair in path.windows(2) {
        text += &format!("  {} uses {} ({})\n", name(pair[0]), name(pair[1]), edges[pair[0]][pair[1]]);
    }
    text
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let scan = scan(&src);
    let edges = graph(&scan);
    let found = cycles(&edges);
    let allowed: Vec<BTreeSet<String>> = ALLOWED.iter().map(|c| c.iter().map(|s| (*s).to_string()).collect()).collect();
    let mut failures = Vec::new();
    for comp in &found {
        let names: BTreeSet<String> = comp.iter().map(name).collect();
        if !allowed.contains(&names) {
            failures.push(describe(comp, &edges));
        }
    }
    for a in &allowed {
        if !found.iter().any(|c| c.iter().map(name).collect::<BTreeSet<_>>() == *a) {
            failures.push(format!(
                "allowed cycle {{{}}} is gone: remove it from ALLOWED in layers.rs\n",
                a.iter().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn the_scanner_sees_through_use_trees_reexports_comments_and_tests() {
    let code = code_of(
        "use crate::a::{b::{self, C}, d as e};\n\
         // crate::commented::Out\n\
         let s = \"crate::in_string\"; let c = '{';\n\
         fn f<'x>(v: &'x str) { crate::f::g(); super::h::I; child::J; Vec::<u8>::new(); }\n\
         #[cfg(test)]\nmod tests { use crate::only_tests; }\n",
    );
    let children = BTreeSet::from(["child".to_string()]);
    let found: Vec<String> = references(&code, &children).iter().map(|u| u.segments.join("::")).collect();
    assert_eq!(found, ["crate::a::b", "crate::a::b::C", "crate::a::d", "crate::f::g", "super::h::I", "child::J"]);
    let ex = reexports(&code_of("pub use x::Y;\npub(crate) use crate::z::{W as V};\nuse q::Private;"));
    let ex: Vec<(String, String)> = ex.iter().map(|u| (u.name.clone(), u.segments.join("::"))).collect();
    assert_eq!(ex, [("Y".to_string(), "x::Y".to_string()), ("V".to_string(), "crate::z::W".to_string())]);
}

#[test]
fn a_cycle_is_found_and_named() {
    let m = |s: &str| -> Module { s.split("::").map(str::to_string).collect() };
    let mut edges: BTreeMap<Module, BTreeMap<Module, String>> = BTreeMap::new();
    edges.entry(m("a")).or_default().insert(m("b"), "crate::b::X".into());
    edges.entry(m("b")).or_default().insert(m("c"), "crate::c::Y".into());
    edges.entry(m("c")).or_default().insert(m("a"), "crate::a::Z".into());
    edges.entry(m("c")).or_default().insert(m("d"), "crate::d::W".into());
    edges.entry(m("d")).or_default();
    let found = cycles(&edges);
    assert_eq!(found, [vec![m("a"), m("b"), m("c")]]);
    let text = describe(&found[0], &edges);
    assert!(text.contains("c uses a (crate::a::Z)"), "{text}");
}
