//! A CI-sized run of the mutation fuzzer in `examples/fuzz_trunk` (`trunk.json` and the
//! trunk codec's chunk decoder, 20,000 cases each, a few seconds), so the harness keeps
//! compiling and keeps reaching the readers' accepting paths; the long runs (≥ 10^7 cases
//! each) are in docs/fuzzing.md.

#[allow(dead_code)]
#[path = "../examples/fuzz_trunk/harness.rs"]
mod harness;

use harness::{run, Target};

/// Both readers: no panics, no verdict the oracles disagree with, and a share of accepted
/// mutants (a harness whose mutants never parse tests only the readers' first checks).
#[test]
fn trunk_fuzz_finds_nothing_and_reaches_acceptance() {
    for t in Target::ALL {
        let rep = run(t, 20_261_205, fuzzkit::ci_execs(), 0, |_| {});
        rep.assert_ci(fuzzkit::ci_execs(), |b| {
            format!("{:?}", String::from_utf8_lossy(b))
        });
    }
}

/// The corpus holds raw and coded manifests the reader accepts, and the oracle can fail:
/// it refuses a nudged run length and a layer count that disagrees with the codec's.
#[test]
fn trunk_corpus_is_valid_and_the_oracle_refuses_what_it_must() {
    let ms = harness::manifests();
    assert!(ms.len() >= 8, "{} manifests", ms.len());
    let mut coded = 0;
    for m in &ms {
        let s = std::str::from_utf8(m).unwrap();
        let got = k3_model::trunk::TrunkManifest::from_json_str(s).unwrap();
        assert!(harness::oracle_accepts(s));
        coded += got.codec.is_some() as usize;
    }
    assert!(coded > 0 && coded < ms.len());
    let s = String::from_utf8(ms[0].clone()).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&s).unwrap();
    v["layers"][0]["length"] = (v["layers"][0]["length"].as_u64().unwrap() + 1).into();
    assert!(!harness::oracle_accepts(&v.to_string()));
    let mut v: serde_json::Value = serde_json::from_str(&s).unwrap();
    v["total_bytes"] = 0.into();
    assert!(!harness::oracle_accepts(&v.to_string()));
}

/// The coded corpus carries a coded lm_head, and the reader and the oracle both refuse
/// its chunk rows at 0, a chunk moved off its alignment, a row so wide that rows times
/// chunk rows passes 2^64 (the reader saturates it, the oracle counts in 128 bits), and a
/// file_size that is not the last chunk's end aligned up. Catches a head the fuzzer never
/// sees (the corpus without one), and a check the two would disagree on.
#[test]
fn the_coded_lm_head_is_in_the_corpus_and_checked() {
    let v = coded_manifest();
    assert!(
        v["codec"]["head"]["chunks"]
            .as_array()
            .is_some_and(|c| c.len() > 1),
        "{v}"
    );
    let text = v.to_string();
    assert!(harness::oracle_accepts(&text));
    assert!(k3_model::trunk::TrunkManifest::from_json_str(&text).is_ok());
    let edits: [&dyn Fn(&mut serde_json::Value); 4] = [
        &|v| v["codec"]["head"]["chunk_rows"] = 0.into(),
        &|v| v["codec"]["head"]["chunks"][1]["offset"] = 4097.into(),
        &|v| v["codec"]["head"]["shape"][1] = (u64::MAX / 2).into(),
        &|v| {
            let f = v["codec"]["head"]["file_size"].as_u64().unwrap();
            v["codec"]["head"]["file_size"] = (f + 4096).into();
        },
    ];
    for (i, edit) in edits.iter().enumerate() {
        let mut w = v.clone();
        edit(&mut w);
        let t = w.to_string();
        assert!(
            !harness::oracle_accepts(&t),
            "edit {i}: the oracle accepted"
        );
        assert!(
            k3_model::trunk::TrunkManifest::from_json_str(&t).is_err(),
            "edit {i}: the reader accepted"
        );
    }
}

/// The harness corpus's first coded (`k3-trunk-coded/1`) manifest, as JSON.
fn coded_manifest() -> serde_json::Value {
    harness::manifests()
        .iter()
        .map(|m| serde_json::from_slice::<serde_json::Value>(m).unwrap())
        .find(|v| v.get("codec").is_some())
        .unwrap()
}

/// Found by `examples/fuzz_trunk` (a panic, "attempt to multiply with overflow", in a build
/// with overflow checks): a run length or a coded layer's stored length within 4095 of
/// 2^64 has no 4096-aligned padded length, and `align_up` overflowed while the manifest
/// was being checked. Catches: the plain `align_up` in `TrunkManifest::problems` or
/// `codec_problems`, which panics with overflow checks and otherwise wraps to 0, so that
/// a `padded_length` of 0 passed its check (this test then finds no padded_length
/// problem).
#[test]
fn a_length_near_2_64_is_a_problem_not_an_overflow() {
    let coded = coded_manifest();
    let mut v = coded.clone();
    v["layers"][0]["length"] = u64::MAX.into();
    v["layers"][0]["padded_length"] = 0.into();
    let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
    let p = m.problems();
    assert!(
        p.iter()
            .any(|p| p.starts_with("layer 0: padded_length 0 is not length")),
        "{p:#?}"
    );
    let mut v = coded;
    v["codec"]["layers"][0]["stored_length"] = (u64::MAX - 5).into();
    v["codec"]["layers"][0]["padded_length"] = 0.into();
    let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
    let p = m.problems();
    assert!(
        p.iter()
            .any(|p| p == "codec layer 0: padded_length is not stored_length aligned up"),
        "{p:#?}"
    );
}

/// Found by `examples/fuzz_trunk` (seed 20261207, case 6,351,961 of 10^7; the oracle
/// refused what the reader accepted): a raw layer at offset 2^64 - 4096 with a padded
/// length of 53,248 ends past 2^64; its end saturated to 2^64 - 1, which a `file_size` of
/// 2^64 - 1 then matched. The same for a coded layer's run and the codec's file_size.
/// Catches: `saturating_add` in place of a checked sum in `TrunkManifest::problems` or
/// `codec_problems` (no problem is then reported).
#[test]
fn a_run_ending_past_2_64_is_a_problem() {
    let coded = coded_manifest();
    let mut v = coded.clone();
    v.as_object_mut().unwrap().remove("codec");
    v["format"] = "k3-trunk/3".into();
    v["file_size"] = u64::MAX.into();
    let n = v["layers"].as_array().unwrap().len();
    v["layers"][n - 1]["offset"] = (u64::MAX - 4095).into();
    let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
    let p = m.problems();
    assert!(
        p.iter()
            .any(|p| p.ends_with("offset + padded_length overflows 64 bits")),
        "{p:#?}"
    );
    let mut v = coded;
    v["codec"]["file_size"] = u64::MAX.into();
    let n = v["codec"]["layers"].as_array().unwrap().len();
    v["codec"]["layers"][n - 1]["offset"] = (u64::MAX - 4095).into();
    let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
    let p = m.problems();
    assert!(
        p.iter().any(|p| p.starts_with("codec layer")
            && p.ends_with("offset + padded_length overflows 64 bits")),
        "{p:#?}"
    );
}

/// Found by `examples/fuzz_trunk` (`load_dir` accepted a manifest whose data file could
/// not exist): a manifest naming "." (or "..") as its data file passed the check, and
/// `load_dir` then took the trunk directory itself, 4096 bytes on most file systems, for a
/// data file of that size. Catches: a plain-file-name check that refuses only "" and
/// names with a slash, for the raw file and for the codec's.
#[test]
fn a_data_file_named_dot_or_dot_dot_is_a_problem() {
    let coded = coded_manifest();
    for name in [".", ".."] {
        let mut v = coded.clone();
        v["file"] = name.into();
        let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
        let want = format!("file {name:?} is not a plain file name");
        assert!(m.problems().contains(&want), "{:#?}", m.problems());
        let mut v = coded.clone();
        v["codec"]["file"] = name.into();
        let m: k3_model::trunk::TrunkManifest = serde_json::from_value(v).unwrap();
        let want = format!("codec file {name:?} is not a plain file name of its own");
        assert!(m.problems().contains(&want), "{:#?}", m.problems());
    }
}
