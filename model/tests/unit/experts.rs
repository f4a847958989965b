//! The packed-experts format (`src/experts.rs`): striping, the manifest's round trip and
//! checks, one pack over the drive directories.

use k3_model::experts::*;
use k3_model::trunk::SourceIdentity;

fn run(layer: usize, expert: usize, length: u64) -> ExpertRun {
    ExpertRun {
        layer,
        expert,
        shard: 0,
        source_offset: 0,
        length,
    }
}

/// Equal experts go round-robin (the experts of one decision spread over the drives);
/// uneven ones fill the lightest directory, so the bytes stay balanced.
#[test]
fn striping_balances_bytes() {
    let runs: Vec<_> = (0..7).map(|e| run(0, e, 5000)).collect();
    assert_eq!(
        stripe(&runs, 3),
        vec![vec![0, 3, 6], vec![1, 4], vec![2, 5]]
    );
    assert_eq!(stripe(&runs, 1), vec![(0..7).collect::<Vec<_>>()]);
    let uneven = vec![
        run(0, 0, 40_000),
        run(0, 1, 4096),
        run(0, 2, 4096),
        run(0, 3, 8192),
    ];
    // 40 KB to dir 0; then dir 1 gets the small ones until it passes dir 0.
    assert_eq!(stripe(&uneven, 2), vec![vec![0], vec![1, 2, 3]]);
}

/// Two copies over four directories: every run in two distinct directories, every
/// directory the same bytes, and every one of the six pairs of directories used (twice in
/// twelve runs). Catches copies in one directory, an unbalanced layout, and fixed mirror
/// pairs ({0,1} and {2,3} only), which leave a layer's reads as uneven between the two
/// pairs as plain stripes over two drives. One copy is `stripe`; copies beyond the
/// directories are clamped.
#[test]
fn copies_cover_every_pair_of_directories() {
    let runs: Vec<_> = (0..12).map(|e| run(0, e, 5000)).collect();
    let dirs = stripe_copies(&runs, 4, 2);
    assert!(dirs.iter().all(|d| d.len() == 6), "{dirs:?}");
    let mut pairs = std::collections::BTreeMap::new();
    for i in 0..runs.len() {
        let on: Vec<usize> = (0..4).filter(|&d| dirs[d].contains(&i)).collect();
        assert_eq!(on.len(), 2, "run {i}: {on:?}");
        *pairs.entry(on).or_insert(0) += 1;
    }
    assert_eq!(pairs.len(), 6, "{pairs:?}");
    assert!(pairs.values().all(|&n| n == 2), "{pairs:?}");
    // File order within a directory is the runs' order.
    assert!(dirs.iter().all(|d| d.windows(2).all(|w| w[0] < w[1])));
    assert_eq!(stripe_copies(&runs, 3, 1), stripe(&runs, 3));
    let all = stripe_copies(&runs, 2, 5);
    assert_eq!(all, vec![(0..12).collect::<Vec<_>>(); 2]);
}

/// Split packs: every run cut into page-aligned parts that tile it, part `k` of run `j` in
/// directory `(j + k) mod n`, so each directory holds one part of every run (of runs of
/// at least `n` pages) and the bytes balance. Catches parts that overlap or leave a gap,
/// unaligned cuts (an O_DIRECT read of a part would then land off its place in the slot),
/// and every first part on directory 0 (the short last parts would then all land on the
/// last directory).
#[test]
fn split_parts_tile_each_run_over_every_directory() {
    let runs: Vec<_> = (0..6).map(|e| run(0, e, 3 * 4096 + 100)).collect();
    let dirs = split_runs(&runs, 2);
    for (j, r) in runs.iter().enumerate() {
        let mut parts: Vec<(u64, u64, usize)> = (0..2)
            .flat_map(|d| {
                dirs[d]
                    .iter()
                    .filter(|p| p.run == j)
                    .map(move |p| (p.from, p.length, d))
            })
            .collect();
        parts.sort_unstable();
        assert_eq!(parts.len(), 2, "run {j}: {parts:?}");
        assert_eq!(parts[0].0, 0);
        assert_eq!(parts[1].0, parts[0].1, "run {j}: the parts must meet");
        assert_eq!(parts[0].1 + parts[1].1, r.length);
        assert!(parts.iter().all(|p| p.0 % EXPERTS_ALIGN == 0));
        assert_ne!(parts[0].2, parts[1].2, "run {j}: one part a directory");
        assert_eq!(parts[0].2, j % 2, "run {j}: the first part rotates");
    }
    let bytes: Vec<u64> = dirs
        .iter()
        .map(|d| d.iter().map(|p| p.length).sum())
        .collect();
    assert_eq!(bytes[0], bytes[1], "{bytes:?}");
    // An expert under n pages takes fewer parts; one directory takes the whole run.
    let small = split_runs(&[run(0, 0, 5000)], 4);
    assert_eq!(small.iter().map(Vec::len).sum::<usize>(), 2);
    let one = split_runs(&runs, 1);
    assert!(one[0]
        .iter()
        .all(|p| p.from == 0 && p.length == 3 * 4096 + 100));
}

fn manifest() -> ExpertsManifest {
    let sha = "ab".repeat(32);
    ExpertsManifest {
        format: EXPERTS_FORMAT.into(),
        align: EXPERTS_ALIGN,
        pack_id: "cd".repeat(32),
        stripe: 1,
        stripes: 2,
        total_experts: 4,
        copies: 1,
        split: false,
        file: EXPERTS_BIN.into(),
        file_size: 8192 + 4096,
        total_bytes: 5000 + 100,
        source: SourceIdentity {
            total_size: 1,
            shards: Vec::new(),
        },
        experts: vec![
            PackedExpert {
                layer: 1,
                expert: 1,
                offset: 0,
                length: 5000,
                shard: "s".into(),
                source_offset: 10,
                sha256: sha.clone(),
                part_offset: 0,
            },
            PackedExpert {
                layer: 1,
                expert: 3,
                offset: 8192,
                length: 100,
                shard: "s".into(),
                source_offset: 99999,
                sha256: sha,
                part_offset: 0,
            },
        ],
    }
}

#[test]
fn a_valid_manifest_round_trips() {
    let m = manifest();
    assert!(m.problems().is_empty(), "{:?}", m.problems());
    let text = serde_json::to_string(&m).unwrap();
    assert_eq!(ExpertsManifest::from_json_str(&text).unwrap(), m);
    // A manifest written before copies existed has one copy of each expert.
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("copies");
    let old = ExpertsManifest::from_json_str(&v.to_string()).unwrap();
    assert_eq!(old.copies, 1);
}

/// Each way a manifest can lie is named (a reader that trusted it would read the wrong
/// bytes as an expert).
#[test]
fn inconsistencies_are_named() {
    type Edit = Box<dyn Fn(&mut ExpertsManifest)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|m| m.experts[1].offset = 4096), "overlaps"),
        (Box::new(|m| m.experts[1].offset = 8000), "not aligned"),
        (Box::new(|m| m.file_size += 1), "file_size"),
        (Box::new(|m| m.total_bytes = 1), "total_bytes"),
        (Box::new(|m| m.stripe = 2), "stripe 2 of 2"),
        (Box::new(|m| m.experts[1].expert = 1), "listed twice"),
        (Box::new(|m| m.experts[0].sha256 = "x".into()), "sha256"),
        (Box::new(|m| m.pack_id = "x".into()), "pack_id"),
        (Box::new(|m| m.file = "../x".into()), "plain file name"),
        // "." and ".." name directories (the trunk manifest's fuzz finding, here too).
        (Box::new(|m| m.file = ".".into()), "plain file name"),
        (Box::new(|m| m.file = "..".into()), "plain file name"),
        (Box::new(|m| m.copies = 3), "copies 3"),
        (Box::new(|m| m.copies = 0), "copies 0"),
        // A whole-expert pack has no parts; a split pack says so in its format and has
        // one copy, its parts aligned.
        (
            Box::new(|m| m.experts[0].part_offset = 4096),
            "whole-expert",
        ),
        (Box::new(|m| m.split = true), "k3-experts/2"),
        (
            Box::new(|m| {
                m.split = true;
                m.format = EXPERTS_FORMAT_SPLIT.into();
                m.copies = 2;
            }),
            "one copy",
        ),
        (
            Box::new(|m| {
                m.split = true;
                m.format = EXPERTS_FORMAT_SPLIT.into();
                m.experts[1].part_offset = 100;
            }),
            "not aligned",
        ),
    ];
    for (edit, want) in cases {
        let mut m = manifest();
        edit(&mut m);
        let p = m.problems().join("; ");
        assert!(p.contains(want), "{want}: {p}");
    }
    // A valid split manifest round-trips.
    let mut m = manifest();
    m.split = true;
    m.format = EXPERTS_FORMAT_SPLIT.into();
    m.experts[1].part_offset = 8192;
    assert!(m.problems().is_empty(), "{:?}", m.problems());
    let text = serde_json::to_string(&m).unwrap();
    assert_eq!(ExpertsManifest::from_json_str(&text).unwrap(), m);
    let mut m = manifest();
    m.format = "k3-experts/0".into();
    let e = ExpertsManifest::from_json_str(&serde_json::to_string(&m).unwrap()).unwrap_err();
    assert!(e.to_string().contains("re-run"), "{e}");
}

/// A set of directories must be exactly one pack: a missing stripe, a stripe given
/// twice and a directory of another pack are each refused and named.
#[test]
fn directories_must_make_one_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, m: &ExpertsManifest| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(EXPERTS_JSON), serde_json::to_vec(m).unwrap()).unwrap();
        std::fs::write(d.join(EXPERTS_BIN), vec![0u8; m.file_size as usize]).unwrap();
        d
    };
    let one = write("one", &manifest());
    let mut m0 = manifest();
    m0.stripe = 0;
    m0.experts[0].expert = 0;
    m0.experts[1].expert = 2;
    let zero = write("zero", &m0);
    let mut other = m0.clone();
    other.pack_id = "ef".repeat(32);
    let other = write("other", &other);
    let p = PackedExperts::open(&[one.clone(), zero.clone()]).unwrap();
    assert_eq!(p.dirs, vec![zero.clone(), one.clone()], "ordered by stripe");
    assert_eq!(p.locations().len(), 4);
    let e = PackedExperts::open(std::slice::from_ref(&one)).unwrap_err();
    assert!(matches!(e, ExpertsError::MissingStripes { ref missing, .. } if missing == &[0]));
    let e = PackedExperts::open(&[one.clone(), one.clone()]).unwrap_err();
    assert!(matches!(e, ExpertsError::SameStripe { .. }), "{e}");
    let e = PackedExperts::open(&[zero.clone(), other, one.clone()]).unwrap_err();
    assert!(matches!(e, ExpertsError::OtherPack { .. }), "{e}");
    let e = PackedExperts::open(&[tmp.path().join("nope")]).unwrap_err();
    assert!(e.to_string().contains("no such directory"), "{e}");
    let e = PackedExperts::open(&[tmp.path().to_path_buf()]).unwrap_err();
    assert!(e.to_string().contains("no experts.json"), "{e}");
    // A truncated data file is refused by its size.
    std::fs::write(one.join(EXPERTS_BIN), [0u8; 10]).unwrap();
    let e = PackedExperts::open(&[zero, one]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
}
