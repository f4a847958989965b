//! One total budget through the real binary (issue 11): `--preset auto` and `--mem-gb` plan
//! over the packed trunk's page-rounded runs, pin every layer when memory allows, give the
//! same ids at every budget, refuse up front (exit 2) what does not fit, and the report
//! carries the run's true peak beside the plan.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::tools_common::{fixture, k3_cmd as k3, output_text as text, read_json as json};

fn prompt(model: &str) -> String {
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture(&format!("{model}/expected-k3ref.json"))).unwrap(),
    )
    .unwrap();
    v["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// `pack-trunk` of `model`'s fixture into `trunk`, with `extra` flags and `envs`.
fn pack_with(model: &str, trunk: &Path, extra: &[&str], envs: &[(&str, &str)]) {
    let o = k3()
        .arg("pack-trunk")
        .arg(fixture(&format!("{model}/sharded")))
        .arg(trunk)
        .args(extra)
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

fn gen(model: &str, trunk: &Path, out: &Path, extra: &[&str]) -> Output {
    gen_with(model, trunk, out, extra, &[])
}

/// [`gen`] with environment variables (the test hooks).
fn gen_with(
    model: &str,
    trunk: &Path,
    out: &Path,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> Output {
    k3().arg(fixture(&format!("{model}/sharded")))
        .args([
            "--ids",
            &prompt(model),
            "--gen",
            "4",
            "--incremental",
            "--trunk",
        ])
        .arg(trunk)
        .arg("--out")
        .arg(out)
        .args(extra)
        .envs(envs.iter().copied())
        .output()
        .unwrap()
}

/// Catches `auto` budgeting the census sum of tensor bytes instead of the packed runs (it
/// pinned 11 of 13 layers with gigabytes free), a `--mem-gb` that changes the ids, a plan
/// over its total that is not refused, and a report that sums per-process RSS.
#[test]
fn auto_and_mem_gb_pin_the_packed_trunk_and_keep_the_ids() {
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let dir = tempfile::tempdir().unwrap();
        let trunk = dir.path().join("trunk");
        let o = k3()
            .arg("pack-trunk")
            .arg(fixture(&format!("{model}/sharded")))
            .arg(&trunk)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let out = dir.path().join("r.json");
        let mut ids: Vec<(String, serde_json::Value)> = Vec::new();
        for extra in [
            &["--preset", "auto"][..],
            &["--mem-gb", "0.032"],
            &["--mem-gb", "0.032", "--trunk-gb", "0.00045"],
            &["--mem-gb", "0.032", "--cache-gb", "0"],
            &["--inproc", "--mem-gb", "0.032"],
        ] {
            let o = gen(model, &trunk, &out, extra);
            assert!(o.status.success(), "{model} {extra:?}: {}", text(&o));
            let r = json(&out);
            let t = text(&o);
            if extra[0] == "--preset" {
                let n = r["plan"]["items"][0]["what"].as_str().unwrap().to_string();
                let (p, l) = n
                    .trim_start_matches("trunk (")
                    .trim_end_matches(" pinned)")
                    .split_once('/')
                    .unwrap();
                assert_eq!(p, l, "{model}: --preset auto with memory to spare: {n}");
            }
            let peak = r["totals"]["peak_bytes"].as_u64().expect("a measured peak");
            assert!(peak > 0);
            assert!(t.contains("PEAK memory of the whole run"), "{t}");
            assert!(!t.contains("quote this"), "{t}");
            if extra.contains(&"--mem-gb") {
                let plan = r["plan"]["total_bytes"].as_u64().unwrap();
                assert!(
                    plan <= 32_000_000,
                    "{model} {extra:?}: plan {plan} over --mem-gb"
                );
            }
            ids.push((format!("{extra:?}"), r["generated_ids"].clone()));
        }
        for (w, v) in &ids[1..] {
            assert_eq!(v, &ids[0].1, "{model}: {w} vs {}", ids[0].0);
        }
        // Too small: refused up front with exit 2, naming what every run holds.
        let o = gen(model, &trunk, &out, &["--mem-gb", "0.001"]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("REFUSING TO START"), "{}", text(&o));
    }
}

/// The embedding read row by row and the lm_head streamed in chunks (the test hooks force
/// chunk sizes that do not divide the vocabulary, down to one row, and leading rows held
/// that are not a whole number of chunks) give the very logits of the held lm_head, bit
/// for bit, in both tiny models. Catches a chunk written to the wrong columns, a last
/// partial chunk dropped, a double-buffer that hands the multiply the chunk being read, an
/// embedding row read at the wrong offset, and streamed rows that restart at row 0 (or
/// skip a row) after the held ones.
#[test]
fn streamed_lm_head_and_embedding_rows_keep_the_logits() {
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let dir = tempfile::tempdir().unwrap();
        let trunk = dir.path().join("trunk");
        let o = k3()
            .arg("pack-trunk")
            .arg(fixture(&format!("{model}/sharded")))
            .arg(&trunk)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let out = dir.path().join("r.json");
        let mut first: Option<(Vec<u8>, serde_json::Value)> = None;
        for (chunk, held) in [
            (None, None),
            (Some("7000"), None),
            (Some("1"), None),
            (Some("100000000"), None),
            (Some("7000"), Some("10000")),
            (Some("7000"), Some("600")),
            (Some("1"), Some("10000")),
        ] {
            let logits = dir.path().join("logits.bin");
            let mut c = k3();
            c.arg(fixture(&format!("{model}/sharded")))
                .args(["--ids", &prompt(model), "--gen", "5", "--trunk"])
                .arg(&trunk)
                .arg("--dump-logits")
                .arg(&logits)
                .arg("--out")
                .arg(&out);
            if let Some(n) = chunk {
                c.env("K3_TEST_HOOKS", "1").env("K3_LM_HEAD_CHUNK_BYTES", n);
            }
            if let Some(n) = held {
                c.env("K3_LM_HEAD_HELD_BYTES", n);
            }
            let o = c.output().unwrap();
            let t = text(&o);
            assert!(
                o.status.success(),
                "{model} chunk {chunk:?} held {held:?}: {t}"
            );
            if chunk.is_some() {
                assert!(t.contains("lm_head (streamed)"), "{t}");
            }
            if held.is_some() {
                assert!(t.contains("of its leading rows held"), "{t}");
            }
            let r = json(&out);
            let got = (std::fs::read(&logits).unwrap(), r["generated_ids"].clone());
            match &first {
                None => first = Some(got),
                Some(f) => {
                    assert_eq!(got.1, f.1, "{model} chunk {chunk:?} held {held:?}: ids");
                    assert!(
                        got.0 == f.0,
                        "{model} chunk {chunk:?} held {held:?}: logits differ"
                    );
                }
            }
        }
    }
}

/// A coded trunk codes the lm_head too (`pack-trunk --codec`, here in 8-row chunks so the
/// tiny head has 32 of them), and a streamed lm_head read from it (`--lm-head-read coded`)
/// gives the oracle's ids and the very logits of the raw stream, at every chunk size and
/// held prefix: a stream chunk of one coded chunk, of three, bigger than the head; held
/// rows rounded down to whole coded chunks (600 bytes: none; 10000: 32 rows), the last
/// chunk short of 8 rows. Catches decoded chunks placed at the wrong rows, streamed rows
/// that restart at row 0 after the held ones or skip a chunk, and a short last chunk
/// decoded past its rows. Then damage: a stored byte flipped in chunk 5 of lm_head.k3z
/// fails the run (exit 1) naming the coded lm_head and the chunk, is read around with a good
/// copy of the trunk beside it (`--trunk DIR,COPY`; the drive rate the plan weighs decoding
/// against is then the copies' together), a truncated lm_head.k3z
/// and `--lm-head-read coded` over a trunk without one are refused up front (exit 2).
#[test]
fn a_coded_lm_head_streams_the_same_logits() {
    let model = "tiny-mxfp4";
    let dir = tempfile::tempdir().unwrap();
    let trunk = dir.path().join("trunk");
    let hooks = [("K3_TEST_HOOKS", "1"), ("K3_TEST_HEAD_CHUNK_BYTES", "2048")];
    pack_with(model, &trunk, &["--codec", "bf16-zstd"], &hooks);
    let m = k3_model::trunk::TrunkManifest::load_dir(&trunk).unwrap();
    let h = m
        .codec
        .as_ref()
        .unwrap()
        .head
        .clone()
        .expect("the lm_head is coded");
    assert_eq!((h.chunk_rows, h.chunks.len()), (8, 32));
    let out = dir.path().join("r.json");
    let want = oracle_ids(model, 4);
    let run_on = |trunk: &Path, read: &str, chunk: &str, held: Option<&str>, logits: &Path| {
        let lg = logits.to_str().unwrap().to_string();
        let mut env = vec![("K3_TEST_HOOKS", "1"), ("K3_LM_HEAD_CHUNK_BYTES", chunk)];
        if let Some(n) = held {
            env.push(("K3_LM_HEAD_HELD_BYTES", n));
        }
        let extra = ["--lm-head-read", read, "--dump-logits", lg.as_str()];
        gen_with(model, trunk, &out, &extra, &env)
    };
    let run = |read: &str, chunk: &str, held: Option<&str>, logits: &Path| {
        run_on(&trunk, read, chunk, held, logits)
    };
    let base = dir.path().join("raw.bin");
    let o = run("raw", "7000", None, &base);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("read coded"), "{}", text(&o));
    assert_eq!(
        generated_ids(&out),
        want,
        "raw stream: ids differ from the oracle"
    );
    let base = std::fs::read(&base).unwrap();
    for (chunk, held) in [
        ("7000", None),
        ("1", None),
        ("100000000", None),
        ("7000", Some("10000")),
        ("7000", Some("600")),
    ] {
        let logits = dir.path().join("coded.bin");
        let o = run("coded", chunk, held, &logits);
        let t = text(&o);
        assert!(o.status.success(), "chunk {chunk} held {held:?}: {t}");
        assert!(t.contains("read coded"), "{t}");
        assert_eq!(
            generated_ids(&out),
            want,
            "chunk {chunk} held {held:?}: ids"
        );
        assert!(
            std::fs::read(&logits).unwrap() == base,
            "chunk {chunk} held {held:?}: logits differ from the raw stream"
        );
    }
    // A copy of the trunk, lm_head.k3z with it, for the damage below.
    let copy = dir.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for f in std::fs::read_dir(&trunk).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, copy.join(f.file_name().unwrap())).unwrap();
    }
    // A flipped stored byte in chunk 5.
    let k3z = trunk.join(&h.file);
    let mut bytes = std::fs::read(&k3z).unwrap();
    bytes[h.chunks[5].offset as usize + 3] ^= 0x10;
    std::fs::write(&k3z, &bytes).unwrap();
    let o = run("coded", "7000", None, &dir.path().join("x.bin"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("coded lm_head chunk 5: the stored bytes fail their CRC-32C"),
        "{}",
        text(&o)
    );
    // The damaged trunk with a good copy (`--trunk DAMAGED,COPY`): chunk 5's stream chunk
    // fails its check in the first copy and is read again from the second; the logits are
    // the raw stream's. Catches the coded lm_head read from the first copy alone (the run
    // fails as above) and a copy's lm_head.k3z looked for anywhere but in that copy.
    let both = PathBuf::from(format!("{},{}", trunk.display(), copy.display()));
    let logits = dir.path().join("copies.bin");
    let o = run_on(&both, "coded", "7000", None, &logits);
    let t = text(&o);
    assert!(
        o.status.success(),
        "a good copy beside the damaged one: {t}"
    );
    assert!(
        t.contains("reading them again from the other trunk copies"),
        "{t}"
    );
    // The plan weighs decoding against the copies' summed rate, not the first copy's.
    assert!(t.contains("its 2 copies read at once"), "{t}");
    assert_eq!(generated_ids(&out), want, "ids read around the damage");
    assert!(
        std::fs::read(&logits).unwrap() == base,
        "logits read around the damage differ from the raw stream"
    );
    // A truncated lm_head.k3z: refused before anything runs (exit 2), naming the file.
    let f = std::fs::OpenOptions::new().write(true).open(&k3z).unwrap();
    f.set_len(h.file_size - 4096).unwrap();
    let o = run("coded", "7000", None, &dir.path().join("y.bin"));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("lm_head.k3z is"), "{}", text(&o));
    // A raw trunk has no coded lm_head.
    let raw = dir.path().join("raw-trunk");
    pack(model, &raw);
    let o = gen(model, &raw, &out, &["--lm-head-read", "coded"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("holds no coded lm_head"), "{}", text(&o));
}

/// Prefill reads each expert once per pass: the prompt's 12 tokens route 12 x 12 MoE layers
/// x top-2 = 288 expert uses on tiny-mxfp4, but a layer has only 8 experts, so the union is
/// at most 96 loads, and with the smallest cache every load is a read. Catches a prefill
/// that fetches per token (288 requests, 2.95 MB) instead of the union of the routes.
#[test]
fn prefill_reads_the_union_of_the_routes() {
    let model = "tiny-mxfp4";
    let dir = tempfile::tempdir().unwrap();
    let trunk = dir.path().join("trunk");
    let o = k3()
        .arg("pack-trunk")
        .arg(fixture(&format!("{model}/sharded")))
        .arg(&trunk)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = dir.path().join("r.json");
    let o = gen(model, &trunk, &out, &["--cache-gb", "0"]);
    assert!(o.status.success(), "{}", text(&o));
    let r = json(&out);
    let prefill = &r["steps"][0];
    let req = prefill["expert_requests"].as_u64().unwrap();
    let bytes = prefill["expert_read_bytes"].as_u64().unwrap();
    let per_token = 12 * 12 * 2;
    assert!(req <= 96 && req > 24, "prefill requested {req} experts");
    assert!(req < per_token);
    // Each request is one expert's bytes (no cache to hit).
    let decode = &r["steps"][1];
    let per_expert = decode["expert_read_bytes"].as_u64().unwrap() as f64
        / decode["expert_requests"].as_u64().unwrap().max(1) as f64;
    assert!(
        (bytes as f64) < 0.5 * per_token as f64 * per_expert,
        "prefill read {bytes} bytes, token by token would read {}",
        per_token as f64 * per_expert
    );
}

fn pack(model: &str, trunk: &Path) {
    pack_with(model, trunk, &[], &[]);
}

/// The ids a run's report says it generated.
fn generated_ids(out: &Path) -> Vec<u64> {
    json(out)["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The first `n` ids the oracle (k3ref, tests/fixtures) generates after the prompt.
fn oracle_ids(model: &str, n: usize) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture(&format!("{model}/expected-k3ref.json"))).unwrap(),
    )
    .unwrap();
    let p = v["n_prompt"].as_u64().unwrap() as usize;
    v["full_ids"].as_array().unwrap()[p..p + n]
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// At the smallest budgets (a streaming trunk slot, no expert cache: every routed expert is
/// read, its request sent the moment the router chose it, before the shared experts are
/// computed; two arena slots, so the prompt pass's batches of up to 8 experts stream
/// through them, each slot reused once compute releases it) both tiny models give the
/// oracle's ids, in separate processes and in-process. Catches a reordering of the MoE
/// products that changes a value, an announced batch that is answered twice or not at
/// all, a slot reused before its expert was multiplied, and ids that depend on the budget.
#[test]
fn smallest_budgets_give_the_oracle_ids() {
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let dir = tempfile::tempdir().unwrap();
        let trunk = dir.path().join("trunk");
        pack(model, &trunk);
        let out = dir.path().join("r.json");
        let want = oracle_ids(model, 4);
        for extra in [
            &["--mem-gb", "0.032", "--cache-gb", "0"][..],
            &[
                "--mem-gb",
                "0.032",
                "--trunk-gb",
                "0.00045",
                "--cache-gb",
                "0",
            ],
            &["--inproc", "--trunk-gb", "0.00045", "--cache-gb", "0"],
        ] {
            let o = gen(model, &trunk, &out, extra);
            assert!(o.status.success(), "{model} {extra:?}: {}", text(&o));
            let got: Vec<u64> = generated_ids(&out);
            assert_eq!(got, want, "{model} {extra:?}: ids differ from the oracle");
        }
    }
}

/// A trunk packed in another format version (here the manifest says `k3-trunk/1`; the
/// `k3-trunk/2` of the last release reads the same way) is
/// refused up front, exit 2, with the command that repacks it, not a serde error about a
/// missing field and not a run over bytes laid out differently.
#[test]
fn an_old_version_trunk_is_refused_with_the_repack_command() {
    let model = "tiny-mxfp4";
    let dir = tempfile::tempdir().unwrap();
    let trunk = dir.path().join("trunk");
    pack(model, &trunk);
    let json_path = trunk.join("trunk.json");
    let mut m = json(&json_path);
    m["format"] = "k3-trunk/1".into();
    m.as_object_mut().unwrap().remove("source");
    std::fs::write(&json_path, m.to_string()).unwrap();
    let out = dir.path().join("r.json");
    let o = gen(model, &trunk, &out, &["--mem-gb", "0.032"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("k3-trunk/1"), "{t}");
    assert!(t.contains("re-run k3-orch pack-trunk --force"), "{t}");
    assert!(!out.exists(), "a refused run wrote a report");
}

/// A trunk budget below one slot for the largest layer but at least the largest part (the
/// tensors the forward uses together): the trunk streams in parts through one slot smaller
/// than a layer, and both tiny models still give the oracle's ids, staged and in-process.
/// Catches a part missing a tensor its phase binds, a forward that binds the next phase
/// before it gives the last back (it would wait forever on a one-slot ring), a tensor mapped
/// at the wrong offset inside its part, and a part whose pieces are not checked. With the
/// lm_head streamed too (test hook), a plan whose tokens start with a pinned part holds
/// each token's first streamed part until the token starts, and one that pins nothing does
/// not; both keep the ids. Catches a held read that never lets go (the run would hang until
/// the stage timeout) and a hold switched on where the token would wait for it at once.
#[test]
fn a_slot_smaller_than_a_layer_streams_parts_and_keeps_the_oracle_ids() {
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let dir = tempfile::tempdir().unwrap();
        let trunk = dir.path().join("trunk");
        pack(model, &trunk);
        let m = k3_model::trunk::TrunkManifest::load_dir(&trunk).unwrap();
        let (part, layer) = (m.max_part(), m.max_run);
        // Exactly one slot for the largest part (parts are whole pages): nothing is left to
        // pin, however small the smallest part.
        let budget = part;
        assert!(
            budget < layer,
            "{model}: the largest part {part} is not smaller than the largest layer {layer}"
        );
        let out = dir.path().join("r.json");
        let want = oracle_ids(model, 4);
        // The whole trunk but a page: only small parts stream, so layer 0's first
        // (attention) part is pinned and a token starts with pinned compute.
        let most = m.layers.iter().map(|l| l.padded_length).sum::<u64>() - 4096;
        // One slot for the largest part, nothing pinned (staged and in-process); then just
        // under a layer: some parts pinned, the rest through the ring.
        let hold = "first streamed part is read when the token starts";
        for (b, inproc, streamed_head) in [
            (budget, false, false),
            (budget, true, false),
            (layer - 4096, false, false),
            (budget, false, true),
            (most, false, true),
            (most, true, true),
        ] {
            let gb = format!("{:.9}", b as f64 / 1e9);
            let mut extra = vec!["--trunk-gb", gb.as_str(), "--cache-gb", "0"];
            if inproc {
                extra.insert(0, "--inproc");
            }
            let hooks: &[(&str, &str)] = if streamed_head {
                &[("K3_TEST_HOOKS", "1"), ("K3_LM_HEAD_CHUNK_BYTES", "7000")]
            } else {
                &[]
            };
            let o = gen_with(model, &trunk, &out, &extra, hooks);
            let t = text(&o);
            assert!(o.status.success(), "{model} {extra:?}: {t}");
            // Held only with a streamed lm_head and a token that starts with a pinned part.
            assert_eq!(
                t.contains(hold),
                streamed_head && b != budget,
                "{model} {extra:?} streamed lm_head {streamed_head}: {t}"
            );
            if b == budget {
                assert!(
                    t.contains("0/") && t.contains("layer parts pinned, ring 1 x"),
                    "{model}: {t}"
                );
            } else {
                assert!(t.contains("layer parts pinned"), "{model}: {t}");
            }
            let got: Vec<u64> = generated_ids(&out);
            assert_eq!(got, want, "{model} {extra:?}: ids differ from the oracle");
        }
        // Below the largest part: refused up front, naming the shortfall.
        let gb = format!("{:.9}", (part - 4096) as f64 / 1e9);
        let o = gen(model, &trunk, &out, &["--trunk-gb", gb.as_str()]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("largest part"), "{}", text(&o));
    }
}

/// A flipped byte inside a tensor is caught when the trunk streams in parts (each tensor
/// checked by its own CRCs, `k3-trunk/3`): the run fails naming the checksum, it never
/// computes on the bad byte. Catches parts read without their tensor checks.
#[test]
fn a_corrupt_tensor_is_caught_in_a_streamed_part() {
    let model = "tiny-mxfp4";
    let dir = tempfile::tempdir().unwrap();
    let trunk = dir.path().join("trunk");
    pack(model, &trunk);
    let m = k3_model::trunk::TrunkManifest::load_dir(&trunk).unwrap();
    let l = &m.layers[1];
    let t = l.tensors.iter().max_by_key(|t| t.len).unwrap();
    let at = (l.offset + t.offset + t.len / 2) as usize;
    let bin = trunk.join("trunk.bin");
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[at] ^= 0x40;
    std::fs::write(&bin, bytes).unwrap();
    let gb = format!("{:.9}", (m.max_part() + 4096) as f64 / 1e9);
    let out = dir.path().join("r.json");
    let o = gen(
        model,
        &trunk,
        &out,
        &["--trunk-gb", gb.as_str(), "--cache-gb", "0"],
    );
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("checksum mismatch"), "{t}");
}

/// A prompt whose experts do not fit beside the rest is fed in smaller passes instead of
/// being refused. On both tiny models, in separate processes: the smallest `--mem-gb` that
/// runs at all (found by stepping up from a refused total) feeds the prompt in passes and
/// gives the oracle's ids; the test hook's passes of 1 and 5 tokens give the very logits of
/// one pass (the first step's row, bit for bit) and the oracle's ids. Catches a plan that
/// still asks for the whole prompt's experts (the smallest run would be refused, or run in
/// one pass), logits taken from a pass other than the last, and session state that does
/// not carry across passes.
#[test]
fn a_prompt_whose_experts_do_not_fit_is_fed_in_passes() {
    for model in ["tiny-mxfp4", "tiny-seed"] {
        let dir = tempfile::tempdir().unwrap();
        let trunk = dir.path().join("trunk");
        pack(model, &trunk);
        let out = dir.path().join("r.json");
        let logits = dir.path().join("logits.bin");
        let want = oracle_ids(model, 4);
        let dump = ["--dump-logits", logits.to_str().unwrap()];
        let o = gen(model, &trunk, &out, &dump);
        assert!(o.status.success(), "{model}: {}", text(&o));
        assert!(!text(&o).contains("prompt fed in passes"), "{}", text(&o));
        let one_pass = std::fs::read(&logits).unwrap();
        for chunk in ["1", "5"] {
            let o = gen_with(
                model,
                &trunk,
                &out,
                &dump,
                &[("K3_TEST_HOOKS", "1"), ("K3_PREFILL_CHUNK", chunk)],
            );
            let t = text(&o);
            assert!(o.status.success(), "{model} chunk {chunk}: {t}");
            assert!(
                t.contains(&format!("prompt fed in passes of at most {chunk} token(s)")),
                "{t}"
            );
            // Progress counts the prompt's tokens in, not the first pass's layers.
            assert!(
                t.contains("tokens in passes:") && !t.contains("tokens: layer"),
                "{t}"
            );
            assert_eq!(generated_ids(&out), want, "{model} chunk {chunk}");
            assert!(
                std::fs::read(&logits).unwrap() == one_pass,
                "{model} chunk {chunk}: the first step's logits differ from one pass"
            );
        }
        // Step up, 100 KB at a time, from a total that is refused to the first that runs.
        let mut step = 200u32;
        let o = gen(model, &trunk, &out, &["--mem-gb", "0.0200"]);
        assert_eq!(o.status.code(), Some(2), "{model}: 20 MB ran: {}", text(&o));
        let first = loop {
            step += 1;
            assert!(step <= 400, "{model}: nothing up to 40 MB runs");
            let gb = format!("{:.4}", step as f64 / 1e4);
            let o = gen(model, &trunk, &out, &["--mem-gb", gb.as_str()]);
            if o.status.success() {
                break (gb, text(&o));
            }
            assert_eq!(o.status.code(), Some(2), "{model} {gb}: {}", text(&o));
        };
        assert!(
            first.1.contains("prompt fed in passes"),
            "{model} {}: {}",
            first.0,
            first.1
        );
        assert_eq!(generated_ids(&out), want, "{model} --mem-gb {}", first.0);
    }
}

/// `--trunk DIR,COPY`: a copy of the packed trunk (its files copied) serves the same
/// oracle ids with everything streamed, staged and in-process; a copy whose manifest
/// differs, or whose data file is short or missing, is refused up front (exit 2) naming
/// it; a unit whose bytes fail their CRCs on one copy is read from the other. Catches a
/// copy taken on trust (a stale or half-copied trunk would be read as this one until a CRC
/// failed mid-run) and the comma list read as one directory. (Which copy
/// serves which 8 MiB piece is the trunk-loader's `copies_share_a_units_pieces`: the tiny
/// trunks are smaller than one piece.)
#[test]
fn a_copy_of_the_trunk_serves_the_same_ids_and_a_wrong_one_is_refused() {
    let model = "tiny-mxfp4";
    let dir = tempfile::tempdir().unwrap();
    let (trunk, copy) = (dir.path().join("trunk"), dir.path().join("copy"));
    pack(model, &trunk);
    std::fs::create_dir(&copy).unwrap();
    for f in ["trunk.json", "trunk.bin"] {
        std::fs::copy(trunk.join(f), copy.join(f)).unwrap();
    }
    let both = std::path::PathBuf::from(format!("{},{}", trunk.display(), copy.display()));
    let m = k3_model::trunk::TrunkManifest::load_dir(&trunk).unwrap();
    let gb = format!("{:.9}", m.max_part() as f64 / 1e9);
    let out = dir.path().join("r.json");
    let want = oracle_ids(model, 4);
    for inproc in [false, true] {
        let mut extra = vec!["--trunk-gb", gb.as_str(), "--cache-gb", "0"];
        if inproc {
            extra.insert(0, "--inproc");
        }
        let o = gen_with(model, &both, &out, &extra, &[]);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
        assert!(
            text(&o).contains("trunk read from 2 copies"),
            "{}",
            text(&o)
        );
        assert_eq!(generated_ids(&out), want, "{extra:?}: ids with a copy");
    }
    // A byte of the first copy changed: the unit that holds it fails its CRC there and is
    // read again from the second; alone, the first copy fails the run. Catches a CRC
    // failure taken as final while another copy holds the bytes.
    let bin = std::fs::read(trunk.join("trunk.bin")).unwrap();
    let mut bad = bin.clone();
    bad[m.layers[1].offset as usize + 100] ^= 0x40;
    std::fs::write(trunk.join("trunk.bin"), &bad).unwrap();
    let o = gen_with(model, &both, &out, &[], &[]);
    let t = text(&o);
    assert!(o.status.success(), "a changed byte in the first copy: {t}");
    assert!(t.contains("reading it again from the other copies"), "{t}");
    assert_eq!(generated_ids(&out), want, "ids read around a changed byte");
    let o = gen_with(model, &trunk, &out, &[], &[]);
    assert!(!o.status.success(), "the changed copy alone: {}", text(&o));
    std::fs::write(trunk.join("trunk.bin"), &bin).unwrap();
    let refused = |what: &str| {
        let o = gen_with(model, &both, &out, &[], &[]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{what}: {t}");
        assert!(t.contains("not a copy of the packed trunk"), "{what}: {t}");
        assert!(t.contains(&copy.display().to_string()), "{what}: {t}");
    };
    let bin = std::fs::read(copy.join("trunk.bin")).unwrap();
    std::fs::write(copy.join("trunk.bin"), &bin[..bin.len() - 4096]).unwrap();
    refused("a short trunk.bin");
    std::fs::write(copy.join("trunk.bin"), &bin).unwrap();
    let mut j = std::fs::read_to_string(copy.join("trunk.json")).unwrap();
    j.push('\n');
    std::fs::write(copy.join("trunk.json"), j).unwrap();
    refused("another trunk.json");
    std::fs::remove_file(copy.join("trunk.json")).unwrap();
    refused("no trunk.json");
}

/// The device of a path's file system (`st_dev`), for telling two of them apart.
fn dev_of(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().dev()
}

/// A directory on the checkpoint's drive (under the target directory) and one on another
/// (tmpfs, `/dev/shm`), for `model`'s packed trunk. None for the second where `/dev/shm` is
/// missing or on the checkpoint's drive, and `test`'s other-drive half is then said to be
/// SKIPPED.
fn beside_and_apart(model: &str, test: &str) -> (tempfile::TempDir, Option<tempfile::TempDir>) {
    let beside = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let shm = std::path::Path::new("/dev/shm");
    let ckpt = fixture(&format!("{model}/sharded"));
    let apart =
        (shm.is_dir() && dev_of(shm) != dev_of(&ckpt)).then(|| tempfile::tempdir_in(shm).unwrap());
    if apart.is_none() {
        // The real stderr: the harness captures eprintln! of a passing test.
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED: {test} (its other-drive half): /dev/shm is missing or on the \
             checkpoint's drive"
        );
    }
    (beside, apart)
}

/// The plan weighs the raw lm_head by its checkpoint shard's drive only where that drive is
/// not the trunk's, for a raw trunk and beside a coded lm_head alike: with the packed trunk
/// beside the checkpoint (one drive) the lm_head's note names no drive rates; with it on
/// tmpfs (`/dev/shm`, another device) both drives are measured (devbw) and the note gives
/// their rates and a raw byte's weight, the lm_head streamed (test hooks) or pinned (whole
/// budgets: tmpfs reads faster than the checkpoint's disk). The ids are the oracle's
/// whichever way the lm_head is held and read. Catches a weight measured on one drive (where the ranking by bytes
/// holds), the shard's drive never measured where it is apart (or only beside a coded
/// lm_head), and a choice that changes an id.
#[test]
fn the_raw_lm_head_is_weighed_by_its_own_drive_only_where_it_has_one() {
    let model = "tiny-mxfp4";
    let want = oracle_ids(model, 4);
    let env = [("K3_TEST_HOOKS", "1"), ("K3_LM_HEAD_CHUNK_BYTES", "7000")];
    let extra = [
        "--trunk-gb",
        "0.0004",
        "--cache-gb",
        "0",
        "--lm-head-read",
        "auto",
    ];
    let test = "the_raw_lm_head_is_weighed_by_its_own_drive_only_where_it_has_one";
    let (beside, apart) = beside_and_apart(model, test);
    let own = "the raw lm_head's shard is on a drive of its own";
    let dirs = [(Some(beside), false), (apart, true)];
    for (dir, weighed) in dirs.into_iter().filter_map(|(d, w)| Some((d?, w))) {
        for (name, codec) in [("raw", &[][..]), ("coded", &["--codec", "bf16-zstd"][..])] {
            let trunk = dir.path().join(name);
            pack_with(model, &trunk, codec, &[]);
            let out = dir.path().join("r.json");
            let o = gen_with(model, &trunk, &out, &extra, &env);
            let t = text(&o);
            assert!(o.status.success(), "{}: {t}", trunk.display());
            assert_eq!(t.contains(own), weighed, "{}: {t}", trunk.display());
            if weighed {
                assert!(t.contains("a raw byte weighed"), "{t}");
            }
            assert_eq!(generated_ids(&out), want, "{}: ids", trunk.display());
            // Whole budgets: the lm_head pinned, and the note says what it was weighed by.
            let o = gen_with(model, &trunk, &out, &[], &[]);
            let t = text(&o);
            assert!(o.status.success(), "{}: {t}", trunk.display());
            assert_eq!(t.contains("lm_head pinned: "), weighed, "{t}");
            assert_eq!(t.contains(own), weighed, "{}: {t}", trunk.display());
            assert_eq!(generated_ids(&out), want, "{}: ids", trunk.display());
        }
    }
}

/// The ring's read of each token's first streamed part waits for the token only when the
/// streamed lm_head shares a drive with the trunk (the trunk beside the checkpoint, under
/// the target directory); with the trunk on another one (tmpfs, `/dev/shm`) it is read
/// while the lm_head streams. The ids are the oracle's either way. Catches the hold kept
/// whatever the drives (the trunk's drives idle through every lm_head), the hold dropped
/// where the drive is shared (the measured win lost), and a wrap read early that changes a
/// bit.
#[test]
fn the_next_tokens_trunk_is_read_during_the_lm_head_only_from_another_drive() {
    let model = "tiny-mxfp4";
    let want = oracle_ids(model, 4);
    let env = [("K3_TEST_HOOKS", "1"), ("K3_LM_HEAD_CHUNK_BYTES", "7000")];
    let extra = ["--trunk-gb", "0.0004", "--cache-gb", "0"];
    let test = "the_next_tokens_trunk_is_read_during_the_lm_head_only_from_another_drive";
    let (beside, apart) = beside_and_apart(model, test);
    let held = "each token's first streamed part is read when the token starts";
    let early = "the next token's first streamed part is read while the lm_head streams";
    let cases = [(Some(beside), held, early), (apart, early, held)];
    for (dir, says, not) in cases.into_iter().filter_map(|(d, s, n)| Some((d?, s, n))) {
        let trunk = dir.path().join("trunk");
        pack(model, &trunk);
        let out = dir.path().join("r.json");
        let o = gen_with(model, &trunk, &out, &extra, &env);
        let t = text(&o);
        assert!(o.status.success(), "{}: {t}", trunk.display());
        assert!(
            t.contains(says) && !t.contains(not),
            "{}: {t}",
            trunk.display()
        );
        assert_eq!(generated_ids(&out), want, "{}: ids", trunk.display());
    }
}
