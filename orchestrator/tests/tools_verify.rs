//! `k3-orch verify`: a whole checkpoint passes; a truncated shard, a missing shard, an index
//! that disagrees with the headers and same-size corruption (with SHA256SUMS) are each
//! named and exit 1.

use std::path::Path;

use crate::tools_common::{copy_model, fixtures, k3, k3_ok, tiny_sharded};

fn copy_fixture(to: &Path) {
    copy_model(&tiny_sharded(), to);
}

fn shard(i: usize) -> String {
    format!("model-{i:05}-of-000014.safetensors")
}

#[test]
fn fixtures_pass() {
    let sharded = fixtures().join("tiny-mxfp4/sharded");
    let out = k3_ok(&["verify", sharded.to_str().unwrap()]);
    assert!(out.contains("shards : 14 of 14 present"), "{out}");
    assert!(out.contains("total_size 3629312 matches"), "{out}");
    assert!(out.contains("hashes : NOT CHECKED"), "{out}");
    assert!(out.contains("RESULT : OK"), "{out}");
    // The single-file layout too.
    let single = fixtures().join("tiny-mxfp4");
    let out = k3_ok(&["verify", single.to_str().unwrap()]);
    assert!(out.contains("single file"), "{out}");
}

/// A shard cut short by 100 bytes: named, with the missing byte count. (A verifier that
/// only summed sizes against total_size would name no shard.)
#[test]
fn truncated_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    let p = d.join(shard(5));
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let (code, out, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains(&format!("{}: truncated", shard(5))), "{err}");
    assert!(err.contains("(100 bytes missing)"), "{err}");
    assert!(out.contains("RESULT : FAIL"), "{out}");

    // Extra bytes after the data are named too.
    let q = d.join(shard(6));
    let mut b = std::fs::read(&q).unwrap();
    b.extend_from_slice(&[0u8; 8]);
    std::fs::write(&q, b).unwrap();
    let (_, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert!(err.contains("8 extra bytes after the last tensor"), "{err}");
}

#[test]
fn missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    std::fs::remove_file(d.join(shard(7))).unwrap();
    let (code, out, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains(&format!("missing shard: {}", shard(7))),
        "{err}"
    );
    assert!(out.contains("13 of 14 present"), "{out}");
}

/// A shard the index forgot entirely (its file gone too) is still found through the
/// `-of-N` numbering.
#[test]
fn shard_missing_from_index_and_disk_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    let ip = d.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();
    let last = shard(14);
    v["weight_map"]
        .as_object_mut()
        .unwrap()
        .retain(|_, f| f.as_str() != Some(last.as_str()));
    let size14 = 131840u64; // payload of shard 14 in the fixture (header says so)
    let ts = v["metadata"]["total_size"].as_u64().unwrap() - size14;
    v["metadata"]["total_size"] = ts.into();
    std::fs::write(&ip, serde_json::to_vec(&v).unwrap()).unwrap();
    std::fs::remove_file(d.join(&last)).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&format!(
        "missing shard: {last} (implied by the -of-N numbering"
    )));
}

/// The index disagrees with the headers: a wrong total_size; a tensor dropped from the
/// weight_map; a tensor mapped to the wrong shard.
#[test]
fn index_mismatch_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    let ip = d.join("model.safetensors.index.json");
    let orig: serde_json::Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();

    let mut v = orig.clone();
    v["metadata"]["total_size"] = (3629312u64 + 1).into();
    std::fs::write(&ip, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("total_size is 3629313 but the shards hold 3629312"),
        "{err}"
    );

    let name = "language_model.model.layers.2.self_attn.q_proj.weight";
    let mut v = orig.clone();
    v["weight_map"].as_object_mut().unwrap().remove(name);
    std::fs::write(&ip, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("missing from the index's weight_map"), "{err}");
    assert!(err.contains(name), "{err}");

    let mut v = orig.clone();
    v["weight_map"][name] = shard(4).into();
    std::fs::write(&ip, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!(
            "{name} is here but the index maps it to {}",
            shard(4)
        )),
        "{err}"
    );
}

/// Same-size corruption: invisible to sizes (verify says hashes were not checked), caught
/// and named once SHA256SUMS is present.
#[test]
fn corrupted_bytes_need_and_use_sha256sums() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    k3_ok(&["synth", "--shape", "tiny", "--sums", d.to_str().unwrap()]);
    let out = k3_ok(&["verify", d.to_str().unwrap()]);
    assert!(
        out.contains("hashes : 16 of 16 files in SHA256SUMS match"),
        "{out}"
    );

    let p = d.join(shard(3));
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n - 10] ^= 0x55;
    std::fs::write(&p, &b).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("{}: sha256 mismatch", shard(3))),
        "{err}"
    );

    std::fs::rename(d.join("SHA256SUMS"), tmp.path().join("sums")).unwrap();
    let out = k3_ok(&["verify", d.to_str().unwrap()]);
    assert!(out.contains("hashes : NOT CHECKED"), "{out}");
}

#[test]
fn usage_errors() {
    assert_eq!(k3(&["verify"]).0, 2);
    assert_eq!(k3(&["verify", "/nonexistent/k3/model"]).0, 2);
}

/// SHA256SUMS entries outside the model directory, or naming something that is not a
/// regular file, are refused (never hashed or counted as a match; /dev/zero never hangs).
/// Before: `../../../etc/hostname` was hashed and matched, `/dev/zero` hung verify.
#[test]
fn sums_entries_must_be_plain_files_inside_the_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    k3_ok(&["synth", "--shape", "tiny", "--sums", d.to_str().unwrap()]);
    let outside = tmp.path().join("outside");
    std::fs::write(&outside, b"x\n").unwrap();
    // sha256 of "x\n"
    let h = "1f3cd6e4d5b2c1ee6a3a1a2e3dcbd0e8f2d0c8ca0c8e8f0c9b1e1f5b8c7d9a0e";
    let mut sums = std::fs::read_to_string(d.join("SHA256SUMS")).unwrap();
    sums.push_str(&format!("{h}  ../outside\n{h}  /dev/zero\n"));
    std::fs::write(d.join("SHA256SUMS"), sums).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d.join("zero")).unwrap();
    let mut sums = std::fs::read_to_string(d.join("SHA256SUMS")).unwrap();
    sums.push_str(&format!("{h}  zero\n"));
    std::fs::write(d.join("SHA256SUMS"), sums).unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("names \"../outside\": only plain file names"),
        "{err}"
    );
    assert!(err.contains("names \"/dev/zero\""), "{err}");
    assert!(
        err.contains("zero: listed in SHA256SUMS but not a regular file"),
        "{err}"
    );
}

/// verify reads config.json: garbage there is a problem (exit 1). Before: passed.
#[test]
fn garbage_config_fails_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    std::fs::write(d.join("config.json"), b"{ not json").unwrap();
    let (code, _, err) = k3(&["verify", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("config.json"), "{err}");
}

/// The release table: a directory holding released shard names is checked against the
/// published sizes even without SHA256SUMS (header-only sparse copies of two shards, one
/// cut short). Before: only self-consistency was checked.
#[test]
fn released_shard_sizes_are_checked() {
    use k3_model::released::{shard_file_name, SHARD_SIZES};
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for (k, len) in [(95usize, SHARD_SIZES[94]), (96, SHARD_SIZES[95] - 100)] {
        let f = std::fs::File::create(d.join(shard_file_name(k))).unwrap();
        f.set_len(len).unwrap();
    }
    let r = k3_orch::tools::verify::verify_dir(d, false);
    let all = r.problems.join("\n");
    assert!(
        all.contains(&format!(
            "{}: {} bytes, the released shard is {} (100 bytes short)",
            shard_file_name(96),
            SHARD_SIZES[95] - 100,
            SHARD_SIZES[95]
        )),
        "{all}"
    );
    assert!(
        all.contains(&format!("{}: missing", shard_file_name(1))),
        "{all}"
    );
    assert!(
        !all.contains(&format!("{}: {}", shard_file_name(95), SHARD_SIZES[94])),
        "{all}"
    );
}

/// `verify --hashes` checks every shard against the hub's download metadata (etag = the
/// LFS file's sha256): a matching set passes, a changed byte is named, and no metadata at
/// all is a problem rather than a silent pass.
#[test]
fn hub_metadata_hashes_are_checked() {
    use sha2::{Digest, Sha256};
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    copy_fixture(&d);
    let (code, _, err) = k3(&["verify", "--hashes", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(".cache/huggingface/download does not exist"),
        "{err}"
    );
    let meta = d.join(".cache/huggingface/download");
    std::fs::create_dir_all(&meta).unwrap();
    for e in std::fs::read_dir(&d).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            let h: String = Sha256::digest(std::fs::read(d.join(&name)).unwrap())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            std::fs::write(
                meta.join(format!("{name}.metadata")),
                format!("{}\n{h}\n1712656091.123\n", "a".repeat(40)),
            )
            .unwrap();
        }
    }
    let out = k3_ok(&["verify", "--hashes", d.to_str().unwrap()]);
    assert!(out.contains("hub    : 14 of 14 shard(s) match"), "{out}");
    let p = d.join(shard(3));
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n - 1] ^= 1;
    std::fs::write(&p, b).unwrap();
    let (code, _, err) = k3(&["verify", "--hashes", d.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("{}: sha256 differs from the hub's etag", shard(3))),
        "{err}"
    );
}
