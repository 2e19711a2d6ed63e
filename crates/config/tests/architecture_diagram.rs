//! The crate diagram in `docs/architecture.md` ("The crates") shows exactly the pagoda
//! dependencies of every `crates/*/Cargo.toml`: `a --> b` for a `[dependencies]` entry,
//! `a -.-> b` for a `[dev-dependencies]` entry that is not also a dependency. A crate
//! dependency added or removed without the diagram fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// One edge of the graph: (crate, pagoda crate it depends on), both as short names (`ops`).
type Edge = (String, String);

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The short name of a pagoda crate (`pagoda-ops` -> `ops`), or `None` for other crates.
fn pagoda_short_name(dependency: &str) -> Option<&str> {
    dependency.strip_prefix("pagoda-")
}

/// The package's short name: `name = "pagoda-x"` gives `x`; the CLI's package is
/// `pagoda-cli` like the others, so the folder name would do, but the manifest decides.
fn package_short_name(manifest: &str, folder: &str) -> String {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package && line.starts_with("name") {
            let value = line
                .split('=')
                .nth(1)
                .unwrap_or("")
                .trim()
                .trim_matches('"');
            if let Some(short) = pagoda_short_name(value) {
                return short.to_string();
            }
        }
    }
    folder.to_string()
}

/// The pagoda dependencies of one manifest: (normal, dev-only), as short names.
fn manifest_dependencies(manifest: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut normal = BTreeSet::new();
    let mut dev = BTreeSet::new();
    let mut section = String::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.trim_matches(|c| c == '[' || c == ']').to_string();
            continue;
        }
        let key = line
            .split(|c: char| c == '=' || c == '.' || c.is_whitespace())
            .next()
            .unwrap_or("");
        let Some(short) = pagoda_short_name(key) else {
            continue;
        };
        if section.ends_with("dev-dependencies") {
            dev.insert(short.to_string());
        } else if section.ends_with("dependencies") {
            normal.insert(short.to_string());
        }
    }
    let dev_only = dev.difference(&normal).cloned().collect();
    (normal, dev_only)
}

/// Every crate under `crates/` with its pagoda dependencies: (crates, normal, dev-only).
fn cargo_graph() -> (BTreeSet<String>, BTreeSet<Edge>, BTreeSet<Edge>) {
    let mut crates = BTreeSet::new();
    let mut normal = BTreeSet::new();
    let mut dev_only = BTreeSet::new();
    let folders = std::fs::read_dir(workspace_root().join("crates")).expect("crates/");
    for entry in folders {
        let folder = entry.expect("crates/ entry").path();
        let Ok(manifest) = std::fs::read_to_string(folder.join("Cargo.toml")) else {
            continue;
        };
        let folder_name = folder.file_name().unwrap().to_string_lossy().into_owned();
        let name = package_short_name(&manifest, &folder_name);
        let (deps, dev) = manifest_dependencies(&manifest);
        normal.extend(deps.into_iter().map(|dep| (name.clone(), dep)));
        dev_only.extend(dev.into_iter().map(|dep| (name.clone(), dep)));
        crates.insert(name);
    }
    (crates, normal, dev_only)
}

/// The first Mermaid block after the "## The crates" heading: (nodes, solid, dotted edges).
fn diagram_graph(doc: &str) -> (BTreeSet<String>, BTreeSet<Edge>, BTreeSet<Edge>) {
    let section = doc
        .split("\n## The crates")
        .nth(1)
        .expect("docs/architecture.md has a \"## The crates\" section");
    let block = section
        .split("```mermaid")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the crates section has a ```mermaid block");
    let mut nodes = BTreeSet::new();
    let mut solid = BTreeSet::new();
    let mut dotted = BTreeSet::new();
    for line in block.lines().map(str::trim) {
        let (arrow, edges) = if line.contains("-.->") {
            ("-.->", &mut dotted)
        } else if line.contains("-->") {
            ("-->", &mut solid)
        } else {
            continue;
        };
        let (from, to) = line.split_once(arrow).unwrap();
        let (from, to) = (from.trim().to_string(), to.trim().to_string());
        nodes.insert(from.clone());
        nodes.insert(to.clone());
        edges.insert((from, to));
    }
    (nodes, solid, dotted)
}

fn listed(edges: &BTreeSet<Edge>, arrow: &str) -> String {
    edges
        .iter()
        .map(|(from, to)| format!("  {from} {arrow} {to}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn crate_diagram_matches_the_manifests() {
    let path = workspace_root().join("docs/architecture.md");
    let doc = std::fs::read_to_string(&path).expect("docs/architecture.md");
    let (crates, normal, dev_only) = cargo_graph();
    let (nodes, solid, dotted) = diagram_graph(&doc);
    assert!(normal.len() > 10, "read too few dependencies: {normal:?}");

    let mut problems = Vec::new();
    for (label, want, have, arrow) in [
        ("dependencies", &normal, &solid, "-->"),
        ("dev-dependencies", &dev_only, &dotted, "-.->"),
    ] {
        let missing: BTreeSet<Edge> = want.difference(have).cloned().collect();
        let stale: BTreeSet<Edge> = have.difference(want).cloned().collect();
        if !missing.is_empty() {
            problems.push(format!(
                "{label} missing from the diagram:\n{}",
                listed(&missing, arrow)
            ));
        }
        if !stale.is_empty() {
            problems.push(format!(
                "diagram edges that no Cargo.toml {label} has:\n{}",
                listed(&stale, arrow)
            ));
        }
    }
    let absent: Vec<&String> = crates.difference(&nodes).collect();
    if !absent.is_empty() {
        problems.push(format!("crates not in the diagram: {absent:?}"));
    }
    assert!(
        problems.is_empty(),
        "{} is stale (the Mermaid block under \"## The crates\"):\n{}",
        path.display(),
        problems.join("\n")
    );
}

#[test]
fn manifest_parsing_reads_sections() {
    let manifest = "[package]\nname = \"pagoda-x\"\n[dependencies]\npagoda-kv.workspace = true\n\
                    pagoda-ops = { path = \"../ops\" }\nserde.workspace = true\n\
                    [dev-dependencies]\npagoda-kv.workspace = true\npagoda-testkit.workspace = true\n";
    let (normal, dev_only) = manifest_dependencies(manifest);
    assert_eq!(
        normal,
        BTreeSet::from(["kv".to_string(), "ops".to_string()])
    );
    assert_eq!(dev_only, BTreeSet::from(["testkit".to_string()]));
    assert_eq!(package_short_name(manifest, "folder"), "x");
}
