//! `docs/configuration.md` is the registry's Markdown, byte for byte.

#[test]
fn configuration_doc_is_current() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/configuration.md");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == pagoda_config::markdown(),
        "{} is stale: run `cargo run -q -- config --markdown > docs/configuration.md`",
        path.display()
    );
}
