//! Generation on the command line with a tokenizer (`synth --shape tiny-chat`): text
//! streamed to stdout and nothing else there, sampling recorded and deterministic across
//! process modes, a random seed printed and recorded, stop strings.

use crate::tools_common::{k3_cmd, tiny_chat_model as model};
use serde_json::Value;

/// Run a generation; (stdout, stderr, report).
fn gen(extra: &[&str]) -> (String, String, Value) {
    let m = model().to_str().unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let o = k3_cmd()
        .args([
            m,
            "--tok",
            m,
            "--prompt",
            "Hello there",
            "--gen",
            "8",
            "--incremental",
        ])
        .args(["--threads", "1", "--out", out.path().to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8(o.stdout).unwrap(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert!(o.status.success(), "{extra:?}\n{se}");
    let rep: Value = serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap();
    (so, se, rep)
}

#[test]
fn stdout_is_the_text_and_seeded_sampling_is_the_same_in_every_mode() {
    let s = [
        "--temp", "0.8", "--top-k", "50", "--min-p", "0.01", "-s", "3",
    ];
    let (text, err, rep) = gen(&s);
    assert_eq!(format!("{}\n", rep["text"].as_str().unwrap()), text);
    assert!(err.contains("STEP"), "the step table goes to stderr: {err}");
    assert_eq!(rep["sampling"]["seed"], 3);
    assert_eq!(rep["sampling"]["mode"], "sample");
    assert_eq!(rep["sampling"]["top_k"], 50);
    for mode in ["--inproc", "--single-process"] {
        let mut args = s.to_vec();
        args.push(mode);
        let (t, _, r) = gen(&args);
        assert_eq!(t, text, "{mode}");
        assert_eq!(r["generated_ids"], rep["generated_ids"], "{mode}");
    }
    // --quiet keeps the text and drops the diagnostics.
    let mut q = s.to_vec();
    q.push("-q");
    let (t, e, _) = gen(&q);
    assert_eq!(t, text);
    assert!(!e.contains("STEP"), "{e}");
    // Sampling greedy-free without a seed: a random one, printed and recorded.
    let (_, e, r) = gen(&["--top-k", "50"]);
    let seed = r["sampling"]["seed"].as_u64().unwrap();
    assert!(
        e.contains(&format!("sampling with seed {seed} (random)")),
        "{e}"
    );
    assert_eq!(r["sampling"]["seed_given"], false);
    assert_eq!(r["sampling"]["temperature"], 1.0);
}

#[test]
fn a_stop_string_cuts_the_text_and_the_ids() {
    let (full, _, rep) = gen(&[]);
    let full = full.trim_end_matches('\n').to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 8, "{full:?}");
    let stop: String = chars[5..7].iter().collect();
    let at = full.find(&stop).unwrap();
    for mode in [&[][..], &["--single-process"][..]] {
        let mut args = vec!["--stop", stop.as_str()];
        args.extend_from_slice(mode);
        let (t, _, r) = gen(&args);
        assert_eq!(t, format!("{}\n", &full[..at]), "{mode:?}");
        let n = r["generated_ids"].as_array().unwrap().len();
        assert!(
            n < rep["generated_ids"].as_array().unwrap().len(),
            "{mode:?}"
        );
        assert_eq!(
            r["generated_ids"].as_array().unwrap()[..],
            rep["generated_ids"].as_array().unwrap()[..n]
        );
        assert_eq!(r["sampling"]["stop"][0], stop.as_str());
    }
}

// Catches: a K3_PROFILE that prints nothing, misses a phase, or changes a result (the
// profile is observation only: the ids and the text must equal the run without it). One
// line per forward call: the prompt's, then one per decode step after the first token.
#[test]
fn the_phase_profile_prints_one_line_per_forward_call_and_changes_nothing() {
    for mode in [&[][..], &["--single-process"][..]] {
        let (text0, _, rep0) = gen(mode);
        let m = model().to_str().unwrap();
        let out = tempfile::NamedTempFile::new().unwrap();
        let o = k3_cmd()
            .env("K3_PROFILE", "1")
            .args([m, "--tok", m, "--prompt", "Hello there", "--gen", "8"])
            .args(["--incremental", "--threads", "1"])
            .args(["--out", out.path().to_str().unwrap()])
            .args(mode)
            .output()
            .unwrap();
        assert!(o.status.success(), "{mode:?}");
        let se = String::from_utf8_lossy(&o.stderr);
        let lines: Vec<&str> = se.lines().filter(|l| l.contains("k3 profile:")).collect();
        let rep: Value = serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap();
        let steps = rep["steps"].as_array().unwrap().len();
        assert_eq!(lines.len(), steps, "{mode:?}: one line per step\n{se}");
        for l in &lines {
            for p in [
                "total",
                "attn",
                "router",
                "shared",
                "experts",
                "expert-wait",
                "combine",
                "dense-ffn",
                "head",
                "other",
            ] {
                assert!(l.contains(&format!(" {p} ")), "{mode:?}: no {p} in {l}");
            }
        }
        assert_eq!(rep["generated_ids"], rep0["generated_ids"], "{mode:?}");
        assert_eq!(String::from_utf8(o.stdout).unwrap(), text0, "{mode:?}");
    }
}

// Catches: a read floor (`K3_FLOOR=1`) that reads other bytes than one decode token
// multiplies (the token embedding too, every routed expert, or none), probes the prompt's
// step, or changes a result. The byte count is summed here from the checkpoint's headers:
// every tensor but the routed experts and the embedding, the lm_head, and top-k experts'
// worth of every MoE layer (expert 0's size: experts are all one size).
#[test]
fn the_read_floor_reads_one_decode_tokens_weights_and_changes_nothing() {
    use k3_model::catalog::Catalog;
    use k3_model::classify::{classify, split_expert, TensorClass};
    let (text0, _, rep0) = gen(&["--single-process"]);
    let m = model();
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(m.join("config.json")).unwrap()).unwrap();
    let tc = cfg.get("text_config").unwrap_or(&cfg);
    let top_k = tc["num_experts_per_token"].as_u64().unwrap();
    let cat = Catalog::open(m).unwrap();
    let (mut fixed, mut expert0) = (0u64, std::collections::BTreeMap::new());
    for (name, e) in cat.iter() {
        match classify(&name) {
            TensorClass::RoutedExpert => {
                let (l, x, _) = split_expert(&name).unwrap();
                if x == 0 {
                    *expert0.entry(l).or_insert(0u64) += e.len;
                }
            }
            TensorClass::Embedding if !name.contains("lm_head") => {}
            TensorClass::Vision => {}
            _ => fixed += e.len,
        }
    }
    assert!(!expert0.is_empty(), "the tiny model has routed experts");
    let want = fixed + top_k * expert0.values().sum::<u64>();
    let out = tempfile::NamedTempFile::new().unwrap();
    let ms = m.to_str().unwrap();
    let o = k3_cmd()
        .env("K3_FLOOR", "1")
        .args([ms, "--tok", ms, "--prompt", "Hello there", "--gen", "8"])
        .args(["--incremental", "--threads", "1", "--single-process"])
        .args(["--out", out.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success());
    let se = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = se.lines().filter(|l| l.contains("k3 floor:")).collect();
    let rep: Value = serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap();
    let steps = rep["steps"].as_array().unwrap().len();
    assert_eq!(
        lines.len(),
        steps - 1,
        "one line per decode step after the first\n{se}"
    );
    for (i, l) in lines.iter().enumerate() {
        assert!(
            l.contains(&format!("step {} read {want} bytes in ", i + 1)),
            "{l} (want {want} bytes)"
        );
    }
    assert_eq!(rep["generated_ids"], rep0["generated_ids"]);
    assert_eq!(String::from_utf8(o.stdout).unwrap(), text0);
}

// The report's prefill line (issue 32): the prompt's tokens (here the chat template's,
// counted from the report's own prompt ids), the first step's time and reads, and the
// product path. Catches a prefill that counts the generated tokens, or the whole run's
// time instead of the first step's, or names another path than K3_SIMD selects.
#[test]
fn the_report_has_the_prefill_line() {
    let (_, err, rep) = gen(&[]);
    let p = &rep["prefill"];
    let prompt = rep["prompt_ids"].as_array().unwrap().len() as u64;
    assert_eq!(p["tokens"].as_u64(), Some(prompt), "{p}");
    assert_eq!(p["seconds"], rep["steps"][0]["seconds"], "{p}");
    let tps = p["tokens_per_second"].as_f64().unwrap();
    let want = prompt as f64 / p["seconds"].as_f64().unwrap();
    assert!((tps - want).abs() <= 1e-9 * want, "{tps} vs {want}");
    assert!(err.contains("prefill: "), "{err}");
    let out = tempfile::NamedTempFile::new().unwrap();
    let m = model().to_str().unwrap();
    let o = k3_cmd()
        .env("K3_SIMD", "portable")
        .args([
            m,
            "--ids",
            "1,2,3,4,5",
            "--gen",
            "2",
            "--threads",
            "1",
            "--out",
        ])
        .arg(out.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rep: Value = serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap();
    assert_eq!(rep["prefill"]["tokens"], 5);
    assert_eq!(rep["prefill"]["product_path"], "exact/portable");
}
