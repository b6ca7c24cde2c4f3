//! Tests that keep the docs true to the tree (rust-analyzer's `tidy.rs` is the model): every
//! file ARCHITECTURE.md names exists, every crate says what it is for in a `//!` doc, and
//! every relative link of the top-level docs resolves. They run with xtask's tests, in
//! `cargo xtask test` and its `--quick` tier.

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::Path;
    use std::process::Command;

    use crate::root;

    /// The files git tracks, by path from the root.
    fn tracked() -> BTreeSet<String> {
        let output = Command::new("git")
            .current_dir(root())
            .args(["ls-files"])
            .output()
            .expect("git ls-files runs");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Whether `name` is a tracked file or folder, by its whole path or as the end of one
    /// (a doc names `client/send.rs` inside the crate it is describing).
    fn names_something(name: &str, files: &BTreeSet<String>) -> bool {
        let name = name.trim_end_matches('/');
        files.iter().any(|file| {
            file == name
                || file.ends_with(&format!("/{name}"))
                || file.starts_with(&format!("{name}/"))
                || file.contains(&format!("/{name}/"))
        })
    }

    /// The code spans of `text` that look like paths of the tree: a `/` or a file
    /// extension, no spaces, no `::` or `(`.
    fn path_spans(text: &str) -> Vec<String> {
        let mut spans = Vec::new();
        for (i, piece) in text.split('`').enumerate() {
            if i % 2 == 0 || piece.contains([' ', '(', '<', '*', '=', '$', '…']) {
                continue;
            }
            let path = piece.split("::").next().unwrap_or(piece);
            let looks_like_a_file = [".rs", ".md", ".sh", ".toml", ".py"]
                .iter()
                .any(|ext| path.ends_with(ext));
            let looks_like_a_folder = path.contains('/')
                && !path.starts_with('/')
                && !path.contains("://")
                && path
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c));
            if looks_like_a_file || looks_like_a_folder {
                spans.push(path.to_owned());
            }
        }
        spans
    }

    #[test]
    fn every_file_architecture_md_names_exists() {
        let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
        let files = tracked();
        let missing: Vec<String> = path_spans(&text)
            .into_iter()
            .filter(|path| !names_something(path, &files))
            .collect();
        assert!(
            missing.is_empty(),
            "ARCHITECTURE.md names what the tree does not hold: {missing:?}"
        );
    }

    #[test]
    fn every_crate_starts_with_a_doc_of_what_it_is_for() {
        let files = tracked();
        let roots: Vec<&String> = files
            .iter()
            .filter(|f| {
                (f.ends_with("src/lib.rs") || f.ends_with("src/main.rs"))
                    && files.contains(
                        &f.replace("src/lib.rs", "Cargo.toml")
                            .replace("src/main.rs", "Cargo.toml"),
                    )
            })
            .collect();
        assert!(roots.len() > 10, "found {} crate roots", roots.len());
        let undocumented: Vec<&String> = roots
            .into_iter()
            .filter(|f| {
                let text = std::fs::read_to_string(root().join(f)).unwrap_or_default();
                !text.trim_start().starts_with("//!")
            })
            .collect();
        assert!(
            undocumented.is_empty(),
            "crates without a `//!` doc first: {undocumented:?}"
        );
    }

    #[test]
    fn every_relative_link_of_the_top_level_docs_resolves() {
        let mut broken = Vec::new();
        for doc in ["README.md", "ARCHITECTURE.md", "BENCHMARKS.md"] {
            let Ok(text) = std::fs::read_to_string(root().join(doc)) else {
                continue;
            };
            for target in text.split("](").skip(1) {
                let Some(end) = target.find(')') else {
                    continue;
                };
                let link = &target[..end];
                if link.contains("://") || link.starts_with('#') || link.starts_with("mailto:") {
                    continue;
                }
                let file = link.split('#').next().unwrap_or(link);
                if !file.is_empty() && !Path::new(&root().join(file)).exists() {
                    broken.push(format!("{doc}: {link}"));
                }
            }
        }
        assert!(
            broken.is_empty(),
            "links that resolve to nothing: {broken:?}"
        );
    }
}
