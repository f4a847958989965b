//! End-to-end: `k3-orch replay` re-runs every stage of the committed recordings
//! (tests/fixtures/recordings, made with `--record`, see its README) and finds them
//! identical; a recording with one inbound message changed, or with a flipped byte, fails.
//!
//! Replays run from the repository root, because the recorded `Configure` messages name
//! the model by its path relative to it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k3_protocol::messages::{self, Msg};
use k3_protocol::record::{read_recording, recording_path, Entry, Recorder};

const STAGES: [&str; 4] = [
    "tokenizer",
    "trunk-loader",
    "expert-fetcher",
    "layer-compute",
];
const MODELS: [&str; 2] = ["tiny-mxfp4", "tiny-seed"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn recordings() -> PathBuf {
    root().join("tests/fixtures/recordings")
}

fn replay(dir: &Path, stage: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3-orch"))
        .current_dir(root())
        .arg("replay")
        .arg(dir)
        .args(["--stage", stage])
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every stage of both tiny models replays identically. A stage whose outputs depended on
/// anything outside its inbound messages and buffers (wall clock in a compared field, a
/// random seed, arrival order of experts summed in a different order) fails here.
#[test]
fn every_stage_of_both_models_replays_identically() {
    for m in MODELS {
        let dir = recordings().join(m);
        for s in STAGES {
            let o = replay(&dir, s);
            let t = text(&o);
            assert!(o.status.success(), "{m} {s}: {t}");
            assert!(
                t.contains(&format!("replay {s}: ")) && t.contains("messages identical"),
                "{m} {s}: {t}"
            );
            // Something was compared (a replay that checks nothing would pass trivially).
            let n: usize = t
                .split(&format!("replay {s}: "))
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            assert!(n >= 3, "{m} {s}: only {n} messages compared: {t}");
        }
    }
}

/// Rewrite `stage`'s recording into `out` with `change` applied to the first inbound frame
/// it accepts (chain hashes recomputed, so only the replay comparison can catch it).
fn mutate(src: &Path, out: &Path, stage: &str, change: impl Fn(&Msg) -> Option<Msg>) {
    let rec = read_recording(&recording_path(src, stage), true).unwrap();
    let mut w = Recorder::create(out, stage, rec.bytes_kept).unwrap();
    let mut changed = false;
    for e in &rec.entries {
        match e {
            Entry::Inbound { channel, frame } => {
                let mut f = frame.clone();
                if !changed {
                    if let Some(m) = messages::decode(frame).ok().and_then(|m| change(&m)) {
                        f = messages::encode(&m).unwrap();
                        changed = true;
                    }
                }
                w.inbound(channel, &f).unwrap();
            }
            Entry::Outbound { channel, frame } => w.outbound(channel, frame).unwrap(),
            Entry::BufferRead { handle, bytes, .. } => {
                let b = bytes.clone().expect("mutation tests need kept bytes");
                w.buffer_read(handle, &b).unwrap()
            }
        }
    }
    w.finish().unwrap();
    assert!(changed, "{stage}: nothing to mutate");
}

/// A different id in one `DecodeId` (tokenizer), or a different prompt in layer-compute's
/// `Configure`: the stage's answer changes and the replay must FAIL naming the entry and
/// channel. A replay that only checked message counts or kinds passes these
/// wrongly.
#[test]
fn a_mutated_inbound_message_fails_the_replay() {
    let src = recordings().join("tiny-mxfp4");
    let tmp = tempfile::tempdir().unwrap();
    mutate(&src, tmp.path(), "tokenizer", |m| match m {
        Msg::DecodeId { id } => Some(Msg::DecodeId { id: id ^ 1 }),
        _ => None,
    });
    let o = replay(tmp.path(), "tokenizer");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains("FAIL") && t.contains("entry") && t.contains("control"),
        "{t}"
    );

    let tmp2 = tempfile::tempdir().unwrap();
    mutate(&src, tmp2.path(), "layer-compute", |m| match m {
        Msg::Configure { json } if json.contains("\"prompt_ids\":[1,2,3,4]") => {
            Some(Msg::Configure {
                json: json.replace("\"prompt_ids\":[1,2,3,4]", "\"prompt_ids\":[1,2,3,5]"),
            })
        }
        _ => None,
    });
    let o = replay(tmp2.path(), "layer-compute");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL") && t.contains("entry"), "{t}");
}

/// A flipped byte in the file is caught by the chain hash before anything runs.
#[test]
fn a_modified_file_is_refused() {
    let src = recordings().join("tiny-mxfp4");
    let tmp = tempfile::tempdir().unwrap();
    let p = recording_path(&src, "tokenizer");
    let mut b = std::fs::read(&p).unwrap();
    let n = b.len();
    b[n / 2] ^= 0x40;
    std::fs::write(recording_path(tmp.path(), "tokenizer"), &b).unwrap();
    let o = replay(tmp.path(), "tokenizer");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("chain hash") || t.contains("malformed"), "{t}");
}

#[test]
fn usage_errors_exit_2() {
    let o = replay(&recordings().join("tiny-mxfp4"), "orchestrator");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_k3-orch"))
        .args(["replay"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}
