//! The library's folders import only the folders below them
//! (docs/architecture.md, "The library's folders"): a `use crate::…` of a
//! higher folder anywhere in a lower one fails here, naming the file, the
//! line and the rule.

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
                ["lib.rs", "error.rs"].contains(&first),
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
            if name != first && name != "error" && !allowed.contains(&name.as_str()) {
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
