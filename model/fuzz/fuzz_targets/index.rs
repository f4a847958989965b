//! libFuzzer target: any bytes as `model.safetensors.index.json` next to the real
//! tiny-mxfp4 shards must give a catalog or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-mxfp4/sharded");
        let d = std::env::temp_dir().join(format!("k3-fuzz-index-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("temp dir");
        for e in std::fs::read_dir(&src).expect("fixture dir") {
            let p = e.expect("entry").path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                let _ = std::os::unix::fs::symlink(&p, d.join(p.file_name().expect("name")));
            }
        }
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let d = dir();
    std::fs::write(d.join("model.safetensors.index.json"), data).expect("write index");
    let _ = k3_model::catalog::Catalog::open(d);
});
