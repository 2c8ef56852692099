//! The library's folders import only the folders below them
//! (docs/architecture.md, "The library's folders"): a `use crate::…` of a
//! higher folder anywhere in a lower one fails here, naming the file, the
//! line and the rule. And no two files of the workspace import each other,
//! directly or around a circle.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each folder, lowest first, with the folders it may import.
const RULES: &[(&str, &[&str])] = &[
    ("util", &[]),
    ("model", &["util"]),
    ("data", &["util"]),
    ("kernels", &["util", "model"]),
    ("device", &["util", "model", "kernels"]),
    ("engine", &["util", "model", "kernels", "device"]),
    ("plan", &["util", "model", "kernels", "device"]),
    (
        "train",
        &[
            "util", "model", "data", "kernels", "device", "engine", "plan",
        ],
    ),
    (
        "tools",
        &[
            "util", "model", "data", "kernels", "device", "engine", "plan", "train",
        ],
    ),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The folders `text` names as `crate::FOLDER`, with their line numbers,
/// outside comments.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            found.push((n + 1, name));
        }
    }
    found
}

#[test]
fn folders_import_only_the_folders_below_them() {
    let rules: BTreeMap<&str, &[&str]> = RULES.iter().copied().collect();
    let mut broken = Vec::new();
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    for file in &files {
        let rel = file.strip_prefix(src()).unwrap();
        let mut parts = rel.iter();
        let first = parts.next().unwrap().to_str().unwrap();
        if parts.next().is_none() {
            // The root holds the crate's index alone.
            assert!(
                first == "lib.rs",
                "'{}' sits in the library's root: put it in a folder",
                rel.display()
            );
            continue;
        }
        let allowed = rules
            .get(first)
            .unwrap_or_else(|| panic!("folder '{first}' has no import rule in this test"));
        let text = std::fs::read_to_string(file).unwrap();
        for (line, name) in crate_paths(&text) {
            if name != first && !allowed.contains(&name.as_str()) {
                broken.push(format!(
                    "{}:{line}: `{first}` imports `crate::{name}` (it may import {allowed:?})",
                    rel.display()
                ));
            }
        }
    }
    assert!(
        files.len() > 40,
        "only {} source files found under {}",
        files.len(),
        src().display()
    );
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn the_rule_check_sees_an_import() {
    let found = crate_paths(
        "use crate::train::step; // crate::tools\nlet x = crate::util::rng::Rng::new(1);",
    );
    assert_eq!(found, [(1, "train".into()), (2, "util".into())]);
}

/// A source file of the workspace, with its crate's `src` and its module
/// path (`lib.rs`/`main.rs` are the root, `a/mod.rs` and `a.rs` are `a`).
struct SourceFile {
    path: PathBuf,
    krate: PathBuf,
    module: Vec<String>,
    /// `lib.rs`, `main.rs` or a `mod.rs`: a folder's index, whose `pub use`
    /// lines re-export its children rather than use them.
    index: bool,
    /// The code before the file's `#[cfg(test)] mod tests` (tests may
    /// reach anywhere).
    code: String,
}

fn workspace_files() -> Vec<SourceFile> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .unwrap()
        .map(|e| e.unwrap().path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for krate in dirs {
        let mut files = Vec::new();
        rust_files(&krate, &mut files);
        for path in files {
            let rel = path.strip_prefix(&krate).unwrap();
            let mut module: Vec<String> = rel
                .iter()
                .map(|s| s.to_str().unwrap().trim_end_matches(".rs").to_string())
                .collect();
            let last = module.pop().unwrap();
            let index = last == "mod" || (module.is_empty() && ["lib", "main"].contains(&&*last));
            if !index {
                module.push(last);
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap()
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect::<Vec<_>>()
                .join("\n");
            let code = inline_modules_flattened(&code);
            out.push(SourceFile {
                path,
                krate: krate.clone(),
                module,
                index,
                code,
            });
        }
    }
    out
}

/// `code` with `super::` read as the file's own module inside inline
/// `mod NAME { … }` blocks (whose parent is the file), so their imports
/// count as the file's.
fn inline_modules_flattened(code: &str) -> String {
    let (mut out, mut opened, mut depth) = (String::new(), Vec::new(), 0i64);
    for line in code.lines() {
        let t = line.trim();
        let opens = (t.starts_with("mod ") || t.starts_with("pub mod ")) && t.ends_with('{');
        match opened.is_empty() {
            true => out.push_str(line),
            false => out.push_str(&line.replace("super::", "self::")),
        }
        out.push('\n');
        if opens {
            opened.push(depth);
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        while opened.last().is_some_and(|&d| depth <= d) {
            opened.pop();
        }
    }
    out
}

/// Expands one `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand_use(tree: &str) -> Vec<String> {
    let tree: String = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    let Some(open) = tree.find('{') else {
        return vec![tree.split(" as ").next().unwrap().replace(' ', "")];
    };
    let prefix = tree[..open].replace(' ', "");
    let Some(close) = tree.rfind('}').filter(|&c| c > open) else {
        return Vec::new();
    };
    let inner = &tree[open + 1..close];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand_use)
        .map(|p| format!("{prefix}{p}"))
        .collect()
}

/// The paths a file's code names, each with whether a `pub use` names it:
/// every `use` (expanded) and every `crate::`, `super::` or `self::` path
/// elsewhere.
fn named_paths(code: &str) -> Vec<(String, bool)> {
    let mut found = Vec::new();
    let word = |c: char| c.is_alphanumeric() || c == '_';
    // `use` statements begin a line (rustfmt's layout) and end at `;`.
    let (mut offset, mut uses) = (0, Vec::new());
    for line in code.split_inclusive('\n') {
        let t = line.trim_start();
        let start = offset + (line.len() - t.len());
        offset += line.len();
        let public = t.starts_with("pub");
        let Some(at) = ["use ", "pub use ", "pub(crate) use ", "pub(super) use "]
            .iter()
            .find(|p| t.starts_with(**p))
            .map(|p| start + p.len())
        else {
            continue;
        };
        if let Some(end) = code[at..].find(';') {
            for p in expand_use(&code[at..at + end]) {
                found.push((p, public));
            }
            uses.push(start..at + end);
        }
    }
    // The other paths, outside the `use` statements.
    let mut rest = code.to_string();
    for r in uses {
        rest.replace_range(r.clone(), &" ".repeat(r.len()));
    }
    let code = rest.as_str();
    for key in ["crate::", "super::", "self::"] {
        let mut at = 0;
        while let Some(i) = code[at..].find(key) {
            let i = at + i;
            let path: String = code[i..]
                .chars()
                .take_while(|&c| word(c) || c == ':')
                .collect();
            at = i + path.len();
            // (`$crate::` in a macro names the crate where it expands.)
            if !code[..i]
                .chars()
                .last()
                .is_some_and(|c| word(c) || c == ':' || c == '$')
            {
                found.push((path, false));
            }
        }
    }
    found
}

/// The modules a file declares (`mod x;`), which its `use x::…` names.
fn declared_modules(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

/// The module a path named in `from` starts at, made absolute within its
/// crate; `None` for another crate's path.
fn absolute(from: &SourceFile, path: &str) -> Option<Vec<String>> {
    let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut abs = Vec::new();
    let mut rest = &segs[..];
    match segs.first().copied() {
        Some("crate") => rest = &segs[1..],
        Some("super" | "self") => {
            abs = from.module.clone();
            while let Some((&s, tail)) = rest.split_first() {
                match s {
                    "super" => {
                        abs.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                rest = tail;
            }
        }
        Some(first) if declared_modules(&from.code).iter().any(|m| m == first) => {
            abs = from.module.clone();
        }
        _ => return None,
    }
    abs.extend(rest.iter().map(|s| s.to_string()));
    Some(abs)
}

/// No two files of the workspace import each other, directly or through
/// others: a file's imports are the deepest file-modules its `use`s and
/// paths name; a folder's index re-exporting its children (`pub use` in
/// `mod.rs` or `lib.rs`) does not use them. Each circle found is named
/// with its files.
/// No library source file holds more than 900 lines before its tests: a
/// file that grows past it is split along what it does.
#[test]
fn no_library_file_passes_900_lines() {
    let files = workspace_files();
    let library: Vec<&SourceFile> = files
        .iter()
        .filter(|f| f.krate.ends_with("anetrain/src"))
        .collect();
    assert!(library.len() > 40, "{} library files", library.len());
    let long: Vec<String> = library
        .iter()
        .filter(|f| f.code.lines().count() > 900)
        .map(|f| format!("{}: {} lines", f.path.display(), f.code.lines().count()))
        .collect();
    assert!(long.is_empty(), "{}", long.join("\n"));
}

#[test]
fn no_import_circle_between_files() {
    let files = workspace_files();
    let key = |f: &SourceFile| (f.krate.clone(), f.module.clone());
    let at: BTreeMap<(PathBuf, Vec<String>), usize> =
        files.iter().enumerate().map(|(i, f)| (key(f), i)).collect();
    let mut edges = vec![std::collections::BTreeSet::new(); files.len()];
    for (i, f) in files.iter().enumerate() {
        for (path, public) in named_paths(&f.code) {
            if public && f.index {
                continue;
            }
            let Some(abs) = absolute(f, &path) else {
                continue;
            };
            let target = (0..=abs.len())
                .rev()
                .find_map(|n| at.get(&(f.krate.clone(), abs[..n].to_vec())));
            if let Some(&j) = target {
                if j != i {
                    edges[i].insert(j);
                }
            }
        }
    }
    let reach = |from: usize| {
        let mut seen = vec![false; files.len()];
        let mut todo = vec![from];
        while let Some(n) = todo.pop() {
            for &m in &edges[n] {
                if !seen[m] {
                    seen[m] = true;
                    todo.push(m);
                }
            }
        }
        seen
    };
    let reachable: Vec<Vec<bool>> = (0..files.len()).map(reach).collect();
    let mut circles = std::collections::BTreeSet::new();
    for (i, from_i) in reachable.iter().enumerate() {
        let members: Vec<String> = (0..files.len())
            .filter(|&j| from_i[j] && reachable[j][i])
            .map(|j| {
                files[j]
                    .path
                    .strip_prefix(files[j].krate.parent().unwrap().parent().unwrap())
                    .unwrap()
                    .display()
                    .to_string()
            })
            .collect();
        if members.len() > 1 {
            circles.insert(members.join(" ↔ "));
        }
    }
    assert!(files.len() > 100, "only {} files read", files.len());
    assert!(
        circles.is_empty(),
        "files that import each other (move what both need to one of them, or below both):\n{}",
        circles.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_circle_check_reads_use_trees_and_relative_paths() {
    assert_eq!(
        expand_use("crate::kernels::{self, maths::{a, b as c}, Shape}"),
        [
            "crate::kernels::self",
            "crate::kernels::maths::a",
            "crate::kernels::maths::b",
            "crate::kernels::Shape"
        ]
    );
    let f = SourceFile {
        path: PathBuf::from("a/b.rs"),
        krate: PathBuf::from("src"),
        module: vec!["a".into(), "b".into()],
        index: false,
        code: "mod c;\nuse super::d::X;\nlet y = crate::e::f();\nuse c::Z;\n".into(),
    };
    let named: Vec<Option<Vec<String>>> = named_paths(&f.code)
        .iter()
        .map(|(p, _)| absolute(&f, p))
        .collect();
    let v = |s: &[&str]| Some(s.iter().map(|x| x.to_string()).collect::<Vec<_>>());
    assert!(named.contains(&v(&["a", "d", "X"])), "{named:?}");
    assert!(named.contains(&v(&["a", "b", "c", "Z"])), "{named:?}");
    assert!(named.contains(&v(&["e", "f"])), "{named:?}");
}
