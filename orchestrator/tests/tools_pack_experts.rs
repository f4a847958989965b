//! `k3-orch pack-experts`: the routed experts one aligned run each, striped over several
//! directories, byte-identical to the shards, resumable, verifiable; a run with
//! `--experts DIR,...` gives the same ids as one that reads the shards, and refuses a pack
//! that is not whole or not of this checkpoint. A drive that fails mid-run exits 4.

use std::path::{Path, PathBuf};

use crate::tools_common::{fixtures, k3, k3_ok};
use k3_model::experts::{ExpertsManifest, PackedExperts};

const IDS: &str = "77,198,74";

fn tiny() -> PathBuf {
    fixtures().join("tiny-mxfp4/sharded")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `n` fresh directories under `root`, named `d0`...
fn dirs(root: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let d = root.join(format!("d{i}"));
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .collect()
}

fn pack(model: &Path, to: &[PathBuf], extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["pack-experts", s(model), "--to"];
    args.extend(to.iter().map(|d| s(d)));
    args.extend(extra);
    k3(&args)
}

/// The ids of a staged run of the tiny model, with `extra` flags.
fn ids(extra: &[&str]) -> String {
    let model = tiny();
    let mut args = vec![s(&model), "--ids", IDS, "--gen", "4"];
    args.extend(extra);
    k3_ok(&args)
}

fn join(to: &[PathBuf]) -> String {
    to.iter().map(|d| s(d)).collect::<Vec<_>>().join(",")
}

/// Every expert of every directory is exactly its run of the shard (copied from the
/// manifest's source, checked against the shard's bytes), aligned and zero-padded, and
/// the directories' bytes differ by at most one expert. Catches a packer that copies the
/// aligned source window, drops or repeats an expert, or stripes unevenly.
fn check_pack(to: &[PathBuf]) {
    let p = PackedExperts::open(to).unwrap();
    let mut n = 0;
    for (dir, m) in p.dirs.iter().zip(&p.manifests) {
        let bin = std::fs::read(dir.join("experts.bin")).unwrap();
        assert_eq!(bin.len() as u64, m.file_size);
        for x in &m.experts {
            assert_eq!(x.offset % 4096, 0);
            let shard = std::fs::read(tiny().join(&x.shard)).unwrap();
            let (a, b) = (
                x.source_offset as usize,
                (x.source_offset + x.length) as usize,
            );
            let run = &bin[x.offset as usize..(x.offset + x.length) as usize];
            assert!(run == &shard[a..b], "layer {} expert {}", x.layer, x.expert);
            let pad = &bin[(x.offset + x.length) as usize..(x.offset + x.padded_length()) as usize];
            assert!(pad.iter().all(|&b| b == 0));
            n += 1;
        }
    }
    if p.split() {
        // One part of each expert per directory (the tiny model's experts span 2 pages).
        assert_eq!(n, p.manifests[0].total_experts * 2.min(p.dirs.len()));
    } else {
        assert_eq!(n, p.manifests[0].total_experts * p.copies());
    }
    let bytes: Vec<u64> = p.manifests.iter().map(|m| m.file_size).collect();
    let largest = p
        .manifests
        .iter()
        .flat_map(|m| &m.experts)
        .map(|x| x.padded_length())
        .max()
        .unwrap();
    let (lo, hi) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
    assert!(hi - lo <= largest, "unbalanced: {bytes:?}");
}

/// `project --json` of the tiny model over the pack in `to` (one drive a directory, the
/// machine's figures given).
fn project_json(to: &[PathBuf]) -> String {
    k3_ok(&[
        "project",
        s(&tiny()),
        "--experts",
        &join(to),
        "--drives",
        &to.len().to_string(),
        "--drive-gbps",
        "1",
        "--mem-gbps",
        "10",
        "--gmacs-per-core",
        "1",
        "--json",
    ])
}

/// Packed over 1, 2 and 3 directories, the run gives the shards' ids; a re-run of the
/// packer has nothing to do and `--verify` passes.
#[test]
fn packs_and_runs_with_the_same_ids_over_one_two_and_three_directories() {
    let want = ids(&[]);
    let tmp = tempfile::tempdir().unwrap();
    for n in 1..=3 {
        let to = dirs(&tmp.path().join(format!("n{n}")), n);
        let (code, out, err) = pack(&tiny(), &to, &[]);
        assert_eq!(code, 0, "{out}{err}");
        check_pack(&to);
        assert_eq!(ids(&["--experts", &join(&to)]), want, "{n} directories");
        let (code, out, err) = pack(&tiny(), &to, &["--verify"]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("nothing to pack"), "{out}");
        assert!(out.contains("verify: OK"), "{out}");
    }
}

/// `--copies 2` over 2 and 3 directories: every expert in two of them (check_pack counts
/// both copies, each byte-identical to the shard), the run gives the shards' ids and
/// `--verify` passes, and `project` projects the pack's copies. More copies than
/// directories is refused (exit 2). A pack that lost one copy of an expert from a manifest
/// is refused by the run (exit 2), naming the expert: catches a reader that trusts the
/// first copy it finds.
#[test]
fn copies_pack_and_run_with_the_same_ids() {
    let want = ids(&[]);
    let tmp = tempfile::tempdir().unwrap();
    for n in 2..=3 {
        let to = dirs(&tmp.path().join(format!("c{n}")), n);
        let (code, out, err) = pack(&tiny(), &to, &["--copies", "2", "--verify"]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("2 copies of each"), "{out}");
        assert!(out.contains("verify: OK"), "{out}");
        check_pack(&to);
        let p = PackedExperts::open(&to).unwrap();
        assert_eq!(p.copies(), 2);
        assert!(p.locations().values().all(|l| l.len() == 2));
        assert_eq!(ids(&["--experts", &join(&to)]), want, "{n} directories");
        // `project` takes the copies from the pack.
        let json = project_json(&to);
        assert!(json.contains("\"copies\":2"), "{json}");
    }
    let to = dirs(&tmp.path().join("c2"), 2);
    let (code, _, err) = pack(&tiny(), &to, &["--copies", "3"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--copies 3 needs at least 3 directories"),
        "{err}"
    );
    // Drop the last expert of directory 1 (its manifest stays self-consistent).
    let mut m = ExpertsManifest::load_dir(&to[1]).unwrap();
    let x = m.experts.pop().unwrap();
    m.file_size = x.offset;
    m.total_bytes -= x.length;
    std::fs::write(to[1].join("experts.json"), serde_json::to_vec(&m).unwrap()).unwrap();
    let bin = std::fs::OpenOptions::new()
        .write(true)
        .open(to[1].join("experts.bin"))
        .unwrap();
    bin.set_len(x.offset).unwrap();
    let (code, _, err) = k3(&[s(&tiny()), "--ids", IDS, "--experts", &join(&to)]);
    assert_eq!(code, 2, "{err}");
    let who = format!(
        "layer {} expert {} is in 1 of the directories",
        x.layer, x.expert
    );
    assert!(err.contains(&who), "{err}");
}

/// `--split` over 2 and 3 directories: every expert cut into page-aligned parts, one a
/// directory (`check_pack`: each part byte-identical to its range of the shard), and the
/// run's first logits bit-identical to the shards' run, its ids the same: catches a fetcher
/// that reads every part from the first part's file, or puts a part at another place in
/// the slot (the expert's second page would be another expert's bytes). `--verify`
/// passes, `project` takes the split from the pack, `--split` with `--copies` is refused
/// (exit 2), a part moved in its manifest is refused by the run naming the expert (exit
/// 2), and a failing drive exits 4 naming it.
#[test]
fn split_packs_run_with_the_same_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let logits = |name: &str, extra: &[&str]| {
        let f = tmp.path().join(name);
        let model = tiny();
        let mut args = vec![
            s(&model),
            "--ids",
            IDS,
            "--gen",
            "4",
            "--dump-logits",
            s(&f),
        ];
        args.extend(extra);
        let ids = k3_ok(&args);
        (ids, std::fs::read(&f).unwrap())
    };
    let want = logits("shards.f32", &[]);
    for n in 2..=3 {
        let to = dirs(&tmp.path().join(format!("s{n}")), n);
        let (code, out, err) = pack(&tiny(), &to, &["--split", "--verify"]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains("each split"), "{out}");
        assert!(out.contains("verify: OK"), "{out}");
        check_pack(&to);
        let p = PackedExperts::open(&to).unwrap();
        assert!(p.split());
        assert!(p
            .locations()
            .values()
            .all(|l| l.len() == 2 && l[1].part_offset == 4096));
        let got = logits(&format!("split{n}.f32"), &["--experts", &join(&to)]);
        assert_eq!(got.0, want.0, "{n} directories: ids");
        assert!(got.1 == want.1, "{n} directories: logits differ");
        let json = project_json(&to);
        assert!(json.contains("\"stripe_balance\":1.0"), "{json}");
    }
    let to = dirs(&tmp.path().join("s2"), 2);
    let (code, _, err) = pack(&tiny(), &to, &["--split", "--copies", "2"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--copies"), "{err}");
    exits_4_naming_the_drive(&to);
    // Directory 1's first part claims to start a page later in its expert.
    let mut m = ExpertsManifest::load_dir(&to[1]).unwrap();
    m.experts[0].part_offset += 4096;
    let who = format!(
        "layer {} expert {}",
        m.experts[0].layer, m.experts[0].expert
    );
    std::fs::write(to[1].join("experts.json"), serde_json::to_vec(&m).unwrap()).unwrap();
    let (code, _, err) = k3(&[s(&tiny()), "--ids", IDS, "--experts", &join(&to)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&who), "{err}");
}

/// Interrupted after 5 experts per directory (exit 1, no manifest: not a usable pack), a
/// re-run resumes there and ends with the same files as a pack done in one go. Catches a
/// packer that commits early, restarts from scratch, or misplaces the resumed experts.
#[test]
fn resumes_an_interrupted_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let to = dirs(&tmp.path().join("a"), 2);
    let (code, out, err) = pack(&tiny(), &to, &["--stop-after-experts", "5"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(!to[0].join("experts.json").exists());
    let (code, _, err) = k3(&[s(&tiny()), "--ids", IDS, "--experts", &join(&to)]);
    assert_eq!(code, 2, "an unfinished pack is refused: {err}");
    let (code, out, err) = pack(&tiny(), &to, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("resuming: 5 of"), "{err}");
    let fresh = dirs(&tmp.path().join("b"), 2);
    let (code, out, err) = pack(&tiny(), &fresh, &[]);
    assert_eq!(code, 0, "{out}{err}");
    for (a, b) in to.iter().zip(&fresh) {
        let (x, y) = (
            std::fs::read(a.join("experts.bin")),
            std::fs::read(b.join("experts.bin")),
        );
        assert!(x.unwrap() == y.unwrap(), "{}", a.display());
        let (ma, mb) = (ExpertsManifest::load_dir(a), ExpertsManifest::load_dir(b));
        assert_eq!(ma.unwrap().experts, mb.unwrap().experts);
    }
    check_pack(&to);
}

/// One byte flipped inside an expert's run: `--verify` fails (exit 1) naming the file,
/// layer and expert.
#[test]
fn verify_catches_a_flipped_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let to = dirs(tmp.path(), 2);
    k3_ok(&["pack-experts", s(&tiny()), "--to", s(&to[0]), s(&to[1])]);
    let m = ExpertsManifest::load_dir(&to[1]).unwrap();
    let x = &m.experts[3];
    let path = to[1].join("experts.bin");
    let mut bin = std::fs::read(&path).unwrap();
    bin[(x.offset + x.length / 2) as usize] ^= 0x10;
    std::fs::write(&path, &bin).unwrap();
    let (code, out, err) = pack(&tiny(), &to, &["--verify"]);
    assert_eq!(code, 1, "{out}{err}");
    let want = format!("layer {} expert {}: sha256 mismatch", x.layer, x.expert);
    assert!(err.contains(&want), "{err}");
}

/// Refused up front (exit 2), naming the directory: a missing one, a read-only one, one
/// given twice, and one holding another checkpoint's pack.
#[test]
fn refuses_bad_directories() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let to = dirs(tmp.path(), 2);
    let missing = tmp.path().join("not-mounted");
    let (code, _, err) = pack(&tiny(), &[to[0].clone(), missing.clone()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("{}: no such directory", missing.display())),
        "{err}"
    );
    let (code, _, err) = pack(&tiny(), &[to[0].clone(), to[0].clone()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the same directory"), "{err}");
    let ro = tmp.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let (code, _, err) = pack(&tiny(), &[to[0].clone(), ro.clone()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("{} is read-only", ro.display())),
        "{err}"
    );
    assert!(
        !to[0].join("experts.bin.partial").exists(),
        "nothing written"
    );
}

/// A pack of another checkpoint (same headers, other data): the packer refuses to
/// overwrite it without --force, and a run refuses it (exit 2); a run given only some of a
/// pack's directories is refused too, naming the missing stripe.
#[test]
fn refuses_a_foreign_or_partial_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let s7 = tmp.path().join("s7");
    k3_ok(&["synth", "--shape", "tiny", "--seed", "7", s(&s7)]);
    let to = dirs(&tmp.path().join("p"), 2);
    let (code, out, err) = pack(&s7, &to, &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = pack(&tiny(), &to, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("packed from another checkpoint"), "{err}");
    let (code, _, err) = k3(&[s(&tiny()), "--ids", IDS, "--experts", &join(&to)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("packed from another checkpoint"), "{err}");
    assert!(err.contains("same header, other data"), "{err}");
    let (code, _, err) = k3(&[s(&s7), "--ids", IDS, "--experts", s(&to[1])]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stripe 0 not given"), "{err}");
}

/// A staged run of `gen` tokens over the pack in `to`, every read of `failing` (a pack
/// directory) failing through the test hook.
fn run_failing(to: &[PathBuf], failing: &Path, gen: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_k3-orch"))
        .args([
            s(&tiny()),
            "--ids",
            IDS,
            "--gen",
            gen,
            "--experts",
            &join(to),
        ])
        .env("K3_TEST_HOOKS", "1")
        .env("K3_INJECT_DRIVE_FAILURE", failing)
        .output()
        .unwrap()
}

/// A run over the pack in `to` whose second directory fails every read exits 4 and names
/// the drive.
fn exits_4_naming_the_drive(to: &[PathBuf]) {
    let out = run_failing(to, &to[1], "2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(
        err.contains("(device "),
        "the failure must name the drive: {err}"
    );
}

/// A drive that fails while the run reads it (every read of one pack directory fails,
/// through the test hook): exit 4, and the failure names the drive. Catches a failure
/// that is silent (exit 0 with other ids) or ends the run without its report (exit 1).
#[test]
fn a_failing_drive_exits_4_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let to = dirs(tmp.path(), 2);
    k3_ok(&["pack-experts", s(&tiny()), "--to", s(&to[0]), s(&to[1])]);
    exits_4_naming_the_drive(&to);
}

/// A failing pack directory under a pack with two copies of each expert (the first
/// copy's directory, which every read goes to when both directories share a drive, as
/// here): the run reads around it (exit 0, the shards' ids) and says what failed. Catches
/// copies that are never used when a drive fails, and a failover that reads the wrong
/// bytes.
#[test]
fn a_failing_drive_is_read_around_with_copies() {
    let want = ids(&[]);
    let tmp = tempfile::tempdir().unwrap();
    let to = dirs(tmp.path(), 2);
    k3_ok(&[
        "pack-experts",
        s(&tiny()),
        "--copies",
        "2",
        "--to",
        s(&to[0]),
        s(&to[1]),
    ]);
    let out = run_failing(&to, &to[0], "4");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), want, "{err}");
    assert!(
        err.contains("failed a read"),
        "the failover must be said: {err}"
    );
}

/// `doctor --experts` measures every drive the weights sit on: a pack in /dev/shm (tmpfs,
/// another device than the fixture's) makes two, each named, and the projection uses
/// their sum. Catches a doctor that measures only the model's drive.
#[test]
fn doctor_measures_each_drive() {
    use std::os::unix::fs::MetadataExt;
    let shm = Path::new("/dev/shm");
    let same = std::fs::metadata(shm)
        .and_then(|a| std::fs::metadata(tiny()).map(|b| a.dev() == b.dev()))
        .unwrap_or(true);
    if same {
        return crate::tools_common::skip(
            "doctor_measures_each_drive",
            "no /dev/shm on another device than the fixtures",
        );
    }
    let tmp = tempfile::tempdir_in(shm).unwrap();
    k3_ok(&["pack-experts", s(&tiny()), "--to", s(tmp.path())]);
    let out = k3_ok(&[
        "doctor",
        s(&tiny()),
        "--experts",
        s(tmp.path()),
        "--seconds",
        "0.2",
    ]);
    assert_eq!(out.matches("drive      :").count(), 2, "{out}");
    assert!(out.contains("of 2 drives measured"), "{out}");
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted (lazily) when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// None when this process may not mount (not root).
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (src, target, fstype, opts) = (
            c("k3-test-tmpfs"),
            c(s(dir.path())),
            c("tmpfs"),
            c(&format!("size={size}")),
        );
        // SAFETY: every pointer is a NUL-terminated string alive for the call.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        (r == 0).then_some(Tmpfs { dir })
    }

    /// Change its size in place.
    fn resize(&self, size: &str) {
        let target = std::ffi::CString::new(s(self.dir.path())).unwrap();
        let opts = std::ffi::CString::new(format!("size={size}")).unwrap();
        // SAFETY: every pointer is a NUL-terminated string (or null) alive for the call.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(r, 0, "remount: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(s(self.dir.path())).unwrap();
        // SAFETY: `target` is a NUL-terminated path alive for the call.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Issue 35: a directory whose file system cannot take its share of the experts is
/// refused up front (exit 2, naming it and the sizes) before anything is written, here a
/// 256 KiB tmpfs beside a roomy directory; the same tmpfs grown to 64 MiB takes its share
/// (the refusal is the free space's, not the directory's). Catches a packer without the
/// check (it fails on ENOSPC mid-pack, exit 1, after writing the other directory: checked
/// by removing `check_room`) and one that refuses a directory with room.
#[test]
fn refuses_a_directory_too_full_for_its_share() {
    let Some(fs) = Tmpfs::mount("256k") else {
        return crate::tools_common::skip(
            "refuses_a_directory_too_full_for_its_share",
            "cannot mount a tmpfs (needs root)",
        );
    };
    let tmp = tempfile::tempdir().unwrap();
    let roomy = dirs(tmp.path(), 1).remove(0);
    let full = fs.dir.path().to_path_buf();
    let (code, _, err) = pack(&tiny(), &[roomy.clone(), full.clone()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("{} is too full", full.display()))
            && err.contains("its share of the experts needs"),
        "{err}"
    );
    for d in [&roomy, &full] {
        for f in ["experts.bin.partial", "experts.bin", "experts.json"] {
            assert!(!d.join(f).exists(), "{}/{f} was written", d.display());
        }
    }
    fs.resize("64m");
    let (code, _, err) = pack(&tiny(), &[roomy.clone(), full.clone()], &[]);
    assert_eq!(code, 0, "{err}");
    check_pack(&[roomy, full]);
}
