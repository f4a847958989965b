//! `k3-orch pack-trunk`: one aligned run per layer, byte-identical to the source, atomic,
//! resumable, verifiable, and refusing layouts it cannot pack as runs.

use std::path::Path;

use crate::tools_common::{fixtures, header, k3, k3_ok, tensor_bytes, write_safetensors};
use k3_model::trunk::TrunkManifest;

/// The non-routed-expert tensors of layer `l` in a fixture shard, read with the test's own
/// header parser: (name, data-relative begin, end), sorted by offset.
fn fixture_trunk(shard: &Path, l: usize) -> Vec<(String, u64, u64)> {
    let (_, h) = header(shard);
    let prefix = format!("language_model.model.layers.{l}.");
    let mut v: Vec<(String, u64, u64)> = h
        .as_object()
        .unwrap()
        .iter()
        .filter(|(n, _)| n.starts_with(&prefix) && !n.contains(".block_sparse_moe.experts."))
        .map(|(n, e)| {
            let o = &e["data_offsets"];
            (n.clone(), o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
        })
        .collect();
    v.sort_by_key(|x| x.1);
    v
}

/// Pack the tiny-mxfp4 fixture (written by another tool): every layer's run must hold
/// exactly the fixture's bytes of its trunk tensors, at a 4096-aligned offset, followed by
/// zeros. A packer that copied the aligned source window (dragging neighbour bytes in),
/// mixed in shared-vs-routed experts, or misaligned the tail fails.
#[test]
fn packs_the_fixture_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let trunk = tmp.path().join("t");
    let out = k3_ok(&[
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
    ]);
    assert!(out.contains("largest layer run"), "{out}");
    let m = TrunkManifest::load_dir(&trunk).unwrap();
    assert_eq!(m.layers.len(), 13);
    let bin = std::fs::read(trunk.join("trunk.bin")).unwrap();
    assert_eq!(bin.len() as u64, m.file_size);
    let mut largest = (0u64, 0usize);
    for l in 0..13 {
        let shard = model.join(format!("model-{:05}-of-000014.safetensors", l + 1));
        let want = fixture_trunk(&shard, l);
        let ml = &m.layers[l];
        assert_eq!(ml.offset % 4096, 0);
        assert_eq!(ml.tensors.len(), want.len(), "layer {l}");
        let span = want.last().unwrap().2 - want[0].1;
        assert_eq!(ml.length, span, "layer {l}");
        if span > largest.0 {
            largest = (span, l);
        }
        for (t, (name, _, _)) in ml.tensors.iter().zip(&want) {
            assert_eq!(&t.name, name);
            let got =
                &bin[(ml.offset + t.offset) as usize..(ml.offset + t.offset + t.len) as usize];
            assert_eq!(
                got,
                &tensor_bytes(&shard, name)[..],
                "layer {l} tensor {name}"
            );
        }
        let pad = &bin[(ml.offset + ml.length) as usize..(ml.offset + ml.padded_length) as usize];
        assert!(pad.iter().all(|&b| b == 0), "layer {l} padding");
    }
    assert_eq!((m.max_run, m.max_run_layer), largest);
    // trunk_total = the fixture's non-expert layer bytes.
    let total: u64 = m.layers.iter().map(|l| l.length).sum();
    assert_eq!(m.total_bytes, total);

    // Re-run: nothing to do; --verify re-reads and passes.
    let (code, _, err) = k3(&[
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(err.contains("nothing to pack"), "{err}");
    let out = k3_ok(&[
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
        "--verify",
    ]);
    assert!(out.contains("verify: OK"), "{out}");

    // Same-size corruption of one layer's bytes is caught by --verify's sha256 and named,
    // even when the per-chunk CRCs were forged to match (a plain corruption is re-packed:
    // corrupted_trunk_is_repacked_not_trusted).
    let mut bad = bin.clone();
    let at = (m.layers[4].offset + 100) as usize;
    bad[at] ^= 0xff;
    std::fs::write(trunk.join("trunk.bin"), &bad).unwrap();
    let mut forged = m.clone();
    let l4 = &m.layers[4];
    forged.layers[4].crc32 =
        k3_model::trunk::chunk_crcs(&bad[l4.offset as usize..(l4.offset + l4.length) as usize]);
    std::fs::write(
        trunk.join("trunk.json"),
        serde_json::to_vec_pretty(&forged).unwrap(),
    )
    .unwrap();
    let (code, _, err) = k3(&[
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
        "--verify",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("layer 4: sha256 mismatch"), "{err}");
}

/// synth -> verify -> pack-trunk -> --verify, the whole tool chain on a fresh model.
#[test]
fn synth_verify_pack_chain() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let trunk = tmp.path().join("t");
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "11",
        model.to_str().unwrap(),
    ]);
    k3_ok(&["verify", model.to_str().unwrap()]);
    let out = k3_ok(&[
        "pack-trunk",
        model.to_str().unwrap(),
        trunk.to_str().unwrap(),
        "--verify",
    ]);
    assert!(out.contains("verify: OK"), "{out}");
}

/// An interrupted pack resumes after its last journaled layer, and the result is
/// byte-identical to an uninterrupted pack. A leftover data file with no journal, or a
/// journal of another plan, restarts. No trunk.json exists while unfinished.
#[test]
fn interrupted_pack_resumes_or_restarts() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let m = model.to_str().unwrap();
    let clean = tmp.path().join("clean");
    k3_ok(&["pack-trunk", m, clean.to_str().unwrap()]);
    let want_bin = std::fs::read(clean.join("trunk.bin")).unwrap();
    let want_json = std::fs::read(clean.join("trunk.json")).unwrap();

    let t = tmp.path().join("t");
    let ts = t.to_str().unwrap();
    let (code, _, _) = k3(&["pack-trunk", m, ts, "--stop-after-layers", "5"]);
    assert_eq!(code, 1);
    assert!(
        !t.join("trunk.json").exists(),
        "unfinished trunk must not look complete"
    );
    assert!(!t.join("trunk.bin").exists());
    assert!(t.join("trunk.bin.partial").exists() && t.join("trunk.partial.json").exists());
    let (code, _, err) = k3(&["pack-trunk", m, ts]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming: 5 of 13 layers"), "{err}");
    assert_eq!(std::fs::read(t.join("trunk.bin")).unwrap(), want_bin);
    assert_eq!(std::fs::read(t.join("trunk.json")).unwrap(), want_json);
    assert!(!t.join("trunk.partial.json").exists());

    // Garbage data file, no journal: start over.
    let g = tmp.path().join("g");
    std::fs::create_dir(&g).unwrap();
    std::fs::write(g.join("trunk.bin.partial"), vec![0xAB; 1 << 20]).unwrap();
    let (code, _, err) = k3(&["pack-trunk", m, g.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("starting over"), "{err}");
    assert_eq!(std::fs::read(g.join("trunk.bin")).unwrap(), want_bin);

    // A journal of another plan: start over (resuming would mix two checkpoints).
    let j = tmp.path().join("j");
    k3(&[
        "pack-trunk",
        m,
        j.to_str().unwrap(),
        "--stop-after-layers",
        "3",
    ]);
    let jp = j.join("trunk.partial.json");
    let text = std::fs::read_to_string(&jp).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["plan_sha256"] = serde_json::json!("0".repeat(64));
    std::fs::write(&jp, serde_json::to_vec(&v).unwrap()).unwrap();
    let (code, _, err) = k3(&["pack-trunk", m, j.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("another checkpoint or layout: starting over"),
        "{err}"
    );
    assert_eq!(std::fs::read(j.join("trunk.bin")).unwrap(), want_bin);

    // A complete trunk of another checkpoint in TRUNK_DIR is refused (exit 2), not trusted
    // and not silently overwritten; --force replaces it.
    let other = tmp.path().join("other");
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--experts",
        "6",
        other.to_str().unwrap(),
    ]);
    let (code, _, err) = k3(&["pack-trunk", other.to_str().unwrap(), ts]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("another checkpoint"), "{err}");
    let (code, _, err) = k3(&["pack-trunk", other.to_str().unwrap(), ts, "--force"]);
    assert_eq!(code, 0, "{err}");
    let mo = TrunkManifest::load_dir(&t).unwrap();
    assert_ne!(std::fs::read(t.join("trunk.bin")).unwrap(), want_bin);
    assert_eq!(mo.layers.len(), 13);
}

/// Layouts that cannot be packed as one run per layer are refused (exit 2) with the reason:
/// a routed expert between two trunk tensors (the gap in bytes is named), a layer split
/// over two shards.
#[test]
fn refuses_non_contiguous_and_split_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("gap");
    std::fs::create_dir(&a).unwrap();
    write_safetensors(
        &a.join("model.safetensors"),
        &[
            (
                "language_model.model.layers.0.input_layernorm.weight",
                "BF16",
                vec![8],
                [0, 16],
            ),
            (
                "language_model.model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "BF16",
                vec![4, 4],
                [16, 48],
            ),
            (
                "language_model.model.layers.0.post_attention_layernorm.weight",
                "BF16",
                vec![8],
                [48, 64],
            ),
        ],
        64,
    );
    let (code, _, err) = k3(&[
        "pack-trunk",
        a.to_str().unwrap(),
        tmp.path().join("t1").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("layer 0 is not contiguous"), "{err}");
    assert!(err.contains("32 bytes of gap"), "{err}");

    let b = tmp.path().join("split");
    std::fs::create_dir(&b).unwrap();
    let n1 = "language_model.model.layers.0.input_layernorm.weight";
    let n2 = "language_model.model.layers.0.post_attention_layernorm.weight";
    write_safetensors(
        &b.join("s1.safetensors"),
        &[(n1, "BF16", vec![8], [0, 16])],
        16,
    );
    write_safetensors(
        &b.join("s2.safetensors"),
        &[(n2, "BF16", vec![8], [0, 16])],
        16,
    );
    let idx = serde_json::json!({
        "metadata": {"total_size": 32},
        "weight_map": {n1: "s1.safetensors", n2: "s2.safetensors"}
    });
    std::fs::write(
        b.join("model.safetensors.index.json"),
        serde_json::to_vec(&idx).unwrap(),
    )
    .unwrap();
    let (code, _, err) = k3(&[
        "pack-trunk",
        b.to_str().unwrap(),
        tmp.path().join("t2").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("layer 0 spans 2 shards"), "{err}");
    assert!(!tmp.path().join("t2/trunk.json").exists());

    let (code, _, _) = k3(&["pack-trunk", a.to_str().unwrap()]);
    assert_eq!(code, 2, "usage error");
}

/// A trunk packed from another checkpoint with the same layout (same shard names, sizes and
/// headers; `synth --seed 7` of the tiny shape) is refused by pack-trunk, --verify included
/// (exit 2). Failed before: sizes were the whole identity, and pack-trunk --verify said
/// "already holds a complete trunk of this checkpoint ... verify: OK".
#[test]
fn same_layout_other_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let s7 = tmp.path().join("s7");
    let t7 = tmp.path().join("t7");
    k3_ok(&[
        "synth",
        "--shape",
        "tiny",
        "--seed",
        "7",
        s7.to_str().unwrap(),
    ]);
    k3_ok(&["pack-trunk", s7.to_str().unwrap(), t7.to_str().unwrap()]);
    let model = fixtures().join("tiny-mxfp4/sharded");
    for extra in [&[][..], &["--verify"][..]] {
        let mut args = vec!["pack-trunk", model.to_str().unwrap(), t7.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (code, out, err) = k3(&args);
        assert_eq!(code, 2, "{extra:?}: {out}{err}");
        assert!(err.contains("same header, other data"), "{err}");
        assert!(!out.contains("verify: OK"), "{out}");
    }
}

/// Bytes of trunk.bin changed after packing: plain pack-trunk no longer calls the directory
/// complete (its per-chunk CRCs are re-read) and re-packs it to the checkpoint's bytes;
/// --verify names the layer. Failed before: "complete ... nothing to pack".
#[test]
fn corrupted_trunk_is_repacked_not_trusted() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let (m, t) = (model.to_str().unwrap(), tmp.path().join("t"));
    k3_ok(&["pack-trunk", m, t.to_str().unwrap()]);
    let good = std::fs::read(t.join("trunk.bin")).unwrap();
    let man = TrunkManifest::load_dir(&t).unwrap();
    let mut bad = good.clone();
    let at = man.layers[2].offset as usize + 4096;
    bad[at..at + 4096].fill(0xAB);
    std::fs::write(t.join("trunk.bin"), &bad).unwrap();
    let (code, _, err) = k3(&["pack-trunk", m, t.to_str().unwrap(), "--verify"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("checksum mismatch") && err.contains("(layer 2,"),
        "{err}"
    );
    assert!(!err.contains("nothing to pack"), "{err}");
    assert_eq!(std::fs::read(t.join("trunk.bin")).unwrap(), good);
}

/// Two pack-trunk runs into one directory: the second is refused (exit 2) while the first
/// holds the directory's lock, instead of failing later with a rename ENOENT.
#[test]
fn concurrent_pack_is_refused() {
    use std::os::fd::AsRawFd;
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path().join("t");
    std::fs::create_dir(&t).unwrap();
    let lock = std::fs::File::create(t.join(".pack-trunk.lock")).unwrap();
    // SAFETY: flock on a descriptor `lock` keeps open.
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let model = fixtures().join("tiny-mxfp4/sharded");
    let (code, _, err) = k3(&["pack-trunk", model.to_str().unwrap(), t.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("another k3-orch pack-trunk is writing"),
        "{err}"
    );
    drop(lock);
    k3_ok(&["pack-trunk", model.to_str().unwrap(), t.to_str().unwrap()]);
}

/// `--codec bf16-zstd`: an interrupted coding resumes (the raw trunk stays the complete one
/// until the coded manifest commits), the result replaces trunk.bin and verifies; a flipped
/// stored byte is caught by `--verify` naming the layer and the chunk (exit 1), and a plain
/// re-run re-packs it rather than trusting it; a run without --codec is refused rather than
/// throwing the coded trunk away. Catches a journal that restarts from zero, a
/// coded manifest committed before its data, a verify that checks only the stored CRCs'
/// count or only the decoded sha256 of intact layers.
#[test]
fn coded_pack_resumes_verifies_and_names_a_damaged_chunk() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let (m, t) = (model.to_str().unwrap(), tmp.path().join("t"));
    let t = t.to_str().unwrap();
    let (code, _, err) = k3(&[
        "pack-trunk",
        m,
        t,
        "--codec",
        "bf16-zstd",
        "--stop-after-coded-layers",
        "5",
    ]);
    assert_eq!(code, 1, "{err}");
    let raw = TrunkManifest::load_dir(t).unwrap();
    assert!(raw.codec.is_none(), "committed before the coding finished");
    let (code, out, err) = k3(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--level", "3"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("resuming the coding: 5 of 13"), "{err}");
    let coded = TrunkManifest::load_dir(t).unwrap();
    let c = coded.codec.as_ref().unwrap();
    assert_eq!(c.name, "bf16-zstd");
    assert!(!Path::new(t).join("trunk.bin").exists());
    assert!(
        c.stored_bytes < coded.total_bytes,
        "{} of {}",
        c.stored_bytes,
        coded.total_bytes
    );
    assert_eq!(
        coded.layers, raw.layers,
        "the raw layout is what the loader plans for"
    );
    let out = k3_ok(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--verify"]);
    assert!(out.contains("verify: OK"), "{out}");

    // A flipped stored byte: the scan before anything else names the chunk and re-packs.
    let k3z = Path::new(t).join(&c.file);
    let ch = c.layers[4].chunks[0];
    let at = (c.layers[4].offset + ch.offset) as usize;
    let mut bytes = std::fs::read(&k3z).unwrap();
    bytes[at + 40] ^= 0x20;
    std::fs::write(&k3z, &bytes).unwrap();
    let (code, out, err) = k3(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--verify"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        err.contains("trunk layer 4 chunk 0: the stored bytes fail"),
        "{err}"
    );
    assert!(out.contains("verify: OK"), "{out}");
    // A changed mantissa byte whose stored CRC was forged too: only decoding and the
    // decoded CRC can see it, and --verify does (exit 1, naming the chunk).
    let c = TrunkManifest::load_dir(t).unwrap().codec.unwrap();
    let ch = c.layers[4].chunks[0];
    let at = (c.layers[4].offset + ch.offset) as usize;
    let mut bytes = std::fs::read(&k3z).unwrap();
    let last = at + ch.stored as usize - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&k3z, &bytes).unwrap();
    let json = Path::new(t).join("trunk.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    v["codec"]["layers"][4]["chunks"][0]["crc32_stored"] =
        crc32c::crc32c(&bytes[at..at + ch.stored as usize]).into();
    std::fs::write(&json, v.to_string()).unwrap();
    let (code, _, err) = k3(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--verify"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("trunk layer 4 chunk 0: the decoded bytes fail"),
        "{err}"
    );
    // Asked for raw (no --codec, a `--verify` of the coded trunk mistyped): refused (exit 2)
    // and the coded trunk kept, since coding a released trunk takes a long time. Catches
    // the re-pack that threw it away silently.
    let (code, _, err) = k3(&["pack-trunk", m, t, "--verify"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("coded with bf16-zstd; pass --codec bf16-zstd to keep it")
            && err.contains("--force"),
        "{err}"
    );
    assert!(k3z.exists() && TrunkManifest::load_dir(t).unwrap().codec.is_some());
    // With --force: trunk.bin comes back and the coded file goes.
    k3_ok(&["pack-trunk", m, t, "--force"]);
    assert!(TrunkManifest::load_dir(t).unwrap().codec.is_none());
    assert!(!k3z.exists());
}

/// `--codec` codes the lm_head too (`lm_head.k3z`), and a coded trunk packed before that
/// (no `head` in its manifest) gets it added by a re-run with `--codec`, its layers left
/// alone; `--verify` decodes the coded lm_head and names a damaged chunk of it (exit 1).
/// Catches a re-run that re-packs the whole trunk for the head, a verify that skips the
/// head, and a head committed without its data.
#[test]
fn the_lm_head_is_coded_added_and_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let (m, t) = (model.to_str().unwrap(), tmp.path().join("t"));
    let t = t.to_str().unwrap();
    let out = k3_ok(&["pack-trunk", m, t, "--codec", "bf16-zstd"]);
    assert!(out.contains("coded the lm_head (256 rows)"), "{out}");
    let coded = TrunkManifest::load_dir(t).unwrap();
    let h = coded.codec.as_ref().unwrap().head.clone().unwrap();
    let head_file = Path::new(t).join(&h.file);
    assert_eq!(std::fs::metadata(&head_file).unwrap().len(), h.file_size);
    // As a trunk coded before the lm_head was.
    let json = Path::new(t).join("trunk.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    v["codec"].as_object_mut().unwrap().remove("head");
    std::fs::write(&json, v.to_string()).unwrap();
    std::fs::remove_file(&head_file).unwrap();
    let k3z = Path::new(t).join("trunk.k3z");
    let before = std::fs::metadata(&k3z).unwrap().modified().unwrap();
    let out = k3_ok(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--verify"]);
    assert!(
        out.contains("added the coded lm_head") && out.contains("verify: OK"),
        "{out}"
    );
    assert_eq!(std::fs::metadata(&k3z).unwrap().modified().unwrap(), before);
    let again = TrunkManifest::load_dir(t).unwrap();
    assert_eq!(again.codec.as_ref().unwrap().head.as_ref(), Some(&h));
    assert_eq!(again.codec.unwrap().layers, coded.codec.unwrap().layers);
    // A changed byte of chunk 0 with its stored CRC forged: only decoding sees it.
    let ch = h.chunks[0];
    let mut bytes = std::fs::read(&head_file).unwrap();
    bytes[(ch.offset + ch.stored) as usize - 1] ^= 0x01;
    std::fs::write(&head_file, &bytes).unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let stored = &bytes[ch.offset as usize..(ch.offset + ch.stored) as usize];
    v["codec"]["head"]["chunks"][0]["crc32_stored"] = crc32c::crc32c(stored).into();
    std::fs::write(&json, v.to_string()).unwrap();
    let (code, _, err) = k3(&["pack-trunk", m, t, "--codec", "bf16-zstd", "--verify"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("coded lm_head chunk 0: the decoded bytes fail"),
        "{err}"
    );
}

/// `pack-trunk`'s test hook `K3_TEST_HEAD_CHUNK_BYTES` is refused up front (exit 2,
/// naming it, nothing packed) unless `K3_TEST_HOOKS=1` arms it, and when armed with a value
/// that is not a positive integer: as a run's hooks are (`check_test_hooks`). Catches the
/// hook read on its own, silently ignored when unarmed or malformed.
#[test]
fn the_head_chunk_hook_is_refused_unless_armed_and_well_formed() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let t = tmp.path().join("t");
    for (armed, value) in [(false, "2048"), (true, "0"), (true, "x")] {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_k3-orch"));
        c.arg("pack-trunk")
            .arg(&model)
            .arg(&t)
            .args(["--codec", "bf16-zstd"]);
        c.env_remove("K3_TEST_HOOKS")
            .env("K3_TEST_HEAD_CHUNK_BYTES", value);
        if armed {
            c.env("K3_TEST_HOOKS", "1");
        }
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "armed {armed} {value:?}: {err}");
        assert!(err.contains("K3_TEST_HEAD_CHUNK_BYTES"), "{err}");
        assert!(!t.join("trunk.json").exists(), "packed despite the refusal");
    }
}

/// An unknown codec is refused up front (exit 2) with the ones this build has.
#[test]
fn unknown_codec_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let t = tmp.path().join("t");
    let (code, _, err) = k3(&[
        "pack-trunk",
        model.to_str().unwrap(),
        t.to_str().unwrap(),
        "--codec",
        "lz9",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("bf16-zstd"), "{err}");
}

/// A build that predates codecs reads a trunk.json only when its `format` is "k3-trunk/3"
/// (and would ignore an unknown `codec` field): a coded manifest carries another format,
/// so such a build refuses it by name; this build refuses a codec under the raw format; a
/// raw manifest has no `codec` key at all (byte for byte what an old build wrote).
#[test]
fn an_old_reader_refuses_a_coded_trunk_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-mxfp4/sharded");
    let t = tmp.path().join("t");
    k3_ok(&["pack-trunk", model.to_str().unwrap(), t.to_str().unwrap()]);
    let raw = std::fs::read_to_string(t.join("trunk.json")).unwrap();
    assert!(!raw.contains("\"codec\""));
    k3_ok(&[
        "pack-trunk",
        model.to_str().unwrap(),
        t.to_str().unwrap(),
        "--codec",
        "bf16-zstd",
        "--level",
        "1",
    ]);
    let text = std::fs::read_to_string(t.join("trunk.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    // What the old build (k3_model::trunk of format 3) compares the format with.
    assert_ne!(v["format"], "k3-trunk/3");
    assert_eq!(v["format"], k3_model::trunk::TRUNK_CODED_FORMAT);
    let mut forged = v.clone();
    forged["format"] = "k3-trunk/3".into();
    let e = TrunkManifest::from_json_str(&forged.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("a trunk with a codec is \"k3-trunk-coded/1\""),
        "{e}"
    );
    // And a run refuses a truncated coded file before any compute (exit 2).
    let k3z = t.join("trunk.k3z");
    let len = std::fs::metadata(&k3z).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&k3z)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    let (code, _, err) = k3(&[
        model.to_str().unwrap(),
        "--ids",
        "1,2",
        "--gen",
        "1",
        "--trunk",
        t.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("trunk.k3z"), "{err}");
}
