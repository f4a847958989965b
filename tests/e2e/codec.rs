//! A coded trunk (`pack-trunk --codec bf16-zstd`, issue 37) gives the same ids and the same
//! logits, bit for bit, as the raw trunk and as no trunk at all, whole layers pinned,
//! streamed through a ring or in parts; the report shows the stored bytes the disk
//! delivered against the decoded bytes the slots received.

use std::path::{Path, PathBuf};

use crate::common::*;

fn pack(model: &Path, trunk: &Path, codec: bool) {
    let mut a = vec![
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
    ];
    if codec {
        a.extend_from_slice(&["--codec", "bf16-zstd", "--verify"]);
    }
    let o = run(&a);
    assert!(o.status.success(), "{}", text(&o));
}

/// (generated ids, logits bytes, report) of a greedy run.
fn gen(
    model: &Path,
    ids: &str,
    n: usize,
    extra: &[&str],
    tmp: &Path,
    tag: &str,
) -> (Vec<u32>, Vec<u8>, serde_json::Value) {
    let out = tmp.join(format!("{tag}.json"));
    let logits = tmp.join(format!("{tag}.f32"));
    let n = n.to_string();
    let mut a = vec![
        model.to_str().unwrap(),
        "--ids",
        ids,
        "--gen",
        &n,
        "--quiet",
        "--out",
        out.to_str().unwrap(),
        "--dump-logits",
        logits.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let o = run(&a);
    assert!(o.status.success(), "{tag}: {}", text(&o));
    let r = json(&out);
    (
        u32s(&r["generated_ids"]),
        std::fs::read(&logits).unwrap(),
        r,
    )
}

/// Wrong implementations caught: a decoder that drops the sign or shifts the exponent, a
/// chunk decoded into the wrong place of its slot, a part read from the wrong chunk, padding
/// left unzeroed: any of them changes the ids or the logits' bits against the raw trunk.
fn same_with_and_without_codec(model: &Path, ids: &str, n: usize, budgets: &[&[&str]]) -> Vec<u32> {
    let tmp = tempfile::tempdir().unwrap();
    let (raw, coded) = (tmp.path().join("raw"), tmp.path().join("coded"));
    pack(model, &raw, false);
    pack(model, &coded, true);
    assert!(!coded.join("trunk.bin").exists());
    let (want, want_logits, _) = gen(model, ids, n, &[], tmp.path(), "resident");
    for (i, b) in budgets.iter().enumerate() {
        let mut planned = Vec::new();
        for (dir, tag) in [(&raw, "raw"), (&coded, "coded")] {
            let mut extra = vec!["--trunk", dir.to_str().unwrap()];
            extra.extend_from_slice(b);
            if tag == "coded" {
                // Decoding nearly free: the plan ranks by stored bytes, as the planned
                // reads below assume (with decoding weighed it may read more, decode less).
                extra.extend_from_slice(&["--drive-gbps", "1", "--decode-gbps", "1000"]);
            }
            let (got, logits, r) = gen(model, ids, n, &extra, tmp.path(), &format!("{tag}{i}"));
            assert_eq!(got, want, "{tag} trunk, budget {b:?}");
            assert!(
                logits == want_logits,
                "{tag} trunk, budget {b:?}: logits differ"
            );
            let c = &r["stage_summaries"]["trunk-loader"]["codec"];
            if tag == "coded" {
                let (s, d) = (
                    c["stored_bytes_read"].as_u64().unwrap(),
                    c["decoded_bytes"].as_u64().unwrap(),
                );
                assert!(s > 0 && s < d, "stored {s} of decoded {d}: {c}");
                let notes = r["notes"].to_string();
                assert!(
                    notes.contains("coded trunk:") && notes.contains("(--decode-gbps"),
                    "{notes}"
                );
            } else {
                assert!(c.is_null(), "{c}");
            }
            planned.push(r["plan"]["streamed_bytes_per_token"].as_u64().unwrap());
        }
        // The plan reads a coded trunk at its stored size (catches a plan that counts
        // the decoded bytes, as a raw trunk's).
        if planned[0] > 0 {
            assert!(
                planned[1] < planned[0],
                "budget {b:?}: planned reads {planned:?}"
            );
        }
    }
    want
}

/// The tiny-mxfp4 fixture (made by another tool), its oracle's greedy ids, at every kind of
/// trunk budget.
#[test]
fn tiny_mxfp4_same_ids_and_logits_coded() {
    let (prompt, greedy) = oracle("tiny-mxfp4/expected-k3ref.json");
    let model = fixtures().join("tiny-mxfp4/sharded");
    let n = 6.min(greedy.len());
    let got = same_with_and_without_codec(
        &model,
        &join(&prompt),
        n,
        &[
            &[],
            &["--trunk-gb", "0.004"],
            &["--trunk-gb", "0.00025", "--cache-gb", "0.00001"],
        ],
    );
    assert_eq!(got, greedy[..n]);
}

/// A synth model with Gaussian weights (whose exponents really compress) gives the same
/// ids and logits coded, and its trunk stores in well under raw.
#[test]
fn gaussian_synth_same_ids_and_logits_coded() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let o = run(&[
        "synth",
        "--shape",
        "tiny",
        "--weights",
        "gaussian",
        "--seed",
        "5",
        model.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("entropy: BF16 exponent"), "{}", text(&o));
    let want = same_with_and_without_codec(
        &model,
        "1,2,3,4",
        4,
        &[
            &[],
            &["--trunk-gb", "0.004"],
            &["--trunk-gb", "0.00025", "--cache-gb", "0.00001"],
        ],
    );
    let coded = tmp.path().join("c");
    pack(&model, &coded, true);
    // Without --drive-gbps/--decode-gbps the run measures the decoder on the trunk's own
    // chunks and plans with it (the plan's note says so); the ids do not move. Catches a
    // run that never weighs decoding by default.
    let extra = ["--trunk", coded.to_str().unwrap(), "--trunk-gb", "0.004"];
    let (got, _, r) = gen(&model, "1,2,3,4", 4, &extra, tmp.path(), "measured");
    assert_eq!(got, want);
    let notes = r["notes"].to_string();
    assert!(notes.contains("measured on the trunk's chunks"), "{notes}");
    let m = json(&coded.join("trunk.json"));
    let ratio = m["codec"]["stored_bytes"].as_f64().unwrap() / m["total_bytes"].as_f64().unwrap();
    assert!(ratio < 0.75, "stored {ratio} of raw");
}

/// tiny-mxfp4 run for two tokens with `extra` flags over its trunk packed coded, with one
/// bit flipped inside layer 4's first chunk (77 bytes in).
fn run_damaged(extra: &[&str]) -> std::process::Output {
    let tmp = tempfile::tempdir().unwrap();
    let (model, coded) = damaged_coded_trunk(tmp.path());
    let (model, coded) = (model.to_str().unwrap(), coded.to_str().unwrap());
    let mut args = vec![model, "--ids", "1,2,3", "--gen", "2", "--trunk", coded];
    args.extend_from_slice(extra);
    run(&args)
}

/// tiny-mxfp4 and its trunk packed coded under `dir`, with one bit flipped inside layer 4's
/// first chunk (77 bytes in): (model, coded trunk).
fn damaged_coded_trunk(dir: &Path) -> (PathBuf, PathBuf) {
    let model = fixtures().join("tiny-mxfp4/sharded");
    let coded = dir.join("coded");
    pack(&model, &coded, true);
    let m = json(&coded.join("trunk.json"));
    let l4 = &m["codec"]["layers"][4];
    let at = l4["offset"].as_u64().unwrap() + l4["chunks"][0]["offset"].as_u64().unwrap() + 77;
    let k3z = coded.join("trunk.k3z");
    let mut bytes = std::fs::read(&k3z).unwrap();
    bytes[at as usize] ^= 0x01;
    std::fs::write(&k3z, &bytes).unwrap();
    (model, coded)
}

/// A flipped byte in a coded trunk's chunk: the run exits 1 naming the layer and the chunk
/// (the stored CRC is checked before decoding), not with wrong ids. Catches a loader that
/// decodes without checking, or that reports the raw offset only.
#[test]
fn damaged_chunk_at_load_exits_1_naming_it() {
    let o = run_damaged(&[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("trunk layer 4 chunk 0"), "{}", text(&o));
}

/// Layers kept coded (`--trunk-resident coded`: every layer that fits stays compressed in
/// the trunk-loader's arena and is decoded into a ring slot on each use) give the ids and
/// the logits, bit for bit, of the resident run and of the raw trunk, whether every layer
/// is kept or some stream beside them; the kept runs are counted in the plan (its
/// `trunk N kept coded` line is the loader's kept bytes, and pinned + ring + kept fit the
/// trunk budget) and decoded from memory, not read. Catches a kept layer decoded wrongly
/// (from the wrong place of the arena) or skipped, kept bytes left out of the plan, and a
/// loader that plans other placements than the orchestrator.
#[test]
fn kept_coded_layers_same_ids_and_logits() {
    let (prompt, greedy) = oracle("tiny-mxfp4/expected-k3ref.json");
    let model = fixtures().join("tiny-mxfp4/sharded");
    let ids = join(&prompt);
    let n = 4.min(greedy.len());
    let tmp = tempfile::tempdir().unwrap();
    let coded = tmp.path().join("coded");
    pack(&model, &coded, true);
    let (want, want_logits, _) = gen(&model, &ids, n, &[], tmp.path(), "resident");
    assert_eq!(want, greedy[..n]);
    // 13 layers storing 2.0 MB: all kept at 4 MB; some kept, the rest streamed, at 1.5 MB.
    for (gb, all) in [("0.004", true), ("0.0015", false)] {
        let extra = [
            "--trunk",
            coded.to_str().unwrap(),
            "--trunk-gb",
            gb,
            "--cache-gb",
            "0.00001",
            "--trunk-resident",
            "coded",
            "--drive-gbps",
            "1",
            "--decode-gbps",
            "1000",
        ];
        let (got, logits, r) = gen(&model, &ids, n, &extra, tmp.path(), &format!("kept{gb}"));
        assert_eq!(got, want, "{gb} GB");
        assert!(logits == want_logits, "{gb} GB: logits differ");
        let t = &r["stage_summaries"]["trunk-loader"];
        let (c, p) = (&t["codec"], &t["plan"]);
        let kept = c["kept_layers"].as_u64().unwrap();
        assert!(kept > 0 && (kept == 13) == all, "{gb} GB: {c}");
        assert_eq!(p["pinned"].as_u64(), Some(0), "coded pins nothing raw: {p}");
        assert!(c["stored_bytes_kept"].as_u64().unwrap() > 0, "{c}");
        if all {
            assert_eq!(c["stored_bytes_read"].as_u64(), Some(0), "{c}");
        }
        let plan = &r["plan"];
        assert_eq!(plan["trunk_kept_layers"].as_u64(), Some(kept));
        let kept_bytes = c["kept_bytes"].as_u64().unwrap();
        assert_eq!(plan["trunk_kept_bytes"].as_u64(), Some(kept_bytes));
        let line = plan["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["what"] == format!("trunk {kept} kept coded"))
            .unwrap_or_else(|| panic!("no kept line: {plan}"));
        assert_eq!(line["bytes"].as_u64(), Some(kept_bytes));
        let used = p["pinned_bytes"].as_u64().unwrap()
            + p["ring_slots"].as_u64().unwrap() * p["slot_bytes"].as_u64().unwrap()
            + kept_bytes;
        assert!(used <= plan["trunk_budget_bytes"].as_u64().unwrap(), "{p}");
        let notes = r["notes"].to_string();
        assert!(
            notes.contains("trunk placement (--trunk-resident coded): 0 layer(s) pinned raw"),
            "{notes}"
        );
    }
}

/// A flipped byte in a chunk of a layer kept coded: the stored CRC is checked when the
/// chunk is decoded from memory, so the run exits 1 naming the layer and the chunk, as a
/// streamed one does. Catches a kept chunk decoded without its check (wrong ids, exit 0).
#[test]
fn damaged_kept_chunk_exits_1_naming_it() {
    let o = run_damaged(&["--trunk-gb", "0.004", "--trunk-resident", "coded"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("trunk layer 4 chunk 0"), "{}", text(&o));
}
