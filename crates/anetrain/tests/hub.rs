//! A Hugging Face Hub id (`ORG/NAME[@REVISION]`) resolves in the library,
//! without the command line: the snapshot the cache's `refs/REVISION`
//! names, laid out as Python's `huggingface_hub` lays it out, loads as the
//! same model as its directory. (One test in this binary: it sets the
//! process's `HF_HUB_CACHE` and `HF_HUB_OFFLINE`.)

use std::path::PathBuf;

use anetrain::model::hub::{resolve, HubId, Need};
use anetrain::model::Model;

#[test]
fn a_hub_id_loads_from_the_local_cache_without_the_command_line() {
    let source =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/fixtures/qwen3/model");
    let cache = tempfile::tempdir().unwrap();
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let repo = cache.path().join("models--acme--tiny-qwen");
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    for f in std::fs::read_dir(&source).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, snapshot.join(f.file_name().unwrap())).unwrap();
    }
    std::env::set_var("HF_HUB_CACHE", cache.path());
    std::env::set_var("HF_HUB_OFFLINE", "1");

    let dir = resolve("acme/tiny-qwen", Need::Model).unwrap();
    assert_eq!(PathBuf::from(&dir), snapshot);
    let (by_id, by_dir) = (
        Model::load(std::path::Path::new(&dir)).unwrap(),
        Model::load(&source).unwrap(),
    );
    assert_eq!(by_id.params.len(), by_dir.params.len());
    for (a, b) in by_id.params.iter().zip(&by_dir.params) {
        assert_eq!((&a.name, a.values()), (&b.name, b.values()));
    }
    // A revision is the commit itself, or a ref.
    assert_eq!(
        resolve(&format!("acme/tiny-qwen@{commit}"), Need::Config).unwrap(),
        dir
    );
    // Offline, a model the cache lacks is one line naming the id, the
    // cache entry and the way out.
    let e = resolve("acme/absent", Need::Model).unwrap_err().to_string();
    assert!(
        e.contains("'acme/absent'")
            && e.contains("models--acme--absent")
            && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    // A preset or a path is never taken for a Hub id.
    assert_eq!(resolve("tiny", Need::Model).unwrap(), "tiny");
    assert!(HubId::parse("./acme/tiny-qwen").is_none());
}
