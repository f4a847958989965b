//! `k3-orch project`, the projection in `doctor` and `--list-presets`: the released geometry
//! built in memory equals the one read from the released headers, the output names the plan,
//! the per-token bytes and the floor, says it is a projection, and bad figures exit 2;
//! doctor advises `--mem-gb` at what the machine can spare and a text prompt.

use crate::tools_common::{k3, k3_ok, released_headers, tiny_chat_model};
use k3_orch::tools::project::{project, Machine, ModelShape};

/// The flags that fix every machine figure (nothing is measured; the output is exact).
const GIVEN: [&str; 8] = [
    "--drive-gbps",
    "7",
    "--mem-gbps",
    "50",
    "--gmacs-per-core",
    "10",
    "--cores",
    "16",
];

/// The shape `project` builds from `k3_model::released` without files is the one it reads
/// from the released headers (`synth --shape released --headers-only`), field for field,
/// and projects the same. Catches a tensor list and a catalog path that drift apart (a
/// trunk tensor counted in one only, experts' MACs from the packed bytes, the model-level
/// norms left out of the plan's fixed part).
#[test]
fn the_released_shape_is_the_released_headers() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("released");
    released_headers(&d);
    let mut from_headers = ModelShape::from_dir(&d).unwrap();
    let built = ModelShape::released();
    from_headers.label = built.label.clone();
    assert_eq!(format!("{from_headers:?}"), format!("{built:?}"));
    let m = Machine::reference(2);
    let a = project(&from_headers, 100_000_000_000, &m).unwrap();
    let b = project(&built, 100_000_000_000, &m).unwrap();
    assert_eq!(a.times, b.times);
    // The CLI on the headers says the same as without them.
    let dir = d.to_str().unwrap();
    let mut args = vec!["project", dir, "--ram-gb", "64"];
    args.extend(GIVEN);
    let on_disk = k3_ok(&args);
    let mut args = vec!["project", "--ram-gb", "64"];
    args.extend(GIVEN);
    let in_memory = k3_ok(&args);
    let tail = |s: &str| s.lines().skip(2).collect::<Vec<_>>().join("\n");
    assert_eq!(tail(&on_disk), tail(&in_memory));
}

/// One budget: the plan (pinned, streamed, cached), the bytes per token from disk and RAM,
/// the MACs, the projected s/token with its floor and the word "projection". Several
/// budgets or drive counts: one table row each, and the striping note for more than one
/// drive. At 512 GB on 4 drives it is faster than at 64 GB on one.
#[test]
fn project_prints_the_plan_the_bytes_and_the_floor() {
    let mut args = vec!["project", "--ram-gb", "128"];
    args.extend(GIVEN);
    let out = k3_ok(&args);
    for key in [
        "PROJECTION",
        "pinned   :",
        "streamed :",
        "cached   :",
        "expected hit rate",
        "flat routing",
        "disk     :",
        "experts missed",
        "memory   :",
        "compute  :",
        "projected:",
        "-bound",
        "1 drive x 7.00 GB/s (given)",
    ] {
        assert!(out.contains(key), "no {key:?} in\n{out}");
    }
    let mut args = vec!["project", "--ram-gb", "64,512", "--drives", "1,4"];
    args.extend(GIVEN);
    let out = k3_ok(&args);
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.trim_start().starts_with("64.0") || l.trim_start().starts_with("512.0"))
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    let s = |row: &str| -> f64 {
        row.split_whitespace()
            .rev()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(s(rows[3]) < s(rows[0]), "{out}");
    assert!(out.contains("striped"), "{out}");
}

/// `--experts DIR,..`: the drives the packs sit on are measured and summed, a drive counted
/// once however many directories it holds (two directories on this test's one file system
/// are one drive), `--drives` follows from them; a directory without `experts.bin` is
/// refused with exit 2, naming it. Catches drives counted per directory (two drives'
/// bandwidth from one disk) and a missing pack projected at an assumed speed.
#[test]
fn project_sums_the_drives_of_experts_dirs() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    for d in [&a, &b] {
        std::fs::create_dir(d).unwrap();
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i >> 12) as u8).collect();
        std::fs::write(d.join("experts.bin"), bytes).unwrap();
    }
    let dirs = format!("{},{}", a.display(), b.display());
    let args = [
        "project",
        "--ram-gb",
        "64",
        "--experts",
        &dirs,
        "--seconds",
        "0.05",
        "--mem-gbps",
        "50",
        "--gmacs-per-core",
        "10",
        "--cores",
        "16",
    ];
    let out = k3_ok(&args);
    let machine = out.lines().find(|l| l.starts_with("machine")).unwrap();
    assert!(machine.contains("machine : 1 drive x"), "{out}");
    assert!(machine.contains("experts"), "{out}");
    assert!(!out.contains("striped"), "{out}");
    let missing = tmp.path().join("none");
    let dirs = format!("{},{}", a.display(), missing.display());
    let (code, _, err) = k3(&["project", "--experts", &dirs]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
}

#[test]
fn project_refuses_bad_figures() {
    for bad in [
        &["project", "--ram-gb", "0"][..],
        &["project", "--drives", "0"],
        &["project", "--drive-gbps", "-1"],
        &["project", "--cores", "0"],
        &["project", "/nonexistent/model"],
        &["project", "--probe-file", "/nonexistent/file"],
    ] {
        let (code, _, err) = k3(bad);
        assert_eq!(code, 2, "{bad:?}: {err}");
    }
    // Below the streaming floor the plan refuses, and says so.
    let mut args = vec!["project", "--ram-gb", "0.5"];
    args.extend(GIVEN);
    assert!(k3_ok(&args).contains("refused"));
}

/// `--list-presets` shows each preset's memory and k3's own projected s/token (marked as
/// such), never the seed engine's figures.
#[test]
fn list_presets_shows_k3s_projection() {
    let out = k3_ok(&["--list-presets"]);
    for name in ["laptop", "desktop", "workstation", "server", "max", "auto"] {
        assert!(out.contains(name), "{name}\n{out}");
    }
    assert!(out.contains("PROJECTED"), "{out}");
    assert_eq!(out.matches("s/token (disk-bound)").count(), 5, "{out}");
    assert!(out.contains("holds"), "{out}");
    // The seed's figures (laptop ~32, server ~19-21 s/token; 8.2 GB peak RSS) are gone.
    for seed in ["~32 s/token", "19-21", "8.2 GB peak", "seed"] {
        assert!(!out.contains(seed), "{seed}\n{out}");
    }
}

/// Doctor projects s/token for this machine and advises `--mem-gb` at what it can spare
/// (not a preset), with a text prompt and a `chat` command when the model has its
/// tokenizer; the figures given on its command line are used.
#[test]
fn doctor_projects_and_advises_mem_gb_and_a_text_prompt() {
    let m = tiny_chat_model().to_str().unwrap();
    let (code, out, err) = k3(&[
        "doctor",
        "--seconds",
        "0",
        "--drive-gbps",
        "3",
        "--mem-gbps",
        "20",
        "--gmacs-per-core",
        "5",
        m,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let projected = out
        .lines()
        .find(|l| l.starts_with("projected"))
        .unwrap_or_else(|| panic!("no projection\n{out}"));
    assert!(projected.contains("per token at --mem-gb"), "{projected}");
    assert!(out.contains("PROJECTION"), "{out}");
    assert!(!out.contains("--preset laptop"), "{out}");
    let next: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("next")).collect();
    assert!(next.iter().any(|l| l.contains("-p \"")), "{out}");
    assert!(next.iter().any(|l| l.contains("k3-orch chat")), "{out}");
    assert!(next.iter().all(|l| !l.contains("--ids")), "{out}");
    let mem_gb = out
        .split("give a run --mem-gb ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no --mem-gb advice\n{out}"));
    assert!(next[0].contains(&format!("--mem-gb {mem_gb}")), "{out}");
    let avail: f64 = out
        .split("available ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let spare: f64 = mem_gb.parse().unwrap();
    assert!(
        spare <= avail * 0.9 + 0.05 && spare >= avail * 0.9 - 0.2,
        "{spare} of {avail}"
    );
}
